"""Fast-dLLM's approximate K/V caches for bidirectional dLLMs (LLaDA, Dream): prefix and dual.

In a bidirectional model every position's keys and values depend on every other position, so
no cache is exact while the canvas changes. Fast-dLLM's observation is that K/V outside the
block being denoised move little while that block is decoded. So the first step of each block
runs the whole canvas (the refresh, which also decides like any step) and keeps its K/V;
the block's later steps feed
- `prefix`: the block and everything after it, attending to the cached K/V before the block;
- `dual`: only the block, attending to the cached K/V before and after it.
The cost shows in `Sequence.nfe` and `Sequence.query_lengths` (tokens fed to each forward):
one full-length forward per block, then block-length (dual) or suffix-length (prefix) ones.

Keys are cached after RoPE (positions are absolute, so a cached key is exactly the key the
refresh computed), in each layer's KV-head layout [Hkv, T, D].
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from dlm.engine.runtime.kv_cache import tensor_bytes

if TYPE_CHECKING:
    from dlm.engine.runtime.sequence import Sequence

MODES = ("prefix", "dual")


@dataclass
class KVCache:
    """One request's cache, filled by the refresh forward of its current block."""

    keys: list[torch.Tensor] = field(default_factory=list)  # per layer [Hkv, T, D]
    values: list[torch.Tensor] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return tensor_bytes(self.keys + self.values)


@dataclass
class RowKV:
    """How one row of a batched forward meets its request's cache.

    Refresh rows feed the whole canvas and store the K/V of fed rows [0, keep). Other rows
    feed canvas[start:] (prefix) or canvas[start:end] (dual) and attend to the cached K/V
    before `start` and, for dual, after the fed rows."""

    cache: KVCache
    refresh: bool
    keep: int = 0
    start: int = 0


def plan(seq: Sequence) -> tuple[int, int, RowKV | None]:
    """The canvas span [first, end) the next forward of `seq` feeds, and its cache use."""
    mode, length = seq.params.cache, len(seq.canvas)
    if mode == "none":
        return 0, length, None
    start, end = seq.block_bounds()
    if seq.kv_cache is None:
        seq.kv_cache = KVCache()
    if seq.step_in_block == 0:
        seq.kv_cache.keys, seq.kv_cache.values = [], []
        return 0, length, RowKV(seq.kv_cache, refresh=True, keep=start if mode == "prefix" else length)
    return start, length if mode == "prefix" else end, RowKV(seq.kv_cache, refresh=False, start=start)


class BatchKV:
    """The key/value side of one batched forward: per row, its fed rows' K/V plus any cached
    K/V around them in position order from key 0, right-padded to one width, with the real
    keys per row (`kv_lens`) for the attention kernel. Refresh rows record their K/V."""

    def __init__(self, rows: list[RowKV | None], lengths: list[int], width: int) -> None:
        self.rows, self.lengths, self.width = rows, lengths, width
        self.reads = any(r is not None and not r.refresh for r in rows)

    def _pieces(self, r: int, fed: torch.Tensor, cached: torch.Tensor | None) -> list[torch.Tensor]:
        """Row r's keys (or values) in position order: cached before, fed, cached after."""
        row, n = self.rows[r], self.lengths[r]
        if row is None or row.refresh or cached is None:
            return [fed[:, :n]]
        return [cached[:, : row.start], fed[:, :n], cached[:, row.start + n :]]

    def keys_values(
        self, layer: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Keys, values and real keys per row (None = all) for layer `layer`."""
        for r, row in enumerate(self.rows):
            if row is not None and row.refresh:
                row.cache.keys.append(k[r, :, : row.keep].clone())
                row.cache.values.append(v[r, :, : row.keep].clone())
        if not self.reads:
            return k, v, _kv_lens(self.lengths, self.width, k.device)
        out = []
        for fed, store in ((k, "keys"), (v, "values")):
            pieces = [
                self._pieces(r, fed[r], getattr(row.cache, store)[layer] if row and not row.refresh else None)
                for r, row in enumerate(self.rows)
            ]
            if len(pieces) == 1:
                out.append(torch.cat(pieces[0], dim=1)[None])
                continue
            spans = [sum(p.shape[1] for p in row) for row in pieces]
            full = fed.new_zeros((len(pieces), fed.shape[1], max(spans), fed.shape[3]))
            for r, row_pieces in enumerate(pieces):
                offset = 0
                for piece in row_pieces:
                    full[r, :, offset : offset + piece.shape[1]] = piece
                    offset += piece.shape[1]
            out.append(full)
        spans = [out[0].shape[2]] if len(self.rows) == 1 else spans
        return out[0], out[1], _kv_lens(spans, out[0].shape[2], k.device)


def _kv_lens(spans: list[int], total: int, device: torch.device) -> torch.Tensor | None:
    """Real keys per row [B] (row r attends to its first `spans[r]` of `total` keys); None
    when nothing is hidden."""
    if all(s == total for s in spans):
        return None
    return torch.tensor(spans, device=device)
