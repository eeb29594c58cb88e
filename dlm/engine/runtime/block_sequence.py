"""BlockSequence: one request's state in a block-causal family (LLaDA2, SDAR, openPangu,
Fast-dLLM v2).

The canvas holds the prompt and the block grid up to its end; positions [0, ctx_end) are
final context, [block_start, block_end) is the block being denoised (`pending` marks its
undecided positions), and with the exact cache [0, cached) already have their K/V stored.

`plan()` says what the next forward feeds and decides, following the family's
`BlockRules`:
- context not cached yet is fed first and written to the cache (the prompt, in chunks of
  at most PREFILL_CHUNK tokens when it is long, then each finished block);
- the commit of a finished block shares its forward with the first denoising step of the
  next block (block-causal visibility makes that exact), so no forward is spent only on
  writing K/V; for shifted-logit families (openPangu, Fast-dLLM v2) the commit forward is
  the one that decodes the next block's first token, as the model was trained (a block whose
  first position holds the prompt's tail needs no such forward);
- without a cache (`--cache none`) every forward recomputes the whole prefix.

With a cross-request `PrefixCache` (dlm/engine/runtime/prefix_cache.py) the sequence starts with
the K/V of the longest cached run of its prompt's pages (`reuse`) and feeds only the rest;
every whole page it caches is published for later requests (`publish`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from dlm.engine.decoding.block_diffusion import BlockRules
from dlm.engine.decoding.schedule import linear_schedule
from dlm.engine.family_rules import PREFILL_CHUNK
from dlm.engine.runtime.kv_cache import SequenceKVCache
from dlm.engine.runtime.prefix_cache import PrefixCache
from dlm.engine.runtime.request import RequestState, first_stop


@dataclass
class Work:
    """One row of a forward: feed positions [start, end), store the first `write` of them
    in the cache, return hidden states at `rows` to decide positions `rows + shift`."""

    start: int
    end: int
    write: int
    groups: torch.Tensor  # [end - start] visibility groups
    rows: torch.Tensor  # absolute positions whose hidden states are needed
    decide: torch.Tensor  # absolute positions decided by this forward


@dataclass(eq=False)
class BlockSequence(RequestState):
    rules: BlockRules = field(kw_only=True)
    cache: SequenceKVCache | None = None
    cached: int = 0
    # Draft-and-edit (dlm/engine/decoding/draft_edit.py): steps spent on the current block, and
    # how many of them found it without MASK (the edit budget spent).
    block_steps: int = 0
    mask_free_steps: int = 0
    published: int = 0  # positions [0, published) are in the prefix cache (or never will be)
    publish_under: int | None = None  # prefix-cache node the next page goes under (None: stop)

    def __post_init__(self) -> None:
        p, b = len(self.prompt_ids), self.block_length
        first = (p // b) * b if self.rules.aligned_grid else p
        # Whole blocks: the grid runs past the answer to the end of the block holding its last
        # position (the answer is cut at gen_length), as the parameters resolved it.
        self.grid_end = p + self.params.grid_length
        self.canvas = torch.full((self.grid_end,), self.mask_id, dtype=torch.long)
        self.canvas[:p] = torch.tensor(self.prompt_ids, dtype=torch.long)
        self.decoded_end = p  # generated tokens are canvas[p:decoded_end] once blocks finish
        self._start_block(first)

    @property
    def block_length(self) -> int:
        assert self.params.block_length is not None
        return self.params.block_length

    @property
    def cache_bytes(self) -> int:
        """Bytes of exact block K/V cache this request holds now (allocated capacity)."""
        return 0 if self.cache is None else self.cache.nbytes

    @property
    def ctx_end(self) -> int:
        return self.block_start

    def _start_block(self, start: int) -> None:
        self.block_start, self.block_end = start, start + self.block_length
        self.pending = self.canvas[start : self.block_end] == self.mask_id
        self.pending[: max(0, self.prompt_length - start)] = False  # the prompt's tail is given
        self.block_steps = self.mask_free_steps = 0
        self.unit_start = -1
        self._sync_unit()

    # -- sub-blocks ("units") and the static schedule -------------------------------------
    @property
    def unit_size(self) -> int:
        return max(1, self.block_length // self.rules.sub_blocks)

    def _unit_bounds(self) -> tuple[int, int]:
        """Offsets (within the block) of the first unit that still has pending positions."""
        first = int(self.pending.nonzero()[0, 0])
        lo = first // self.unit_size * self.unit_size
        return lo, min(lo + self.unit_size, self.block_length)

    def _sync_unit(self) -> None:
        """Start a fresh schedule when decoding moves on to another unit."""
        lo, _ = self._unit_bounds()
        if lo != self.unit_start:
            self.unit_start, self.step_in_unit = lo, 0
            steps = max(1, self.params.steps_per_block // max(1, self.block_length // self.unit_size))
            # SDAR's num_transfer_tokens: the unit size split over its steps, earlier first.
            self.schedule = linear_schedule(self.unit_size, steps)

    @property
    def scheduled(self) -> int:
        return self.schedule[self.step_in_unit] if self.step_in_unit < len(self.schedule) else 1

    # -- the cross-request prefix cache ----------------------------------------------------
    @property
    def visibility_unit(self) -> int:
        """Positions whose context K/V depend on the same tokens (1: causal context)."""
        return 1 if self.rules.causal_context else self.block_length

    def reuse(self, prefix: PrefixCache) -> None:
        """Start from the cached K/V of the longest cached run of the prompt's pages. The
        block's first forward must still feed a row: with shifted logits the last context
        position predicts the block's first token, so it is never taken from the cache."""
        assert self.cache is not None and self.cached == 0
        limit = self.block_start - (1 if self.rules.logit_shift else 0)
        found = prefix.lookup(self.prompt_ids, self.visibility_unit, max(0, limit), self.params.prefix_cache_partition)
        for layer, (k, v) in enumerate(zip(found.k, found.v)):
            self.cache.store(layer, k, v)
        self.cache.advance(found.length)
        self.cached = self.published = found.length
        self.publish_under = found.last

    def publish(self, prefix: PrefixCache) -> None:
        """Offer every whole page of cached context not yet published (its tokens are final)."""
        if self.cache is None or self.publish_under is None:
            return
        page = prefix.page_size(self.visibility_unit)
        while self.publish_under is not None and self.published + page <= self.cached:
            lo, hi = self.published, self.published + page
            layers = [self.cache.layer(i) for i in range(self.cache.num_layers)]
            k = torch.stack([kv[0][:, lo:hi] for kv in layers if kv is not None])
            v = torch.stack([kv[1][:, lo:hi] for kv in layers if kv is not None])
            self.publish_under = prefix.publish(self.publish_under, self.canvas[lo:hi].tolist(), k, v)
            self.published = hi

    # -- planning ------------------------------------------------------------------------
    def _groups(self, start: int, end: int) -> torch.Tensor:
        pos = torch.arange(start, end)
        context = pos if self.rules.causal_context else pos // self.block_length * self.block_length
        return torch.where(pos < self.block_start, context, torch.full_like(pos, self.block_start))

    def plan(self) -> Work:
        base = self.cached if self.cache is not None else 0
        s = self.block_start
        if self.cache is not None and s - base > PREFILL_CHUNK:
            step = (
                PREFILL_CHUNK
                if self.rules.causal_context
                else max(self.block_length, PREFILL_CHUNK // self.block_length * self.block_length)
            )
            empty = torch.empty(0, dtype=torch.long)
            return Work(base, base + step, step, self._groups(base, base + step), empty, empty)
        write = s - base if self.cache is not None else 0
        shift = self.rules.logit_shift
        if shift and bool(self.pending[0]):
            # The block's first token is predicted by the last context row (the commit forward).
            decide = torch.tensor([s])
            return Work(base, s, write, self._groups(base, s), decide - shift, decide)
        if self.params.edit_threshold is not None:  # every generated position may be edited
            decide = torch.arange(max(s, self.prompt_length), self.block_end)
            return Work(base, self.block_end, write, self._groups(base, self.block_end), decide, decide)
        lo, hi = self._unit_bounds()
        decide = self.pending[lo:hi].nonzero()[:, 0] + s + lo
        return Work(base, self.block_end, write, self._groups(base, self.block_end), decide - shift, decide)

    # -- committing ----------------------------------------------------------------------
    def committed(self, work: Work) -> None:
        """The forward of `work` ran: its written positions are now cached."""
        self.nfe += 1
        self.query_lengths.append(work.end - work.start)
        if self.cache is not None and work.write:
            self.cache.advance(work.write)
            self.cached += work.write

    def commit(self, positions: torch.Tensor, tokens: torch.Tensor) -> None:
        """Write decided tokens; move to the next unit, block, or finish."""
        if positions.numel() == 0:
            return
        first_token = self.rules.logit_shift and bool(self.pending[0])  # from the commit forward
        self.canvas[positions] = tokens
        self.pending[positions - self.block_start] = False
        if not first_token:
            self.step_in_unit += 1
        if self.rules.stop_mid_block and self.params.early_stop and self._stop_decided():
            return
        if bool(self.pending.any()):
            self._sync_unit()
            return
        self._end_block()

    def revise(self, positions: torch.Tensor, tokens: torch.Tensor, finished: bool, mask_free: bool) -> None:
        """A draft-and-edit step: write its fills and edits; end the block when the rule
        finishes it or it has spent the reference's step bound (block + post-edit steps + 1)."""
        self.canvas[positions] = tokens
        tail = max(0, self.prompt_length - self.block_start)
        self.pending = self.canvas[self.block_start : self.block_end] == self.mask_id
        self.pending[:tail] = False
        self.block_steps += 1
        self.mask_free_steps += mask_free
        post = self.params.max_post_edit_steps
        assert post is not None  # resolved whenever editing is on
        if finished or self.block_steps >= self.block_length + post + 1:
            self._end_block()

    def _end_block(self) -> None:
        """The current block is final: finish on EOS (with `early_stop`) or at the grid's end,
        else start the next (`stop` only when the stop id lies within the answer, not in the
        grid's overhang)."""
        self.decoded_end = self.block_end
        stopped = self.params.early_stop and self.holds_stop(self.prompt_length, self.block_end)
        if stopped or self.block_end >= self.grid_end:
            self.conclude()  # SDAR's stopping_criteria_idx, or the grid's end
        else:
            self._start_block(self.block_end)

    def _stop_decided(self) -> bool:
        """Finish if the block's first stop id (EOS or a request's `stop_token_ids`) is decided
        with no undecided position before it: what follows it can no longer matter (Fast-dLLM
        v2 stops there, mid-block)."""
        start = max(self.prompt_length, self.block_start)
        stop = first_stop(self.canvas[start : self.block_end].tolist(), self.stop_ids)
        if stop is None:
            return False
        end = start + stop
        if bool(self.pending[: end - self.block_start].any()):
            return False
        self.decoded_end = end + 1
        self.conclude()
        return True

    @property
    def generated_ids(self) -> list[int]:
        """Every token decoded after the prompt, to the end of the last finished block
        (the absolute grid may decode past gen_length, as the references do)."""
        return self.canvas[self.prompt_length : self.decoded_end].tolist()

    @property
    def output_ids(self) -> list[int]:
        return self.generated_ids[: self.params.gen_length]
