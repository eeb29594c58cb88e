"""LLMEngine: owns the model and runs denoising steps over a set of sequences.

`step()` is the unit of work: one batched forward for every unfinished sequence, then one
commit decision per sequence. `generate()` steps until all given sequences are done; the
server's scheduler (continuous batching) drives `step()` itself.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from dlm.engine.capabilities import supported
from dlm.engine.compressed_tensors import placement, read_scheme
from dlm.engine.config import ModelConfig, check_fits_weights, load_config, read_config_json
from dlm.engine.decoding.constrain import Constraint, Vocabulary, layout
from dlm.engine.errors import Name, Unsupported, UsageError
from dlm.engine.family_rules import validate
from dlm.engine.layers.linear import lm_head_shard
from dlm.engine.loader import load_weights, stored_values
from dlm.engine.parallel import state as parallel_state
from dlm.engine.params import GenerationParams, ResolvedParams, reproducible
from dlm.engine.quantization import check_kv_cache_dtype, method_named
from dlm.engine.quantized_weights import quantizable, quantizer
from dlm.engine.registry import family_for, family_named
from dlm.engine.runtime.block_runner import BlockRunner
from dlm.engine.runtime.interface import Engine, Runner
from dlm.engine.runtime.prefix_cache import PrefixCache, PrefixCacheStats
from dlm.engine.runtime.request import RequestState
from dlm.engine.runtime.runner import MIN_ROWS, ModelRunner
from dlm.engine.runtime.sequence import Sequence
from dlm.engine.runtime.step_graphs import ShapeBuckets, StepGraphs, graph_mode
from dlm.engine.structured import FIELD
from dlm.kernels import dispatch


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


@dataclass
class LoadedModel:
    config: ModelConfig
    model: torch.nn.Module
    dtype: torch.dtype
    device: torch.device
    model_dir: Path | None = None  # where its tokenizer is, for response formats
    quantization: str | None = None  # the weight format of its linear layers (dlm/engine/quantization.py)
    kv_cache_dtype: str = "auto"  # how its requests' exact K/V caches store values (quantization.KV_CACHE_DTYPES)


# torch.nn.init's fills, which the layers' constructors call. On meta tensors they have nothing
# to fill (the checkpoint's weights replace them), yet `normal_` there runs through torch's
# Python decompositions, whose first use imports torch._dynamo, sympy and triton: 145 MiB of a
# server's resident memory (docs/serve.md#memory) for nothing.
_INIT_FILLS = ("normal_", "uniform_", "kaiming_uniform_", "kaiming_normal_", "trunc_normal_", "xavier_uniform_")


@contextmanager
def _no_init() -> Iterator[None]:
    """While the model is built on the meta device: the init fills leave tensors as they are."""
    saved = {name: getattr(torch.nn.init, name) for name in _INIT_FILLS}
    for name in _INIT_FILLS:
        setattr(torch.nn.init, name, lambda tensor, *args, **kwargs: tensor)
    try:
        yield
    finally:
        for name, fill in saved.items():
            setattr(torch.nn.init, name, fill)


def build_on_meta(config: ModelConfig) -> torch.nn.Module:
    """The family's model without storage, shaped for this process's tensor-parallel shard;
    a split the layers cannot make raises `UsageError` (one line, not a traceback)."""
    cls = family_named(config.family).model_class()
    try:
        with torch.device("meta"), _no_init():
            return cls(config)
    except ValueError as exc:  # the parallel layers refuse an uneven split
        raise UsageError(str(exc)) from exc


def weights_config(model_dir: Path) -> ModelConfig:
    """The config.json of the checkpoint in `model_dir`, held against its weights' size
    before anything builds its model (`check_fits_weights`)."""
    config = load_config(model_dir)
    check_fits_weights(config, stored_values(model_dir))
    return config


def load_model(
    model_dir: Path,
    dtype: torch.dtype,
    device: torch.device,
    on_tensor: Callable[[str], None] | None = None,
    quantization: str | None = None,
) -> LoadedModel:
    """The family's model over the checkpoint in `model_dir`; with `quantization` (a name of
    dlm/engine/quantization.py) its linear layers and experts are quantized as they load."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise UsageError(f"model directory {model_dir} does not exist")
    config = weights_config(model_dir)
    method = method_named(quantization)
    scheme = read_scheme(read_config_json(model_dir))
    model = build_on_meta(config)
    decoded = None
    if scheme is not None:  # a pre-quantized checkpoint: its own weights, scales and method
        if method is not None and method.name != scheme.method:
            raise UsageError(
                f"{model_dir.name} is already quantized ({scheme.method}, compressed-tensors): "
                f"--quantization {method.name} cannot apply; omit it or give {scheme.method}"
            )
        if parallel_state.current().size > 1:
            raise UsageError(
                "pre-quantized checkpoints are not split over tensor-parallel ranks (their packed data and "
                "scales are read whole); serve the bf16/fp32 checkpoint with --quantization instead"
            )
        place, decoded = placement(model, model_dir, scheme, dtype, device)
        method = method_named(scheme.method)
    else:
        place = linear_placement(model, dtype, device) if method is None else quantizer(model, method, dtype, device)
    load_weights(model, model_dir, dtype, device, on_tensor=on_tensor, place=place, decoded=decoded)
    return LoadedModel(config, model.eval(), dtype, device, model_dir, None if method is None else method.name)


