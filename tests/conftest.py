"""Shared fixtures: the reference directory, an isolated DLM_HOME, tiny checkpoints."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

# Environment the whole suite needs, set once before any test module is imported:
# Triton kernels run on CPU through the interpreter (set before any kernel is defined).
os.environ["TRITON_INTERPRET"] = "1"
# Each pytest-xdist worker gets its share of the cores (an explicit OMP_NUM_THREADS wins): N
# workers each running torch's default of one thread per core oversubscribe the CPU, and
# spinning OpenMP threads then make small matmuls several times slower (the reference-vector
# tests ran 4x slower on 2 workers x 2 threads than on 2 x 1). Set before torch is imported;
# the servers and ranks the tests start inherit it.
if "PYTEST_XDIST_WORKER" in os.environ:  # a worker (the controller runs no test)
    _WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // _WORKERS)))
    if "torch" in sys.modules:  # imported by a plugin before this file: too late for the variable
        sys.modules["torch"].set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

import pytest  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def server_logging() -> Iterator[None]:
    """`dlm serve` in process points its loggers at this run's stderr (which the runner then
    closes) and stops their propagation: put them back, or later tests of this worker log
    into a closed stream ("--- Logging error ---" in their stderr)."""
    import logging

    loggers = [logging.getLogger(name) for name in ("dlm", "uvicorn", "uvicorn.error")]
    saved = [(lg.handlers[:], lg.level, lg.propagate) for lg in loggers]
    yield
    for lg, (handlers, level, propagate) in zip(loggers, saved):
        lg.handlers, lg.propagate = handlers, propagate
        lg.setLevel(level)


@pytest.fixture(scope="module")
def one_thread() -> Iterator[None]:
    """Tiny models are overhead-bound; one thread avoids spin contention on shared CPUs
    (modules opt in with `pytestmark = pytest.mark.usefixtures("one_thread")`)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def reference_dir() -> Path | None:
    """`DLM_REFERENCE_DIR` (default ../shared/reference). Absent: skip, except under CI."""
    path = Path(os.environ.get("DLM_REFERENCE_DIR", ROOT.parent / "shared" / "reference"))
    if (path / "vectors").is_dir() and (path / "models").is_dir():
        return path
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"reference vectors missing at {path} (required under CI=true)")
    pytest.skip(f"reference vectors not found at {path}; set DLM_REFERENCE_DIR")
    return None


@pytest.fixture
def reference() -> Path:
    path = reference_dir()
    assert path is not None
    return path


def session_home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The DLM_HOME of this test session (also for session/module fixtures and subprocesses)."""
    return Path(os.environ.get("DLM_TEST_HOME") or tmp_path_factory.getbasetemp() / "dlm_home")


@pytest.fixture(autouse=True)
def isolated_home(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Each test session shares one DLM_HOME (the default model is built once), never ~/.cache."""
    home = session_home(tmp_path_factory)
    monkeypatch.setenv("DLM_HOME", str(home))
    return home


@pytest.fixture(scope="session")
def tiny_llada(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny LLaDA checkpoint (GQA: 4 query heads over 2 KV heads), single file."""
    from dlm.engine.checkpoint_writer import llada_config, random_llada_tensors, save_checkpoint

    directory = tmp_path_factory.mktemp("tiny_llada")
    config = llada_config(vocab_size=300, mask_token_id=299, eos_token_id=298, n_kv_heads=2)
    save_checkpoint(directory, config, random_llada_tensors(config, seed=0))
    return directory


@pytest.fixture(scope="session")
def tiny_dream(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Dream checkpoint (4 query heads over 2 KV heads, q/k/v biases), single file."""
    from dlm.engine.checkpoint_writer import dream_config, random_dream_tensors, save_checkpoint

    directory = tmp_path_factory.mktemp("tiny_dream")
    config = dream_config(vocab_size=300, mask_token_id=299, eos_token_id=298)
    save_checkpoint(directory, config, random_dream_tensors(config, seed=0))
    return directory


def _reference_llm(name: str) -> Any:
    """An `engine.LLM` over reference checkpoint `name`, in float32 on the CPU (for oracles)."""
    from dlm.engine.llm import LLM

    ref = reference_dir()
    assert ref is not None
    return LLM(ref / "models" / name, dtype="float32", device="cpu")


@pytest.fixture(scope="module")
def reference_llada() -> Any:
    """The tiny reference LLaDA checkpoint, loaded (float32, CPU)."""
    return _reference_llm("llada_tiny_v2")


@pytest.fixture(scope="module")
def reference_dream() -> Any:
    """The tiny reference Dream checkpoint, loaded (float32, CPU)."""
    return _reference_llm("dream_tiny_v2")


@pytest.fixture(scope="session")
def gpu_check() -> Any:
    """benchmarks/gpu_check.py as a module (a script, not a package): the checks a lent
    device runs, exercised on the CPU where they can be."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "benchmarks" / "gpu_check.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
