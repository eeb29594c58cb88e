"""Any max_tokens on every family (issue 33): every length an OpenAI client may pick, with
every set of dLLM fields `dlm validate` sends, decodes on every family the registry lists.

A block-grid family (block-causal, Clover, DiffusionGemma) decodes its last block whole and
cuts the answer at gen_length, `length` when cut; `steps` below a block's least is raised
to it. The one validation (dlm/engine/family_rules.py) is what every entry point runs, so
the Python API here stands for them all; the same matrix over HTTP against `dlm serve` is
tests/test_family_contract.py, and one CLI and one batch request below show the other doors.
Refusals are left only where the family record says the family cannot do a field.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from dlm.cli.checks.contract import DLLM_REQUESTS, DLLM_TOKENS, PROMPT
from dlm.cli.main import app
from dlm.engine.capabilities import supported
from dlm.engine.errors import Unsupported
from dlm.engine.llm import LLM
from dlm.engine.params import GenerationParams
from dlm.engine.runtime.request import stop_ids
from tests.tiny_families import MAX_TOKENS, cannot, tiny_names

pytestmark = pytest.mark.usefixtures("one_thread")

FIELD_SETS: tuple[dict, ...] = ({}, *DLLM_REQUESTS)


def test_the_matrix_holds_every_family_the_registry_decodes() -> None:
    from dlm.engine.config import load_config
    from dlm.engine.registry import FAMILIES
    from dlm.engine.tiny_models import ensure_tiny_model

    covered = {load_config(ensure_tiny_model(f"tiny:{name}")).family for name in tiny_names()}
    assert covered == {f.name for f in FAMILIES if f.engine}
    assert DLLM_TOKENS in MAX_TOKENS  # the length dlm validate's dLLM checks use


@pytest.mark.parametrize("name", tiny_names())
def test_any_max_tokens_with_the_fields_validate_sends(name: str) -> None:
    with LLM(f"tiny:{name}", dtype="float32", device="cpu") as llm:
        engine, family = llm.engine, llm.engine.family
        prompt = llm.tokenizer.encode(PROMPT)
        problems: list[str] = []
        for gen in MAX_TOKENS:
            for fields in FIELD_SETS:
                case = f"max_tokens={gen} {fields}"
                refusable = cannot(family) & set(fields)
                params = GenerationParams(gen_length=gen, **fields)
                try:
                    resolved = engine.validate(params, len(prompt))
                    out = llm.generate(prompt, **{"gen_length": gen, **fields})[0]
                except Unsupported as exc:
                    if exc.field not in refusable:
                        problems.append(f"{case}: refused ({exc.field}: {exc})")
                    continue
                if refusable:
                    problems.append(f"{case}: {sorted(refusable)} accepted, though {family.name} cannot honour it")
                stops = stop_ids(engine.config.eos_token_ids, resolved)
                completion = out.completion_ids
                if len(out.output_ids) > gen or not 1 <= len(completion) <= gen:
                    problems.append(f"{case}: {len(out.output_ids)} ids, completion of {len(completion)}")
                if out.finish_reason == "length" and (len(completion) != gen or stops & set(completion)):
                    problems.append(f"{case}: finish length with a completion of {len(completion)} tokens")
                if out.finish_reason == "stop" and completion[-1] not in stops:
                    problems.append(f"{case}: finish stop without a stop id at the end")
                if not 1 <= out.nfe <= resolved.max_forwards:
                    problems.append(f"{case}: {out.nfe} forwards, bound {resolved.max_forwards}")
                if not fields and "logprobs" in supported(family):  # a sampler that commits tokens
                    least = engine.validate(GenerationParams(gen_length=gen, steps=1), len(prompt))
                    if resolved.max_forwards > max(gen, least.max_forwards):
                        problems.append(f"{case}: default steps may spend {resolved.max_forwards} forwards")
    assert not problems, "\n".join(problems)


def test_dlm_generate_decodes_an_odd_length_on_a_block_grid() -> None:
    result = CliRunner().invoke(
        app, ["generate", "tiny:pangu", "--prompt", "hi", "--gen-length", "7", "--steps", "1", "--json"]
    )
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    assert len(out["output_ids"]) == 7 and out["finish_reason"] in ("stop", "length")


def test_dlm_batch_decodes_an_odd_length_on_a_block_grid(tmp_path: Path) -> None:
    requests = tmp_path / "in.jsonl"
    line = {"custom_id": "a", "method": "POST", "url": "/v1/completions"}
    body = {"prompt": PROMPT, "max_tokens": 7, "steps": 2}
    requests.write_text(json.dumps({**line, "body": body}) + "\n")
    output = tmp_path / "out.jsonl"
    result = CliRunner().invoke(app, ["batch", str(requests), str(output), "--model", "tiny:llada2_moe"])
    assert result.exit_code == 0, result.output
    answer = json.loads(output.read_text().splitlines()[0])["response"]
    assert answer["status_code"] == 200, answer
    assert 1 <= answer["body"]["usage"]["completion_tokens"] <= 7
