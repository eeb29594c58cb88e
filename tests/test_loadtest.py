"""`dlm loadtest`: statistics, knee and thresholds on known numbers, then real locust runs
against a fake server whose capacity is known, so the knee is known too."""

from __future__ import annotations

import csv
import io
import json
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from dlm.cli.loadtest.report import finalize, level_row, levels_table
from dlm.cli.loadtest.stats import GATE_METRICS, RequestRecord, summarize
from dlm.cli.loadtest.sweep import check_ramps, find_knee, parse_levels
from dlm.cli.loadtest.thresholds import parse_conditions, parse_seconds, parse_slo, violations
from dlm.cli.loadtest.vllm_format import VLLM_KEYS
from dlm.cli.loadtest.workload import from_prompts, load_jsonl, model_card, named
from dlm.engine.default_model import NAME
from dlm.engine.errors import DlmError, UsageError
from tests.cli_process import dlm
from tests.fake_openai import Behaviour, http_answer, raw_server, serve, sse_answer


def test_summary_of_known_records() -> None:
    records = [
        RequestRecord(0, float(i), e2e, 200, None, ttft, 11, 5, 10)
        for i, (e2e, ttft) in enumerate([(1.0, 0.1), (2.0, 0.2), (3.0, 0.3)])
    ]
    records.append(RequestRecord(0, 3.0, 0.01, 429, "queue full"))
    s = summarize(records, 10.0, parse_slo("e2e<=2s"))
    assert s["requests"] == 4 and s["ok"] == 3
    assert s["error_rate"] == 0.25 and s["errors_by_status"] == {"429": 1}
    assert s["rps"] == pytest.approx(0.3) and s["output_tokens_per_s"] == pytest.approx(3.3)
    assert s["p50_e2e"] == 2.0 and s["p50_ttft"] == pytest.approx(0.2)
    assert records[0].tpot == pytest.approx(0.09)  # (e2e - ttft) / (tokens - 1)
    assert s["goodput_rps"] == pytest.approx(0.2) and s["goodput_fraction"] == pytest.approx(2 / 3)
    assert s["mean_denoising_steps"] == 10 and s["tokens_per_step"] == pytest.approx(1.1)


def level(users: int, tokens_per_s: float, p50: float, ok: int = 50) -> dict:
    return {
        "users": users,
        "ok": ok,
        "output_tokens": 1,
        "output_tokens_per_s": tokens_per_s,
        "rps": 0.0,
        "p50_e2e": p50,
        "empty_answers": 0,
    }


def test_knee_is_where_throughput_stops_rising_and_latency_climbs() -> None:
    saturating = [level(1, 10, 1.0), level(2, 19, 1.05), level(4, 21, 1.9), level(8, 21, 3.8)]
    assert find_knee(saturating)["users"] == 2
    linear = [level(1, 10, 1.0), level(2, 20, 1.0), level(4, 40, 1.0)]
    assert find_knee(linear)["users"] is None


def test_no_knee_is_named_from_levels_too_thin_to_measure() -> None:
    """Two or three requests per level (a short README run) give a verdict of noise: refuse it."""
    thin = [level(1, 10, 1.0, ok=3), level(2, 19, 1.05, ok=2), level(4, 21, 1.9, ok=3)]
    knee = find_knee(thin)
    assert knee["users"] is None and "fewer than 20" in knee["reason"]
    assert find_knee(thin, min_samples=2)["users"] == 2
    summary = finalize({"levels": thin, "server_metrics": {}}, [], [])
    assert summary["knee"]["users"] is None and len(summary["warnings"]) == 3


def test_mostly_empty_answers_are_a_warning_first() -> None:
    """Answers that are EOS at once have no first token: TTFT and TPOT are blank and a knee
    would describe nothing, so the summary says so, ahead of any other warning."""

    def answers(texts: list[str]) -> dict[str, Any]:
        records = [
            RequestRecord(0, float(i), 0.2, 200, None, 0.1 if t else None, 1 + len(t), 5, 8, text=t)
            for i, t in enumerate(texts)
        ]
        return {"users": 1, **summarize(records, 1.0, [])}

    empty = finalize({"levels": [answers(["", "", "", "119"])], "server_metrics": {}}, [], [], min_samples=1)
    assert empty["levels"][0]["empty_answers"] == 3
    assert empty["warnings"][0].startswith("3 of 4 answers were empty"), empty["warnings"]
    half = finalize({"levels": [answers(["", "", "85", "119"])], "server_metrics": {}}, [], [], min_samples=1)
    assert half["warnings"] == []


