"""The server's pure parts: configuration sources and precedence, key checks, token
buckets, tool-call parsing, and `dlm serve`'s usage errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from dlm.cli.server.auth import ANONYMOUS, KeyRing
from dlm.cli.server.config import key_id, load_config
from dlm.cli.server.errors import APIError
from dlm.cli.server.ratelimit import TokenBucket
from dlm.cli.server.tools import parse_tool_calls, streamable
from dlm.engine.errors import UsageError

ROOT = Path(__file__).resolve().parent.parent


def test_flags_beat_environment_beat_file(tmp_path: Path) -> None:
    file = tmp_path / "serve.toml"
    file.write_text('port = 9000\nmax-num-seqs = 3\nmax_queue = 5\napi_keys = ["sk-file"]\n')
    env = {"DLM_MAX_NUM_SEQS": "6", "DLM_MAX_QUEUE": "7", "DLM_API_KEY": "sk-env", "DLM_HOME": "/x"}
    config = load_config(file, {"max_queue": 9, "host": None}, environ=env)
    assert (config.port, config.max_num_seqs, config.max_queue, config.host) == (9000, 6, 9, "127.0.0.1")
    assert config.keys() == ["sk-env"]  # the environment's list replaces the file's
    assert load_config(file, {"api_keys": ["sk-flag"]}, environ=env).keys() == ["sk-flag"]


def test_api_keys_are_stripped_as_the_key_file_and_admin_key_are(tmp_path: Path) -> None:
    """A secret mounted as DLM_API_KEY often ends in a newline, and a flag can carry a space:
    the key kept them, no client can send them (the header's token is stripped), and every
    request was a 401."""
    assert load_config(None, {"api_keys": [" sk-flag "]}, environ={}).keys() == ["sk-flag"]
    config = load_config(None, environ={"DLM_API_KEY": "sk-env\n", "DLM_API_KEYS": "sk-flag"})
    assert config.keys() == ["sk-flag", "sk-env"]
    ring = KeyRing(config.keys())
    assert ring.identify("Bearer sk-env") == key_id("sk-env") == ring.identify("Bearer sk-env  ")
    assert ring.identify("Bearer sk-flag") == key_id("sk-flag")
    with pytest.raises(UsageError, match="empty"):
        load_config(None, {"api_keys": ["  "]}, environ={}).keys()


def test_yaml_file_with_a_serve_table_and_a_key_file(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.write_text("# comment\nsk-one\n\nsk-two\n")
    file = tmp_path / "serve.yml"
    file.write_text(f"serve:\n  request_timeout: 12.5\n  api_key_file: {keys}\n  public-metrics: true\n")
    config = load_config(file, environ={})
    assert config.request_timeout == 12.5 and config.public_metrics is True
    assert config.keys() == ["sk-one", "sk-two"]


def test_the_other_flag_spellings_are_file_keys_and_variables_too(tmp_path: Path) -> None:
    """`--max-concurrency` and `--model-path` (the deployment guides' names) were flags only: a
    file's `max_concurrency: 16` stopped the start with 'Extra inputs are not permitted'."""
    file = tmp_path / "serve.yaml"
    file.write_text("serve:\n  max-concurrency: 16\n  model_path: tiny:sdar\n")
    config = load_config(file, environ={})
    assert (config.max_num_seqs, config.model) == (16, "tiny:sdar")
    config = load_config(None, environ={"DLM_MAX_CONCURRENCY": "5", "DLM_MODEL_PATH": "tiny:pangu"})
    assert (config.max_num_seqs, config.model) == (5, "tiny:pangu")
    file.write_text("max_concurrency = 4\nmax_num_seqs = 4\n")
    file = file.rename(tmp_path / "both.toml")
    with pytest.raises(UsageError, match="max_num_seqs is given twice"):
        load_config(file, environ={})
    with pytest.raises(UsageError, match="DLM_MAX_NUM_SEQS and DLM_MAX_CONCURRENCY"):
        load_config(None, environ={"DLM_MAX_NUM_SEQS": "4", "DLM_MAX_CONCURRENCY": "4"})
    # DLM_API_KEY still adds a key beside DLM_API_KEYS
    assert load_config(None, environ={"DLM_API_KEYS": "k1", "DLM_API_KEY": "k2"}).keys() == ["k1", "k2"]


def test_public_view_has_key_ids_never_keys(tmp_path: Path) -> None:
    config = load_config(None, {"api_keys": ["sk-very-secret"]}, environ={})
    shown = json.dumps(config.public())
    assert "sk-very-secret" not in shown and key_id("sk-very-secret") in shown
    assert "sk-very-secret" not in repr(config)


@pytest.mark.parametrize(
    "content, flags, message",
    [
        ("colour = 'blue'\n", {}, "invalid setting colour"),
        ("port = 70000\n", {}, "invalid setting port"),
        ("", {"max_num_seqs": 0}, "invalid setting max_num_seqs"),
        ("", {"log_level": "loud"}, "invalid setting log_level"),
        ("", {"backend": "onnx"}, "invalid setting backend"),
        ("", {"gpu_memory_utilization": 1.5}, "invalid setting gpu_memory_utilization"),
        ("gpu-memory-utilization = 0\n", {}, "invalid setting gpu_memory_utilization"),
        ("", {"ssl_certfile": "cert.pem"}, "needs both"),
        ("", {"default_max_tokens": 64, "max_tokens": 32}, "default_max_tokens"),
        ("", {"api_key_file": "/no/such/keys"}, "cannot read api_key_file"),
        ("port = [", {}, "not valid TOML"),
        ("", {"host": ""}, "invalid setting host"),  # was exit 1 from the bind: "cannot listen on :8000"
        ("host = ' '\n", {}, "invalid setting host"),
        # was served under the directory name, as if not given: a request naming "" got 404
        ("", {"served_model_name": ""}, "invalid setting served_model_name"),
        ("served_model_name = ' '\n", {}, "invalid setting served_model_name"),
    ],
)
def test_bad_settings_are_usage_errors(tmp_path: Path, content: str, flags: dict, message: str) -> None:
    file = tmp_path / "serve.toml"
    file.write_text(content)
    with pytest.raises(UsageError, match=message):
        load_config(file, flags, environ={})


@pytest.mark.parametrize("source", ["flag", "file", "blank flag"])
def test_an_empty_store_setting_is_refused_not_read_as_the_current_directory(source: str, tmp_path: Path) -> None:
    """`store` was a Path, and '' became '.': `dlm serve --deployment D --store ''` served
    the current directory as its store. The store commands refuse `--store ''` (the same check,
    dlm.cli.store.store.check_store_path)."""
    file = tmp_path / "serve.toml"
    file.write_text('store = ""\n' if source == "file" else "")
    flags = {"store": {"flag": "", "file": None, "blank flag": "  "}[source]}
    got = "a blank value '  '" if source == "blank flag" else "an empty string"
    with pytest.raises(UsageError, match=f"invalid setting store: must name a directory, got {got}"):
        load_config(file, flags, environ={})


def test_a_blank_dlm_store_variable_is_refused_naming_it() -> None:
    """DLM_STORE=' ' is neither unset (empty) nor a directory: refused naming the variable."""
    with pytest.raises(UsageError, match="^DLM_STORE must name a directory, got a blank value ' '$"):
        load_config(None, {}, environ={"DLM_STORE": " "})


def test_an_empty_dlm_store_variable_is_unset_as_for_every_command() -> None:
    """An empty DLM_STORE was the current directory for `dlm serve`; the store commands (and the
    default store, dlm.cli.store.store.default_store_root) read it as unset."""
    assert load_config(None, {}, environ={"DLM_STORE": ""}).store is None
    assert load_config(None, {}, environ={"DLM_STORE": "/srv/store"}).store == Path("/srv/store")
    assert load_config(None, {"store": "."}, environ={"DLM_STORE": ""}).store == Path(".")  # said so: kept


def test_keyring_identifies_callers_by_key_id() -> None:
    ring = KeyRing(["sk-a", "sk-b"])
    assert ring.identify("Bearer sk-b") == key_id("sk-b")
    assert ring.identify("bearer  sk-a ") == key_id("sk-a")
    for header in (None, "", "sk-a", "Basic sk-a", "Bearer", "Bearer sk-c", "Bearer sk-a2"):
        with pytest.raises(APIError) as info:
            ring.identify(header)
        assert info.value.status == 401 and "sk-" not in info.value.message
    assert KeyRing([]).identify(None) == ANONYMOUS


def test_token_bucket_refills_continuously() -> None:
    bucket = TokenBucket(per_minute=60, level=60, stamp=0.0)
    assert bucket.take(60, now=0.0) == 0.0
    assert bucket.take(1, now=0.0) == pytest.approx(1.0)  # one per second
    assert bucket.take(1, now=1.0) == 0.0
    assert bucket.take(30, now=11.0) == pytest.approx(20.0)  # 10 refilled, 20 short
    assert bucket.take(10, now=11.0) == 0.0


def test_tool_call_parsing() -> None:
    text = (
        'Let me check. <tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>'
        '<tool_call>{"name": "g", "arguments": "{\\"y\\": 2}"}</tool_call>'
    )
    content, calls = parse_tool_calls(text)
    assert content.strip() == "Let me check."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("f", {"x": 1}),
        ("g", {"y": 2}),
    ]
    assert len({c["id"] for c in calls}) == 2
    broken = "<tool_call>{not json}</tool_call> and <tool_call>[1]</tool_call>"
    assert parse_tool_calls(broken) == (broken, [])
    unclosed = 'x <tool_call>{"name": "f"'
    assert parse_tool_calls(unclosed) == (unclosed, [])
    assert streamable("Hello <tool_ca") == "Hello"  # the space goes with a call, if one follows
    assert streamable("Hello <tool_call>{") == "Hello"
    assert streamable("a < b") == "a < b"


CALL = '<tool_call>{"name": "f", "arguments": {}}</tool_call>'


@pytest.mark.parametrize(
    "text",
    [
        f"Sure. {CALL}",
        f"Sure.\n\n{CALL}\n",
        f"  {CALL} and then {CALL} done ",
        f"<tool_call>[1]</tool_call> x {CALL}",
        "no call at all, trailing space ",
        f"Sure. <tool_call>{{broken</tool_call> {CALL}",
    ],
)
def test_streamed_content_is_the_whole_answers_content(text: str) -> None:
    """A stream sends `streamable` of what has committed so far, then the rest of the whole
    answer's content: what it sent must be a prefix of that content at every step, or the
    stream's text differs from the whole answer's ("Sure. " streamed, "Sure." answered)."""
    content, _ = parse_tool_calls(text)
    for end in range(len(text) + 1):
        sent = streamable(text[:end])
        assert content.startswith(sent), (text[:end], sent, content)


def test_parallel_tool_calls_false_takes_the_first_call_and_shows_the_rest() -> None:
    content, calls = parse_tool_calls(f"a {CALL} b {CALL}", most=1)
    assert [c["function"]["name"] for c in calls] == ["f"]
    assert content == f"a\nb {CALL}"
    assert parse_tool_calls(f"a {CALL} b {CALL}")[0] == "a\nb"


def dlm_serve(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "dlm", "serve", *args], cwd=ROOT, capture_output=True, text=True, timeout=120
    )


