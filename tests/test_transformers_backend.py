"""`--backend transformers`: the forward path (dlm's decoding over a bidirectional
transformers model) against a literal loop over the model's own logits, the generate path
(the model's own generation method) against calling it directly, and remote code refused
unless explicitly trusted."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from typer.testing import CliRunner

from dlm.cli.main import app
from dlm.engine.diffusion_gemma_checkpoint import save_tiny_diffusion_gemma
from dlm.engine.errors import Unsupported, UsageError
from dlm.engine.llm import LLM
from dlm.engine.params import GenerationParams
from tests.hybrid_checkpoints import reference_model, save_reference
from tests.tiny_transformers import tiny_bert

MASK = 99


@pytest.fixture(scope="module")
def masked_lm(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny BertForMaskedLM (bidirectional, head with bias) with a MASK id in its config."""
    directory = tmp_path_factory.mktemp("bert")
    tiny_bert(100, 128, mask_token_id=MASK).save_pretrained(str(directory))
    return directory


def literal_llada(hf_model, prompt: list[int], gen_length: int, block: int, steps: int) -> list[int]:  # noqa: ANN001
    """LLaDA's greedy low-confidence loop, written directly on the model's full logits."""
    x = torch.tensor([prompt + [MASK] * gen_length])
    per_block = steps // (gen_length // block)
    for b in range(gen_length // block):
        s, e = len(prompt) + b * block, len(prompt) + (b + 1) * block
        counts = [block // per_block + (1 if i < block % per_block else 0) for i in range(per_block)]
        for k in counts:
            probs = torch.softmax(hf_model(input_ids=x).logits[0].double(), dim=-1)
            conf, token = probs.max(-1)
            masked = (x[0] == MASK) & (torch.arange(x.shape[1]) >= s) & (torch.arange(x.shape[1]) < e)
            conf = torch.where(masked, conf, torch.tensor(float("-inf"), dtype=torch.float64))
            chosen = conf.topk(k).indices
            x[0, chosen] = token[chosen]
    return x[0, len(prompt) :].tolist()


def test_forward_path_matches_literal_loop_and_batches(masked_lm: Path) -> None:
    llm = LLM(masked_lm, dtype="float32", device="cpu", backend="transformers")
    assert llm.engine.path == "forward"
    prompts = [[5, 17, 42, 11, 3], [7, 8, 9]]
    outs = llm.generate(prompts, gen_length=16, block_length=8, steps=16)
    hf = llm.engine.loaded.model.hf
    with torch.inference_mode():
        for prompt, out in zip(prompts, outs):
            assert out.output_ids == literal_llada(hf, prompt, 16, 8, 16)
            assert out.nfe == 16
    single = llm.generate(prompts[1], gen_length=16, block_length=8, steps=16)[0]
    assert single.output_ids == outs[1].output_ids  # right padding + key mask do not leak


def test_a_checkpoint_under_a_non_utf8_folder_loads(masked_lm: Path, tmp_path: Path) -> None:
    """transformers reads the weights with safetensors, which opened UTF-8 paths only
    ('is not valid UTF-8'); the same ids either way, float32."""
    import os
    import shutil

    copy = Path(os.fsdecode(os.fsencode(tmp_path) + b"/st\xff"))
    shutil.copytree(masked_lm, copy)
    prompt = [5, 17, 42, 11, 3]
    outs = [
        LLM(where, dtype="float32", device="cpu", backend="transformers").generate(
            prompt, gen_length=16, block_length=8, steps=16
        )[0]
        for where in (masked_lm, copy)
    ]
    assert outs[1].output_ids == outs[0].output_ids


def test_generate_path_calls_the_models_own_method(tmp_path: Path) -> None:
    """A causal LM (here transformers' own Qwen3.5-MoE) is decoded by its `generate`."""
    ref = reference_model(seed=3)
    directory = save_reference(ref, tmp_path / "causal", eos_token_id=158)
    llm = LLM(directory, dtype="float32", device="cpu", backend="transformers")
    assert llm.engine.path == "generate" and llm.engine.runner.method_name == "generate"
    prompt = [5, 17, 42, 99, 3, 7]
    out = llm.generate(prompt, gen_length=8)[0]
    with torch.inference_mode():
        expected = ref.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False)[0, len(prompt) :]
    assert out.output_ids == expected.tolist()[: len(out.output_ids)]
    assert out.query_lengths[0] == len(prompt) and out.nfe == len(out.query_lengths) >= 1
    # dLLM fields a plain `generate` cannot honour are refused, not silently dropped.
    given: dict[str, Any] = {"steps": 2, "block_length": 4, "threshold": 0.5, "remasking": "random", "cfg_scale": 1.0}
    given.update(suffix=(1, 2), logprobs=1)  # nor can it infill or report committing-step logprobs
    given["stop_token_ids"] = [3]  # dlm's own stop rules: the method knows only its EOS
    given["response_format"] = '{"type": "json_object"}'
    assert llm.engine.capabilities == ("n",)
    for field, value in given.items():
        with pytest.raises(Unsupported, match=f"^{field} does not apply"):
            llm.generate(prompt, gen_length=8, **{field: value})
    assert llm.engine.validate(GenerationParams(gen_length=8), len(prompt)).steps is None  # no step count applies
    # Temperature 0 is greedy even when the model's generation config prefers sampling;
    # temperature > 0 samples through the model's own generate, reproducibly with a seed.
    llm.engine.runner.hf.generation_config.do_sample = True
    assert llm.generate(prompt, gen_length=8)[0].output_ids == out.output_ids
    sampled = llm.generate(prompt, gen_length=8, temperature=5.0, seed=4)[0]
    torch.manual_seed(4)
    with torch.inference_mode():
        expected = ref.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=True, temperature=5.0)
    assert sampled.output_ids == expected[0, len(prompt) :].tolist()[: len(sampled.output_ids)]


