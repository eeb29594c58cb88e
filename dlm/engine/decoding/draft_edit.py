"""Draft-and-edit decoding (LLaDA2.1): mask-to-token commits plus token-to-token edits.

LLaDA2.1 was trained to revise its own drafts, so besides filling MASK positions a step
may replace tokens it committed earlier in the current block. One step, given the block's
current ids and the model's top token and its probability at each generated position
(prompt positions are never decided, so never edited), as SGLang's `JointThreshold` runs it:

- fill (M2T): while the block holds MASK positions, every one whose top probability is
  strictly above `threshold`, or else the single most confident one;
- edit (T2T): every non-MASK position whose top token differs from its current token with
  probability strictly above `edit_threshold` (0 edits on any change);
- the block is finished when a step changes nothing, or when a step finds no MASK left
  after `max_post_edit_steps` such mask-free steps already ran (the edit budget).

A top token may be MASK itself: written, it leaves (or makes) the position masked again, as
in the reference. The caller bounds a block at `block_length + max_post_edit_steps + 1`
steps, the reference's limit, and ends it there whatever is left.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class EditStep:
    changed: torch.Tensor  # indices (into the decided positions) whose token becomes the top token
    finished: bool  # the block is done: nothing changed, or the edit budget is spent
    mask_free: bool  # the block held no MASK at this step (it spends one of the edit budget)


def draft_edit_step(
    current: torch.Tensor,
    tokens: torch.Tensor,
    conf: torch.Tensor,
    *,
    mask_id: int,
    threshold: float,
    edit_threshold: float,
    edits_left: int,
) -> EditStep:
    """current, tokens, conf [n]: the decided positions' ids, top tokens and top
    probabilities; `edits_left`: mask-free steps the block may still take."""
    masked = current == mask_id
    mask_free = not bool(masked.any())
    none = torch.empty(0, dtype=torch.long)
    if mask_free:
        if edits_left <= 0:
            return EditStep(none, True, True)
        fill = torch.zeros_like(masked)
    else:
        ranked = torch.where(masked, conf, torch.full_like(conf, float("-inf")))
        fill = ranked > threshold
        if not bool(fill.any()):
            fill[torch.topk(ranked, k=1).indices] = True
    edit = ~masked & (conf > edit_threshold) & (current != tokens)
    changed = (fill | edit).nonzero()[:, 0]
    return EditStep(changed, changed.numel() == 0, mask_free)
