"""`dlm batch` line by line, in process over the tiny LLaDA: a line the app fails on gets its
500 record and every other line its answer; lines holding U+2028, U+2029 or U+0085 are read,
written and resumed; an OUTPUT that is not a batch output, or that another run holds, is
refused with nothing in it changed. (Whole-process runs, kills and resumes: test_batch.py.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import dlm.cli.batch
import dlm.engine.tokenizer
from dlm.cli.batch import claim_output, read_requests
from dlm.cli.jsonl import lines
from tests.tiny_families import tiny_names
from tests.weights_helpers import cli

SEPARATORS = "\u2028\u2029\u0085"  # str.splitlines breaks at these; JSON strings hold them raw


def request(custom_id: str, prompt: str, **body: object) -> dict:
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": "/v1/completions",
        "body": {"prompt": prompt, "max_tokens": 4, "temperature": 0, **body},
    }


def write(path: Path, items: list[dict]) -> Path:
    path.write_text("".join(json.dumps(item, ensure_ascii=False) + "\n" for item in items), encoding="utf-8")
    return path


def run(source: Path, out: Path) -> tuple[int, dict | None, str]:
    code, stdout, stderr = cli("batch", str(source), str(out), "--model", "tiny:llada", "--json")
    return code, json.loads(stdout) if stdout.strip() else None, stderr


def results(out: Path) -> dict[str, dict]:
    records = [json.loads(line) for line in lines(out.read_text(encoding="utf-8"))]
    ids = [r["custom_id"] for r in records]
    assert len(ids) == len(set(ids)), "a request was answered twice"
    return {r["custom_id"]: r for r in records}


def test_a_line_the_app_fails_on_gets_its_error_and_the_rest_are_answered(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = dlm.engine.tokenizer.encode

    def failing(tokenizer: object, text: str, chat: bool = False) -> list[int]:
        if text == "explode":
            raise RuntimeError("injected failure")
        return real(tokenizer, text, chat)

    monkeypatch.setattr(dlm.engine.tokenizer, "encode", failing)
    items = [request(f"q{i}", "explode" if i == 3 else f"line {i}") for i in range(7)]
    source, out = write(tmp_path / "in.jsonl", items), tmp_path / "out.jsonl"
    code, summary, stderr = run(source, out)
    assert code == 0, stderr
    assert summary is not None and summary | {"output": None} == {
        "total": 7,
        "skipped": 0,
        "completed": 6,
        "failed": 1,
        "output": None,
    }
    assert "Traceback" not in stderr and "RuntimeError: injected failure" in stderr
    got = results(out)
    assert set(got) == {f"q{i}" for i in range(7)}
    bad = got["q3"]
    assert bad["response"]["status_code"] == 500
    assert bad["error"] == bad["response"]["body"]["error"]
    assert bad["error"]["type"] == "server_error" and "injected failure" in bad["error"]["message"]
    assert all(got[f"q{i}"]["response"]["status_code"] == 200 for i in range(7) if i != 3)
    before = out.read_bytes()
    code, summary, stderr = run(source, out)  # the rerun finds every line answered
    assert code == 0 and summary is not None, stderr
    assert (summary["skipped"], summary["completed"], summary["failed"]) == (7, 0, 0)
    assert out.read_bytes() == before


def test_line_separators_inside_strings_are_read_answered_and_resumed(tmp_path: Path) -> None:
    items = [request(f"s{i}", f"say {SEPARATORS[i % 3]} then {i}", echo=True) for i in range(6)]
    items.append(request("bad", "x", **{f"odd{SEPARATORS}field": 1}))  # refused: its error names the field
    source = write(tmp_path / "in.jsonl", items)
    assert [r.custom_id for r in read_requests(source)] == [item["custom_id"] for item in items]
    out = tmp_path / "out.jsonl"
    code, summary, stderr = run(source, out)
    assert code == 0 and summary is not None, stderr
    full = results(out)
    for item in items[:-1]:
        assert full[item["custom_id"]]["response"]["body"]["choices"][0]["text"].startswith(item["body"]["prompt"])
    assert full["bad"]["error"]["param"] == f"odd{SEPARATORS}field"
    assert all(ch in out.read_text(encoding="utf-8") for ch in SEPARATORS)  # written raw, not escaped
    # A kill after three whole lines, in the middle of the fourth (cut inside a separator's bytes).
    raw = out.read_bytes().split(b"\n")
    fourth = raw[3]
    cut = fourth.index(next(ch.encode() for ch in SEPARATORS if ch.encode() in fourth)) + 1
    out.write_bytes(b"\n".join(raw[:3]) + b"\n" + fourth[:cut])
    code, summary, stderr = run(source, out)
    assert code == 0 and summary is not None, stderr
    assert (summary["skipped"], summary["completed"] + summary["failed"]) == (3, 4)
    assert set(results(out)) == set(full)


def test_a_line_names_the_model_as_dlm_serve_of_the_same_model_answers_to(tmp_path: Path) -> None:
    """`dlm batch --model tiny:llada` answers a line whose body names `tiny:llada`, as `dlm
    serve tiny:llada` does (the server's one rule names the model from MODEL as given), and
    refuses another name with the server's 404. It used to be named after the resolved
    directory (`tiny-llada-v1`), refusing the name it was given."""
    from tests.serving import app_client

    with app_client({"model": "tiny:llada", "warmup": False}) as client:  # MODEL as `dlm serve` takes it
        served = client.get("/v1/models").json()["data"][0]["id"]
        wrong = client.post("/v1/completions", json={"model": "nope", "prompt": "hi", "max_tokens": 1}).json()
    assert served == "tiny:llada"
    source = write(
        tmp_path / "in.jsonl", [request("named", "hello", model=served), request("wrong", "hi", model="nope")]
    )
    out = tmp_path / "out.jsonl"
    code, summary, stderr = run(source, out)
    assert code == 0 and summary is not None, stderr
    got = results(out)
    named = got["named"]["response"]
    assert named["status_code"] == 200 and named["body"]["model"] == served, named
    assert got["wrong"]["response"]["status_code"] == 404 and got["wrong"]["error"] == wrong["error"]


@pytest.mark.parametrize(
    "content",
    [
        b"notes about the batch\nsecond line\n",
        b"a text file without a final newline",
        b'{"custom_id": "q0", "method": "POST", "url": "/v1/completions", "body": {}}\n',  # INPUT given as OUTPUT
        b'{"id": "batch_req_1", "custom_id": "q0", "response": null, "error": null}\n\xff\xfe\n',
        b"[1, 2]\n",
    ],
    ids=["text", "text-no-newline", "requests", "not-utf8", "not-an-object"],
)
def test_an_output_that_is_not_a_batch_output_is_refused_untouched(tmp_path: Path, content: bytes) -> None:
    source = write(tmp_path / "in.jsonl", [request("q0", "hello")])
    out = tmp_path / "out.jsonl"
    out.write_bytes(content)
    code, summary, stderr = run(source, out)
    assert code == 2 and summary is None
    assert "error:" in stderr and "not a dlm batch output" in stderr.replace("\n", " ")
    assert "Traceback" not in stderr
    assert out.read_bytes() == content


@pytest.mark.parametrize(
    ("change", "says"),
    [
        ({"custom_id": ""}, "custom_id must be a non-empty string"),
        ({"custom_id": 5}, "custom_id must be a non-empty string"),
        ({"custom_id": "q0"}, "custom_id 'q0' appears twice"),
        ({"method": "GET"}, "got 'GET' to '/v1/completions'"),
        ({"url": "/v1/embeddings"}, "got 'POST' to '/v1/embeddings'"),
        ({"body": [1]}, "body must be a JSON object"),
        ({"body": {"prompt": "hi", "stream": True}}, "cannot stream"),
        ({"max_tokens": 5}, "unknown field 'max_tokens'"),  # was silently ignored
    ],
    ids=["empty-id", "number-id", "duplicate-id", "get", "other-url", "body-not-object", "stream", "unknown-field"],
)
def test_a_bad_input_line_is_refused_by_number_before_anything_runs(tmp_path: Path, change: dict, says: str) -> None:
    source = write(tmp_path / "in.jsonl", [request("q0", "hello"), {**request("q1", "hi"), **change}])
    out = tmp_path / "out.jsonl"
    code, summary, stderr = run(source, out)
    assert code == 2 and summary is None
    assert "in.jsonl:2: " in stderr and says in stderr.replace("\n", " "), stderr
    assert "Traceback" not in stderr and not out.exists()


def test_a_deployment_is_refused_and_the_config_files_model_is_served(tmp_path: Path) -> None:
    """MODEL comes as `dlm serve` takes it: `--config`'s `model` when --model is not given
    (it used to be the embedded default model whatever the file said); a `deployment` is a
    usage error (its one server is `dlm serve`'s)."""
    source = write(tmp_path / "in.jsonl", [request("q0", "hello", model="tiny:llada")])
    settings = tmp_path / "serve.toml"
    settings.write_text('deployment = "prod"\n')
    code, _, stderr = cli("batch", str(source), str(tmp_path / "a.jsonl"), "--config", str(settings))
    assert code == 2 and "error: dlm batch answers with --model, not a deployment" in stderr, stderr
    settings.write_text('model = "tiny:llada"\n')
    out = tmp_path / "b.jsonl"
    code, _, stderr = cli("batch", str(source), str(out), "--config", str(settings))
    assert code == 0, stderr
    assert results(out)["q0"]["response"]["status_code"] == 200, results(out)


@pytest.mark.parametrize(
    ("text", "flags", "batch"),
    [
        ('model = "tiny:llada"\nmax_num_seqs = 3\n', [], 3),
        ("model: tiny:llada\nservice:\n  max_concurrency: 2\n", [], 2),  # guide 003's file
        ('model = "tiny:llada"\nmax_num_seqs = 3\n', ["--max-concurrency", "5"], 5),  # the flag wins
        ('model = "tiny:llada"\n', [], 8),
    ],
)
def test_the_config_files_batch_size_is_the_batchs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, text: str, flags: list[str], batch: int
) -> None:
    """`--config`'s `max_num_seqs` (guide 003's `service.max_concurrency`) is read as `dlm
    serve` reads it: --max-concurrency's default 8 used to replace it without a word."""
    seen: list[tuple[int, int]] = []

    async def record(config, requests, output, concurrency, on_result=None):  # type: ignore[no-untyped-def]
        seen.append((config.max_num_seqs, concurrency))
        return dlm.cli.batch.BatchSummary(len(requests), 0, 0, 0)

    monkeypatch.setattr(dlm.cli.batch, "run_batch", record)
    settings = tmp_path / ("serve.yaml" if "service:" in text else "serve.toml")
    settings.write_text(text)
    source = write(tmp_path / "in.jsonl", [request("q0", "hello")])
    code, _, stderr = cli("batch", str(source), str(tmp_path / "out.jsonl"), "--config", str(settings), *flags)
    assert code == 0, stderr
    assert seen == [(batch, batch)]


def test_a_lines_n_is_judged_by_the_config_files_queue_whatever_the_files_length(tmp_path: Path) -> None:
    """`dlm batch` set max_queue to INPUT's line count: a line's `n` was judged against it, so
    the same line was answered 200 where `dlm serve` with the same --config answers 400 (no
    wait lets 2 samples in with max_num_seqs 1 and max_queue 0), and a line of n 20 was refused
    in a file of 1 line and answered in one of 20."""
    settings = tmp_path / "serve.yaml"
    settings.write_text("model: tiny:llada\nmax_num_seqs: 1\nmax_queue: 0\n")
    source = write(tmp_path / "in.jsonl", [request("q0", "hi", n=2), request("q1", "hi")])
    out = tmp_path / "out.jsonl"
    code, _, stderr = cli("batch", str(source), str(out), "--config", str(settings))
    assert code == 0, stderr
    answers = results(out)
    assert answers["q0"]["response"]["status_code"] == 400, answers["q0"]
    assert answers["q0"]["error"]["param"] == "n"
    assert answers["q1"]["response"]["status_code"] == 200


def test_an_output_directory_is_refused(tmp_path: Path) -> None:
    source = write(tmp_path / "in.jsonl", [request("q0", "hello")])
    code, _, stderr = run(source, tmp_path)
    assert code == 2 and "is a directory" in stderr


def test_a_second_run_on_the_same_output_is_refused(tmp_path: Path) -> None:
    import os

    source = write(tmp_path / "in.jsonl", [request("q0", "hello")])
    out = tmp_path / "out.jsonl"
    with claim_output(out, read_requests(source)) as held:  # another run, holding OUTPUT
        assert [r.custom_id for r in held.todo] == ["q0"]
        code, summary, stderr = run(source, out)
    assert code == 1 and summary is None
    assert f"another dlm batch (pid {os.getpid()}) is writing" in stderr.replace("\n", " ")
    assert out.read_bytes() == b""


def test_a_run_that_fails_midway_shuts_its_engine_down(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A failure that ends the run (here OUTPUT's disk filling up) is one `error:` line and
    exit 1, and the engine is shut down on the way out, never left decoding into the
    interpreter's exit (where it aborted the process: SIGABRT, exit 134)."""
    from dlm.cli.batch import BatchOutput
    from dlm.cli.server.service import Service

    shut: list[Service] = []
    real_shutdown = Service.shutdown

    def shutdown(self: Service) -> None:
        shut.append(self)
        real_shutdown(self)

    def full(self: BatchOutput, record: dict) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(Service, "shutdown", shutdown)
    monkeypatch.setattr(BatchOutput, "append", full)
    source = write(tmp_path / "in.jsonl", [request(f"q{i}", f"line {i}") for i in range(4)])
    code, summary, stderr = run(source, tmp_path / "out.jsonl")
    assert code == 1 and summary is None
    assert "error: [Errno 28] No space left on device" in stderr and "Traceback" not in stderr
    assert len(shut) == 1


def test_unpaired_surrogates_are_answered_as_the_server_answers_them(tmp_path: Path) -> None:
    """JSON reads `"\\ud800"` as a lone surrogate, which UTF-8 cannot encode. In a body it got a
    500 (the batch could not encode the request) where `dlm serve` answers 400; in a custom_id
    it was a traceback that ended the run with the other lines unanswered. Now the body gets
    the server's 400, the custom_id is written back escaped, and a rerun finds it answered."""
    source = tmp_path / "in.jsonl"
    source.write_text(
        json.dumps(request("q0", "hello"))
        + "\n"
        + json.dumps(request("lone\ud800id", "hi"))
        + "\n"
        + json.dumps(request("q2", "hi \ud800 there"))
        + "\n",
        encoding="ascii",  # json.dumps escapes them: the file is valid JSON Lines
    )
    out = tmp_path / "out.jsonl"
    code, summary, stderr = run(source, out)
    assert code == 0 and summary is not None, stderr
    assert "Traceback" not in stderr
    got = results(out)
    assert set(got) == {"q0", "lone\ud800id", "q2"}
    assert got["q0"]["response"]["status_code"] == 200 and got["lone\ud800id"]["response"]["status_code"] == 200
    assert got["q2"]["response"]["status_code"] == 400, got["q2"]
    assert got["q2"]["error"]["param"] == "prompt" and "surrogate" in got["q2"]["error"]["message"]
    out.read_bytes().decode("utf-8")  # OUTPUT stays UTF-8
    code, summary, stderr = run(source, out)
    assert code == 0 and summary is not None, stderr
    assert (summary["skipped"], summary["completed"], summary["failed"]) == (3, 0, 0)


def test_a_rate_limited_line_waits_and_is_answered(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A `--config` with a rate limit (`requests_per_minute`) answers 429 once its bucket is
    empty; the batch wrote that 429 as the line's result, and a rerun skips it for good (295
    of 300 lines failed at 5 a minute). Now a 429 is retried after its Retry-After."""
    from dlm.cli.server.ratelimit import RateLimiter

    real = RateLimiter.check
    refused: list[str] = []

    def check(self: RateLimiter, key: str, kind: str, amount: float = 1.0) -> int:
        if kind == "requests" and not refused:  # the bucket empty for the first request
            refused.append(key)
            return 1
        return real(self, key, kind, amount)

    monkeypatch.setattr(RateLimiter, "check", check)
    settings = tmp_path / "serve.toml"
    settings.write_text('model = "tiny:llada"\nrequests_per_minute = 6000\n')
    source = write(tmp_path / "in.jsonl", [request(f"q{i}", f"line {i}") for i in range(3)])
    out = tmp_path / "out.jsonl"
    code, stdout, stderr = cli("batch", str(source), str(out), "--config", str(settings), "--json")
    assert code == 0, stderr
    assert refused, "the rate limit never answered 429"
    assert json.loads(stdout)["failed"] == 0
    assert all(r["response"]["status_code"] == 200 for r in results(out).values()), results(out)


def test_an_output_fifo_is_refused_as_not_a_regular_file(tmp_path: Path) -> None:
    """A FIFO as OUTPUT failed opening it (exit 1, `error: File or stream is not seekable.`);
    docs/batch.md makes an OUTPUT that is not a regular file a usage error."""
    import os

    source = write(tmp_path / "in.jsonl", [request("q0", "hello")])
    fifo = tmp_path / "out.fifo"
    os.mkfifo(fifo)
    code, summary, stderr = run(source, fifo)
    assert code == 2 and summary is None, stderr
    assert f"OUTPUT {fifo} is not a regular file" in stderr.replace("\n", ""), stderr


def test_an_input_opening_with_a_byte_order_mark_is_read(tmp_path: Path) -> None:
    """A UTF-8 BOM (what Notepad and PowerShell write) made line 1 `not JSON` (exit 2)."""
    source = tmp_path / "in.jsonl"
    source.write_bytes(b"\xef\xbb\xbf" + (json.dumps(request("q0", "hello")) + "\r\n").encode())
    assert [r.custom_id for r in read_requests(source)] == ["q0"]
    out = tmp_path / "out.jsonl"
    code, summary, stderr = run(source, out)
    assert code == 0 and summary is not None, stderr
    assert results(out)["q0"]["response"]["status_code"] == 200


def test_a_rerun_whose_input_changed_an_answered_request_is_refused_untouched(tmp_path: Path) -> None:
    """A result answers the request it was made for: a rerun whose INPUT now holds another
    body (or url) under an answered custom_id, or no longer holds it, would keep an answer to
    a question nobody asks; it is a usage error naming OUTPUT's line, and OUTPUT is kept as
    it was. The same requests written with their keys in another order resume."""
    items = [request("q0", "hello"), request("q1", "world")]
    source = write(tmp_path / "in.jsonl", items)
    out = tmp_path / "out.jsonl"
    code, summary, stderr = run(source, out)
    assert code == 0 and summary is not None and summary["completed"] == 2, stderr
    answered = out.read_bytes()
    line = next(n for n, r in enumerate(lines(answered.decode()), 1) if json.loads(r)["custom_id"] == "q1")

    changed = [items[0], request("q1", "world", max_tokens=2)]
    for now, says in (
        (changed, f"out.jsonl:{line}: answers custom_id 'q1' for another request than INPUT's"),
        ([{**items[1], "url": "/v1/chat/completions"}, items[0]], "for another request than INPUT's"),
        ([items[0]], f"out.jsonl:{line}: answers custom_id 'q1', which INPUT does not hold"),
    ):
        code, summary, stderr = run(write(tmp_path / "in.jsonl", now), out)
        assert code == 2 and summary is None and says in " ".join(stderr.split()), stderr
        assert out.read_bytes() == answered

    reordered = [{**item, "body": dict(reversed(item["body"].items()))} for item in reversed(items)]
    code, summary, stderr = run(write(tmp_path / "in.jsonl", reordered), out)
    assert code == 0 and summary == {**summary, "skipped": 2, "completed": 0}, stderr
    assert out.read_bytes() == answered


@pytest.mark.parametrize("name", tiny_names())
def test_the_config_files_response_cache_answers_a_repeated_line_without_a_forward(tmp_path: Path, name: str) -> None:
    """`dlm batch --config` serves with the file's settings, `response_cache_size` too: a line
    repeating an earlier one (seeded, so reproducible under every family's sampler; one line
    at a time, so the first is answered before the second is looked up) is answered from the
    cache with the same choices, for every family the registry decodes (fp32)."""
    settings = tmp_path / "serve.yaml"
    settings.write_text(f"model: tiny:{name}\ndtype: float32\nmax_num_seqs: 1\nresponse_cache_size: 2\n")
    line = {"prompt": [5, 6, 7], "max_tokens": 8, "seed": 3, "return_token_ids": True}
    items = [{"custom_id": c, "method": "POST", "url": "/v1/completions", "body": line} for c in ("q0", "q1")]
    out = tmp_path / "out.jsonl"
    code, _, stderr = cli("batch", str(write(tmp_path / "in.jsonl", items)), str(out), "--config", str(settings))
    assert code == 0, stderr
    first, again = (results(out)[c]["response"]["body"] for c in ("q0", "q1"))
    assert first["usage"]["denoising_steps"] > 0 and again["usage"]["denoising_steps"] == 0
    assert again["choices"] == first["choices"]