def test_the_default_model_gets_its_task_prompts_by_default() -> None:
    """`--prompts auto` (the default) sends the default model's task prompts when the server's
    /v1/models card says it loaded that model, whatever name it serves it under."""
    auto = from_prompts("auto", {"max_tokens": 8}, None)
    renamed = auto.for_model({"id": "my-name", "root": NAME})
    assert (renamed.prompts, renamed.model, renamed.requests) == ("tasks", "my-name", named("tasks"))
    assert auto.for_model({"id": NAME}).prompts == "tasks"  # a server that sends no root
    other = auto.for_model({"id": "llada", "root": "LLaDA-8B-Instruct"})
    assert other.prompts == "builtin" and other.requests == named("builtin")
    chosen = from_prompts("builtin", {}, None).for_model({"id": "x", "root": NAME})
    assert chosen.prompts == "builtin"  # a set given by name is kept


def test_the_levels_table_fits_80_columns_and_cuts_no_cell() -> None:
    """Large values in every column (a big GPU server's sweep) at 80 columns: every line fits
    and every cell is whole; narrower, cells fold onto a second line but are never cut."""
    worst = {
        "users": 1024,
        "ok": 12345,
        "rps": 1234.56,
        "output_tokens_per_s": 12345.6,
        "p50_e2e": 99.9994,
        "p95_e2e": 123.4,
        "p99_e2e": 1234.5,
        "p50_ttft": 99.99,
        "p50_tpot": 9.99,
        "mean_denoising_steps": 10240.0,
        "error_rate": 1.0,
        "goodput_rps": 1234.56,
    }
    small = {**worst, "users": 1, "ok": 3, "p50_ttft": None, "p50_tpot": None, "error_rate": 0.125}
    for width in (80, 50):
        console = Console(width=width, file=io.StringIO(), record=True)
        console.print(levels_table([small, worst], "dlm loadtest https://a-long-host-name.example.com:8443 (model)"))
        text = console.export_text()
        assert "…" not in text, text
        assert max(map(len, text.splitlines())) <= width, text
        if width == 80:
            assert set(level_row(worst)) | set(level_row(small)) <= set(text.split()), text


def test_thresholds_and_quantities() -> None:
    conditions = parse_conditions("p95_e2e>5s, error_rate>1%,p50_ttft>=200ms", GATE_METRICS, "--fail-on")
    assert [(c.metric, c.op, c.value) for c in conditions] == [
        ("p95_e2e", ">", 5.0),
        ("error_rate", ">", 0.01),
        ("p50_ttft", ">=", 0.2),
    ]
    assert violations(conditions, {"p95_e2e": 6.0, "error_rate": 0.0, "p50_ttft": None}) == ["p95_e2e>5s (measured 6s)"]
    # The measured value in the unit its condition wrote ("measured 0.2805" said nothing of it).
    tight = parse_conditions("p95_e2e>1ms,error_rate>=1%,p50_ttft>0.1", GATE_METRICS, "--fail-on")
    assert violations(tight, {"p95_e2e": 0.2805, "error_rate": 0.025, "p50_ttft": 0.25}) == [
        "p95_e2e>1ms (measured 280.5ms)",
        "error_rate>=1% (measured 2.5%)",
        "p50_ttft>0.1 (measured 0.25)",
    ]
    assert parse_seconds("2m", "-t") == 120 and parse_seconds("1.5", "-t") == 1.5
    for bad in ("p95_e2e 5s", "latency>5s"):
        with pytest.raises(UsageError):
            parse_conditions(bad, GATE_METRICS, "--fail-on")
    with pytest.raises(UsageError, match="upper limits"):
        parse_slo("ttft>1s")
    with pytest.raises(UsageError):
        parse_levels("4,2")
    assert parse_levels("1, 2,8") == [1, 2, 8]