def test_native_dllm_end_to_end_through_cli(tmp_path: Path) -> None:
    """transformers' native block-diffusion model (DiffusionGemma) through `dlm generate`."""
    from transformers import DiffusionGemmaForBlockDiffusion

    save_tiny_diffusion_gemma(tmp_path, vocab_size=128)
    model = DiffusionGemmaForBlockDiffusion.from_pretrained(tmp_path, dtype=torch.float32).eval()
    prompt = [21, 82, 90, 108, 40]
    result = CliRunner().invoke(
        app,
        [
            "generate",
            str(tmp_path),
            "--prompt-ids",
            ",".join(map(str, prompt)),
            "--gen-length",
            "16",
            "--seed",
            "1",
            "--backend",
            "transformers",
            "--dtype",
            "float32",
            "--device",
            "cpu",
            "--json",
        ],
    )
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["backend"] == {"name": "transformers", "path": "generate"}
    assert "generate path" in result.stderr
    torch.manual_seed(1)
    with torch.inference_mode():
        expected = model.generate(torch.tensor([prompt]), max_new_tokens=16).sequences[0, len(prompt) :]
    assert data["output_ids"] == expected.tolist()[:16]


def test_a_model_answering_a_fixed_canvas_takes_the_generate_path_even_with_a_mask_id() -> None:
    """`dlm generate tiny:diffusion_gemma --backend transformers`: its tokenizer names a MASK,
    and its forward is bidirectional, so the forward path was chosen; but the forward answers
    its canvas (32 positions) whatever the input's length, and the first step ended in a
    RuntimeError traceback ('index 32 is out of bounds for dimension 1 with size 32'). The
    forward path needs one output per input position; such a model takes the generate path."""
    result = CliRunner().invoke(
        app,
        ["generate", "tiny:diffusion_gemma", "--backend", "transformers", "--prompt", "hi"]
        + ["--gen-length", "32", "--device", "cpu", "--json"],
    )
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["backend"] == {"name": "transformers", "path": "generate"}


