"""LLM: the Python API. `LLM(model).generate(prompts, **params)` returns one output per prompt
(`n` per prompt with `n=`, prompt by prompt)."""

from __future__ import annotations

import logging
import operator
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from collections.abc import Sequence as Seq
from contextlib import contextmanager
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dlm.engine.cpu_plan import Candidate, ModelShape, apply_threads
from dlm.engine.decoding.logprobs import TokenLogprob
from dlm.engine.device import resolve_device
from dlm.engine.dtype import checkpoint_dtype, choose_dtype
from dlm.engine.errors import UsageError
from dlm.engine.params import GenerationParams
from dlm.engine.quantization import method_named
from dlm.engine.resolve import resolve_model
from dlm.engine.runtime.engine import cap_device_memory, load_engine
from dlm.engine.runtime.interface import Engine
from dlm.engine.runtime.request import RequestState
from dlm.engine.runtime.scheduler import forward_tokens
from dlm.engine.runtime.thread_governor import ThreadGovernor, for_plan, governs_by_default, why_no_governor
from dlm.engine.stops import TextOf, covering, ends_at_stop, require_text, stop_cut
from dlm.engine.tokenizer import decode, encode, has_tokenizer, load_tokenizer

log = logging.getLogger("dlm.engine")

if TYPE_CHECKING:
    from dlm.engine.parallel.distributed import ParallelConfig