def linear_placement(
    model: torch.nn.Module, dtype: torch.dtype, device: torch.device
) -> Callable[[str, torch.Tensor], torch.Tensor] | None:
    """The loader's placement that holds each linear layer's weight in the layout the kernels'
    dispatch gives it (bf16 on a CPU with native bf16: packed once for oneDNN,
    dlm/kernels/packed_linear.py), or None where every weight stays plain. The layers are the
    ones quantization applies to (`quantizable`: not the LM head, embeddings or routers),
    stacked experts aside."""
    if dispatch.linear_layout(dtype, device) == "dense":
        return None
    params = dict(model.named_parameters())
    linears = {name for name in quantizable(model) if params[name].dim() == 2}

    def place(name: str, tensor: torch.Tensor) -> torch.Tensor:
        tensor = tensor.to(device=device, dtype=dtype)
        return dispatch.prepare_linear_weight(tensor) if name in linears else tensor

    return place


def load_engine(
    model_dir: Path | str,
    dtype: torch.dtype,
    device: torch.device,
    on_tensor: Callable[[str], None] | None = None,
    quantization: str | None = None,
    kv_cache_dtype: str = "auto",
) -> LLMEngine:
    """The family's native engine over the checkpoint in `model_dir` (this rank's shard
    under tensor parallelism). Which engine decodes a family is known before any weight
    is read, and so is whether it takes `kv_cache_dtype` (`check_kv_cache_dtype`)."""
    from dlm.engine.config import read_config_json

    family = family_for(read_config_json(Path(model_dir)))
    check_kv_cache_dtype(kv_cache_dtype, family)
    loaded = load_model(Path(model_dir), dtype, device, on_tensor, quantization)
    loaded.kv_cache_dtype = kv_cache_dtype
    return family.engine_class()(loaded)


