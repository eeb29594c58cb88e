"""Mixture-of-experts feed-forward, one layer for every MoE family: a router, the routed
experts stacked and run by `dlm.kernels.dispatch.fused_moe`, an optional shared expert.

The pieces that differ between families are small strategies:
- Routers. LLaDA2 (DeepSeek-V3 style, `SigmoidGroupGate`): sigmoid scores; selection on
  scores + expert bias, limited to the `topk_group` groups (of `n_group`) with the largest
  sum of their two best biased scores; weights are the *unbiased* scores of the chosen
  experts, renormalised, times `routed_scaling_factor` (kept in fp32). Qwen3-MoE (SDAR-MoE)
  and Qwen3.5-MoE (`SoftmaxGate`): softmax over expert logits, top-k, optional
  renormalisation, weights cast to the activation dtype as the reference code does.
- Shared expert: none (Qwen3-MoE), `shared_experts` added unweighted (LLaDA2), or
  `shared_expert` scaled by sigmoid(`shared_expert_gate`) (Qwen3.5-MoE), named as in the
  checkpoints.

The routed experts are stacked, `experts.gate_up_proj` [E, 2I, d] (gate rows then up rows)
and `experts.down_proj` [E, d, I]: the fused MoE kernel's layout, and how transformers holds
Qwen3.5-MoE experts. Checkpoints keep one tensor per expert and projection
(`experts.3.gate_proj.weight`) or the stacked tensors; `expert_sources` names the tensors of
this rank's experts and the loader concatenates them into the stacked parameter.

Across tensor-parallel ranks (activations are replicated, so every rank routes every token
identically with the replicated router) `expert_placement` decides what a rank holds:
expert parallelism gives it whole experts (the others' slots are passed to the kernel as
"held elsewhere" and add nothing), tensor-parallel experts give it a slice of every expert's
intermediate features. Either way each rank produces a partial sum of the routed (and
shared) experts' output, and one all-reduce per layer combines them.
"""

from __future__ import annotations

from collections.abc import Collection

import torch
import torch.nn.functional as F
from torch import nn

from dlm.engine.config import ModelConfig
from dlm.engine.layers.linear import split
from dlm.engine.layers.mlp import GatedMLP
from dlm.engine.loader import Index, Shard
from dlm.engine.parallel import state as parallel_state
from dlm.kernels import dispatch


def sigmoid_group_limited_route(
    logits: torch.Tensor,
    expert_bias: torch.Tensor | None,
    top_k: int,
    n_group: int,
    topk_group: int,
    scaling: float,
    renormalize: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] fp32 -> (experts [T, k], weights [T, k] fp32)."""
    scores = torch.sigmoid(logits)
    biased = scores if expert_bias is None else scores + expert_bias.float()
    tokens, experts = biased.shape
    if n_group > 1:
        grouped = biased.view(tokens, n_group, experts // n_group)
        group_scores = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(-1)
        keep = torch.zeros_like(group_scores, dtype=torch.bool)
        keep.scatter_(1, group_scores.topk(topk_group, dim=-1, sorted=False).indices, True)
        keep = keep[:, :, None].expand_as(grouped).reshape(tokens, experts)
        biased = biased.masked_fill(~keep, float("-inf"))
    chosen = biased.topk(top_k, dim=-1).indices
    weights = scores.gather(1, chosen)
    if renormalize and top_k > 1:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return chosen, weights * scaling


def softmax_route(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] -> (experts [T, k], weights [T, k] fp32)."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, chosen = probs.topk(top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(-1, keepdim=True)
    return chosen, weights


class SigmoidGroupGate(nn.Module):
    """LLaDA2's router: `gate.weight` [E, d] and `gate.expert_bias` [E] as in the checkpoint."""

    def __init__(
        self,
        hidden: int,
        experts: int,
        top_k: int,
        n_group: int,
        topk_group: int,
        scaling: float,
        renormalize: bool,
        bias: bool,
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(experts, hidden))
        self.expert_bias = nn.Parameter(torch.empty(experts)) if bias else None
        self.top_k, self.n_group, self.topk_group = top_k, n_group, topk_group
        self.scaling, self.renormalize = scaling, renormalize

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = F.linear(x.float(), self.weight.float())  # the router runs in fp32
        return sigmoid_group_limited_route(
            logits,
            self.expert_bias,
            self.top_k,
            self.n_group,
            self.topk_group,
            self.scaling,
            self.renormalize,
        )


