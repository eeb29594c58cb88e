"""The transformers backend: serve a checkpoint dlm has no native family for, the day it lands.

The checkpoint is loaded with transformers (its remote code only when the caller passes
`trust_remote_code=True`). Then one of two paths, chosen by probing the loaded model:

- "forward": the model's forward answers every input position and is bidirectional
  (changing the last token changes the first position's output), takes an attention mask,
  has a linear output head and a MASK id is known. dlm's own decoding drives it:
  `LLMEngine` (continuous batching, schedules, threshold/factor commits, CFG, token_stats
  on the decided rows only) runs over a thin adapter. Cost versus native: the model still
  computes logits for every position and has no dlm caches.
- "generate": anything else (a causal LM, an encoder-decoder block-diffusion model, a
  remote-code dLLM with its own sampler). The model's own generation method is called,
  `diffusion_generate` when it has one, else `generate`, one request at a time: no
  cross-request batching, no dlm caches, dlm's commit rules do not apply.

Both paths are LLMEngines (the `Engine` protocol) over their own runner, so `dlm generate`
and `dlm serve` (its scheduler, limits, metrics) drive them like a native model.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dlm.engine.config import NO_MASK, ModelConfig, read_config_json
from dlm.engine.errors import DlmError, Name, Unsupported, UsageError
from dlm.engine.params import GenerationParams, ResolvedParams
from dlm.engine.registry import UNREGISTERED
from dlm.engine.runtime.batch import ForwardBatch, gather_rows
from dlm.engine.runtime.engine import LLMEngine, LoadedModel
from dlm.engine.runtime.request import RequestState, narrow
from dlm.engine.runtime.sequence import Sequence

PATHS = {
    "forward": "dlm decoding over the model's forward (batched across requests; "
    "full-canvas logits every step, no dlm caches)",
    "generate": "the model's own generation method, one request at a time "
    "(no cross-request batching, no dlm caches, dlm commit rules unused)",
}
# What the generate path further costs a server (said at `dlm serve` start-up after PATHS).
GENERATE_SERVING_COSTS = (
    "max_num_seqs is 1; a stream sends the answer in one piece at the end; a timeout or "
    "disconnect stops a queued request but not a running generation; dLLM fields the method "
    "does not take (steps, block_length, threshold, ...) are refused with 400"
)


def _check_loadable(model_dir: Path, trust_remote_code: bool) -> None:
    """Refuse, from config.json, a checkpoint transformers cannot load: a model type it does not
    know, unless the checkpoint ships its own code (`auto_map`) and the user trusts it."""
    import transformers

    raw = read_config_json(model_dir)
    model_type = raw.get("model_type")
    if model_type in transformers.CONFIG_MAPPING:
        return
    if "AutoConfig" not in (raw.get("auto_map") or {}):
        raise UsageError(
            f"transformers {transformers.__version__} does not know model type {model_type!r}, and "
            f"{model_dir} ships no code of its own (no auto_map in config.json)"
        )
    if not trust_remote_code:
        raise UsageError(
            f"{model_dir} needs its own remote code to load; pass --trust-remote-code only if you trust that code"
        )


def _load(model_dir: Path, dtype: torch.dtype, device: torch.device, trust_remote_code: bool) -> Any:
    """The checkpoint as transformers loads it, trying the head classes a dLLM may use."""
    import transformers
    from transformers.utils import logging as hf_logging

    from dlm.engine.quantized_weights import quiet_torchao_import
    from dlm.engine.utf8_paths import utf8_path

    hf_logging.set_verbosity_error()
    _check_loadable(model_dir, trust_remote_code)
    try:
        config = transformers.AutoConfig.from_pretrained(str(model_dir), trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as exc:  # transformers' own words, first line (the rest is advice on upgrading)
        raise UsageError(f"transformers cannot read {model_dir}: {str(exc).splitlines()[0]}") from exc
    errors = []
    # transformers' "Loading weights" bar only on a terminal, as every progress bar of dlm
    # (docs/cli.md): a script's stderr holds lines, not carriage-return frames
    bars = hf_logging.is_progress_bar_enabled()
    if not sys.stderr.isatty():
        hf_logging.disable_progress_bar()
    try:
        for auto in ("AutoModelForMaskedLM", "AutoModelForCausalLM", "AutoModelForImageTextToText", "AutoModel"):
            try:
                # a model class may import torchao; its weights are read by safetensors (UTF-8 paths only)
                with quiet_torchao_import(), utf8_path(model_dir) as readable:
                    model = getattr(transformers, auto).from_pretrained(
                        readable, config=config, dtype=dtype, trust_remote_code=trust_remote_code
                    )
            except ValueError as exc:  # this auto class has no mapping for the config
                errors.append(f"{auto}: {exc}")
                continue
            return model.to(device).eval()
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    raise UsageError(f"transformers has no model class for {model_dir}: {errors[-1]}")


class ForwardAdapter(nn.Module):
    """Presents a transformers model with the native model interface the runner expects:
    `forward(ForwardBatch)` -> the LM head's input at `batch.select`, and `lm_head_weight`.

    The head's input is captured with a pre-hook on the output embedding; a head bias is
    folded in as one extra hidden unit fixed at 1 (W h + b = [W | b] [h; 1])."""

    def __init__(self, hf_model: Any) -> None:  # a transformers PreTrainedModel
        super().__init__()
        self.hf = hf_model
        head = hf_model.get_output_embeddings() if hasattr(hf_model, "get_output_embeddings") else None
        if not isinstance(head, nn.Linear):
            raise DlmError("the model's output head is not a linear layer")
        bias = head.bias
        self._weight = head.weight if bias is None else torch.cat((head.weight, bias[:, None]), dim=1)
        self._has_bias = bias is not None
        self._captured: list[torch.Tensor] = []
        head.register_forward_pre_hook(lambda _module, args: self._captured.append(args[0]))

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self._weight

    def hidden(self, input_ids: torch.Tensor, key_mask: torch.Tensor | None) -> torch.Tensor:
        """The head's input at every position [B, T, d(+1)]."""
        mask = torch.ones_like(input_ids) if key_mask is None else key_mask.long()
        self._captured.clear()
        self.hf(input_ids=input_ids, attention_mask=mask)
        h = self._captured[-1]
        if self._has_bias:
            h = torch.cat((h, h.new_ones(h.shape[:-1] + (1,))), dim=-1)
        return h

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        return gather_rows(self.hidden(batch.input_ids, batch.key_mask), batch.select)


