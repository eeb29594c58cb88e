"""How many tokens each step of a block commits (LLaDA's linear schedule)."""

from __future__ import annotations


def linear_schedule(num_masked: int, steps: int) -> list[int]:
    """Split `num_masked` tokens over `steps` as evenly as possible, earlier steps first.

    A linear noise schedule makes the expected number of unmasked tokens per step
    constant; the remainder goes to the first steps, as in LLaDA's reference.
    """
    base, remainder = divmod(num_masked, steps)
    return [base + 1 if i < remainder else base for i in range(steps)]
