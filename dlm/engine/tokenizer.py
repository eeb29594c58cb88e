"""Text <-> ids through the checkpoint's own tokenizer (and its chat template)."""

from __future__ import annotations

import warnings
from collections.abc import Collection
from pathlib import Path
from typing import Any

from dlm.engine.errors import UsageError
from dlm.engine.utf8_paths import utf8_path

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def has_tokenizer(model_dir: Path) -> bool:
    return any((Path(model_dir) / name).exists() for name in TOKENIZER_FILES)


def load_tokenizer(model_dir: Path) -> Any:
    """A transformers tokenizer for `model_dir`; never runs remote code."""
    if not has_tokenizer(model_dir):
        raise UsageError(f"{model_dir} has no tokenizer files; pass token ids instead (--prompt-ids)")
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    # transformers warns that dLLM model types are unknown to it; the tokenizer is fine.
    hf_logging.set_verbosity_error()
    try:
        with warnings.catch_warnings():
            # It parses config.json only to pick the tokenizer class, and warns about the
            # config fields of model types it does not know (Dream's `rope_scaling: null`):
            # nothing the tokenizer uses, and nothing the user can act on.
            warnings.filterwarnings("ignore", message="`rope_scaling` is deprecated", category=FutureWarning)
            with utf8_path(model_dir) as readable:  # the tokenizers library opens UTF-8 paths only
                tokenizer = AutoTokenizer.from_pretrained(readable, trust_remote_code=False)
            # Fields it reads only when it encodes or decodes fail then, not here: a string
            # model_max_length was a TypeError traceback from the first prompt. One word each
            # way makes such a tokenizer fail where it loads, with the errors below.
            tokenizer.decode(tokenizer("a", add_special_tokens=False)["input_ids"])
            return tokenizer
    except (OSError, ValueError) as exc:
        raise UsageError(f"could not load the tokenizer in {model_dir}: {exc}") from exc
    except (ImportError, MemoryError):
        raise  # this environment's, not the checkpoint's
    except Exception as exc:  # noqa: BLE001 - transformers parsing files of unknown origin
        # It reads config.json to pick the tokenizer class and validates fields dlm never
        # reads (`id2label: 5` raised AttributeError, a traceback from generate); the
        # tokenizers library raises a bare Exception for a tokenizer.json it cannot read.
        what = "tokenizer.json could not be read" if type(exc) is Exception else type(exc).__name__
        raise UsageError(
            f"could not load the tokenizer in {model_dir} (transformers reads config.json too): "
            + " ".join(f"{what}: {exc}".split())  # one line: validators' messages span several
        ) from exc


def encode(tokenizer: Any, text: str, chat: bool = False, template_kwargs: dict[str, Any] | None = None) -> list[int]:
    """`text`'s ids, or with `chat` those of one user message through the chat template, with
    its extra variables `template_kwargs` (`enable_thinking`; see `encode_chat`)."""
    if chat:
        return encode_chat(tokenizer, [{"role": "user", "content": text}], None, template_kwargs)
    if template_kwargs:
        raise UsageError("chat_template_kwargs apply to a chat prompt (--chat)", field="chat_template_kwargs")
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


# Names a caller's template variables cannot take besides `apply_chat_template`'s own
# arguments (`reserved_template_kwargs`): the variable the conversation reaches the template
# as, and the renderer's own argument for it, which `**kwargs` would collide with.
TEMPLATE_OWN_NAMES = frozenset({"messages", "conversations"})


def reserved_template_kwargs(tokenizer: Any) -> frozenset[str]:
    """Names `chat_template_kwargs` cannot set: every named argument of this tokenizer's
    `apply_chat_template` (read from its signature, so an argument a transformers release adds,
    such as 5.x's `sanitize_control_tokens`, is one too: given as a template variable it set
    the call's argument instead, silently) and `TEMPLATE_OWN_NAMES`."""
    import inspect

    parameters = inspect.signature(type(tokenizer).apply_chat_template).parameters.values()
    named = {p.name for p in parameters if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
    return frozenset(named) | TEMPLATE_OWN_NAMES


def encode_chat(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None = None,
    template_kwargs: dict[str, Any] | None = None,
) -> list[int]:
    """Prompt ids of a conversation through the checkpoint's own chat template (which also
    decides how `tools` are shown to the model). `template_kwargs` are extra template
    variables (vLLM's `chat_template_kwargs`, e.g. `enable_thinking`)."""
    clash = sorted(set(template_kwargs) & reserved_template_kwargs(tokenizer)) if template_kwargs else []
    if clash:
        raise UsageError(
            f"chat_template_kwargs cannot set {', '.join(clash)}: the server sets it", field="chat_template_kwargs"
        )
    template = getattr(tokenizer, "chat_template", None)
    if not template:
        raise UsageError("this checkpoint's tokenizer has no chat template; drop --chat")
    templates = template.values() if isinstance(template, dict) else [template]  # named templates
    if not all(isinstance(t, str) for t in templates):
        kinds = sorted({type(t).__name__ for t in templates if not isinstance(t, str)})
        raise UsageError(
            f"this checkpoint's chat template is no template (tokenizer_config.json's chat_template holds "
            f"{', '.join(kinds)}, not text); drop --chat"
        )
    try:
        ids = tokenizer.apply_chat_template(
            messages,
            tools=tools,
            add_generation_prompt=True,
            tokenize=True,
            return_dict=False,
            **(template_kwargs or {}),
        )
    except Exception as exc:  # jinja2 errors: the template rejected these messages
        if type(exc).__module__.startswith("jinja2"):
            raise UsageError(f"the chat template rejected the messages: {exc}") from exc
        if _raised_by_template(exc):  # its own code failed: `{{ 1/0 }}`, `{{ messages + 1 }}`
            raise UsageError(f"the chat template failed on the messages: {type(exc).__name__}: {exc}") from exc
        raise
    return list(ids)


def _raised_by_template(exc: BaseException) -> bool:
    """Whether `exc` was raised while a chat template ran (the checkpoint's code, or a filter
    it called; not dlm's or transformers' own): jinja2 names template code's frames <template>."""
    tb = exc.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == "<template>":
            return True
        tb = tb.tb_next
    return False


def decode(tokenizer: Any, ids: list[int], stops: Collection[int]) -> str:
    """Text of the generated ids up to (not including) the first stop id (EOS, the
    request's stop_token_ids), as the text of a `stop` string excludes it."""
    from dlm.engine.runtime.request import first_stop

    end = first_stop(ids, stops)
    return tokenizer.decode(ids if end is None else ids[:end], skip_special_tokens=True)
