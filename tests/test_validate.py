"""`dlm validate` against a fake server: it passes a conforming one, and each deliberate
misbehaviour fails exactly the checks that name it."""

from __future__ import annotations

import itertools
import json
import re
import socket
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from typer.testing import CliRunner, Result

from dlm.cli.checks.capabilities import PROBES
from dlm.cli.checks.contract import completion, models
from dlm.cli.checks.runner import FAILED, PASSED, SKIPPED, CheckFailed, CheckResult, Context, ValidateOptions
from dlm.cli.checks.validate import run_validation
from dlm.cli.client.api import ApiClient, RequestTooLong
from dlm.cli.client.metrics import missing_metrics, parse_samples
from dlm.cli.client.sse import SSEError, iter_events, sse_lines
from dlm.cli.main import app
from dlm.engine.errors import UsageError
from tests.fake_openai import Behaviour, http_answer, raw_server, serve, sse_answer

ROOT = Path(__file__).resolve().parent.parent
FAST = ValidateOptions(ready_timeout=2.0, burst=8)


def validate(behaviour: Behaviour, options: ValidateOptions = FAST, **kwargs) -> dict[str, CheckResult]:
    with serve(behaviour) as url:
        return {r.name: r for r in run_validation(url, options, timeout=10, **kwargs)}


def failed(results: dict[str, CheckResult]) -> set[str]:
    return {name for name, r in results.items() if r.status == FAILED}


def test_conforming_server_passes_every_check() -> None:
    results = validate(Behaviour())
    assert failed(results) == set(), {n: r.detail for n, r in results.items() if r.status == FAILED}
    # Without keys on the server there is nothing to check for missing or wrong keys; it
    # advertises no capabilities (tests/test_serve_infill_logprobs_n.py checks dlm's own).
    capabilities = {"capabilities"} | {f"capability_{name}" for name in PROBES}
    assert {n for n, r in results.items() if r.status == SKIPPED} == {"missing_key", "wrong_key"} | capabilities
    assert "steps=2 -> 2" in results["steps"].detail
    assert "block_length=4 -> 4 steps, 8 -> 2 steps" in results["block_length"].detail


def test_a_second_run_against_a_response_cache_measures_the_server_again() -> None:
    """`dlm serve --response-cache-size N` answers a request it answered before with
    `denoising_steps` 0; validate sends the same requests on every run, so its second run
    failed `usage` (and the step checks compared cached zeros). It asks for fresh answers."""
    with serve(Behaviour(response_cache=True)) as url:
        for _ in range(2):
            results = {r.name: r for r in run_validation(url, FAST, timeout=10)}
            assert failed(results) == set(), {n: r.detail for n, r in results.items() if r.status == FAILED}


def test_keyed_server_with_the_right_key_passes_the_key_checks() -> None:
    results = validate(Behaviour(api_keys=("k-1", "k-2")), api_key="k-2")
    assert failed(results) == set()
    assert results["missing_key"].status == results["wrong_key"].status == PASSED


@pytest.mark.parametrize("api_key", ["wrong", None])
def test_wrong_or_missing_key_fails_auth_and_skips_what_needs_it(api_key: str | None) -> None:
    results = validate(Behaviour(api_keys=("right",)), api_key=api_key)
    assert failed(results) == {"auth"}
    assert results["completion"].status == SKIPPED
    assert results["liveness"].status == PASSED  # /health needs no key


