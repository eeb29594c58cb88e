"""Reference vectors for Dream's `confidence_threshold` rule without a cache.

Runs Fast-dLLM's Dream `diffusion_generate` (dream/model/generation_utils.py, whole-sequence,
no block cache) with Fast-dLLM's Dream modeling code over the tiny random Dream checkpoint of
the shared reference set (float32, CPU, temperature 0), for several prompts, thresholds and
step counts, and writes what dlm must reproduce: the generated ids, the model forwards
(counted with a forward hook) and the steps the rule ended with (it adds steps when the last
scheduled step leaves positions below the threshold).

The reference code is imported from its checkout, never copied; it needs transformers 4.x
(4.49 was used: its modeling code predates transformers 5's rotary registry), e.g. installed
with `pip install --target DIR transformers==4.49.0 tokenizers==0.21.4 huggingface_hub==0.36.0`
and put first on PYTHONPATH:

    PYTHONPATH=DIR python scripts/make_dream_ct_vectors.py FAST_DLLM_CHECKOUT MODEL_DIR \
        tests/data/dream_ct/confidence_threshold.json --commit SHA
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch

PROMPTS = [
    [17, 301, 2048, 999, 5, 77, 1203, 640],
    [3000, 12, 845, 2210, 96, 1500],
    [42, 4000, 7, 1024, 333, 2777, 90, 1812, 65, 2301, 150, 8],
]
# (gen_length, steps): the rule needs gen_length divisible by steps.
LAYOUTS = [(16, 16), (32, 8), (64, 16), (48, 4)]
THRESHOLDS = [0.3, 0.6, 0.9]


def run_case(model: Any, prompt: list[int], gen_length: int, steps: int, threshold: float) -> dict[str, Any]:
    forwards = 0
    gaps: list[float] = []

    def count(*_: Any) -> None:
        nonlocal forwards
        forwards += 1

    def watch(step: int, x: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        # The decisions' distance from the threshold, to spot a choice decided by rounding.
        conf = torch.softmax(logits[x == model.generation_config.mask_token_id], dim=-1).max(-1).values
        gaps.append(float((conf - threshold).abs().min()))
        return logits

    handle = model.register_forward_hook(count)
    try:
        out = model.diffusion_generate(
            torch.tensor([prompt]),
            max_new_tokens=gen_length,
            steps=steps,
            alg="confidence_threshold",
            threshold=threshold,
            temperature=0.0,
            # transformers 4.x's GenerationConfig would otherwise bring its sampling defaults
            # (top_k 50, top_p 1.0), and Dream's sampler would renormalise over the top 50.
            top_p=None,
            top_k=None,
            generation_logits_hook_func=watch,
            return_dict_in_generate=True,
        )
    finally:
        handle.remove()
    generated = out.sequences[0, len(prompt) :].tolist()
    return {
        "prompt_ids": prompt,
        "gen_length": gen_length,
        "steps": steps,
        "threshold": threshold,
        "generated_ids": generated,
        "nfe": forwards,
        "min_threshold_gap": min(gaps),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkout", type=Path, help="a checkout of NVlabs/Fast-dLLM")
    parser.add_argument("model_dir", type=Path, help="the tiny Dream checkpoint (dream_tiny_v2)")
    parser.add_argument("out", type=Path)
    parser.add_argument("--commit", required=True, help="the checkout's commit, recorded as provenance")
    args = parser.parse_args()
    sys.path.insert(0, str(args.checkout))
    from dream.model.modeling_dream import DreamModel  # Fast-dLLM's copy, with its generation_utils

    torch.set_num_threads(1)
    model = DreamModel.from_pretrained(str(args.model_dir), torch_dtype=torch.float32).eval()
    cases = [
        run_case(model, prompt, gen, steps, thr) for prompt in PROMPTS for gen, steps in LAYOUTS for thr in THRESHOLDS
    ]
    import transformers

    record = {
        "reference": "NVlabs/Fast-dLLM dream/model/generation_utils.py diffusion_generate, alg=confidence_threshold",
        "repo": "NVlabs/Fast-dLLM",
        "commit": args.commit,
        "model": args.model_dir.name,
        "dtype": "float32",
        "temperature": 0.0,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cases": cases,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
