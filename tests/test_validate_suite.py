"""User suites: the YAML is validated on load, and each expectation passes or fails."""

from __future__ import annotations

from pathlib import Path

import pytest

from dlm.cli.checks.runner import FAILED, PASSED, ValidateOptions
from dlm.cli.checks.suite import Expect, load_suite, unmet
from dlm.cli.checks.validate import run_validation
from dlm.engine.errors import UsageError
from tests.fake_openai import Behaviour, serve

WEATHER_SCHEMA = {
    "type": "object",
    "required": ["name", "arguments"],
    "properties": {
        "name": {"const": "get_weather"},
        "arguments": {"type": "object", "required": ["city"], "properties": {"city": {"type": "string"}}},
    },
}

SUITE = """
defaults: {max_tokens: 32}
cases:
  - name: capital
    prompt: "Question: capital of France?"
    expect: {contains: Paris, regex: "^The capital", not_contains: London}
  - name: capital-wrong
    prompt: "Question: capital of France?"
    expect: {contains: [Paris, Berlin]}
  - name: code
    messages: [{role: user, content: "write code please"}]
    expect: {code_block: python}
  - name: code-wrong-language
    messages: [{role: user, content: "write code please"}]
    expect: {code_block: rust}
  - name: weather-tool
    messages: [{role: user, content: "weather in Paris?"}]
    tools: [{type: function, function: {name: get_weather, parameters: {type: object}}}]
    expect: {json_schema: %(schema)s}
  - name: weather-text-not-json
    prompt: "weather in Paris?"
    expect: {json: true}
  - name: json-answer
    prompt: "give json"
    params: {steps: 8, block_length: 8, max_tokens: 8}
    expect: {json_schema: {type: object, required: [days]}}
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "suite.yaml"
    path.write_text(text)
    return path


def test_suite_expectations_pass_and_fail_by_case(tmp_path: Path) -> None:
    import json

    suite = load_suite(write(tmp_path, SUITE % {"schema": json.dumps(WEATHER_SCHEMA)}))
    behaviour = Behaviour(
        answers={
            "capital": "The capital of France is Paris.",
            "code": "Sure:\n```python\nprint('hi')\n```\n",
            "weather": "It is sunny.",
            "json": '```json\n{"city": "Paris", "days": 3}\n```',
        },
        tool_call={"name": "get_weather", "arguments": {"city": "Paris"}},
    )
    with serve(behaviour) as url:
        results = {
            r.name: r for r in run_validation(url, ValidateOptions(ready_timeout=2, burst=2), suite=suite, timeout=10)
        }
    status = {name[len("suite.") :]: r.status for name, r in results.items() if name.startswith("suite.")}
    assert status == {
        "capital": PASSED,
        "capital-wrong": FAILED,
        "code": PASSED,
        "code-wrong-language": FAILED,
        "weather-tool": PASSED,
        "weather-text-not-json": FAILED,
        "json-answer": PASSED,
    }
    assert "does not contain 'Berlin'" in results["suite.capital-wrong"].detail
    assert "no fenced rust code block" in results["suite.code-wrong-language"].detail


PASS_RATE_SUITE = """
min_pass_rate: %s
cases:
  - {name: sum, messages: [{role: user, content: "sum please"}], expect: {regex: '^\\s*85\\s*$'}}
  - {name: sum-again, prompt: "sum again", expect: {regex: '^\\s*85\\s*$'}}
  - {name: wrong, prompt: "something else", expect: {contains: "85"}}
"""


@pytest.mark.parametrize("rate, passed", [(0.6, True), (0.9, False)])
def test_min_pass_rate_makes_the_cases_one_named_check(tmp_path: Path, rate: float, passed: bool) -> None:
    suite = load_suite(write(tmp_path, PASS_RATE_SUITE % rate))
    with serve(Behaviour(answers={"sum": " 85"})) as url:
        results = {
            r.name: r for r in run_validation(url, ValidateOptions(ready_timeout=2, burst=2), suite=suite, timeout=10)
        }
    assert [name for name in results if name.startswith("suite.")] == ["suite.pass_rate"]
    result = results["suite.pass_rate"]
    assert result.status == (PASSED if passed else FAILED)
    assert result.detail.startswith("2/3 cases passed")
    if not passed:
        assert "wrong: answer" in result.detail


def test_expectations_on_text() -> None:
    text = 'Call: <tool_call>{"name": "get_weather", "arguments": {"city": 3}}</tool_call>'
    assert unmet(Expect(json=True), text, []) == []
    problems = unmet(Expect(json_schema=WEATHER_SCHEMA), text, [])
    assert len(problems) == 1 and "does not match the schema" in problems[0]
    assert unmet(Expect(regex=[r"tool_call>\{"], not_contains=["Paris"]), text, []) == []
    assert unmet(Expect(code_block=True), "no fence here", []) == ["has no fenced code block"]
    call = [{"type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]
    assert unmet(Expect(json_schema=WEATHER_SCHEMA), "", call) == []


@pytest.mark.parametrize(
    "text, message",
    [
        ("cases:\n  - name: a\n    prompt: hi\n    expect: {contians: x}\n", "contians"),
        ("cases:\n  - name: a\n    prompt: hi\n    expect: {regex: '(unclosed'}\n", "regex"),
        (
            "cases:\n  - name: a\n    prompt: hi\n    messages: []\n    expect: {}\n",
            "exactly one of prompt or messages",
        ),
        ("cases:\n  - name: a\n    prompt: hi\n    tools: []\n    expect: {}\n", "tools need a chat case"),
        ("cases:\n  - name: a\n    prompt: hi\n    expect: {json_schema: {type: 5}}\n", "invalid JSON schema"),
        (
            "cases:\n  - {name: a, prompt: x, expect: {}}\n  - {name: a, prompt: y, expect: {}}\n",
            "duplicate case names",
        ),
        ("cases: []\n", "cases"),
        ("min_pass_rate: 1.5\ncases:\n  - {name: a, prompt: x, expect: {}}\n", "min_pass_rate"),
        ("cases: [\n", "not valid YAML"),
        # a misspelt key was reported as the missing one it stands for ('cases.0.expect: Field
        # required'), never naming what the file says
        ("cases:\n  - name: a\n    prompt: hi\n    expekt: {contains: x}\n", "cases.0.expekt"),
        ("cases:\n  - name: a\n    promt: hi\n    expect: {}\n", "cases.0.promt"),
    ],
)
def test_bad_suites_are_usage_errors(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(UsageError, match=message):
        load_suite(write(tmp_path, text))
