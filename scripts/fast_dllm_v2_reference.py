"""Make the Fast-dLLM v2 reference vectors in tests/data/fast_dllm_v2/ by running the
authors' own code on dlm's tiny random checkpoint.

    python scripts/fast_dllm_v2_reference.py REFERENCE_DIR [OUT_DIR]

REFERENCE_DIR holds the hub's remote code of Efficient-Large-Model/Fast_dLLM_v2_7B
(`modeling.py`, `configuration.py`: the model and its `generate`, the decoding loop the model
card and NVlabs/Fast-dLLM's `v2/run_chatbot.py` call), e.g. a checkout of the hub repository
or of its GitHub mirror (tests/data/fast_dllm_v2/README.md names the one used). It needs the
transformers version the checkpoint was saved with (4.53, with tokenizers < 0.22,
huggingface_hub < 1.0 and einops; its remote code does not import under 5.x): run this with
those first on PYTHONPATH and dlm's worktree after them. CPU, float32, temperature 0;
nothing is stubbed: the script only records the inputs of the model's forwards.

The tiny checkpoint is `dlm.engine.block_checkpoints.write_tiny(dir, "fast_dllm_v2", seed=0)`;
the vectors record the sha256 of its weights so a change of the writer shows up as such.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from dlm.engine.block_checkpoints import write_tiny

SEED = 0
# (prompt length, block size, sub-block size): prompt inside the first block, across a block
# boundary, and exactly at one (the prefill then predicts the first token). A prompt of
# exactly one block is left out: the reference then decodes the block without its prompt.
LAYOUTS = [(5, 8, 2), (19, 8, 2), (16, 8, 2), (11, 16, 4), (21, 16, 4)]
THRESHOLDS = [1.0, 0.9, 0.7, 0.5]  # 1.0: one token per step (nothing passes a strict > 1)
MAX_NEW_TOKENS = 32


def _prompt(length: int, salt: int) -> list[int]:
    g = torch.Generator().manual_seed(1000 + 37 * length + salt)
    return torch.randint(1, 300, (length,), generator=g).tolist()


def _weights_sha256(directory: Path) -> str:
    return hashlib.sha256((directory / "model.safetensors").read_bytes()).hexdigest()


def _counting(model: Any) -> list[torch.Tensor]:
    """Record the input ids of every forward the reference's `generate` makes."""
    calls: list[torch.Tensor] = []
    original = model.forward

    def forward(*args: Any, **kwargs: Any) -> Any:
        calls.append(kwargs["input_ids"].clone())
        return original(*args, **kwargs)

    model.forward = forward
    return calls


def main(reference_dir: Path, out_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = write_tiny(Path(tmp) / "ckpt", "fast_dllm_v2", seed=SEED)
        for name in ("modeling.py", "configuration.py"):
            shutil.copyfile(reference_dir / name, ckpt / name)
        config = json.loads((ckpt / "config.json").read_text())
        weights_sha256 = _weights_sha256(ckpt)
        model = AutoModelForCausalLM.from_pretrained(ckpt, trust_remote_code=True, torch_dtype=torch.float32)
        model.eval()
        calls = _counting(model)
        mask, eos = config["mask_token_id"], config["eos_token_id"]
        cases = []
        for salt, (length, block, small) in enumerate(LAYOUTS):
            prompt = _prompt(length, salt)
            for threshold in THRESHOLDS:
                stops = [eos]
                for stop in stops:
                    calls.clear()
                    out = model.generate(
                        torch.tensor([prompt]),
                        max_new_tokens=MAX_NEW_TOKENS,
                        mask_id=mask,
                        threshold=threshold,
                        small_block_size=small,
                        block_size=block,
                        stop_token=stop,
                        temperature=0,
                    )[0].tolist()
                    generated = out[length:]
                    cases.append(
                        {
                            "prompt_ids": prompt,
                            "block_size": block,
                            "small_block_size": small,
                            "threshold": threshold,
                            "max_new_tokens": MAX_NEW_TOKENS,
                            "stop_token": stop,
                            "generated_ids": generated,
                            "nfe": len(calls),
                            "query_lengths": [c.shape[1] for c in calls],
                        }
                    )
                    if stop == eos and stop not in generated and len(generated) > 6:
                        # A stop the random weights do produce: the token decided mid-way.
                        stops.append(generated[len(generated) // 2])
        # First-forward logits of the first case with a prefill (a prompt longer than a block).
        first = next(c for c in cases if len(c["prompt_ids"]) > c["block_size"])
        block = first["block_size"]
        ids = torch.tensor([first["prompt_ids"][: len(first["prompt_ids"]) // block * block]])
        with torch.no_grad():
            logits = model.forward(input_ids=ids, use_cache=True, update_past_key_values=True, block_size=block).logits
        save_file(
            {"input_ids": ids.contiguous(), "logits": logits.float().contiguous()},
            str(out_dir / "first_forward.safetensors"),
        )
    meta = {
        "reference": "Efficient-Large-Model/Fast_dLLM_v2_7B remote code: modeling.py, "
        "Fast_dLLM_QwenForCausalLM.generate",
        "checkpoint": {"writer": "dlm.engine.block_checkpoints.write_tiny", "family": "fast_dllm_v2", "seed": SEED},
        "weights_sha256": weights_sha256,
        "mask_id": mask,
        "eos_id": eos,
        "temperature": 0,
        "dtype": "float32",
        "first_forward": {"block_size": first["block_size"], "prompt_ids": first["prompt_ids"]},
        "cases": cases,
    }
    (out_dir / "vectors.json").write_text(json.dumps(meta, indent=1) + "\n")


if __name__ == "__main__":
    if len(sys.argv) not in (2, 3):
        sys.exit(__doc__)
    here = Path(__file__).resolve().parent.parent
    main(Path(sys.argv[1]), Path(sys.argv[2]) if len(sys.argv) == 3 else here / "tests/data/fast_dllm_v2")
