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
# int8 storage (`--kv-cache-dtype int8`, dlm.engine.quantization.KV_CACHE_DTYPES): each
# position's head vector scaled by its absmax / 127 (the scale kept in float32), 1 + 4/head_dim
# bytes a value instead of 2 (bf16) or 4 (fp32), for contexts that would not fit otherwise (the
# deployment guides' KV-cache quantization), at the price of rounding every cached key and
# value (answers may differ from the model dtype's).
INT8_MAX = 127.0


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
        storage: str = "auto",
    ) -> None:
        """`storage`: one of `dlm.engine.quantization.KV_CACHE_DTYPES`."""
        self.length = 0
        self._shape = (num_kv_heads, head_dim)
        self._dtype, self._device = dtype, device
        self.quantized = storage == "int8"
        self._k: list[torch.Tensor | None] = [None] * num_layers
        self._v: list[torch.Tensor | None] = [None] * num_layers
        # int8 storage: each position's scale per head [H, capacity, 1] (None otherwise)
        self._k_scale: list[torch.Tensor | None] = [None] * num_layers
        self._v_scale: list[torch.Tensor | None] = [None] * num_layers

    @property
    def num_layers(self) -> int:
        return len(self._k)

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Keys and values [H, length, D] of layer i in the model's dtype (int8 storage:
        dequantized, a copy), or None while the cache is empty."""
        k, v = self._k[i], self._v[i]
        if self.length == 0 or k is None or v is None:
            return None
        n = self.length
        if not self.quantized:
            return k[:, :n], v[:, :n]
        k_scale, v_scale = self._k_scale[i], self._v_scale[i]
        assert k_scale is not None and v_scale is not None
        return _dequantize(k[:, :n], k_scale[:, :n], self._dtype), _dequantize(v[:, :n], v_scale[:, :n], self._dtype)

    def store(self, i: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write k/v [H, n, D] of layer i at positions [length, length + n); `advance`
        makes them visible once every layer has stored its part."""
        n = k.shape[1]
        need = self.length + n
        buf_k = self._k[i]
        if buf_k is None or buf_k.shape[1] < need:
            capacity = max(INITIAL_CAPACITY, need, 2 * (0 if buf_k is None else buf_k.shape[1]))
            self._grow(i, capacity)
        span = slice(self.length, need)
        buf_k, buf_v = self._k[i], self._v[i]
        assert buf_k is not None and buf_v is not None
        if not self.quantized:  # every forward of every layer: two copies, nothing more
            buf_k[:, span] = k
            buf_v[:, span] = v
            return
        k_scale, v_scale = self._k_scale[i], self._v_scale[i]
        assert k_scale is not None and v_scale is not None
        buf_k[:, span], k_scale[:, span] = _quantize(k)
        buf_v[:, span], v_scale[:, span] = _quantize(v)

    def _grow(self, i: int, capacity: int) -> None:
        """Layer i's buffers at `capacity` positions, the live ones copied over."""
        heads, dim = self._shape
        storage = torch.int8 if self.quantized else self._dtype
        for buffers, scales in ((self._k, self._k_scale), (self._v, self._v_scale)):
            old = buffers[i]
            new = torch.empty((heads, capacity, dim), dtype=storage, device=self._device)
            if old is not None and self.length:
                new[:, : self.length] = old[:, : self.length]
            buffers[i] = new
            if self.quantized:
                old_scale = scales[i]
                scale = torch.empty((heads, capacity, 1), dtype=torch.float32, device=self._device)
                if old_scale is not None and self.length:
                    scale[:, : self.length] = old_scale[:, : self.length]
                scales[i] = scale

    def advance(self, n: int) -> None:
        self.length += n

    @property
    def nbytes(self) -> int:
        """Bytes allocated (capacity, not only the live length), scales included."""
        return tensor_bytes(self._k + self._v + self._k_scale + self._v_scale)


def _quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [H, n, D] as int8 with one scale per head and position ([H, n, 1], float32)."""
    scale = x.detach().abs().amax(dim=-1, keepdim=True).float() / INT8_MAX
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero vector stays zero
    return torch.round(x.float() / scale).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8), scale


def _dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (q.float() * scale).to(dtype)
