"""User suites: YAML files of prompts with expectations on the answers.

An operator knows what their model must get right (a format, a tool call, a code block);
a suite turns that into named checks (`suite.<case>`) that gate CI like the built-in ones.
The file is validated when loaded, so a typo is a usage error, not a failed check.
"""

from __future__ import annotations

import json
import re
from functools import partial
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from dlm.cli.checks.runner import Check, CheckFailed, Context, expect_status, json_body
from dlm.cli.text_files import load_yaml, read_text
from dlm.engine.errors import UsageError

FENCE = re.compile(r"```([\w+-]*)[^\n]*\n(.*?)```", re.DOTALL)
TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


def _as_list(value: Any) -> Any:
    return [value] if isinstance(value, str) else value


class Expect(BaseModel):
    """What the answer must satisfy; every given expectation must hold."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    contains: list[str] = []
    not_contains: list[str] = []
    regex: list[str] = []
    json_: bool = Field(False, alias="json")
    json_schema: dict[str, Any] | None = None
    code_block: bool | str = False  # True: any fenced block; "python": a ```python block

    _as_lists = field_validator("contains", "not_contains", "regex", mode="before")(_as_list)

    @field_validator("regex")
    @classmethod
    def _compiles(cls, patterns: list[str]) -> list[str]:
        for pattern in patterns:
            try:
                re.compile(pattern)
            except re.error as exc:
                raise ValueError(f"invalid regex {pattern!r}: {exc}") from None
        return patterns

    @field_validator("json_schema")
    @classmethod
    def _is_schema(cls, schema: dict[str, Any] | None) -> dict[str, Any] | None:
        if schema is not None:
            from jsonschema import SchemaError, validators

            try:
                validators.validator_for(schema).check_schema(schema)
            except SchemaError as exc:
                raise ValueError(f"invalid JSON schema: {exc.message}") from None
        return schema


class Case(BaseModel):
    """One request (a completion `prompt` or chat `messages`) and its expectations."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=r"^[\w.-]+$")
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    params: dict[str, Any] = {}  # body fields: max_tokens, steps, threshold, ...
    expect: Expect

    @model_validator(mode="after")
    def _one_input(self) -> Case:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt or messages")
        if self.tools is not None and self.messages is None:
            raise ValueError("tools need a chat case (messages)")
        return self


class Suite(BaseModel):
    """Without `min_pass_rate` every case is its own check (`suite.<case>`); with it, the cases
    are one check, `suite.pass_rate`, that passes when at least that share of them do: the
    known-answer form for a model that is right most of the time, not always."""

    model_config = ConfigDict(extra="forbid")

    defaults: dict[str, Any] = {}  # body fields merged into every case's request
    min_pass_rate: float | None = Field(None, gt=0, le=1)
    cases: list[Case] = Field(min_length=1)

    @model_validator(mode="after")
    def _unique_names(self) -> Suite:
        names = [c.name for c in self.cases]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"duplicate case names: {', '.join(duplicates)}")
        return self


# Suites shipped with dlm, by name: `--suite default-model` is the embedded default model's
# known answers (held-out task prompts, written by scripts/train_tiny_dllm.py).
DEFAULT_MODEL_SUITE = "default-model"


def suite_file(spec: str | Path) -> Path:
    """The file `--suite` names: a path, or the name of a shipped suite when no such file exists."""
    path = Path(spec)
    if str(spec) == DEFAULT_MODEL_SUITE and not path.exists():
        from dlm.engine.default_model import ensure_default_model, suite_path

        ensure_default_model()  # its files verified, the suite among them
        return suite_path()
    return path


def load_suite(spec: str | Path) -> Suite:
    """Parse and validate a suite (a file, or a shipped suite's name); any problem is a
    UsageError naming the field."""
    path = suite_file(spec)
    raw = load_yaml(read_text(path, "suite"), f"suite {path}")
    try:
        return Suite.model_validate(raw)
    except ValidationError as exc:
        # a key the suite does not know first: a misspelt `expekt` also leaves `expect` missing,
        # and the misspelling is what the file says
        first = min(exc.errors(), key=lambda e: e["type"] != "extra_forbidden")
        where = ".".join(str(p) for p in first["loc"]) or "suite"
        raise UsageError(f"suite {path}: {where}: {first['msg']}") from None


