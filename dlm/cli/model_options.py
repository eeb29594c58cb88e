"""The MODEL argument, shared word for word by the commands that load a model themselves
(`dlm generate`, `dlm serve`); None means the embedded default model. (Their other shared
options are serve settings: dlm/cli/setting_options.py.)"""

from __future__ import annotations

from typing import Any

import typer

MODEL_ARGUMENT: Any = typer.Argument(
    None,
    help="Checkpoint directory, store name (NAME or NAME@VERSION) or tiny:FAMILY "
    "(default: the embedded default model).",
)
