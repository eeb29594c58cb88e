"""Load levels and the knee: where throughput stops rising while latency climbs.

At a closed-loop concurrency c, Little's law ties latency to throughput (latency = c /
throughput), so past saturation each extra user only adds queueing. The knee is the last
level before the first step whose throughput gain is under half of what linear scaling
would give and whose median latency rose: the operating point worth deploying at.
"""

from __future__ import annotations

from typing import Any

from dlm.engine.errors import UsageError

SCALING_FLOOR = 0.5  # below half of linear scaling, the extra users mostly queue
LATENCY_RISE = 1.1  # median latency up by at least 10%
# Fewest successful requests a level needs before its median and throughput mean anything:
# with 2-3 samples a single slow request moves the median by half, and a "knee" is noise.
MIN_SAMPLES = 20


def parse_levels(text: str) -> list[int]:
    """`1,2,4,8` -> [1, 2, 4, 8]: strictly increasing positive user counts."""
    try:
        levels = [int(p) for p in text.split(",") if p.strip()]
    except ValueError:
        raise UsageError(f"--sweep must be comma-separated user counts, got {text!r}") from None
    if len(levels) < 2 or any(n < 1 for n in levels) or levels != sorted(set(levels)):
        raise UsageError(f"--sweep needs at least two increasing positive user counts, got {text!r}")
    return levels


def ramp(before: int, users: int, spawn_rate: float | None) -> float:
    """Seconds locust takes to go from `before` to `users` users at `spawn_rate` per second
    (None: all at once)."""
    return max(0.0, (users - before) / spawn_rate) if spawn_rate else 0.0


def check_ramps(levels: list[int], spawn_rate: float | None, duration: float) -> None:
    """Every level must outlast its ramp-up, or its steady window, where its statistics are
    measured, is empty: in a sweep each level ramps from the one before, so a later level's
    ramp can be the longest."""
    for before, users in zip([0, *levels], levels):
        if ramp(before, users, spawn_rate) >= duration:
            raise UsageError(
                f"--duration must exceed the ramp-up of every level: from {before} to {users} users at "
                f"--spawn-rate {spawn_rate:g} takes {ramp(before, users, spawn_rate):g}s"
            )


def throughput(level: dict[str, Any]) -> float:
    """Output tokens/s where the server reports usage, else requests/s."""
    return level["output_tokens_per_s"] if level["output_tokens"] else level["rps"]


def thin_levels(levels: list[dict[str, Any]], min_samples: int = MIN_SAMPLES) -> list[int]:
    """User counts of the levels with fewer successful requests than `min_samples`."""
    return [level["users"] for level in levels if level["ok"] < min_samples]


def find_knee(levels: list[dict[str, Any]], min_samples: int = MIN_SAMPLES) -> dict[str, Any]:
    """The knee of a sweep (each level: `users` plus its summary), with the reason.

    No knee is named from levels too thin to measure: the reason says which and what to do."""
    thin = thin_levels(levels, min_samples)
    if thin:
        return {
            "users": None,
            "scaling_after": None,
            "reason": f"not measured: levels {', '.join(map(str, thin))} had fewer than {min_samples} "
            "successful requests; run longer (-t) or lower --min-samples",
        }
    for before, after in zip(levels, levels[1:]):
        t0, t1 = throughput(before), throughput(after)
        l0, l1 = before["p50_e2e"], after["p50_e2e"]
        if not t0 or l0 is None or l1 is None:
            continue
        scaling = (t1 / t0 - 1) / (after["users"] / before["users"] - 1)
        if scaling < SCALING_FLOOR and l1 >= l0 * LATENCY_RISE:
            return {
                "users": before["users"],
                "scaling_after": scaling,
                "reason": f"from {before['users']} to {after['users']} users throughput rose "
                f"{(t1 / t0 - 1) * 100:.0f}% ({scaling:.0%} of linear) while median "
                f"latency rose {(l1 / l0 - 1) * 100:.0f}%",
            }
    return {
        "users": None,
        "scaling_after": None,
        "reason": "throughput still scaled at the highest level: extend the sweep",
    }
