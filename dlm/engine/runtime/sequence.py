"""Sequence: one request's denoising state.

The canvas is the prompt followed by `canvas_length` MASK tokens (`gen_length`, or for a
family decoding whole blocks, Clover, gen_length rounded up to them: the answer is the first
gen_length), then the infilling suffix if any (bidirectional attention sees it from every
step; it is never decided). Decoding walks the blocks left to right (semi-autoregressive;
the last one shorter when block_length does not divide the canvas); inside a block each step
commits some masked positions, and committed tokens are never remasked. With `early_stop`, a block that finishes
holding a stop id (EOS, or one of the request's `stop_token_ids`) ends the request: the rest
of the canvas is filled with EOS (what the model would be forced to emit after it, and what
dInfer writes; with no EOS, the stop id) instead of being denoised for nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from dlm.engine.decoding.constrain import Constraint
from dlm.engine.decoding.schedule import linear_schedule
from dlm.engine.runtime.request import RequestState, first_stop


@dataclass(eq=False)
class Sequence(RequestState):
    block: int = 0
    step_in_block: int = 0
    schedule: list[int] = field(init=False)
    sampler: str = "llada"  # decoding rules of the model family: "llada" or "dream"
    # dlm.engine.runtime.cache.KVCache while an approximate cache is in use (Clover: its HybridCache)
    kv_cache: Any = None
    # Candidate canvases after the next step, verified by the next forward (dlm/engine/decoding/drafts.py)
    drafts: list[torch.Tensor] = field(default_factory=list)

    def __post_init__(self) -> None:
        length = self.params.canvas_length
        self.canvas = torch.tensor(
            self.prompt_ids + [self.mask_id] * length + list(self.params.suffix), dtype=torch.long
        )
        self._start_block()

    @property
    def cache_bytes(self) -> int:
        """Bytes of approximate K/V cache this request holds now."""
        return 0 if self.kv_cache is None else int(self.kv_cache.nbytes)

    def release(self) -> None:
        self.kv_cache = None

    def block_bounds(self) -> tuple[int, int]:
        b = self.params.block_length
        assert b is not None
        start = self.prompt_length + self.block * b
        return start, min(start + b, self.canvas_end)

    @property
    def canvas_end(self) -> int:
        """The canvas position after the decoded positions (where an infilling suffix starts)."""
        return self.prompt_length + self.params.canvas_length

    def positions_to_decide(self) -> torch.Tensor:
        """Absolute positions the next step decides: the block's MASK tokens, except that
        Fast-dLLM's Dream block sampler commits only the block's first token in the forward
        that refreshes the cache."""
        if self.sampler == "dream" and self.params.cache != "none" and self.step_in_block == 0:
            return self.block_bounds()[0] + torch.zeros(1, dtype=torch.long)
        if self.constraint is not None:  # a response format: each slot is written left to right
            return self.constraint.open_positions(self.canvas, self.masked_positions())
        return self.masked_positions()

    def masked_positions(self, canvas: torch.Tensor | None = None) -> torch.Tensor:
        """Absolute positions of the MASK tokens in the current block (of `canvas`, default
        the sequence's own)."""
        start, end = self.block_bounds()
        canvas = self.canvas if canvas is None else canvas
        return (canvas[start:end] == self.mask_id).nonzero()[:, 0] + start

    def quota(self) -> int:
        """Positions this step may commit under the block's linear schedule, counting the slots
        earlier steps left uncommitted: the masks left minus what the schedule still grants
        later steps (every mask left from the last scheduled step on). Fast-dLLM's
        whole-sequence Dream `confidence_threshold` carries those slots over this way."""
        return len(self.masked_positions()) - sum(self.schedule[self.step_in_block + 1 :])

    def unconditional_canvas(self) -> torch.Tensor:
        """The canvas with the prompt masked out, for classifier-free guidance."""
        un = self.canvas.clone()
        un[: self.prompt_length] = self.mask_id
        return un

    def _start_block(self) -> None:
        self.step_in_block = 0
        self.schedule = linear_schedule(len(self.masked_positions()), self.params.steps_per_block)

    def commit(self, positions: torch.Tensor, tokens: torch.Tensor) -> None:
        """Write decided tokens; move to the next block (or finish) once this one is full.

        Progress is counted by the MASK tokens left in the block, so committing the MASK id
        would leave its position undecided forever: the statistics exclude it, and this
        refuses it rather than loop."""
        if bool((tokens == self.mask_id).any()):
            raise RuntimeError(
                f"decoding invariant violated: the MASK token {self.mask_id} was committed at "
                f"{positions[tokens == self.mask_id].tolist()}; the block would never finish"
            )
        self.canvas[positions] = tokens
        self.step_in_block += 1
        self._advance()

    def lay(self, answer: list[int], constraint: Constraint) -> None:
        """Put a response format's skeleton on the answer (dlm/engine/decoding/constrain.py):
        its fixed tokens are committed before the first forward, and blocks without a slot
        are passed over (a skeleton without slots is finished at once)."""
        self.canvas[self.prompt_length :] = torch.tensor(answer, dtype=torch.long)
        self.constraint = constraint
        self._start_block()
        self._advance()

    def _advance(self) -> None:
        """Move past full blocks: to the next block, or to the end (EOS early stop)."""
        while not self.finished and len(self.masked_positions()) == 0:
            start, end = self.block_bounds()
            if self.params.early_stop and self.holds_stop(start, end) and end < self.canvas_end:
                self.canvas[end : self.canvas_end] = self._filler(start, end)  # never the infilling suffix
                self._finish()
            elif self.block + 1 < self.params.num_blocks:
                self.block += 1
                self._start_block()
            else:
                self._finish()

    def _filler(self, start: int, end: int) -> int:
        """What follows an early stop: EOS, or without one the first stop id in the block."""
        if self.eos_id is not None:
            return self.eos_id
        index = first_stop(self.canvas[start:end].tolist(), self.stop_ids)
        assert index is not None
        return int(self.canvas[start + index])

    def _finish(self) -> None:
        self.conclude()
