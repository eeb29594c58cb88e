"""Arguments shared, word for word, by the commands that load a model themselves (`dlm
generate`, `dlm serve`, `dlm batch`); defaults of None mean "not given", so `dlm serve` and
`dlm batch` can take the value from their settings file or DLM_* variables instead."""

from __future__ import annotations

from typing import Any

import typer

MODEL_ARGUMENT: Any = typer.Argument(
    None,
    help="Checkpoint directory, store name (NAME or NAME@VERSION) or tiny:FAMILY "
    "(default: the embedded default model).",
)
DEVICE_OPTION: Any = typer.Option(None, "--device", help="auto, cpu, cuda, cuda:N.")