@dataclass
class GenerationOutput:
    prompt_ids: list[int]
    output_ids: list[int]  # generated ids only
    completion_ids: list[int]  # output_ids up to and including the first EOS (what a server returns)
    text: str | None
    nfe: int  # model forwards spent on this request
    seconds: float
    tokens_per_second: float
    finish_reason: str  # "stop" (EOS, a stop id or a stop string generated) or "length"
    query_lengths: list[int]  # tokens fed to each forward
    cache: str = "none"  # approximate K/V cache used: its cost shows in nfe and query_lengths
    index: int = 0  # which of the prompt's `n` samples (seed + index)
    # with `logprobs=`: per completion token, its log-probability at the step that committed it
    logprobs: list[TokenLogprob] | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class LLM:
    def __init__(
        self,
        model: str | Path | None = None,
        *,
        dtype: str = "auto",
        device: str = "auto",
        on_load: Callable[[str], None] | None = None,
        backend: str = "native",
        trust_remote_code: bool = False,
        parallel: ParallelConfig | None = None,
        gpu_memory_utilization: float | None = None,
        quantization: str | None = None,
        thread_governor: bool | None = None,
        kv_cache_dtype: str = "auto",
    ) -> None:
        """`parallel`: split the model over several processes (dlm/engine/parallel/distributed.py); this
        process is then rank 0 and drives the others until `close()`.
        `gpu_memory_utilization`: the share of each GPU this model may use (a ceiling, see
        `dlm.engine.runtime.engine.cap_device_memory`; no effect on CPU).
        `quantization`: int8, int4 or fp8 weights for the linear layers and experts
        (dlm/engine/quantization.py; docs/quantization.md); None or "none": the dtype's.
        `thread_governor`: on a CPU with more cores than the plan's threads, choose between the
        two counts step by step by measured step time (dlm/engine/runtime/thread_governor.py);
        None (auto): where this CPU's forwards give the same bits with either count
        (`governs_by_default`), so answers cannot depend on it.
        `kv_cache_dtype`: how requests' exact K/V caches store values, `auto` (the model's dtype)
        or `int8` (block-causal families; dlm/engine/runtime/kv_cache.py)."""
        self.quantization = None if method_named(quantization) is None else quantization
        distributed = parallel is not None and parallel.resolved().parallel
        check_backend(backend, distributed, self.quantization, kv_cache_dtype, trust_remote_code)
        self.model_dir = resolve_model(model)
        self.device = resolve_device(device)
        shape = _shape(self.model_dir, self.quantization) if self.device.type == "cpu" else None
        probe = (
            _ModelProbe(self.model_dir, self.device, on_load, self.quantization, kv_cache_dtype)
            if backend == "native" and not distributed
            else None
        )
        timer = probe if probe is not None and shape is not None and probe.affordable() else None
        self.dtype_choice = choose_dtype(dtype, self.device, checkpoint_dtype(self.model_dir), shape, timer)
        self.dtype = self.dtype_choice.dtype
        if self.dtype_choice.threads is not None:
            # On this thread, which runs the forwards (`dlm generate`; `dlm serve` loads on its
            # engine thread, dlm/engine/runtime/async_engine.py): OpenMP counts are per thread.
            apply_threads(self.dtype_choice.threads)
        governed = thread_governor
        if governed is None:  # auto: governed where switching cannot change an answer
            native = shape if backend == "native" and not distributed else None
            governed = governs_by_default(native, self.dtype, self.dtype_choice.threads)
            if governed:
                log.info("thread governor on: this CPU's forwards give the same bits at either thread count")
        self.thread_governor = for_plan(self.dtype_choice.threads) if governed and not distributed else None
        # Asked for but nothing to govern: why, for the server's log and `dlm generate` to say.
        self.thread_governor_off = (
            why_no_governor(distributed, self.device.type, self.dtype_choice.threads)
            if thread_governor and self.thread_governor is None
            else None
        )
        self.memory_capped = cap_device_memory(self.device, gpu_memory_utilization)
        self._tokenizer: Any = None
        # One `generate` decodes at a time (`_decoding`): the engine's step is not thread-safe.
        self._decoding = threading.Lock()
        self._decoding_thread: int | None = None
        # After `close` (the end of a `with` block) nothing decodes: a tensor-parallel engine's
        # ranks are gone (its next step failed as a broken group), a single process's would
        # answer, so the same program behaved one way at one rank and another at two.
        self.closed = False
        self.backend = backend
        self.engine: Engine
        if backend == "transformers":
            from dlm.engine.transformers_backend import load_transformers_engine

            tokenizer = self.tokenizer if has_tokenizer(self.model_dir) else None
            self.engine = load_transformers_engine(
                self.model_dir, self.dtype, self.device, trust_remote_code, tokenizer
            )
        elif backend == "native":
            if parallel is not None and distributed:
                from dlm.engine.parallel.distributed import EngineSpec, start_driver

                # The resolved dtype: every rank runs in the one this process chose.
                spec = EngineSpec(
                    str(self.model_dir),
                    self.dtype_choice.name,
                    device,
                    gpu_memory_utilization,
                    self.quantization,
                    kv_cache_dtype,
                )
                self.engine = start_driver(spec, parallel)
                self.device = self.engine.loaded.device
            else:
                kept = probe.take(self.dtype) if probe is not None else None
                self.engine = kept or load_engine(
                    self.model_dir, self.dtype, self.device, on_load, self.quantization, kv_cache_dtype
                )
        else:
            raise UsageError(f"backend must be native or transformers, got {backend!r}")
        self.config = self.engine.config
        if backend == "native":  # a pre-quantized checkpoint brings its own method
            self.quantization = self.engine.loaded.quantization

    def close(self) -> None:
        """Release the worker ranks of a tensor-parallel engine; `generate` is refused after."""
        self.closed = True
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def tokenizer(self) -> Any:
        if self._tokenizer is None:
            self._tokenizer = load_tokenizer(self.model_dir)
        return self._tokenizer

    def encode(
        self, prompt: str | Seq[int], chat: bool = False, chat_template_kwargs: dict[str, Any] | None = None
    ) -> list[int]:
        """A prompt's ids: text through the tokenizer (with `chat`, the chat template and its
        extra variables `chat_template_kwargs`, as the server's chat requests take them), ids as
        they are."""
        if chat_template_kwargs is not None and not isinstance(chat_template_kwargs, dict):
            raise UsageError(
                f"chat_template_kwargs must be a dict, got {type(chat_template_kwargs).__name__}",
                field="chat_template_kwargs",
            )
        if isinstance(prompt, str):
            return encode(self.tokenizer, prompt, chat=chat, template_kwargs=chat_template_kwargs)
        if chat or chat_template_kwargs:
            raise UsageError("chat templates apply to text prompts, not token ids")
        return token_ids(prompt)

    def generate(
        self,
        prompts: str | Seq[int] | Seq[str | Seq[int]],
        params: GenerationParams | None = None,
        *,
        chat: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
        on_step: Callable[[list[RequestState]], None] | None = None,
        **overrides: Any,
    ) -> list[GenerationOutput]:
        """Decode one prompt or a list of prompts (text or token ids) together. `suffix`
        (text or ids) is infilled after the answer; `n` samples per prompt come back prompt
        by prompt (`GenerationOutput.index`). `stop` (a string or a list) ends an answer where
        its first stop string starts (dlm/engine/stops.py: the rule a server applies). With
        `chat`, text prompts go through the chat template, given `chat_template_kwargs`' extra
        variables (a chat request's field of that name). `on_step` is called after every
        denoising step with the sequences; `seq.canvas_view()` is the canvas then (committed,
        provisional and masked positions), as the server streams it to clients that ask
        (docs/serve.md, "Canvas streaming")."""
        batch = prompt_list(prompts)
        if params is not None and not isinstance(params, GenerationParams):
            raise UsageError(
                f"params must be a GenerationParams, got {type(params).__name__} (or give its fields as keyword "
                "arguments: generate(prompt, gen_length=64))"
            )
        if isinstance(overrides.get("suffix"), str):  # infilling text: its ids, as a completion's prompt
            overrides["suffix"] = tuple(self.encode(overrides["suffix"]))
        if params is None or overrides:  # resolved parameters pass through unchanged
            given = {f.name: getattr(params, f.name) for f in fields(GenerationParams)} if params else {}
            params = GenerationParams(**{**given, **overrides})
        ids = [self.encode(p, chat=chat, chat_template_kwargs=chat_template_kwargs) for p in batch]
        decodable = has_tokenizer(self.model_dir)
        require_text(params.stop, decodable)
        if self.thread_governor is not None:
            on_step = governed(self.thread_governor, self.engine, on_step)
        # Stop strings end a sequence at the step whose committed text first holds one, as a
        # server's engine thread ends it: the same forwards through every entry point.
        ends = ends_at_stop(self._text_of) if params.stop else None
        with self._one_at_a_time():
            start = time.perf_counter()
            seqs = self.engine.generate(ids, params, on_step=on_step, ends=ends)
            seconds = time.perf_counter() - start
        outputs = []
        for i, s in enumerate(seqs):
            text, completion_ids, finish_reason = self._answer(s) if decodable else (None, s.completion_ids, None)
            outputs.append(
                GenerationOutput(
                    prompt_ids=s.prompt_ids,
                    output_ids=s.output_ids,
                    completion_ids=completion_ids,
                    text=text,
                    nfe=s.nfe,
                    seconds=seconds,
                    tokens_per_second=len(s.output_ids) / seconds if seconds > 0 else 0.0,
                    finish_reason=finish_reason or s.finish_reason or "length",
                    query_lengths=s.query_lengths,
                    cache=s.params.cache,
                    index=i % params.n,
                    logprobs=s.token_logprobs(completion_ids),
                )
            )
        return outputs

    @contextmanager
    def _one_at_a_time(self) -> Iterator[None]:
        """Calls from several threads decode one after another. Two at once each stepped the
        one engine (its running set holds both calls' sequences): steps ran concurrently, so
        answers differed from a lone call's, or a step failed with a torch index error. A call
        from inside a running call (its `on_step`) is refused: it would wait on itself."""
        if self.closed:
            raise UsageError("this LLM is closed (LLM.close, or the end of its with block)")
        if self._decoding_thread == threading.get_ident():
            raise UsageError("LLM.generate was called from inside a running generate (its on_step)")
        with self._decoding:
            self._decoding_thread = threading.get_ident()
            try:
                yield
            finally:
                self._decoding_thread = None

    def _text_of(self, seq: RequestState) -> TextOf:
        """The text of `seq`'s generated ids, up to its first stop id."""
        return lambda ids: decode(self.tokenizer, ids, seq.stop_ids)

    def _answer(self, seq: RequestState) -> tuple[str, list[int], str | None]:
        """A finished sequence's text, completion ids and finish reason (None: its own): cut
        where its first stop string starts, to the ids that spell what is kept, as a server
        answers (dlm/engine/stops.py)."""
        text_of = self._text_of(seq)
        completion_ids = seq.completion_ids
        if seq.params.stop:
            text, cut = stop_cut(text_of, seq.committed_prefix, seq.params)
            if cut is not None:
                return text[:cut], completion_ids[: covering(text_of, completion_ids, cut)], "stop"
        return text_of(seq.output_ids), completion_ids, None


