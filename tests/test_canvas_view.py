"""The canvas as the engine sees it after each denoising step, for the Python API
(`on_step` + `RequestState.canvas_view()`) and `dlm generate --canvas`: committed,
provisional (the step's proposal at a position left masked) and masked positions, the
proposals committing later and the last view equal to the answer."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from dlm_cli.main import app
from engine.runtime.request import RequestState


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
    from engine.llm import LLM

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
