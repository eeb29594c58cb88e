"""LLaDA2.1 draft-and-edit decoding reproduces SGLang's `JointThreshold` on the tiny LLaDA2
checkpoint (tests/data/llada2_edit, made by scripts/llada2_edit_vectors.py): the same ids,
and the same forwards less the one SGLang spends after each finished block to persist its
K/V (the engine writes a finished block's K/V with the next block's first forward, and
needs none after the last). Numerics in float32, greedy. Also: the fields are refused where
draft-and-edit does not apply, each refusal naming its field."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from dlm.cli.main import app
from dlm.engine.errors import UsageError
from dlm.engine.llm import LLM
from dlm.engine.params import GenerationParams
from dlm.engine.registry import family_named
from tests.reference_vectors import reference_llm

DATA = Path(__file__).parent / "data" / "llada2_edit"
NAMES = sorted(p.stem for p in DATA.glob("*.json"))


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def llm() -> LLM:
    return reference_llm("llada2_tiny")


@pytest.fixture(scope="module")
def model_dir(llm: LLM) -> Path:
    return llm.model_dir


def _vector(name: str) -> dict[str, Any]:
    return json.loads((DATA / f"{name}.json").read_text())


def _fields(meta: dict[str, Any]) -> dict[str, Any]:
    c = meta["algorithm_config"]
    return {
        "gen_length": meta["gen_length"],
        "threshold": c["threshold"],
        "edit_threshold": c["edit_threshold"],
        "max_post_edit_steps": int(c["max_post_edit_steps"]),
    }


def _engine_nfe(meta: dict[str, Any]) -> int:
    """SGLang's forwards per block, less its K/V-persisting forward after each block."""
    return sum(meta["nfe_per_block"]) - len(meta["nfe_per_block"])


def test_vectors_present() -> None:
    assert len(NAMES) >= 6


@pytest.mark.parametrize("cache", ["block", "none"])
@pytest.mark.parametrize("name", NAMES)
def test_engine_reproduces_joint_threshold(llm: LLM, name: str, cache: str) -> None:
    meta = _vector(name)
    engine = llm.engine
    saved = engine.config
    engine.config = dataclasses.replace(saved, eos_token_ids=(meta["eos_id"],))  # `_stop` vectors stop on their id
    try:
        seq = engine.generate([meta["prompt_ids"]], GenerationParams(cache=cache, **_fields(meta)))[0]
    finally:
        engine.config = saved
    assert seq.generated_ids == meta["generated_ids_raw"]
    assert seq.nfe == _engine_nfe(meta)
    assert seq.finish_reason == ("stop" if "_stop" in name else "length")


def test_batched_equals_the_reference(llm: LLM) -> None:
    """Two requests in one batched forward (different prompt lengths, so different block
    grids and edit phases at each step) each keep their reference ids and forwards."""
    metas = [_vector("speed_p20"), _vector("speed_p40")]
    assert _fields(metas[0]) == _fields(metas[1])
    seqs = llm.engine.generate([m["prompt_ids"] for m in metas], GenerationParams(**_fields(metas[0])))
    for seq, meta in zip(seqs, metas):
        assert seq.generated_ids == meta["generated_ids_raw"]
        assert seq.nfe == _engine_nfe(meta)


def test_logprobs_are_from_the_step_that_last_wrote_each_token(llm: LLM) -> None:
    """An edit rewrites committed tokens, and a step may propose a token it does not write: each
    token's logprob is its own, from the step that wrote it last (consistent with that step's
    top alternatives), and asking for logprobs changes no id."""
    for name in NAMES:
        meta = _vector(name)
        plain = llm.generate(meta["prompt_ids"], **_fields(meta))[0]
        out = llm.generate(meta["prompt_ids"], logprobs=20, **_fields(meta))[0]
        assert out.output_ids == plain.output_ids and out.logprobs is not None
        for lp in out.logprobs:
            top = dict(lp.top)
            assert lp.logprob <= lp.top[0][1] + 1e-6, (name, lp)
            if lp.token in top:
                assert abs(top[lp.token] - lp.logprob) <= 1e-6, (name, lp)


def test_presets_are_the_model_cards_modes(llm: LLM) -> None:
    """`edit_mode` fills threshold and edit threshold (quality: 0.7/0.5, speed: 0.5/0), and the
    Python API returns the reference's ids and forwards with the preset alone."""
    for name, mode in (("quality_p20", "quality"), ("speed_p40", "speed")):
        meta = _vector(name)
        out = llm.generate(meta["prompt_ids"], gen_length=meta["gen_length"], edit_mode=mode)[0]
        assert out.output_ids == meta["generated_ids_raw"][: meta["gen_length"]]
        assert out.nfe == _engine_nfe(meta)
    resolved = llm.engine.validate(GenerationParams(edit_mode="quality", threshold=0.9), 5)
    assert (resolved.threshold, resolved.edit_threshold, resolved.max_post_edit_steps) == (0.9, 0.5, 16)
    assert llm.engine.validate(GenerationParams(edit_threshold=0.2), 5).threshold == 0.5  # speed's draft


