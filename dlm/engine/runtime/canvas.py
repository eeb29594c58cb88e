"""CanvasEngine: DiffusionGemma's decoding, canvas after canvas, batched across requests.

A request is a sequence of canvases (`block_length` tokens each, the family's
`canvas_length` by default). For each canvas the encoder first appends what is new (the
prompt, then the previous canvas's output) to the request's prompt KV cache, and the canvas
is drawn uniformly at random; then every engine step is one decoder forward for all the
running canvases of one length together (each against its own cache, padded and masked;
requests asking for other canvas lengths get a forward per length), followed by each
canvas's own entropy-bound step (dlm/engine/decoding/entropy_bound.py). A finished canvas
appends its argmax to the answer; one holding EOS ends the request (what follows EOS
becomes PAD, as the reference writes it), as does the last canvas of `gen_length`.

`nfe` counts decoder forwards, as the reference's forward count does; the encoder's pass
per canvas is not one of them.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from dlm.engine.config import ModelConfig
from dlm.engine.decoding import entropy_bound
from dlm.engine.params import GenerationParams, ResolvedParams
from dlm.engine.runtime.engine import LLMEngine
from dlm.engine.runtime.interface import Runner
from dlm.engine.runtime.request import RequestState, narrow

if TYPE_CHECKING:
    from dlm.engine.models.diffusion_gemma import PromptCache


@dataclass(eq=False)
class CanvasSequence(RequestState):
    pad_id: int | None = None
    cache: PromptCache | None = None  # the encoder's keys and values, read by every decoder step
    pending: torch.Tensor | None = None  # tokens the encoder has not read yet
    current: torch.Tensor | None = None  # the canvas being denoised [1, L]
    self_conditioning: torch.Tensor | None = None  # the previous step's tempered logits
    step_in_canvas: int = 0
    stop: entropy_bound.StableAndConfident | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        self.canvas = torch.tensor(self.prompt_ids, dtype=torch.long)
        self.pending = self.canvas.clone()

    @property
    def cache_bytes(self) -> int:
        return 0 if self.cache is None else int(self.cache.nbytes)

    @property
    def masks_left(self) -> int:
        """Answer positions no finished canvas holds yet (there is no MASK token)."""
        return max(0, self.params.gen_length - (len(self.canvas) - self.prompt_length))

    def canvas_view(self) -> list[tuple[int | None, str]]:
        """Finished canvases committed (up to the first stop id); the canvas being denoised
        provisional (this step's tokens, renoised ones included); positions no canvas has
        reached yet masked."""
        view: list[tuple[int | None, str]] = []
        for token in self.canvas[self.prompt_length :].tolist():
            view.append((token, "committed"))
            if token in self.stop_ids:
                return view
        if self.current is not None:
            view += [(int(t), "provisional") for t in self.current[0].tolist()]
        view += [(None, "masked")] * (self.params.gen_length - len(view))
        return view[: self.params.gen_length]

    def release(self) -> None:
        self.cache = self.current = self.self_conditioning = self.pending = None

    def start_canvas(self, vocab_size: int, device: torch.device) -> None:
        length = self.params.block_length
        assert length is not None
        self.current = torch.randint(0, vocab_size, (1, length), generator=self.generator, device=device)
        self.self_conditioning, self.step_in_canvas = None, 0
        self.stop = entropy_bound.StableAndConfident(self.params)

    def advance(self, logits: torch.Tensor, vocab_size: int, dtype: torch.dtype) -> None:
        """One entropy-bound step from this canvas's decoder logits [1, L, V]."""
        assert self.current is not None and self.stop is not None
        steps = self.params.steps_per_block
        logits = self._without_banned(logits)
        step = entropy_bound.denoise_step(
            self.params, self.current, logits, steps - self.step_in_canvas, vocab_size, self.generator
        )
        self.current, self.self_conditioning = step.canvas, entropy_bound.conditioning(step.logits, dtype)
        self.step_in_canvas += 1
        self.nfe += 1
        self.query_lengths.append(step.canvas.shape[1])
        if self.stop.done(step) or self.step_in_canvas == steps:
            self._finish_canvas(step.argmax[0].cpu())

    def _without_banned(self, logits: torch.Tensor) -> torch.Tensor:
        """The canvas's logits with the stop ids it may not hold (`ignore_eos`, `min_tokens`:
        `RequestState.banned`) at -inf: never sampled, never its argmax, no weight in the
        self-conditioning."""
        offsets = torch.arange(logits.shape[1]) + (len(self.canvas) - self.prompt_length)
        banned = self.banned(offsets)
        if banned is None:
            return logits
        ids, ban = banned
        columns = torch.tensor(ids, device=logits.device)
        logits = logits.clone()
        logits[0, :, columns] = logits[0, :, columns].masked_fill(ban.to(logits.device), float("-inf"))
        return logits

    def _finish_canvas(self, tokens: torch.Tensor) -> None:
        self.current = self.self_conditioning = self.stop = None
        stops = torch.tensor(sorted(self.stop_ids), dtype=tokens.dtype)
        hit = torch.isin(tokens, stops)  # EOS or a request's stop_token_ids
        if bool(hit.any()):
            after = torch.cumsum(hit, dim=0) > 0
            after[int(hit.nonzero()[0, 0])] = False
            if self.pad_id is not None:
                tokens = tokens.masked_fill(after, self.pad_id)
            self.canvas = torch.cat((self.canvas, tokens))
            self.conclude()  # `stop` when the stop id is within gen_length, not past the answer's end
            return
        self.canvas = torch.cat((self.canvas, tokens))
        if len(self.canvas) - self.prompt_length >= self.params.gen_length:
            self.conclude()
        else:
            self.pending = tokens


class CanvasRunner:
    """The `Runner` of DiffusionGemma: one decoder forward for every running canvas."""

    def __init__(self, model: torch.nn.Module, config: ModelConfig, dtype: torch.dtype, device: torch.device) -> None:
        self.model: Any = model  # dlm.engine.models.diffusion_gemma.Model
        self.config, self.dtype, self.device = config, dtype, device

    def new_sequence(self, prompt_ids: list[int], params: ResolvedParams, eos_ids: tuple[int, ...]) -> CanvasSequence:
        return CanvasSequence(
            list(prompt_ids), params, self.config.mask_token_id, eos_ids, pad_id=self.config.pad_token_id
        )

    def step(self, seqs: Seq[RequestState]) -> None:
        mine = [narrow(s, CanvasSequence) for s in seqs]
        vocab = self.config.vocab_size
        for seq in mine:
            if seq.pending is not None:
                if seq.cache is None:
                    seq.cache = self.model.new_cache()
                self.model.encode(seq.pending.to(self.device), seq.cache)
                seq.pending = None
                seq.start_canvas(vocab, self.device)
        for length in dict.fromkeys(s.params.block_length for s in mine):
            group = [s for s in mine if s.params.block_length == length]
            canvases = torch.cat([s.current for s in group if s.current is not None])
            logits = self.model.denoise(canvases, [s.cache for s in group], [s.self_conditioning for s in group])
            for row, seq in enumerate(group):
                seq.advance(logits[row : row + 1], vocab, self.dtype)


class CanvasEngine(LLMEngine):
    """LLMEngine over DiffusionGemma's canvas runner."""

    warmup_params = GenerationParams(gen_length=8, block_length=8, refinement_steps=1)

    def make_runner(self) -> Runner:
        loaded = self.loaded
        return CanvasRunner(loaded.model, loaded.config, loaded.dtype, loaded.device)