def test_generate_path_of_a_model_whose_generate_skips_its_forward_counts_and_repeats(tmp_path: Path) -> None:
    """transformers' DiffusionGemma `generate` runs its decoder and LM head, never the model's
    top-level forward: nfe (the server's denoising_steps) was 0, which `dlm validate`'s usage
    check fails; and it samples by its own config, so two requests at temperature 0 without
    a seed answered differently (validate's determinism). nfe now counts LM-head passes when
    the top-level forward is not used (48 here, as the native DiffusionGemma spends), and
    temperature 0 without a seed runs seeded 0, as dlm's own DiffusionGemma does."""
    save_tiny_diffusion_gemma(tmp_path, vocab_size=128, canvas_length=32)
    llm = LLM(tmp_path, dtype="float32", device="cpu", backend="transformers")
    assert llm.engine.path == "generate"
    first, second = (llm.generate([21, 82, 90], gen_length=32)[0] for _ in range(2))
    assert first.nfe > 0 and len(first.query_lengths) == first.nfe
    assert first.output_ids == second.output_ids
    seeded = llm.generate([21, 82, 90], gen_length=32, seed=1)[0]
    assert seeded.output_ids != first.output_ids  # a seed still chooses the sample


@pytest.mark.slow
def test_a_scripts_stderr_gets_no_torchao_warnings_and_no_progress_bar(tmp_path: Path) -> None:
    """`dlm generate tiny:diffusion_gemma --backend transformers` (building the tiny model, then
    loading it with transformers) wrote torchao's 'Failed to load ...' lines, torch's
    register_constant warnings (transformers' model classes import torchao) and transformers'
    'Loading weights' bar to a stderr that is no terminal; dlm quiets the first two where it
    imports torchao itself, and draws progress bars only on a terminal (docs/cli.md)."""
    import os
    import subprocess
    import sys

    from tests.weights_helpers import ROOT

    env = {**os.environ, "DLM_HOME": str(tmp_path), "OMP_NUM_THREADS": "1"}
    run = subprocess.run(
        [sys.executable, "-m", "dlm", "generate", "tiny:diffusion_gemma", "--backend", "transformers"]
        + ["--prompt", "hi", "--gen-length", "32", "--device", "cpu"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    for noise in ("Failed to load", "register_constant", "Loading weights", "\r"):
        assert noise not in run.stderr, run.stderr[-2000:]
    assert "generate path" in run.stderr


REMOTE_CONFIG = """
import pathlib
from transformers import BertConfig
pathlib.Path(__file__).with_name("EXECUTED").write_text("yes")
class RemoteConfig(BertConfig):
    model_type = "remote_dllm"
"""


def _variant(source: Path, directory: Path, **config: Any) -> Path:
    """A copy of checkpoint `source` at `directory` with `config` changed in its config.json."""
    directory.mkdir()
    for item in source.iterdir():
        (directory / item.name).write_bytes(item.read_bytes())
    raw = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**raw, **config}))
    return directory


def test_remote_code_needs_explicit_trust(masked_lm: Path, tmp_path: Path) -> None:
    remote = {"AutoConfig": "configuration_remote.RemoteConfig"}
    directory = _variant(masked_lm, tmp_path / "remote", model_type="remote_dllm", auto_map=remote)
    (directory / "configuration_remote.py").write_text(REMOTE_CONFIG)
    with pytest.raises(UsageError, match="--trust-remote-code"):
        LLM(directory, dtype="float32", device="cpu", backend="transformers")
    assert not (directory / "EXECUTED").exists()
    result = CliRunner().invoke(
        app, ["generate", str(directory), "--prompt-ids", "1,2", "--backend", "transformers", "--device", "cpu"]
    )
    assert result.exit_code == 2 and "--trust-remote-code" in result.stderr
    with pytest.raises(UsageError, match="only applies"):
        LLM(masked_lm, device="cpu", trust_remote_code=True)


def test_unknown_model_type_without_code_is_one_line(masked_lm: Path, tmp_path: Path) -> None:
    """A model type transformers does not know and no code of its own: one clear line, not
    transformers' paragraph of upgrade advice."""
    directory = _variant(masked_lm, tmp_path / "unknown", model_type="no_such_dllm")
    result = CliRunner().invoke(
        app, ["generate", str(directory), "--prompt-ids", "1,2", "--backend", "transformers", "--device", "cpu"]
    )
    assert result.exit_code == 2
    assert "does not know model type 'no_such_dllm'" in result.stderr and "no auto_map" in result.stderr
    assert "pip install" not in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr
