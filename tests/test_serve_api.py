"""`dlm serve` on the embedded default model, as a real process on 127.0.0.1, driven with
httpx and the official openai client: the OpenAI contract, dLLM fields, error paths,
continuous batching, equality with `dlm generate`, metrics and request logs."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from dlm.engine.default_model import NAME, default_model_dir
from dlm.engine.tokenizer import load_tokenizer
from tests.conftest import session_home
from tests.serving import ROOT, ServerProcess, ready_server, wait_until

pytestmark = pytest.mark.slow  # every test here starts processes

KEY, OTHER_KEY = "sk-test-alpha-1234", "sk-test-beta-5678"
ADMIN = "sk-test-operator-9012"  # two tenant keys: /metrics is the operator's
MODEL = NAME
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    key_file = tmp_path_factory.mktemp("keys") / "keys.txt"
    key_file.write_text(f"# one key per line\n{OTHER_KEY}\n")
    with ready_server(
        [
            "--api-key",
            KEY,
            "--api-key-file",
            str(key_file),
            "--max-num-seqs",
            "4",
            "--max-queue",
            "16",
            "--max-tokens",
            "256",
            "--max-model-len",
            "512",
            "--max-body-bytes",
            "8192",
        ],
        session_home(tmp_path_factory),
        env={"DLM_MAX_STEPS": "128", "DLM_ADMIN_KEY": ADMIN},
    ) as proc:
        yield proc


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120)


def post(
    server: ServerProcess,
    path: str,
    body: Any = None,
    headers: dict | None = None,
    content: bytes | None = None,
    timeout: float = 120,
) -> httpx.Response:
    headers = AUTH if headers is None else headers
    if content is not None:
        return httpx.post(server.url + path, content=content, headers=headers, timeout=timeout)
    return httpx.post(server.url + path, json=body, headers=headers, timeout=timeout)


def test_health_ready_and_models(server: ServerProcess) -> None:
    health = httpx.get(server.url + "/health").json()
    assert health["status"] == "ok"
    assert health["dtype"]["dtype"] in ("float32", "bfloat16") and health["kernels"]["fallbacks"] == {}
    # How the linear weights are held (dlm/kernels/packed_linear.py): the default model's layers
    # are under the packing floor in any dtype.
    assert health["kernels"]["linear"] == "dense"
    assert httpx.get(server.url + "/ready").status_code == 200
    for probe in ("/health", "/ready"):  # HEAD probes (curl -I, load balancers): a 405 before
        head = httpx.head(server.url + probe)
        assert head.status_code == 200 and head.content == b"", (probe, head.status_code)
    assert httpx.get(server.url + "/v1/models").status_code == 401
    models = httpx.get(server.url + "/v1/models", headers={"Authorization": f"Bearer {OTHER_KEY}"}).json()
    assert [m["id"] for m in models["data"]] == [MODEL]
    assert models["data"][0]["quantization"] is None  # dense weights
    # OpenAI's retrieve route (client.models.retrieve), keyed as the list is.
    assert httpx.get(f"{server.url}/v1/models/{MODEL}").status_code == 401
    one = httpx.get(f"{server.url}/v1/models/{MODEL}", headers={"Authorization": f"Bearer {OTHER_KEY}"})
    assert one.status_code == 200 and one.json() == models["data"][0]


def test_openai_client_completions_chat_and_streaming(client: openai.OpenAI) -> None:
    dllm = {"steps": 16, "block_length": 4}
    # A raw completion prompt in the default model's own chat format (its template, rendered),
    # answered with 11 tokens ("a b c d e f"). Blocks commit in order, so with 4-token blocks a
    # stream of it spans at least three of them, whatever order the model unmasks a block in
    # (in one 16-token block a trained model may fill the answer's first token last).
    messages = [{"role": "user", "content": "Copy: a b c d e f"}]
    task_prompt = load_tokenizer(default_model_dir()).apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False
    )
    done = client.completions.create(model=MODEL, prompt=task_prompt, max_tokens=32, extra_body=dllm)
    choice = done.choices[0]
    assert isinstance(choice.text, str) and choice.finish_reason in ("stop", "length")
    usage = done.usage.model_dump()
    assert 1 <= usage["denoising_steps"] <= 16  # 16 steps at most; fewer if EOS ends it early
    assert usage["prompt_tokens"] > 0 and usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]

    stream = client.completions.create(model=MODEL, prompt=task_prompt, max_tokens=32, extra_body=dllm, stream=True)
    pieces = [c.choices[0].text for c in stream if c.choices]
    assert "".join(pieces) == choice.text  # the committed prefix, streamed, adds up to the answer
    assert len([p for p in pieces if p]) >= 2  # it arrived over several denoising steps

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hi"}]
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=32, extra_body=dllm)
    assert chat.choices[0].message.role == "assistant"
    assert isinstance(chat.choices[0].message.content, str)
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=32,
            extra_body=dllm,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == chat.choices[0].message.content
    assert chunks[-1].usage is not None and chunks[-1].usage.model_dump()["denoising_steps"] >= 1
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("stop", "length")


def test_sse_wire_format_ends_with_done(server: ServerProcess) -> None:
    with httpx.stream(
        "POST",
        server.url + "/v1/completions",
        headers=AUTH,
        timeout=120,
        json={"prompt": "abc", "max_tokens": 16, "stream": True},
    ) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [line for line in response.iter_lines() if line]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    assert json.loads(events[-2][6:])["choices"][0]["finish_reason"] in ("stop", "length")


def test_server_output_equals_dlm_generate(server: ServerProcess, tmp_path_factory: pytest.TempPathFactory) -> None:
    prompt = "What is a diffusion language model?"
    generated = subprocess.run(
        [
            sys.executable,
            "-m",
            "dlm",
            "generate",
            "--prompt",
            prompt,
            "--chat",
            "--gen-length",
            "32",
            "--block-length",
            "16",
            "--steps",
            "16",
            "--dtype",  # the one the server's auto chose (each process probes its CPU)
            httpx.get(server.url + "/health").json()["dtype"]["dtype"],
            "--json",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**__import__("os").environ, "DLM_HOME": str(session_home(tmp_path_factory)), "OMP_NUM_THREADS": "1"},
    )
    assert generated.returncode == 0, generated.stderr
    expected = json.loads(generated.stdout)
    body = post(
        server,
        "/v1/chat/completions",
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": 32,
            "block_length": 16,
            "steps": 16,
            "temperature": 0,
            "return_token_ids": True,
        },
    ).json()
    choice = body["choices"][0]
    assert choice["message"]["content"] == expected["text"]
    ids = choice["token_ids"]
    assert ids == expected["output_ids"][: len(ids)]
    assert choice["finish_reason"] == expected["finish_reason"]
    assert body["usage"]["prompt_tokens"] == len(expected["prompt_ids"])


def test_fast_dllm_caches_are_served(server: ServerProcess) -> None:
    """The prefix/dual caches are request fields; the cost shows in fewer tokens per forward,
    not in fewer answers."""
    for cache in ("prefix", "dual"):
        response = post(
            server,
            "/v1/completions",
            {
                "model": MODEL,
                "prompt": "Hello",
                "max_tokens": 16,
                "block_length": 8,
                "steps": 8,
                "cache": cache,
                "return_token_ids": True,
            },
        )
        assert response.status_code == 200, response.text
        choice = response.json()["choices"][0]
        assert choice["finish_reason"] in ("stop", "length") and choice["token_ids"]


LONG_PROMPT = list(range(10, 600))


@pytest.mark.parametrize(
    "kwargs, status, kind, param, code",
    [
        (dict(content=b'{"prompt": "x", '), 400, "invalid_request_error", None, "invalid_json"),
        (dict(content=b"[1, 2]"), 400, "invalid_request_error", None, "invalid_json"),
        (dict(body={"prompt": "x", "max_tokens": "many"}), 400, "invalid_request_error", "max_tokens", "invalid_value"),
        (dict(body={"prompt": 12}), 400, "invalid_request_error", "prompt", "invalid_value"),
        (dict(body={"prompt": "x", "temperature": [1]}), 400, "invalid_request_error", "temperature", "invalid_value"),
        (dict(body={"prompt": "x", "stream": "yes"}), 400, "invalid_request_error", "stream", "invalid_value"),
        (dict(body={"model": "gpt-4", "prompt": "x"}), 404, "not_found_error", "model", "model_not_found"),
        (
            dict(body={"prompt": LONG_PROMPT, "max_tokens": 16}),
            400,
            "invalid_request_error",
            "prompt",
            "context_length_exceeded",
        ),
        (
            dict(body={"prompt": "x", "max_tokens": 512}),
            400,
            "invalid_request_error",
            "max_tokens",
            "max_tokens_exceeded",
        ),
        (
            dict(body={"prompt": "x", "max_tokens": 32, "steps": 256}),
            400,
            "invalid_request_error",
            "steps",
            "steps_exceeded",
        ),
        (
            dict(body={"prompt": "x", "max_tokens": 8, "min_tokens": 9}),
            400,
            "invalid_request_error",
            "min_tokens",
            "invalid_value",
        ),
        (dict(body={"prompt": "x", "threshold": 1.5}), 400, "invalid_request_error", "threshold", "invalid_value"),
        (
            dict(body={"prompt": "x", "remasking": "sideways"}),
            400,
            "invalid_request_error",
            "remasking",
            "invalid_value",
        ),
        (dict(body={"prompt": "x", "cache": "block"}), 400, "invalid_request_error", "cache", "invalid_value"),
        (dict(body={"prompt": "x", "cache": "quad"}), 400, "invalid_request_error", "cache", "invalid_value"),
        (dict(body={"prompt": "x", "alg": "entropy"}), 400, "invalid_request_error", "alg", "unsupported"),
        (dict(body={"prompt": "x", "top_p": 0.5}), 400, "invalid_request_error", "top_p", "unsupported"),
        (dict(body={"prompt": "x", "decode_mode": "ar"}), 400, "invalid_request_error", "decode_mode", "unsupported"),
        (dict(body={"prompt": "x", "n": 65}), 400, "invalid_request_error", "n", "invalid_value"),
        (dict(body={"prompt": ["a", "b"]}), 400, "invalid_request_error", "prompt", "unsupported"),
        (dict(body={"prompt": [99999]}), 400, "invalid_request_error", "prompt", "invalid_value"),
        (dict(body={"prompt": "x"}, headers={}), 401, "authentication_error", None, "invalid_api_key"),
        (
            dict(body={"prompt": "x"}, headers={"Authorization": "Bearer sk-wrong"}),
            401,
            "authentication_error",
            None,
            "invalid_api_key",
        ),
        (
            dict(body={"prompt": "x"}, headers={"Authorization": KEY}),
            401,
            "authentication_error",
            None,
            "invalid_api_key",
        ),
        (dict(body={"prompt": "x" * 9000}), 413, "invalid_request_error", None, "request_too_large"),
        (  # a compressed body: named as such (it was a 400 'not UTF-8 text')
            dict(
                content=gzip.compress(b'{"prompt": "x"}'),
                headers={**AUTH, "Content-Type": "application/json", "Content-Encoding": "gzip"},
            ),
            415,
            "invalid_request_error",
            None,
            "unsupported_content_encoding",
        ),
    ],
)
def test_completion_error_paths(
    server: ServerProcess, kwargs: dict, status: int, kind: str, param: str | None, code: str | None
) -> None:
    response = post(server, "/v1/completions", kwargs.get("body"), kwargs.get("headers"), kwargs.get("content"))
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["type"], error["param"], error["code"]) == (kind, param, code), error
    assert error["message"]


@pytest.mark.parametrize(
    "body, status, param",
    [
        ({"messages": []}, 400, "messages"),
        ({"messages": "hi"}, 400, "messages"),
        ({"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages.0.role"),
        ({"messages": [{"role": "user", "content": 5}]}, 400, "messages.0.content"),
        ({"messages": [{"role": "user", "content": "hi"}], "tool_choice": "required"}, 400, "tool_choice"),
        ({"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]}, 400, "tools.0.function"),
        (
            {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 1000},
            400,
            "max_completion_tokens",  # the field the client sent
        ),
        (
            {"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "json_schema"}},
            400,
            "response_format",
        ),
    ],
)
def test_chat_error_paths(server: ServerProcess, body: dict, status: int, param: str) -> None:
    response = post(server, "/v1/chat/completions", body)
    assert response.status_code == status, response.text
    assert response.json()["error"]["param"] == param


def test_unknown_routes_and_methods_answer_openai_errors(server: ServerProcess) -> None:
    missing = httpx.get(server.url + "/v1/nothing", headers=AUTH)
    assert missing.status_code == 404 and missing.json()["error"]["type"] == "not_found_error"
    wrong = httpx.get(server.url + "/v1/completions", headers=AUTH)
    assert wrong.status_code == 405 and "error" in wrong.json()


def test_odd_inputs_never_answer_500(server: ServerProcess) -> None:
    odd: list[Any] = [None, True, -1, 0, 1e308, float("nan"), "", [], {"a": 1}, [[1, 2]], [-5], 2**70]
    fields = [
        "prompt",
        "max_tokens",
        "temperature",
        "steps",
        "block_length",
        "threshold",
        "stop",
        "seed",
        "cache",
        "stream_options",
    ]

    def send(path: str, body: dict) -> httpx.Response:
        raw = json.dumps(body).encode()  # NaN goes out as NaN, as a careless client would send it
        response = post(server, path, content=raw, headers={**AUTH, "Content-Type": "application/json"})
        assert response.status_code < 500, (body, response.text)
        return response

    statuses = set()
    for field in fields:
        for value in odd:
            response = send("/v1/completions", {"prompt": "hi", "max_tokens": 1, field: value})
            statuses.add(response.status_code)
            if response.status_code == 200:
                assert response.json()["choices"][0]["finish_reason"] in ("stop", "length")
    for value in odd:
        send("/v1/chat/completions", {"messages": value, "max_tokens": 1})
        send("/v1/chat/completions", {"messages": [{"role": "user", "content": value}], "max_tokens": 1})
    assert statuses >= {200, 400}
    assert httpx.get(server.url + "/health").status_code == 200


def _forwards(requests: list[dict], server: ServerProcess, concurrent: bool) -> tuple[float, float]:
    """Send the requests one after another or all at once; return the forwards the server ran
    for them and the sequence-steps those forwards held (the `dlm_batch_size` histogram's count
    and sum grow by one forward and by its batch size at every step)."""

    def one(body: dict) -> None:
        response = post(server, "/v1/completions", body)
        assert response.status_code == 200, response.text

    before = server.metrics(ADMIN)
    if concurrent:
        threads = [threading.Thread(target=one, args=(b,)) for b in requests]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=300)
    else:
        for b in requests:
            one(b)
    after = server.metrics(ADMIN)
    count, total = ("dlm_batch_size_count", "dlm_batch_size_sum")
    return after[count] - before[count], after[total] - before[total]


def test_continuous_batching_shares_forwards(server: ServerProcess) -> None:
    """Concurrent requests with different prompts, lengths and blocks share forwards: the same
    sequence-steps in far fewer forwards than one request at a time. Counted, not timed (what
    that saves in seconds is measured by benchmarks/serve_overhead.py)."""
    requests = [
        {"prompt": f"request {i} " * (1 + i % 3), "max_tokens": 16 + 16 * (i % 2), "steps": 16, "block_length": 16}
        for i in range(8)
    ]
    seq_forwards, seq_steps = _forwards(requests, server, concurrent=False)
    con_forwards, con_steps = _forwards(requests, server, concurrent=True)
    assert seq_forwards == seq_steps  # alone, every forward holds one sequence
    assert con_steps == seq_steps  # the same work: each request takes its own number of steps
    assert con_forwards < 0.75 * seq_forwards, (seq_forwards, con_forwards)
    m = server.metrics(ADMIN)
    assert m['dlm_batch_size_bucket{le="4.0"}'] == m["dlm_batch_size_count"]  # never more than --max-num-seqs 4


def test_one_key_filling_the_queue_does_not_turn_the_other_away(server: ServerProcess) -> None:
    """Two keys, a queue of 16: one key flooding it holds at most its share (8 waiting
    besides what runs) and gets 429 beyond it; the other key's request is still queued and
    answered, between the first key's waiting requests (round-robin). The flood comes once
    the first 4 run, so the count is the share's alone (a burst the batch's free room takes
    at the next step is not counted against the queue: tests/test_serve_scheduler.py)."""
    body = {"prompt": "flood", "max_tokens": 128, "steps": 128, "block_length": 128}
    statuses: list[int] = []

    def flood() -> None:
        statuses.append(post(server, "/v1/completions", body).status_code)

    threads = [threading.Thread(target=flood) for _ in range(20)]
    for t in threads[:4]:
        t.start()
    assert wait_until(lambda: server.metrics(ADMIN).get("dlm_num_requests_running") == 4, timeout=60)
    for t in threads[4:]:
        t.start()
    assert wait_until(lambda: statuses.count(429) >= 8, timeout=120), statuses
    other = post(
        server,
        "/v1/completions",
        {**body, "max_tokens": 8, "steps": 8, "block_length": 8},
        headers={"Authorization": f"Bearer {OTHER_KEY}"},
    )
    for t in threads:
        t.join(timeout=600)
    assert other.status_code == 200, other.text
    assert statuses.count(429) == 8 and statuses.count(200) == 12, statuses  # 4 running + its share of 8


def test_metrics_names_and_auth(server: ServerProcess) -> None:
    assert httpx.get(server.url + "/metrics").status_code == 401
    for key in (KEY, OTHER_KEY):  # a tenant's key: every tenant's traffic is not its to read
        refused = httpx.get(server.url + "/metrics", headers={"Authorization": f"Bearer {key}"})
        assert refused.status_code == 403 and refused.json()["error"]["code"] == "admin_key_required"
    post(server, "/v1/completions", {"prompt": "count me", "max_tokens": 8})
    assert post(server, "/v1/completions", {"prompt": "no key"}, headers={}).status_code == 401
    names = {k.split("{")[0] for k in server.metrics(ADMIN)}
    for name in (
        "dlm_num_requests_running",
        "dlm_num_requests_waiting",
        "dlm_batch_token_usage_perc",
        "dlm_kv_cache_bytes",
        "dlm_e2e_request_latency_seconds_count",
        "dlm_time_to_first_token_seconds_count",
        "dlm_request_queue_time_seconds_count",
        "dlm_request_denoising_steps_count",
        "dlm_tokens_per_step_count",
        "dlm_step_duration_seconds_count",
        "dlm_batch_size_count",
        "dlm_prompt_tokens_total",
        "dlm_generation_tokens_total",
        "dlm_request_success_total",
        "dlm_request_rejections_total",
        "dlm_request_timeouts_total",
        "dlm_http_requests_client_disconnected_total",
    ):
        assert name in names, name
    m = server.metrics(ADMIN)
    assert m['dlm_request_rejections_total{reason="invalid_api_key"}'] >= 1
    assert m["dlm_tokens_per_step_sum"] > 0 and m["dlm_prompt_tokens_total"] > 0
    assert m["dlm_kv_cache_bytes"] == 0  # every request is done: no cache is held
    info = [k for k in m if k.startswith("dlm_model_info{")]
    assert len(info) == 1 and m[info[0]] == 1 and 'deployment=""' in info[0], info  # one series: what serves
    assert m["process_resident_memory_bytes"] > 0
    assert "dlm_gpu_memory_allocated_bytes" not in m  # exported on CUDA only


def test_tokenize_detokenize_and_version_as_vllm_has_them(server: ServerProcess) -> None:
    """`/tokenize` gives the ids the server decodes from (a completion's prompt, or a chat with
    its template applied), `/detokenize` turns ids back, `/version` says dlm's version."""
    tokens = post(server, "/tokenize", {"prompt": "Hello, diffusion"}).json()
    assert tokens["count"] == len(tokens["tokens"]) > 0 and tokens["max_model_len"] > 0
    assert post(server, "/detokenize", {"tokens": tokens["tokens"]}).json() == {"prompt": "Hello, diffusion"}
    chat = post(server, "/tokenize", {"messages": [{"role": "user", "content": "Hello, diffusion"}]}).json()
    assert chat["count"] > tokens["count"]  # the template adds its role markers
    completion = post(
        server, "/v1/completions", {"prompt": "Hello, diffusion", "max_tokens": 8, "return_token_ids": True}
    )
    assert completion.json()["usage"]["prompt_tokens"] == tokens["count"]
    assert post(server, "/tokenize", {"prompt": "x"}, headers={}).status_code == 401
    bad = post(server, "/detokenize", {"tokens": [10**9]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    assert bad.json()["error"]["code"] == "invalid_value"
    assert post(server, "/detokenize", {"tokens": [1], "nope": 1}).status_code == 400
    assert httpx.get(server.url + "/version").json()["version"]


def test_request_log_lines_carry_ids_not_secrets_or_text(server: ServerProcess) -> None:
    secret_prompt = "the secret prompt 42"
    post(server, "/v1/completions", {"prompt": secret_prompt, "max_tokens": 8})
    logs = server.request_logs()
    assert logs, "\n".join(server.lines)
    last = [line for line in logs if line["status"] == 200][-1]
    for field in (
        "id",
        "key",
        "status",
        "latency_s",
        "prompt_tokens",
        "completion_tokens",
        "denoising_steps",
        "finish_reason",
    ):
        assert field in last
    assert last["key"].startswith("key-")
    everything = "\n".join(server.lines)
    assert KEY not in everything and OTHER_KEY not in everything
    assert secret_prompt not in everything
