"""DiffusionGemma's canvas rules: the entropy-bound sampler, renoising and the stability and
confidence stop, as transformers' `DiffusionGemmaForBlockDiffusion.generate` runs them.

A canvas starts as `canvas_length` uniform random tokens. Each denoising step (counting
down from N to 1) divides the decoder's logits by a temperature falling linearly from
`max_temperature` to `min_temperature`, samples one token per position from them, and
accepts the sampled tokens of the lowest-entropy positions as long as the sum of the
accepted entropies minus the largest stays within `entropy_bound` (at least one position
always); every other position is redrawn uniformly (renoised). The tempered logits condition
the next step. A canvas ends when its argmax has not changed for `stability_threshold`
steps and its mean entropy is below `confidence_threshold`, or after N steps; its argmax is
the output. Random draws, all from the request's generator, come in the reference's
order: the canvas, then per step the samples and the renoising tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributions import Categorical

from dlm.engine.params import ResolvedParams


def temperature(params: ResolvedParams, remaining: int) -> torch.Tensor:
    """The step's temperature (fp32, as the reference computes it) with `remaining` steps
    of the canvas's N left, this one included."""
    low, high = params.min_temperature, params.max_temperature
    assert low is not None and high is not None
    fraction = torch.tensor(remaining, dtype=torch.int32) / params.steps_per_block
    return low + (high - low) * fraction


def conditioning(logits: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A step's tempered logits (float32) as the next step's self-conditioning, in the model's
    `dtype`, of which the model takes only the softmax. float16's range ends at 65504 (the
    soft-capped logits, up to 30, at a temperature of 1e-4 pass it): cast as they were, they
    overflowed to inf and that softmax's inf - inf made the next step's probabilities NaN, a
    failed step. So for float16 each row is shifted first, its largest to 0 (the softmax is
    the same): the rest can only overflow to -inf, weight 0. float32 and bfloat16, whose range
    is float32's, take them as they are, as the reference does."""
    if dtype != torch.float16:
        return logits.to(dtype)
    return (logits - logits.amax(dim=-1, keepdim=True)).to(dtype)


@dataclass
class StepResult:
    canvas: torch.Tensor  # the next canvas: accepted samples, the rest renoised
    argmax: torch.Tensor  # the tempered logits' argmax: the canvas's output if it ends now
    logits: torch.Tensor  # the tempered logits: the next step's self-conditioning
    entropy: torch.Tensor  # per position


def denoise_step(
    params: ResolvedParams,
    canvas: torch.Tensor,
    raw_logits: torch.Tensor,
    remaining: int,
    vocab_size: int,
    generator: torch.Generator | None,
) -> StepResult:
    """One step on one canvas [1, L] from its decoder logits [1, L, V]. Every position not
    accepted is renoised, so the next canvas does not depend on the current one's tokens."""
    logits = raw_logits / temperature(params, remaining).to(raw_logits.device)
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    length = canvas.shape[1]
    sampled = torch.multinomial(probs.view(-1, probs.shape[-1]), 1, generator=generator).view(1, length)
    argmax = logits.argmax(dim=-1)
    entropy = Categorical(logits=logits).entropy()
    bound = params.entropy_bound
    assert bound is not None
    ordered, order = torch.sort(entropy, dim=-1)
    chosen = torch.cumsum(ordered, dim=-1) - ordered <= bound  # the sorted row's running max is its last entry
    accepted = torch.zeros_like(chosen).scatter(-1, order, chosen)
    noise = torch.randint(0, vocab_size, (1, length), generator=generator, device=canvas.device)
    next_canvas = torch.where(accepted, sampled, noise)
    return StepResult(next_canvas, argmax, logits, entropy)


class StableAndConfident:
    """The stop rule of one canvas: the argmax unchanged over the last `stability_threshold`
    steps and the mean entropy below `confidence_threshold`."""

    def __init__(self, params: ResolvedParams) -> None:
        assert params.stability_threshold is not None and params.confidence_threshold is not None
        self.window, self.threshold = params.stability_threshold, params.confidence_threshold
        self.history: list[torch.Tensor] = []

    def done(self, step: StepResult) -> bool:
        stable = len(self.history) == self.window and all(bool((h == step.argmax).all()) for h in self.history)
        if self.window:
            self.history = [*self.history, step.argmax][-self.window :]
        else:
            stable = True
        return stable and bool(step.entropy.mean(dim=-1)[0] < self.threshold)
