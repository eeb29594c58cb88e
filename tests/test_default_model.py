"""The embedded default model: the trained weights ship intact, and still answer their tasks.

The known-answer subset is the shipped suite (held-out prompts, one source for this test,
`dlm validate --suite default-model` and `dlm loadtest --prompts tasks`), decoded by the engine
in float32 at the default settings the model card's accuracy was measured at: a change to
the engine, the tokenizer or the weights that costs accuracy fails here.
"""

from __future__ import annotations

import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from dlm.cli.checks.suite import DEFAULT_MODEL_SUITE, Suite, load_suite
from dlm.cli.loadtest.workload import named
from dlm.engine import default_model
from dlm.engine.errors import DlmError

if TYPE_CHECKING:
    from dlm.engine.llm import LLM

DRAFTS = 1  # candidates per forward (dlm/engine/decoding/drafts.py): 1.8x fewer forwards here


def test_the_shipped_files_match_their_pinned_digests() -> None:
    directory = default_model.ensure_default_model()
    assert directory == default_model.default_model_dir()
    assert {p.name for p in directory.iterdir()} >= {"config.json", "model.safetensors", "tokenizer.json", "suite.yaml"}
    assert directory.joinpath("model.safetensors").stat().st_size <= 20 * 2**20  # ships in the package


@pytest.mark.parametrize("victim", ["model.safetensors", "sha256sums.json"])
def test_a_damaged_copy_is_refused_naming_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, victim: str
) -> None:
    copy = tmp_path / default_model.NAME
    shutil.copytree(default_model.default_model_dir(), copy)
    target = copy / victim
    data = bytearray(target.read_bytes())
    data[len(data) // 2] ^= 0xFF
    target.write_bytes(bytes(data))
    monkeypatch.setattr(default_model, "default_model_dir", lambda: copy)
    default_model.ensure_default_model.cache_clear()
    try:
        with pytest.raises(DlmError, match=rf"damaged \({re.escape(victim)} does not match"):
            default_model.ensure_default_model()
    finally:
        default_model.ensure_default_model.cache_clear()


@dataclass
class Decoded:
    """The shipped suite decoded once for the module (float32, temperature 0, the suite's length)."""

    suite: Suite
    llm: LLM
    questions: list[str]
    outputs: list[Any]


@pytest.fixture(scope="module")
def decoded() -> Decoded:
    from dlm.engine.llm import LLM

    suite = load_suite(DEFAULT_MODEL_SUITE)
    llm = LLM(default_model.ensure_default_model(), dtype="float32", device="cpu")
    questions = [case.messages[0]["content"] for case in suite.cases if case.messages]  # one user turn each
    return Decoded(suite, llm, questions, llm.generate(questions, gen_length=suite.defaults["max_tokens"], chat=True))


def test_the_known_answer_subset_still_passes(decoded: Decoded) -> None:
    """Every task's held-out suite prompts, in one batch, float32, temperature 0."""
    suite, outputs = decoded.suite, decoded.outputs
    assert suite.min_pass_rate is not None
    passed = [bool(re.search(case.expect.regex[0], out.text)) for case, out in zip(suite.cases, outputs, strict=True)]
    failures = [(c.name, o.text) for c, o, ok in zip(suite.cases, outputs, passed, strict=True) if not ok]
    assert sum(passed) >= suite.min_pass_rate * len(passed), failures


def test_the_task_prompt_set_is_the_suites_prompts() -> None:
    requests = named("tasks")
    suite = load_suite(DEFAULT_MODEL_SUITE)
    assert [body["messages"] for _, body in requests] == [case.messages for case in suite.cases]
    assert {path for path, _ in requests} == {"/v1/chat/completions"}


def test_lossless_drafts_keep_the_ids_and_save_forwards_on_the_task_prompts(decoded: Decoded) -> None:
    """Issue 22's lossless multi-token steps on a trained model at the default settings: the
    plain rule's ids exactly, in at least 1.5x fewer forwards (float32, counted, not timed)."""
    plain = decoded.outputs
    length = decoded.suite.defaults["max_tokens"]
    drafted = decoded.llm.generate(decoded.questions, gen_length=length, chat=True, drafts=DRAFTS)
    assert [o.output_ids for o in drafted] == [o.output_ids for o in plain]
    forwards = sum(o.nfe for o in plain), sum(o.nfe for o in drafted)
    assert forwards[0] >= 1.5 * forwards[1], forwards