MISBEHAVIOURS = {
    "answers 500": (Behaviour(status=500), {"completion", "chat", "invalid_params"}),
    "NDJSON instead of SSE": (Behaviour(sse="ndjson"), {"completion_stream", "chat_stream"}),
    "no [DONE]": (Behaviour(sse="no_done"), {"completion_stream", "chat_stream"}),
    "no blank line between events": (Behaviour(sse="no_blank_lines"), {"completion_stream", "chat_stream"}),
    "stream differs from JSON": (Behaviour(stream_text_differs=True), {"completion_stream", "chat_stream"}),
    "non-deterministic": (
        Behaviour(random_text=True),
        {"determinism", "completion_stream", "chat_stream", "batch_invariance"},
    ),
    "MASK in the text": (Behaviour(leaks_mask=True), {"no_leaks"}),
    "text depends on the batch": (Behaviour(batch_dependent=True, step_delay=0.01), {"batch_invariance"}),
    "no /metrics": (Behaviour(metrics=False), {"metrics"}),
    "ignores dLLM fields": (Behaviour(ignores_dllm=True), {"steps", "threshold", "block_length"}),
    "refuses dLLM fields as invalid": (Behaviour(refuses_dllm="invalid_value"), {"steps", "threshold", "block_length"}),
    # its refusal of response_format crashes too: a 500, never a skip
    "500 on invalid input": (Behaviour(lax_validation=True), {"invalid_params"}),
    "context too small": (Behaviour(accepted_context=64), {"context_window"}),
    "accepts over-long prompts": (Behaviour(max_model_len=256, accepted_context=100_000), {"overlong_prompt"}),
    "503 when the queue is full": (Behaviour(queue_limit=2, step_delay=0.003, overload_status=503), {"burst"}),
    "429 without Retry-After": (Behaviour(queue_limit=2, step_delay=0.003, retry_after=False), {"burst"}),
}


@pytest.mark.parametrize("case", list(MISBEHAVIOURS))
def test_each_misbehaviour_fails_its_checks(case: str) -> None:
    behaviour, expected = MISBEHAVIOURS[case]
    assert failed(validate(behaviour)) == expected


def test_dllm_checks_are_skipped_when_the_server_refuses_the_fields_as_unsupported() -> None:
    """A server that says it cannot honour steps (a model decoding with its own generate
    method) is not failed for it, and says why; one that ignores them still fails (above)."""
    results = validate(Behaviour(refuses_dllm="unsupported"))
    assert failed(results) == set()
    for name in ("steps", "threshold", "block_length"):
        assert results[name].status == SKIPPED
        refused = "block_length" if name == "block_length" else "steps"  # the first field the check sends
        assert f"refuses {refused} as unsupported: {refused} is not supported by this model" in results[name].detail


def test_a_server_advertising_both_decoding_modes_answers_in_each() -> None:
    """Guide 003's dual-mode acceptance: `capability_decode_mode` sends the same prompt in
    each mode and reports both; a mode the server advertises but refuses fails it."""
    both = validate(Behaviour(capabilities=("decode_mode",)))
    assert both["capability_decode_mode"].status == PASSED, both["capability_decode_mode"].detail
    assert re.fullmatch(
        r"diffusion \d+ tokens in \d+ steps, [\d.]+s; ar \d+ tokens in \d+ steps, [\d.]+s",
        both["capability_decode_mode"].detail,
    )
    one = validate(Behaviour(capabilities=("decode_mode",), decode_modes=("diffusion",)))
    assert failed(one) == {"capability_decode_mode"}
    assert "decode_mode 'ar' is not supported" in one["capability_decode_mode"].detail
    assert validate(Behaviour())["capability_decode_mode"].detail == "the server does not advertise decode_mode"


def test_queue_full_with_429_and_retry_after_is_correct_overload_handling() -> None:
    results = validate(Behaviour(queue_limit=2, step_delay=0.003))
    assert results["burst"].status == PASSED
    assert "rejected with 429" in results["burst"].detail
    assert not results["burst"].detail.endswith(" 0 rejected with 429")


def test_server_smaller_than_the_required_context_fails_context_window() -> None:
    results = validate(Behaviour(max_model_len=512), ValidateOptions(ready_timeout=2, burst=4, min_context=4096))
    assert failed(results) == {"context_window"}
    assert "less than the required 4096" in results["context_window"].detail


