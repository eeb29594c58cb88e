"""`chat_template_kwargs` (vLLM's request field): extra variables for the checkpoint's chat
template, such as the thinking-mode switch the deployment guides ask the API to expose
(`{"enable_thinking": true}`). It was refused as an unknown parameter."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from dlm.engine.errors import UsageError
from dlm.engine.tokenizer import encode_chat, load_tokenizer
from tests.serving import in_process_server

DEFAULT = Path(__file__).resolve().parent.parent / "dlm" / "engine" / "assets" / "dlm-tiny-tasks-llada"
THINKING = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% if enable_thinking %}<think>\n{% endif %}{% endif %}"
)
MESSAGES = [{"role": "user", "content": "What is 27 + 58?"}]


@pytest.fixture(scope="module")
def thinking_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("thinking") / "model"
    shutil.copytree(DEFAULT, directory, ignore=shutil.ignore_patterns("sha256sums.json", "*.png"))
    config = json.loads((directory / "tokenizer_config.json").read_text())
    config["chat_template"] = THINKING
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


def test_the_template_sees_the_variables(thinking_model: Path) -> None:
    tokenizer = load_tokenizer(thinking_model)
    plain = encode_chat(tokenizer, MESSAGES)
    thinking = encode_chat(tokenizer, MESSAGES, template_kwargs={"enable_thinking": True})
    assert thinking[: len(plain)] == plain and len(thinking) > len(plain)
    assert encode_chat(tokenizer, MESSAGES, template_kwargs={"enable_thinking": False}) == plain
    with pytest.raises(UsageError, match="cannot set add_generation_prompt"):
        encode_chat(tokenizer, MESSAGES, template_kwargs={"add_generation_prompt": False})


@pytest.mark.parametrize("name", ["sanitize_control_tokens", "conversations", "self", "tokenizer_kwargs"])
def test_no_variable_can_set_an_argument_of_the_call(thinking_model: Path, name: str) -> None:
    """Every named argument of apply_chat_template (transformers 5's `sanitize_control_tokens`
    was taken as the call's argument, silently) and the renderer's `conversations` (a
    TypeError blamed on the messages) is refused as the field's, as `tokenize` is."""
    tokenizer = load_tokenizer(thinking_model)
    with pytest.raises(UsageError, match=f"cannot set {name}") as refused:
        encode_chat(tokenizer, MESSAGES, template_kwargs={name: True})
    assert refused.value.field == "chat_template_kwargs"


def test_the_server_passes_them_to_the_template(thinking_model: Path) -> None:
    with in_process_server(model=str(thinking_model), dtype="float32", device="cpu", warmup=False) as client:
        plain = client.post("/tokenize", json={"messages": MESSAGES}).json()["tokens"]
        body = {"messages": MESSAGES, "chat_template_kwargs": {"enable_thinking": True}}
        thinking = client.post("/tokenize", json=body).json()["tokens"]
        assert thinking[: len(plain)] == plain and len(thinking) > len(plain)
        answer = client.post("/v1/chat/completions", json={**body, "max_tokens": 8})
        assert answer.status_code == 200, answer.text
        assert answer.json()["usage"]["prompt_tokens"] == len(thinking)
        for bad in ({"tokenize": False}, "enable_thinking"):
            refused = client.post("/v1/chat/completions", json={"messages": MESSAGES, "chat_template_kwargs": bad})
            assert refused.status_code == 400 and refused.json()["error"]["param"] == "chat_template_kwargs", (
                refused.text
            )
        # completions have no template: the field stays unknown there
        refused = client.post("/v1/completions", json={"prompt": "x", "chat_template_kwargs": {}})
        assert refused.json()["error"]["code"] == "unknown_parameter"


def test_every_entry_point_gives_the_template_the_same_variables(thinking_model: Path) -> None:
    """`dlm generate --chat --chat-template-kwargs JSON`, `LLM.generate(chat=True,
    chat_template_kwargs=...)` and a chat request's field prompt the model with the same ids
    (only the server took them; the CLI and Python had no way to switch thinking on)."""
    from typer.testing import CliRunner

    from dlm.cli.main import app
    from dlm.engine.llm import LLM

    kwargs = {"enable_thinking": True}
    with in_process_server(model=str(thinking_model), dtype="float32", device="cpu", warmup=False) as client:
        served = client.post("/tokenize", json={"messages": MESSAGES, "chat_template_kwargs": kwargs}).json()["tokens"]
    llm = LLM(str(thinking_model), dtype="float32", device="cpu")
    prompt = MESSAGES[0]["content"]
    (python,) = llm.generate(prompt, chat=True, chat_template_kwargs=kwargs, gen_length=4)
    assert python.prompt_ids == served != llm.encode(prompt, chat=True)
    args = ["generate", str(thinking_model), "--prompt", prompt, "--chat", "--gen-length", "4"]
    result = CliRunner().invoke(
        app, [*args, "--chat-template-kwargs", json.dumps(kwargs), "--dtype", "float32", "--json"]
    )
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["prompt_ids"] == served


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--chat-template-kwargs", '{"enable_thinking": true}'], "--chat-template-kwargs needs --chat"),
        (["--chat", "--chat-template-kwargs", "[1]"], "--chat-template-kwargs: not a JSON object"),
        (["--chat", "--chat-template-kwargs", '{"a": 1, "a": 2}'], "appears twice"),
        (["--chat", "--chat-template-kwargs", '{"tokenize": false}'], "cannot set tokenize"),
    ],
)
def test_bad_chat_template_kwargs_on_the_command_line_are_usage_errors(
    flags: list[str], message: str, thinking_model: Path
) -> None:
    from typer.testing import CliRunner

    from dlm.cli.main import app

    args = ["generate", str(thinking_model), "--prompt", "hi", *flags, "--dtype", "float32"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output and message in " ".join(result.output.split()), result.output
