"""`dlm validate URL`: acceptance checks of a running server, for humans and CI."""

from __future__ import annotations

from pathlib import Path

import typer

from dlm.cli.http_options import CACERT_OPTION, INSECURE_OPTION, URL_ARGUMENT, check_model_id
from dlm.cli.output import cli_errors, emit_json, err_console, writable_file
from dlm.cli.paths import path_value


def validate(
    url: str = URL_ARGUMENT,
    api_key: str | None = typer.Option(
        None,
        "--api-key",
        envvar="DLM_API_KEY",
        help="Bearer key for the server (also checks that a missing or wrong key gets 401).",
        show_default="none",
    ),
    model: str | None = typer.Option(
        None, "--model", help="Model id to check.", show_default="the first of /v1/models"
    ),
    suite: Path | None = typer.Option(
        None,
        "--suite",
        help="YAML file of prompts with expectations, or `default-model`: the embedded default model's "
        "known answers (see docs/validate.md).",
        show_default="none",
        parser=path_value,
    ),
    junit_xml: Path | None = typer.Option(
        None, "--junit-xml", help="Also write the results as JUnit XML.", show_default="none", parser=path_value
    ),
    ready_timeout: float = typer.Option(60.0, "--ready-timeout", help="Seconds to wait for /ready."),
    timeout: float = typer.Option(60.0, "--timeout", help="Seconds allowed for each request."),
    max_tokens: int = typer.Option(16, "--max-tokens", help="max_tokens of the check requests."),
    burst: int = typer.Option(32, "--burst", help="Concurrent requests of the burst check."),
    min_context: int | None = typer.Option(
        None, "--min-context", help="Fail unless prompts of this many tokens are served.", show_default="none"
    ),
    skip: list[str] = typer.Option([], "--skip", help="Check to leave out (repeatable).", show_default="none"),
    cacert: Path | None = CACERT_OPTION,
    insecure: bool = INSECURE_OPTION,
    json_out: bool = typer.Option(False, "--json", help="Print the results as JSON on stdout."),
) -> None:
    """Check a running server against the HTTP contract; exit 1 if any check fails."""
    with cli_errors():
        from dlm.cli.checks.report import render_table, to_json, write_junit
        from dlm.cli.checks.runner import FAILED, ValidateOptions
        from dlm.cli.checks.suite import load_suite
        from dlm.cli.checks.validate import run_validation
        from dlm.cli.client.api import checked_url, finite_seconds, tls_verify
        from dlm.engine.errors import DlmError, UsageError

        if max_tokens < 1 or burst < 1:
            raise UsageError("--max-tokens and --burst must be >= 1")
        if min_context is not None and min_context < 1:  # 0 read as "not given", -5 checked a 1-token prompt
            raise UsageError(f"--min-context must be >= 1, got {min_context}")
        check_model_id(model)
        finite_seconds(timeout, "--timeout")
        finite_seconds(ready_timeout, "--ready-timeout", allow_zero=True)
        checked_url(url)
        verify = tls_verify(cacert, insecure)
        if junit_xml is not None:  # before any check runs, so their results are never lost
            writable_file("--junit-xml", junit_xml)
        options = ValidateOptions(
            model=model, max_tokens=max_tokens, ready_timeout=ready_timeout, burst=burst, min_context=min_context
        )
        loaded = load_suite(suite) if suite else None
        with err_console.status("validating") as status:
            results = run_validation(
                url,
                options,
                api_key=api_key,
                timeout=timeout,
                suite=loaded,
                skip=tuple(skip),
                on_start=lambda name: status.update(f"check [bold]{name}[/]"),
                on_note=lambda line: err_console.print(line, highlight=False, markup=False),
                verify=verify,
            )
        if junit_xml:
            write_junit(results, url, junit_xml)
        render_table(results, url, err_console)  # human text on stderr in both modes (docs/cli.md)
        if json_out:
            emit_json(to_json(results, url))
        failed = [r.name for r in results if r.status == FAILED]
        if failed:
            raise DlmError(f"{len(failed)} of {len(results)} checks failed: {', '.join(failed)}")