@pytest.mark.parametrize(
    "args, message",
    [
        (["/no/such/model"], "no model at"),
        (["--config", "/no/such/serve.toml"], "cannot read config file"),
        (["--port", "99999"], "invalid setting port"),
        (["--max-queue", "-1"], "invalid setting max_queue"),
    ],
)
@pytest.mark.slow
def test_serve_usage_errors_exit_2_with_one_line(args: list[str], message: str) -> None:
    result = dlm_serve(*args)
    assert result.returncode == 2, result.stderr
    assert message in result.stderr and "Traceback" not in result.stderr
    assert len([line for line in result.stderr.splitlines() if line.strip()]) == 1, result.stderr


@pytest.mark.slow
def test_a_model_that_fails_to_load_ends_the_server_visibly(tmp_path: Path) -> None:
    model = tmp_path / "mystery"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "mystery"}))
    result = dlm_serve(str(model), "--port", "0")
    assert result.returncode == 2, result.stderr
    assert "unsupported model_type" in result.stderr and "Traceback" not in result.stderr


@pytest.mark.slow
def test_remote_code_trust_without_the_transformers_backend_is_bad_usage() -> None:
    result = dlm_serve("--trust-remote-code", "--port", "0")
    assert result.returncode == 2, result.stderr
    assert "--trust-remote-code only applies to --backend transformers" in result.stderr


