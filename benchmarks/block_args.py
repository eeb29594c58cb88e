"""The options every block-causal benchmark takes (benchmarks/block_diffusion.py,
benchmarks/prefix_reuse.py): an optional checkpoint, else a tiny one of --family written with
random weights, the parallel-decoding threshold, the rounds, and where it runs."""

from __future__ import annotations

import argparse

BLOCK_FAMILIES = ("llada2_moe", "sdar", "sdar_moe", "pangu")


def block_parser(doc: str | None, family: str) -> argparse.ArgumentParser:
    """A parser with the shared options (`family`: the default --family); the script adds its own."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?", default=None)
    ap.add_argument("--family", default=family, choices=BLOCK_FAMILIES)
    ap.add_argument("--threshold", type=float, default=0.9)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--device", default="cpu")
    return ap
