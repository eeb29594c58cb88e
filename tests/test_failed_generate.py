"""A `generate` call whose step fails (or is interrupted) leaves the engine usable: its
sequences leave the running set. They stayed there, so every later call on the same `LLM`
stepped them again and failed the same way (a Dream request at a temperature of 1e39 once
made every following `generate` raise its NaN error)."""

from __future__ import annotations

from typing import Any

import pytest

from dlm.engine.llm import LLM
from tests.tiny_families import tiny_names

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("name", tiny_names())
def test_a_failed_generate_leaves_the_engine_usable(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    with LLM(f"tiny:{name}", dtype="float32", device="cpu") as llm:
        engine: Any = llm.engine
        expected = llm.generate("Sort: 4 3 9", gen_length=8)[0].output_ids

        def fail(*args: Any, **kwargs: Any) -> None:
            raise RuntimeError("a failed forward")

        with monkeypatch.context() as patched:
            patched.setattr(engine.runner, "step", fail)
            with pytest.raises(RuntimeError, match="a failed forward"):
                llm.generate("Sort: 4 3 9", gen_length=8, n=2)
        assert engine.running == []
        assert llm.generate("Sort: 4 3 9", gen_length=8)[0].output_ids == expected
