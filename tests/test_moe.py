"""MoE routing, and the MoE layer (routed experts through `dlm.kernels.dispatch.fused_moe`)
against a naive per-token oracle, alone and split over ranks (what a rank reads from the
checkpoint: tests/test_tp_shards.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dlm.engine.layers.moe import SigmoidGroupGate, SoftmaxGate, SparseMoE, sigmoid_group_limited_route, softmax_route
from dlm.engine.parallel import state as parallel_state
from dlm.kernels import dispatch


def naive_sigmoid_route(logits, bias, top_k, n_group, topk_group, scaling):  # noqa: ANN001, ANN201
    """Token by token, as DeepSeek-V3/LLaDA2 describe it."""
    chosen, weights = [], []
    for row, b in zip(logits, bias.expand_as(logits)):
        s = torch.sigmoid(row)
        biased = s + b
        size = len(row) // n_group
        group_score = [sorted(biased[g * size : (g + 1) * size].tolist())[-2:] for g in range(n_group)]
        groups = sorted(range(n_group), key=lambda g: -sum(group_score[g]))[:topk_group]
        candidates = [e for g in groups for e in range(g * size, (g + 1) * size)]
        best = sorted(candidates, key=lambda e: -biased[e].item())[:top_k]
        w = s[best]  # unbiased scores, renormalised, scaled
        chosen.append(best)
        weights.append((w / w.sum() * scaling).tolist())
    return chosen, weights


def test_sigmoid_group_limited_route_matches_naive() -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(40, 16, generator=g) * 2
    bias = torch.randn(16, generator=g) * 0.5
    chosen, weights = sigmoid_group_limited_route(logits, bias, 4, 4, 2, 2.5, True)
    want_chosen, want_weights = naive_sigmoid_route(logits, bias, 4, 4, 2, 2.5)
    for t in range(40):
        assert chosen[t].tolist() == want_chosen[t]
        assert torch.allclose(weights[t], torch.tensor(want_weights[t]), atol=1e-6)
        # Group limiting: the experts come from at most topk_group groups.
        assert len({e // 4 for e in chosen[t].tolist()}) <= 2


def test_expert_bias_steers_selection_not_weights() -> None:
    logits = torch.zeros(1, 8)
    bias = torch.tensor([0, 0, 0, 0, 0, 0, 5.0, 5.0])
    chosen, weights = sigmoid_group_limited_route(logits, bias, 2, 1, 1, 1.0, True)
    assert sorted(chosen[0].tolist()) == [6, 7]
    assert torch.allclose(weights, torch.full((1, 2), 0.5))  # sigmoid(0) each, renormalised


def test_softmax_route() -> None:
    logits = torch.tensor([[0.0, 2.0, 1.0, -1.0]])
    chosen, weights = softmax_route(logits, 2, True)
    assert chosen[0].tolist() == [1, 2]
    p = torch.softmax(logits[0], -1)[[1, 2]]
    assert torch.allclose(weights[0], p / p.sum())


def _naive_moe(moe: SparseMoE, x: torch.Tensor) -> torch.Tensor:
    """Token by token, expert by expert, from the stacked weights."""
    experts, f = moe.experts, moe.experts.intermediate_size
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        chosen, weights = moe.gate(x[t : t + 1])
        for e, w in zip(chosen[0].tolist(), weights[0]):
            gate_up = experts.gate_up_proj[e] @ x[t]
            out[t] += w * (experts.down_proj[e] @ (F.silu(gate_up[:f]) * gate_up[f:]))
        if moe.shared_experts is not None:
            out[t] += moe.shared_experts(x[t : t + 1])[0]
        if moe.shared_expert is not None:
            out[t] += torch.sigmoid(moe.shared_expert_gate(x[t : t + 1]))[0] * moe.shared_expert(x[t : t + 1])[0]
    return out


def _init(module: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)


KINDS = ["llada2", "qwen3", "qwen3_5"]  # sigmoid-group + shared; softmax; softmax + gated shared


def _moe(kind: str, d: int = 24, experts: int = 8, ffn: int = 16) -> SparseMoE:
    gate = (
        SigmoidGroupGate(d, experts, 2, 4, 2, 2.5, True, bias=True)
        if kind == "llada2"
        else SoftmaxGate(d, experts, 2, True)
    )
    return SparseMoE(gate, d, ffn, experts, shared_ffn=0 if kind == "qwen3" else 16, gated_shared=kind == "qwen3_5")


@pytest.mark.parametrize("kind", KINDS)
def test_sparse_moe_matches_per_token_oracle_through_one_fused_moe_call(
    kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    moe = _moe(kind)
    _init(moe, 1)
    x = torch.randn(50, 24, generator=torch.Generator().manual_seed(2))
    calls = []
    real = dispatch.fused_moe
    monkeypatch.setattr(dispatch, "fused_moe", lambda *a: calls.append(a) or real(*a))
    with torch.no_grad():
        got = moe(x[None])[0]
    # All (token, slot) pairs in one call, with the layer's stacked weights.
    assert len(calls) == 1 and calls[0][1] is moe.experts.gate_up_proj and calls[0][3].shape == (50, 2)
    with torch.no_grad():
        want = _naive_moe(moe, x)
    assert torch.allclose(got, want, atol=1e-5)


@pytest.mark.parametrize("kind", KINDS)
def test_sparse_moe_same_through_triton_and_torch(kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    moe = _moe(kind)
    _init(moe, 3)
    x = torch.randn(1, 37, 24, generator=torch.Generator().manual_seed(4))
    outs, backends = [], []
    real = dispatch.implementation
    monkeypatch.setattr(
        dispatch, "implementation", lambda n, dev: backends.append(dispatch.backend(dev)) or real(n, dev)
    )
    for choice in ("torch", "triton"):
        monkeypatch.setenv("DLM_KERNELS", choice)
        with torch.no_grad():
            outs.append(moe(x))
    assert backends == ["torch", "triton"]
    assert torch.allclose(outs[0], outs[1], atol=1e-5)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(("ranks", "mode"), [(2, "ep"), (4, "ep"), (2, "tp"), (4, "tp")])
def test_ranks_partial_sums_add_up_to_the_layer(
    kind: str, ranks: int, mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each rank's layer (its experts, or its slice of every expert, and its slice of the
    shared expert), with the weights a rank loads, gives a partial output; the all-reduce
    (here: a sum in this process) gives the single-process layer's output."""
    whole = _moe(kind)
    _init(whole, 5)
    x = torch.randn(1, 30, 24, generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        want = whole(x)
    monkeypatch.setattr(parallel_state, "all_reduce", lambda t: t)  # each rank's partial sum
    total = torch.zeros_like(want)
    f, sf = whole.experts.intermediate_size, 16
    for rank in range(ranks):
        with parallel_state.using(parallel_state.TPState(rank=rank, size=ranks, moe=mode)):
            part = _moe(kind)
            assert part.experts.placement == mode
            state = {}
            for name, p in whole.state_dict().items():
                if name == "experts.gate_up_proj" and mode == "ep":
                    per = 8 // ranks
                    state[name] = p[rank * per : (rank + 1) * per]
                elif name == "experts.down_proj" and mode == "ep":
                    state[name] = p[rank * (8 // ranks) : (rank + 1) * (8 // ranks)]
                elif name == "experts.gate_up_proj":
                    i = slice(rank * f // ranks, (rank + 1) * f // ranks)
                    state[name] = torch.cat((p[:, i], p[:, f:][:, i]), dim=1)
                elif name == "experts.down_proj":
                    state[name] = p[:, :, rank * f // ranks : (rank + 1) * f // ranks]
                elif name.endswith("gate_up_proj.weight"):  # shared expert: column-parallel
                    i = slice(rank * sf // ranks, (rank + 1) * sf // ranks)
                    state[name] = torch.cat((p[i], p[sf:][i]))
                elif name.endswith("down_proj.weight"):  # row-parallel
                    state[name] = p[:, rank * sf // ranks : (rank + 1) * sf // ranks]
                else:
                    state[name] = p  # routers, the shared expert's gate: replicated
            part.load_state_dict(state)
            with torch.no_grad():
                total += part(x)
    assert torch.allclose(total, want, atol=1e-5)


def test_sparse_moe_handles_no_tokens() -> None:
    moe = _moe("llada2")
    _init(moe, 7)
    with torch.no_grad():
        assert moe(torch.empty(1, 0, 24)).shape == (1, 0, 24)