def test_waiting_for_readiness_is_said_once() -> None:
    """A URL where nothing answers yet: validate waits --ready-timeout, and says so once (it
    waited 60 s in silence when stderr is no terminal, where no spinner is drawn)."""
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    notes: list[str] = []
    results = run_validation(f"http://127.0.0.1:{port}", ValidateOptions(ready_timeout=0.6), on_note=notes.append)
    assert [r.status for r in results if r.name == "readiness"] == [FAILED]
    assert (
        len(notes) == 1
        and notes[0] == f"http://127.0.0.1:{port}/ready: ConnectError; waiting up to 0.6s (--ready-timeout)"
    )


def test_a_server_that_never_gets_ready_fails_readiness_and_skips_the_rest() -> None:
    results = validate(Behaviour(ready_after=60), ValidateOptions(ready_timeout=0.5))
    assert failed(results) == {"readiness"}
    assert all(r.status == SKIPPED for n, r in results.items() if n != "readiness")


class ModelsListClient:
    """Answers /v1/models with a fixed list (the `models` check reads nothing else)."""

    api_key = None

    def __init__(self, data: list) -> None:
        self.data = data

    def get(self, path: str) -> httpx.Response:
        return httpx.Response(200, json={"object": "list", "data": self.data})


@pytest.mark.parametrize(
    "entry,needs",
    [
        ("not-an-object", "every entry of 'data' needs a string id"),
        ({"id": 7, "object": "model"}, "every entry of 'data' needs a string id"),
        ({"id": "m", "object": "other"}, "every /v1/models entry needs object 'model'"),
    ],
)
def test_a_malformed_models_entry_fails_models_saying_what_an_entry_needs(entry: object, needs: str) -> None:
    """(The list's shape is read by the one reader `dlm loadtest` uses too, `model_cards`.)"""
    ctx = Context(ModelsListClient([{"id": "m", "object": "model"}, entry]), FAST)
    with pytest.raises(CheckFailed, match=re.escape(needs)):
        models(ctx)
    ok = Context(ModelsListClient([{"id": "m", "object": "model", "max_model_len": 64}]), FAST)
    assert models(ok) == "1 model(s); using 'm', context 64"


def test_sse_reader_accepts_comments_and_rejects_bad_framing() -> None:
    good = ['data: {"a": 1}', "", ": keep-alive", "", "data: [DONE]", ""]
    assert list(iter_events(good)) == [{"a": 1}]
    bad = {
        "not an SSE field": ['{"a": 1}', ""],
        "without data: [DONE]": ['data: {"a": 1}', ""],
        "inside an event": ['data: {"a": 1}'],
        "not JSON": ["data: {oops", ""],
        "after data: [DONE]": ["data: [DONE]", "", 'data: {"a": 1}', ""],
    }
    for message, lines in bad.items():
        with pytest.raises(SSEError, match=re.escape(message)):
            list(iter_events(lines))


def test_sse_lines_split_at_sse_line_ends_only() -> None:
    """U+2028, U+2029 and U+0085 are text inside an event (a server writing JSON with
    ensure_ascii=False sends them raw); CRLF split across chunks is one line end."""
    text = 'data: {"t": "a\u2028b\u2029c\u0085d"}\r\n\r\ndata: [DONE]\r\n\r\n'
    for cut in range(len(text) + 1):
        chunks = [text[:cut], text[cut:]]
        assert list(iter_events(sse_lines(chunks))) == [{"t": "a\u2028b\u2029c\u0085d"}], cut
    assert list(sse_lines(["a\rb\nc\r", "\nd"])) == ["a", "b", "c", "d"]


def test_metrics_names_include_labelled_counters_without_children() -> None:
    text = "# HELP dlm_request_success x\n# TYPE dlm_request_success counter\n"
    assert "dlm_request_success_total" in parse_samples(text)
    assert "dlm_generation_tokens_total" in missing_metrics(text)


def run_cli(*args: str) -> Result:
    return CliRunner().invoke(app, ["validate", *args])


