"""Block diffusion: what distinguishes the block-causal families, and their commit rules.

A block-causal model decodes block by block; inside a block each denoising step commits
some MASK positions. The families agree on the loop and differ in a few declared rules
(`BlockRules`), so one runner serves them all:

- LLaDA2 (dInfer) and SDAR put blocks on an absolute grid (the first decoded block starts
  at floor(P/B)*B and re-encodes the prompt's tail), attend block-causally to the context,
  and read position i's prediction from output row i.
- openPangu starts blocks right after the prompt, attends causally to the context (its
  prompt is prefilled and its blocks committed with a causal mask), and shifts logits:
  row i predicts token i+1, so a block's first token is predicted by the commit forward of
  the previous block (or the prefill) and the block is denoised in sub-blocks.

Commit rules (all take the confidences and tokens of the eligible positions):
- static low-confidence: the `k` most confident (SDAR `low_confidence_static`; the default
  without a threshold);
- dInfer's threshold (LLaDA2): every position whose argmax is not MASK and whose confidence
  is >= min(max_conf - 1e-5, threshold), so at least the most confident one;
- dynamic threshold (SDAR `low_confidence_dynamic`, openPangu `confidence_threshold`): all
  with confidence strictly > threshold if there are at least `k` of them, else the top k.

Whatever the rule, `steps` bounds the denoising steps: the last step of a (sub-)block's share
commits every position left in it, as the static schedule does by construction.
"""

from __future__ import annotations

import torch

from dlm.engine.params import GenerationParams
from dlm.engine.registry import BlockRules


def static_top_k(conf: torch.Tensor, k: int) -> torch.Tensor:
    return torch.topk(conf, k=max(1, min(k, conf.numel()))).indices


def dinfer_threshold(conf: torch.Tensor, tokens: torch.Tensor, threshold: float, mask_id: int) -> torch.Tensor:
    """dInfer's `get_transfer_index_threshold` (temperature 0): positions predicting MASK
    are not eligible; commit every eligible one with conf >= min(max - 1e-5, threshold)."""
    eligible = torch.where(tokens != mask_id, conf, torch.full_like(conf, float("-inf")))
    best = eligible.max()
    if not torch.isfinite(best):  # every argmax is MASK: take the most confident anyway
        return static_top_k(conf, 1)
    cut = max(min(best.item() - 1e-5, threshold), -1000.0)
    return (eligible >= cut).nonzero()[:, 0]


def dynamic_threshold(conf: torch.Tensor, threshold: float, k: int) -> torch.Tensor:
    """SDAR's `low_confidence_dynamic`: strict `>`; fall back to the top k when fewer pass."""
    high = (conf > threshold).nonzero()[:, 0]
    if high.numel() >= max(1, min(k, conf.numel())):
        return high
    return static_top_k(conf, k)


def choose(
    params: GenerationParams,
    rules: BlockRules,
    conf: torch.Tensor,
    tokens: torch.Tensor,
    scheduled: int,
    mask_id: int,
    last: bool = False,
) -> torch.Tensor:
    """Indices (into conf) of the positions to commit at this step; `last`: the step spends
    the last of the (sub-)block's share of `steps`, so every position left is committed."""
    if last:
        return torch.arange(conf.numel())
    if params.threshold is None:
        return static_top_k(conf, scheduled)
    if rules.threshold_rule == "dinfer":
        return dinfer_threshold(conf, tokens, params.threshold, mask_id)
    return dynamic_threshold(conf, params.threshold, scheduled)
