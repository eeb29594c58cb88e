"""RequestState: what every kind of sequence shares, whatever family decodes it.

A request's canvas holds the prompt, then the answer's `gen_length` positions (MASK until
committed), possibly followed by grid padding a block-causal family decodes past the answer.
The progress notions every caller needs are read here, once: the committed prefix (what can
be streamed: a dLLM commits anywhere in its block, but nothing before the first MASK can
change), the MASK positions left, the stop ids (EOS and the request's `stop_token_ids`), the
completion (the committed prefix up to its first stop id), the forwards spent and the finish
reason. The end of a request is decided by the
sequence's own rule, never by a caller: so the same request spends the same forwards through
`dlm generate`, `engine.LLM` and the HTTP server.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from dlm.engine.decoding.constrain import Constraint
from dlm.engine.decoding.logprobs import LogprobRecord, TokenLogprob
from dlm.engine.params import ResolvedParams
from dlm.kernels.token_stats import VocabShard

_ids = itertools.count()
S = TypeVar("S", bound="RequestState")


@dataclass(eq=False)
class RequestState:
    prompt_ids: list[int]
    params: ResolvedParams  # validated and resolved once, at the boundary
    mask_id: int
    # Every EOS id of the model (config.json and generation_config.json may list several):
    # each ends an answer; the first (`eos_id`) also fills the canvas after an early stop.
    eos_ids: tuple[int, ...]
    seq_id: int = field(default_factory=lambda: next(_ids))
    nfe: int = 0  # model forwards spent on this request
    query_lengths: list[int] = field(default_factory=list)  # tokens fed to each forward
    finish_reason: str | None = None  # stop, length, or the caller's reason (abort, timeout, ...)
    generator: torch.Generator | None = None  # set by the engine on its device when seeded
    # A response format's token masks (dlm/engine/decoding/constrain.py), laid on by the engine.
    constraint: Constraint | None = field(default=None, repr=False)
    # The latest step's proposals (positions, tokens) at positions it left MASK: see `propose`.
    proposed: tuple[torch.Tensor, torch.Tensor] | None = field(default=None, repr=False)
    canvas: torch.Tensor = field(init=False, repr=False)
    logprob_record: LogprobRecord | None = field(default=None, init=False, repr=False)  # when asked for

    @property
    def prompt_length(self) -> int:
        return len(self.prompt_ids)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def cache_bytes(self) -> int:
        """Bytes of cache (K/V, recurrent state) this request holds now."""
        return 0

    @property
    def eos_id(self) -> int | None:
        """The model's EOS, the first of `eos_ids` (None without one)."""
        return self.eos_ids[0] if self.eos_ids else None

    @property
    def stop_ids(self) -> frozenset[int]:
        """Token ids that end the answer: every EOS and the request's `stop_token_ids`."""
        return stop_ids(self.eos_ids, self.params)

    def banned(self, offsets: torch.Tensor) -> tuple[list[int], torch.Tensor] | None:
        """What a step may not commit at answer offsets [N] (positions past the prompt), as
        (ids, ban [N, len(ids)] bool), or None when nothing is banned: EOS everywhere with
        `ignore_eos`; every stop id (EOS, `stop_token_ids`) before `min_tokens`. Masking them
        out of the decision (vLLM does the same to the logits) is what makes a diffusion
        answer's length fixed: the model's EOS never fills the answer."""
        p = self.params
        always = list(self.eos_ids) if p.ignore_eos else []
        early = sorted(self.stop_ids) if p.min_tokens else []
        if not always and not early:
            return None
        ban = torch.zeros(len(offsets), len(always) + len(early), dtype=torch.bool)
        ban[:, : len(always)] = True
        ban[:, len(always) :] = (offsets.cpu() < p.min_tokens)[:, None]
        return (always + early, ban) if bool(ban.any()) else None

    def holds_stop(self, start: int, end: int) -> bool:
        """Whether canvas[start:end] holds a stop id."""
        stops = self.stop_ids  # built once, not per token: this runs every step
        return any(int(t) in stops for t in self.canvas[start:end].unique())

    def release(self) -> None:
        """Drop what the request holds beyond its canvas (caches): it will run no more."""

    def finish(self, reason: str) -> None:
        """End the request now with `reason` (kept if it already ended) and free its caches."""
        if self.finish_reason is None:
            self.finish_reason = reason
        self.release()

    def conclude(self) -> None:
        """End the request by its own rule: `stop` when its answer (the first gen_length
        positions: a stop id in a block grid's overhang does not count) holds a stop id, else
        `length`."""
        self.finish("stop" if self.holds_stop(self.prompt_length, self.answer_end) else "length")

    @property
    def answer_end(self) -> int:
        """The canvas position after the answer (where an infilling suffix starts)."""
        return self.prompt_length + self.params.gen_length

    def answer(self) -> torch.Tensor:
        """The canvas positions of the answer (a block-causal grid may extend past them,
        an infilling suffix follows them)."""
        return self.canvas[self.prompt_length : self.answer_end]

    def note_logprobs(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        tokens: torch.Tensor,
        shard: VocabShard | None = None,
    ) -> None:
        """A runner decided canvas `positions` from `hidden` rows, proposing `tokens`: keep
        their log-probabilities when the request asks for them (dlm/engine/decoding/logprobs.py)."""
        top = self.params.logprobs
        if top is None:
            return
        if self.logprob_record is None:
            self.logprob_record = LogprobRecord(self.params.gen_length, top)
        self.logprob_record.note(positions - self.prompt_length, hidden, weight, tokens, self.mask_id, shard)

    def token_logprobs(self, ids: list[int]) -> list[TokenLogprob] | None:
        """Log-probabilities of the first len(ids) answer tokens (committed: `ids`), or None
        when the request did not ask for them."""
        if self.params.logprobs is None:
            return None
        if self.logprob_record is None:  # nothing decided yet
            self.logprob_record = LogprobRecord(self.params.gen_length, self.params.logprobs)
        return self.logprob_record.tokens(ids)

    @property
    def masks_left(self) -> int:
        """Answer positions still MASK."""
        return int((self.answer() == self.mask_id).sum())

    @property
    def committed_prefix(self) -> list[int]:
        """Generated ids up to the first MASK: the part of the answer that can no longer change."""
        answer = self.answer()
        masked = (answer == self.mask_id).nonzero()
        end = int(masked[0, 0]) if len(masked) else len(answer)
        return answer[:end].tolist()

    @property
    def completion_ids(self) -> list[int]:
        """The committed prefix up to and including its first stop id: the answer as a client
        receives it (what follows is filler)."""
        return completion(self.committed_prefix, self.stop_ids)

    def propose(self, positions: torch.Tensor, tokens: torch.Tensor) -> None:
        """Record a step's proposals (before its commit): what canvas streaming shows as
        provisional at the positions the step leaves MASK. Kept as device copies, read only
        when a canvas is asked for: every step calls this, and a host read would make each
        one wait for the device."""
        self.proposed = (positions.clone(), tokens.clone())

    @property
    def provisional(self) -> dict[int, int]:
        """The latest step's proposals, position -> token."""
        if self.proposed is None:
            return {}
        positions, tokens = self.proposed
        return dict(zip(positions.tolist(), tokens.tolist(), strict=True))

    def canvas_view(self) -> list[tuple[int | None, str]]:
        """Every answer position as (token id, state): "committed", "provisional" (the
        latest step's proposal for a position still MASK) or "masked" (token None).
        Cut after the first committed stop id (EOS): the rest is filler."""
        view: list[tuple[int | None, str]] = []
        provisional = self.provisional
        for i, token in enumerate(self.answer().tolist()):  # a block grid's MASKs included
            if token != self.mask_id:
                view.append((token, "committed"))
                if token in self.stop_ids and all(state == "committed" for _, state in view):
                    break
            elif self.prompt_length + i in provisional:
                view.append((provisional[self.prompt_length + i], "provisional"))
            else:
                view.append((None, "masked"))
        return view

    @property
    def output_ids(self) -> list[int]:
        """Every answer position (generated ids only; MASK where nothing was committed)."""
        return self.answer().tolist()