class SoftmaxGate(nn.Module):
    """The Qwen3-MoE / Qwen3.5-MoE router: `gate.weight` [E, d]."""

    def __init__(self, hidden: int, experts: int, top_k: int, renormalize: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(experts, hidden))
        self.top_k, self.renormalize = top_k, renormalize

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        chosen, weights = softmax_route(F.linear(x, self.weight), self.top_k, self.renormalize)
        return chosen, weights.to(x.dtype)


def expert_placement(num_experts: int, expert_ffn: int) -> tuple[str, range]:
    """How this rank holds a layer's experts: ("single", all) outside tensor parallelism,
    ("ep", its experts) or ("tp", all, each split). `auto` picks expert parallelism when
    the experts divide evenly over the ranks, tensor-parallel experts otherwise."""
    tp = parallel_state.current()
    if tp.size == 1:
        return "single", range(num_experts)
    mode = tp.moe
    if mode == "auto":
        mode = "ep" if num_experts % tp.size == 0 else "tp"
    if mode == "ep":
        return "ep", range(*split(num_experts, "the number of experts"))
    split(expert_ffn, "the expert intermediate size")
    return "tp", range(num_experts)


# Stacked parameter -> the per-expert checkpoint projections it concatenates.
PER_EXPERT = {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}


class FusedExperts(nn.Module):
    """This rank's routed experts, stacked: `gate_up_proj` [local E, 2 * local I, d] and
    `down_proj` [local E, d, local I] (`intermediate_size` is the local I)."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.placement, self.local = expert_placement(num_experts, intermediate_size)
        full = intermediate_size
        i0, i1 = split(full, "the expert intermediate size") if self.placement == "tp" else (0, full)
        self.intermediate_size = i1 - i0
        self.gate_up_proj = nn.Parameter(torch.empty(len(self.local), 2 * self.intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(len(self.local), hidden_size, self.intermediate_size))
        for param in (self.gate_up_proj, self.down_proj):
            # Per-expert sources arrive concatenated along dim 0: restore the expert axis.
            param.weight_loader = lambda p, t: t.reshape(p.shape)  # type: ignore[attr-defined]
            param.stacked_experts = True  # type: ignore[attr-defined]  # quantized expert by expert
        if self.placement == "single":
            return
        experts = slice(self.local.start, self.local.stop)

        def gate_up(i: int, shape: tuple[int, ...]) -> list[Index]:
            if len(shape) == 3:  # stacked on disk [E, 2I, d]: this rank's experts / gate and up rows
                if self.placement == "ep":
                    return [(experts,)]
                return [(slice(None), slice(i0, i1)), (slice(None), slice(full + i0, full + i1))]
            return [(slice(i0, i1),)]  # one [I, d] tensor per expert and projection

        def down(i: int, shape: tuple[int, ...]) -> list[Index]:
            if len(shape) == 3:  # [E, d, I]
                return [(experts,)] if self.placement == "ep" else [(slice(None), slice(None), slice(i0, i1))]
            return [(slice(None), slice(i0, i1))]  # [d, I] per expert

        # Per-expert sources are concatenated on dim 0 (then reshaped by weight_loader);
        # the gate and up rows of a stacked tensor on dim 1.
        self.gate_up_proj.shard = Shard(gate_up, lambda shape: 1 if len(shape) == 3 else 0)  # type: ignore[attr-defined]
        self.down_proj.shard = Shard(down)  # type: ignore[attr-defined]
        if self.placement == "tp":
            self.down_proj.split_inputs = full  # type: ignore[attr-defined]  # quantized as whole rows

    def sources(self, stem: str, attr: str, available: Collection[str]) -> list[str]:
        """Checkpoint tensors of parameter `attr` for experts at checkpoint path `stem`
        (`...mlp.experts`): the stacked tensor when the checkpoint has it, else one tensor
        per local expert and projection, in concatenation order."""
        stacked = f"{stem}.{attr}"
        if stacked in available:
            return [stacked]
        return [f"{stem}.{e}.{part}.weight" for e in self.local for part in PER_EXPERT[attr]]

    def forward(self, x: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x [N, d]; chosen/weights [N, k]: each token's experts (global ids) and weights.
        Only this rank's experts run; the others' contributions come with the reduce."""
        if self.placement == "ep":
            held = len(self.local)
            chosen = chosen - self.local.start
            chosen = chosen.masked_fill((chosen < 0) | (chosen >= held), held)  # held elsewhere
        return dispatch.fused_moe(x, self.gate_up_proj, self.down_proj, chosen, weights)


