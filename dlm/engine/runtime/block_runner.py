"""BlockRunner: one batched forward for block-causal sequences, then their commits.

Each sequence contributes one row (`BlockSequence.plan()`): the positions it feeds, which
of them enter its KV cache and which it decides. Rows are padded on the right (PAD group),
hidden states leave the last layer only at the decided rows, and the LM head runs there
through `dlm.kernels.dispatch.token_stats` (argmax, its probability), never over the vocabulary
for the whole block. The family's commit rule then picks the positions to commit (with
draft-and-edit decoding, the fills and edits of the block's generated positions): like
ModelRunner, `step` commits (the `Runner` contract, dlm/engine/runtime/interface.py).
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from typing import Any

import torch

from dlm.engine.config import ModelConfig
from dlm.engine.decoding.block_diffusion import choose
from dlm.engine.decoding.draft_edit import draft_edit_step
from dlm.engine.decoding.step import confidence, restricted_stats
from dlm.engine.layers.linear import lm_head_shard, local_kv_heads
from dlm.engine.params import ResolvedParams
from dlm.engine.runtime.block_batch import PAD_GROUP, BlockBatch
from dlm.engine.runtime.block_sequence import BlockSequence, Work
from dlm.engine.runtime.kv_cache import SequenceKVCache
from dlm.engine.runtime.prefix_cache import PrefixCache
from dlm.engine.runtime.request import RequestState, narrow
from dlm.engine.runtime.runner import MIN_ROWS
from dlm.kernels import dispatch


class BlockRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        config: ModelConfig,
        dtype: torch.dtype,
        device: torch.device,
        kv_cache_dtype: str = "auto",
    ) -> None:
        self.model: Any = model  # a block-causal family's model: forward(BlockBatch)
        self.config = config
        self.dtype, self.device = dtype, device
        self.kv_cache_dtype = kv_cache_dtype  # its sequences' cache storage (quantization.KV_CACHE_DTYPES)
        rules = config.block_rules
        assert rules is not None  # every block-causal family declares them
        self.rules = rules
        self.vocab_shard = lm_head_shard(config.logits_size)  # None outside tensor parallelism
        self.prefix_cache: PrefixCache | None = None  # prompt K/V shared across requests (exact)

    def new_sequence(self, prompt_ids: list[int], params: ResolvedParams, eos_ids: tuple[int, ...]) -> BlockSequence:
        """Decoding stops after a block holding one of `eos_ids`."""
        c = self.config
        cache = None
        if params.cache == "block":
            heads = local_kv_heads(c.num_heads, c.num_kv_heads)  # this rank's share of the KV heads
            cache = SequenceKVCache(c.num_layers, heads, c.head_dim, self.dtype, self.device, self.kv_cache_dtype)
        seq = BlockSequence(list(prompt_ids), params, c.mask_token_id, eos_ids, rules=self.rules, cache=cache)
        if cache is not None and self.prefix_cache is not None:
            seq.reuse(self.prefix_cache)
        return seq

    def _batch(self, seqs: list[BlockSequence], works: list[Work]) -> BlockBatch:
        # At least MIN_ROWS fed and selected rows, so a GEMM rounds the same solo as batched.
        width = max(max(w.end - w.start for w in works), MIN_ROWS)
        picks = max(max(len(w.rows) for w in works), MIN_ROWS)
        n = len(works)
        ids = torch.full((n, width), self.config.mask_token_id, dtype=torch.long)
        positions = torch.zeros((n, width), dtype=torch.long)
        groups = torch.full((n, width), PAD_GROUP, dtype=torch.long)
        select = torch.zeros((n, picks), dtype=torch.long)
        for r, (seq, w) in enumerate(zip(seqs, works)):
            length = w.end - w.start
            ids[r, :length] = seq.canvas[w.start : w.end]
            positions[r, :length] = torch.arange(w.start, w.end)
            groups[r, :length] = w.groups
            select[r, : len(w.rows)] = w.rows - w.start
        caches = [s.cache for s in seqs]
        to = self.device
        return BlockBatch(
            ids.to(to),
            positions.to(to),
            groups.to(to),
            select.to(to),
            caches=None if caches[0] is None else caches,  # type: ignore[arg-type]
            write=[w.write for w in works],
        )

    def step(self, seqs: Seq[RequestState]) -> None:
        """Advance every sequence by one forward and commit: one batched forward for those
        with the exact cache, one for those recomputing their prefix (`--cache none`)."""
        mine = [narrow(s, BlockSequence) for s in seqs]
        for cached in (True, False):
            group = [s for s in mine if (s.cache is not None) == cached]
            if group:
                self._forward(group)

    @torch.inference_mode()
    def _forward(self, seqs: list[BlockSequence]) -> None:
        works = [s.plan() for s in seqs]
        hidden = self.model(self._batch(seqs, works))
        weight = self.model.lm_head_weight
        for r, (seq, work) in enumerate(zip(seqs, works)):
            seq.committed(work)
            if self.prefix_cache is not None:
                seq.publish(self.prefix_cache)
            if len(work.decide) == 0:
                continue
            p = seq.params
            rows = hidden[r, : len(work.rows)]
            # Banned stop ids (ignore_eos, min_tokens) restrict the distribution; the MASK id is
            # not excluded (dInfer and SDAR commit a MASK argmax, which still settles its position).
            stats = restricted_stats(seq, rows, weight, self.vocab_shard, work.decide, exclude_token=None)
            if stats is None:
                stats = dispatch.token_stats(
                    rows, weight, temperature=p.temperature, generator=seq.generator, shard=self.vocab_shard
                )
            conf, tokens = confidence(p, stats, seq.generator).cpu(), stats.token.cpu()
            if p.edit_threshold is not None:
                # Edits rewrite committed tokens: a position's logprob is from the step that
                # last wrote it, so only the positions this step writes are noted.
                changed = self._revise(seq, work, conf, tokens)
                on = changed.to(rows.device)
                seq.note_logprobs(work.decide[changed], rows[on], weight, stats.token[on], self.vocab_shard)
                continue
            seq.note_logprobs(work.decide, rows, weight, stats.token, self.vocab_shard)
            last = seq.step_in_unit >= len(seq.schedule) - 1  # the unit's share of `steps` is spent
            chosen = choose(p, self.rules, conf, tokens, seq.scheduled, seq.mask_id, last)
            if chosen.numel() == 0:
                # Progress is counted in `pending` positions (a committed MASK argmax, as dInfer
                # and SDAR commit it, still settles its position): a forward that settles none
                # would repeat forever on the unchanged block.
                raise RuntimeError(
                    f"decoding invariant violated: a forward decided none of positions "
                    f"{work.decide.tolist()}; the block would never finish"
                )
            seq.commit(work.decide[chosen], tokens[chosen])

    @staticmethod
    def _revise(seq: BlockSequence, work: Work, conf: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """Draft-and-edit: fill and edit the block's generated positions (all decided); returns
        the indices (into the decided positions) it wrote."""
        p = seq.params
        assert p.threshold is not None and p.edit_threshold is not None and p.max_post_edit_steps is not None
        step = draft_edit_step(
            seq.canvas[work.decide],
            tokens,
            conf,
            mask_id=seq.mask_id,
            threshold=p.threshold,
            edit_threshold=p.edit_threshold,
            edits_left=p.max_post_edit_steps - seq.mask_free_steps,
        )
        seq.revise(work.decide[step.changed], tokens[step.changed], step.finished, step.mask_free)
        return step.changed
