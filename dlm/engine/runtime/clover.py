"""CloverEngine: Clover-style block diffusion on the Qwen3.5-MoE hybrid. EXPERIMENTAL.

Not yet checked against Clover's own code or weights (nobody has read its modeling file);
every assumption is listed in docs/clover.md. The loop, per sequence:

1. prefill: one causal pass over the prompt; its states become the sequence's cache.
2. for each 32-token block of MASKs:
   a. preview passes: the block alone, at its absolute positions, against the cache;
      full-attention layers see the prefix and the whole block (bidirectional inside it),
      DeltaNet layers run causally from the committed state. The states these passes
      produce are dropped, so previews never change the recurrent or conv state. Each
      preview decides the block's masked positions with dlm's commit rules (threshold,
      factor, or the linear schedule) through `dlm.kernels.dispatch.token_stats`, which never
      proposes the MASK token (as for LLaDA: committing it would leave the position masked).
   b. commit pass: once the block has no MASK, one causal pass over it advances the cache
      (KV appended, DeltaNet state and conv ring moved on).
3. stop after the block that contains EOS (skipping its commit pass), or after gen_length.

`CloverEngine` is `LLMEngine` over `CloverRunner` (the `Runner` contract: a step advances and
commits). Sequences are run one at a time (no cross-request batching yet): their caches have
different lengths.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from typing import Any

import torch

from dlm.engine.config import ModelConfig
from dlm.engine.decoding.step import decide, token_stats
from dlm.engine.layers.linear import lm_head_shard
from dlm.engine.params import ResolvedParams
from dlm.engine.runtime.engine import LLMEngine
from dlm.engine.runtime.hybrid_cache import HybridCache
from dlm.engine.runtime.interface import Runner
from dlm.engine.runtime.request import RequestState, narrow
from dlm.engine.runtime.sequence import Sequence


class CloverRunner:
    """The `Runner` of Clover: sequences run one at a time (their caches differ in length);
    each one's `HybridCache` lives on the sequence (`kv_cache`), so it goes when the request ends."""

    def __init__(self, model: torch.nn.Module, config: ModelConfig, device: torch.device) -> None:
        self.model: Any = model  # the hybrid: forward_tokens, new_cache, lm_head_weight
        self.config, self.device = config, device
        self.vocab_shard = lm_head_shard(config.logits_size)

    def new_sequence(self, prompt_ids: list[int], params: ResolvedParams, eos_ids: tuple[int, ...]) -> Sequence:
        return Sequence(list(prompt_ids), params, self.config.mask_token_id, eos_ids)

    def step(self, seqs: Seq[RequestState]) -> None:
        """One preview pass per sequence (and the passes it entails, see the module docstring)."""
        for seq in seqs:
            self._advance(narrow(seq, Sequence))

    def _causal(self, seq: Sequence, cache: HybridCache, start: int, end: int) -> None:
        """Run tokens [start, end) causally and commit their states to the cache."""
        ids = seq.canvas[start:end].to(self.device)[None]
        _, states = self.model.forward_tokens(ids, torch.arange(start, end, device=self.device)[None], cache)
        cache.commit(states, end - start)
        seq.nfe += 1
        seq.query_lengths.append(end - start)

    @torch.inference_mode()
    def _advance(self, seq: Sequence) -> None:
        """One preview (and, when it completes the block, the commit pass) for `seq`."""
        device = self.device
        cache: HybridCache | None = seq.kv_cache
        if cache is None:
            cache = seq.kv_cache = self.model.new_cache()
            self._causal(seq, cache, 0, seq.prompt_length)
        start, end = seq.block_bounds()
        block = seq.block
        ids = seq.canvas[start:end].to(device)[None]
        hidden, _ = self.model.forward_tokens(
            ids, torch.arange(start, end, device=device)[None], cache, causal=False
        )  # preview: the states are dropped
        positions = seq.masked_positions()
        # The family's statistics (MASK never proposed): a preview that kept predicting MASK
        # would commit nothing and never fill the block.
        rows = hidden[0, (positions - start).to(device)]
        stats = token_stats(seq, rows, self.model.lm_head_weight, self.vocab_shard, positions)
        seq.note_logprobs(positions, rows, self.model.lm_head_weight, stats.token, self.vocab_shard)
        seq.nfe += 1
        seq.query_lengths.append(end - start)
        seq.commit(*decide(seq, positions, stats))
        if seq.block == block and not seq.finished:
            return
        if not seq.finished and seq.params.early_stop and seq.holds_stop(start, end):
            seq.canvas = seq.canvas[:end]  # the answer ended in this block: no further blocks
            seq.conclude()
        if not seq.finished:
            self._causal(seq, cache, start, end)


class CloverEngine(LLMEngine):
    """LLMEngine over Clover's runner."""

    def make_runner(self) -> Runner:
        return CloverRunner(self.loaded.model, self.config, self.loaded.device)
