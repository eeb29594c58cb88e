"""Accelerators `dlm estimate` knows by name, with the memory a process can address.

Capacities are the totals the vendor tools report (`nvidia-smi --query-gpu=memory.total`,
`npu-smi info` HBM), in MiB: a card sold as "80 GB" exposes 81559 MiB, not 80e9 bytes,
and a plan that is off by that much would call an 80 GB fit wrongly.
"""

from __future__ import annotations

from dataclasses import dataclass

from dlm.engine.errors import UsageError

MIB = 1024**2


@dataclass(frozen=True)
class Gpu:
    name: str
    memory_mib: int
    aliases: tuple[str, ...] = ()

    @property
    def memory_bytes(self) -> int:
        return self.memory_mib * MIB


CATALOGUE: tuple[Gpu, ...] = (
    Gpu("H200", 143771, ("h200-141gb", "h200-sxm")),
    Gpu("H100-80GB", 81559, ("h100", "h100-sxm", "h100-80g")),
    Gpu("H20", 97871, ("h20-96gb",)),
    Gpu("A100-80GB", 81920, ("a100-80g", "a100")),
    Gpu("A100-40GB", 40960, ("a100-40g",)),
    Gpu("L40S", 46068, ("l40s-48gb",)),
    Gpu("A10", 23028, ("a10-24gb",)),
    Gpu("L4", 23034, ("l4-24gb",)),
    Gpu("RTX-4090", 24564, ("4090", "rtx4090")),
    Gpu("RTX-5090", 32607, ("5090", "rtx5090")),
    Gpu("Ascend-910B", 65536, ("910b", "ascend910b")),
)


def _key(name: str) -> str:
    return name.lower().replace(" ", "-").replace("_", "-")


def find_gpu(name: str) -> Gpu:
    key = _key(name)
    for gpu in CATALOGUE:
        if key == _key(gpu.name) or key in gpu.aliases:
            return gpu
    known = ", ".join(g.name for g in CATALOGUE)
    raise UsageError(f"unknown GPU {name!r}; known: {known} (or give --gpu-memory GiB)")