def test_every_sweep_level_must_outlast_its_ramp_up() -> None:
    """Before: only the first level's ramp was checked, so `--sweep 1,20 -r 2 -t 3s` ran a
    20-user level whose steady window began 6.5 s after it ended: 0 requests measured over
    -6.5 seconds, and a knee 'not measured' that advised lowering --min-samples."""
    with pytest.raises(UsageError, match="from 1 to 20 users"):
        check_ramps([1, 20], 2.0, 3.0)
    with pytest.raises(UsageError, match="from 0 to 8 users"):
        check_ramps([8], 2.0, 4.0)
    check_ramps([1, 2, 4, 8], 2.0, 3.0)  # each level ramps from the one before: at most 2 s
    check_ramps([1, 1000], None, 1.0)  # all at once


@pytest.mark.parametrize("number", [".", "1.2.3", "..5", "1e999"])
def test_a_malformed_number_is_bad_usage_not_a_traceback(number: str) -> None:
    """Before: `-t .`, `-t 1.2.3s` and `--fail-on "p95_e2e>1.2.3s"` matched the number pattern
    and float() raised a ValueError traceback (exit 1). An exponent is a number, but a duration
    that overflows to infinity is none."""
    with pytest.raises(UsageError, match="-t"):
        parse_seconds(f"{number}s", "-t")
    if number != "1e999":
        for flag in ("--fail-on", "--slo"):
            with pytest.raises(UsageError, match=flag):
                parse_conditions(f"e2e<{number}s", ("e2e",), flag)
    assert parse_seconds(".5s", "-t") == 0.5 and parse_seconds("5.", "-t") == 5
    assert parse_conditions("e2e<1e-3,e2e<.5s", ("e2e",), "--slo")[0].value == 0.001


@pytest.mark.parametrize(
    "condition",
    [
        "p95_e2e>5%",
        "p50_ttft>1%",
        "rps<5s",
        "error_rate>5ms",
        "tokens_per_step<2%",
        "error_rate>5",
        "goodput_fraction<90",
    ],
)
def test_a_unit_of_the_wrong_kind_is_bad_usage(condition: str) -> None:
    """Before: `p95_e2e>5%` was a 50 ms gate, `rps<5s` one of 5 requests/s, and `error_rate>5`
    (500%) one that never fires: each silently another gate than the one written."""
    with pytest.raises(UsageError, match=re.escape(condition)):
        parse_conditions(condition, GATE_METRICS, "--fail-on")


def test_units_of_the_right_kind_are_read() -> None:
    conditions = "p95_e2e>5,p50_tpot>20ms,mean_ttft>=300us,error_rate>0.5,tokens_mismatch>150%,rps<2,error_rate>=1"
    values = [c.value for c in parse_conditions(conditions, GATE_METRICS, "--fail-on")]
    assert values == pytest.approx([5, 0.02, 0.0003, 0.5, 1.5, 2, 1])
    with pytest.raises(UsageError, match="ttft"):
        parse_slo("ttft<=50%")


def test_jsonl_prompts(tmp_path: Path) -> None:
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "a", "max_tokens": 4}\n\n{"messages": [{"role": "user", "content": "b"}]}\n')
    assert [route for route, _ in load_jsonl(path)] == ["/v1/completions", "/v1/chat/completions"]
    path.write_text('{"prompt": "a", "colour": "red"}\n')
    with pytest.raises(UsageError, match="colour"):
        load_jsonl(path)
    separators = "\u2028\u2029\u0085"  # raw inside JSON strings: not line ends
    path.write_text(f'{{"prompt": "a{separators}b"}}\n', encoding="utf-8")
    assert [body["prompt"] for _, body in load_jsonl(path)] == [f"a{separators}b"]


def loadtest(*args: str) -> subprocess.CompletedProcess:
    return dlm("loadtest", *args)


OUTPUTS = {
    "vllm_result.json",
    "locust_stats.csv",
    "locust_stats_history.csv",
    "locust_failures.csv",
    "locust_exceptions.csv",
    "locust_report.html",
    "summary.json",
    "requests.jsonl",
    "latency.png",
    "throughput.png",
}


def sweep(url: str, out: Path, duration: str, *flags: str) -> dict[str, Any]:
    """`dlm loadtest URL --sweep 1,2,4` of 8-token requests, failing on any error, plus FLAGS:
    checks that it passed, wrote every output into `out`, and that the server's own counts
    agree with the client's (within 2%); returns its JSON summary."""
    common = ["--sweep", "1,2,4", "-t", duration, "--max-tokens", "8", "--fail-on", "error_rate>1%", "--json"]
    result = loadtest(url, *common, "--out", str(out), *flags)
    assert result.returncode == 0, result.stderr[-2000:]
    summary: dict[str, Any] = json.loads(result.stdout)
    assert OUTPUTS <= {p.name for p in out.iterdir()}
    for key in ("requests", "output_tokens"):
        assert summary["server_metrics"][key]["mismatch"] <= 0.02, summary["server_metrics"]
    return summary