@pytest.mark.parametrize("where", ["directory", "under a file", "unwritable"])
def test_a_junit_path_no_report_can_take_is_refused_before_any_check(tmp_path: Path, where: str) -> None:
    """--junit-xml /proc/x.xml failed only after every check had run (exit 1, the results
    lost to the report): each path is refused first (exit 2), the server never asked."""
    (tmp_path / "file").write_text("")
    path = {"directory": tmp_path, "under a file": tmp_path / "file" / "r.xml", "unwritable": Path("/proc/r.xml")}
    result = run_cli("http://127.0.0.1:9", "--ready-timeout", "30", "--junit-xml", str(path[where]))
    assert result.exit_code == 2, result.stderr
    assert result.stderr.startswith(f"error: --junit-xml {path[where]}"), result.stderr
    assert not Path("/proc/r.xml").exists()


@pytest.mark.parametrize("tokens", ["0", "-5"])
def test_a_min_context_below_one_is_bad_usage(tokens: str) -> None:
    """Before: `--min-context -5` passed context_window with a 1-token prompt ("context -5"),
    and `--min-context 0` was read as not given: each a requirement that required nothing."""
    result = run_cli("http://127.0.0.1:9", "--ready-timeout", "30", "--min-context", tokens)
    assert result.exit_code == 2 and "--min-context must be >= 1" in result.stderr, result.stderr


def test_skipping_every_check_is_bad_usage_not_a_pass() -> None:
    """Before: `--skip` of every check ran none and passed (exit 0, "PASSED: 0 passed"), even
    against a URL where nothing listens: a CI gate that passed any server."""
    from dlm.cli.checks.validate import validation_checks

    names = [c.name for c in validation_checks()]
    with pytest.raises(UsageError, match="--skip leaves no check"):
        validation_checks(skip=tuple(names))
    assert [c.name for c in validation_checks(skip=tuple(names[1:]))] == names[:1]


def test_junit_xml_stays_well_formed_whatever_the_server_said(tmp_path: Path) -> None:
    """Before: a detail quoting a server's words with an ANSI colour code or a NUL went into
    the file raw (XML no parser reads: CI lost every result), and a lone surrogate (a JSON
    "\\ud800" decodes to one) was a UnicodeEncodeError traceback."""
    from dlm.cli.checks.report import write_junit

    path = tmp_path / "v.xml"
    said = "answer \x1b[31mred\x00 \x0c \ud800 café\ttab"
    write_junit(
        [CheckResult("completion", FAILED, 0.1, said), CheckResult("chat", SKIPPED, 0.1, said)], "http://h", path
    )
    root = ET.parse(path).getroot()
    failure, skipped = root.find(".//failure"), root.find(".//skipped")
    assert failure is not None and skipped is not None
    expected = "answer \\x1b[31mred\\x00 \\x0c \\ud800 café\ttab"
    assert failure.text == failure.get("message") == skipped.get("message") == expected


def test_cli_json_junit_and_exit_codes(tmp_path: Path) -> None:
    junit = tmp_path / "validate.xml"
    with serve(Behaviour()) as url:
        ok = run_cli(url, "--json", "--burst", "4", "--junit-xml", str(junit))
    assert ok.exit_code == 0, ok.stderr
    assert "PASSED" in ok.stderr and "error:" not in ok.stderr  # the table on stderr under --json too
    payload = json.loads(ok.stdout)
    assert payload["passed"] is True and payload["counts"]["failed"] == 0
    assert {c["name"] for c in payload["checks"]} >= {"completion_stream", "burst", "metrics"}
    suite = ET.parse(junit).getroot().find("testsuite")
    assert suite is not None and suite.get("failures") == "0"
    assert len(suite.findall("testcase")) == len(payload["checks"])

    with serve(Behaviour(status=500)) as url:
        bad = run_cli(url, "--burst", "4", "--junit-xml", str(junit), "--json")
    assert bad.exit_code == 1
    assert "FAILED" in bad.stderr and "completion" in bad.stderr
    assert json.loads(bad.stdout)["passed"] is False
    # The failure ends with the contract's one error line, naming the failed checks.
    last = bad.stderr.strip().splitlines()[-1]
    assert last.startswith("error: 3 of ") and last.endswith("checks failed: completion, chat, invalid_params"), last
    failures = {c.get("name") for c in ET.parse(junit).getroot().iter("testcase") if c.find("failure") is not None}
    assert failures == {"completion", "chat", "invalid_params"}