def json_candidates(text: str, tool_calls: list[dict[str, Any]]) -> list[Any]:
    """Values that may hold the expected JSON, most specific first.

    OpenAI `tool_calls` become `{"name", "arguments"}` objects (arguments parsed); then the
    body of a `<tool_call>` tag, fenced ```json blocks, and the whole text.
    """
    found: list[Any] = []
    for call in tool_calls:
        function = call.get("function") or {}
        try:
            arguments = json.loads(function.get("arguments") or "null")
        except json.JSONDecodeError:
            arguments = function.get("arguments")
        found.append({"name": function.get("name"), "arguments": arguments})
    texts = TOOL_CALL.findall(text) + [body for lang, body in FENCE.findall(text) if lang in ("", "json")] + [text]
    for candidate in texts:
        try:
            found.append(json.loads(candidate))
        except json.JSONDecodeError:
            continue
    return found


def unmet(expect: Expect, text: str, tool_calls: list[dict[str, Any]]) -> list[str]:
    """Every expectation the answer fails, as short sentences."""
    problems = [f"does not contain {s!r}" for s in expect.contains if s not in text]
    problems += [f"contains {s!r}" for s in expect.not_contains if s in text]
    problems += [f"does not match /{p}/" for p in expect.regex if not re.search(p, text, re.DOTALL)]
    candidates = json_candidates(text, tool_calls)
    if expect.json_ and not candidates:
        problems.append("holds no JSON (text, ```json block, <tool_call> or tool_calls)")
    if expect.json_schema is not None:
        from jsonschema import validators

        validator = validators.validator_for(expect.json_schema)(expect.json_schema)
        if not candidates:
            problems.append("holds no JSON to match the schema")
        elif not any(validator.is_valid(c) for c in candidates):
            error = next(validator.iter_errors(candidates[0]))
            problems.append(f"JSON does not match the schema: {error.message}")
    if expect.code_block:
        languages = [lang for lang, _ in FENCE.findall(text)]
        wanted = expect.code_block if isinstance(expect.code_block, str) else None
        if not languages or (wanted and wanted not in languages):
            problems.append(f"has no fenced {wanted + ' ' if wanted else ''}code block")
    return problems


def run_case(ctx: Context, suite: Suite, case: Case) -> str:
    body: dict[str, Any] = {"model": ctx.model, "temperature": 0, **suite.defaults, **case.params}
    if case.prompt is not None:
        path, body["prompt"] = "/v1/completions", case.prompt
    else:
        path, body["messages"] = "/v1/chat/completions", case.messages
        if case.tools is not None:
            body["tools"] = case.tools
    response = ctx.client.post(path, body)
    expect_status(response, 200, path)
    choice = json_body(response, path)["choices"][0]
    tool_calls: list[dict[str, Any]]
    if case.prompt is not None:
        text, tool_calls = choice.get("text") or "", []
    else:
        message = choice.get("message") or {}
        text, tool_calls = message.get("content") or "", message.get("tool_calls") or []
    problems = unmet(case.expect, text, tool_calls)
    if problems:
        raise CheckFailed(f"answer {text[:60]!r} " + "; ".join(problems))
    return f"{len(text)} characters" + (f", {len(tool_calls)} tool call(s)" if tool_calls else "")


def run_pass_rate(ctx: Context, suite: Suite) -> str:
    """Every case; fails when fewer than `min_pass_rate` of them pass, naming the first failures."""
    assert suite.min_pass_rate is not None
    failed = []
    for case in suite.cases:
        try:
            run_case(ctx, suite, case)
        except CheckFailed as exc:
            failed.append(f"{case.name}: {exc}")
    total = len(suite.cases)
    rate = (total - len(failed)) / total
    summary = f"{total - len(failed)}/{total} cases passed ({rate:.0%}, minimum {suite.min_pass_rate:.0%})"
    if rate < suite.min_pass_rate:
        raise CheckFailed(summary + "; " + "; ".join(failed[:3]))
    return summary


def suite_checks(suite: Suite) -> list[Check]:
    if suite.min_pass_rate is not None:
        return [Check("suite.pass_rate", lambda ctx: run_pass_rate(ctx, suite), ("models",))]
    return [Check(f"suite.{case.name}", partial(run_case, suite=suite, case=case), ("models",)) for case in suite.cases]
