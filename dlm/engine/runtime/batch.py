"""ForwardBatch: everything one model forward needs, built by the runner.

Rows are the tokens fed to the model (a whole canvas, or with an approximate cache only the
block / the suffix being denoised), padded on the right. `select` names, per row, the fed
rows whose final hidden states are wanted: a dLLM step decides only the masked positions of
the current block, so the last layer and the LM head run only there. Keys come from the fed
rows, hidden by `key_mask` where padded (as `kv_lens`, real keys per row), or, when `kv` is set,
from a per-row K/V cache around them (dlm/engine/runtime/cache.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from dlm.engine.runtime.cache import BatchKV


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [B, T] long
    positions: torch.Tensor  # [B, T] long, absolute position ids
    key_mask: torch.Tensor | None  # [B, T] bool, True = real token; None = no padding
    select: torch.Tensor  # [B, S] long, fed rows whose hidden states are returned
    kv: BatchKV | None = None  # cached keys around the fed rows; None = keys are the fed rows

    @cached_property
    def kv_lens(self) -> torch.Tensor | None:
        """Real tokens per row (rows are right-padded), for attention; None = no padding."""
        return None if self.key_mask is None else self.key_mask.sum(1)

    def keys_values(
        self, layer: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Keys, values and real keys per row (`kv_lens`, None = all) layer `layer` attends
        over, given the fed rows' k/v [B, H, T, D]."""
        if self.kv is None:
            return k, v, self.kv_lens
        return self.kv.keys_values(layer, k, v)


def gather_rows(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """x [B, T, ...], index [B, S] -> [B, S, ...]."""
    shape = index.shape + x.shape[2:]
    expanded = index.reshape(index.shape + (1,) * (x.dim() - 2)).expand(shape)
    return torch.gather(x, 1, expanded)
