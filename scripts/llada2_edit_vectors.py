"""Make tests/data/llada2_edit/: SGLang's JointThreshold (LLaDA2.1 draft-and-edit) decoding a
tiny LLaDA2 checkpoint, for several prompts and thresholds.

Usage:
    python scripts/llada2_edit_vectors.py SGLANG_PYTHON_DIR [--model DIR] [--out DIR]

SGLANG_PYTHON_DIR is the `python/` folder of an sgl-project/sglang checkout (at least
`sglang/srt/dllm/algorithm/base.py` and `joint_threshold.py`). Those two files run
unchanged: `DllmAlgorithm._run_sync` (the block loop: a forward, then a step, until every
block is done or `max_steps`) and `JointThreshold.step` (the rule). Only the serving
plumbing around them is stubbed here: the config object, the forward batch (one block of
ids), the model runner (our tiny checkpoint's forward over prompt + decoded blocks + the
block, block-causal, float32, no cache) and the scheduler's outer loop (absolute block
grid from floor(P/B)*B, stop after a block holding EOS or at the end of the grid), as
SGLang's dLLM scheduler lays out blocks for LLaDA2.

Recorded per case: the raw block ids after the prompt (`generated_ids_raw`), and the
forwards `_run_sync` spent on each block (`nfe_per_block`: it counts one forward after a
block is finished, which persists the block's K/V in SGLang). Prompt prefill forwards are
the scheduler's, not the algorithm's, and are not counted.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import subprocess
import sys
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from dlm.engine.llm import LLM
from dlm.engine.runtime.block_batch import BlockBatch

ROOT = Path(__file__).resolve().parents[1]
# The shared reference checkpoint beside the clone (DLM_REFERENCE_DIR, as the tests find it).
DEFAULT_MODEL = (
    Path(os.environ.get("DLM_REFERENCE_DIR", ROOT.parent / "shared" / "reference")) / "models" / "llada2_tiny"
)
BLOCK = 32
PROMPT_VOCAB = 2000  # prompt ids below the tiny checkpoint's special ids (EOS 2017, MASK 2020)
# (name, prompt length, gen_length, algorithm_config[, stop id instead of the config's EOS])
CASES: list[tuple[Any, ...]] = [
    ("speed_p20", 20, 64, {"threshold": 0.5, "edit_threshold": 0.0, "max_post_edit_steps": 16}),
    ("quality_p20", 20, 64, {"threshold": 0.7, "edit_threshold": 0.5, "max_post_edit_steps": 16}),
    ("speed_p40", 40, 64, {"threshold": 0.5, "edit_threshold": 0.0, "max_post_edit_steps": 16}),
    ("quality_p7", 7, 96, {"threshold": 0.7, "edit_threshold": 0.5, "max_post_edit_steps": 16}),
    ("thr0.9_edit0.3_post3_p33", 33, 64, {"threshold": 0.9, "edit_threshold": 0.3, "max_post_edit_steps": 3}),
    ("thr0.3_edit0.8_post0_p12", 12, 64, {"threshold": 0.3, "edit_threshold": 0.8, "max_post_edit_steps": 0}),
    ("speed_p20_stop1969", 20, 64, {"threshold": 0.5, "edit_threshold": 0.0, "max_post_edit_steps": 16}, 1969),
]


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor
    batch_size: int = 1


@dataclass
class DllmConfig:
    block_size: int
    mask_id: int
    algorithm_config: dict[str, Any] = field(default_factory=dict)
    first_done_first_out_mode: bool = False


def _stub_modules(sglang_python: Path) -> None:
    """Register the plumbing modules `base.py` and `joint_threshold.py` import; the
    algorithm package's own files load from the checkout."""

    def module(name: str, path: Path | None = None, **attrs: Any) -> None:
        mod = types.ModuleType(name)
        if path is not None:
            mod.__path__ = [str(path)]
        mod.__dict__.update(attrs)
        sys.modules[name] = mod

    root = sglang_python / "sglang"
    module("sglang", root)
    module("sglang.srt", root / "srt")
    module("sglang.srt.dllm", root / "srt" / "dllm")
    module("sglang.srt.dllm.algorithm", root / "srt" / "dllm" / "algorithm", get_algorithm=None)
    module("sglang.srt.dllm.config", DllmConfig=DllmConfig)
    module("sglang.srt.layers", root / "srt" / "layers")
    module("sglang.srt.layers.logits_processor", LogitsProcessorOutput=object)
    module("sglang.srt.model_executor", root / "srt" / "model_executor")
    module("sglang.srt.model_executor.forward_batch_info", ForwardBatch=ForwardBatch)
    module("sglang.srt.model_executor.model_runner", ModelRunner=object)
    module("sglang.srt.server_args", ServerArgs=object)


