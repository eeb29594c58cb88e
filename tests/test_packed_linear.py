"""bf16 linear weights packed once for oneDNN (dlm/kernels/packed_linear.py) against their
twin, `F.linear` on the plain weight.

These tests run in bfloat16 on purpose: packing applies to bf16 only, and the claim is that
the product is bit-identical to the plain bf16 product (the same oneDNN kernel), so they
compare with `torch.equal`, not a tolerance. On a CPU whose oneDNN has no native bf16 nothing
is packed; the tests that need packing skip there, saying so, and the dispatch test checks
that the weights stay plain.
"""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dlm.engine.llm import LLM
from dlm.engine.quantized_weights import storage_bytes
from dlm.kernels import dispatch, packed_linear
from dlm.kernels.packed_linear import PackedLinearWeight, pack, supported
from tests.serving import in_process_server
from tests.tiny_families import tiny_names

CPU = torch.device("cpu")
PACKS = supported(torch.bfloat16, "cpu")
needs_packing = pytest.mark.skipif(
    not PACKS, reason="this CPU's oneDNN computes no native bf16, so dlm packs no weight here"
)


def weight(out: int, inputs: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(out, inputs, generator=g) / inputs**0.5).bfloat16()


@needs_packing
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(("out", "inputs"), [(3072, 1024), (1024, 2816), (619, 1024), (96, 64), (40, 24)])
def test_packed_product_is_the_plain_product(out: int, inputs: int, threads: int) -> None:
    """Every row count (one token to a batch of canvases), 2-D and 3-D inputs, with and
    without bias, at one and two threads: bit-identical to `F.linear` on the plain weight at
    the same thread count."""
    w, before = weight(out, inputs), torch.get_num_threads()
    packed = pack(w)
    bias = weight(1, out, seed=1)[0]
    torch.set_num_threads(threads)
    try:
        for rows in (1, 7, 64, 113, 300, 904):
            x = weight(rows, inputs, seed=rows)
            assert torch.equal(F.linear(x, packed), F.linear(x, w)), rows
            assert torch.equal(F.linear(x, packed, bias), F.linear(x, w, bias)), rows
            x3 = x.view(1, rows, inputs)
            assert torch.equal(F.linear(x3, packed), F.linear(x3, w)), rows
    finally:
        torch.set_num_threads(before)


@needs_packing
def test_a_packed_weight_stands_where_the_plain_one_stood(caplog: pytest.LogCaptureFixture) -> None:
    w = weight(96, 64)
    layer = nn.Linear(64, 96, bias=False)
    layer.weight = nn.Parameter(pack(w), requires_grad=False)  # as the loader sets it
    assert isinstance(layer.weight, PackedLinearWeight)
    assert layer.weight.shape == w.shape and layer.weight.dtype == torch.bfloat16
    assert "PackedLinearWeight(shape=(96, 64)" in repr(layer.weight)
    assert torch.equal(layer.weight.dense(), w)  # unpacking is exact
    assert storage_bytes(layer.weight) == w.nbytes  # no plain copy beside it
    assert packed_linear.layout_of(nn.Sequential(layer)) == "onednn-packed"  # what /health says
    assert packed_linear.layout_of(nn.Linear(64, 96)) == "dense"
    x = weight(5, 64, seed=2)
    with torch.inference_mode():
        assert torch.equal(layer(x), F.linear(x, w))
    with pytest.raises(NotImplementedError, match="view a packed linear weight"):
        layer.weight[:10]
    with caplog.at_level(logging.WARNING, logger="dlm.kernels"):
        assert torch.equal(layer.weight.float(), w.float())  # any other op: on the dense weight
        layer.weight.float()
    assert [r.getMessage() for r in caplog.records].count(
        "aten._to_copy.default on a packed linear weight: it is unpacked for each such call (slow)"
    ) == 1  # said once, never silently slow
    with pytest.raises(RuntimeError):  # a float input meets a bf16 weight as F.linear's would
        F.linear(x.float(), layer.weight)


def test_the_dispatch_packs_bf16_cpu_weights_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DLM_KERNELS", raising=False)
    w32 = torch.ones(8, 8)
    assert dispatch.linear_layout(torch.float32, CPU) == "dense"
    assert dispatch.prepare_linear_weight(w32) is w32  # fp32: MKL reads the plain layout
    assert dispatch.linear_layout(torch.bfloat16, torch.device("cuda")) == "dense"
    assert dispatch.linear_layout(torch.bfloat16, CPU) == ("onednn-packed" if PACKS else "dense")
    small, large = weight(64, 64), weight(1024, packed_linear.MIN_WEIGHTS // 1024)
    assert dispatch.prepare_linear_weight(small) is small  # where packing does not pay
    assert isinstance(dispatch.prepare_linear_weight(large), PackedLinearWeight) == PACKS
    monkeypatch.setenv("DLM_KERNELS", "torch")  # the twins everywhere
    assert dispatch.linear_layout(torch.bfloat16, CPU) == "dense"
    assert dispatch.prepare_linear_weight(large) is large


def packed_weights(llm: LLM) -> int:
    return sum(isinstance(p, PackedLinearWeight) for p in llm.engine.loaded.model.parameters())  # type: ignore[attr-defined]


@needs_packing
@pytest.mark.parametrize("name", tiny_names())
def test_every_family_decodes_the_same_ids_packed_and_plain(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The whole engine in bf16, loaded with packed weights (the default) and with plain ones
    (`DLM_KERNELS=torch`): the same ids and forwards, ragged prompts batched. Every linear
    layer is packed (none of the LM head, embeddings, routers or stacked experts)."""
    monkeypatch.setattr(packed_linear, "MIN_WEIGHTS", 0)  # tiny layers: pack them all the same
    prompts = [[5, 17, 42], [9, 8, 7, 6, 5, 4, 3]]
    outputs = {}
    for kernels in ("auto", "torch"):
        monkeypatch.setenv("DLM_KERNELS", kernels)
        with LLM(f"tiny:{name}", dtype="bfloat16", device="cpu") as llm:
            packed = packed_weights(llm)
            linears = sum(
                isinstance(m, nn.Linear) and not getattr(m, "keep_precision", False)
                for m in llm.engine.loaded.model.modules()  # type: ignore[attr-defined]
            )
            assert packed == (linears if kernels == "auto" else 0)
            assert linears > 0
            outputs[kernels] = [(o.output_ids, o.nfe) for o in llm.generate(prompts, gen_length=8)]
    assert outputs["auto"] == outputs["torch"]


@needs_packing
def test_a_server_serves_packed_weights_and_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    """Through HTTP (the server's app in this process): `/health` reports the packed layout,
    and a completion's ids equal those of a server whose weights are plain."""
    monkeypatch.setattr(packed_linear, "MIN_WEIGHTS", 0)  # tiny layers: pack them all the same
    answers, layouts = {}, {}
    for kernels in ("auto", "torch"):
        monkeypatch.setenv("DLM_KERNELS", kernels)
        with in_process_server(model="tiny:llada", dtype="bfloat16", device="cpu") as client:
            layouts[kernels] = client.get("/health").json()["kernels"]["linear"]
            body = {"prompt": "Write one sentence about the sea.", "max_tokens": 16, "return_token_ids": True}
            response = client.post("/v1/completions", json=body)
            assert response.status_code == 200, response.text
            answers[kernels] = response.json()["choices"][0]["token_ids"]
    assert layouts == {"auto": "onednn-packed", "torch": "dense"}
    assert answers["auto"] == answers["torch"]
