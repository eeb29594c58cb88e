"""`dlm loadtest URL`: locust-driven load, a concurrency sweep, thresholds for CI."""

from __future__ import annotations

import math
import time
from pathlib import Path

import typer
from rich.markup import escape

from dlm.cli.http_options import CACERT_OPTION, INSECURE_OPTION, URL_ARGUMENT, check_model_id
from dlm.cli.loadtest.sweep import MIN_SAMPLES
from dlm.cli.output import cli_errors, emit_json, err_console, writable_dir
from dlm.cli.paths import path_value
from dlm.engine.home import dlm_home

SERVERS = "the server's"  # a dLLM field left out of the requests: the server's default applies


def loadtest(
    url: str = URL_ARGUMENT,
    users: int = typer.Option(4, "--users", "-u", help="Concurrent users of a fixed run."),
    spawn_rate: float | None = typer.Option(
        None, "--spawn-rate", "-r", help="Users started per second.", show_default="all at once"
    ),
    duration: str = typer.Option("30s", "--duration", "-t", help="Run time of each level, ramp-up included (30s, 2m)."),
    sweep: str | None = typer.Option(
        None,
        "--sweep",
        help="Concurrency levels to run in turn, e.g. 1,2,4,8: reports the knee.",
        show_default="none: one level of --users",
    ),
    out: Path | None = typer.Option(
        None,
        "--out",
        help="Output directory (outside any checkout by default).",
        show_default="$DLM_HOME/loadtest/<time>",
        parser=path_value,
    ),
    prompts: str = typer.Option(
        "auto",
        "--prompts",
        help="JSONL of {prompt|messages, fields...}, or a named set: tasks (the default model's task "
        "prompts), builtin (general questions), auto (tasks when the server serves the default model, "
        "else builtin).",
    ),
    model: str | None = typer.Option(None, "--model", help="Model id.", show_default="the first of /v1/models"),
    api_key: str | None = typer.Option(
        None, "--api-key", envvar="DLM_API_KEY", help="Bearer key for the server.", show_default="none"
    ),
    timeout: float = typer.Option(120.0, "--timeout", help="Seconds allowed for each request."),
    max_tokens: int = typer.Option(64, "--max-tokens", help="max_tokens of each request."),
    fixed_length: bool = typer.Option(
        False,
        "--fixed-length",
        help="Every answer exactly --max-tokens long (a prompts file line's own max_tokens where it sets one): "
        "sends ignore_eos and min_tokens = max_tokens (vLLM's fields, as vLLM's bench and aiperf fix output "
        "lengths), so EOS cannot end an answer early.",
    ),
    temperature: float = typer.Option(0.0, "--temperature", help="Sampling temperature."),
    steps: int | None = typer.Option(None, "--steps", help="dLLM: denoising steps.", show_default=SERVERS),
    block_length: int | None = typer.Option(None, "--block-length", help="dLLM: block length.", show_default=SERVERS),
    remasking: str | None = typer.Option(
        None, "--remasking", help="dLLM: low_confidence or random.", show_default=SERVERS
    ),
    threshold: float | None = typer.Option(
        None, "--threshold", help="dLLM: parallel-decoding threshold.", show_default=SERVERS
    ),
    cache: str | None = typer.Option(None, "--cache", help="dLLM: none|prefix|dual|block.", show_default=SERVERS),
    decode_mode: str | None = typer.Option(None, "--decode-mode", help="dLLM: diffusion|ar.", show_default=SERVERS),
    slo: str | None = typer.Option(
        None, "--slo", help='Goodput bounds per request, e.g. "ttft<=1s,e2e<=10s".', show_default="none"
    ),
    fail_on: str | None = typer.Option(
        None, "--fail-on", help='Exit 1 when any holds, e.g. "p95_e2e>5s,error_rate>1%".', show_default="none"
    ),
    cacert: Path | None = CACERT_OPTION,
    insecure: bool = INSECURE_OPTION,
    json_out: bool = typer.Option(False, "--json", help="Print the summary as JSON on stdout."),
    result_format: str = typer.Option(
        "dlm",
        "--format",
        help="What --json prints: dlm (the summary) or vllm (`vllm bench serve --save-result` keys, one object "
        "per level, plus a diffusion section). Both are always written to the output directory.",
    ),
    min_samples: int = typer.Option(
        MIN_SAMPLES, "--min-samples", help="Successful requests a level needs before a knee is named from it."
    ),
) -> None:
    """Load-test a running server with locust (headless) and report latency, throughput, knee."""
    with cli_errors():
        # dlm.cli.loadtest.run imports locust, which monkey-patches sockets and ssl for gevent:
        # every TLS context is made after these imports.
        from dlm.cli.client.api import checked_url, finite_seconds, tls_verify
        from dlm.cli.loadtest.plots import plot_levels
        from dlm.cli.loadtest.report import finalize, live_table, render_summary, write_summary
        from dlm.cli.loadtest.run import LoadPlan, run_loadtest
        from dlm.cli.loadtest.stats import GATE_METRICS
        from dlm.cli.loadtest.sweep import check_ramps, parse_levels
        from dlm.cli.loadtest.thresholds import parse_conditions, parse_seconds, parse_slo
        from dlm.cli.loadtest.workload import check_request_fields, from_prompts
        from dlm.engine.errors import DlmError, UsageError

        if result_format not in ("dlm", "vllm"):
            raise UsageError(f"--format must be dlm or vllm, got {result_format!r}")
        if min_samples < 1:
            raise UsageError("--min-samples must be >= 1")
        if users < 1 or max_tokens < 1:
            raise UsageError("--users and --max-tokens must be >= 1")
        finite_seconds(timeout, "--timeout")
        if spawn_rate is not None and (not math.isfinite(spawn_rate) or spawn_rate <= 0):
            raise UsageError(f"--spawn-rate must be a finite number > 0, got {spawn_rate}")
        url = checked_url(url)
        levels = parse_levels(sweep) if sweep is not None else [users]  # "" is no sweep: refused
        seconds = parse_seconds(duration, "--duration")
        check_ramps(levels, spawn_rate, seconds)
        slo_bounds = parse_slo(slo or "")
        thresholds = parse_conditions(fail_on or "", GATE_METRICS, "--fail-on")
        # An empty value ('', ',', an unset "$VAR") is no request for the default: a gate that
        # checks nothing, or the first model of /v1/models, passes where the script meant a check.
        for flag, given, parsed in (("--slo", slo, slo_bounds), ("--fail-on", fail_on, thresholds)):
            if given is not None and not parsed:
                raise UsageError(f"{flag} names no condition, got {given!r} (leave the option out for none)")
        check_model_id(model)
        dllm = {
            "steps": steps,
            "block_length": block_length,
            "remasking": remasking,
            "threshold": threshold,
            "cache": cache,
            "decode_mode": decode_mode,
        }
        fields = {
            "max_tokens": max_tokens,
            "temperature": temperature,
            **{k: v for k, v in dllm.items() if v is not None},
        }
        check_request_fields(fields)  # before the load: a value every request would be refused for
        workload = from_prompts(prompts, fields, model, fixed_length=fixed_length)
        directory = out or dlm_home() / "loadtest" / time.strftime("%Y%m%d-%H%M%S")
        writable_dir("--out", directory)  # before the load: its results would have nowhere to go
        verify = tls_verify(cacert, insecure)
        plan = LoadPlan(
            url, levels, seconds, spawn_rate, workload, directory, api_key, timeout, tuple(slo_bounds), verify
        )

        from rich.live import Live

        with Live(console=err_console, auto_refresh=False, transient=True) as live:
            result, vllm = run_loadtest(plan, on_tick=lambda tick: live.update(live_table(tick), refresh=True))
        summary = finalize(result, thresholds, slo_bounds, min_samples)
        knee = summary["knee"]["users"] if summary["knee"] else None
        plots = [p.name for p in plot_levels(summary["levels"], knee, directory)]
        summary["files"] = sorted({*(p.name for p in directory.iterdir()), *plots, "summary.json"})
        write_summary(summary, directory)
        if summary["interrupted"]:  # Ctrl-C: what was measured, where it is, then exit 130
            render_summary(summary, err_console)
            err_console.print(f"results so far in {escape(str(directory))}/", highlight=False, soft_wrap=True)
            raise KeyboardInterrupt
        if summary["totals"]["ok"] == 0:
            if not summary["totals"]["requests"]:
                raise DlmError(
                    f"no request finished in {seconds:g}s (the server accepted them and never answered in "
                    f"time; --timeout {timeout:g}s); results in {directory}/"
                )
            top = summary["top_errors"][0]
            raise DlmError(
                f"no request succeeded (errors by status: {summary['totals']['errors_by_status']}; "
                f"{top['requests']} of them: {top['error']}); results in {directory}/"
            )
        # Human text on stderr in both modes (docs/cli.md): a --json run's warnings and the
        # reason it failed are not only in summary.json.
        render_summary(summary, err_console)
        err_console.print(f"results in {escape(str(directory))}/: {', '.join(summary['files'])}", highlight=False)
        if json_out:
            emit_json(summary if result_format == "dlm" else (vllm if len(vllm) > 1 else vllm[0]))
        if not summary["passed"]:
            raise DlmError(f"threshold exceeded: {'; '.join(summary['violations'])}")