def test_cli_generate_reproduces(model_dir: Path) -> None:
    meta = _vector("thr0.9_edit0.3_post3_p33")
    f = _fields(meta)
    args = ["generate", str(model_dir), "--prompt-ids", ",".join(map(str, meta["prompt_ids"]))]
    args += ["--gen-length", str(f["gen_length"]), "--threshold", str(f["threshold"])]
    args += ["--edit-threshold", str(f["edit_threshold"]), "--max-post-edit-steps", str(f["max_post_edit_steps"])]
    result = CliRunner().invoke(app, [*args, "--dtype", "float32", "--device", "cpu", "--json"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    assert out["output_ids"] == meta["generated_ids_raw"][: meta["gen_length"]]
    assert out["nfe"] == _engine_nfe(meta)
    bad = CliRunner().invoke(app, [*args, "--temperature", "0.5"])
    assert bad.exit_code == 2 and "error:" in bad.output and "temperature" in bad.output


@pytest.mark.parametrize(
    "fields,field",
    [
        ({"edit_threshold": 0.5, "temperature": 0.7}, "temperature"),
        ({"edit_mode": "speed", "mode": "ar"}, "mode"),
        ({"edit_mode": "speed", "steps": 32}, "steps"),
        ({"edit_threshold": 0.5, "refinement_steps": 8}, "refinement_steps"),
        ({"max_post_edit_steps": 4}, "max_post_edit_steps"),
        ({"edit_mode": "fast"}, "edit_mode"),
        ({"edit_threshold": 1.5}, "edit_threshold"),
    ],
)
def test_refusals_name_their_field(llm: LLM, fields: dict[str, Any], field: str) -> None:
    engine = llm.engine
    with pytest.raises(UsageError) as error:
        engine.validate(GenerationParams(gen_length=32, **fields), 5)  # the family defaults apply inside
    assert error.value.field == field


@pytest.mark.parametrize("family", ["llada", "dream", "sdar", "pangu"])
def test_refused_for_families_not_trained_to_edit(family: str) -> None:
    for given in ("edit_threshold", "edit_mode"):
        value = 0.5 if given == "edit_threshold" else "quality"
        with pytest.raises(UsageError, match="llada2_moe") as error:
            GenerationParams(gen_length=32, **{given: value}).validate(5, 4096, family_named(family))
        assert error.value.field == given


def test_editing_bounds_the_forwards(llm: LLM) -> None:
    """A server's --max-steps caps `max_forwards`: with edits a block may take block +
    max_post_edit_steps + 1 forwards."""
    p = llm.engine.validate(GenerationParams(gen_length=64, edit_mode="speed", max_post_edit_steps=4), 20)
    assert p.max_forwards == p.decoded_blocks * (32 + 4 + 1)


@pytest.mark.slow
def test_serve_reproduces_over_http(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    """`dlm serve` on the tiny checkpoint: the same ids and forwards (`usage.denoising_steps`)
    from the fields and from the preset; a sampled draft-and-edit request is a 400 naming
    `temperature`."""
    from tests.conftest import session_home
    from tests.serving import ServerProcess

    # A server default of refinement steps does not apply to draft-and-edit requests (they
    # bound their own steps); a request's own `steps` is refused.
    args = [str(model_dir), "--dtype", "float32", "--device", "cpu", "--no-warmup", "--refinement-steps", "8"]
    server = ServerProcess(args, session_home(tmp_path_factory))
    try:
        server.wait_ready()
        for name, extra in (("speed_p40", {"edit_mode": "speed"}), ("thr0.9_edit0.3_post3_p33", None)):
            meta = _vector(name)
            fields = _fields(meta)
            body: dict[str, Any] = {"prompt": meta["prompt_ids"], "max_tokens": fields.pop("gen_length")}
            body.update(extra or fields)
            response = server.http.post(server.url + "/v1/completions", json={**body, "return_token_ids": True})
            assert response.status_code == 200, response.text
            answer = response.json()
            assert answer["choices"][0]["token_ids"] == meta["generated_ids_raw"][: meta["gen_length"]]
            assert answer["usage"]["denoising_steps"] == _engine_nfe(meta)
        refused = server.http.post(
            server.url + "/v1/completions", json={"prompt": [5, 6, 7], "edit_mode": "quality", "temperature": 0.5}
        )
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "temperature"
        refused = server.http.post(
            server.url + "/v1/completions", json={"prompt": [5, 6], "edit_mode": "speed", "steps": 8}
        )
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "steps"
    finally:
        assert server.terminate() == 0, "\n".join(server.lines)


@pytest.mark.slow
def test_two_ranks_reproduce(model_dir: Path) -> None:
    from dlm.engine.parallel.distributed import ParallelConfig

    meta = _vector("quality_p20")
    with LLM(model_dir, dtype="float32", device="cpu", parallel=ParallelConfig(tensor_parallel_size=2)) as llm:
        out = llm.generate(meta["prompt_ids"], **_fields(meta))[0]
    assert out.output_ids == meta["generated_ids_raw"][: meta["gen_length"]]
    assert out.nfe == _engine_nfe(meta)
