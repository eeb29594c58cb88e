"""ThreadGovernor: the intra-op thread count of the engine thread's next step, chosen by the
measured time of the steps before it.

The CPU plan (dlm/engine/cpu_plan.py) times the model once and never gives a forward team
every core: a team of all cores runs a step faster only while every core is free. On this
project's 2-core VM the 104M model's step took 50 ms with one thread and 31 ms with two on a
quiet machine, yet a two-thread team ran 9-57x slower than one thread as soon as other
processes wanted a core (libgomp's team meets at a barrier in every parallel region, and a
descheduled teammate holds the whole region for a time slice). Whether the machine is quiet
changes by the minute, so no load-time measurement can decide it.

The governor keeps two candidates, `base` (the plan's count) and `team` (every core), and the
recent per-token cost of each (step seconds / canvas tokens fed to the forward) per batch-size
class (`size_class`: a small batch costs more per token, so only steps of like size compare).
It runs at one of them ("home") and now and then probes the other for `PROBE_STEPS` steps,
each compared with home's recent cost at its own size (a probe step of a size home has no
cost for ends the probe undecided, and the next step at home of a known size starts it again):

- it moves home when the probed count's median cost beats home's by `SPEEDUP` (hysteresis:
  within it the counts are as fast, and `base` leaves cores to other work);
- at home on `team`, one step `COLLAPSE` times home's recent median moves home to `base` at
  once; a probe of `team` is cut short by the same rule after its first slow step;
- a probe of `team` that lost cost time (its steps over home's median cost): the next waits
  until home has run `1 / PROBE_SHARE` times that long, so a loaded machine pays at most
  `PROBE_SHARE` of its time for probes however steep the cliff. Probes of `base` cost
  nothing and come every `PROBE_EVERY` steps.

Decisions depend only on the seconds and tokens given to `observe` (no clock of its own), so
tests drive it with made-up timings. Thread counts are per thread in OpenMP: the caller
applies `threads` (cpu_plan.apply_threads) on the thread that runs the forwards, before each
step; setting it takes microseconds and the next parallel region uses the new team.
"""

from __future__ import annotations

import logging
import statistics
from collections import deque

import torch

from dlm.engine import cpu_plan

log = logging.getLogger("dlm.engine")

WINDOW = 8  # recent per-token costs kept per count
MIN_SAMPLES = 3  # a count's median is trusted from this many steps
PROBE_STEPS = 3
PROBE_EVERY = 32  # steps at home between probes that cost nothing
SPEEDUP = 1.15  # a probed count must beat home's median cost by this factor
COLLAPSE = 2.0  # a team step this many times its recent median means the cores are taken
PROBE_SHARE = 0.05  # the share of time lost to probes of the team, at most


def size_class(tokens: int) -> int:
    """The batch-size class of a step of `tokens` canvas tokens: powers of two. Costs per token
    compare only within a class: a step of one 59-token canvas cost 4.6x a step of eight per
    token on the 104M model (the weights are read once per step whatever the batch), so a
    probe step at the tail of a batch looked like a collapse of the team."""
    return max(1, tokens).bit_length()


