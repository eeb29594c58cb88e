"""MoE routing and grouped expert dispatch against a naive per-token oracle."""
from __future__ import annotations

import pytest
import torch

from engine.layers.mlp import GatedMLP
from engine.layers.moe import (
    SigmoidGroupGate, SoftmaxGate, SparseMoE, grouped_experts, sigmoid_group_limited_route, softmax_route,
)


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
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        chosen, weights = moe.gate(x[t : t + 1])
        for e, w in zip(chosen[0].tolist(), weights[0]):
            out[t] += w * moe.experts[e](x[t : t + 1])[0]
        if moe.shared_experts is not None:
            out[t] += moe.shared_experts(x[t : t + 1])[0]
    return out


def _init(module: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)


@pytest.mark.parametrize("kind", ["llada2", "qwen3"])
def test_sparse_moe_matches_per_token_oracle_and_groups_tokens(kind: str) -> None:
    d, experts = 24, 8
    gate = (SigmoidGroupGate(d, experts, 2, 4, 2, 2.5, True, bias=True) if kind == "llada2"
            else SoftmaxGate(d, experts, 2, True))
    moe = SparseMoE(gate, d, 16, experts, shared_ffn=16 if kind == "llada2" else 0)
    _init(moe, 1)
    x = torch.randn(50, d, generator=torch.Generator().manual_seed(2))
    calls = []
    hooks = [e.register_forward_hook(lambda m, i, o: calls.append(i[0].shape[0])) for e in moe.experts]
    with torch.no_grad():
        got = moe(x[None])[0]
    for h in hooks:
        h.remove()
    # One call per used expert over all its (token, slot) rows, never one per token.
    assert len(calls) <= experts and sum(calls) == 50 * 2
    with torch.no_grad():
        want = _naive_moe(moe, x)
    assert torch.allclose(got, want, atol=1e-5)


def test_grouped_experts_handles_no_tokens() -> None:
    experts = torch.nn.ModuleList(GatedMLP(4, 8) for _ in range(3))
    out = grouped_experts(torch.empty(0, 4), torch.empty(0, 2, dtype=torch.long), torch.empty(0, 2), experts)
    assert out.shape == (0, 4)
