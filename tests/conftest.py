"""Shared fixtures: the reference directory, an isolated DLM_HOME, tiny checkpoints."""

from __future__ import annotations

import os
from pathlib import Path

# Environment the whole suite needs, set once before any test module is imported:
# Triton kernels run on CPU through the interpreter (set before any kernel is defined).
os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def reference_dir() -> Path | None:
    """`DLM_REFERENCE_DIR` (default ../shared/reference). Absent: skip, except under CI."""
    path = Path(os.environ.get("DLM_REFERENCE_DIR", ROOT.parent / "shared" / "reference"))
    if (path / "vectors").is_dir() and (path / "models").is_dir():
        return path
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"reference vectors missing at {path} (required under CI=true)")
    pytest.skip(f"reference vectors not found at {path}; set DLM_REFERENCE_DIR")
    return None


@pytest.fixture(scope="module")
def one_thread() -> object:
    """Tiny models are overhead-bound; one thread avoids spin contention on shared CPUs
    (`pytestmark = pytest.mark.usefixtures("one_thread")` in a module that wants it)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


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
    from engine.checkpoint_writer import llada_config, random_llada_tensors, save_checkpoint

    directory = tmp_path_factory.mktemp("tiny_llada")
    config = llada_config(vocab_size=300, mask_token_id=299, eos_token_id=298, n_kv_heads=2)
    save_checkpoint(directory, config, random_llada_tensors(config, seed=0))
    return directory


@pytest.fixture(scope="session")
def tiny_dream(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Dream checkpoint (4 query heads over 2 KV heads, q/k/v biases), single file."""
    from engine.checkpoint_writer import dream_config, random_dream_tensors, save_checkpoint

    directory = tmp_path_factory.mktemp("tiny_dream")
    config = dream_config(vocab_size=300, mask_token_id=299, eos_token_id=298)
    save_checkpoint(directory, config, random_dream_tensors(config, seed=0))
    return directory
