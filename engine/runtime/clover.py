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
      factor, or the linear schedule) through `kernels.dispatch.token_stats`, which never
      proposes the MASK token (as for LLaDA: committing it would leave the position masked).
   b. commit pass: once the block has no MASK, one causal pass over it advances the cache
      (KV appended, DeltaNet state and conv ring moved on).
3. stop after the block that contains EOS (skipping its commit pass), or after gen_length.

It keeps the same interface as `LLMEngine` (add_request / step / generate). Sequences are
run one at a time (no cross-request batching yet): their caches have different lengths.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from engine.decoding.step import decide, token_stats
from engine.params import Forwards, GenerationParams, ResolvedParams
from engine.runtime.engine import LLMEngine, LoadedModel
from engine.runtime.hybrid_cache import HybridCache
from engine.runtime.sequence import Sequence

DEFAULT_BLOCK = 32  # Clover's training block size (model card); `block_size` in config.json overrides


class CloverEngine(LLMEngine):
    def __init__(self, loaded: LoadedModel) -> None:
        super().__init__(loaded)
        self.model = loaded.model
        self.block_size = int(self.config.raw.get("block_size", DEFAULT_BLOCK))
        self.caches: dict[int, HybridCache] = {}

    def validate(self, params: GenerationParams, prompt_length: int) -> ResolvedParams:
        """Clover's rules are part of the one validation: its block size by default, and no
        other block length (nor guidance)."""
        if isinstance(params, ResolvedParams):
            return params
        params = replace(params, block_length=params.block_length or self.block_size)
        return params.validate(
            prompt_length,
            self.config.max_position_embeddings,
            self.family,
            fixed_block=self.block_size,
            forwards=Forwards(per_block=1),  # a block's commit pass (the prompt's prefill replaces the last one)
        )

    def abort(self, seq: Sequence, reason: str = "abort") -> None:  # type: ignore[override]
        super().abort(seq, reason)
        self.caches.pop(seq.seq_id, None)  # a cancelled request's cache goes with it

    def cache_bytes(self) -> int:
        # A snapshot: a metrics scrape reads this while the step thread adds and drops caches.
        return sum(cache.nbytes for cache in list(self.caches.values()))

    def _causal(self, seq: Sequence, cache: HybridCache, start: int, end: int) -> None:
        """Run tokens [start, end) causally and commit their states to the cache."""
        device = self.loaded.device
        ids = seq.canvas[start:end].to(device)[None]
        _, states = self.model.forward_tokens(ids, torch.arange(start, end, device=device)[None], cache)
        cache.commit(states, end - start)
        seq.nfe += 1
        seq.query_lengths.append(end - start)

    @torch.inference_mode()
    def _advance(self, seq: Sequence) -> None:
        """One preview (and, when it completes the block, the commit pass) for `seq`."""
        device = self.loaded.device
        cache = self.caches.get(seq.seq_id)
        if cache is None:
            cache = self.caches[seq.seq_id] = self.model.new_cache()
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
        stats = token_stats(
            seq, hidden[0, (positions - start).to(device)], self.model.lm_head_weight, self.runner.vocab_shard
        )
        seq.nfe += 1
        seq.query_lengths.append(end - start)
        seq.commit(*decide(seq, positions, stats))
        if seq.block == block and not seq.finished:
            return
        eos = self.config.eos_token_id
        if not seq.finished and eos is not None and eos in seq.canvas[start:end].tolist():
            seq.canvas = seq.canvas[:end]  # the answer ended in this block: no further blocks
            seq.finish_reason = "stop"
        if not seq.finished:
            self._causal(seq, cache, start, end)

    def step(self) -> list[Sequence]:
        """Advance every running sequence by one preview pass; return those that finished."""
        for seq in [s for s in self.running if not s.finished]:
            self._advance(seq)
        done = [s for s in self.running if s.finished]
        for seq in done:
            self.caches.pop(seq.seq_id, None)
        self.running = [s for s in self.running if not s.finished]
        return done
