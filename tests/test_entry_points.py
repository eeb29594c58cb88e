"""One request, four entry points: `dlm generate --json`, `engine.LLM`, `/v1/completions`
(`return_token_ids`) and a `dlm batch` line give the same ids and spend the same forwards, for
every family the registry decodes (`tiny_names`: a family added there joins by itself, on its
`tiny:` checkpoint, with the default request, until it is given one of its own below). So do
they with a stop string (dlm/engine/stops.py: one rule, once offered over HTTP only).

The request ends by the sequence's own rule whatever runs it (an EOS ends it at block
granularity, dlm/engine/runtime/request.py). Random tiny weights never emit EOS on cue, so each
checkpoint's EOS id is set to a token its greedy answer holds early: every entry point must
then stop at the same forward, and a server that ended requests by a rule of its own (say,
at the first EOS of the committed prefix) would spend fewer.
"""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from dlm.cli.main import app
from dlm.engine.llm import LLM
from dlm.engine.registry import family_named
from tests.conftest import session_home
from tests.serving import ServerProcess, in_process_server
from tests.test_stop_string_forwards import LENGTH, late_stop
from tests.test_stop_string_forwards import PROMPT as TEXT
from tests.tiny_families import cannot, tiny_names
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
DEFAULT_REQUEST: dict[str, Any] = dict(gen_length=16)  # a family without a request of its own
EOS_AT = 2  # answer position whose greedy token becomes the EOS id: inside the first block


def _checkpoint(directory: Path, family: str) -> Path:
    """The family's test checkpoint (tests/tp_checkpoints.py), else a copy of its `tiny:` one."""
    if family in REQUESTS:
        return write_family(directory, family)
    from dlm.engine.tiny_models import ensure_tiny_model

    return Path(shutil.copytree(ensure_tiny_model(f"tiny:{family}"), directory / family))


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
    if isinstance(config.get("text_config"), dict):  # a multimodal layout keeps it there too
        config["text_config"]["eos_token_id"] = eos
    config_path.write_text(json.dumps(config))
    generation = directory / "generation_config.json"
    if generation.exists():  # its EOS ids count too (dlm/engine/config.py)
        settings = json.loads(generation.read_text())
        settings.pop("eos_token_id", None)
        generation.write_text(json.dumps(settings))
    return eos


def _batch_line(directory: Path, body: dict[str, Any], tmp: Path) -> dict[str, Any]:
    """The answer `dlm batch` writes for one line (its in-process server, dlm/cli/batch.py)."""
    from dlm.cli.batch import BatchRequest, claim_output, run_batch
    from dlm.cli.server.config import load_config

    config = load_config(None, {"model": str(directory), "dtype": "float32", "device": "cpu"}, environ={})
    request = BatchRequest("q", "/v1/completions", body)
    with claim_output(tmp / "out.jsonl", [request]) as output:
        asyncio.run(run_batch(config, [request], output, concurrency=1))
    line = json.loads((tmp / "out.jsonl").read_text())
    assert line["response"]["status_code"] == 200, line
    return dict(line["response"]["body"])


@pytest.mark.slow
@pytest.mark.parametrize("family", tiny_names())
def test_same_ids_and_forwards_through_cli_python_http_and_batch(
    tmp_path_factory: pytest.TempPathFactory, family: str
) -> None:
    request = REQUESTS.get(family, DEFAULT_REQUEST)
    directory = _checkpoint(tmp_path_factory.mktemp(family), family)
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
    batch = _batch_line(directory, _http_body(request), tmp_path_factory.mktemp(f"{family}-batch"))
    assert batch["choices"] == http["choices"] and batch["usage"] == http["usage"]

    assert cli["output_ids"] == python.output_ids
    assert cli["completion_ids"] == python.completion_ids == http["choices"][0]["token_ids"]
    assert cli["nfe"] == python.nfe == http["usage"]["denoising_steps"]
    assert cli["finish_reason"] == "stop" == http["choices"][0]["finish_reason"]


@pytest.mark.slow
@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("family", tiny_names())
def test_a_stop_string_gives_the_same_answer_through_cli_python_http_and_batch(tmp_path: Path, family: str) -> None:
    """`dlm generate --stop`, `LLM.generate(stop=...)`, `stop` over HTTP and in a batch line:
    the same text, ids and finish reason, and the forwards up to the step whose committed
    text first holds the stop string."""
    from dlm.engine.tiny_models import ensure_tiny_model

    directory = ensure_tiny_model(f"tiny:{family}")
    with LLM(directory, dtype="float32", device="cpu") as llm:
        stop, forwards = late_stop(llm)
        python = llm.generate(TEXT, gen_length=LENGTH, stop=[stop, "\x00never"])[0]
    assert python.text is not None and stop not in python.text
    assert python.finish_reason == "stop" and python.nfe == forwards

    args = ["generate", str(directory), "--prompt", TEXT, "--gen-length", str(LENGTH), "--json"]
    result = CliRunner().invoke(
        app, [*args, "--stop", stop, "--stop", "\x00never", "--dtype", "float32", "--device", "cpu"]
    )
    assert result.exit_code == 0, result.output
    cli = json.loads(result.stdout)

    body = {"prompt": TEXT, "max_tokens": LENGTH, "stop": [stop, "\x00never"], "return_token_ids": True}
    with in_process_server(model=str(directory), dtype="float32", device="cpu", warmup=False) as client:
        response = client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    http = response.json()
    batch = _batch_line(directory, body, tmp_path)
    assert batch["choices"] == http["choices"] and batch["usage"] == http["usage"]

    choice = http["choices"][0]
    assert cli["text"] == python.text == choice["text"]
    assert cli["completion_ids"] == python.completion_ids == choice["token_ids"]
    assert cli["finish_reason"] == python.finish_reason == choice["finish_reason"]
    assert cli["nfe"] == python.nfe == http["usage"]["denoising_steps"]


@pytest.mark.slow
@pytest.mark.parametrize("family", tiny_names())
def test_early_stop_changes_only_the_forwards(tmp_path_factory: pytest.TempPathFactory, family: str) -> None:
    """Why `early_stop` (`--no-early-stop`) is offered on the command line and in Python but
    not over HTTP (docs/serve.md): turned off, decoding goes on past the block holding EOS,
    but what follows EOS is filler no answer returns. The completion, its text and finish
    reason are the same; only forwards are spent (a reference comparison's knob)."""
    if "early_stop" in cannot(family_named(family)):
        pytest.skip(f"{family} refuses early_stop")
    request = REQUESTS.get(family, DEFAULT_REQUEST)
    request = {**request, "gen_length": 2 * request["gen_length"]}  # a block after the one holding EOS
    directory = _checkpoint(tmp_path_factory.mktemp(family), family)
    _with_eos_from_answer(directory, request)
    with LLM(directory, dtype="float32", device="cpu") as llm:
        stopped = llm.generate(PROMPT, **request)[0]
        full = llm.generate(PROMPT, early_stop=False, **request)[0]
    assert stopped.finish_reason == full.finish_reason == "stop"
    assert (stopped.completion_ids, stopped.text) == (full.completion_ids, full.text)
    assert full.nfe > stopped.nfe