def test_cli_usage_errors_exit_2(tmp_path: Path) -> None:
    suite = tmp_path / "suite.yaml"
    suite.write_text("cases:\n  - name: x\n    prompt: hi\n    expect: {contians: a}\n")
    result = run_cli("http://127.0.0.1:9", "--suite", str(suite))
    assert result.exit_code == 2
    assert "error:" in result.stderr and "contians" in result.stderr
    assert run_cli("127.0.0.1:9").exit_code == 2
    assert run_cli("http://127.0.0.1:9", "--skip", "nonsense").exit_code == 2


@pytest.mark.slow
def test_checks_import_neither_the_engine_core_nor_locust() -> None:
    code = (
        "import sys, dlm.cli.checks.validate, dlm.cli.checks.report, dlm.cli.loadtest.report, "
        "dlm.cli.loadtest.plots; print(sorted(m for m in ('torch', 'locust', 'dlm.cli.server', "
        "'dlm.engine.llm') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


TRICKLE_PIECES = 60


def trickle(method: str, path: str, stream: bool, sent: list[int]) -> Iterator[bytes]:
    """An answer that keeps sending bytes (keep-alive comments, or a JSON body's blanks), one
    every 0.1 s, `TRICKLE_PIECES` of them: httpx's timeout bounds each read, so only a
    whole-answer deadline ends it sooner. `sent` counts the pieces sent."""
    if stream:
        yield b"HTTP/1.0 200 OK\r\nContent-Type: text/event-stream\r\n\r\n"
    else:
        yield b"HTTP/1.0 200 OK\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n"
    for _ in range(TRICKLE_PIECES):
        yield b": ping\n\n" if stream else b" "
        sent.append(1)
        time.sleep(0.1)


@pytest.mark.parametrize("stream", [True, False], ids=["sse keep-alives", "json body a byte at a time"])
def test_the_timeout_bounds_the_whole_answer(stream: bool) -> None:
    sent: list[int] = []
    answer = lambda method, path: trickle(method, path, stream, sent)  # noqa: E731
    with raw_server(answer) as url, ApiClient(url, timeout=1.0) as client:
        with pytest.raises(httpx.TimeoutException, match="did not end within the 1s timeout"):
            if stream:
                client.stream("/v1/completions", {"prompt": "x"})
            else:
                client.post("/v1/completions", {"prompt": "x"})
        # The client gave up while the server was still sending: its deadline, not the answer's end.
        assert len(sent) < TRICKLE_PIECES


HEAD_PIECES = 150


def trickled_head(method: str, path: str, sent: list[int]) -> Iterator[bytes]:
    """A status line, then a header line that never ends: one byte every 0.1 s,
    `HEAD_PIECES` of them, then the connection closes. Each read gets its byte well within
    httpx's per-read timeout, so only a deadline over the whole answer, head included, ends
    it before the server gives up."""
    yield b"HTTP/1.1 200 OK\r\nX-Pad: "
    for _ in range(HEAD_PIECES):
        yield b"a"
        sent.append(1)
        time.sleep(0.1)


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "get"])
def test_the_timeout_bounds_a_trickled_head(stream: bool) -> None:
    """Before: the whole-answer deadline started with the body, so a head trickled a byte
    at a time ran until the server closed (15 s here; a RemoteProtocolError, not the
    client's timeout); now the transport's waits end at the deadline, head included."""
    sent: list[int] = []
    with (
        raw_server(lambda method, path: trickled_head(method, path, sent)) as url,
        ApiClient(url, timeout=1.0) as client,
    ):
        with pytest.raises(RequestTooLong, match="did not end within the 1s timeout"):
            if stream:
                client.stream("/v1/completions", {"prompt": "x"})
            else:
                client.get("/v1/models")
        assert len(sent) < HEAD_PIECES  # the client gave up while the server was still sending