def stop_ids(eos_ids: Collection[int], params: ResolvedParams) -> frozenset[int]:
    """The model's EOS ids (unless the request ignores them) and the request's
    `stop_token_ids`."""
    eos = [] if params.ignore_eos else list(eos_ids)
    return frozenset(eos + list(params.stop_token_ids or ()))


def first_stop(ids: list[int], stops: Collection[int]) -> int | None:
    """Index of the first stop id in `ids`, or None."""
    return next((i for i, t in enumerate(ids) if t in stops), None)


def completion(prefix: list[int], stops: Collection[int]) -> list[int]:
    """`prefix` up to and including its first stop id."""
    end = first_stop(prefix, stops)
    return prefix if end is None else prefix[: end + 1]


def narrow(seq: RequestState, kind: type[S]) -> S:
    """`seq` as the kind a runner builds: an engine only hands a runner back its own sequences."""
    if not isinstance(seq, kind):
        raise TypeError(f"a {kind.__name__} was expected, got a {type(seq).__name__}")
    return seq


def canvas_json(step: int, view: list[tuple[int | None, str]], text: Callable[[int], str] | None) -> dict[str, Any]:
    """A canvas snapshot (`RequestState.canvas_view()`) as the server's canvas events and
    `dlm generate --canvas` print it: `{"step", "tokens": [{"id", "text", "state"}]}`
    (`text` None without a tokenizer, and at masked positions)."""
    tokens = [
        {"id": token, "text": None if token is None or text is None else text(token), "state": state}
        for token, state in view
    ]
    return {"step": step, "tokens": tokens}
