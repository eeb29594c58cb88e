"""Request bodies of the OpenAI API as dlm accepts them, plus the dLLM fields.

Unknown fields are ignored (OpenAI SDKs send fields dlm has no use for); known fields are
type-checked, and fields dlm cannot honour (n > 1, logprobs, penalties, ...) are refused by
`unsupported()` rather than silently ignored; fields only some families take (Dream's `alg`,
`top_p`, `top_k`, a cache mode) are refused by the family's validation (engine/params.py).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictStr, model_validator


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", protected_namespaces=(), allow_inf_nan=False)


class StreamOptions(_Body):
    include_usage: StrictBool = False


class DiffusionFields(_Body):
    """dLLM parameters as top-level body fields (OpenAI SDKs send them via `extra_body`)."""

    steps: int | None = Field(None, ge=1)
    # Denoising steps per block (the deployment guides' "refinement steps"); `steps` is the total.
    refinement_steps: int | None = Field(None, ge=1)
    block_length: int | None = Field(None, ge=1)
    remasking: Literal["low_confidence", "random"] | None = None
    threshold: float | None = None
    factor: float | None = None
    cfg_scale: float | None = Field(None, ge=0)
    cache: StrictStr | None = None
    decode_mode: StrictStr | None = None
    # Dream family (diffusion_generate); `top_p` is on the generation body.
    alg: StrictStr | None = None
    alg_temp: float | None = None
    top_k: int | None = None


class _Generation(DiffusionFields):
    model: StrictStr | None = None
    max_tokens: int | None = Field(None, ge=1)
    max_output_tokens: int | None = Field(None, ge=1)  # the Responses API's name for max_tokens
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    n: int = Field(1, ge=1)
    seed: int | None = Field(None, ge=0, lt=2**63)  # torch.Generator's range
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    stop: StrictStr | list[StrictStr] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    user: StrictStr | None = None
    return_token_ids: StrictBool = False  # as in vLLM: also return the generated token ids

    @model_validator(mode="after")
    def _output_tokens(self) -> _Generation:
        """`max_output_tokens` is read as `max_tokens` (the two may not disagree)."""
        if self.max_output_tokens is not None:
            if self.max_tokens not in (None, self.max_output_tokens):
                raise ValueError("give max_tokens or max_output_tokens, not both")
            self.max_tokens = self.max_output_tokens
        return self

    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [s for s in ([self.stop] if isinstance(self.stop, str) else self.stop) if s]

    def unsupported(self) -> tuple[str, str] | None:
        """(param, reason) for a field dlm cannot honour, else None."""
        if self.n != 1:
            return "n", "n must be 1: send one request per choice (requests are batched on the server)"
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name) not in (None, 0.0):
                return name, f"{name} is not supported by diffusion decoding"
        return None


class CompletionRequest(_Generation):
    prompt: StrictStr | list[int] | list[StrictStr] | list[list[int]]
    echo: StrictBool = False
    logprobs: int | None = None
    suffix: StrictStr | None = None

    def unsupported(self) -> tuple[str, str] | None:
        if self.echo:
            return "echo", "echo is not supported"
        if self.logprobs is not None:
            return "logprobs", "logprobs are not supported"
        if self.suffix:
            return "suffix", "suffix is not supported"
        return super().unsupported()


class TextPart(_Body):
    type: Literal["text"]
    text: StrictStr


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


class ChatRequest(_Generation):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    tools: list[ToolDef] | None = None
    tool_choice: Literal["none", "auto"] | dict[str, Any] | None = None
    logprobs: StrictBool | None = None
    response_format: dict[str, Any] | None = None

    def unsupported(self) -> tuple[str, str] | None:
        if isinstance(self.tool_choice, dict):
            return "tool_choice", "forcing a specific tool is not supported; use auto or none"
        if self.logprobs:
            return "logprobs", "logprobs are not supported"
        if self.response_format and self.response_format.get("type") not in (None, "text"):
            return "response_format", "structured output (json_object, json_schema) is not supported"
        return super().unsupported()
