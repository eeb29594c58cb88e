"""ForwardBatch: everything one model forward needs, built by the runner.

`select` names, per row, the positions whose final hidden states are wanted: a dLLM step
decides only the masked positions of the current block, so the last layer and the LM head
run only there. Rows are padded on the right; `key_mask` hides the padding.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [B, T] long
    positions: torch.Tensor  # [B, T] long, absolute position ids
    key_mask: torch.Tensor | None  # [B, T] bool, True = real token; None = no padding
    select: torch.Tensor  # [B, S] long, positions whose hidden states are returned

    @cached_property
    def kv_lens(self) -> torch.Tensor | None:
        """Real tokens per row (rows are right-padded), for attention; None = no padding."""
        return None if self.key_mask is None else self.key_mask.sum(1)


def gather_rows(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """x [B, T, ...], index [B, S] -> [B, S, ...]."""
    shape = index.shape + x.shape[2:]
    expanded = index.reshape(index.shape + (1,) * (x.dim() - 2)).expand(shape)
    return torch.gather(x, 1, expanded)
