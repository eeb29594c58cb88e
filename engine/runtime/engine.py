"""LLMEngine: owns the model and runs denoising steps over a set of sequences.

`step()` is the unit of work: one batched forward for every unfinished sequence, then one
commit decision per sequence. `generate()` steps until all given sequences are done; the
server's scheduler (continuous batching) drives `step()` itself.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.config import ModelConfig, load_config
from engine.decoding.step import decide
from engine.errors import UsageError
from engine.layers.linear import lm_head_shard
from engine.loader import load_weights
from engine.params import Forwards, GenerationParams, ResolvedParams
from engine.registry import family_for, family_named
from engine.runtime.block_runner import BlockRunner
from engine.runtime.block_sequence import PREFILL_CHUNK, BlockSequence
from engine.runtime.runner import ModelRunner
from engine.runtime.sequence import Sequence

DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        return torch.device(device)
    except RuntimeError as exc:
        raise UsageError(f"unknown device {device!r}") from exc


def cap_device_memory(device: torch.device, fraction: float | None) -> bool:
    """Cap this process's share of `device`'s memory (weights, caches, activations) at
    `fraction` of its capacity, so a server sharing a GPU gets an out-of-memory error rather
    than taking what other processes need. dlm allocates caches per request, so, unlike
    vLLM's `gpu_memory_utilization`, nothing is reserved up front: this is a ceiling. CUDA
    only; returns whether a cap was applied."""
    if fraction is None:
        return False
    if not 0.0 < fraction <= 1.0:
        raise UsageError(f"gpu_memory_utilization must be in (0, 1], got {fraction}")
    if device.type != "cuda":
        return False
    torch.cuda.set_per_process_memory_fraction(fraction, device)
    return True


def resolve_dtype(dtype: str) -> torch.dtype:
    """'auto' is bf16: on GPUs it is the serving dtype, and on AMX/AVX512-BF16 CPUs bf16
    matmuls run several times faster than fp32. Reproducibility checks pass float32."""
    if dtype == "auto":
        return torch.bfloat16
    if dtype not in DTYPES:
        raise UsageError(f"unknown dtype {dtype!r}; use auto, {', '.join(DTYPES)}")
    return DTYPES[dtype]


@dataclass
class LoadedModel:
    config: ModelConfig
    model: torch.nn.Module
    dtype: torch.dtype
    device: torch.device


def build_on_meta(config: ModelConfig) -> torch.nn.Module:
    """The family's model without storage, shaped for this process's tensor-parallel shard;
    a split the layers cannot make raises `UsageError` (one line, not a traceback)."""
    cls = family_for(config.raw).model_class()
    try:
        with torch.device("meta"):
            return cls(config)
    except ValueError as exc:  # the parallel layers refuse an uneven split
        raise UsageError(str(exc)) from exc


def load_model(
    model_dir: Path,
    dtype: torch.dtype,
    device: torch.device,
    on_tensor: Callable[[str], None] | None = None,
) -> LoadedModel:
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise UsageError(f"model directory {model_dir} does not exist")
    config = load_config(model_dir)
    model = build_on_meta(config)
    load_weights(model, model_dir, dtype, device, on_tensor=on_tensor)
    return LoadedModel(config, model.eval(), dtype, device)


def load_engine(
    model_dir: Path | str,
    dtype: torch.dtype,
    device: torch.device,
    on_tensor: Callable[[str], None] | None = None,
) -> LLMEngine:
    """The family's native engine over the checkpoint in `model_dir` (this rank's shard
    under tensor parallelism). Which engine decodes a family is known before any weight
    is read."""
    from engine.config import read_config_json

    engine_class = family_for(read_config_json(Path(model_dir))).engine_class()
    return engine_class(load_model(Path(model_dir), dtype, device, on_tensor))


class LLMEngine:
    # The serving warm-up request (engine/runtime/async_engine.py): the family picks the block
    # length; a tiny threshold commits each block in one forward.
    warmup_params = GenerationParams(gen_length=32, threshold=1e-6)

    def __init__(self, loaded: LoadedModel) -> None:
        self.loaded = loaded
        self.config = loaded.config
        self.family = family_named(loaded.config.family)
        self.runner = ModelRunner(loaded.model, loaded.device, lm_head_shard(loaded.config.logits_size))
        # Block-causal families (exact KV cache, AR mode) run through their own runner.
        self.block_runner = (
            BlockRunner(loaded.model, loaded.config, loaded.dtype, loaded.device) if self.family.block_causal else None
        )
        self.running: list[Sequence | BlockSequence] = []

    def validate(self, params: GenerationParams, prompt_length: int) -> ResolvedParams:
        """Resolve the family's defaults and validate: what every entry point should call.
        Parameters already resolved (this call at the boundary) pass as they are."""
        if isinstance(params, ResolvedParams):
            return params
        if self.block_runner is None:
            return params.validate(prompt_length, self.config.max_position_embeddings, self.family)
        rules = self.block_runner.rules
        # openPangu's commit forward of a block also decides the next block's first token.
        forwards = Forwards(
            rules.aligned_grid, rules.sub_blocks, 1 if rules.logit_shift else 0, PREFILL_CHUNK, rules.causal_context
        )
        return self.block_runner.resolve(params).validate(
            prompt_length, self.config.max_position_embeddings, self.family, forwards=forwards
        )

    def add_request(self, prompt_ids: list[int], params: GenerationParams) -> Sequence | BlockSequence:
        seq = self.make_sequence(prompt_ids, params)
        self.running.append(seq)
        return seq

    def make_sequence(self, prompt_ids: list[int], params: GenerationParams) -> Sequence | BlockSequence:
        """Validate a request and build its sequence without running it: the serving
        scheduler (engine/runtime/scheduler.py) decides when it joins `running`."""
        resolved = self.validate(params, len(prompt_ids))
        self.check_prompt(prompt_ids)
        seq: Sequence | BlockSequence
        if self.block_runner is not None:
            seq = self.block_runner.new_sequence(prompt_ids, resolved, self.config.eos_token_id)
        else:
            seq = Sequence(
                list(prompt_ids),
                resolved,
                self.config.mask_token_id,
                self.config.eos_token_id,
                sampler=self.family.sampler,
            )
        if resolved.seed is not None:
            seq.generator = torch.Generator(device=self.loaded.device).manual_seed(resolved.seed)
        return seq

    def check_prompt(self, prompt_ids: list[int]) -> None:
        bad = [t for t in prompt_ids if not 0 <= t < self.config.logits_size]
        if bad:
            raise UsageError(f"prompt token id {bad[0]} is outside the vocabulary (0..{self.config.logits_size - 1})")

    def cache_bytes(self) -> int:
        """Bytes of K/V cache (and recurrent state) the running requests hold on this
        process: what grows with concurrency and context besides the weights."""
        return sum(seq.cache_bytes for seq in list(self.running))  # a snapshot: scrapes run beside steps

    def abort(self, seq: Sequence | BlockSequence, reason: str = "abort") -> None:
        """Finish `seq` now (timeout, cancel, early stop): it is not part of the next forward."""
        if seq.finish_reason is None:
            seq.finish_reason = reason
        self.running = [s for s in self.running if s is not seq]

    def step(self) -> list[Sequence | BlockSequence]:
        """Advance every running sequence by one denoising step; return those that finished."""
        active = [s for s in self.running if not s.finished]
        if active and self.block_runner is not None:
            self.block_runner.step(active)  # type: ignore[arg-type]
        elif active:
            for seq, (positions, stats) in zip(active, self.runner.step(active)):
                seq.commit(*decide(seq, positions, stats))
        done = [s for s in self.running if s.finished]
        self.running = [s for s in self.running if not s.finished]
        return done

    def generate(
        self,
        prompts: list[list[int]],
        params: GenerationParams,
        on_step: Callable[[list[Sequence | BlockSequence]], None] | None = None,
    ) -> list[Sequence | BlockSequence]:
        seqs = [self.add_request(p, params) for p in prompts]
        while any(not s.finished for s in seqs):
            self.step()
            if on_step is not None:
                on_step(seqs)
        return seqs
