"""`stop_token_ids`: ids that end the answer besides EOS, with each family's own stop rule.

Stop ids never change a decision, only where the answer ends and when decoding stops, so a
run without them is the reference for a run with them: pick a token the model commits in
block 1 or 2 (its first occurrence) and ask to stop on it.
- bidirectional families (LLaDA, Dream): the answer ends at the first committed stop id;
  with early stop, decoding ends after the block holding it (the rest filled with EOS);
- block-causal families (SDAR, LLaDA2): decoding ends after the block holding it, as SDAR's
  `stopping_criteria_idx` does (checked against the literal loop).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from dlm.engine.errors import UsageError
from dlm.engine.llm import LLM
from dlm.engine.params import GenerationParams
from tests.oracles.block_reference_loop import reference_block_generate
from tests.serving import ServerProcess

PROMPT = list(range(5, 21))  # 16 tokens: on the block grid of 8
BLOCK = 8


@pytest.fixture(scope="module")
def engines(tiny_llada: Path, tiny_dream: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, LLM]:
    from dlm.engine.block_checkpoints import write_tiny

    paths = {"llada": tiny_llada, "dream": tiny_dream}
    for family in ("sdar", "llada2_moe"):
        paths[family] = write_tiny(tmp_path_factory.mktemp(family), family)
    return {name: LLM(path, dtype="float32", device="cpu") for name, path in paths.items()}


def first_new_token(ids: list[int], eos: int | None) -> tuple[int, int]:
    """(position, token) of a token that first appears in block 1 or 2 (of 4), before any EOS."""
    for j in range(BLOCK, 3 * BLOCK):
        if ids[j] not in ids[:j] and ids[j] != eos and eos not in ids[:j]:
            return j, ids[j]
    raise AssertionError(f"no token first appears in blocks 1-2 of {ids}")


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_bidirectional_answer_ends_at_the_first_committed_stop_id(engines: dict[str, LLM], family: str) -> None:
    llm = engines[family]
    eos = llm.config.eos_token_id
    params = dict(gen_length=32, steps=32, block_length=BLOCK)
    full = llm.generate(PROMPT, early_stop=False, **params)[0]
    j, stop = first_new_token(full.output_ids, eos)
    end = (j // BLOCK + 1) * BLOCK

    stopped = llm.generate(PROMPT, stop_token_ids=[stop], **params)[0]
    assert stopped.finish_reason == "stop"
    assert stopped.completion_ids == full.output_ids[: j + 1]
    assert stopped.output_ids[:end] == full.output_ids[:end] and stopped.output_ids[end:] == [eos] * (32 - end)
    assert stopped.nfe == end  # one token per step: the blocks up to the stop only

    decoded_on = llm.generate(PROMPT, stop_token_ids=[stop], early_stop=False, **params)[0]
    assert decoded_on.output_ids == full.output_ids and decoded_on.nfe == 32
    assert decoded_on.completion_ids == full.output_ids[: j + 1] and decoded_on.finish_reason == "stop"


@pytest.mark.parametrize("family", ["sdar", "llada2_moe"])
def test_block_causal_stops_after_the_block_holding_a_stop_id(engines: dict[str, LLM], family: str) -> None:
    llm = engines[family]
    engine, eos = llm.engine, llm.config.eos_token_id
    full = llm.generate(PROMPT, gen_length=32, block_length=BLOCK)[0]
    j, stop = first_new_token(full.output_ids, eos)
    end = (j // BLOCK + 1) * BLOCK

    stopped = llm.generate(PROMPT, gen_length=32, block_length=BLOCK, stop_token_ids=[stop])[0]
    assert stopped.finish_reason == "stop"
    assert stopped.output_ids == full.output_ids[:end]
    assert stopped.completion_ids == full.output_ids[: j + 1]
    assert stopped.nfe < full.nfe

    params = engine.validate(GenerationParams(gen_length=32, block_length=BLOCK, stop_token_ids=[stop]), len(PROMPT))
    want, _ = reference_block_generate(
        engine.loaded.model, PROMPT, params, mask_id=engine.config.mask_token_id, eos_id=eos, stop_ids=[stop]
    )
    assert stopped.output_ids == want


@pytest.mark.parametrize("bad", [[4096], [-1], [1, 10**9], ["7"], [True], 7])
def test_ids_outside_the_vocabulary_are_refused_naming_the_field(bad: object) -> None:
    with pytest.raises(UsageError) as caught:
        GenerationParams(stop_token_ids=bad).validate(4, 512, vocab=4096)  # type: ignore[arg-type]
    assert caught.value.field == "stop_token_ids"


def test_engines_refuse_ids_beyond_their_lm_head(engines: dict[str, LLM]) -> None:
    llm = engines["llada"]
    size = llm.config.logits_size
    with pytest.raises(UsageError, match="outside the vocabulary") as caught:
        llm.generate(PROMPT, gen_length=8, stop_token_ids=[size])
    assert caught.value.field == "stop_token_ids"
    resolved = llm.engine.validate(GenerationParams(gen_length=8, stop_token_ids=[size - 1, 3]), len(PROMPT))
    assert resolved.stop_token_ids == (size - 1, 3)  # a list becomes one immutable form


def test_text_ends_before_the_stop_token() -> None:
    from dlm.engine.tokenizer import decode

    class Tokens:
        def decode(self, ids: list[int], skip_special_tokens: bool) -> str:
            return " ".join(map(str, ids))

    assert decode(Tokens(), [4, 5, 6, 5], {5}) == "4"
    assert decode(Tokens(), [4, 6], {5}) == "4 6"


def _generate_cli(model: Path, *extra: str) -> tuple[int, str, str]:
    from tests.weights_helpers import cli

    ids = ",".join(map(str, PROMPT))
    common = ("--gen-length", "32", "--steps", "32", "--block-length", str(BLOCK), "--dtype", "float32")
    return cli("generate", str(model), "--prompt-ids", ids, *common, "--device", "cpu", "--json", *extra)


def test_dlm_generate_stop_token_ids(engines: dict[str, LLM], tiny_llada: Path) -> None:
    import json

    from tests.test_cli_bad_inputs import _assert_one_error

    llm = engines["llada"]
    full = llm.generate(PROMPT, gen_length=32, steps=32, block_length=BLOCK, early_stop=False)[0]
    j, stop = first_new_token(full.output_ids, llm.config.eos_token_id)
    for flags in (["--stop-token-ids", str(stop), "--stop-token-ids", "3"], ["--stop-token-ids", f"{stop},3"]):
        code, stdout, stderr = _generate_cli(tiny_llada, *flags)
        assert code == 0, stderr
        out = json.loads(stdout)
        assert out["finish_reason"] == "stop" and out["completion_ids"] == full.output_ids[: j + 1]
        assert out["params"]["stop_token_ids"] == [stop, 3]

    code, stdout, stderr = _generate_cli(tiny_llada, "--stop-token-ids", str(llm.config.logits_size))
    _assert_one_error(code, stdout, stderr, 2)
    assert "stop_token_ids" in stderr and "outside the vocabulary" in stderr


@pytest.fixture(scope="module", params=["llada", "sdar"])
def server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """tiny:llada (bidirectional) and tiny:sdar (block-causal): random weights, whose answers fill
    the canvas with many distinct tokens to stop at (the trained default model answers in a few)."""
    from tests.conftest import session_home
    from tests.serving import ready_server

    args = [f"tiny:{request.param}", "--max-tokens", "64"]
    with ready_server(args, session_home(tmp_path_factory)) as proc:
        yield proc


def _post(server: ServerProcess, route: str, **fields: object) -> httpx.Response:
    body = {"max_tokens": 32, "temperature": 0, "return_token_ids": True, **fields}
    return httpx.post(f"{server.url}/v1/{route}", json=body, timeout=120)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("route", "prompt"),
    [("completions", {"prompt": PROMPT}), ("chat/completions", {"messages": [{"role": "user", "content": "Hi"}]})],
    ids=["completions", "chat"],
)
def test_http_request_ends_at_the_first_stop_id(server: ServerProcess, route: str, prompt: dict) -> None:
    base = _post(server, route, **prompt)
    assert base.status_code == 200, base.text
    ids = base.json()["choices"][0]["token_ids"]
    usable = [j for j, t in enumerate(ids) if t not in ids[:j] and j < len(ids) - 1]
    assert usable, ids
    j = usable[-1]  # the latest token that first appears there, not the last (maybe EOS)
    stopped = _post(server, route, stop_token_ids=[ids[j]], **prompt)
    assert stopped.status_code == 200, stopped.text
    choice, base_choice = stopped.json()["choices"][0], base.json()["choices"][0]
    assert choice["finish_reason"] == "stop"
    assert choice["token_ids"] == ids[: j + 1]
    assert stopped.json()["usage"]["completion_tokens"] == j + 1
    text = choice["text"] if route == "completions" else choice["message"]["content"]
    base_text = base_choice["text"] if route == "completions" else base_choice["message"]["content"]
    assert base_text.startswith(text)


@pytest.mark.slow
@pytest.mark.parametrize("bad", [[10**6], [-3], ["7"], 7])
def test_http_refuses_bad_stop_token_ids_naming_the_field(server: ServerProcess, bad: object) -> None:
    for route, prompt in (
        ("completions", {"prompt": PROMPT}),
        ("chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}),
    ):
        response = _post(server, route, stop_token_ids=bad, **prompt)
        assert response.status_code == 400, response.text
        # A wrongly typed entry is named with its index (stop_token_ids.0), as every body field is.
        assert response.json()["error"]["param"].split(".")[0] == "stop_token_ids", response.text


@pytest.mark.slow
@pytest.mark.parametrize("family", ["dream", "sdar"])
def test_tensor_parallel_ranks_stop_where_one_process_does(tmp_path: Path, family: str) -> None:
    """Two ranks (gloo) decode the single-process ids and forwards with a stop id, and for
    Dream with Fast-dLLM's whole-sequence confidence_threshold (added steps included)."""
    from dlm.engine.parallel.distributed import ParallelConfig
    from tests.tp_checkpoints import write_family

    model = write_family(tmp_path, family)
    kwargs: dict = dict(gen_length=32, block_length=BLOCK)
    if family == "dream":
        kwargs.update(block_length=16, steps=8, alg="confidence_threshold", threshold=0.3, cache="none")
    single = LLM(model, dtype="float32", device="cpu")
    full = single.generate(PROMPT, **kwargs)[0]
    j, stop = first_new_token(full.output_ids, single.config.eos_token_id)
    want = single.generate(PROMPT, stop_token_ids=[stop], **kwargs)[0]
    assert want.finish_reason == "stop" and want.completion_ids == full.output_ids[: j + 1]
    with LLM(model, dtype="float32", device="cpu", parallel=ParallelConfig(tensor_parallel_size=2)) as llm:
        got = llm.generate(PROMPT, stop_token_ids=[stop], **kwargs)[0]
    assert (got.output_ids, got.completion_ids, got.nfe, got.finish_reason) == (
        want.output_ids,
        want.completion_ids,
        want.nfe,
        want.finish_reason,
    )


def test_a_stop_id_that_is_not_an_integer_is_one_usage_error(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Refused while the command line is parsed (the `dlm` entry point: one line, exit 2)."""
    import sys

    from dlm.cli.main import main

    monkeypatch.setattr(sys, "argv", ["dlm", "generate", "--stop-token-ids", "3,x"])
    with pytest.raises(SystemExit) as caught:
        main()
    assert caught.value.code == 2
    err = capsys.readouterr().err
    assert (
        err.count("\n") == 1
        and err.startswith("error: ")
        and "--stop-token-ids must be comma-separated integers" in err
    ), err
