"""PNG plots of a load test: latency percentiles and throughput against concurrency.

Matplotlib's Agg backend renders without a display (CI machines have none). Every value
axis starts at zero (a throughput that moves from 6.4 to 9.6 tok/s must not look like a
collapse), each level is labelled with its sample count, and the legend sits outside the
axes so it hides no point.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def plot_levels(levels: list[dict[str, Any]], knee: int | None, out: Path) -> list[Path]:
    """Write latency.png and throughput.png; mark the knee when there is one."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    users = [level["users"] for level in levels]
    written = []

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for metric, style in (("e2e", "-"), ("ttft", "--")):
        for p, marker in (("p50", "o"), ("p95", "s"), ("p99", "^")):
            values = [level[f"{p}_{metric}"] for level in levels]
            if any(v is not None for v in values):
                ax.plot(
                    users,
                    [v if v is not None else float("nan") for v in values],
                    style,
                    marker=marker,
                    label=f"{p} {metric}",
                )
    ax.set(xlabel="concurrent users", ylabel="seconds", title="Latency against concurrency")
    _finish(fig, [ax], knee, levels)
    written.append(_save(fig, out / "latency.png"))

    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.plot(users, [level["output_tokens_per_s"] for level in levels], "-o", label="output tokens/s")
    ax.set(xlabel="concurrent users", ylabel="output tokens/s", title="Throughput against concurrency")
    twin = ax.twinx()
    twin.plot(users, [level["rps"] for level in levels], "--s", color="tab:orange", label="requests/s")
    twin.plot(users, [level["goodput_rps"] for level in levels], ":^", color="tab:green", label="goodput requests/s")
    twin.set_ylabel("requests/s")
    _finish(fig, [ax, twin], knee, levels)
    written.append(_save(fig, out / "throughput.png"))
    return written


def _finish(fig: Any, axes: list[Any], knee: int | None, levels: list[dict[str, Any]]) -> None:
    """Concurrency on a log2 axis (sweeps usually double), ticked at the levels run and
    labelled with each level's sample count; value axes from zero; one legend outside."""
    users = [level["users"] for level in levels]
    ax = axes[0]
    ax.set_xscale("log", base=2)
    ax.set_xticks(users, [f"{level['users']}\n(n={level['ok']})" for level in levels])
    if knee is not None:
        ax.axvline(knee, color="grey", linestyle=":", label=f"knee ({knee} users)")
    ax.grid(alpha=0.3)
    handles, labels = [], []
    for axis in axes:
        axis.set_ylim(0, axis.get_ylim()[1] * 1.08)  # from zero, with room above the highest point
        h, lab = axis.get_legend_handles_labels()
        handles += h
        labels += lab
    fig.tight_layout()
    # Right of the figure (saved with bbox_inches="tight", so the image grows to hold it).
    fig.legend(handles, labels, loc="center left", bbox_to_anchor=(1.0, 0.5), frameon=False)


def _save(fig: Any, path: Path) -> Path:
    from matplotlib import pyplot as plt

    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)
    return path