@pytest.mark.parametrize(
    ("settings", "words"),
    [
        ({"backend": "transformers", "kv_cache_dtype": "int8"}, "--kv-cache-dtype needs the native backend"),
        ({"backend": "transformers", "quantization": "int8"}, "--quantization needs the native backend"),
        ({"backend": "transformers", "tensor_parallel_size": 2}, "--tensor-parallel-size needs the native backend"),
        ({"trust_remote_code": True}, "--trust-remote-code only applies to --backend transformers"),
    ],
)
def test_settings_the_backend_cannot_honour_are_refused_with_the_settings(settings: dict[str, Any], words: str) -> None:
    """Refused as the settings are read, before `dlm serve` prints them and opens its port (the
    model's load refused them after both); `--quantization none` is no quantization."""
    with pytest.raises(UsageError, match=words):
        load_config(None, {"model": "tiny:sdar", **settings}, environ={})
    load_config(None, {"model": "tiny:sdar", "backend": "transformers", "quantization": "none"}, environ={})


def test_before_the_model_is_loaded_the_app_is_alive_but_not_ready() -> None:
    from fastapi.testclient import TestClient

    from dlm.cli.server.app import create_app

    app = create_app(load_config(None, {"api_keys": ["sk-k"]}, environ={}))
    client = TestClient(app)  # no lifespan: the model is never loaded
    assert client.get("/health").json() == {"status": "loading"}
    ready = client.get("/ready")
    assert ready.status_code == 503 and ready.json()["error"]["code"] == "not_ready"
    refused = client.post("/v1/completions", json={"prompt": "x"}, headers={"Authorization": "Bearer sk-k"})
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "not_ready"
    assert client.post("/v1/completions", json={"prompt": "x"}).status_code == 401  # keys first


