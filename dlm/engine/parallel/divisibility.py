"""Whether a model splits over N tensor-parallel ranks, from its config alone (torch-free).

The parallel layers (dlm/engine/layers/linear.py) refuse an uneven split when the model is
built, which under `dlm generate/serve --tensor-parallel-size N` is after the ranks have
spawned; this check says the same from config.json first, and `dlm estimate` plans with it.
"""

from __future__ import annotations

from dlm.engine.config import ModelConfig
from dlm.engine.errors import UsageError


def check_tensor_parallel(config: ModelConfig, tp: int) -> None:
    """Raise unless the model's heads divide over `tp` ranks (KV heads may be replicated:
    then `tp` must be a multiple of them)."""
    problems = []
    if config.num_heads % tp:
        problems.append(f"{config.num_heads} attention heads")
    if config.num_kv_heads % tp and tp % config.num_kv_heads:
        problems.append(f"{config.num_kv_heads} KV heads")
    linear = config.linear
    if linear is not None and (linear.value_heads % tp or linear.key_heads % tp):
        problems.append(f"{linear.key_heads}/{linear.value_heads} linear-attention heads")
    if problems:
        raise UsageError(
            f"the model's {' and '.join(problems)} are not divisible by the tensor-parallel size {tp}",
            field="tensor_parallel_size",
        )