class BlockRunner:
    """SGLang's model runner for one block: logits of the block's rows given the context."""

    def __init__(self, model: torch.nn.Module, context: torch.Tensor) -> None:
        self.model, self.context, self.forwards = model, context, 0

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, pp_proxy_tensors: Any = None) -> Any:
        self.forwards += 1
        s = len(self.context)
        x = torch.cat([self.context, batch.input_ids])
        pos = torch.arange(len(x))
        groups = torch.where(pos < s, pos // BLOCK * BLOCK, torch.full_like(pos, s))
        hidden = self.model(BlockBatch(x[None], pos[None], groups[None], pos[None]))
        logits = (hidden @ self.model.lm_head_weight.T)[0, s:].float()
        return types.SimpleNamespace(logits_output=types.SimpleNamespace(full_logits=logits), can_run_graph=False)


def generate(
    algorithm: Any, model: torch.nn.Module, prompt: list[int], gen: int, mask_id: int, eos_id: int
) -> tuple[list[int], list[int]]:
    p = len(prompt)
    end = -(-(p + gen) // BLOCK) * BLOCK
    x = torch.full((end,), mask_id, dtype=torch.long)
    x[:p] = torch.tensor(prompt)
    per_block = []
    for s in range(p // BLOCK * BLOCK, end, BLOCK):
        batch = ForwardBatch(x[s : s + BLOCK].clone())
        runner = BlockRunner(model, x[:s])
        algorithm._run_sync(runner, batch)
        x[s : s + BLOCK] = batch.input_ids
        per_block.append(runner.forwards)
        if bool((x[p : s + BLOCK] == eos_id).any()):
            return x[p : s + BLOCK].tolist(), per_block
    return x[p:end].tolist(), per_block


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sglang_python", type=Path)
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    parser.add_argument("--out", type=Path, default=ROOT / "tests" / "data" / "llada2_edit")
    parser.add_argument("--commit", default="", help="sglang commit of the files (default: the folder's git HEAD)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    _stub_modules(args.sglang_python.resolve())
    joint = importlib.import_module("sglang.srt.dllm.algorithm.joint_threshold")
    llm = LLM(args.model, dtype="float32", device="cpu")
    config = llm.engine.config
    model = llm.engine.loaded.model
    commit = (
        args.commit
        or subprocess.run(
            ["git", "-C", str(args.sglang_python), "rev-parse", "HEAD"], capture_output=True, text=True
        ).stdout.strip()
    )
    args.out.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(0)
    for name, length, gen, algo_config, *stop in CASES:
        prompt = torch.randint(0, PROMPT_VOCAB, (length,), generator=generator).tolist()
        algorithm = joint.JointThreshold(DllmConfig(BLOCK, config.mask_token_id, dict(algo_config)))
        eos = stop[0] if stop else config.eos_token_id
        ids, per_block = generate(algorithm, model, prompt, gen, config.mask_token_id, eos)
        record = {
            "name": name,
            "reference": "sglang python/sglang/srt/dllm/algorithm/joint_threshold.py JointThreshold "
            "via base.py DllmAlgorithm._run_sync",
            "sglang_commit": commit or "unknown",
            "model_dir": args.model.name,
            "block_length": BLOCK,
            "gen_length": gen,
            "algorithm_config": algo_config,
            "mask_id": config.mask_token_id,
            "eos_id": eos,
            "prompt_ids": prompt,
            "generated_ids_raw": ids,
            "nfe_per_block": per_block,
        }
        (args.out / f"{name}.json").write_text(json.dumps(record) + "\n")
        print(name, "blocks", len(per_block), "forwards", per_block, "tokens", len(ids))


if __name__ == "__main__":
    main()
