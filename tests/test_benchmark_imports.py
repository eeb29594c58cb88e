"""Every name a benchmark or script imports from a sibling benchmark or script exists there.

Benchmarks are not tests, so nothing runs them between their runs: when dtype_auto.py moved its
checkpoint writer to vs_peers.py, benchmarks/quantization.py and decode_vs_reference.py kept
importing it from dtype_auto and failed at their first line of work, which a user following
docs/quantization.md met. Read from the source (the scripts' imports run torch and write
checkpoints), including imports inside functions, which is where quantization.py's was.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# benchmarks/quantization.py puts both folders on sys.path, so a bare `from x import` may be either.
FOLDERS = ("benchmarks", "scripts")
SOURCES = sorted(path for folder in FOLDERS for path in (ROOT / folder).glob("*.py"))


def sibling(module: str) -> Path | None:
    """The benchmarks/ or scripts/ file an import names (`benchmarks.x`, or a bare `x`), else None."""
    folder, _, name = module.rpartition(".")
    if folder and folder in FOLDERS:
        path = ROOT / folder / f"{name}.py"
        return path if path.exists() else None
    if not folder:
        return next((ROOT / f / f"{name}.py" for f in FOLDERS if (ROOT / f / f"{name}.py").exists()), None)
    return None


def top_level_names(path: Path) -> set[str]:
    """What `from module import NAME` can take from this file: its top-level definitions and imports."""
    names: set[str] = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names.update(t.id for target in node.targets for t in ast.walk(target) if isinstance(t, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, ast.Import | ast.ImportFrom):
            names.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
    return names


@pytest.mark.parametrize("source", SOURCES, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_imports_from_siblings_exist(source: Path) -> None:
    missing = []
    for node in ast.walk(ast.parse(source.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            target = sibling(node.module)
            if target is None:
                continue
            defined = top_level_names(target)
            missing += [
                f"line {node.lineno}: {alias.name} from {target.relative_to(ROOT)}"
                for alias in node.names
                if alias.name not in defined
            ]
    assert not missing, f"{source.relative_to(ROOT)} imports names its sibling does not define: {missing}"
