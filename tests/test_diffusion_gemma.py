"""DiffusionGemma against transformers' reference implementation, run live on a tiny random
checkpoint that transformers' own classes saved (dlm/engine/diffusion_gemma_checkpoint.py).

All numerics in float32: first-forward logits within 1e-4 of their standard deviation, and
`generate` (canvas init, self-conditioning, entropy-bound sampler, stability/confidence
stop, renoising, prompt KV cache) giving the same ids and decoder forward count as
`DiffusionGemmaForBlockDiffusion.generate` after `torch.manual_seed(seed)`, through
`engine.LLM` and `dlm generate --seed`.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from typer.testing import CliRunner

from dlm.cli.main import app
from dlm.engine.config import load_config
from dlm.engine.diffusion_gemma_checkpoint import save_tiny_diffusion_gemma
from dlm.engine.errors import Unsupported, UsageError
from dlm.engine.llm import LLM
from dlm.engine.params import GenerationParams
from dlm.engine.registry import family_named
from tests.diffusion_gemma_reference import CASES, cli_args, logits_inputs, params, reference_generate

FREQUENT = 46  # a token the tiny model emits often: as EOS it ends some requests early


@pytest.fixture(scope="module")
def one_thread() -> Any:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_diffusion_gemma(tmp_path_factory.mktemp("dg") / "tiny")


@pytest.fixture(scope="module")
def eos_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_diffusion_gemma(tmp_path_factory.mktemp("dg") / "eos", eos_token_id=FREQUENT)


@pytest.fixture(scope="module")
def transformers_model(checkpoint: Path) -> Any:
    from transformers import DiffusionGemmaForBlockDiffusion

    return DiffusionGemmaForBlockDiffusion.from_pretrained(checkpoint, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def llm(checkpoint: Path, one_thread: Any) -> LLM:
    return LLM(checkpoint, dtype="float32", device="cpu")


def test_config_reads_the_encoder_decoder_shapes(checkpoint: Path) -> None:
    config = load_config(checkpoint)
    assert config.family == "diffusion_gemma"
    assert config.canvas is not None
    assert (config.head_dim, config.canvas.global_head_dim, config.canvas.global_kv_heads) == (8, 16, 1)
    assert config.layer_types == ("sliding_attention", "full_attention", "full_attention")
    assert config.block_length == 8 and config.canvas.sliding_window == 8


def test_logits_match_transformers(llm: LLM, transformers_model: Any) -> None:
    """Float32: the first denoising forward (after a prompt longer than the sliding window)
    and one with self-conditioning logits, within 1e-4 of the logits' standard deviation."""
    model: Any = llm.engine.loaded.model
    transformers_model.config.canvas_length = 8
    prompt, canvas, previous = logits_inputs()
    with torch.no_grad():
        first = transformers_model(input_ids=prompt[None], decoder_input_ids=canvas)
        conditioned = transformers_model(cache=first.cache, decoder_input_ids=canvas, self_conditioning_logits=previous)
    cache = model.new_cache()
    model.encode(prompt, cache)
    for expected, ours in (
        (first.logits, model.denoise(canvas, [cache], [None])),
        (conditioned.logits, model.denoise(canvas, [cache], [previous])),
    ):
        assert float((expected - ours).abs().max()) <= 1e-4 * float(expected.std())


def test_rope_factor_and_a_longer_window_match_transformers(tmp_path: Path, one_thread: Any) -> None:
    """Proportional RoPE with a `factor` (the turning frequencies divided by it) and another
    sliding window: first-forward logits still within 1e-4 of their std (float32)."""
    from transformers import DiffusionGemmaForBlockDiffusion

    rope = {
        "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.5, "rope_theta": 5e4, "factor": 2.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
    }
    directory = save_tiny_diffusion_gemma(tmp_path / "rope", rope_parameters=rope, sliding_window=5)
    reference = DiffusionGemmaForBlockDiffusion.from_pretrained(directory, dtype=torch.float32).eval()
    model: Any = LLM(directory, dtype="float32", device="cpu").engine.loaded.model
    prompt, canvas, _ = logits_inputs()
    with torch.no_grad():
        want = reference(input_ids=prompt[None], decoder_input_ids=canvas).logits
    cache = model.new_cache()
    model.encode(prompt, cache)
    assert float((want - model.denoise(canvas, [cache], [None])).abs().max()) <= 1e-4 * float(want.std())