def expert_sources(
    model: nn.Module,
    name: str,
    available: Collection[str],
    checkpoint_name: str | None = None,
) -> list[str] | None:
    """The loader's `tensor_sources` for stacked experts: the checkpoint tensors of model
    parameter `name` (whose checkpoint name is `checkpoint_name`, by default `name`) when it
    belongs to a `FusedExperts`, else None (the default rule applies)."""
    owner, _, attr = name.rpartition(".")
    experts = model.get_submodule(owner)
    if not isinstance(experts, FusedExperts):
        return None
    return experts.sources((checkpoint_name or name).rpartition(".")[0], attr, available)


class SparseMoE(nn.Module):
    """`gate`, `experts` and the shared expert, named as in the checkpoints: with
    `shared_ffn` and `gated_shared`, `shared_expert` + `shared_expert_gate` (Qwen);
    with `shared_ffn` alone, `shared_experts` (LLaDA2)."""

    def __init__(
        self,
        gate: nn.Module,
        hidden: int,
        expert_ffn: int,
        num_experts: int,
        shared_ffn: int = 0,
        gated_shared: bool = False,
    ) -> None:
        super().__init__()
        self.gate = gate  # replicated: every rank routes every token the same way
        self.experts = FusedExperts(num_experts, hidden, expert_ffn)
        shared = GatedMLP(hidden, shared_ffn, reduce=False) if shared_ffn else None
        self.shared_experts = None if gated_shared else shared
        self.shared_expert = shared if gated_shared else None
        # Replicated, like the router, and like it kept in the model dtype under quantization.
        self.shared_expert_gate = nn.Linear(hidden, 1, bias=False) if shared is not None and gated_shared else None
        if self.shared_expert_gate is not None:
            self.shared_expert_gate.keep_precision = True  # type: ignore[assignment]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        chosen, weights = self.gate(flat)
        out = self.experts(flat, chosen, weights)
        if self.shared_experts is not None:
            out = out + self.shared_experts(flat)
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(flat)) * self.shared_expert(flat)
        return parallel_state.all_reduce(out).view(x.shape)


def feed_forward(config: ModelConfig, index: int) -> nn.Module:
    """Layer `index`'s MLP as `config.moe` places and describes it: the family's router,
    routed experts and shared expert, or the dense SwiGLU MLP."""
    moe, d = config.moe, config.hidden_size
    if moe is None or index not in moe.layers:
        return GatedMLP(d, config.intermediate_size)
    gate: nn.Module
    if moe.router == "sigmoid_group":
        gate = SigmoidGroupGate(
            d,
            moe.num_experts,
            moe.top_k,
            moe.n_group,
            moe.topk_group,
            moe.routed_scaling_factor,
            moe.norm_topk_prob,
            moe.router_bias,
        )
    else:
        gate = SoftmaxGate(d, moe.num_experts, moe.top_k, moe.norm_topk_prob)
    return SparseMoE(gate, d, moe.expert_ffn, moe.num_experts, moe.shared_ffn, gated_shared=moe.shared_gate)