@pytest.mark.slow
def test_sweep_finds_the_knee_of_a_two_slot_server(tmp_path: Path) -> None:
    out = tmp_path / "sweep"
    # Two decoding slots, 8 steps of 10 ms: throughput doubles from 1 to 2 users, then flattens.
    with serve(Behaviour(capacity=2, step_delay=0.01)) as url:
        # A 1.5 s level of 80 ms requests holds ~15: 5 samples are enough for this two-slot server.
        summary = sweep(url, out, "1.5s", "--min-samples", "5", "--slo", "e2e<=10s")
    assert summary["mode"] == "sweep" and [lv["users"] for lv in summary["levels"]] == [1, 2, 4]
    assert summary["knee"]["users"] == 2, summary["knee"]
    assert summary["passed"] and summary["gate"]["users"] == 2
    gate = summary["gate"]
    assert gate["mean_denoising_steps"] == 8 and gate["goodput_fraction"] == 1.0
    assert gate["p50_ttft"] < gate["p50_e2e"] and gate["p50_tpot"] > 0
    rows = {(r["Type"], r["Name"]) for r in csv.DictReader(open(out / "locust_stats.csv"))}
    assert {("POST", "/v1/completions"), ("TTFT", "/v1/completions")} <= rows
    assert "<html" in (out / "locust_report.html").read_text()[:2000].lower()
    vllm = json.loads((out / "vllm_result.json").read_text())
    assert [level["max_concurrency"] for level in vllm] == [1, 2, 4]
    for level_result in vllm:
        assert set(VLLM_KEYS) <= set(level_result), set(VLLM_KEYS) - set(level_result)
        assert level_result["completed"] == len(level_result["ttfts"]) == len(level_result["output_lens"]) > 0
        assert level_result["diffusion"]["mean_denoising_steps_per_request"] == 8
        assert 0 < level_result["median_ttft_ms"] <= level_result["median_e2el_ms"]


@pytest.mark.slow
def test_fixed_run_with_chat_prompts_and_a_failing_threshold(tmp_path: Path) -> None:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}\n')
    with serve(Behaviour(step_delay=0.005)) as url:
        result = loadtest(
            url,
            "-u",
            "2",
            "-t",
            "1s",
            "--prompts",
            str(prompts),
            "--steps",
            "4",
            "--out",
            str(tmp_path / "fixed"),
            "--fail-on",
            "p50_e2e>1ms",
            "--json",
            "--format",
            "vllm",
        )
    assert result.returncode == 1, result.stderr[-2000:]
    # Under --json the table still goes to stderr, and the failure is the contract's error line.
    assert "dlm loadtest" in result.stderr and "knee" not in result.stderr.splitlines()[-1]
    assert result.stderr.strip().splitlines()[-1].startswith("error: threshold exceeded: p50_e2e>1ms"), result.stderr
    vllm = json.loads(result.stdout)  # --format vllm: one object for a fixed run
    assert vllm["endpoint_type"] == "openai-chat" and vllm["max_concurrency"] == 2 and vllm["failed"] == 0
    summary = json.loads((tmp_path / "fixed" / "summary.json").read_text())
    assert summary["mode"] == "fixed" and summary["knee"] is None
    assert summary["violations"] and summary["violations"][0].startswith("p50_e2e>1ms")
    assert summary["gate"]["mean_denoising_steps"] == 4  # --steps reached the server
    assert summary["totals"]["error_rate"] == 0