PROMPTS = "a text, a list of token ids, or a list of those"


def prompt_list(prompts: Any) -> list[Any]:
    """`LLM.generate`'s prompts as a list of prompts (each text, or token ids): one text or one
    list of ids is one prompt; any other iterable (a generator, a tuple, an array) is a list of
    prompts, read once. Anything else (None, a number, bytes) is a UsageError: None was
    "'NoneType' object is not iterable", a generator "not subscriptable", a numpy array or
    torch tensor of ids "truth value ... is ambiguous", and bytes were read as token ids."""
    if isinstance(prompts, str):
        return [prompts]
    refused = UsageError(f"prompts must be {PROMPTS}, got {type(prompts).__name__}", field="prompt")
    if isinstance(prompts, (bytes, bytearray)) or not isinstance(prompts, Iterable):
        raise refused
    try:
        items = list(prompts)
    except TypeError:  # iterable by type, not by value: a 0-d tensor ("iteration over a 0-d tensor")
        raise refused from None
    return [items] if items and is_token_id(items[0]) else items


def is_token_id(value: Any) -> bool:
    """An integer (numpy's and torch's integer scalars too), not a bool."""
    if isinstance(value, (bool, str, bytes)):
        return False
    try:
        operator.index(value)
    except TypeError:
        return False
    return True


