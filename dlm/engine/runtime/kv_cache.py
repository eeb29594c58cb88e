"""SequenceKVCache: the exact block KV cache of one request, for block-causal families.

Block-causal models (LLaDA2, SDAR, openPangu) attend causally across blocks, so the keys
and values of a finished block never change: they are written once, by the forward that
commits the block, and every later forward only reads them. The cache stores the rotated
keys and the values of every layer for positions [0, length), grows by doubling as blocks
are committed (memory stays linear in the context, at most twice the live size), and is
never truncated: a 32K-token prompt simply grows it.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

INITIAL_CAPACITY = 256


def tensor_bytes(tensors: Iterable[torch.Tensor | None]) -> int:
    """Bytes of storage the given tensors (None: absent) view, counted as allocated."""
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


class SequenceKVCache:
    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.length = 0
        self._shape = (num_kv_heads, head_dim)
        self._dtype, self._device = dtype, device
        self._k: list[torch.Tensor | None] = [None] * num_layers
        self._v: list[torch.Tensor | None] = [None] * num_layers

    @property
    def num_layers(self) -> int:
        return len(self._k)

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Keys and values [H, length, D] of layer i, or None while the cache is empty."""
        k, v = self._k[i], self._v[i]
        if self.length == 0 or k is None or v is None:
            return None
        return k[:, : self.length], v[:, : self.length]

    def store(self, i: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write k/v [H, n, D] of layer i at positions [length, length + n); `advance`
        makes them visible once every layer has stored its part."""
        n = k.shape[1]
        need = self.length + n
        buf_k, buf_v = self._k[i], self._v[i]
        if buf_k is None or buf_v is None or buf_k.shape[1] < need:
            capacity = max(INITIAL_CAPACITY, need, 2 * (0 if buf_k is None else buf_k.shape[1]))
            heads, dim = self._shape
            new_k = torch.empty((heads, capacity, dim), dtype=self._dtype, device=self._device)
            new_v = torch.empty_like(new_k)
            if buf_k is not None and buf_v is not None and self.length:
                new_k[:, : self.length] = buf_k[:, : self.length]
                new_v[:, : self.length] = buf_v[:, : self.length]
            self._k[i], self._v[i] = buf_k, buf_v = new_k, new_v
        buf_k[:, self.length : need] = k
        buf_v[:, self.length : need] = v

    def advance(self, n: int) -> None:
        self.length += n

    @property
    def nbytes(self) -> int:
        """Bytes allocated (capacity, not only the live length)."""
        return tensor_bytes(self._k + self._v)
