"""Arguments shared, word for word, by the commands that load a model themselves (`dlm
generate`, `dlm serve`, `dlm batch`); defaults of None mean "not given", so `dlm serve` and
`dlm batch` can take the value from their settings file or DLM_* variables instead."""

from __future__ import annotations

from typing import Any

import typer

from dlm.engine.quantization import CHOICES

MODEL_ARGUMENT: Any = typer.Argument(
    None,
    help="Checkpoint directory, store name (NAME or NAME@VERSION) or tiny:FAMILY "
    "(default: the embedded default model).",
)
DEVICE_OPTION: Any = typer.Option(None, "--device", help="auto, cpu, cuda, cuda:N.")
QUANTIZATION_OPTION: Any = typer.Option(
    None,
    "--quantization",
    help=f"Weights of the linear layers and experts: {', '.join(CHOICES)} "
    "(quantized at load; fp8 on CUDA only; docs/quantization.md) [none, or the checkpoint's own].",
)
