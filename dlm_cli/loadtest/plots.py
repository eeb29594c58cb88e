"""PNG plots of a load test: latency percentiles and throughput against concurrency.

Matplotlib's Agg backend renders without a display (CI machines have none).
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
    _finish(ax, knee, users)
    written.append(_save(fig, out / "latency.png"))

    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.plot(users, [level["output_tokens_per_s"] for level in levels], "-o", label="output tokens/s")
    ax.set(xlabel="concurrent users", ylabel="output tokens/s", title="Throughput against concurrency")
    twin = ax.twinx()
    twin.plot(users, [level["rps"] for level in levels], "--s", color="tab:orange", label="requests/s")
    twin.plot(users, [level["goodput_rps"] for level in levels], ":^", color="tab:green", label="goodput requests/s")
    twin.set_ylabel("requests/s")
    twin.legend(loc="lower right")
    _finish(ax, knee, users)
    written.append(_save(fig, out / "throughput.png"))
    return written


def _finish(ax: Any, knee: int | None, users: list[int]) -> None:
    """Concurrency on a log2 axis (sweeps usually double), ticked at the levels run."""
    ax.set_xscale("log", base=2)
    ax.set_xticks(users, [str(u) for u in users])
    if knee is not None:
        ax.axvline(knee, color="grey", linestyle=":", label=f"knee ({knee} users)")
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left")


def _save(fig: Any, path: Path) -> Path:
    from matplotlib import pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
