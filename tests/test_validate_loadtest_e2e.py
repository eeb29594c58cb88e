"""`dlm validate` and `dlm loadtest` against the real `dlm serve` (embedded model, 127.0.0.1).

One server process for the module: one decoding slot (`--max-num-seqs 1`), so its knee is
known, an API key, so the key checks run, and a 512-token context.
"""

from __future__ import annotations

import json
import subprocess
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.cli_process import dlm
from tests.conftest import session_home
from tests.serving import ServerProcess, ready_server
from tests.test_loadtest import sweep

pytestmark = pytest.mark.slow  # every test here starts processes

KEY = "e2e-key"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    with ready_server(
        ["--api-key", KEY, "--max-num-seqs", "1", "--max-model-len", "512"], session_home(tmp_path_factory)
    ) as proc:
        yield proc


def checks(result: subprocess.CompletedProcess) -> dict[str, str]:
    return {c["name"]: c["status"] for c in json.loads(result.stdout)["checks"]}


def test_validate_passes_against_dlm_serve(server: ServerProcess, tmp_path: Path) -> None:
    junit = tmp_path / "validate.xml"
    result = dlm(
        "validate", server.url, "--api-key", KEY, "--burst", "16", "--suite", "default-model", "--json",
        "--junit-xml", str(junit),
    )  # fmt: skip
    statuses = checks(result)
    assert result.returncode == 0, json.loads(result.stdout)["checks"]
    # key checks included: none skipped but the capability checks of what the default model's
    # family lacks (the registry's record: LLaDA decodes no decode_mode ar)
    from dlm.cli.checks.capabilities import PROBES
    from dlm.engine.capabilities import supported
    from dlm.engine.config import load_config
    from dlm.engine.default_model import default_model_dir
    from dlm.engine.registry import family_named

    family = family_named(load_config(default_model_dir()).family)
    lacking = {f"capability_{name}" for name in PROBES if name not in supported(family)}
    assert {name for name, status in statuses.items() if status != "passed"} == lacking, statuses
    assert {statuses[name] for name in lacking} <= {"skipped"}
    assert "suite.pass_rate" in statuses  # the embedded model's known answers
    assert len(ET.parse(junit).getroot().findall("testsuite/testcase")) == len(statuses)


def test_validate_names_what_is_misconfigured(server: ServerProcess) -> None:
    wrong_key = dlm("validate", server.url, "--api-key", "not-the-key", "--json")
    assert wrong_key.returncode == 1
    assert {n for n, s in checks(wrong_key).items() if s == "failed"} == {"auth"}

    too_small = dlm(
        "validate",
        server.url,
        "--api-key",
        KEY,
        "--min-context",
        "1024",
        "--json",
        "--skip",
        "burst",
        "--skip",
        "determinism",
        "--skip",
        "client_timeout",
    )
    assert too_small.returncode == 1
    assert {n for n, s in checks(too_small).items() if s == "failed"} == {"context_window"}


def test_loadtest_sweep_against_dlm_serve(server: ServerProcess, tmp_path: Path) -> None:
    # 5 samples a level: a loaded 2-core runner completes fewer than the default 20 in 2 s, and a
    # level below the minimum cannot be the knee (the rule itself: test_loadtest.py).
    summary = sweep(server.url, tmp_path / "loadtest", "2s", "--api-key", KEY, "--min-samples", "5")
    # One decoding slot: a second user can only queue, so the knee is reached by 2 users.
    assert summary["knee"]["users"] in (1, 2), summary["knee"]
    assert summary["totals"]["ok"] > 0 and summary["totals"]["error_rate"] == 0
    assert summary["gate"]["mean_denoising_steps"] >= 1
    # The README's sweep measures answers: the default model's task prompts (chosen from its
    # /v1/models card), so every level times a first token and the time per output token.
    assert summary["prompts"] == "tasks" and summary["warnings"] == [], summary["warnings"]
    for level in summary["levels"]:
        assert level["p50_ttft"] is not None and level["p50_tpot"] is not None, level
        assert level["empty_answers"] < level["ok"] / 2, level


def test_the_default_models_suite_fails_against_a_random_weight_model(tmp_path_factory: pytest.TempPathFactory) -> None:
    """The same server machinery on random weights answers every request, and the known-answer
    suite tells it apart (exit 1, the named check)."""
    with ready_server(["tiny:llada"], session_home(tmp_path_factory)) as random_weights:
        result = dlm("validate", random_weights.url, "--suite", "default-model", "--json", "--skip", "burst")
    statuses = checks(result)
    assert result.returncode == 1, result.stdout
    assert {n for n, s in statuses.items() if s == "failed"} == {"suite.pass_rate"}, statuses


def test_loadtest_sends_the_task_prompts(server: ServerProcess, tmp_path: Path) -> None:
    """Task answers end with EOS well before the canvas does, as production answers do; the
    built-in prompts, which this model was not trained on, get empty answers, and the report
    says its numbers then mean nothing."""
    result = dlm(
        "loadtest", server.url, "--api-key", KEY, "-u", "1", "-t", "3s",
        "--max-tokens", "64", "--min-samples", "1", "--json", "--out", str(tmp_path / "tasks"),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    summary = json.loads(result.stdout)
    assert summary["prompts"] == "tasks"  # the default, for the default model
    assert summary["totals"]["ok"] > 0 and summary["totals"]["error_rate"] == 0
    assert summary["totals"]["output_tokens"] < 64 * summary["totals"]["ok"] / 2, summary["totals"]
    builtin = dlm(
        "loadtest", server.url, "--api-key", KEY, "--prompts", "builtin", "-u", "1", "-t", "2s",
        "--max-tokens", "8", "--min-samples", "1", "--out", str(tmp_path / "builtin"),
    )  # fmt: skip
    assert builtin.returncode == 0, builtin.stderr[-2000:]
    assert "answers were empty (EOS at once)" in " ".join(builtin.stderr.split()), builtin.stderr


def test_loadtest_fixed_length_mode_fixes_every_answer_length(server: ServerProcess, tmp_path: Path) -> None:
    """The task prompts end early with EOS (above); --fixed-length sends ignore_eos and
    min_tokens, so every answer is exactly --max-tokens long."""
    result = dlm(
        "loadtest", server.url, "--api-key", KEY, "--prompts", "tasks", "-u", "1", "-t", "3s",
        "--max-tokens", "24", "--fixed-length", "--min-samples", "1", "--json", "--out", str(tmp_path / "fixed"),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    totals = json.loads(result.stdout)["totals"]
    assert totals["ok"] > 0 and totals["error_rate"] == 0
    assert totals["output_tokens"] == 24 * totals["ok"], totals
