"""The canvas as the engine sees it after each denoising step, for the Python API
(`on_step` + `RequestState.canvas_view()`) and `dlm generate --canvas`: committed,
provisional (the step's proposal at a position left masked) and masked positions, the
proposals committing later and the last view equal to the answer."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from dlm.cli.main import app
from dlm.engine.runtime.request import RequestState


def _became_committed(views: list[list[tuple[int | None, str]]]) -> bool:
    proposed: set[int] = set()
    for view in views:
        for i, (_, state) in enumerate(view):
            if state == "provisional":
                proposed.add(i)
            elif state == "committed" and i in proposed:
                return True
    return False


def test_the_python_api_sees_proposals_commit() -> None:
    from dlm.engine.llm import LLM

    llm = LLM("tiny:llada", device="cpu", dtype="float32")
    views: list[list[tuple[int | None, str]]] = []

    def on_step(seqs: list[RequestState]) -> None:
        views.append(seqs[0].canvas_view())

    out = llm.generate("hello", gen_length=32, steps=8, on_step=on_step)[0]
    assert len(views) == out.nfe  # one view per denoising step
    assert all((token is None) == (state == "masked") for view in views for token, state in view)
    assert _became_committed(views)
    assert [token for token, _ in views[-1]] == out.completion_ids
    assert all(state == "committed" for _, state in views[-1])


def test_dlm_generate_prints_the_canvas_per_step() -> None:
    result = CliRunner().invoke(
        app,
        ["generate", "tiny:dream", "-p", "hi", "--gen-length", "64", "--steps", "4", "--no-early-stop", "--canvas"],
        catch_exceptions=False,
    )
    assert result.exit_code == 0, result.output
    lines = [json.loads(line)["canvas"] for line in result.stdout.splitlines() if line.startswith('{"canvas"')]
    assert [line["step"] for line in lines] == [1, 2, 3, 4]
    assert {t["state"] for t in lines[0]["tokens"]} >= {"provisional", "masked"}
    assert all(t["state"] == "committed" for t in lines[-1]["tokens"])


def _views(model: str, **params: object) -> tuple[list[list[tuple[int | None, str]]], object]:
    from dlm.engine.llm import LLM

    llm = LLM(model, device="cpu", dtype="float32")
    views: list[list[tuple[int | None, str]]] = []
    out = llm.generate("hello", on_step=lambda seqs: views.append(seqs[0].canvas_view()), **params)[0]
    return views, out


def test_a_block_causal_canvas_shows_every_answer_position() -> None:
    """The block being decoded shows its committed tokens and its masked positions, and the
    blocks not reached yet show as masked: every answer position, every step."""
    views, out = _views("tiny:sdar", gen_length=32, steps=16, early_stop=False)
    assert all(len(view) == 32 for view in views[:-1])
    assert any({"committed", "masked"} <= {state for _, state in view} for view in views)
    assert [token for token, _ in views[-1]] == out.completion_ids  # type: ignore[attr-defined]


def test_a_diffusion_gemma_canvas_shows_the_canvas_being_denoised_as_provisional() -> None:
    views, out = _views("tiny:diffusion_gemma", gen_length=96, refinement_steps=2, seed=3)  # 3 canvases
    first = views[0]
    assert len(first) == 96 and {state for _, state in first} == {"provisional", "masked"}
    assert any({"committed", "provisional", "masked"} == {state for _, state in view} for view in views)
    assert [token for token, _ in views[-1]] == out.completion_ids  # type: ignore[attr-defined]


def test_dlm_generate_prints_each_samples_canvas() -> None:
    args = ["generate", "tiny:llada", "-p", "hi", "--gen-length", "16", "--steps", "4", "--n", "2", "--canvas"]
    result = CliRunner().invoke(app, [*args, "--temperature", "1", "--seed", "1", "--dtype", "float32"])
    assert result.exit_code == 0, result.output
    lines = [json.loads(line)["canvas"] for line in result.stdout.splitlines() if line.startswith('{"canvas"')]
    assert sorted({line["index"] for line in lines}) == [0, 1]


def test_the_python_api_takes_a_response_format_object() -> None:
    from dlm.engine.llm import LLM

    llm = LLM("tiny:llada", device="cpu", dtype="float32")
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    as_object = llm.generate("hi", gen_length=32, response_format=fmt)[0]
    as_text = llm.generate("hi", gen_length=32, response_format=json.dumps(fmt))[0]
    assert as_object.output_ids == as_text.output_ids and "a" in json.loads(as_object.text or "{}")