def test_several_authorization_headers_are_refused_whichever_comes_first() -> None:
    """The routes read the first header: `Bearer sk-k` then `Bearer bad` was served (a proxy
    checking the last one saw a bad key), the other order refused."""
    from fastapi.testclient import TestClient

    from dlm.cli.server.app import create_app

    client = TestClient(create_app(load_config(None, {"api_keys": ["sk-k"]}, environ={})))  # not loaded
    assert client.get("/v1/models", headers={"Authorization": "Bearer sk-k"}).status_code == 200
    for pair in (["sk-k", "bad"], ["bad", "sk-k"], ["sk-k", "sk-k"]):
        headers = [("Authorization", f"Bearer {key}") for key in pair]
        for method, path in (("GET", "/v1/models"), ("POST", "/v1/completions"), ("POST", "/tokenize")):
            refused = client.request(method, path, headers=headers, json={"prompt": "x"})
            assert refused.status_code == 401, (pair, path, refused.text)
            assert (
                refused.json()["error"]["code"] == "invalid_api_key" and "several" in refused.json()["error"]["message"]
            )
        assert client.get("/health", headers=headers).status_code == 200  # reads no key


def test_gpu_memory_utilization_caps_the_cuda_allocator(monkeypatch: pytest.MonkeyPatch) -> None:
    """A ceiling on CUDA devices (the allocator refuses beyond it), nothing on the CPU."""
    import torch

    from dlm.engine.runtime.engine import cap_device_memory

    calls: list[tuple[float, torch.device]] = []
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", lambda f, d: calls.append((f, d)))
    assert cap_device_memory(torch.device("cuda", 1), 0.6) is True
    assert calls == [(0.6, torch.device("cuda", 1))]
    assert cap_device_memory(torch.device("cpu"), 0.6) is False
    assert cap_device_memory(torch.device("cuda", 0), None) is False and len(calls) == 1
    with pytest.raises(UsageError, match="gpu_memory_utilization must be in"):
        cap_device_memory(torch.device("cuda", 0), 1.2)


def test_weight_loading_logs_its_progress(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """A server loading a large checkpoint says how far it got, not nothing for minutes."""
    from dlm.cli.server.service import LoadProgress
    from dlm.engine.llm import LLM
    from dlm.engine.tiny_models import ensure_tiny_model

    monkeypatch.setattr(LoadProgress, "EVERY_S", 0.0)
    with caplog.at_level("INFO", logger="dlm"):
        LLM(ensure_tiny_model("tiny:llada"), dtype="float32", device="cpu", on_load=LoadProgress())
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("loading weights:")]
    assert lines and lines[-1].startswith(f"loading weights: {len(lines)} tensors read")


def test_a_key_file_saved_with_a_byte_order_mark_keeps_its_first_key(tmp_path: Path) -> None:
    """Notepad writes a BOM first: it became part of the first key, which then never matched."""
    keys = tmp_path / "keys.txt"
    keys.write_bytes(b"\xef\xbb\xbfsk-first\nsk-second\n")
    assert load_config(flags={"api_key_file": keys}, environ={}).keys() == ["sk-first", "sk-second"]
    settings = tmp_path / "serve.toml"
    settings.write_bytes(b"\xef\xbb\xbfmax_tokens = 10\n")  # tomllib refused the mark
    assert load_config(settings, environ={}).max_tokens == 10


