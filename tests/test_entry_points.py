"""One request, three entry points: `dlm generate --json`, `engine.LLM` and `/v1/completions`
(`return_token_ids`) give the same ids and spend the same forwards, for every family.

The request ends by the sequence's own rule whatever runs it (an EOS ends it at block
granularity, dlm/engine/runtime/request.py). Random tiny weights never emit EOS on cue, so each
checkpoint's EOS id is set to a token its greedy answer holds early: every entry point must
then stop at the same forward, and a server that ended requests by a rule of its own (say,
at the first EOS of the committed prefix) would spend fewer.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from dlm.cli.main import app
from dlm.engine.llm import LLM
from tests.conftest import session_home
from tests.serving import ServerProcess
from tests.tp_checkpoints import PROMPT, write_family

# Per family, greedy (temperature 0), written once under GenerationParams' names: what each
# entry point receives under its own spelling (CLI flags, HTTP fields, keyword arguments).
REQUESTS: dict[str, dict[str, Any]] = {
    "llada": dict(gen_length=16, block_length=8, steps=16),
    "dream": dict(gen_length=16, block_length=8, cache="prefix"),
    "llada2_moe": dict(gen_length=32, threshold=0.6),
    "sdar": dict(gen_length=16),
    "sdar_moe": dict(gen_length=16, threshold=0.6, cache="none"),
    "pangu": dict(gen_length=32),
    "fast_dllm_v2": dict(gen_length=32, threshold=0.7),
    "clover": dict(gen_length=32, threshold=0.3),
}
EOS_AT = 2  # answer position whose greedy token becomes the EOS id: inside the first block


def _cli_flags(request: dict[str, Any]) -> list[str]:
    return [part for name, value in request.items() for part in (f"--{name.replace('_', '-')}", str(value))]


def _http_body(request: dict[str, Any]) -> dict[str, Any]:
    body = {("max_tokens" if name == "gen_length" else name): value for name, value in request.items()}
    return {**body, "prompt": PROMPT, "temperature": 0, "return_token_ids": True}


def _with_eos_from_answer(directory: Path, request: dict[str, Any]) -> int:
    """Rewrite the checkpoint's EOS id to the token its greedy answer has at EOS_AT."""
    with LLM(directory, dtype="float32", device="cpu") as llm:
        eos = llm.generate(PROMPT, **request)[0].output_ids[EOS_AT]
    config_path = directory / "config.json"
    config = json.loads(config_path.read_text())
    config["eos_token_id"] = eos
    config_path.write_text(json.dumps(config))
    return eos


@pytest.mark.slow
@pytest.mark.parametrize("family", list(REQUESTS))
def test_same_ids_and_forwards_through_cli_python_and_http(
    tmp_path_factory: pytest.TempPathFactory, family: str
) -> None:
    request = REQUESTS[family]
    directory = write_family(tmp_path_factory.mktemp(family), family)
    eos = _with_eos_from_answer(directory, request)

    with LLM(directory, dtype="float32", device="cpu") as llm:
        assert llm.config.eos_token_id == eos
        python = llm.generate(PROMPT, **request)[0]
    assert python.finish_reason == "stop" and eos in python.completion_ids
    assert python.completion_ids[-1] == eos

    args = ["generate", str(directory), "--prompt-ids", ",".join(map(str, PROMPT)), "--json"]
    result = CliRunner().invoke(app, [*args, "--dtype", "float32", "--device", "cpu", *_cli_flags(request)])
    assert result.exit_code == 0, result.output
    cli = json.loads(result.stdout)

    server = ServerProcess(
        [str(directory), "--dtype", "float32", "--device", "cpu", "--no-warmup"], session_home(tmp_path_factory)
    )
    try:
        server.wait_ready()
        response = server.http.post(server.url + "/v1/completions", json=_http_body(request))
    finally:
        server.terminate()
    assert response.status_code == 200, response.text
    http = response.json()

    assert cli["output_ids"] == python.output_ids
    assert cli["completion_ids"] == python.completion_ids == http["choices"][0]["token_ids"]
    assert cli["nfe"] == python.nfe == http["usage"]["denoising_steps"]
    assert cli["finish_reason"] == "stop" == http["choices"][0]["finish_reason"]
