"""HybridCache: one sequence's decoding state for the Gated-DeltaNet / attention hybrid.

Full-attention layers keep keys and values (growing with the context, like any KV cache);
Gated-DeltaNet layers keep a fixed-size state whatever the context length: the last K-1
pre-convolution rows and the recurrent matrix S per value head. Models compute new states
without touching the cache; `commit` is the one place that advances it, so a pass whose
states are dropped (Clover's preview) provably leaves the sequence's state unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

from dlm.engine.layers.gated_attention import KeyValue
from dlm.engine.layers.gated_deltanet import LinearAttentionState
from dlm.engine.runtime.kv_cache import tensor_bytes

LayerState = KeyValue | LinearAttentionState


@dataclass
class HybridCache:
    layers: list[LayerState | None]
    length: int = 0  # tokens whose state is committed

    def commit(self, states: list[LayerState], tokens: int) -> None:
        """Adopt the states a causal pass over the next `tokens` tokens produced."""
        if len(states) != len(self.layers):
            raise ValueError("one state per layer is required")
        self.layers = list(states)
        self.length += tokens

    @property
    def nbytes(self) -> int:
        """Bytes held now (keys/values grow with length; DeltaNet states do not)."""
        total = 0
        for state in self.layers:
            if isinstance(state, LinearAttentionState):
                total += tensor_bytes((state.conv, state.recurrent))
            elif state is not None:
                total += tensor_bytes(state)
        return total
