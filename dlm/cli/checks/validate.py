"""`run_validation`: every check of `dlm validate`, in order, against one server URL."""

from __future__ import annotations

from collections.abc import Callable

from dlm.cli.checks.abnormal import ABNORMAL_CHECKS
from dlm.cli.checks.capabilities import CAPABILITY_CHECKS
from dlm.cli.checks.contract import CONTRACT_CHECKS
from dlm.cli.checks.quality import QUALITY_CHECKS
from dlm.cli.checks.runner import Check, CheckResult, Context, ValidateOptions, run_checks
from dlm.cli.checks.suite import Suite, suite_checks
from dlm.cli.client.api import ApiClient, Verify, checked_url
from dlm.engine.errors import UsageError


def validation_checks(suite: Suite | None = None, skip: tuple[str, ...] = ()) -> list[Check]:
    """Contract and output-quality checks, the advertised capabilities, then the user's suite,
    then abnormal paths (metrics last, after traffic)."""
    checks = (
        CONTRACT_CHECKS + QUALITY_CHECKS + CAPABILITY_CHECKS + (suite_checks(suite) if suite else []) + ABNORMAL_CHECKS
    )
    unknown = sorted(set(skip) - {c.name for c in checks})
    if unknown:
        raise UsageError(f"--skip names no check: {', '.join(unknown)}")
    kept = [c for c in checks if c.name not in skip]
    if not kept:  # a run that checks nothing would pass: a gate that passes any server, none at all too
        raise UsageError("--skip leaves no check to run")
    return kept


def run_validation(
    url: str,
    options: ValidateOptions,
    *,
    api_key: str | None = None,
    timeout: float = 60.0,
    suite: Suite | None = None,
    skip: tuple[str, ...] = (),
    on_start: Callable[[str], None] | None = None,
    on_result: Callable[[CheckResult], None] | None = None,
    on_note: Callable[[str], None] | None = None,
    verify: Verify = True,
) -> list[CheckResult]:
    url = checked_url(url)
    checks = validation_checks(suite, skip)
    with ApiClient(url, api_key, timeout, max_connections=max(100, options.burst), verify=verify) as client:
        ctx = Context(client, options, note=on_note or Context.note)
        return run_checks(ctx, checks, on_result=on_result, on_start=on_start)
