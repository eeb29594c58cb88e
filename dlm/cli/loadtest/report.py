"""The verdict and the views of a load test: gate metrics, --fail-on, JSON and rich tables."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rich import box
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from dlm.cli.loadtest.sweep import MIN_SAMPLES, find_knee, thin_levels
from dlm.cli.loadtest.thresholds import Condition, violations

# More empty answers than this share of the successful ones, and the run is called meaningless.
EMPTY_SHARE = 0.5


def gate_level(levels: list[dict[str, Any]], knee: dict[str, Any] | None) -> dict[str, Any]:
    """The level thresholds apply to: the only one, else the knee, else the highest."""
    if knee and knee["users"] is not None:
        return next(level for level in levels if level["users"] == knee["users"])
    return levels[-1]


def finalize(
    result: dict[str, Any], fail_on: list[Condition], slo: list[Condition], min_samples: int = MIN_SAMPLES
) -> dict[str, Any]:
    """Add the knee (for sweeps), sample-count warnings, the gated metrics and the verdict."""
    levels = result["levels"]
    knee = find_knee(levels, min_samples) if len(levels) > 1 else None
    warnings = [
        f"{users} users: fewer than {min_samples} successful requests; its percentiles are rough"
        for users in thin_levels(levels, min_samples)
    ]
    empty, ok = sum(level["empty_answers"] for level in levels), sum(level["ok"] for level in levels)
    if ok and empty > EMPTY_SHARE * ok:
        warnings.insert(
            0,
            f"{empty} of {ok} answers were empty (EOS at once): no first token to time, so TTFT and TPOT "
            "are blank and the knee is that of empty answers; send prompts this model answers "
            "(--prompts tasks for the default model, or a JSONL file)",
        )
    if result.get("interrupted"):
        last = levels[-1]
        warnings.insert(
            0,
            f"interrupted (Ctrl-C) at level {len(levels)}, {last['users']} users, after {last['seconds']:.0f}s of "
            "its steady window: its numbers are partial, and levels after it were not run",
        )
    gate = dict(gate_level(levels, knee))
    agreement = result["server_metrics"]
    for key, name in (("requests", "requests_mismatch"), ("output_tokens", "tokens_mismatch")):
        if agreement.get(key, {}).get("mismatch") is not None:
            gate[name] = agreement[key]["mismatch"]
    failed = violations(fail_on, gate)
    return {
        **result,
        "mode": "sweep" if len(levels) > 1 else "fixed",
        "knee": knee,
        "warnings": warnings,
        "slo": [c.text for c in slo],
        "gate": gate,
        "fail_on": [c.text for c in fail_on],
        "violations": failed,
        "passed": not failed,
    }


def write_summary(summary: dict[str, Any], out: Path) -> Path:
    path = out / "summary.json"
    path.write_text(json.dumps(summary, indent=2) + "\n")
    return path


def _compact(value: float, digits: int) -> str:
    """`value` with at most `digits` decimals, fewer as its integer part grows, so a cell
    stays about five characters wide (12.35, 123.5, 1235): the table fits 80 columns."""
    whole = len(str(int(abs(value))))
    return f"{value:.{max(0, digits - whole + 1)}f}"


def _num(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else _compact(value, digits)


def _ms(value: float | None) -> str:
    """Seconds as milliseconds (a decimal below 10 ms: a diffusion model's TPOT is often under
    one); from 100 s on, as seconds with an `s`."""
    if value is None:
        return "-"
    return _compact(value * 1000, 1) if value < 100 else f"{value:.0f}s"


def level_row(level: dict[str, Any]) -> list[str]:
    return [
        str(level["users"]),
        str(level["ok"]),
        _num(level["rps"]),
        _num(level["output_tokens_per_s"], 1),
        _ms(level["p50_e2e"]),
        _ms(level["p95_e2e"]),
        _ms(level["p99_e2e"]),
        _ms(level["p50_ttft"]),
        _ms(level["p50_tpot"]),
        _num(level["mean_denoising_steps"], 1),
        f"{level['error_rate']:.1%}" if level["error_rate"] < 1 else "100%",
        _num(level["goodput_rps"]),
    ]


COLUMNS = (
    "users",
    "n",  # successful requests measured at this level
    "req\n/s",
    "tok\n/s",
    "e2e\np50",
    "e2e\np95",
    "e2e\np99",
    "ttft\np50",
    "tpot\np50",
    "steps",
    "err",
    "good\n/s",
)


def levels_table(levels: list[dict[str, Any]], title: str) -> Table:
    """One row per level. Columns two spaces apart and cells of about five characters keep the
    table within 80 columns; a narrower terminal folds a cell onto a second line rather than
    cutting it (a cut number reads as another number)."""
    table = Table(
        title=f"{title}; latencies in ms",
        title_justify="left",
        box=box.SIMPLE_HEAD,
        padding=(0, 1),
        collapse_padding=True,
        pad_edge=False,
    )
    for name in COLUMNS:
        table.add_column(name, justify="right", overflow="fold")
    for level in levels:
        table.add_row(*level_row(level))
    return table


def live_table(tick: dict[str, Any]) -> Table:
    """The live view: the running level's numbers so far."""
    return levels_table(
        [tick],
        f"level {tick['level'] + 1}/{tick['levels']}: {tick['users']} users, "
        f"{tick['elapsed']:.0f}/{tick['duration']:.0f}s",
    )


def render_summary(summary: dict[str, Any], console: Console) -> None:
    # the URL and the server's own model id, shown as they are (never read as rich markup)
    title = escape(f"dlm loadtest {summary['url']} ({summary['model']}, prompts: {summary['prompts']})")
    console.print(levels_table(summary["levels"], title))
    errors = summary["totals"]["errors_by_status"]
    if errors:
        console.print(f"errors by status: {', '.join(f'{k}: {v}' for k, v in errors.items())}")
        for top in summary.get("top_errors", []):
            console.print(f"  {top['requests']} x {escape(top['error'])}", highlight=False)
    for warning in summary["warnings"]:  # before the knee: they say what it is worth
        console.print(f"[yellow]warning:[/] {escape(warning)}")
    if summary["knee"]:
        knee = summary["knee"]
        where = f"{knee['users']} users" if knee["users"] is not None else "not reached"
        console.print(f"knee: [bold]{where}[/] ({knee['reason']})")
    agreement = summary["server_metrics"]
    if agreement.get("available"):
        for key in ("requests", "output_tokens"):
            item = agreement[key]
            if item.get("missing"):
                console.print(f"server /metrics lacks {item['counter']}")
            else:
                console.print(
                    f"{key}: client {item['client']:.0f}, server {item['server']:.0f} ({item['mismatch']:.1%} apart)"
                )
    else:
        console.print("server /metrics not readable: no client/server agreement check")
