"""The tensor-parallel group this process belongs to, and the collectives the layers use.

A process holds one shard of one model, so which shard it is (rank, group size) is a
process-wide fact, set once before the model is built (`dlm/engine/parallel/distributed.py`) and read by
the parallel layers at construction (to size their shards) and in forward (to reduce).
Outside a group the state is rank 0 of 1: every collective is then the identity and every
layer is exactly the single-process layer.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

MOE_MODES = ("auto", "ep", "tp")


@dataclass(frozen=True)
class TPState:
    rank: int = 0
    size: int = 1
    group: Any = None  # torch.distributed process group of the tensors (NCCL or gloo)
    moe: str = "auto"  # how MoE layers split their experts: auto, ep (experts), tp (rows)


_state = TPState()


def current() -> TPState:
    return _state


def set_state(state: TPState) -> None:
    global _state
    if state.moe not in MOE_MODES:
        raise ValueError(f"moe mode must be one of {', '.join(MOE_MODES)}, not {state.moe!r}")
    _state = state


@contextmanager
def using(state: TPState) -> Iterator[TPState]:
    """Build (or run) under `state`, then restore the previous one."""
    previous = _state
    set_state(state)
    try:
        yield state
    finally:
        set_state(previous)


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum `x` over the group in place and return it (identity outside a group)."""
    if _state.size > 1:
        import torch.distributed as dist

        dist.all_reduce(x, group=_state.group)
    return x


def all_gather(x: torch.Tensor) -> torch.Tensor:
    """Stack every rank's `x` (same shape on every rank) in rank order: [size, *x.shape]."""
    if _state.size == 1:
        return x[None]
    import torch.distributed as dist

    parts = [torch.empty_like(x) for _ in range(_state.size)]
    dist.all_gather(parts, x.contiguous(), group=_state.group)
    return torch.stack(parts)
