"""Start dlmserve (PyPI) on a checkpoint other than LLaDA-8B: run with the peer's own Python.

    python dlmserve_main.py --mask-token '<|mask|>' --mask-id 1 --port 8000

with DLMSERVE_MODEL (the checkpoint directory) and DLMSERVE_DTYPE in the environment, as
dlmserve reads them. dlmserve hard-codes LLaDA-8B's mask token and id (`<|mdm_mask|>`, 126336)
and refuses a tokenizer without them; the one workaround here points both at the
checkpoint's own mask token before the server loads, nothing else of dlmserve is changed.
`--float32` (benchmarks/vs_peers.py --dtype float32, an identity check, not a default) loads
the weights in fp32, which dlmserve has no setting for.
"""

from __future__ import annotations

import argparse
import os
from typing import Any


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mask-token", required=True)
    ap.add_argument("--mask-id", type=int, required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--float32", action="store_true", help="load the weights in fp32 (not a dlmserve dtype)")
    args = ap.parse_args()

    import uvicorn
    from dlmserve import engine
    from dlmserve.models import llada

    load = llada.load_llada
    llada.MASK_TOKEN, llada.MASK_ID = args.mask_token, args.mask_id

    def load_with_mask(*a: Any, **k: Any) -> Any:
        loaded = load(*a, **k)
        loaded.mask_id = args.mask_id  # the dataclass default was bound to 126336
        return loaded

    llada.load_llada = engine.load_llada = load_with_mask
    if args.float32:  # for an identity check only: dlmserve's unquantised dtype is bf16
        import torch

        from_pretrained = llada.AutoModel.from_pretrained

        def fp32(*a: Any, **k: Any) -> Any:
            return from_pretrained(*a, **{**k, "torch_dtype": torch.float32})

        llada.AutoModel.from_pretrained = fp32  # type: ignore[method-assign]
    uvicorn.run("dlmserve.api.server:app", host="127.0.0.1", port=args.port, log_level="warning")


if __name__ == "__main__":
    os.environ.setdefault("DLMSERVE_LOG_LEVEL", "warning")
    main()
