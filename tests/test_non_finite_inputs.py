"""Non-finite numbers (nan, inf, -inf) at every entry point: NaN fails every comparison, so a
range check written with `<` and `>` lets it through. Each float parameter of
dlm/engine/params.py is refused through `Param.check` and `GenerationParams.validate` (the
list is read from the declarations, so a new float parameter is covered by itself), as are
`dlm generate`, `LLM.generate`, `dlm estimate`'s GiB options, `dlm batch` lines that only
Python's permissive `json` reads, and HTTP bodies (in process, over the tiny LLaDA)."""

from __future__ import annotations

import dataclasses
import json
import math
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from dlm.engine.errors import UsageError
from dlm.engine.params import PARAMS, GenerationParams
from tests.weights_helpers import cli

NON_FINITE = [math.nan, math.inf, -math.inf]


def _float_params() -> list[str]:
    hints = typing.get_type_hints(GenerationParams)
    return [
        f.name
        for f in dataclasses.fields(GenerationParams)
        if hints[f.name] is float or float in typing.get_args(hints[f.name])
    ]


FLOAT_PARAMS = _float_params()


def test_the_float_parameters_are_found() -> None:
    assert {"temperature", "threshold", "cfg_scale", "top_p", "eps"} <= set(FLOAT_PARAMS)


@pytest.mark.parametrize("value", NON_FINITE, ids=str)
@pytest.mark.parametrize("name", FLOAT_PARAMS)
def test_param_check_refuses_non_finite(name: str, value: float) -> None:
    with pytest.raises(UsageError) as caught:
        PARAMS[name].check(name, value)
    assert caught.value.field == name and "finite" in str(caught.value)


@pytest.mark.parametrize("value", NON_FINITE, ids=str)
@pytest.mark.parametrize("name", FLOAT_PARAMS)
def test_validate_refuses_non_finite(name: str, value: float) -> None:
    with pytest.raises(UsageError) as caught:
        GenerationParams(gen_length=8, **{name: value}).validate(prompt_length=4, max_length=64)
    assert caught.value.field == name and "finite" in str(caught.value)  # not a family's rule


@pytest.mark.parametrize("name", FLOAT_PARAMS)
def test_finite_values_in_range_still_pass(name: str) -> None:
    spec = PARAMS[name]
    value = spec.high if spec.high is not None and not spec.high_open else 0.5
    spec.check(name, value)


@pytest.mark.parametrize(("flag", "value"), [("--temperature", "nan"), ("--threshold", "nan"), ("--cfg-scale", "inf")])
def test_generate_refuses_non_finite(flag: str, value: str) -> None:
    code, stdout, stderr = cli("generate", "tiny:llada", "--prompt", "hi", "--gen-length", "8", flag, value, "--json")
    assert code == 2 and not stdout.strip(), (code, stdout)
    assert stderr.startswith("error: ") and "finite" in stderr and "Traceback" not in stderr, stderr


def test_llm_generate_refuses_nan() -> None:
    from dlm.engine.llm import LLM

    llm = LLM("tiny:llada", device="cpu", dtype="float32")
    with pytest.raises(UsageError) as caught:
        llm.generate("hi", gen_length=4, temperature=math.nan)
    assert caught.value.field == "temperature"


# ----------------------------------------------------------------------------- dlm estimate
@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--overhead-gb", "nan"], "--overhead-gb must be a finite number >= 0, got nan"),
        (["--overhead-gb", "inf"], "--overhead-gb must be a finite number >= 0, got inf"),
        (["--overhead-gb", "-inf"], "--overhead-gb must be a finite number >= 0, got -inf"),
        (["--overhead-gb", "1e308"], "--overhead-gb must be at most"),
        (["--gpu-memory", "nan"], "--gpu-memory must be a finite number > 0, got nan"),
        (["--gpu-memory", "inf"], "--gpu-memory must be a finite number > 0, got inf"),
        (["--gpu-memory", "-inf"], "--gpu-memory must be a finite number > 0, got -inf"),
        (["--gpu-memory", "1e308"], "--gpu-memory must be at most"),
        (["--fragmentation", "nan"], "--fragmentation must be in [0, 1)"),
    ],
    ids=lambda v: " ".join(v) if isinstance(v, list) else None,
)
def test_estimate_refuses_non_finite(args: list[str], says: str) -> None:
    from dlm.engine.default_model import default_model_dir

    code, stdout, stderr = cli("estimate", str(default_model_dir()), *args, "--json")
    assert code == 2 and not stdout.strip(), (code, stdout)
    assert stderr.startswith("error: ") and says in stderr.replace("\n", " "), stderr


def test_estimate_takes_a_large_finite_gpu_memory() -> None:
    from dlm.engine.default_model import default_model_dir

    code, stdout, stderr = cli("estimate", str(default_model_dir()), "--gpu-memory", "1e6", "--json")
    assert code == 0, stderr
    assert json.loads(stdout)["verdicts"][0]["fits"] is True


# ----------------------------------------------------------------------------- dlm batch
def _line(body: str) -> str:
    return '{"custom_id": "q1", "method": "POST", "url": "/v1/completions", "body": ' + body + "}\n"


@pytest.mark.parametrize(
    ("literal", "says"),
    [
        ("NaN", "NaN is not JSON"),
        ("Infinity", "Infinity is not JSON"),
        ("-Infinity", "-Infinity is not JSON"),
        ("1e999", "1e999 is out of range for a JSON number"),
    ],
)
def test_batch_refuses_a_line_with_a_non_json_number(tmp_path: Path, literal: str, says: str) -> None:
    """The server answers such a body 400 `invalid_json` with the same words; a batch line
    holding one is not JSON, so the input is refused by line before anything runs (docs/batch.md)."""
    source = tmp_path / "in.jsonl"
    good = _line('{"prompt": "hello", "max_tokens": 4, "temperature": 0}')
    source.write_text(good + _line('{"prompt": "hi", "max_tokens": 4, "temperature": ' + literal + "}"))
    out = tmp_path / "out.jsonl"
    code, stdout, stderr = cli("batch", str(source), str(out), "--model", "tiny:llada", "--json")
    assert code == 2 and not stdout.strip(), (code, stdout)
    assert stderr.startswith("error: ") and f"in.jsonl:2: {says}" in stderr.replace("\n", " "), stderr
    assert not out.exists()


# ----------------------------------------------------------------------------- HTTP
@pytest.fixture(scope="module")
def client() -> Iterator[Any]:
    from tests.serving import app_client

    with app_client({"model": "tiny:llada", "warmup": False}) as test_client:
        yield test_client


@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity", "1e999", "-1e999"])
@pytest.mark.parametrize("field", ["temperature", "threshold"])
def test_http_refuses_non_finite_numbers(client: Any, field: str, literal: str) -> None:
    raw = '{"prompt": "hi", "max_tokens": 4, "' + field + '": ' + literal + "}"
    response = client.post("/v1/completions", content=raw, headers={"Content-Type": "application/json"})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == "invalid_json"
    assert literal in error["message"]
