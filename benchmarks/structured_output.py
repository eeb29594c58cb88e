"""Structured output vs unconstrained decoding of the same length: forwards per answer.

    python benchmarks/structured_output.py [MODEL] [--device cpu] [--threshold T]

MODEL: a checkpoint, `tiny:FAMILY` or nothing (the embedded default model). For each schema
below, one request with `response_format` and one plain request whose `max_tokens` is the
skeleton's length (so both decode the same canvas), in the same run with the same
parameters (default: one token per step; `--threshold` for Fast-dLLM's rule). Reported:
forwards per answer of each, their ratio, the skeleton's length and its value positions,
and the side-by-side wall-clock ratio. With random weights the values are gibberish, but
the forwards are what decoding costs whatever the weights.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dlm.engine.llm import LLM  # noqa: E402
from dlm.engine.params import GenerationParams  # noqa: E402

SCHEMAS: dict[str, dict[str, Any]] = {
    "person": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 12},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "email_verified": {"type": "boolean"},
            "role": {"enum": ["admin", "editor", "viewer"]},
        },
        "required": ["name", "age"],
    },
    "order": {
        "type": "object",
        "properties": {
            "order_id": {"type": "integer", "minimum": 1},
            "items": {
                "type": "array",
                "maxItems": 3,
                "items": {
                    "type": "object",
                    "properties": {"sku": {"type": "string", "maxLength": 8}, "quantity": {"type": "integer"}},
                },
            },
            "total": {"type": "number", "minimum": 0},
            "status": {"enum": ["pending", "shipped", "delivered"]},
        },
    },
    "flags": {"type": "object", "properties": {k: {"type": "boolean"} for k in "abcdefgh"}},
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model", nargs="?", default=None)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--threshold", type=float, default=None)
    args = parser.parse_args()
    llm = LLM(args.model, device=args.device)
    prompt = llm.encode("Answer in JSON.")
    print(f"model {args.model or 'default'}, threshold {args.threshold}")
    print(
        "| schema | skeleton tokens | value positions | forwards, structured | forwards, plain | ratio | time ratio |"
    )
    print("|---|---|---|---|---|---|---|")
    for name, schema in SCHEMAS.items():
        fmt = json.dumps({"type": "json_schema", "json_schema": {"name": name, "schema": schema}})
        probe = llm.engine.make_sequence(prompt, GenerationParams(gen_length=512, response_format=fmt))
        laid = probe.output_ids  # the skeleton, then EOS to the end
        length = max(i for i, t in enumerate(laid) if t != llm.config.eos_token_id) + 1
        slots = probe.masks_left
        runs = {}
        for kind, extra in (("structured", {"response_format": fmt}), ("plain", {})):
            params = GenerationParams(gen_length=length, threshold=args.threshold, **extra)
            start = time.perf_counter()
            out = llm.engine.generate([prompt], params)[0]
            runs[kind] = (out.nfe, time.perf_counter() - start)
        (s_nfe, s_time), (p_nfe, p_time) = runs["structured"], runs["plain"]
        print(f"| {name} | {length} | {slots} | {s_nfe} | {p_nfe} | {s_nfe / p_nfe:.2f} | {s_time / p_time:.2f} |")


if __name__ == "__main__":
    main()
