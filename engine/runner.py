"""ModelRunner: turns a set of sequences into one batched forward and per-sequence stats.

Only the masked positions of each sequence's current block are decided, so only those rows
leave the last layer and meet the LM head (through `kernels.dispatch.token_stats`), never a
[batch, sequence, vocab] logits tensor.
"""
from __future__ import annotations

import torch

from engine.batch import ForwardBatch
from engine.sequence import Sequence
from kernels import dispatch
from kernels.token_stats import TokenStats, VocabShard


class ModelRunner:
    def __init__(self, model: torch.nn.Module, device: torch.device, vocab_shard: VocabShard | None = None) -> None:
        self.model = model
        self.device = device
        self.vocab_shard = vocab_shard  # this rank's LM-head rows under tensor parallelism

    def _batch(self, rows: list[tuple[torch.Tensor, torch.Tensor]], pad_id: int) -> ForwardBatch:
        lengths = [len(ids) for ids, _ in rows]
        width, picks = max(lengths), max(len(sel) for _, sel in rows)
        input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
        select = torch.zeros((len(rows), picks), dtype=torch.long)
        for r, (ids, sel) in enumerate(rows):
            input_ids[r, : len(ids)] = ids
            select[r, : len(sel)] = sel
        key_mask = None
        if min(lengths) != width:
            key_mask = torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]
            key_mask = key_mask.to(self.device)
        positions = torch.arange(width, device=self.device).expand(len(rows), width)
        return ForwardBatch(input_ids.to(self.device), positions, key_mask, select.to(self.device))

    @torch.inference_mode()
    def step(self, seqs: list[Sequence]) -> list[tuple[torch.Tensor, TokenStats]]:
        """One forward for all `seqs`; returns (decided positions, stats) per sequence."""
        rows: list[tuple[torch.Tensor, torch.Tensor]] = []
        picked = []
        for seq in seqs:
            sel = seq.masked_positions()
            picked.append(sel)
            rows.append((seq.canvas, sel))
            if seq.params.cfg_scale > 0:
                rows.append((seq.unconditional_canvas(), sel))
        batch = self._batch(rows, pad_id=seqs[0].mask_id)
        hidden = self.model(batch)
        weight = self.model.lm_head_weight
        out = []
        r = 0
        for seq, sel in zip(seqs, picked):
            h = hidden[r, : len(sel)]
            if seq.params.cfg_scale > 0:
                # The LM head is linear, so guiding hidden states equals guiding logits:
                # un + (s+1)(cond - un) = W((s+1) h_cond - s h_un).
                s = seq.params.cfg_scale
                h = (s + 1) * h - s * hidden[r + 1, : len(sel)]
                r += 2
            else:
                r += 1
            stats = dispatch.token_stats(
                h, weight, temperature=seq.params.temperature, generator=seq.generator, shard=self.vocab_shard
            )
            seq.nfe += 1
            seq.query_lengths.append(len(seq.canvas))
            out.append((sel, stats))
        return out
