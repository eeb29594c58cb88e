"""The native hybrid layers against transformers' own qwen3_5_moe on a tiny random config:
prefill logits, step-by-step decoding through the recurrent cache, both checkpoint layouts,
and the chunked vs recurrent Gated DeltaNet forms."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dlm.engine.layers.gated_deltanet import chunked_delta_rule, l2_normalize, recurrent_delta_rule
from dlm.engine.runtime.engine import load_model
from tests.hybrid_checkpoints import reference_model, save_reference, to_multimodal_layout

PREFILL = 70  # crosses the 64-token chunk boundary of the chunked DeltaNet form
DECODE = 6


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201
    model = reference_model(seed=0)
    directory = save_reference(model, tmp_path_factory.mktemp("qwen3_5_moe_text"))
    return model, directory


def _ids(batch: int, length: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 160, (batch, length), generator=torch.Generator().manual_seed(seed))


def _assert_close(ours: torch.Tensor, ref: torch.Tensor) -> None:
    """Within 1e-4 of the reference logits' standard deviation (the acceptance bound)."""
    tolerance = 1e-4 * ref.std().item()
    err = (ours - ref).abs().max().item()
    assert err <= tolerance, f"max |diff| {err:.3e} > {tolerance:.3e}"


def _ours(directory: Path):  # noqa: ANN202
    return load_model(directory, torch.float32, torch.device("cpu")).model


def test_prefill_logits_match_transformers(reference) -> None:  # noqa: ANN001
    ref, directory = reference
    model = _ours(directory)
    assert model.layer_types == ["linear_attention", "full_attention"] * 2
    ids = _ids(2, PREFILL)
    with torch.no_grad():
        expected = ref(input_ids=ids).logits
        positions = torch.arange(PREFILL).expand(2, PREFILL)
        hidden, _ = model.forward_tokens(ids, positions, None)
    _assert_close(model.logits(hidden), expected)


def test_step_by_step_decoding_with_recurrent_cache_matches_transformers(reference) -> None:  # noqa: ANN001
    ref, directory = reference
    model = _ours(directory)
    ids = _ids(2, PREFILL + DECODE, seed=2)
    with torch.no_grad():
        out = ref(input_ids=ids[:, :PREFILL], use_cache=True)
        ref_cache, expected = out.cache, [out.logits[:, -1]]
        for t in range(PREFILL, PREFILL + DECODE - 1):
            out = ref(input_ids=ids[:, t : t + 1], cache=ref_cache, use_cache=True)
            ref_cache = out.cache
            expected.append(out.logits[:, -1])

        cache = model.new_cache()
        hidden, states = model.forward_tokens(ids[:, :PREFILL], torch.arange(PREFILL).expand(2, PREFILL), cache)
        cache.commit(states, PREFILL)
        ours = [model.logits(hidden[:, -1])]
        for t in range(PREFILL, PREFILL + DECODE - 1):
            hidden, states = model.forward_tokens(ids[:, t : t + 1], torch.full((2, 1), t), cache)
            cache.commit(states, 1)
            ours.append(model.logits(hidden[:, -1]))
    assert cache.length == PREFILL + DECODE - 1
    for a, b in zip(ours, expected):
        _assert_close(a, b)
    # DeltaNet layers hold a fixed-size state; only attention layers grew with the context.
    conv, rec = cache.layers[0].conv, cache.layers[0].recurrent
    assert conv.shape == (2, 2 * 32 + 64, 3) and rec.shape == (2, 4, 16, 16)
    assert cache.layers[1][0].shape == (2, 2, PREFILL + DECODE - 1, 32)


def test_multimodal_layout_with_stacked_experts_loads_identically(reference, tmp_path: Path) -> None:  # noqa: ANN001
    _, directory = reference
    nested = to_multimodal_layout(directory, tmp_path / "multimodal")
    a, b = _ours(directory), _ours(nested)
    assert b.config.family == "qwen3_5_moe" and b.config.rotary_dim == 8
    for (name, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(p, q), name


def test_chunked_and_recurrent_deltanet_forms_agree() -> None:
    g = torch.Generator().manual_seed(3)
    b, h, t, dk, dv = 2, 3, 150, 16, 8  # 150: two full chunks and a padded one
    q = l2_normalize(torch.randn(b, h, t, dk, generator=g)) * dk**-0.5
    k = l2_normalize(torch.randn(b, h, t, dk, generator=g))
    v = torch.randn(b, h, t, dv, generator=g)
    decay = -torch.rand(b, h, t, generator=g) * 0.5
    beta = torch.rand(b, h, t, generator=g)
    s0 = torch.randn(b, h, dk, dv, generator=g)
    o_rec, s_rec = recurrent_delta_rule(q, k, v, decay, beta, s0)
    o_chk, s_chk = chunked_delta_rule(q, k, v, decay, beta, s0)
    assert ((o_chk - o_rec).norm() / o_rec.norm()).item() < 1e-4
    assert ((s_chk - s_rec).norm() / s_rec.norm()).item() < 1e-4
    # And per element, not only in aggregate.
    assert ((o_chk - o_rec).abs().max() / o_rec.abs().max()).item() < 1e-4


def test_model_forms_agree_inside_the_model(reference) -> None:  # noqa: ANN001
    """Forcing the recurrent form over a whole prefill gives the chunked prefill's logits."""
    _, directory = reference
    model = _ours(directory)
    ids = _ids(1, PREFILL, seed=4)
    positions = torch.arange(PREFILL)[None]
    with torch.no_grad():
        chunked, _ = model.forward_tokens(ids, positions, None, chunked=True)
        recurrent, _ = model.forward_tokens(ids, positions, None, chunked=False)
    _assert_close(model.logits(chunked), model.logits(recurrent))
