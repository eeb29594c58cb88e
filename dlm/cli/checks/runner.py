"""Named checks, their results, and the loop that runs them in order.

A check is a function of the shared `Context` that returns a one-line detail or raises
`CheckFailed`. A check may name others it needs: when one of those did not pass it is
skipped rather than failed, so a wrong key shows as one failing `auth` check instead of a
wall of failures with the same cause.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from dlm.cli.client.api import ApiClient, error_message

PASSED, FAILED, SKIPPED = "passed", "failed", "skipped"


class CheckFailed(Exception):
    """The server did not meet the check's expectation; the message says how."""


class CheckSkipped(Exception):
    """The check does not apply to this server (e.g. key checks on a server without keys)."""


@dataclass
class CheckResult:
    name: str
    status: str
    seconds: float
    detail: str

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "status": self.status, "seconds": round(self.seconds, 3), "detail": self.detail}


@dataclass
class ValidateOptions:
    model: str | None = None
    max_tokens: int = 16
    ready_timeout: float = 60.0
    burst: int = 32
    min_context: int | None = None  # require the server to accept prompts this long
    client_timeout: float = 0.01  # the "tiny timeout" of the abnormal-path check


@dataclass
class Context:
    """What the checks share: the client, the options, and facts learned on the way."""

    client: ApiClient
    options: ValidateOptions
    model: str = ""
    max_context: int | None = None  # as advertised by /v1/models (`max_model_len`)
    facts: dict[str, Any] = field(default_factory=dict)
    # a line for the person waiting (what a check waits for, and how long it may), beside the results
    note: Callable[[str], None] = lambda line: None


@dataclass(frozen=True)
class Check:
    name: str
    run: Callable[[Context], str]
    needs: tuple[str, ...] = ()


def expect_status(response: httpx.Response, expected: int, what: str) -> None:
    if response.status_code != expected:
        raise CheckFailed(f"{what}: HTTP {response.status_code} (expected {expected}): {error_message(response)}")


def json_body(response: httpx.Response, what: str) -> Any:
    """The answer's JSON, declared as such: clients (and proxies) go by the content-type, so a
    JSON body sent as text/plain is a failure too, not a pass."""
    media = response.headers.get("content-type", "").split(";")[0].strip().lower()
    if media != "application/json" and not media.endswith("+json"):
        raise CheckFailed(f"{what}: content-type is {media or 'missing'!r}, not application/json")
    try:
        return response.json()
    except ValueError:
        raise CheckFailed(f"{what}: body is not JSON: {response.text[:80]!r}") from None


def run_checks(
    ctx: Context,
    checks: list[Check],
    on_result: Callable[[CheckResult], None] | None = None,
    on_start: Callable[[str], None] | None = None,
) -> list[CheckResult]:
    """Run the checks in order; a check never stops the run, whatever the server does."""
    results: dict[str, CheckResult] = {}
    for check in checks:
        if on_start:
            on_start(check.name)
        start = time.perf_counter()
        blocked = [n for n in check.needs if n in results and results[n].status != PASSED]
        if blocked:
            status, detail = SKIPPED, f"needs {', '.join(blocked)}"
        else:
            try:
                status, detail = PASSED, check.run(ctx)
            except CheckFailed as exc:
                status, detail = FAILED, str(exc)
            except CheckSkipped as exc:
                status, detail = SKIPPED, str(exc)
            except httpx.TimeoutException as exc:
                status, detail = FAILED, f"timed out ({type(exc).__name__})"
            except httpx.HTTPError as exc:
                status, detail = FAILED, f"{type(exc).__name__}: {exc}"
            except Exception as exc:  # noqa: BLE001 - a malformed answer is a failed check, not a crash
                status, detail = FAILED, f"unexpected answer ({type(exc).__name__}: {exc})"
        result = CheckResult(check.name, status, time.perf_counter() - start, detail)
        results[check.name] = result
        if on_result:
            on_result(result)
    return list(results.values())
