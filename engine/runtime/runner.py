"""ModelRunner: the runner of bidirectional families: one batched forward, then each
sequence's commit (the `Runner` contract, engine/runtime/interface.py).

Each sequence contributes one row: its whole canvas, or with an approximate cache only the
block / suffix being denoised (engine/runtime/cache.py), with its own absolute positions; rows are
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

from engine.config import ModelConfig
from engine.decoding.step import decide, token_stats
from engine.params import Forwards, GenerationParams, ResolvedParams
from engine.runtime import cache
from engine.runtime.batch import ForwardBatch
from engine.runtime.request import RequestState, narrow
from engine.runtime.sequence import Sequence
from kernels.token_stats import TokenStats, VocabShard

MIN_ROWS = 16


@dataclass
class _Row:
    ids: torch.Tensor  # fed tokens
    first: int  # absolute position of ids[0]
    select: torch.Tensor  # fed rows whose hidden states are wanted
    kv: cache.RowKV | None


class ModelRunner:
    fixed_block: int | None = None  # any block length
    forwards: Forwards | None = None  # one forward per step, nothing more

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

    def resolve(self, params: GenerationParams) -> GenerationParams:
        """No family default to add: GenerationParams resolves its own."""
        return params

    def new_sequence(self, prompt_ids: list[int], params: ResolvedParams, eos_id: int | None) -> Sequence:
        return Sequence(list(prompt_ids), params, self.config.mask_token_id, eos_id, sampler=self.sampler)

    def step(self, seqs: Seq[RequestState]) -> None:
        """One forward for all `seqs`, then each one's commit."""
        mine = [narrow(s, Sequence) for s in seqs]
        for seq, (positions, stats) in zip(mine, self.forward(mine)):
            decided = decide(seq, positions, stats)
            seq.propose(positions, stats.token)
            seq.commit(*decided)

    def _batch(self, rows: list[_Row], pad_id: int) -> ForwardBatch:
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
        kv = cache.BatchKV([r.kv for r in rows], lengths, width)
        return ForwardBatch(input_ids.to(self.device), positions.to(self.device), None, select.to(self.device), kv)

    @torch.inference_mode()
    def forward(self, seqs: list[Sequence]) -> list[tuple[torch.Tensor, TokenStats]]:
        """One forward for all `seqs`; returns (decided positions, stats) per sequence, committing nothing."""
        rows: list[_Row] = []
        decided = []
        for seq in seqs:
            positions = seq.positions_to_decide()
            first, end, kv = cache.plan(seq)
            select = positions - self.shift - first
            assert bool((select >= 0).all()), "a decided position's logits row is not fed"
            decided.append(positions)
            rows.append(_Row(seq.canvas[first:end], first, select, kv))
            if seq.params.cfg_scale > 0:
                rows.append(_Row(seq.unconditional_canvas(), 0, select, None))
        hidden = self.model(self._batch(rows, pad_id=seqs[0].mask_id))
        weight = self.model.lm_head_weight
        out = []
        r = 0
        for seq, positions in zip(seqs, decided):
            n = len(positions)
            h = hidden[r, :n]
            fed = len(rows[r].ids)
            if seq.params.cfg_scale > 0:
                # The LM head is linear, so guiding hidden states equals guiding logits:
                # un + (s+1)(cond - un) = W((s+1) h_cond - s h_un).
                s = seq.params.cfg_scale
                h = (s + 1) * h - s * hidden[r + 1, :n]
                r += 2
            else:
                r += 1
            stats = token_stats(seq, h, weight, self.vocab_shard, positions)
            seq.nfe += 1
            seq.query_lengths.append(fed)
            out.append((positions, stats))
        return out