def token_ids(prompt: Any) -> list[int]:
    """A prompt of token ids as ints; a UsageError for anything that is not ids (`int(t)`
    truncated 1.5 to 1 and read "12" as 12, and bytes were read as ids)."""
    if isinstance(prompt, (bytes, bytearray)) or not isinstance(prompt, Iterable):
        raise UsageError(f"a prompt must be {PROMPTS}, got {type(prompt).__name__}", field="prompt")
    ids = list(prompt)
    bad = next((t for t in ids if not is_token_id(t)), None)
    if bad is not None:
        raise UsageError(f"prompt token ids must be integers, got {bad!r}", field="prompt")
    return [operator.index(t) for t in ids]


def check_backend(
    backend: str, distributed: bool, quantization: str | None, kv_cache_dtype: str, trust_remote_code: bool
) -> None:
    """Refuse the settings `backend` cannot honour, before anything loads: `LLM` asks first,
    and `dlm serve` with its settings, before it prints them and opens its port (a refusal
    from the load came after both). `quantization`: a method, None for the dtype's weights."""
    if backend == "native":
        if trust_remote_code:
            raise UsageError("--trust-remote-code only applies to --backend transformers")
        return
    if distributed:
        raise UsageError("--tensor-parallel-size needs the native backend")
    if quantization is not None:
        raise UsageError(
            "--quantization needs the native backend: the transformers backend runs the checkpoint's "
            "own layers, which dlm does not quantize"
        )
    if kv_cache_dtype != "auto":
        raise UsageError("--kv-cache-dtype needs the native backend: the transformers backend keeps its own")


def governed(
    governor: ThreadGovernor, engine: Engine, on_step: Callable[[list[RequestState]], None] | None
) -> Callable[[list[RequestState]], None]:
    """`on_step` after the governor has seen the step's time and set the next one's threads
    (on this thread: the one `Engine.generate` steps on). The first step of a call is not
    observed: it follows the request's preparation and its time is not a step's."""
    last: list[float] = []
    tokens = [0]

    def step_done(seqs: list[RequestState]) -> None:
        now = time.perf_counter()
        if last:
            governor.observe(now - last[0], tokens[0])
        apply_threads(governor.threads)
        if on_step is not None:
            on_step(seqs)
        tokens[0] = sum(forward_tokens(s) for s in engine.running)
        last[:] = [time.perf_counter()]

    return step_done


def _shape(model_dir: Path, quantization: str | None) -> ModelShape | None:
    """The model's layer shape for the CPU plan (with the weights' quantization, which times
    differently); None for a checkpoint no native family reads (the transformers backend):
    its dtype and threads are then not measured."""
    from dlm.engine.config import config_from_dict, read_config_json

    try:
        return replace(ModelShape.of(config_from_dict(read_config_json(model_dir))), weights=quantization or "dense")
    except UsageError:
        return None


# The timed request: the engine's warm-up request (each block committed in one forward) over a
# prompt and an answer of this many tokens: a canvas as long as a short chat's.
PROBE_TOKENS = 64


class _ModelProbe:
    """Times the model's own forward in a candidate dtype for the CPU plan
    (dlm/engine/cpu_plan.py): the engine is loaded in each dtype once, the one chosen is kept
    (`take`) and the others are dropped."""

    def __init__(
        self,
        model_dir: Path,
        device: Any,
        on_load: Callable[[str], None] | None,
        quantization: str | None,
        kv_cache_dtype: str,
    ) -> None:
        self.model_dir, self.device, self.on_load, self.quantization = model_dir, device, on_load, quantization
        self.kv_cache_dtype = kv_cache_dtype
        self.engines: dict[Any, Engine] = {}

    def affordable(self) -> bool:
        """Small enough to hold in two dtypes for the measurement."""
        from dlm.engine.cpu_plan import MODEL_PROBE_MAX_BYTES

        size = sum(f.stat().st_size for f in self.model_dir.glob("*.safetensors"))
        return 0 < size <= MODEL_PROBE_MAX_BYTES

    def __call__(self, candidate: Candidate) -> float:
        engine = self.engines.get(candidate.dtype)
        if engine is None:
            engine = self.engines[candidate.dtype] = load_engine(
                self.model_dir, candidate.dtype, self.device, self.on_load, self.quantization, self.kv_cache_dtype
            )
        prompt = [engine.config.eos_token_id or 0] * PROBE_TOKENS
        params = replace(engine.warmup_params, gen_length=PROBE_TOKENS)
        start = time.perf_counter()
        engine.generate([prompt], params)
        return time.perf_counter() - start

    def take(self, dtype: Any) -> Engine | None:
        engine = self.engines.pop(dtype, None)
        self.engines.clear()
        return engine
