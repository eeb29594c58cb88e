"""Transformers' DiffusionGemma `generate` as the reference the DiffusionGemma tests compare
with (tests/test_diffusion_gemma.py, tests/test_diffusion_gemma_serve.py,
tests/test_diffusion_gemma_tp.py), the request cases they share, and the server check they share."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import torch

from dlm.engine.params import GenerationParams
from dlm.engine.runtime.request import completion
from tests.serving import ServerProcess, ready_server

# (prompt, canvas length, entropy bound, confidence threshold, steps per canvas, gen_length, seed)
CASES = [
    ([5, 6, 7, 8, 9], 8, 0.5, 1.0, 12, 24, 0),
    ([3] * 11, 4, 2.0, 0.5, 10, 16, 1),
    (list(range(10, 30)), 8, 5.0, 2.0, 6, 32, 3),  # longer than the sliding window
    ([7, 9], 16, 0.1, 0.005, 5, 16, 4),  # transformers' defaults for the sampler
]


def reference_generate(model: Any, prompt: list[int], case: tuple, eos: int) -> tuple[list[int], int]:
    """Ids (PAD after EOS) and decoder forwards of transformers' generate for `case`."""
    from transformers.models.diffusion_gemma.generation_diffusion_gemma import EntropyBoundSamplerConfig

    _, canvas, bound, confidence, steps, gen, seed = case
    model.config.canvas_length = canvas  # transformers reads the canvas length from the config
    torch.manual_seed(seed)
    out = model.generate(
        torch.tensor([prompt]),
        max_new_tokens=gen,
        max_denoising_steps=steps,
        sampler_config=EntropyBoundSamplerConfig(entropy_bound=bound),
        confidence_threshold=confidence,
        eos_token_id=eos,
        pad_token_id=0,
    )
    ids = out.sequences[0, len(prompt) :].tolist()
    valid = sum(t != 0 for t in ids)  # tokens_per_forward = valid tokens / decoder forwards
    return ids, round(valid / float(out.tokens_per_forward[0]))


def reference_results(checkpoint: Path) -> list[tuple[list[int], int]]:
    """`reference_generate` (EOS 1) of every case on the checkpoint, loaded in float32."""
    from transformers import DiffusionGemmaForBlockDiffusion

    model = DiffusionGemmaForBlockDiffusion.from_pretrained(checkpoint, dtype=torch.float32).eval()
    return [reference_generate(model, case[0], case, eos=1) for case in CASES]


@contextmanager
def tiny_server(checkpoint: Path, home: Path, *flags: str) -> Iterator[ServerProcess]:
    """`dlm serve CHECKPOINT --dtype float32 --device cpu FLAGS`, ready for the block."""
    with ready_server([str(checkpoint), "--dtype", "float32", "--device", "cpu", *flags], home) as proc:
        yield proc


def assert_concurrent_cases_match(server: ServerProcess, expected: list[tuple[list[int], int]]) -> None:
    """Every case sent at once: each reply has its reference ids (up to EOS 1) and forwards."""
    with ThreadPoolExecutor(len(CASES)) as pool:
        replies = list(
            pool.map(lambda c: httpx.post(server.url + "/v1/completions", json=http_body(c), timeout=300), CASES)
        )
    for reply, (ids, forwards) in zip(replies, expected):
        assert reply.status_code == 200, reply.text
        assert reply.json()["choices"][0]["token_ids"] == completion(ids, {1})
        assert reply.json()["usage"]["denoising_steps"] == forwards


def params(case: tuple) -> GenerationParams:
    _, canvas, bound, confidence, steps, gen, seed = case
    return GenerationParams(
        gen_length=gen,
        block_length=canvas,
        refinement_steps=steps,
        entropy_bound=bound,
        confidence_threshold=confidence,
        seed=seed,
    )


def cli_args(case: tuple) -> list[str]:
    """`dlm generate` options (after the model) for `case`, float32 on the CPU, JSON out."""
    prompt, canvas, bound, confidence, steps, gen, seed = case
    options = {
        "--prompt-ids": ",".join(map(str, prompt)),
        "--gen-length": gen,
        "--block-length": canvas,
        "--refinement-steps": steps,
        "--entropy-bound": bound,
        "--confidence-threshold": confidence,
        "--seed": seed,
        "--dtype": "float32",
        "--device": "cpu",
    }
    return [*(str(item) for pair in options.items() for item in pair), "--json"]


def http_body(case: tuple) -> dict[str, Any]:
    """A /v1/completions body for `case`, asking for the token ids."""
    prompt, canvas, bound, confidence, steps, gen, seed = case
    return {
        "prompt": prompt,
        "max_tokens": gen,
        "block_length": canvas,
        "refinement_steps": steps,
        "entropy_bound": bound,
        "confidence_threshold": confidence,
        "seed": seed,
        "return_token_ids": True,
    }


def logits_inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For the logits checks: a prompt [13] longer than the tiny model's sliding window, a
    canvas [1, 8] and previous-step logits [1, 8, 96] to self-condition on."""
    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(3, 96, (13,), generator=gen)
    return prompt, torch.randint(0, 96, (1, 8), generator=gen), torch.randn(1, 8, 96, generator=gen)
