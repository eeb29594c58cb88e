"""Request bodies of the OpenAI API as dlm accepts them, plus the dLLM fields.

Every top-level field is declared: an unknown one (`"treshold"`) is a 400 naming it, as the
OpenAI API answers. Fields fall in four groups:
- decoding parameters: one per `GenerationParams` field offered over HTTP (`PARAM_FIELDS`),
  typed here, described, defaulted and range-checked by their declaration in dlm/engine/params.py
  (absent = that default); fields only some families take are refused by its validation;
- OpenAI fields dlm acts on (model, max_tokens, stream, stop, ...), among them the request
  layer's spellings of GenerationParams fields no single body field names: `suffix` (text or
  ids, encoded by the route), `logprobs` (completions: the count) and `logprobs` +
  `top_logprobs` (chat), read by `top_logprobs_count()`; a family that cannot honour one is
  refused by the one validation (dlm/engine/capabilities.py);
- fields OpenAI SDKs and frameworks send that change nothing here (`IGNORED`): accepted;
- fields dlm cannot honour (`NEUTRAL`): accepted only with a value that asks for nothing,
  else refused by `unsupported()` (code `unsupported`) rather than silently ignored.
Nested objects (messages, tools) stay lenient about extra fields: clients echo assistant
messages back with fields of their own (refusal, annotations, ...). `response_format` is typed
as any JSON value here: its shape is the engine's rule (`format_object`, dlm/engine/structured.py),
which the request preparation applies at the boundary (dlm/cli/server/prepare.py), so the
command line, the Python API and the server refuse the same values and keys with the same words.

Types are strict everywhere (pydantic's strict mode), as OpenAI's API types them: `"8"` is
not a `max_tokens`, `true` is not a count (`logprobs` is a count on /v1/completions and a
boolean on chat), `1` is a `temperature` (a number) but `1.0` is not a `seed`. A decoding
parameter's HTTP type is its GenerationParams type, optional (a tuple is a JSON array;
`response_format` is the object whose JSON text GenerationParams takes), which
tests/test_params_declaration.py checks field by field.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    StrictStr,
    ValidationInfo,
    WithJsonSchema,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from dlm.engine.errors import UsageError
from dlm.engine.params import DEFAULTS, PARAMS, http_name
from dlm.engine.stops import stop_strings

# `response_format`: any JSON value is taken here and the engine's rule decides
# (`format_object`, dlm/engine/structured.py), so a value that is not an object is refused in
# the words `dlm generate` and the Python API use, not pydantic's; the schema still says object.
ResponseFormat = Annotated[
    Any, WithJsonSchema({"anyOf": [{"additionalProperties": True, "type": "object"}, {"type": "null"}]})
]

# Body field -> GenerationParams field, for every decoding parameter offered over HTTP.
PARAM_FIELDS: dict[str, str] = {name: n for n in PARAMS if (name := http_name(n)) is not None}

# Sent by OpenAI SDKs and frameworks, harmless here: accepted and ignored.
IGNORED = ("user", "metadata", "store", "service_tier", "prompt_cache_key", "safety_identifier")
# Not honoured by dlm: accepted only with these values (asking for nothing), else `unsupported`.
NEUTRAL: dict[str, tuple[Any, ...]] = {
    "presence_penalty": (None, 0),
    "frequency_penalty": (None, 0),
    "logit_bias": (None, {}),
    "best_of": (None, 1),
    "modalities": (None, ["text"]),
    "audio": (None,),
    "prediction": (None,),
    "functions": (None, []),
    "function_call": (None, "none"),
    "reasoning_effort": (None,),
}


def _param(name: str) -> Any:
    """A decoding parameter's body field: absent (None) means GenerationParams' default;
    its description, default and range live in that declaration (dlm/engine/params.py), and
    the JSON schema (/openapi.json) states them."""
    return Field(None, description=PARAMS[PARAM_FIELDS[name]].help, json_schema_extra=_documented(PARAM_FIELDS[name]))


def _documented(field: str) -> Callable[[dict[str, Any]], None]:
    """What the JSON schema of GenerationParams field `field`'s body field adds: its default
    (or, where None means something, that in words), range and choices."""
    spec, default = PARAMS[field], DEFAULTS[field]

    def edit(schema: dict[str, Any]) -> None:
        if default is not None:
            schema["default"] = list(default) if isinstance(default, tuple) else default
        elif spec.shown:
            schema["description"] = f"{schema['description']} Default: {spec.shown}."
        for branch in schema.get("anyOf", [schema]):
            if branch.get("type") in ("integer", "number"):
                if spec.low is not None:
                    branch["exclusiveMinimum" if spec.low_open else "minimum"] = spec.low
                if spec.high is not None:
                    branch["exclusiveMaximum" if spec.high_open else "maximum"] = spec.high
            if branch.get("type") == "string" and spec.choices:
                branch["enum"] = list(spec.choices)

    return edit


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", protected_namespaces=(), allow_inf_nan=False, strict=True)


class StreamOptions(_Body):
    """Only with `stream: true` when one asks for something (OpenAI answers 400 otherwise);
    an unknown option is refused, as an unknown top-level field is."""

    model_config = ConfigDict(extra="forbid")

    include_usage: StrictBool | None = False
    # vLLM's and SGLang's: the usage so far on every chunk, which benchmark clients (vLLM's
    # bench, aiperf-style harnesses) send to count tokens exactly as they arrive; refusing
    # it as unknown failed those clients outright.
    continuous_usage_stats: StrictBool | None = False
    # dlm: also send the canvas (committed, provisional and masked positions) after every
    # denoising step, as `*.canvas` events (docs/serve.md, "Canvas streaming").
    include_canvas: StrictBool | None = False


class DiffusionFields(_Body):
    """dLLM parameters as top-level body fields (OpenAI SDKs send them via `extra_body`)."""

    model_config = ConfigDict(extra="forbid")

    steps: int | None = _param("steps")
    refinement_steps: int | None = _param("refinement_steps")  # the deployment guides' name
    block_length: int | None = _param("block_length")
    remasking: str | None = _param("remasking")
    threshold: float | None = _param("threshold")
    factor: float | None = _param("factor")
    cfg_scale: float | None = _param("cfg_scale")
    drafts: int | None = _param("drafts")
    cache: str | None = _param("cache")
    decode_mode: str | None = _param("decode_mode")
    # Draft-and-edit (LLaDA2.x).
    edit_threshold: float | None = _param("edit_threshold")
    edit_mode: str | None = _param("edit_mode")
    max_post_edit_steps: int | None = _param("max_post_edit_steps")
    # Dream family (diffusion_generate).
    alg: str | None = _param("alg")
    alg_temp: float | None = _param("alg_temp")
    top_k: int | None = _param("top_k")
    top_p: float | None = _param("top_p")
    # Stop ids besides EOS (vLLM's name), with each family's own stop rule.
    stop_token_ids: list[int] | None = _param("stop_token_ids")
    # Fixed output lengths (vLLM's names, sent by benchmark clients).
    ignore_eos: bool | None = _param("ignore_eos")
    min_tokens: int | None = _param("min_tokens")
    # DiffusionGemma (entropy-bound sampler).
    entropy_bound: float | None = _param("entropy_bound")
    min_temperature: float | None = _param("min_temperature")
    max_temperature: float | None = _param("max_temperature")
    stability_threshold: int | None = _param("stability_threshold")
    confidence_threshold: float | None = _param("confidence_threshold")
    # Sampling, shared with the OpenAI API.
    temperature: float | None = _param("temperature")
    seed: int | None = _param("seed")
    max_tokens: int | None = _param("max_tokens")
    n: int | None = _param("n")
    # Structured output: an OpenAI response_format object (GenerationParams takes its JSON text).
    response_format: ResponseFormat = _param("response_format")


class GenerationRequest(DiffusionFields):
    model: StrictStr | None = None
    max_output_tokens: int | None = Field(None, ge=1)  # the Responses API's name for max_tokens
    stream: StrictBool | None = False  # null: the default (OpenAI types it "boolean or null")
    stream_options: StreamOptions | None = None
    stop: StrictStr | list[StrictStr] | None = None
    return_token_ids: StrictBool | None = False  # as in vLLM: also return the generated token ids
    # false: at most one tool call in a chat answer (dlm/cli/server/tools.py); completions have no tools
    parallel_tool_calls: StrictBool | None = None
    # IGNORED
    user: StrictStr | None = None
    metadata: dict[str, Any] | None = None
    store: StrictBool | None = None
    service_tier: StrictStr | None = None
    prompt_cache_key: StrictStr | None = None
    safety_identifier: StrictStr | None = None
    top_logprobs: int | None = None  # chat's count of alternatives (on completions: `logprobs`)
    # NEUTRAL
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, Any] | None = None
    best_of: int | None = None
    modalities: list[StrictStr] | None = None
    audio: dict[str, Any] | None = None
    prediction: dict[str, Any] | None = None
    functions: list[dict[str, Any]] | None = None
    function_call: StrictStr | dict[str, Any] | None = None
    reasoning_effort: StrictStr | None = None

    @field_validator("max_output_tokens")
    @classmethod
    def _one_length(cls, value: int | None, info: ValidationInfo) -> int | None:
        """`max_output_tokens` and `max_tokens` may not disagree (the error names the field)."""
        if value is not None and info.data.get("max_tokens") not in (None, value):
            raise ValueError("give max_tokens or max_output_tokens, not both")
        return value

    @field_validator("stop")
    @classmethod
    def _bounded_stops(cls, value: str | list[str] | None) -> str | list[str] | None:
        """The engine's bounds on stop strings (dlm/engine/stops.py), checked before the prompt
        is tokenised; `Service.params` hands them to GenerationParams, whose validation the
        other entry points share."""
        try:
            stop_strings(value)
        except UsageError as exc:
            raise ValueError(str(exc)) from None
        return value

    @model_validator(mode="after")
    def _output_tokens(self) -> GenerationRequest:
        """`max_output_tokens` is read as `max_tokens`."""
        if self.max_output_tokens is not None:
            self.max_tokens = self.max_output_tokens
        return self

    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [s for s in ([self.stop] if isinstance(self.stop, str) else self.stop) if s]

    def unsupported(self) -> tuple[str, str] | None:
        """(param, reason) for a field dlm cannot honour, else None."""
        for name, neutral in NEUTRAL.items():
            value = getattr(self, name)
            # best_of picks the best n of best_of answers: best_of = n (vLLM's default) asks for nothing more
            if value not in neutral and not (name == "best_of" and value == (self.n or 1)):
                return name, f"{name} is not supported by diffusion decoding"
        return None

    def top_logprobs_count(self) -> int | None:
        """GenerationParams.logprobs: alternatives per token, None when not asked."""
        raise NotImplementedError


class CompletionRequest(GenerationRequest):
    prompt: StrictStr | list[int] | list[StrictStr] | list[list[int]]
    echo: StrictBool | None = False
    logprobs: int | None = None  # alternatives per token (range: GenerationParams.logprobs)
    suffix: StrictStr | list[StrictInt] | None = None  # infilling: the text after the answer

    def unsupported(self) -> tuple[str, str] | None:
        if self.top_logprobs is not None:
            return "top_logprobs", "top_logprobs is a chat field; on /v1/completions logprobs gives the count"
        if self.echo and self.logprobs is not None:
            return (
                "echo",
                "echo with logprobs would need the prompt's log-probabilities, which diffusion decoding lacks",
            )
        return super().unsupported()

    def top_logprobs_count(self) -> int | None:
        return self.logprobs


class DetokenizeRequest(_Body):
    """`/detokenize`, as vLLM has it: token ids back to text."""

    model_config = ConfigDict(extra="forbid", protected_namespaces=())
    model: StrictStr | None = None
    tokens: list[StrictInt]


class TextPart(_Body):
    type: Literal["text"]
    text: StrictStr

    @model_validator(mode="before")
    @classmethod
    def _text_only(cls, data: Any) -> Any:
        """A part of another type (`image_url`, `input_audio`, `file`: what vision and audio
        clients send) is refused as such, naming its type: the served models read text."""
        kind = data.get("type") if isinstance(data, dict) else None
        if isinstance(kind, str) and kind != "text":
            raise PydanticCustomError(
                "unsupported",
                "content parts of type {kind} are not supported: the served model reads text (parts of type 'text')",
                {"kind": repr(kind)},
            )
        return data


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: StrictStr | list[TextPart] | None = None
    name: StrictStr | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: StrictStr | None = None

    def for_template(self) -> dict[str, Any]:
        """The message as chat templates expect it: text content, tool fields when set."""
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        out: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role, "content": content or ""}
        for key in ("name", "tool_calls", "tool_call_id"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        return out


class FunctionDef(_Body):
    name: StrictStr
    description: StrictStr | None = None
    parameters: dict[str, Any] | None = None


class ToolDef(_Body):
    type: Literal["function"]
    function: FunctionDef


class ChatRequest(GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    tools: list[ToolDef] | None = None
    # "required" and a named function force a tool call, which dlm cannot: refused as unsupported.
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    logprobs: StrictBool | None = None
    # vLLM's field: extra variables for the chat template (`{"enable_thinking": false}` where a
    # template has a thinking switch); a template that does not read one ignores it.
    chat_template_kwargs: dict[str, Any] | None = None

    @field_validator("max_completion_tokens")
    @classmethod
    def _one_completion_length(cls, value: int | None, info: ValidationInfo) -> int | None:
        """`max_completion_tokens` (OpenAI's current name) beside `max_tokens` or
        `max_output_tokens` (SDKs and frameworks that fill both) only equal: servers differ on
        which one wins (vLLM takes max_completion_tokens), so two lengths are refused rather
        than one silently dropped."""
        for name in ("max_tokens", "max_output_tokens"):
            other = info.data.get(name)
            if value is not None and other is not None and other != value:
                raise ValueError(f"{name} ({other}) disagrees with it ({value}): give one length")
        return value

    def unsupported(self) -> tuple[str, str] | None:
        if self.tool_choice == "required" or isinstance(self.tool_choice, dict):
            return "tool_choice", "forcing a tool call is not supported; use auto or none"
        if self.top_logprobs and not self.logprobs:
            return "top_logprobs", "top_logprobs needs logprobs: true"
        return super().unsupported()

    def top_logprobs_count(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None