def test_the_client_goes_through_the_environments_proxy(monkeypatch: pytest.MonkeyPatch) -> None:
    """The deadline transport keeps what httpx's own took from the environment: HTTP_PROXY
    carries the request (the proxy here answers it), NO_PROXY exempts a host."""
    seen: list[str] = []

    def proxy(method: str, path: str) -> Iterator[bytes]:
        seen.append(path)
        yield http_answer(200, b'{"data": []}')

    with raw_server(proxy) as url:
        monkeypatch.setenv("HTTP_PROXY", url)
        monkeypatch.setenv("NO_PROXY", "127.0.0.1")
        with ApiClient("http://models.invalid", timeout=5) as client:
            assert client.get("/v1/models").json() == {"data": []}
        assert seen == ["http://models.invalid/v1/models"]  # the absolute form a proxy is sent
        with ApiClient(url, timeout=5) as client:
            client.get("/v1/models")
        assert seen[1:] == ["/v1/models"]  # NO_PROXY: straight to the server


def stall(method: str, path: str, stream: bool, sent: list[int]) -> Iterator[bytes]:
    """The head and three pieces of `trickle`, then nothing for 30 s: the read that stalls
    starts 0.2 s into the answer, well before a 1 s deadline, and httpx bounds it by a whole
    timeout of its own."""
    yield from itertools.islice(trickle(method, path, stream, sent), 1 + 3)
    time.sleep(30)


@pytest.mark.parametrize("stream", [True, False], ids=["sse", "json body"])
def test_a_read_that_stalls_ends_at_the_deadline(stream: bool) -> None:
    """Before: the deadline was checked between chunks only, so the stalled read ran its own
    1 s and ended in httpx's `ReadTimeout` at 1.2 s (up to twice the timeout in all); now the
    answer's socket is shut down at the deadline and the error is the whole answer's."""
    sent: list[int] = []
    answer = lambda method, path: stall(method, path, stream, sent)  # noqa: E731
    with raw_server(answer) as url, ApiClient(url, timeout=1.0) as client:
        with pytest.raises(RequestTooLong, match="did not end within the 1s timeout"):
            if stream:
                client.stream("/v1/completions", {"prompt": "x"})
            else:
                client.post("/v1/completions", {"prompt": "x"})


GARBLED_CHUNKS = {
    "choices a string": (b'{"choices": "abc"}', "choices is not a list of objects"),
    "choices of strings": (b'{"choices": ["abc"]}', "choices is not a list of objects"),
    "choices an object": (b'{"choices": {"0": {"text": "a"}}}', "choices is not a list of objects"),
    "delta a string": (b'{"choices": [{"delta": "abc"}]}', "choices[0].delta is not an object"),
    "text a number": (b'{"choices": [{"text": 5}]}', "choices[0].text is not a string"),
    "content a list": (b'{"choices": [{"delta": {"content": ["a"]}}]}', "choices[0].delta.content is not a string"),
    "usage a string": (b'{"choices": [], "usage": "many"}', "usage is not an object"),
    "error a string": (b'{"error": "boom"}', "boom"),
}


@pytest.mark.parametrize(("event", "expected"), GARBLED_CHUNKS.values(), ids=GARBLED_CHUNKS.keys())
def test_a_garbled_chunk_is_a_stream_error_not_a_crash(event: bytes, expected: str) -> None:
    """JSON events that are not OpenAI chunks: the stream's error names the field (validate's
    check fails saying so, loadtest records it), instead of an AttributeError."""
    with raw_server(lambda method, path: sse_answer(b"data: " + event + b"\n\n", b"data: [DONE]\n\n")) as url:
        with ApiClient(url, timeout=5) as client:
            result = client.stream("/v1/completions", {"prompt": "x"})
    assert not result.ok
    assert expected in (result.error or "")


