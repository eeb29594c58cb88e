"""A checkpoint's chat template is code of unknown origin: whatever it does wrong is one usage
error (exit 2 from `dlm generate --chat`, a 400 from the server), never a traceback."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from dlm.engine.errors import UsageError
from dlm.engine.tiny_models import ensure_tiny_model
from dlm.engine.tokenizer import encode_chat, load_tokenizer

MESSAGES = [{"role": "user", "content": "hi"}]


def _tokenizer(tmp_path: Path, template: object) -> object:
    directory = tmp_path / "ckpt"
    shutil.copytree(ensure_tiny_model("tiny:llada"), directory)
    config = json.loads((directory / "tokenizer_config.json").read_text())
    (directory / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": template}))
    return load_tokenizer(directory)


@pytest.mark.parametrize(
    ("template", "message"),
    [
        # Python errors raised while the template runs, in its code or in a filter it calls:
        # they were tracebacks (TypeError, ZeroDivisionError), only jinja2's own were caught.
        ("{{ 1/0 }}", "failed on the messages: ZeroDivisionError"),
        ("{{ messages + 1 }}", "failed on the messages: TypeError"),
        ("{{ messages | sum }}", "failed on the messages: TypeError"),
        # Not text at all: jinja2's compiler raised TypeError("Can't compile non template nodes").
        (5, "holds int, not text"),
        ([{"name": "default", "template": ["x"]}], "holds list, not text"),
        # What was already refused stays refused.
        ("{{ raise_exception('no') }}", "rejected the messages: no"),
    ],
)
def test_a_chat_template_that_fails_is_a_usage_error(template: object, message: str, tmp_path: Path) -> None:
    tokenizer = _tokenizer(tmp_path, template)
    with pytest.raises(UsageError, match=message):
        encode_chat(tokenizer, MESSAGES)


def test_a_working_template_still_encodes(tmp_path: Path) -> None:
    tokenizer = _tokenizer(tmp_path, "{% for m in messages %}{{ m['content'] }}{% endfor %}")
    assert encode_chat(tokenizer, MESSAGES) == list(tokenizer("hi", add_special_tokens=False)["input_ids"])