def test_unknown_rope_type_is_refused(checkpoint: Path) -> None:
    from dlm.engine.config import config_from_dict

    raw = json.loads((checkpoint / "config.json").read_text())
    raw["text_config"]["rope_parameters"]["sliding_attention"]["rope_type"] = "yarn"
    with pytest.raises(UsageError, match="rope_type 'yarn'"):
        config_from_dict(raw)


@pytest.mark.parametrize("case", CASES, ids=[f"case{i}" for i in range(len(CASES))])
def test_generate_matches_transformers(llm: LLM, transformers_model: Any, case: tuple) -> None:
    ids, forwards = reference_generate(transformers_model, case[0], case, eos=1)
    out = llm.generate(case[0], params(case))[0]
    assert out.output_ids == ids
    assert out.nfe == forwards


def test_checkpoint_generation_config_gives_the_defaults(tmp_path: Path, one_thread: Any) -> None:
    """A request that sets no sampler field decodes with the checkpoint's
    generation_config.json settings, as transformers' `generate` does with none given."""
    from transformers import DiffusionGemmaForBlockDiffusion
    from transformers.models.diffusion_gemma.generation_diffusion_gemma import (
        DiffusionGemmaGenerationConfig,
        EntropyBoundSamplerConfig,
    )

    directory = save_tiny_diffusion_gemma(tmp_path / "tiny")
    DiffusionGemmaGenerationConfig(
        max_denoising_steps=7,
        sampler_config=EntropyBoundSamplerConfig(entropy_bound=3.0),
        t_min=0.3,
        t_max=0.9,
        stability_threshold=2,
        confidence_threshold=1.5,
    ).save_pretrained(directory)
    reference = DiffusionGemmaForBlockDiffusion.from_pretrained(directory, dtype=torch.float32).eval()
    llm = LLM(directory, dtype="float32", device="cpu")
    prompt = [5, 6, 7, 8, 9]
    torch.manual_seed(2)
    out = reference.generate(torch.tensor([prompt]), max_new_tokens=16, eos_token_id=1, pad_token_id=0)
    ours = llm.generate(prompt, gen_length=16, seed=2)[0]
    ids = out.sequences[0, len(prompt) :].tolist()
    assert ours.output_ids == ids
    assert ours.nfe == round(sum(t != 0 for t in ids) / float(out.tokens_per_forward[0]))
    assert ours.nfe <= 2 * 7  # two canvases of the config's canvas length, at most 7 steps each


def test_batched_canvases_match_each_alone(llm: LLM) -> None:
    """Requests decoded together (different prompt lengths, so padded caches) give what each
    gives alone: continuous batching of canvases changes no token."""
    case = CASES[0]
    prompts = [[5, 6, 7, 8, 9], list(range(10, 30)), [4]]
    together = llm.generate(prompts, params(case))
    for prompt, out in zip(prompts, together):
        alone = llm.generate(prompt, params(case))[0]
        assert (out.output_ids, out.nfe) == (alone.output_ids, alone.nfe)


def test_eos_ends_the_request_as_the_reference_does(eos_checkpoint: Path, one_thread: Any) -> None:
    from transformers import DiffusionGemmaForBlockDiffusion

    eos_model = DiffusionGemmaForBlockDiffusion.from_pretrained(eos_checkpoint, dtype=torch.float32).eval()
    llm = LLM(eos_checkpoint, dtype="float32", device="cpu")
    stopped = 0
    for case in CASES[:3]:
        ids, forwards = reference_generate(eos_model, case[0], case, eos=FREQUENT)
        out = llm.generate(case[0], params(case))[0]
        assert (out.output_ids, out.nfe) == (ids, forwards)
        stopped += out.finish_reason == "stop"
        if out.finish_reason == "stop":
            assert out.completion_ids[-1] == FREQUENT
    assert stopped  # the fixture's EOS is frequent enough that some request ends on it


