"""Tokens per forward of DiffusionGemma's entropy-bound sampler: dlm beside transformers.

For each entropy bound, both decode the same prompts from the same seed on the same tiny
random checkpoint (written by transformers' own classes, float32) and we report generated
tokens / decoder forwards, as transformers' `tokens_per_forward` defines it (tokens after
EOS excluded). The ids must be equal, so the counts must be too: the table shows how the
bound trades forwards for parallelism, and that dlm spends exactly the reference's forwards.

    python benchmarks/canvas_tokens_per_forward.py [--bounds 0.1 0.5 2 5] [--gen-length 64]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from dlm.engine.diffusion_gemma_checkpoint import save_tiny_diffusion_gemma  # noqa: E402
from dlm.engine.llm import LLM  # noqa: E402
from tests.diffusion_gemma_reference import params, reference_generate  # noqa: E402

PROMPTS = [[5, 6, 7, 8, 9], [3] * 11, list(range(10, 30)), [7, 9]]
EOS, PAD = 1, 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bounds", type=float, nargs="+", default=[0.1, 0.5, 2.0, 5.0])
    ap.add_argument("--gen-length", type=int, default=64)
    ap.add_argument("--canvas-length", type=int, default=16)
    ap.add_argument("--steps", type=int, default=48, help="max denoising steps per canvas")
    ap.add_argument("--confidence-threshold", type=float, default=0.5)
    args = ap.parse_args()
    torch.set_num_threads(1)
    from transformers import DiffusionGemmaForBlockDiffusion

    with tempfile.TemporaryDirectory() as tmp:
        directory = save_tiny_diffusion_gemma(Path(tmp) / "tiny")
        reference = DiffusionGemmaForBlockDiffusion.from_pretrained(directory, dtype=torch.float32).eval()
        llm = LLM(directory, dtype="float32", device="cpu")
        print("| entropy bound | dlm tokens/forward | transformers tokens/forward | same ids |")
        print("|---|---|---|---|")
        for bound in args.bounds:
            ours_tokens = ours_forwards = ref_tokens = ref_forwards = 0
            same = True
            for seed, prompt in enumerate(PROMPTS):
                case = (
                    prompt,
                    args.canvas_length,
                    bound,
                    args.confidence_threshold,
                    args.steps,
                    args.gen_length,
                    seed,
                )
                ids, forwards = reference_generate(reference, prompt, case, eos=EOS)
                out = llm.generate(prompt, params(case))[0]
                same &= out.output_ids == ids
                ref_tokens += sum(t != PAD for t in ids)
                ref_forwards += forwards
                ours_tokens += sum(t != PAD for t in out.output_ids)
                ours_forwards += out.nfe
            print(
                f"| {bound:g} | {ours_tokens / ours_forwards:.3f} | {ref_tokens / ref_forwards:.3f} | "
                f"{'yes' if same else 'NO'} |"
            )


if __name__ == "__main__":
    main()
