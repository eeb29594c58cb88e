"""BlockBatch: one forward of a block-causal model, with or without the exact KV cache.

Each row feeds a run of consecutive positions (`input_ids`, absolute `positions`): already
decided context still to be cached, and/or the block being denoised. Visibility is given
by `groups`: a query sees a fed key iff the key's group is <= its own, and always sees
every cached position. Groups are nondecreasing along a row, so one rule covers every mask
the families use: block-causal context (group = block start), causal context (group =
position), the denoised block (one group: full attention inside it), and right padding
(group PAD: seen by nobody else).

Rows may write their first `write[r]` fed positions into their cache (committing context);
the denoised block is never written, so its MASK tokens never reach the cache.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from dlm.engine.layers.attention import attention
from dlm.engine.runtime.batch import gather_rows
from dlm.engine.runtime.kv_cache import SequenceKVCache

PAD_GROUP = 2**62


@dataclass
class BlockBatch:
    input_ids: torch.Tensor  # [B, T] long
    positions: torch.Tensor  # [B, T] long, absolute position ids
    groups: torch.Tensor  # [B, T] long, visibility groups (see module docstring)
    select: torch.Tensor  # [B, S] long, rows whose final hidden states are returned
    caches: list[SequenceKVCache] | None = None  # one per row, or None (recompute)
    write: list[int] = field(default_factory=list)  # per row: leading fed positions to cache
    _masks: dict[bool, torch.Tensor | None] = field(default_factory=dict, repr=False)

    def _mask(self, selected: bool, past: list[int]) -> torch.Tensor | None:
        """Boolean [B, 1, Tq, L + T] mask, or None when every query sees every key."""
        if selected not in self._masks:
            q_groups = gather_rows(self.groups, self.select) if selected else self.groups
            # Padding queries see what the row's last real query sees, never padding keys:
            # so the keys any query of a row sees are exactly those it would see alone.
            real = self.groups.masked_fill(self.groups == PAD_GROUP, -1).amax(dim=1, keepdim=True)
            q_groups = torch.where(q_groups == PAD_GROUP, real, q_groups)
            fresh = self.groups[:, None, :] <= q_groups[:, :, None]
            if past:
                width = max(past)
                valid = (
                    torch.arange(width, device=fresh.device)[None, :] < torch.tensor(past, device=fresh.device)[:, None]
                )
                fresh = torch.cat((valid[:, None, :].expand(-1, fresh.shape[1], -1), fresh), dim=2)
            self._masks[selected] = None if bool(fresh.all()) else fresh[:, None]
        return self._masks[selected]

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, selected: bool) -> torch.Tensor:
        """q [B, Hq, Tq, D] (all fed rows, or the `select` rows when `selected`),
        k/v [B, Hkv, T, D] of the fed positions, rotated. Attends over cache + fed keys and
        stores the rows' `write` prefixes in their caches."""
        keys, values, past = k, v, []
        if self.caches is not None:
            stored = [c.layer(layer) for c in self.caches]
            past = [0 if s is None else s[0].shape[1] for s in stored]
            if max(past) > 0:
                keys, values = _prepend(stored, past, k, v)
            else:
                past = []
            for r, cache in enumerate(self.caches):
                if self.write[r]:
                    cache.store(layer, k[r, :, : self.write[r]], v[r, :, : self.write[r]])
        if q.shape[2] == 0:
            return q.new_empty(q.shape[:3] + (v.shape[-1],))
        return attention(q, keys, values, None, mask=self._mask(selected, past))


def _prepend(
    stored: list[tuple[torch.Tensor, torch.Tensor] | None],
    past: list[int],
    k: torch.Tensor,
    v: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Cached keys/values (left, padded to the longest cache) followed by the fed ones."""
    if len(stored) == 1:
        pk, pv = stored[0]  # type: ignore[misc]
        return torch.cat((pk[None], k), dim=2), torch.cat((pv[None], v), dim=2)
    b, h, t, d = k.shape
    width = max(past)
    keys = k.new_zeros((b, h, width + t, d))
    values = v.new_zeros((b, h, width + t, v.shape[-1]))
    for r, s in enumerate(stored):
        if s is not None:
            keys[r, :, : past[r]], values[r, :, : past[r]] = s
    keys[:, :, width:], values[:, :, width:] = k, v
    return keys, values
