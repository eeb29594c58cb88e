"""ForwardBatch: everything one model forward needs, built by the runner.

`select` names, per row, the positions whose final hidden states are wanted: a dLLM step
decides only the masked positions of the current block, so the last layer and the LM head
run only there. Rows are padded on the right; `key_mask` hides the padding.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [B, T] long
    positions: torch.Tensor  # [B, T] long, absolute position ids
    key_mask: torch.Tensor | None  # [B, T] bool, True = real token; None = no padding
    select: torch.Tensor  # [B, S] long, positions whose hidden states are returned

    @property
    def attn_mask(self) -> torch.Tensor | None:
        """Boolean SDPA mask [B, 1, 1, T] for bidirectional attention over real tokens."""
        return None if self.key_mask is None else self.key_mask[:, None, None, :]


def gather_rows(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """x [B, T, ...], index [B, S] -> [B, S, ...]."""
    shape = index.shape + x.shape[2:]
    expanded = index.reshape(index.shape + (1,) * (x.dim() - 2)).expand(shape)
    return torch.gather(x, 1, expanded)