@pytest.mark.parametrize("source", ["api_keys", "api_key_file", "admin_key", "admin_key_file"])
def test_a_key_no_request_can_present_is_refused_at_start(source: str, tmp_path: Path) -> None:
    """A key with a character outside ASCII (`sk-\u00fc`) started a server that answered its
    holder 401 on every request: the OpenAI SDK cannot put it in a header at all, and the
    UTF-8 bytes curl sends are read as Latin-1 (two other characters). Refused at start, as an
    empty key is, without echoing the key."""
    key = "sk-\u00fc"
    file = tmp_path / "keys.txt"
    file.write_text(f"sk-fine\n{key}\n", encoding="utf-8")
    sources: dict[str, dict[str, Any]] = {
        "api_keys": {"api_keys": [key]},
        "api_key_file": {"api_key_file": file},
        "admin_key": {"admin_key": key},
        "admin_key_file": {"admin_key_file": tmp_path / "admin.txt"},
    }
    (tmp_path / "admin.txt").write_text(key, encoding="utf-8")
    what = "an API key" if source.startswith("api") else "the admin key"
    with pytest.raises(UsageError, match=f"^{what} has a character outside ASCII") as refused:
        load_config(flags=sources[source], environ={})
    assert key not in str(refused.value)


@pytest.mark.parametrize("name", ["tpu", "mps", "meta", "xla", "cuda:x", "cuda:-1", "", "cpu:0", "cuda:\u0661"])
def test_a_device_dlm_does_not_run_on_is_refused_everywhere_it_is_named(name: str) -> None:
    """One rule (dlm.engine.device.device_name) for `dlm serve`'s setting, a deployment's
    (`dlm deploy kubernetes --device tpu` rendered pods with exit 0) and the engine's."""
    from dlm.engine.device import resolve_device

    with pytest.raises(UsageError, match=f"invalid setting device: must be auto, cpu, cuda or cuda:N, got {name!r}"):
        load_config(flags={"device": name}, environ={})
    with pytest.raises(UsageError, match="must be auto, cpu, cuda or cuda:N"):
        resolve_device(name)


@pytest.mark.parametrize(("name", "kept"), [("CPU", "cpu"), ("auto", "auto"), ("Cuda:1", "cuda:1")])
def test_device_spellings_are_kept_lower_cased(name: str, kept: str) -> None:
    assert load_config(flags={"device": name}, environ={}).device == kept


def test_a_config_made_in_python_defaults_max_tokens_as_a_loaded_one() -> None:
    """`create_app(ServeConfig(...))` (the Python way in) answers a request without max_tokens
    with as many tokens as `dlm serve` and `dlm batch` (load_config): min(128, max_tokens)."""
    from dlm.cli.server.config import ServeConfig, load_config

    for settings in ({}, {"max_tokens": 64}, {"default_max_tokens": 16}):
        made, loaded = ServeConfig(**settings), load_config(None, settings, environ={})
        assert made.default_gen_length == loaded.default_gen_length
        assert made.decoding_params({}).gen_length == loaded.decoding_params({}).gen_length


def test_a_cancellation_that_comes_as_the_model_loads_is_not_swallowed() -> None:
    """A request waiting for the model (`ready_wait`) whose task is cancelled (its client
    left, the server stops) in the step the load ends: `asyncio.wait_for` (Python 3.10, 3.11)
    dropped the cancellation and the handler went on as if nothing had happened; the
    cancellation must reach the caller."""
    import asyncio

    from starlette.types import Message

    from dlm.cli.server.app import create_app

    app = create_app(load_config(None, {}, environ={}))
    sent: list[Message] = []

    async def receive() -> Message:
        return {"type": "http.request", "body": b'{"prompt": "x"}', "more_body": False}

    async def send(message: Message) -> None:
        sent.append(message)

    async def scenario() -> None:
        loading = asyncio.get_running_loop().create_future()
        app.state.loading = loading
        scope = {
            "type": "http",
            "asgi": {"version": "3.0"},
            "http_version": "1.1",
            "method": "POST",
            "scheme": "http",
            "path": "/v1/completions",
            "raw_path": b"/v1/completions",
            "query_string": b"",
            "headers": [(b"host", b"test"), (b"content-type", b"application/json")],
            "client": ("127.0.0.1", 1),
            "server": ("test", 80),
            "app": app,
        }
        handler = asyncio.ensure_future(app(scope, receive, send))
        for _ in range(100):  # until it waits for the load (no step of the way sleeps)
            await asyncio.sleep(0)
        assert not handler.done() and not sent
        loading.add_done_callback(lambda _: handler.cancel())  # in the step the load ends
        loading.set_result(None)
        with pytest.raises(asyncio.CancelledError):
            await handler

    asyncio.run(scenario())
    assert not sent  # nothing answered for a request cancelled