class ThreadGovernor:
    def __init__(self, base: int, team: int) -> None:
        if not 1 <= base < team:
            raise ValueError(f"a governor needs base < team threads, got {base} and {team}")
        self.base, self.team = base, team
        self.home = base
        # Recent per-token costs, per thread count and size class.
        self.costs: dict[int, dict[int, deque[float]]] = {base: {}, team: {}}
        # The probe in progress: per step, its size class, cost and home's median cost at that size.
        self._probe: list[tuple[int, float, float]] | None = None
        self._probe_lost = 0.0  # seconds the current probe lost against home's median
        self._home_steps = 0  # steps at home since the last probe
        self._home_seconds = 0.0  # seconds at home since the last probe
        self._owed = 0.0  # home seconds due before the next team probe
        self.switches = 0  # changes of home, for reports

    @property
    def probing(self) -> bool:
        return self._probe is not None

    @property
    def threads(self) -> int:
        """The count the next step runs with."""
        return self._other if self._probe is not None else self.home

    @property
    def _other(self) -> int:
        return self.team if self.home == self.base else self.base

    def _median(self, threads: int, size: int) -> float | None:
        costs = self.costs[threads].get(size, ())
        return statistics.median(costs) if len(costs) >= MIN_SAMPLES else None

    def _record(self, threads: int, size: int, cost: float) -> None:
        self.costs[threads].setdefault(size, deque(maxlen=WINDOW)).append(cost)

    def observe(self, seconds: float, tokens: int) -> None:
        """The step just run with `threads` took `seconds` over `tokens` canvas tokens."""
        cost, size = seconds / max(1, tokens), size_class(tokens)
        if self._probe is not None:
            self._observe_probe(cost, size, seconds, tokens)
            return
        median = self._median(self.home, size)
        if self.home == self.team and median is not None and cost > COLLAPSE * median:
            self._move(self.base)  # the cores are taken: back at once
            self.costs[self.team].clear()  # its costs were those of a quiet machine
            self._owed = (seconds - median * tokens) / PROBE_SHARE  # and it is not tried again soon
            return
        self._record(self.home, size, cost)
        self._home_steps += 1
        self._home_seconds += seconds
        if self._home_steps >= PROBE_EVERY and self._home_seconds >= self._owed and median is not None:
            self._probe, self._probe_lost = [], 0.0

    def _observe_probe(self, cost: float, size: int, seconds: float, tokens: int) -> None:
        assert self._probe is not None
        probed, home = self._other, self._median(self.home, size)
        if home is None:  # a batch size home has no recent cost for: nothing to compare with,
            self._probe = None  # so no verdict, and the next step at home of a known size starts it again
            return
        self._probe_lost += max(0.0, seconds - home * tokens)
        self._probe.append((size, cost, home))
        collapsed = probed == self.team and cost > COLLAPSE * home
        if not collapsed and len(self._probe) < PROBE_STEPS:
            return
        ratio = statistics.median(c / h for _, c, h in self._probe)  # probed cost over home's, like for like
        won = not collapsed and ratio * SPEEDUP <= 1
        log.debug(
            "thread governor: %d threads probed at %.2fx home's per-token cost (%d threads)%s",
            probed,
            ratio,
            self.home,
            ", collapsed" if collapsed else "",
        )
        self.costs[probed].clear()
        for probe_size, probe_cost, _ in self._probe:
            self._record(probed, probe_size, probe_cost)
        lost = self._probe_lost if probed == self.team else 0.0
        self._probe = None
        if won:
            self._move(probed)
        else:
            self._home_steps, self._home_seconds = 0, 0.0
            self._owed = lost / PROBE_SHARE

    def _move(self, threads: int) -> None:
        log.debug("thread governor: %d -> %d intra-op threads", self.home, threads)
        self.home = threads
        self.switches += 1
        self._probe = None
        self._home_steps, self._home_seconds, self._owed = 0, 0.0, 0.0


def for_plan(planned: int | None) -> ThreadGovernor | None:
    """A governor between the plan's threads and every core (torch's default count), where
    they differ; None where there is nothing to choose (no plan: not a CPU, or one core)."""
    every = cpu_plan.default_threads()
    return None if planned is None or planned >= every else ThreadGovernor(planned, every)


def governs_by_default(shape: cpu_plan.ModelShape | None, dtype: torch.dtype, planned: int | None) -> bool:
    """Whether a model runs governed when `--thread-governor` is not given: where the plan
    leaves a team to choose (`for_plan`) and this CPU's kernels give a forward of the model's
    shape the same bits with either count (`cpu_plan.team_exact`), so that switching changes
    how fast an answer comes and never the answer. `shape` None: no native layers to check."""
    every = cpu_plan.default_threads()
    if shape is None or planned is None or planned >= every:
        return False
    return cpu_plan.team_exact(shape, dtype, planned, every)


def why_no_governor(distributed: bool, device_type: str, planned: int | None) -> str:
    """Why `--thread-governor` has nothing to govern (`for_plan` gave None, or the model runs
    over tensor-parallel ranks): said by the server's log and `dlm generate`, so the flag is
    never silently without effect."""
    if distributed:
        return "each tensor-parallel rank runs its forwards with the CPU plan's threads"
    if device_type != "cpu":
        return f"the forwards run on {device_type}; it chooses CPU threads"
    if planned is None:
        return "this model has no CPU thread plan (the transformers backend)"
    return f"the CPU plan already gives the forwards every core ({cpu_plan.default_threads()})"
