"""A checkpoint's tokenizer files are of unknown origin, its chat template is code: whatever
they do wrong is one usage error (exit 2 from `dlm generate`, a 400 from the server, a
`tokenizer` finding of `dlm verify`), never a traceback."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from dlm.engine.errors import UsageError
from dlm.engine.tiny_models import ensure_tiny_model
from dlm.engine.tokenizer import encode_chat, load_tokenizer
from tests.weights_helpers import cli

MESSAGES = [{"role": "user", "content": "hi"}]


def _checkpoint(tmp_path: Path, **fields: object) -> Path:
    directory = tmp_path / "ckpt"
    shutil.copytree(ensure_tiny_model("tiny:llada"), directory)
    config = json.loads((directory / "tokenizer_config.json").read_text())
    (directory / "tokenizer_config.json").write_text(json.dumps({**config, **fields}))
    return directory


def _tokenizer(tmp_path: Path, template: object) -> object:
    return load_tokenizer(_checkpoint(tmp_path, chat_template=template))


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


def test_a_tokenizer_that_cannot_encode_fails_where_it_loads(tmp_path: Path) -> None:
    """A string model_max_length loaded, then every prompt was a TypeError traceback; and
    `dlm verify` passed the checkpoint."""
    directory = _checkpoint(tmp_path, model_max_length="x")
    with pytest.raises(UsageError, match="could not load the tokenizer"):
        load_tokenizer(directory)
    code, _, stderr = cli("verify", str(directory))
    assert code == 1 and "tokenizer" in stderr
