"""Peak bytes of live tensors created inside a block of torch code, on any device.

CPU has no allocator statistics like `torch.cuda.max_memory_allocated`, and tracemalloc does
not see torch's allocations, so this counts them at the dispatcher: every op output whose
storage is not one of the op's inputs' is a new allocation, released when the last tensor
viewing it is collected. It measures what the code asks for (tensor storages), not allocator
overhead or kernel-internal scratch; the same on CPU and CUDA.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class PeakTensorMemory(TorchDispatchMode):
    """`with PeakTensorMemory() as m: ...` then `m.peak` (bytes above what existed before)."""

    def __init__(self) -> None:
        super().__init__()
        self.current = 0
        self.peak = 0
        self._views: dict[int, int] = {}  # storage address -> live tensors viewing it

    def _release(self, address: int, nbytes: int) -> None:
        self._views[address] -= 1
        if self._views[address] == 0:
            del self._views[address]
            self.current -= nbytes

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            address = storage.data_ptr()
            if address in inputs or address == 0:
                continue
            if address not in self._views:
                self._views[address] = 0
                self.current += storage.nbytes()
                self.peak = max(self.peak, self.current)
            self._views[address] += 1
            weakref.finalize(t, self._release, address, storage.nbytes())
        return out
