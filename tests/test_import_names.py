"""dlm's import names are its own: no other installed distribution provides them, and the
transformers modules dlm relies on import from the project root.

Why: a top-level import name is one slot per environment. Our package was once called `kernels`,
which is also Hugging Face's `kernels` distribution (a transformers 5.25 dependency): from the
project root transformers imported ours and failed, and `pip install .` wrote our `__init__.py`
over theirs. These tests fail as soon as any shipped name is claimed twice.
"""

from __future__ import annotations

import ast
import fnmatch
import importlib.metadata
import subprocess
import sys

import pytest

from tests.cli_process import ROOT

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib


def shipped_top_level_names() -> set[str]:
    """The top-level import names `pip install .` installs, read from pyproject.toml's
    package-finding rules and the directories they match (so a new package joins by itself)."""
    find = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    patterns = find["include"]
    names = {
        path.name
        for path in ROOT.iterdir()
        if (path / "__init__.py").is_file() and any(fnmatch.fnmatch(path.name, p) for p in patterns)
    }
    assert names, f"no top-level package matches {patterns}"
    return names


def test_the_shipped_package_is_dlm_alone() -> None:
    """One name, the distribution's own (docs/architecture.md says why)."""
    assert shipped_top_level_names() == {"dlm"}


def foreign_providers(names: set[str]) -> dict[str, list[str]]:
    """The installed distributions other than dlm that provide each of `names` (only names
    with at least one)."""
    providers = importlib.metadata.packages_distributions()
    ours = importlib.metadata.distribution("dlm").metadata["Name"].lower()
    found = {name: sorted({d for d in providers.get(name, []) if d.lower() != ours}) for name in names}
    return {name: dists for name, dists in found.items() if dists}


def test_no_other_distribution_provides_our_import_names() -> None:
    assert foreign_providers(shipped_top_level_names()) == {}


def test_the_guard_sees_the_old_clash() -> None:
    """The check above would have caught the old layout: a top-level `kernels` is Hugging Face's
    wherever transformers >= 5.25 is installed."""
    if "kernels" not in importlib.metadata.packages_distributions():
        pytest.skip("Hugging Face's `kernels` distribution is not installed (transformers < 5.25)")
    assert "kernels" in foreign_providers(shipped_top_level_names() | {"kernels"})


def transformers_imports() -> list[str]:
    """Every `from transformers... import X` / `import transformers...` statement in the dlm
    package, as one Python statement each (read from the source, so new ones join by themselves)."""
    statements: set[str] = set()
    for path in sorted((ROOT / "dlm").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "transformers":
                names = ", ".join(alias.name for alias in node.names)
                statements.add(f"from {node.module} import {names}")
            elif isinstance(node, ast.Import):
                statements.update(
                    f"import {alias.name}" for alias in node.names if alias.name.split(".")[0] == "transformers"
                )
    return sorted(statements)


def test_transformers_imports_work_from_the_project_root() -> None:
    """`python -c` with the project root as the working directory (first on sys.path, as for
    `python -m pytest`): transformers' hub-kernels integration and every transformers import dlm
    makes must work there, and `kernels` must not resolve into this checkout."""
    statements = transformers_imports()
    assert statements, "dlm imports nothing from transformers? the scan is broken"
    code = "\n".join(
        [
            "import transformers.integrations.hub_kernels",
            *statements,
            "import importlib.util, pathlib, sys",
            "spec = importlib.util.find_spec('kernels')",
            "root = pathlib.Path.cwd().resolve()",
            "origin = pathlib.Path(spec.origin).resolve() if spec and spec.origin else None",
            "sys.exit(origin is not None and origin.parent.parent == root)",  # a package dir at the root
        ]
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]


def test_no_script_shadows_a_library_it_runs_beside() -> None:
    """`python benchmarks/X.py` puts benchmarks/ first on sys.path, so a script there named like
    an installed distribution's import name (or the standard library's) is what every import
    of that name gets. benchmarks/kernels.py did that: on a GPU, benchmarks/gpu_check.py's
    transformers 5.25 imported it instead of Hugging Face's `kernels` and failed."""
    taken = set(importlib.metadata.packages_distributions()) | set(sys.stdlib_module_names)
    scripts = [path for folder in ("benchmarks", "scripts") for path in (ROOT / folder).iterdir()]
    names = {path.stem for path in scripts if path.suffix == ".py" or (path / "__init__.py").is_file()}
    assert "gpu_check" in names
    assert sorted(names & taken) == []
