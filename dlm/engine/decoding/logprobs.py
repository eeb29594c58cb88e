"""Log-probabilities of generated tokens as a dLLM has them: from the step that committed each.

An autoregressive model's logprob of token i is p(x_i | x_<i). A dLLM commits tokens in any
order, several per forward, so a token's probability is the one it had in the forward whose
step committed it: the model's distribution at its position given the canvas at that moment
(prompt, suffix, the tokens committed before, MASK elsewhere). That is what is reported:
log-softmax of the raw logits over the whole vocabulary (temperature 1, before Dream's top-p /
top-k filtering, after classifier-free guidance), in float32, for the committed token and the
`top` most likely alternatives. The MASK token is never an alternative: it is never committed.

A position is decided by every step until one commits it; each step overwrites its record,
so what remains is the committing step's. Computed only for requests that ask, and only on
the rows a step decides (a [decided, vocab] block of logits, never [canvas, vocab]).

A position no step decides was committed before decoding began: a response format's skeleton
(dlm/engine/structured.py), certain under the constraint. Its token is reported with
log-probability 0.0 (probability 1) and itself as its only alternative; never NaN.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from dlm.engine.layers.linear import gather_logits
from dlm.kernels.token_stats import VocabShard


@dataclass(frozen=True)
class TokenLogprob:
    """One generated token: its log-probability at the committing step and the `top` most
    likely tokens of that step's distribution, most likely first."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...]


class LogprobRecord:
    """Per answer position: the latest deciding step's logprob of its proposed token and the
    top alternatives (a committed position keeps its committing step's)."""

    def __init__(self, length: int, top: int) -> None:
        self.logprob = torch.zeros((length,), dtype=torch.float32)
        self.decided = torch.zeros((length,), dtype=torch.bool)  # a step proposed its token
        self.top_ids = torch.zeros((length, top), dtype=torch.long)
        self.top_logprobs = torch.full((length, top), -math.inf, dtype=torch.float32)

    def note(
        self,
        offsets: torch.Tensor,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        tokens: torch.Tensor,
        mask_id: int,
        shard: VocabShard | None = None,
    ) -> None:
        """A step decided answer positions `offsets` [N] from hidden rows [N, d] and proposed
        `tokens` [N]; `weight` is the LM head (this rank's vocabulary shard under `shard`)."""
        keep = (offsets >= 0) & (offsets < len(self.logprob))  # a block grid may run past the answer
        if not bool(keep.any()):
            return
        logits = hidden @ weight.T if shard is None else gather_logits(hidden @ weight.T, shard.size)
        logp = torch.log_softmax(logits.float(), dim=-1).cpu()[keep.cpu()]
        offsets, tokens = offsets.cpu()[keep.cpu()], tokens.cpu()[keep.cpu()]
        self.logprob[offsets] = logp.gather(1, tokens[:, None])[:, 0]
        self.decided[offsets] = True
        k = self.top_ids.shape[1]
        if k:
            if 0 <= mask_id < logp.shape[1]:
                logp[:, mask_id] = -math.inf  # never committed, so never an alternative
            values, ids = logp.topk(min(k, logp.shape[1]), dim=-1)
            self.top_ids[offsets, : ids.shape[1]] = ids
            self.top_logprobs[offsets, : values.shape[1]] = values

    def tokens(self, ids: list[int]) -> list[TokenLogprob]:
        """The records of the first len(ids) answer positions, whose tokens are `ids`; a
        position no step decided (a response format's skeleton) is certain: 0.0, and its
        token its only alternative."""
        out = []
        k = self.top_ids.shape[1]
        for i, token in enumerate(ids):
            if not bool(self.decided[i]):
                out.append(TokenLogprob(int(token), 0.0, ((int(token), 0.0),) if k else ()))
                continue
            top = tuple(
                (int(t), float(v))
                for t, v in zip(self.top_ids[i].tolist(), self.top_logprobs[i].tolist())
                if v > -math.inf
            )
            out.append(TokenLogprob(int(token), float(self.logprob[i]), top))
        return out
