"""The two seams of the runtime, declared: `Engine` (what every caller drives) and `Runner`
(what an engine drives for one family).

Every engine subclasses `Engine` (inheriting `add_request` and `generate`, written once over
`make_sequence`, `add` and `step`): the native `LLMEngine` and its subclasses (`CloverEngine`,
the transformers backend's `ForwardEngine` and `GenerateMethodEngine`) and the
tensor-parallel driver (`DistributedEngine`). Callers (`engine.LLM`, `dlm generate`, the
serving loop) use only these members, so no caller probes for an attribute.

An engine keeps the one list of running sequences: `add` puts a sequence in it (the serving
scheduler decides when), `abort` and `step` take sequences out; nothing else writes it.
A sequence ends by its own rule (dlm/engine/runtime/request.py), so a request spends the same
forwards whichever entry point runs it.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence as Seq
from typing import TYPE_CHECKING, Protocol

from dlm.engine.config import ModelConfig
from dlm.engine.params import GenerationParams, ResolvedParams
from dlm.engine.runtime.prefix_cache import PrefixCacheStats
from dlm.engine.runtime.request import RequestState

if TYPE_CHECKING:
    from dlm.engine.runtime.engine import LoadedModel


class Runner(Protocol):
    """Runs one family's forwards. `step` advances each sequence by one forward and commits
    its decisions (so the engine never knows how a family decides). What a family's
    requests may ask is not the runner's to say: dlm/engine/family_rules.py derives it from the
    config, so it is checked before loading too."""

    def new_sequence(self, prompt_ids: list[int], params: ResolvedParams, eos_ids: tuple[int, ...]) -> RequestState:
        """A sequence for resolved, validated `params`, ending by its rule on any of the
        model's `eos_ids` (`RequestState.eos_ids`)."""
        ...

    def step(self, seqs: Seq[RequestState]) -> None:
        """One forward for the unfinished `seqs` (sequences this runner built), then their commits."""
        ...


class Engine(Protocol):
    """What `engine.LLM`, `dlm generate` and the serving loop drive."""

    config: ModelConfig
    loaded: LoadedModel
    warmup_params: GenerationParams  # the cheap request a server runs before serving

    @property
    def running(self) -> list[RequestState]:
        """The sequences the next `step` advances, in batch order (read-only: see `add`)."""
        ...

    @property
    def tensor_parallel_size(self) -> int: ...

    @property
    def path(self) -> str | None:
        """The transformers backend's path ("forward" or "generate"); None for native engines."""
        ...

    @property
    def max_num_seqs(self) -> int | None:
        """A bound of the engine's own on the sequences decoded together (None: the caller's)."""
        ...

    @property
    def capabilities(self) -> tuple[str, ...]:
        """The request features this engine honours (dlm/engine/capabilities.py), what a server's
        `/v1/models` lists."""
        ...

    def reproducible(self, params: ResolvedParams) -> bool:
        """Whether a request's answer is a function of its prompt and `params` alone (no
        unseeded random draw): what a server may answer again from its response cache."""
        ...

    def validate(self, params: GenerationParams, prompt_length: int) -> ResolvedParams:
        """The family's defaults resolved and every rule checked (`UsageError`, `Unsupported`)
        once; parameters already resolved pass as they are."""
        ...

    def make_sequence(self, prompt_ids: list[int], params: GenerationParams) -> RequestState:
        """Validate a request and build its sequence without running it."""
        ...

    def check_request(self, prompt_ids: list[int], params: GenerationParams) -> ResolvedParams:
        """Refuse what `make_sequences` would refuse (`UsageError`, `Unsupported`: the
        parameters, the prompt's and suffix's ids, a response format's layout), building
        nothing: what a caller that only asks whether a request would run calls (a server's
        `/tokenize`), so no sequence is made, mirrored to other ranks or dropped."""
        ...

    def make_sequences(self, prompt_ids: list[int], params: GenerationParams) -> list[RequestState]:
        """The request's `n` samples (`GenerationParams.samples`: sample i seeded `seed + i`),
        built without running them; what they share (a response format's layout) is made once."""
        return [self.make_sequence(prompt_ids, sample) for sample in self.validate(params, len(prompt_ids)).samples()]

    def add(self, seq: RequestState) -> None:
        """`seq` (from `make_sequence`) joins the running set: it is in the next `step`."""
        ...

    def add_request(self, prompt_ids: list[int], params: GenerationParams) -> RequestState:
        """`make_sequence`, then `add`."""
        seq = self.make_sequence(prompt_ids, params)
        self.add(seq)
        return seq

    def abort(self, seq: RequestState, reason: str = "abort") -> None:
        """Finish `seq` now (timeout, cancel, stop string): it is not in the next forward."""
        ...

    def step(self) -> list[RequestState]:
        """Advance every running sequence by one step; return those that finished."""
        ...

    def generate(
        self,
        prompts: list[list[int]],
        params: GenerationParams,
        on_step: Callable[[list[RequestState]], None] | None = None,
        ends: Callable[[RequestState], Callable[[list[int]], bool]] | None = None,
    ) -> list[RequestState]:
        """Add `prompts` and step until each has ended (others in the running set take part
        in the same steps). Returns `params.n` sequences per prompt, prompt by prompt, sample
        i seeded `seed + i` (`GenerationParams.samples`, of the resolved parameters: the family
        may fill the seed, as a server's request does). `ends(seq)`: a rule of the caller's
        (stop strings, dlm/engine/stops.py) asked after every step that extends `seq`'s
        committed prefix; when it holds, `seq` ends ("stop") before the next forward, as a
        server's engine thread ends it (`RequestStream.ends`)."""
        seqs = [seq for p in prompts for seq in self.make_sequences(p, params)]
        rules = [(seq, ends(seq)) for seq in seqs] if ends is not None else []
        for seq in seqs:
            self.add(seq)
        try:
            while any(not s.finished for s in seqs):
                self.step()
                for seq, rule in rules:
                    if not seq.finished and rule(seq.committed_prefix):
                        self.abort(seq, "stop")
                if on_step is not None:
                    on_step(seqs)
        except BaseException:  # a failed step, an interrupt: this call's sequences leave the running set
            for seq in seqs:  # (left there, every later call stepped them again, and failed the same way)
                if not seq.finished:
                    self.abort(seq, "error")
            raise
        return seqs

    def cache_bytes(self) -> int:
        """Bytes of cache the running requests hold on this process."""
        ...

    def enable_prefix_cache(self, budget_bytes: int) -> bool:
        """Share prompt K/V across requests within `budget_bytes` (dlm/engine/runtime/prefix_cache.py)
        where the family makes the reuse exact; returns whether the cache is on. Engines that
        cannot reuse exactly (bidirectional families, tensor parallelism) keep it off."""
        return False

    def enable_step_graphs(self, choice: str, max_batch: int) -> str | None:
        """`--step-graphs` auto|on|off (dlm/engine/runtime/step_graphs.py) for batches of up to
        `max_batch` requests; returns the mode in use ("cuda", "static") or None (eager)."""
        return None

    def prefix_cache_stats(self) -> PrefixCacheStats:
        """The prefix cache's counters (all zero while it is off)."""
        return PrefixCacheStats()

    def on_failure(self, callback: Callable[[str], None]) -> None:
        """Call `callback(reason)` as soon as the engine can run nothing more (a rank died).
        A single process fails by raising from `step`: nothing to watch."""
        return None

    def close(self) -> None:
        """Release what the engine holds beyond this process (worker ranks); idempotent."""
        return None
