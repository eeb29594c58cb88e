"""LLaDA2.1 draft-and-edit: tokens per forward with editing vs without, beside SGLang's count.

    python benchmarks/draft_edit.py [MODEL_DIR] [--data tests/data/llada2_edit]

For every reference vector (tests/data/llada2_edit, made by SGLang's JointThreshold on the
tiny LLaDA2 checkpoint; MODEL_DIR defaults to ../shared/reference/models/llada2_tiny) the
engine decodes the same prompt three ways on the same weights, exact block cache, float32:
- edit: draft-and-edit with the vector's thresholds (must equal the reference's ids);
- fill only: the same rule with edit threshold 1 (no token is ever edited): what the
  edits themselves cost or save;
- LLaDA2.0 rule: the family's threshold rule (dInfer's) at the same mask-to-token
  threshold, no edits;
- SGLang: the reference's forwards for the same ids (one more per block than the engine:
  the forward after a finished block that persists its K/V, which dlm folds into the next
  block's first forward).
Tokens per forward (TPF) = generated tokens (every block after the prompt) / forwards.
Counts only, no timings. Random weights: the model was never trained to edit, so its edits
oscillate until the post-edit budget runs out; a trained LLaDA2.1 stops editing once its
draft is right (the model card's S mode ~5.3 TPF vs LLaDA2.0's ~2.6 needs real weights).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from dlm.engine.llm import LLM  # noqa: E402
from dlm.engine.params import GenerationParams  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
REFERENCE = Path(os.environ.get("DLM_REFERENCE_DIR", ROOT.parent / "shared" / "reference"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", type=Path, default=REFERENCE / "models" / "llada2_tiny")
    parser.add_argument("--data", type=Path, default=ROOT / "tests" / "data" / "llada2_edit")
    args = parser.parse_args()
    torch.set_num_threads(1)
    engine = LLM(args.model, dtype="float32", device="cpu").engine
    config = engine.config
    print("| vector | thresholds (M2T / T2T / post) | tokens | edit: forwards, TPF | fill only: forwards, TPF "
          "| LLaDA2.0 rule: forwards, TPF | SGLang: forwards, TPF | same ids as SGLang |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    totals = {"edit": [0, 0], "fill": [0, 0], "plain": [0, 0], "sglang": [0, 0]}
    for path in sorted(args.data.glob("*.json")):
        meta = json.loads(path.read_text())
        c = meta["algorithm_config"]
        engine.config = dataclasses.replace(config, eos_token_id=meta["eos_id"])
        common = {"gen_length": meta["gen_length"], "threshold": c["threshold"], "cache": "block"}
        post = int(c["max_post_edit_steps"])
        edit = engine.generate(
            [meta["prompt_ids"]],
            GenerationParams(**common, edit_threshold=c["edit_threshold"], max_post_edit_steps=post),
        )[0]
        fill = engine.generate(
            [meta["prompt_ids"]], GenerationParams(**common, edit_threshold=1.0, max_post_edit_steps=post)
        )[0]
        plain = engine.generate([meta["prompt_ids"]], GenerationParams(**common))[0]
        reference = len(meta["generated_ids_raw"]), sum(meta["nfe_per_block"])
        rows = {
            "edit": (len(edit.generated_ids), edit.nfe),
            "fill": (len(fill.generated_ids), fill.nfe),
            "plain": (len(plain.generated_ids), plain.nfe),
            "sglang": reference,
        }
        for key, (tokens, forwards) in rows.items():
            totals[key][0] += tokens
            totals[key][1] += forwards
        cells = [f"{f}, {t / f:.2f}" for t, f in rows.values()]
        same = edit.generated_ids == meta["generated_ids_raw"]
        thresholds = f"{c['threshold']} / {c['edit_threshold']} / {int(c['max_post_edit_steps'])}"
        print(f"| {meta['name']} | {thresholds} | {reference[0]} | {' | '.join(cells)} | {'yes' if same else 'NO'} |")
    engine.config = config
    cells = [f"{f}, {t / f:.2f}" for t, f in totals.values()]
    print(f"| all | | {totals['sglang'][0]} | {' | '.join(cells)} | |")


if __name__ == "__main__":
    main()
