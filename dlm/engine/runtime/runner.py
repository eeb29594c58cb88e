"""ModelRunner: the runner of bidirectional families: one batched forward, then each
sequence's commit (the `Runner` contract, dlm/engine/runtime/interface.py).

Each sequence contributes one row: its whole canvas, or with an approximate cache only the
block / suffix being denoised (dlm/engine/runtime/cache.py), with its own absolute positions; rows are
padded on the right and padding is hidden from attention. Only the positions each sequence
decides leave the last layer and meet the LM head (through `decoding.step.token_stats`),
never a [batch, sequence, vocab] logits tensor. For a model whose row i predicts token i+1
(Dream: the family's `logits_shift` is 1) position p is read from row p-1.

A request's output must not depend on its batch. Attention over masked padding is exact,
but a CPU GEMM rounds differently for a handful of rows than for many (MKL's small-M
kernels), so every matmul is given at least `MIN_ROWS` rows per sequence: fed rows and
selected rows are padded up to it. The cost is nil next to a forward.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import Any

import torch

from dlm.engine.config import ModelConfig
from dlm.engine.decoding.drafts import candidates
from dlm.engine.decoding.step import decide, token_stats
from dlm.engine.params import ResolvedParams
from dlm.engine.runtime import cache
from dlm.engine.runtime.batch import ForwardBatch
from dlm.engine.runtime.request import RequestState, narrow
from dlm.engine.runtime.sequence import Sequence
from dlm.engine.runtime.step_graphs import StepGraphs
from dlm.kernels.token_stats import TokenStats, VocabShard

MIN_ROWS = 16


@dataclass
class _Row:
    ids: torch.Tensor  # fed tokens
    first: int  # absolute position of ids[0]
    select: torch.Tensor  # fed rows whose hidden states are wanted
    kv: cache.RowKV | None


@dataclass
class _Forwarded:
    """One sequence's rows of a batched forward: its canvas (row 0) and its draft candidates
    (row i: `drafts[i - 1]`), each with its decided positions and their last hidden states.
    The LM head runs on a row only when a step is decided from it."""

    positions: list[torch.Tensor]
    hidden: list[torch.Tensor]
    drafts: list[torch.Tensor]
    weight: torch.Tensor
    shard: VocabShard | None

    def stats(self, seq: Sequence, row: int) -> TokenStats:
        """The statistics a step is decided from (noting their logprobs when asked for)."""
        stats = token_stats(seq, self.hidden[row], self.weight, self.shard, self.positions[row])
        seq.note_logprobs(self.positions[row], self.hidden[row], self.weight, stats.token, self.shard)
        return stats

    def row_of(self, canvas: torch.Tensor) -> int | None:
        """The row that fed exactly `canvas` (a verified candidate), if any."""
        return next((i + 1 for i, guess in enumerate(self.drafts) if torch.equal(guess, canvas)), None)


class ModelRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        config: ModelConfig,
        device: torch.device,
        sampler: str,
        vocab_shard: VocabShard | None = None,
    ) -> None:
        self.model: Any = model  # a family's model (or the transformers adapter): forward(ForwardBatch)
        self.config, self.device, self.sampler = config, device, sampler
        self.shift = config.logits_shift  # the family record's (0 for the transformers adapter)
        self.vocab_shard = vocab_shard  # this rank's LM-head rows under tensor parallelism
        self.graphs: StepGraphs | None = None  # static-shape forwards (CUDA graphs), when enabled

    def new_sequence(self, prompt_ids: list[int], params: ResolvedParams, eos_ids: tuple[int, ...]) -> Sequence:
        return Sequence(list(prompt_ids), params, self.config.mask_token_id, eos_ids, sampler=self.sampler)

    @torch.inference_mode()
    def step(self, seqs: Seq[RequestState]) -> None:
        """One forward for all `seqs`, then each one's commit; with drafts (`params.drafts`),
        also every following step whose canvas the forward held among its candidates
        (dlm/engine/decoding/drafts.py), then the candidates for the next forward."""
        mine = [narrow(s, Sequence) for s in seqs]
        for seq, out in zip(mine, self._forward(mine)):
            row = 0
            while True:
                positions = out.positions[row]
                stats = out.stats(seq, row)
                chosen_positions, tokens = decide(seq, positions, stats)
                seq.propose(positions, stats.token)  # what canvas streaming shows as provisional
                block = seq.block
                seq.commit(chosen_positions, tokens)
                following = out.row_of(seq.canvas)
                if seq.finished or seq.block != block or following is None:
                    break
                row = following
            seq.drafts = []
            if seq.params.drafts and not seq.finished and seq.block == block:
                left = ~torch.isin(positions, chosen_positions)
                seq.drafts = candidates(
                    seq.params,
                    seq.step_in_block,
                    seq.schedule,
                    seq.canvas,
                    positions[left],
                    out.hidden[row][left],
                    self.model.lm_head_weight,
                    seq.mask_id,
                    self.vocab_shard,
                )

    def _run(self, rows: list[_Row], pad_id: int) -> torch.Tensor:
        """Hidden states at the selected rows: through the step graphs when they hold the
        batch's shape and no row reads an approximate cache, else one eager forward."""
        if self.graphs is not None and all(r.kv is None for r in rows):
            hidden = self.graphs.forward(*self._host(rows, pad_id))
            if hidden is not None:
                return hidden
        return self.model(self._batch(rows, pad_id))

    def _host(self, rows: list[_Row], pad_id: int) -> tuple[torch.Tensor, torch.Tensor, list[int], torch.Tensor]:
        """ids and positions [B, width], real lengths, select [B, picks], on the host."""
        lengths = [len(r.ids) for r in rows]
        width = max(max(lengths), MIN_ROWS)
        picks = max(max(len(r.select) for r in rows), MIN_ROWS)
        input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
        positions = torch.zeros((len(rows), width), dtype=torch.long)
        select = torch.zeros((len(rows), picks), dtype=torch.long)
        for i, row in enumerate(rows):
            input_ids[i, : len(row.ids)] = row.ids
            positions[i, : len(row.ids)] = torch.arange(row.first, row.first + len(row.ids))
            select[i, : len(row.select)] = row.select
        return input_ids, positions, lengths, select

    def _batch(self, rows: list[_Row], pad_id: int) -> ForwardBatch:
        input_ids, positions, lengths, select = self._host(rows, pad_id)
        kv = cache.BatchKV([r.kv for r in rows], lengths, input_ids.shape[1])
        return ForwardBatch(input_ids.to(self.device), positions.to(self.device), None, select.to(self.device), kv)

    @torch.inference_mode()
    def forward(self, seqs: list[Sequence]) -> list[tuple[torch.Tensor, TokenStats]]:
        """One forward for all `seqs`; returns (decided positions, stats) per sequence, committing nothing."""
        return [(out.positions[0], out.stats(seq, 0)) for seq, out in zip(seqs, self._forward(seqs))]

    @torch.inference_mode()
    def _forward(self, seqs: list[Sequence]) -> list[_Forwarded]:
        """One forward for all `seqs`: each one's canvas, then its draft candidates (same span,
        same cache: candidates exist only between a block's steps, never for a refresh)."""
        rows: list[_Row] = []
        decided: list[list[torch.Tensor]] = []
        for seq in seqs:
            positions = seq.positions_to_decide()
            first, end, kv = cache.plan(seq)
            select = positions - self.shift - first
            assert bool((select >= 0).all()), "a decided position's logits row is not fed"
            decided.append([positions])
            rows.append(_Row(seq.canvas[first:end], first, select, kv))
            if seq.params.cfg_scale > 0:
                rows.append(_Row(seq.unconditional_canvas(), 0, select, None))
            for guess in seq.drafts:
                guessed = seq.masked_positions(guess)
                decided[-1].append(guessed)
                rows.append(_Row(guess[first:end], first, guessed - self.shift - first, kv))
        hidden = self._run(rows, pad_id=seqs[0].mask_id)
        out = []
        r = 0
        for seq, picked in zip(seqs, decided):
            h = [hidden[r, : len(picked[0])]]
            fed = len(rows[r].ids)
            if seq.params.cfg_scale > 0:
                # The LM head is linear, so guiding hidden states equals guiding logits:
                # un + (s+1)(cond - un) = W((s+1) h_cond - s h_un).
                s = seq.params.cfg_scale
                h[0] = (s + 1) * h[0] - s * hidden[r + 1, : len(picked[0])]
                r += 1
            r += 1
            for guessed in picked[1:]:
                h.append(hidden[r, : len(guessed)])
                r += 1
            seq.nfe += 1
            seq.query_lengths.append(fed * len(picked))  # every row of this request's was fed
            out.append(_Forwarded(picked, h, seq.drafts, self.model.lm_head_weight, self.vocab_shard))
        return out
