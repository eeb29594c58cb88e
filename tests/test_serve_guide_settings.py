"""The deployment guides' serving settings, each one flag away: `--model-path`,
`--max-concurrency`, `--refinement-steps` (denoising steps per block, also a request field)
and `--block-length` as server defaults, and the request's `max_output_tokens`."""

from __future__ import annotations

import os
from collections.abc import Iterator
from unittest import mock

import httpx
import pytest

from tests.conftest import session_home
from tests.serving import ServerProcess, ready_server

pytestmark = pytest.mark.slow  # every test here starts processes

BODY = {"prompt": "Implement quicksort", "temperature": 0}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    from dlm.engine.default_model import ensure_default_model

    home = session_home(tmp_path_factory)
    with mock.patch.dict(os.environ, {"DLM_HOME": str(home)}):
        model = ensure_default_model()
    with ready_server(
        [
            "--model-path",
            str(model),
            "--max-concurrency",
            "2",
            "--refinement-steps",
            "4",
            "--block-length",
            "16",
            "--max-tokens",
            "64",
        ],
        home,
    ) as proc:
        yield proc


def complete(server: ServerProcess, **fields: object) -> httpx.Response:
    return httpx.post(server.url + "/v1/completions", json={**BODY, **fields}, timeout=120)


def test_flags_reach_the_configuration(server: ServerProcess) -> None:
    shown = "\n".join(server.lines)
    for line in ("max_num_seqs = 2", "refinement_steps = 4", "block_length = 16"):
        assert line in shown, shown


def test_refinement_steps_are_per_block_defaults(server: ServerProcess) -> None:
    """32 tokens in blocks of 16 (the server's default) at 4 steps per block = 8 steps."""
    default = complete(server, max_tokens=32).json()
    explicit = complete(server, max_tokens=32, steps=8, block_length=16).json()
    per_request = complete(server, max_tokens=32, refinement_steps=4).json()
    assert default["choices"][0]["text"] == explicit["choices"][0]["text"] == per_request["choices"][0]["text"]
    assert default["usage"]["denoising_steps"] == explicit["usage"]["denoising_steps"] <= 8
    # A request's own per-block steps win over the server's; a block never takes more steps
    # than it has tokens.
    two = complete(server, max_tokens=32, refinement_steps=2).json()
    assert two == {**two, "choices": complete(server, max_tokens=32, steps=4).json()["choices"]}
    assert two["usage"]["denoising_steps"] <= 4
    capped = complete(server, max_tokens=32, refinement_steps=1000).json()
    assert capped["choices"][0]["text"] == complete(server, max_tokens=32, steps=32).json()["choices"][0]["text"]


def test_max_output_tokens_is_max_tokens(server: ServerProcess) -> None:
    a = complete(server, max_output_tokens=16).json()
    b = complete(server, max_tokens=16).json()
    assert a["choices"][0]["text"] == b["choices"][0]["text"] and a["usage"] == b["usage"]


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"max_tokens": 32, "steps": 8, "refinement_steps": 4}, "refinement_steps"),
        ({"max_tokens": 32, "max_output_tokens": 16}, "max_output_tokens"),
        ({"max_tokens": 32, "refinement_steps": 0}, None),
    ],
)
def test_conflicting_or_bad_step_fields_are_400(server: ServerProcess, fields: dict, param: str | None) -> None:
    response = complete(server, **fields)
    assert response.status_code == 400, response.text
    if param is not None:
        assert response.json()["error"]["param"] == param
