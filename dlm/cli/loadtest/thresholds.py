"""Conditions on summary metrics: `--fail-on "p95_e2e>5s,error_rate>1%"` and `--slo`.

Both flags speak the same small language (metric, comparison, quantity with a unit), so it
is parsed in one place. Quantities are normalised to seconds and fractions.
"""

from __future__ import annotations

import math
import operator
import re
from collections.abc import Callable
from dataclasses import dataclass

from dlm.engine.errors import UsageError

UNITS = {"": 1.0, "s": 1.0, "ms": 1e-3, "us": 1e-6, "%": 0.01}
OPERATORS: dict[str, Callable[[float, float], bool]] = {
    ">=": operator.ge,
    "<=": operator.le,
    ">": operator.gt,
    "<": operator.lt,
}
# A decimal number (`5`, `0.5`, `.5`, `5.`, `1e-3`): no lone `.` nor `1.2.3`, which float() refuses.
NUMBER = r"(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:e-?[0-9]+)?"
CONDITION = re.compile(rf"^\s*([a-z0-9_]+)\s*(>=|<=|>|<)\s*({NUMBER})\s*(ms|us|s|%)?\s*$")
# Per-request quantities an SLO may bound (seconds).
SLO_METRICS = ("ttft", "tpot", "e2e")
# Metrics that are shares: `%` applies, and error_rate and goodput_fraction are at most 1.
FRACTIONS = ("error_rate", "goodput_fraction", "requests_mismatch", "tokens_mismatch")
AT_MOST_ONE = ("error_rate", "goodput_fraction")
TIME_UNITS = ("s", "ms", "us")


def check_unit(metric: str, number: float, unit: str, part: str, flag: str) -> None:
    """Refuse a quantity whose unit is not of its metric's kind (`p95_e2e>5%` read as 50 ms,
    `rps>5s` as 5 requests/s) and a bare share above 1 (`error_rate>5` never holds: 5 is 500%;
    5% was meant): each would be a gate other than the one written, silently."""
    allowed: tuple[str, ...]
    if metric.rsplit("_", 1)[-1] in SLO_METRICS:
        kind, allowed = "a time", TIME_UNITS
    elif metric in FRACTIONS:
        kind, allowed = "a share", ("%",)
    else:
        kind, allowed = "a count per request or second", ()
    if unit and unit not in allowed:
        takes = f"give {', '.join(allowed)} or no unit" if allowed else "give a bare number"
        raise UsageError(f"{flag}: {part!r}: {metric} is {kind}, not in {unit!r}; {takes}")
    if metric in AT_MOST_ONE and not unit and number > 1:
        raise UsageError(f"{flag}: {part!r}: {metric} is a share of at most 1; write {number:g}% for percent")


@dataclass(frozen=True)
class Condition:
    metric: str
    op: str
    value: float  # in seconds or a fraction
    text: str
    unit: str = ""  # as the condition wrote its quantity: a measured value is shown in it

    def holds(self, measured: float) -> bool:
        return OPERATORS[self.op](measured, self.value)


DURATION = re.compile(rf"^\s*({NUMBER})\s*(ms|s|m|h)?\s*$")
DURATION_UNITS = {"ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


def parse_seconds(text: str, flag: str) -> float:
    """`30`, `30s`, `2m`, `500ms` -> seconds (locust's -t style)."""
    match = DURATION.match(text)
    seconds = float(match.group(1)) * DURATION_UNITS[match.group(2) or "s"] if match else 0.0
    if not 0 < seconds < math.inf:
        raise UsageError(f"{flag}: expected a positive duration such as 30s or 2m, got {text!r}")
    return seconds


def parse_conditions(text: str, known: tuple[str, ...], flag: str) -> list[Condition]:
    conditions = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        match = CONDITION.match(part)
        if not match:
            raise UsageError(f"{flag}: cannot read {part!r} (expected e.g. p95_e2e>5s)")
        metric, op, number, unit = match.groups()
        if metric not in known:
            raise UsageError(f"{flag}: unknown metric {metric!r}; known: {', '.join(known)}")
        check_unit(metric, float(number), unit or "", part, flag)
        conditions.append(Condition(metric, op, float(number) * UNITS[unit or ""], part, unit or ""))
    return conditions


def parse_slo(text: str) -> list[Condition]:
    """`ttft<=1s,e2e<=10s`: a request is 'good' when it meets every bound."""
    conditions = parse_conditions(text, SLO_METRICS, "--slo")
    if any(c.op not in ("<", "<=") for c in conditions):
        raise UsageError("--slo bounds must be upper limits (< or <=)")
    return conditions


def violations(conditions: list[Condition], measured: dict[str, float | None]) -> list[str]:
    """The fail-on conditions that hold (each one is a reason to fail)."""
    return [
        f"{c.text} (measured {value / UNITS[c.unit]:.4g}{c.unit})"
        for c in conditions
        if (value := measured.get(c.metric)) is not None and c.holds(value)
    ]
