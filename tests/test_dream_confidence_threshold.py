"""Dream's `confidence_threshold` without a cache reproduces Fast-dLLM's whole-sequence rule.

The vectors (tests/data/dream_ct/, made by scripts/make_dream_ct_vectors.py running
Fast-dLLM's `generation_utils.py` on the shared tiny Dream checkpoint, float32, greedy) cover
several prompts, thresholds and step counts; many of them take more forwards than `steps`,
which is the rule: it carries uncommitted slots over and adds steps at the end.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dlm.engine.llm import LLM
from dlm.engine.params import GenerationParams
from tests.generate_cli import generate_json

DATA = Path(__file__).parent / "data" / "dream_ct" / "confidence_threshold.json"
VECTORS = json.loads(DATA.read_text())
CASES = VECTORS["cases"]


def case_id(case: dict) -> str:
    return f"p{len(case['prompt_ids'])}-gen{case['gen_length']}-steps{case['steps']}-thr{case['threshold']}"


@pytest.fixture(scope="module")
def llm() -> LLM:
    from tests.conftest import reference_dir

    ref = reference_dir()
    assert ref is not None
    return LLM(ref / "models" / VECTORS["model"], dtype="float32", device="cpu")


def settings(case: dict) -> dict:
    """The reference decodes the whole generation as one block, without a cache."""
    return dict(
        gen_length=case["gen_length"],
        steps=case["steps"],
        block_length=case["gen_length"],
        alg="confidence_threshold",
        threshold=case["threshold"],
        cache="none",
        early_stop=False,
    )


def test_the_vectors_exercise_the_added_steps() -> None:
    assert any(case["nfe"] > case["steps"] for case in CASES)
    assert len({case["threshold"] for case in CASES}) > 1 and len({tuple(c["prompt_ids"]) for c in CASES}) > 1


@pytest.mark.parametrize("case", CASES, ids=[case_id(c) for c in CASES])
def test_ids_and_forwards_match_fast_dllm(llm: LLM, case: dict) -> None:
    """float32 throughout; dlm's confidences are float64 sums, the reference's float32: the
    vectors record each run's closest confidence to the threshold (all far above rounding)."""
    out = llm.generate(case["prompt_ids"], **settings(case))[0]
    assert out.output_ids == case["generated_ids"]
    assert out.nfe == case["nfe"]
    # The added steps stay within the bound a server's --max-steps checks.
    resolved = llm.engine.validate(GenerationParams(**settings(case)), len(case["prompt_ids"]))
    assert case["nfe"] <= resolved.max_forwards


def test_dlm_generate_reproduces_a_vector(reference: Path) -> None:
    case = max(CASES, key=lambda c: c["nfe"] - c["steps"])  # the most added steps
    s = settings(case)
    payload = generate_json(
        reference / "models" / VECTORS["model"],
        case["prompt_ids"],
        *("--gen-length", str(s["gen_length"]), "--steps", str(s["steps"])),
        *("--block-length", str(s["block_length"]), "--alg", "confidence_threshold"),
        *("--threshold", str(s["threshold"]), "--cache", "none", "--no-early-stop"),
    )
    assert payload["output_ids"] == case["generated_ids"]
    assert payload["nfe"] == case["nfe"]