class LLMEngine(Engine):
    """The native engine: the family's runner over one running set (satisfies `Engine`)."""

    # The serving warm-up request (dlm/engine/runtime/async_engine.py): the family picks the block
    # length; a tiny threshold commits each block in one forward.
    warmup_params = GenerationParams(gen_length=32, threshold=1e-6)
    path: str | None = None  # native: not the transformers backend
    max_num_seqs: int | None = None  # batches as many sequences as the caller admits
    tensor_parallel_size = 1

    def __init__(self, loaded: LoadedModel) -> None:
        self.loaded = loaded
        self.config = loaded.config
        self.family = family_named(loaded.config.family)
        self.runner = self.make_runner()
        self._running: list[RequestState] = []
        self._vocabulary: Vocabulary | Unsupported | None = None

    def make_runner(self) -> Runner:
        """Block-causal families (exact KV cache, AR mode) have their own runner."""
        loaded = self.loaded
        if self.family.block_causal:
            return BlockRunner(loaded.model, loaded.config, loaded.dtype, loaded.device, loaded.kv_cache_dtype)
        shard = lm_head_shard(loaded.config.logits_size)
        return ModelRunner(loaded.model, loaded.config, loaded.device, self.family.sampler, shard)

    @property
    def running(self) -> list[RequestState]:
        return self._running

    @property
    def capabilities(self) -> tuple[str, ...]:
        return supported(self.family)

    def reproducible(self, params: ResolvedParams) -> bool:
        return reproducible(params, self.family)

    def validate(self, params: GenerationParams, prompt_length: int) -> ResolvedParams:
        """Resolve the family's defaults and validate: what every entry point should call.
        The same check as before loading (dlm/engine/family_rules.py), from the loaded config.
        Parameters already resolved (this call at the boundary) pass as they are."""
        if isinstance(params, ResolvedParams):
            return params
        return validate(params, prompt_length, self.config)

    def make_sequence(self, prompt_ids: list[int], params: GenerationParams) -> RequestState:
        """Validate a request and build its sequence without running it: the serving
        scheduler (dlm/engine/runtime/scheduler.py) decides when it joins `running`."""
        resolved, laid = self._checked(prompt_ids, params)
        return self._build(prompt_ids, resolved, laid)

    def make_sequences(self, prompt_ids: list[int], params: GenerationParams) -> list[RequestState]:
        """The request's `n` samples, validated and laid out once (a response format's
        skeleton is tokenized once, however many samples share it)."""
        resolved, laid = self._checked(prompt_ids, params)
        return [self._build(prompt_ids, sample, laid) for sample in resolved.samples()]

    def check_request(self, prompt_ids: list[int], params: GenerationParams) -> ResolvedParams:
        return self._checked(prompt_ids, params)[0]

    def _checked(
        self, prompt_ids: list[int], params: GenerationParams
    ) -> tuple[ResolvedParams, tuple[list[int], Constraint] | None]:
        """Everything that may refuse a request, before any sequence exists: its parameters
        resolved, its ids and its response format's layout (`_laid`). Building then refuses
        nothing a family's rules let through."""
        resolved = self.validate(params, len(prompt_ids))
        return resolved, self._laid(prompt_ids, resolved)

    def _laid(self, prompt_ids: list[int], resolved: ResolvedParams) -> tuple[list[int], Constraint] | None:
        """Check the ids; the answer's skeleton and its constraint, when the request has a
        response format (read-only: every sample of the request shares them)."""
        self.check_prompt(prompt_ids)
        self.check_prompt(list(resolved.suffix), "suffix")
        if resolved.skeleton is None:
            return None
        config = self.config
        return layout(
            resolved.skeleton,
            self.vocabulary(),
            resolved.gen_length,
            config.mask_token_id,
            config.eos_token_id,
            len(prompt_ids),
        )

    def _build(
        self, prompt_ids: list[int], resolved: ResolvedParams, laid: tuple[list[int], Constraint] | None
    ) -> RequestState:
        seq = self.runner.new_sequence(prompt_ids, resolved, self.config.eos_token_ids)
        if laid is not None:
            if not isinstance(seq, Sequence):
                raise Unsupported("response_format is not available on this decoding path", field=FIELD)
            seq.lay(*laid)
        if resolved.seed is not None:
            seq.generator = torch.Generator(device=self.loaded.device).manual_seed(resolved.seed)
        return seq

    def add(self, seq: RequestState) -> None:
        self._running.append(seq)

    def vocabulary(self) -> Vocabulary:
        """The token classes response formats are decoded under, built on first use from
        the checkpoint's tokenizer (every tensor-parallel rank builds the same); a tokenizer
        that cannot carry them is refused once and remembered."""
        if isinstance(self._vocabulary, Unsupported):
            raise self._vocabulary
        if self._vocabulary is None:
            from dlm.engine.tokenizer import has_tokenizer, load_tokenizer

            model_dir = self.loaded.model_dir
            if model_dir is None or not has_tokenizer(model_dir):
                raise Unsupported(
                    "response_format needs the checkpoint's tokenizer, which this model lacks", field=FIELD
                )
            config = self.config
            excluded = {config.mask_token_id, *config.eos_token_ids}
            try:
                self._vocabulary = Vocabulary.from_tokenizer(load_tokenizer(model_dir), config.logits_size, excluded)
            except Unsupported as exc:
                self._vocabulary = exc
                raise
        return self._vocabulary

    def check_prompt(self, prompt_ids: list[int], field: str = "prompt") -> None:
        bad = [t for t in prompt_ids if not 0 <= t < self.config.logits_size]
        if bad:
            raise UsageError(
                (Name(field), f" token id {bad[0]} is outside the vocabulary (0..{self.config.logits_size - 1})"),
                field=field,
            )

    def cache_bytes(self) -> int:
        """Bytes of K/V cache (and recurrent state) the running requests hold on this
        process: what grows with concurrency and context besides the weights."""
        return sum(seq.cache_bytes for seq in list(self._running))  # a snapshot: scrapes run beside steps

    def enable_prefix_cache(self, budget_bytes: int) -> bool:
        """Block-causal families only: their context K/V is exact across requests; the
        bidirectional runner's prompt K/V depends on the answer (dlm/engine/runtime/prefix_cache.py)."""
        if budget_bytes <= 0 or not isinstance(self.runner, BlockRunner):
            return False
        self.runner.prefix_cache = PrefixCache(budget_bytes)
        return True

    def enable_step_graphs(self, choice: str, max_batch: int) -> str | None:
        """Bidirectional native families: static-shape forwards (dlm/engine/runtime/step_graphs.py),
        CUDA graphs on CUDA. The block runner's rows read per-request caches of growing
        length, which a graph cannot hold yet; the transformers backend runs foreign code."""
        mode = graph_mode(choice, self.loaded.device)
        runner = self.runner
        if mode is None or self.path is not None or type(runner) is not ModelRunner:
            return None
        cfg = self.config
        block = cfg.block_length or cfg.max_position_embeddings
        buckets = ShapeBuckets(2 * max_batch, cfg.max_position_embeddings, MIN_ROWS, block)  # CFG: 2 rows each
        runner.graphs = StepGraphs(runner.model, buckets, self.loaded.device, mode, cfg.mask_token_id)
        return mode

    def prefix_cache_stats(self) -> PrefixCacheStats:
        runner = self.runner
        cache = runner.prefix_cache if isinstance(runner, BlockRunner) else None
        return PrefixCacheStats() if cache is None else cache.stats()

    def abort(self, seq: RequestState, reason: str = "abort") -> None:
        seq.finish(reason)
        self._running = [s for s in self._running if s is not seq]

    def step(self) -> list[RequestState]:
        """Advance every running sequence by one denoising step; return those that finished."""
        active = [s for s in self._running if not s.finished]
        if active:
            self.runner.step(active)
        done = [s for s in self._running if s.finished]
        self._running = [s for s in self._running if not s.finished]
        return done