def is_bidirectional(adapter: ForwardAdapter, vocab: int, device: torch.device) -> bool:
    """Does the forward answer every input position, and does the first position's output
    depend on the last token? (Causal models: never. A model answering a canvas of its own
    length whatever the input, as transformers' DiffusionGemma does, is no masked LM either.)"""
    ids = torch.arange(4, device=device)[None] % vocab
    other = ids.clone()
    other[0, -1] = (ids[0, -1] + 1) % vocab
    with torch.inference_mode():
        first, second = adapter.hidden(ids, None), adapter.hidden(other, None)
    if first.shape[:2] != ids.shape or second.shape[:2] != ids.shape:
        return False
    return not torch.allclose(first[0, 0], second[0, 0], rtol=0.0, atol=0.0)


def _eos_ids(*values: Any) -> tuple[int, ...]:
    """Every EOS id of the first value that names any (config.json may list several)."""
    for value in values:
        ids = value if isinstance(value, (list, tuple)) else [] if value is None else [value]
        if ids:
            return tuple(int(v) for v in ids)
    return ()


def _first(*values: Any) -> int | None:
    for value in values:
        if isinstance(value, (list, tuple)):
            value = value[0] if value else None
        if value is not None:
            return int(value)
    return None


def backend_config(hf_model: Any, tokenizer: Any | None) -> ModelConfig:
    """A ModelConfig for the engine from the transformers config (text part if nested)."""
    config = hf_model.config
    text = config.get_text_config() if hasattr(config, "get_text_config") else config

    def get(name: str, default: Any = None) -> Any:
        # Some configs refuse global reads of per-layer fields (heterogeneous layers):
        # those only describe the model here, so the default is good enough.
        for source in (text, config):
            try:
                value = getattr(source, name)
            except Exception:  # noqa: BLE001 - transformers raises its own types here
                continue
            if value is not None:
                return value
        return default

    hidden = int(get("hidden_size", 0) or 0)
    heads = int(get("num_attention_heads", 1) or 1)
    vocab = int(get("vocab_size", 0) or 0)
    head = hf_model.get_output_embeddings() if hasattr(hf_model, "get_output_embeddings") else None
    mask = _first(get("mask_token_id"), getattr(tokenizer, "mask_token_id", None))
    return ModelConfig(
        family="transformers",
        model_type=str(getattr(config, "model_type", "unknown")),
        hidden_size=hidden,
        num_layers=int(get("num_hidden_layers", 0) or 0),
        num_heads=heads,
        num_kv_heads=int(get("num_key_value_heads", heads) or heads),
        head_dim=int(get("head_dim", 0) or (hidden // heads if heads else 0)),
        intermediate_size=int(get("intermediate_size", 0) or 0),
        vocab_size=vocab,
        logits_size=int(head.weight.shape[0]) if isinstance(head, nn.Linear) else vocab,
        rope_theta=float(get("rope_theta", 10000.0) or 10000.0),
        rms_norm_eps=float(get("rms_norm_eps", 1e-6) or 1e-6),
        max_position_embeddings=int(get("max_position_embeddings", 4096) or 4096),
        mask_token_id=NO_MASK if mask is None else mask,
        eos_token_ids=_eos_ids(get("eos_token_id"), getattr(tokenizer, "eos_token_id", None)),
        pad_token_id=_first(get("pad_token_id"), getattr(tokenizer, "pad_token_id", None)),
        tie_word_embeddings=bool(get("tie_word_embeddings", False)),
        torch_dtype=str(get("dtype", None) or get("torch_dtype", None) or ""),
    )


# dlm's decoding fields a model's own `diffusion_generate` may take, under these names.
DIFFUSION_FIELDS = ("steps", "block_length", "threshold")
# Fields only dlm's own decoding honours; a model's method never receives them.
DLM_FIELDS = (
    *("remasking", "cfg_scale", "factor", "cache", "mode", "suffix", "logprobs", "stop_token_ids", "drafts"),
    *("response_format", "ignore_eos", "min_tokens"),
)
_DEFAULTS = GenerationParams()


class GenerateMethodRunner:
    """The `Runner` of the generate path: the model's own generation method decodes one
    prompt per call, so each `step` runs one whole request (and commits it).

    A field the method cannot honour is refused (`Unsupported`), never silently dropped:
    a client asking for `steps=2` must not believe it got them."""

    def __init__(self, hf_model: Any, config: ModelConfig, device: torch.device) -> None:
        self.hf, self.config, self.device = hf_model, config, device
        self.method_name = "diffusion_generate" if hasattr(hf_model, "diffusion_generate") else "generate"
        self._method: Callable[..., Any] = getattr(hf_model, self.method_name)
        accepted = inspect.signature(self._method).parameters
        self._named = frozenset(accepted)
        self._open = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in accepted.values())
        # A plain `generate` has **kwargs but no dLLM meaning for these names.
        self.takes = frozenset(
            f for f in DIFFUSION_FIELDS if self.method_name == "diffusion_generate" and self._accepts(f)
        )
        # Whether dlm's temperature can reach the method: transformers' GenerationConfig has
        # do_sample (DiffusionGemma's own config has not); a diffusion_generate names it.
        self.samples = (
            self._accepts("temperature")
            if self.method_name == "diffusion_generate"
            else hasattr(getattr(hf_model, "generation_config", None), "do_sample")
        )
        self._forward_lengths: list[int] = []
        hf_model.register_forward_pre_hook(self._count, with_kwargs=True)
        # A method may run submodules and never the top-level forward (transformers'
        # DiffusionGemma: its decoder, then the LM head, per denoising step); then each LM-head
        # pass is a forward, as dlm's own DiffusionGemma counts them.
        self._head_lengths: list[int] = []
        head = hf_model.get_output_embeddings() if hasattr(hf_model, "get_output_embeddings") else None
        if isinstance(head, nn.Module):
            head.register_forward_pre_hook(self._count_head)

    def _accepts(self, name: str) -> bool:
        return self._open or name in self._named

    def _count(self, _module: Any, args: tuple, kwargs: dict) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        self._forward_lengths.append(int(ids.shape[-1]) if isinstance(ids, torch.Tensor) else 0)

    def _count_head(self, _module: Any, args: tuple) -> None:
        hidden = args[0] if args else None
        self._head_lengths.append(int(hidden.shape[-2]) if isinstance(hidden, torch.Tensor) and hidden.dim() > 1 else 0)

    def resolve(self, params: GenerationParams) -> GenerationParams:
        """Refuse what the method cannot honour."""
        for name in (*DIFFUSION_FIELDS, *DLM_FIELDS):
            if name not in self.takes and getattr(params, name) != getattr(_DEFAULTS, name):
                taken = ", ".join(sorted(self.takes)) or "none of steps, block_length, threshold"
                raise Unsupported(
                    (
                        Name(name),
                        f" does not apply here: this model decodes with its own {self.method_name} "
                        f"(transformers backend, generate path), which takes {taken}",
                    ),
                    field=name,
                )
        if params.temperature > 0 and not self.samples:
            raise Unsupported(
                f"temperature cannot be set here: this model's {self.method_name} samples "
                "with its own generation config",
                field="temperature",
            )
        return params

    def new_sequence(self, prompt_ids: list[int], params: ResolvedParams, eos_ids: tuple[int, ...]) -> Sequence:
        """The holder of one request. `GenerateMethodEngine.validate` hides the dlm-only
        fields the method ignores (steps, block length); the holder lays them out again."""
        if params.steps is None or params.block_length is None:
            params = params.validate(len(prompt_ids), self.config.max_position_embeddings, UNREGISTERED)
        return Sequence(list(prompt_ids), params, self.config.mask_token_id, eos_ids)

    def _kwargs(self, params: GenerationParams) -> dict[str, Any]:
        """dlm's parameters under the names the method takes: the length; sampling when
        temperature > 0, and for a plain `generate` greedy at 0 whatever the model's
        generation config prefers (temperature 0 means greedy everywhere in dlm); for a
        `diffusion_generate`, the diffusion fields it takes (dlm's defaults resolved) and the
        MASK id, all filtered by its signature unless it takes **kwargs."""
        wanted: dict[str, Any] = {"max_new_tokens": params.gen_length}
        if params.temperature > 0:
            wanted.update(do_sample=True, temperature=params.temperature)
        elif self.method_name == "generate" and self.samples:
            wanted["do_sample"] = False
        if self.method_name == "diffusion_generate":
            wanted.update({f: getattr(params, f) for f in self.takes})
            if self.config.mask_token_id != NO_MASK:
                wanted["mask_token_id"] = self.config.mask_token_id
            wanted = {k: v for k, v in wanted.items() if self._accepts(k)}
        return {k: v for k, v in wanted.items() if v is not None}

    @torch.inference_mode()
    def step(self, seqs: Seq[RequestState]) -> None:
        """Run the first of `seqs` to its end."""
        if seqs:
            self._run(narrow(seqs[0], Sequence))

    def _run(self, seq: Sequence) -> None:
        if seq.params.seed is not None:
            torch.manual_seed(seq.params.seed)
        elif seq.params.temperature == 0:  # reproducible, also where the method samples by its own config
            torch.manual_seed(0)
        self._forward_lengths.clear()
        self._head_lengths.clear()
        ids = torch.tensor([seq.prompt_ids], device=self.device)
        out = self._method(ids, **self._kwargs(seq.params))
        tokens = getattr(out, "sequences", out)[0, seq.prompt_length :].tolist()[: seq.params.gen_length]
        seq.canvas = torch.tensor(seq.prompt_ids + tokens, dtype=torch.long)
        lengths = self._forward_lengths or self._head_lengths
        seq.nfe = len(lengths)
        seq.query_lengths = list(lengths)
        seq.finish("stop" if any(eos in tokens for eos in seq.eos_ids) else "length")


class GenerateMethodEngine(LLMEngine):
    """LLMEngine over the model's own generation method (`GenerateMethodRunner`), so
    `dlm generate` and the server's scheduler drive it unchanged, one request at a time."""

    path = "generate"
    max_num_seqs = 1
    warmup_params = GenerationParams(gen_length=8)
    runner: GenerateMethodRunner

    @property
    def capabilities(self) -> tuple[str, ...]:
        """Only what needs nothing of the method: `n` is n calls with their seeds (no canvas
        to stream either: the method returns its answer whole)."""
        return tuple(c for c in super().capabilities if c not in (*DLM_FIELDS, "include_canvas"))

    def make_runner(self) -> GenerateMethodRunner:
        return GenerateMethodRunner(self.loaded.model, self.config, self.loaded.device)

    def reproducible(self, params: ResolvedParams) -> bool:
        """Seeded only: the method samples by its own generation config, which dlm does not read."""
        return params.seed is not None

    def validate(self, params: GenerationParams, prompt_length: int) -> ResolvedParams:
        """The same checks as LLMEngine.validate, after refusing what the method cannot honour.
        Fields the method does not take come back as None: no dlm step count or block applies
        (the server's step limit, for one, has nothing to bound). The method spends what it
        spends: its forwards are counted, not bounded."""
        if not isinstance(params, ResolvedParams):
            params = self.runner.resolve(params)
        resolved = super().validate(params, prompt_length)
        dropped: dict[str, Any] = {f: None for f in ("steps", "block_length") if f not in self.runner.takes}
        return replace(resolved, **dropped)


class ForwardEngine(LLMEngine):
    """LLMEngine (and its ModelRunner) over `ForwardAdapter`."""

    path = "forward"


def load_transformers_engine(
    model_dir: Path,
    dtype: torch.dtype,
    device: torch.device,
    trust_remote_code: bool,
    tokenizer: Any | None,
) -> ForwardEngine | GenerateMethodEngine:
    """Load with transformers and pick the path (see the module docstring)."""
    hf_model = _load(Path(model_dir), dtype, device, trust_remote_code)
    config = backend_config(hf_model, tokenizer)
    try:
        adapter = ForwardAdapter(hf_model)
        usable = config.mask_token_id != NO_MASK and is_bidirectional(adapter, config.vocab_size, device)
    except (DlmError, TypeError, ValueError, RuntimeError):  # its forward does not take our inputs
        usable = False
    if usable:
        return ForwardEngine(LoadedModel(config, adapter, dtype, device, Path(model_dir)))
    if not callable(getattr(hf_model, "diffusion_generate", None)) and not callable(
        getattr(hf_model, "generate", None)
    ):
        raise UsageError(f"{model_dir}: the model neither takes dlm's masked decoding nor has a generation method")
    return GenerateMethodEngine(LoadedModel(config, hf_model, dtype, device))