@pytest.mark.slow
def test_ctrl_c_mid_load_keeps_the_results_so_far_and_exits_130(tmp_path: Path) -> None:
    """Before: exit 130 with a gevent traceback of the KeyboardInterrupt on stderr, and only
    locust's CSV files in --out: no summary.json, requests.jsonl or vllm_result.json of the
    levels that had run (a long sweep's results thrown away)."""
    import os
    import signal
    import sys
    import time

    out = tmp_path / "out"
    with serve(Behaviour(step_delay=0.002)) as url:
        process = subprocess.Popen(
            [sys.executable, "-m", "dlm", "loadtest", url, "--sweep", "1,2", "-t", "60s", "--out", str(out)],
            cwd=Path(__file__).parent.parent,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "DLM_HOME": str(tmp_path / "home")},
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),  # not ignored, as in a terminal
        )
        deadline = time.monotonic() + 120
        while not (out / "locust_stats.csv").exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        time.sleep(3)  # into the first level's load
        process.send_signal(signal.SIGINT)
        _, stderr = process.communicate(timeout=60)
    assert process.returncode == 130, stderr[-3000:]
    assert [line for line in stderr.splitlines() if line.startswith("error:")] == ["error: interrupted"], stderr
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr, stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["interrupted"] and [level["users"] for level in summary["levels"]] == [1]
    assert summary["levels"][0]["ok"] > 0 and summary["warnings"][0].startswith("interrupted (Ctrl-C) at level 1")
    assert len((out / "requests.jsonl").read_text().splitlines()) >= summary["levels"][0]["ok"]
    assert json.loads((out / "vllm_result.json").read_text())["completed"] == summary["levels"][0]["ok"]
    assert f"results so far in {out}/\n" in stderr  # on one line, to copy


@pytest.mark.slow
def test_unreachable_server_is_a_failed_operation(tmp_path: Path) -> None:
    result = loadtest("http://127.0.0.1:9", "-t", "1s", "--out", str(tmp_path / "x"))
    assert result.returncode == 1 and "error:" in result.stderr


@pytest.mark.parametrize(
    ("fields", "refused"),
    [
        ({"temperature": -1.0}, "temperature must be >= 0"),
        ({"temperature": float("nan")}, "temperature must be a finite number"),
        ({"max_tokens": 0}, "max_tokens must be"),
    ],
)
def test_loadtest_refuses_a_temperature_every_request_would_be_refused_for(fields: dict, refused: str) -> None:
    """Before: `--temperature -1` ran the whole load, 1363 requests each a 400 'temperature
    must be >= 0', then exit 1: only the dLLM flags were checked before the load."""
    from dlm.cli.loadtest.workload import check_request_fields

    with pytest.raises(UsageError, match=refused):
        check_request_fields({"prompt": "a", **fields})
    check_request_fields({"prompt": "a", "max_tokens": 64, "temperature": 0.7})


@pytest.mark.parametrize(
    ("line", "refused"),
    [
        ('{"prompt": "a", "steps": 0}', ":1: steps must be"),
        ('{"prompt": "a", "temperature": "hot"}', ":1: temperature must be a number"),
        ('{"prompt": "a", "cache": "all"}', ":1: cache must be one of"),
    ],
)
def test_a_prompts_line_with_a_value_every_request_would_be_refused_for_is_bad_usage(
    tmp_path: Path, line: str, refused: str
) -> None:
    """Before: the line was sent as it was, and the load was a run of 400s."""
    path = tmp_path / "p.jsonl"
    path.write_text(line + "\n")
    with pytest.raises(UsageError, match=re.escape(refused)):
        load_jsonl(path)


def test_jsonl_lines_may_fix_the_answer_length(tmp_path: Path) -> None:
    path = tmp_path / "fixed.jsonl"
    path.write_text('{"prompt": "a", "max_tokens": 8, "ignore_eos": true, "min_tokens": 8}\n')
    line = {"prompt": "a", "max_tokens": 8, "ignore_eos": True, "min_tokens": 8}
    assert load_jsonl(path) == (("/v1/completions", line),)


def test_fixed_length_fixes_each_request_at_its_own_max_tokens(tmp_path: Path) -> None:
    """`--fixed-length` fixes every answer at the request's max_tokens: a JSONL line's own
    max_tokens (below --max-tokens here) gets min_tokens equal to it, not --max-tokens (which
    the server refuses: min_tokens must not exceed max_tokens); a line's own min_tokens or
    ignore_eos is kept, as every line field is."""
    path = tmp_path / "lines.jsonl"
    path.write_text('{"prompt": "a", "max_tokens": 8}\n{"prompt": "b"}\n{"prompt": "c", "min_tokens": 2}\n')
    workload = from_prompts(str(path), {"max_tokens": 16}, None, fixed_length=True)
    bodies = [workload.request(i)[1] for i in range(3)]
    assert [(b["max_tokens"], b["min_tokens"], b["ignore_eos"]) for b in bodies] == [
        (8, 8, True),
        (16, 16, True),
        (16, 2, True),
    ]
    plain = from_prompts(str(path), {"max_tokens": 16}, None).request(0)[1]
    assert "min_tokens" not in plain and "ignore_eos" not in plain