def test_cli_generate_seed_matches_transformers(checkpoint: Path, transformers_model: Any, one_thread: Any) -> None:
    case = CASES[1]
    ids, forwards = reference_generate(transformers_model, case[0], case, eos=1)
    result = CliRunner().invoke(app, ["generate", str(checkpoint), *cli_args(case)])
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    assert (out["output_ids"], out["nfe"]) == (ids, forwards)


@pytest.mark.parametrize(
    ("field", "value"),
    [("threshold", 0.9), ("temperature", 0.5), ("remasking", "random"), ("cfg_scale", 1.0), ("alg", "entropy")],
)
def test_masked_diffusion_fields_are_refused(field: str, value: Any) -> None:
    family = family_named("diffusion_gemma")
    with pytest.raises(UsageError, match=field) as error:
        GenerationParams(gen_length=8, block_length=8, steps=8, **{field: value}).validate(5, 100, family)
    assert error.value.field == field


@pytest.mark.parametrize("field", ["entropy_bound", "stability_threshold", "min_temperature"])
def test_entropy_bound_fields_are_refused_elsewhere(field: str) -> None:
    with pytest.raises(UsageError, match="DiffusionGemma") as error:
        GenerationParams(gen_length=8, **{field: 1}).validate(5, 100)  # LLaDA
    assert error.value.field == field


def test_temperatures_must_fall() -> None:
    family = family_named("diffusion_gemma")
    with pytest.raises(UsageError) as error:
        GenerationParams(gen_length=8, block_length=8, steps=8, min_temperature=0.8, max_temperature=0.4).validate(
            5, 100, family
        )
    assert error.value.field == "max_temperature"


def test_estimate_counts_the_text_tensors_and_plans_the_canvas(checkpoint: Path) -> None:
    """The plan's parameters are the checkpoint's text tensors (the vision tower is not
    loaded); its memory holds the encoder cache and the self-conditioning logits."""
    from safetensors import safe_open

    from dlm.cli.estimate.plan import (
        Serving,
        architecture_from_config,
        count_parameters,
        parameter_components,
        plan_memory,
    )

    with safe_open(str(checkpoint / "model.safetensors"), framework="pt") as handle:
        text = sum(
            math.prod(handle.get_slice(name).get_shape())
            for name in handle.keys()
            if ".vision_tower." not in name and ".embed_vision." not in name
        )
    arch = architecture_from_config(json.loads((checkpoint / "config.json").read_text()))
    assert count_parameters(parameter_components(arch)).total == text
    plan = plan_memory(arch, parameter_components(arch), Serving(batch=2, context=64, gen_length=16, block_length=8))
    rows = {row.name: row.bytes for row in plan.rows}
    assert rows["self-conditioning logits"] == 2 * 8 * 96 * 2  # batch x canvas x vocabulary, bf16
    assert rows["KV cache"] > 0


def test_stop_token_ids_end_the_answer_at_the_canvas_holding_one(llm: LLM) -> None:
    """`stop_token_ids` stop a canvas request as EOS does: the answer ends at the first one and
    no later canvas is decoded (the draws before it are the same, so the prefix is too)."""
    stopped = 0
    for case in CASES[:3]:
        plain = llm.generate(case[0], params(case))[0]
        if FREQUENT not in plain.completion_ids:
            continue
        out = llm.generate(case[0], params(case), stop_token_ids=[FREQUENT])[0]
        end = plain.completion_ids.index(FREQUENT) + 1
        assert out.completion_ids == plain.completion_ids[:end] and out.finish_reason == "stop"
        assert out.nfe <= plain.nfe
        stopped += 1
    assert stopped  # the token is frequent enough that some answer holds it


@pytest.mark.parametrize(("field", "value"), [("suffix", (5, 6)), ("logprobs", 2)])
def test_features_without_meaning_for_a_canvas_are_refused(llm: LLM, field: str, value: Any) -> None:
    """No suffix (the decoder sees only the prompt's cache) and no committing-step logprobs
    (the canvas is resampled whole): refused naming the field, not silently dropped."""
    with pytest.raises(Unsupported) as error:
        llm.generate([5, 6, 7], gen_length=8, **{field: value})
    assert error.value.field == field
    assert field not in llm.engine.capabilities and "n" in llm.engine.capabilities
