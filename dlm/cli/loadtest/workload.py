"""What the simulated users send: prompts (built in or from JSONL) and request fields."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dlm.cli.jsonl import read_objects
from dlm.engine.errors import UsageError

BUILTIN_PROMPTS = (
    "Explain in two sentences why the sky is blue.",
    "Write a haiku about a lighthouse.",
    "List three uses of a paperclip.",
    "Summarise the plot of a heist film in one paragraph.",
    "What is the difference between a list and a tuple in Python?",
    "Translate 'good morning, how are you?' into French.",
    "Give a short recipe for pancakes.",
    "Describe a diffusion language model to a ten-year-old.",
)
# Fields a JSONL line may set besides its prompt or messages.
LINE_FIELDS = (
    *("max_tokens", "temperature", "steps", "block_length", "remasking", "threshold", "cache", "decode_mode"),
    *("ignore_eos", "min_tokens"),
)


@dataclass(frozen=True)
class Workload:
    """Request templates the users cycle through, and fields added to every request."""

    requests: tuple[tuple[str, dict[str, Any]], ...]  # (path, body without model/stream)
    fields: dict[str, Any] = field(default_factory=dict)
    model: str | None = None

    def request(self, index: int) -> tuple[str, dict[str, Any]]:
        path, body = self.requests[index % len(self.requests)]
        full = {**self.fields, **body, "stream": True, "stream_options": {"include_usage": True}}
        if self.model:
            full["model"] = self.model
        return path, full


# `--prompts tasks`: the default model's task prompts (its known-answer suite's cases), so
# answer lengths and EOS behave as they do in production.
TASK_PROMPTS = "tasks"


def builtin_requests() -> tuple[tuple[str, dict[str, Any]], ...]:
    return tuple(("/v1/completions", {"prompt": p}) for p in BUILTIN_PROMPTS)


def task_requests() -> tuple[tuple[str, dict[str, Any]], ...]:
    """Chat requests of the default model's known-answer suite (the command's own flags set
    their length and decoding)."""
    from dlm.cli.checks.suite import DEFAULT_MODEL_SUITE, load_suite

    suite = load_suite(DEFAULT_MODEL_SUITE)
    return tuple(
        ("/v1/chat/completions", {**case.params, "messages": case.messages})
        for case in suite.cases
        if case.messages is not None
    )


def named_or_file(spec: str | Path) -> tuple[tuple[str, dict[str, Any]], ...]:
    """`--prompts`: the named set `tasks` (when no such file exists), else a JSONL file."""
    if str(spec) == TASK_PROMPTS and not Path(spec).exists():
        return task_requests()
    return load_jsonl(spec)


def load_jsonl(path: str | Path) -> tuple[tuple[str, dict[str, Any]], ...]:
    """One request per line: {"prompt": ...} or {"messages": [...]}, plus optional fields."""
    path = Path(path)
    requests = []
    for number, item in read_objects(path, "prompts"):
        if ("prompt" in item) == ("messages" in item):
            raise UsageError(f"{path}:{number}: give exactly one of prompt or messages")
        unknown = set(item) - {"prompt", "messages", *LINE_FIELDS}
        if unknown:
            raise UsageError(f"{path}:{number}: unknown field(s) {', '.join(sorted(unknown))}")
        route = "/v1/completions" if "prompt" in item else "/v1/chat/completions"
        requests.append((route, item))
    return tuple(requests)
