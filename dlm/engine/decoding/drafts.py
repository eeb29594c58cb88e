"""Lossless multi-token steps: guesses of the next step's canvas, verified for free.

The plain rule runs one forward per step: step t+1 decides from logits computed on the canvas
holding step t's commits, so no decision can be taken before that canvas exists. But a step's
commits can be guessed from the forward that just ran. If the next forward evaluates, beside the
exact next canvas, a few candidate canvases of the step after it, then once the exact row has
decided, any candidate equal to the resulting canvas IS the canvas the plain rule would feed
next, and its row's logits are the logits the plain rule would compute: the step after is decided
from them without another forward. A forward therefore always takes at least the plain step, and
one more whenever a candidate was right; the ids are those of the plain rule, bit for bit
(a sequence's rows are batch-invariant, dlm/engine/runtime/runner.py), and only the candidates'
compute is spent for nothing when none matches.

Candidates come from the last exact logits (the step's own forward): each of the `width` most
probable (position, token) pairs among the positions left masked is forced to lead the rule,
which is then applied to those logits as if they were the next step's. The first candidate is the
plain "next most confident" guess; the others cover a reshuffled ranking or a changed argmax,
which is what a commit most often causes. Self-speculative schemes for diffusion LMs (Spiffy,
SSD) verify drafted steps the same way; this is our own formulation for LLaDA's rules.

Only deterministic rules are drafted (temperature 0, low-confidence ranking, no guidance): a
sampled step consumes the request's generator, and the rule must see exactly the plain draws.
"""

from __future__ import annotations

import torch

from dlm.engine.decoding.step import llada_rule
from dlm.engine.layers.linear import gather_logits
from dlm.engine.params import ResolvedParams
from dlm.kernels.token_stats import VocabShard


def candidates(
    params: ResolvedParams,
    step: int,
    schedule: list[int],
    canvas: torch.Tensor,
    positions: torch.Tensor,
    hidden: torch.Tensor,
    weight: torch.Tensor,
    mask_id: int,
    shard: VocabShard | None = None,
) -> list[torch.Tensor]:
    """Distinct candidate canvases of step `step` of the current block (at most
    `params.drafts`), from the hidden rows [n, d] of the still-masked `positions` [n] in the
    forward that decided the step before."""
    logits = hidden @ weight.T if shard is None else gather_logits(hidden @ weight.T, shard.size)
    logits = logits.float()
    logits[:, mask_id] = float("-inf")  # never proposed, as in the rule's own statistics
    probs = torch.softmax(logits.to(torch.float64), dim=-1)
    conf, tokens = probs.max(dim=-1)
    vocab = probs.shape[1]
    leads = probs.flatten().topk(min(params.drafts, probs.numel())).indices
    out: list[torch.Tensor] = []
    for lead in leads.tolist():
        row, token = divmod(lead, vocab)
        forced_conf, forced_tokens = conf.clone(), tokens.clone()
        forced_conf[row], forced_tokens[row] = float("inf"), token
        chosen = llada_rule(params, step, schedule, forced_conf)
        guess = canvas.clone()
        guess[positions[chosen]] = forced_tokens[chosen]
        if not any(torch.equal(guess, other) for other in out):
            out.append(guess)
    return out