BAD_URLS = {
    "port past 65535": ("http://127.0.0.1:99999", "outside 1-65535"),
    "port 0": ("http://127.0.0.1:0", "outside 1-65535"),
    "no host": ("http://", "names no host"),
    "broken IPv6": ("http://[::1", "not a valid URL"),
    "an OpenAI base URL": ("http://127.0.0.1:8000/v1", "ends in /v1"),
    "an OpenAI base URL with a slash": ("http://127.0.0.1:8000/v1/", "ends in /v1"),
    "a query": ("http://127.0.0.1:8000/?x=1", "without a query"),
}


@pytest.mark.parametrize(("url", "expected"), BAD_URLS.values(), ids=BAD_URLS.keys())
def test_a_bad_url_is_bad_usage(url: str, expected: str) -> None:
    """Before: a port past 65535 waited out --ready-timeout on connections httpx sent to
    another port, `http://[::1` was a traceback, `/v1` failed readiness with a 404."""
    with pytest.raises(UsageError, match=re.escape(expected)):
        run_validation(url, FAST)
    result = CliRunner().invoke(app, ["validate", url, "--ready-timeout", "0"])
    assert result.exit_code == 2, result.output
    assert expected in result.output


@pytest.mark.parametrize("flag", ["--ready-timeout", "--timeout"])
@pytest.mark.parametrize("value", ["nan", "inf"])
def test_a_timeout_that_is_not_a_number_is_bad_usage(flag: str, value: str) -> None:
    """`--ready-timeout nan` polled /ready forever (no time is >= NaN)."""
    result = CliRunner().invoke(app, ["validate", "http://127.0.0.1:1", flag, value])
    assert result.exit_code == 2, result.output
    assert f"{flag} must be a finite number" in result.output


@pytest.mark.parametrize("content_type", ["text/plain", "text/html; charset=utf-8", ""])
def test_json_sent_under_another_content_type_fails_the_check(content_type: str) -> None:
    """A valid completion body sent as text/plain passed `completion`: clients and proxies go
    by the content-type. The check names the type it got."""
    body = {"object": "text_completion", "choices": [{"text": "hi", "finish_reason": "stop"}], "usage": {}}
    answer = http_answer(200, json.dumps(body).encode(), content_type)
    with raw_server(lambda method, path: iter([answer])) as url:
        ctx = Context(ApiClient(url, timeout=5), FAST)
        with pytest.raises(CheckFailed, match=r"/v1/completions: content-type is '[^']*', not application/json"):
            completion(ctx)
    good = http_answer(200, json.dumps(body).encode(), "application/json; charset=utf-8")
    with raw_server(lambda method, path: iter([good])) as url:
        assert "finish stop" in completion(Context(ApiClient(url, timeout=5), FAST))


def test_a_redirect_says_where_it_points() -> None:
    answer = b"HTTP/1.0 301 Moved\r\nLocation: https://elsewhere.example/v2/ready\r\nContent-Length: 0\r\n\r\n"
    with raw_server(lambda method, path: iter([answer])) as url:
        result = run_cli(url, "--ready-timeout", "5", "--json")
    assert result.exit_code == 1
    (readiness,) = [c for c in json.loads(result.stdout)["checks"] if c["name"] == "readiness"]
    assert readiness["detail"].startswith(
        "/ready: HTTP 301 (expected 200): redirects to https://elsewhere.example/v2/ready"
    ), readiness


def test_a_model_list_that_is_not_an_object_fails_models_saying_so() -> None:
    answer = http_answer(200, b"[1, 2]")
    with raw_server(lambda method, path: iter([answer])) as url:
        ctx = Context(ApiClient(url, timeout=5), FAST)
        with pytest.raises(CheckFailed, match="is not an OpenAI model list"):
            models(ctx)
