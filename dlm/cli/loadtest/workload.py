"""What the simulated users send: prompts (a named set or JSONL) and request fields.

The named sets: `builtin`, general questions for a model that answers anything, and `tasks`,
the embedded default model's task prompts. A model answers prompts it was not trained on
with EOS at once, so a load test of empty answers would time no first token and name a
knee from nothing; `auto` (the default) therefore sends `tasks` when the server's
/v1/models says it serves the default model, else `builtin`.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
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


Requests = tuple[tuple[str, dict[str, Any]], ...]  # (path, body without model/stream)


@dataclass(frozen=True)
class Workload:
    """Request templates the users cycle through, and fields added to every request.
    `requests` None: chosen once the served model is known (`for_model`). `fixed_length`
    (`--fixed-length`): every answer exactly its request's max_tokens long (`ignore_eos`, and
    `min_tokens` equal to that request's max_tokens, a JSONL line's own where it sets one)."""

    requests: Requests | None
    fields: dict[str, Any] = field(default_factory=dict)
    model: str | None = None
    prompts: str = ""  # where the requests came from: a named set or a file, for the summary
    fixed_length: bool = False

    def for_model(self, card: dict[str, Any]) -> Workload:
        """This workload for the server's /v1/models card: its model id unless one was given,
        its prompts when they were left to the model (`auto`)."""
        prompts = self.prompts
        requests = self.requests
        if requests is None:
            prompts = TASK_PROMPTS if serves_default_model(card) else BUILTIN_PROMPT_SET
            requests = named(prompts)
        return replace(self, requests=requests, model=self.model or card["id"], prompts=prompts)

    def request(self, index: int) -> tuple[str, dict[str, Any]]:
        if self.requests is None:
            raise ValueError("the prompts are chosen by for_model() first")
        path, body = self.requests[index % len(self.requests)]
        full = {**self.fields, **body}
        if self.fixed_length:  # a line's own min_tokens / ignore_eos win, as its other fields do
            full = {"ignore_eos": True, "min_tokens": full.get("max_tokens"), **full}
        full.update(stream=True, stream_options={"include_usage": True})
        if self.model:
            full["model"] = self.model
        return path, full


# `--prompts tasks`: the default model's task prompts (its known-answer suite's cases), so
# answer lengths and EOS behave as they do in production.
TASK_PROMPTS = "tasks"
BUILTIN_PROMPT_SET = "builtin"
AUTO_PROMPTS = "auto"  # tasks for the default model, else builtin


def check_request_fields(fields: dict[str, Any], where: str = "") -> None:
    """The generation fields of a request body (body names: `max_tokens`, `temperature`,
    `decode_mode`, ...; others, such as `prompt`, are left alone), each held to its declared
    range or choices (dlm/engine/params.py), so a value every request would be refused for
    (`--cache ''`, `--temperature -1`, a prompts line's `"steps": 0`) is bad usage before the
    load, not a run of 400s. None: not sent. `where` prefixes the message (a file's line)."""
    from dlm.engine.params import PARAMS, http_name

    names = {http: name for name in PARAMS if (http := http_name(name)) is not None}
    for body_field, value in fields.items():
        if body_field not in names:
            continue
        try:
            PARAMS[names[body_field]].check(f"{where}{body_field}", value)
        except TypeError:  # a string where a number goes: no range compares with it
            raise UsageError(f"{where}{body_field} must be a number, got {value!r}") from None


def model_card(body: Any, model: str | None, where: str) -> dict[str, Any]:
    """The card of `model` (default: the first listed) in `where`'s /v1/models answer `body`
    (its parsed JSON); a `DlmError` naming what is wrong when the answer is not an OpenAI
    model list (an HTML page, a proxy's error, another API on that port)."""
    from dlm.cli.client.api import model_cards
    from dlm.engine.errors import DlmError

    cards = model_cards(body, where)
    if model is not None:
        return next((c for c in cards if c["id"] == model), {"id": model})
    if not cards:
        raise DlmError(f"{where} lists no model; give --model")
    return cards[0]


def serves_default_model(card: dict[str, Any]) -> bool:
    """Whether a /v1/models card is the embedded default model's: its `root` (the checkpoint
    the server loaded) or, from a server that sends none, its id."""
    from dlm.engine.default_model import NAME

    return card.get("root", card["id"]) == NAME


def builtin_requests() -> Requests:
    return tuple(("/v1/completions", {"prompt": p}) for p in BUILTIN_PROMPTS)


def task_requests() -> Requests:
    """Chat requests of the default model's known-answer suite (the command's own flags set
    their length and decoding)."""
    from dlm.cli.checks.suite import DEFAULT_MODEL_SUITE, load_suite

    suite = load_suite(DEFAULT_MODEL_SUITE)
    return tuple(
        ("/v1/chat/completions", {**case.params, "messages": case.messages})
        for case in suite.cases
        if case.messages is not None
    )


def named(name: str) -> Requests:
    return task_requests() if name == TASK_PROMPTS else builtin_requests()


def from_prompts(spec: str, fields: dict[str, Any], model: str | None, *, fixed_length: bool = False) -> Workload:
    """`--prompts`: a named set (`auto`, `tasks`, `builtin`) unless a file has its name, else
    a JSONL file; `auto` leaves the choice to the served model (`Workload.for_model`). An
    empty spec is refused (as a path it read as the current directory)."""
    if not spec.strip():
        raise UsageError(
            f"--prompts is empty: give a JSONL file or {AUTO_PROMPTS}, {TASK_PROMPTS}, {BUILTIN_PROMPT_SET}"
        )
    if not Path(spec).exists():
        if spec == AUTO_PROMPTS:
            return Workload(None, fields, model, spec, fixed_length)
        if spec in (TASK_PROMPTS, BUILTIN_PROMPT_SET):
            return Workload(named(spec), fields, model, spec, fixed_length)
    return Workload(load_jsonl(spec), fields, model, spec, fixed_length)


def load_jsonl(path: str | Path) -> Requests:
    """One request per line: {"prompt": ...} or {"messages": [...]}, plus optional fields."""
    path = Path(path)
    requests = []
    for number, item in read_objects(path, "prompts"):
        if ("prompt" in item) == ("messages" in item):
            raise UsageError(f"{path}:{number}: give exactly one of prompt or messages")
        unknown = set(item) - {"prompt", "messages", *LINE_FIELDS}
        if unknown:
            raise UsageError(f"{path}:{number}: unknown field(s) {', '.join(sorted(unknown))}")
        check_request_fields(item, f"{path}:{number}: ")
        route = "/v1/completions" if "prompt" in item else "/v1/chat/completions"
        requests.append((route, item))
    return tuple(requests)