NOT_MODEL_LISTS = {
    "a JSON list": ([1, 2], "no 'data' list"),
    "no data": ({"object": "list"}, "no 'data' list"),
    "data a string": ({"object": "list", "data": "x"}, "no 'data' list"),
    "an entry without id": ({"data": [{"object": "model"}]}, "needs a string id"),
    "a numeric id": ({"data": [{"id": 5}]}, "needs a string id"),
    "an empty list": ({"data": []}, "lists no model"),
}


@pytest.mark.parametrize(("body", "expected"), NOT_MODEL_LISTS.values(), ids=NOT_MODEL_LISTS.keys())
def test_a_models_answer_that_is_no_model_list_is_a_failed_operation(body: Any, expected: str) -> None:
    """Before: a TypeError or KeyError traceback from the /v1/models answer."""
    with pytest.raises(DlmError, match=re.escape(expected)) as caught:
        model_card(body, None, "http://h/v1/models")
    assert caught.value.exit_code == 1


@pytest.mark.slow
@pytest.mark.parametrize(
    ("models", "stream", "expected"),
    [
        (b"<html>Welcome to nginx</html>", b"", "did not answer JSON (text/html)"),
        (b'{"data": [{"id": "m"}]}', b'data: {"choices": "abc"}\n\n', "choices is not a list of objects"),
        (b'{"data": [{"id": "m"}]}', b'data: {"choices": [{"text": "a"}]}\n\n', "stream ended without data: [DONE]"),
    ],
    ids=["an HTML page", "garbled chunks", "no [DONE]"],
)
def test_a_garbage_server_fails_saying_why_without_a_traceback(
    tmp_path: Path, models: bytes, stream: bytes, expected: str
) -> None:
    """Before: tracebacks (of served_card, or of every locust user) and 'no request succeeded
    (errors by status: {})' with no reason."""

    def answer(method: str, path: str) -> Iterator[bytes]:
        if path == "/v1/models":
            return iter([http_answer(200, models, "text/html" if models.startswith(b"<") else "application/json")])
        if path == "/metrics":
            return iter([http_answer(404, b"")])
        return sse_answer(stream)

    with raw_server(answer) as url:
        result = loadtest(url, "-t", "2s", "-u", "2", "--timeout", "2", "--out", str(tmp_path / "out"))
    assert result.returncode == 1, result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    assert expected in result.stderr.splitlines()[-1] or expected in result.stderr


@pytest.mark.slow
def test_users_whose_requests_get_no_answer_pause_before_the_next(tmp_path: Path) -> None:
    """A server that lists its model, then closes every generation's connection unanswered
    (a server dying): before, each closed-loop user retried at once, hundreds of refused
    requests a second; now each waits `NO_ANSWER_PAUSE_S` (1 s) after a request that got no
    answer, so 2 users over 3 s send a handful."""

    def answer(method: str, path: str) -> Iterator[bytes]:
        if path == "/v1/models":
            return iter([http_answer(200, b'{"data": [{"id": "m"}]}')])
        if path == "/metrics":
            return iter([http_answer(404, b"")])
        return iter([])  # the connection closed, no answer

    out = tmp_path / "out"
    with raw_server(answer) as url:
        result = loadtest(url, "-t", "3s", "-u", "2", "--timeout", "5", "--out", str(out))
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-2000:]
    records = [json.loads(line) for line in (out / "requests.jsonl").read_text().splitlines()]
    assert records and all(r["status"] == 0 for r in records), records[:3]
    assert len(records) <= 2 * (3 + 2), len(records)  # a user: one request, then one a second


@pytest.mark.slow
@pytest.mark.parametrize(
    "args",
    [["http://127.0.0.1:99999"], ["http://[::1"], ["http://127.0.0.1:8000/v1"], ["http://h", "--timeout", "nan"]],
    ids=["port past 65535", "broken IPv6", "/v1", "NaN timeout"],
)
def test_bad_urls_and_numbers_are_bad_usage(tmp_path: Path, args: list[str]) -> None:
    result = loadtest(*args, "-t", "1s", "--out", str(tmp_path / "out"))
    assert result.returncode == 2, result.stderr[-2000:]
    assert "Traceback" not in result.stderr
