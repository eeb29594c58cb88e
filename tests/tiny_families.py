"""The `tiny:NAME` checkpoints the family matrices run on, taken from the registry.

Every family the registry decodes natively (`Family.engine`) is in the list, so a family
added to dlm/engine/registry.py joins every matrix built from it (and fails there until
`dlm.engine.tiny_models` can build its tiny checkpoint); the tiny variants beside them
(`sdar_moe`, the MoE SDAR) are in it too.
"""

from __future__ import annotations

from dlm.engine.params import NOT_ENTROPY_BOUND
from dlm.engine.registry import FAMILIES, Family
from dlm.engine.tiny_models import BUILDERS

# Representative max_tokens of the family matrices: one token, odd lengths, less and more
# than a block of 32, and dlm validate's 16.
MAX_TOKENS = (1, 7, 16, 50, 100)


def tiny_names() -> list[str]:
    """`tiny:NAME` names: every natively decoded family, plus the tiny variants."""
    return sorted({f.name for f in FAMILIES if f.engine} | set(BUILDERS))


def cannot(family: Family) -> set[str]:
    """Request fields the family record says the family cannot honour, which the one
    validation refuses as unsupported (a 400 naming the field): the masked-diffusion fields
    for the entropy-bound sampler, another block length for a family with a fixed one."""
    fields = set(NOT_ENTROPY_BOUND) if family.sampler == "entropy_bound" else set()
    if family.fixed_block:
        fields.add("block_length")
    return fields
