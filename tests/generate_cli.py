"""`dlm generate --json` run in process, for tests that read its JSON.

Always float32 on the CPU: the tests compare ids and numerics in float32, whatever this CPU's
fastest dtype is (`--dtype auto` may pick bf16 on one with native bf16).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from typer.testing import CliRunner

from dlm.cli.main import app


def generate_json(model: Path | str, prompt_ids: Sequence[int], *flags: str) -> dict[str, Any]:
    """`dlm generate MODEL --prompt-ids IDS FLAGS --dtype float32 --device cpu --json`: its output,
    after checking it exited 0."""
    ids = ",".join(map(str, prompt_ids))
    args = ["generate", str(model), "--prompt-ids", ids, *flags, "--dtype", "float32", "--device", "cpu", "--json"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    payload: dict[str, Any] = json.loads(result.stdout)
    return payload
