"""dlm's inference engine: models, denoising, scheduling.

Heavy modules (torch, transformers) are imported lazily so that `import engine`
and the CLI's `--help` stay fast; `engine.LLM` pulls them in on first access.
"""

from __future__ import annotations

from typing import Any

__all__ = ["LLM", "GenerationParams"]


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from dlm.engine.llm import LLM

        return LLM
    if name == "GenerationParams":
        from dlm.engine.params import GenerationParams

        return GenerationParams
    raise AttributeError(name)
