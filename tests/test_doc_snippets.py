"""The Python snippets in README.md and docs/ import what exists.

A reader copies them first; the README's Python API once began `from engine import LLM`, an
import name dlm gave up when its packages moved under `dlm` (docs/install.md, "Import names"),
so the first line a new user ran was a ModuleNotFoundError. The snippets' other lines need
checkpoints from the hub, so only their imports are checked (read with ast, resolved here).
"""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def snippets() -> list[tuple[str, str]]:
    return [
        (f"{page.relative_to(ROOT)}#{n}", code)
        for page in PAGES
        for n, code in enumerate(FENCE.findall(page.read_text()))
    ]


@pytest.mark.parametrize(("where", "code"), snippets(), ids=[where for where, _ in snippets()])
def test_snippet_imports_resolve(where: str, code: str) -> None:
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                importlib.import_module(alias.name)
        elif isinstance(node, ast.ImportFrom) and node.module:
            module = importlib.import_module(node.module)
            for alias in node.names:
                assert hasattr(module, alias.name), f"{where}: {node.module} has no {alias.name}"
