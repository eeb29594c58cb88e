"""`cfg_scale` is bounded (`MAX_CFG_SCALE`): the guided hidden state (s + 1) h_cond - s h_uncond
overflowed the model's dtype at a huge scale (1e38 in float32), its step's probabilities were
NaN, and the answer was garbage (EOS first) or, with logprobs, a 500. Past the bound it is a
400 naming the field on every family, as every range is; at the bound it decodes."""

from __future__ import annotations

import math

import pytest

from dlm.engine.errors import UsageError
from dlm.engine.params import MAX_CFG_SCALE, GenerationParams
from dlm.engine.registry import FAMILIES
from tests.serving import app_client

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.name)
def test_a_scale_past_the_bound_is_refused_naming_it(family: object) -> None:
    for scale in (MAX_CFG_SCALE * 1.01, 1e38, 1e300):
        with pytest.raises(UsageError) as refused:
            GenerationParams(gen_length=8, cfg_scale=scale, cache="none").validate(4, 64, family)  # type: ignore[arg-type]
        assert refused.value.field == "cfg_scale"


def test_guidance_at_the_bound_answers_over_http() -> None:
    with app_client({"model": "tiny:llada", "warmup": False}) as client:
        body = {"prompt": "The sea", "max_tokens": 8, "logprobs": 2}
        bounded = client.post("/v1/completions", json={**body, "cfg_scale": MAX_CFG_SCALE})
        assert bounded.status_code == 200, bounded.text
        logprobs = bounded.json()["choices"][0]["logprobs"]["token_logprobs"]
        assert len(logprobs) == 8 and all(math.isfinite(v) for v in logprobs)
        huge = client.post("/v1/completions", json={**body, "cfg_scale": 1e38})
        error = huge.json()["error"]
        assert huge.status_code == 400 and (error["param"], error["code"]) == ("cfg_scale", "invalid_value")
