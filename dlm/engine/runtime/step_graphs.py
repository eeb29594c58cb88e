"""StepGraphs: the bidirectional denoising forward at static shapes, replayed as CUDA graphs.

On a GPU a small batch's forward is bound by kernel launches and host work, not by the
device: a CUDA graph records the forward's kernels once per shape and replays them with one
launch. A graph needs static shapes and static input memory, so:

- batch shapes are bucketed (`ShapeBuckets`): sequences up to a power of two (at most the
  engine's batch bound), canvas width up to a multiple of `WIDTH_GRANULE`, decided rows up to
  a power of two of at least `MIN_ROWS`. A batch is padded to its bucket: extra rows repeat
  row 0 and are dropped, extra columns are hidden by the key mask, so the decided rows see
  exactly the keys they see eagerly;
- the inputs are written into pinned host buffers and copied without blocking into the
  graph's static device buffers; nothing inside the forward waits for the host (real keys per
  row are read on the device from the key mask). The LM head and the decision stay outside
  the graph: they depend on each request's sampling and run on the few decided rows.

A bucket's graph is captured on its first use, after one warm-up call on a side stream (as
CUDA requires), in one memory pool shared by every bucket. A capture that fails (an operation
that synchronises, e.g. a torch twin under `DLM_KERNELS=torch`) is logged once and that bucket
runs eagerly from then on. Mode "static" runs the same bucketing, padding and buffers on any
device and calls the forward directly: that is how the CPU exercises this path (tests,
`benchmarks/gpu_check.py --dry-run`). Batches with an approximate K/V cache, and shapes beyond
the largest bucket or `MAX_GRAPH_TOKENS`, run eagerly (the caller's path).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from dlm.engine.errors import UsageError
from dlm.engine.runtime.batch import ForwardBatch

log = logging.getLogger("dlm.engine")

WIDTH_GRANULE = 64  # canvas widths are padded to a multiple of this
# Fed tokens (rows x width) of the largest graphed forward. Beyond it a forward is bound by
# its matmuls, launches are a negligible share, and padding would cost more than a graph
# saves; it also bounds the number of graphs a varied traffic can capture.
MAX_GRAPH_TOKENS = 4096
GraphMode = Literal["cuda", "static"]
CHOICES = ("auto", "on", "off")


def graph_mode(choice: str, device: torch.device) -> GraphMode | None:
    """`--step-graphs`: auto captures CUDA graphs on CUDA only; on also runs the static-shape
    path on a CPU (no graphs there: for tests and dry runs); off is the eager forward."""
    if choice not in CHOICES:
        raise UsageError(f"step_graphs must be one of {', '.join(CHOICES)}, got {choice!r}", field="step_graphs")
    if choice == "off":
        return None
    if device.type == "cuda":
        return "cuda"
    return "static" if choice == "on" else None


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


@dataclass(frozen=True)
class ShapeBuckets:
    """The static shapes a batch of `batch` rows, `width` canvas columns and `picks` decided
    rows per row is padded to; None beyond the largest bucket."""

    max_batch: int
    max_width: int
    min_picks: int
    max_picks: int

    def shape(self, batch: int, width: int, picks: int) -> tuple[int, int, int] | None:
        b = _pow2(batch)
        w = -(-width // WIDTH_GRANULE) * WIDTH_GRANULE
        s = max(self.min_picks, _pow2(picks))
        if b > _pow2(self.max_batch) or w > self.max_width or s > _pow2(max(self.max_picks, self.min_picks)):
            return None
        if b * w > MAX_GRAPH_TOKENS:
            return None
        return b, w, s


@dataclass
class _Slot:
    """One bucket: pinned host staging, static device inputs, the graph and its output."""

    host: dict[str, torch.Tensor]
    device: dict[str, torch.Tensor]
    graph: Any = None  # torch.cuda.CUDAGraph once captured
    out: torch.Tensor | None = None
    eager: bool = False  # capture failed: run this bucket without a graph


@dataclass
class StepGraphs:
    model: Any  # forward(ForwardBatch) -> hidden states at the selected rows [B, S, H]
    buckets: ShapeBuckets
    device: torch.device
    mode: GraphMode
    pad_id: int
    slots: dict[tuple[int, int, int], _Slot] = field(default_factory=dict)
    replays: int = 0  # forwards run through a captured graph
    static_runs: int = 0  # forwards run through the static buffers without a graph
    _pool: Any = None

    def _slot(self, shape: tuple[int, int, int]) -> _Slot:
        if shape not in self.slots:
            b, w, s = shape
            pin = self.mode == "cuda"
            host = {
                "ids": torch.empty((b, w), dtype=torch.long, pin_memory=pin),
                "positions": torch.empty((b, w), dtype=torch.long, pin_memory=pin),
                "key_mask": torch.empty((b, w), dtype=torch.bool, pin_memory=pin),
                "select": torch.empty((b, s), dtype=torch.long, pin_memory=pin),
            }
            device = {k: torch.empty_like(v, device=self.device) for k, v in host.items()}
            self.slots[shape] = _Slot(host, device)
        return self.slots[shape]

    def _inputs(self, slot: _Slot) -> ForwardBatch:
        d = slot.device
        return ForwardBatch(d["ids"], d["positions"], d["key_mask"], d["select"])

    def forward(
        self, ids: torch.Tensor, positions: torch.Tensor, lengths: list[int], select: torch.Tensor
    ) -> torch.Tensor | None:
        """Hidden states [n, picks, H] of the selected rows for host tensors ids/positions
        [n, width] (row r real up to lengths[r]) and select [n, picks]; None when the batch
        has no bucket (the caller runs it eagerly)."""
        n, width = ids.shape
        picks = select.shape[1]
        shape = self.buckets.shape(n, width, picks)
        if shape is None:
            return None
        slot = self._slot(shape)
        h = slot.host
        h["ids"].fill_(self.pad_id)
        h["positions"].zero_()
        h["select"].zero_()
        h["ids"][:n, :width] = ids
        h["positions"][:n, :width] = positions
        h["select"][:n, :picks] = select
        real = torch.tensor(lengths)
        h["key_mask"][:n] = torch.arange(shape[1])[None, :] < real[:, None]
        for key in h:  # padding rows repeat row 0: a valid row, dropped below
            h[key][n:] = h[key][0]
        for key, buf in slot.device.items():
            buf.copy_(h[key], non_blocking=True)
        if self.mode == "cuda" and not slot.eager:
            if slot.graph is None:
                self._capture(slot, shape)
            if slot.graph is not None:
                slot.graph.replay()
                self.replays += 1
                assert slot.out is not None
                return slot.out[:n, :picks].clone()
        self.static_runs += 1
        return self.model(self._inputs(slot))[:n, :picks]

    def _capture(self, slot: _Slot, shape: tuple[int, int, int]) -> None:
        """Record the bucket's forward (CUDA only); a failure leaves the bucket eager."""
        try:
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                self.model(self._inputs(slot))  # warm-up: lazy initialisation, Triton compiles
            torch.cuda.current_stream(self.device).wait_stream(side)
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                slot.out = self.model(self._inputs(slot))
            slot.graph = graph
        except RuntimeError as exc:
            slot.eager, slot.out = True, None
            log.warning("step graphs: capturing shape %s failed (%s); that shape runs eagerly", shape, exc)
