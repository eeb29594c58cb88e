"""`dlm generate -p -`: the prompt read from standard input (a pipe, a file: `< prompt.txt`),
as `-` names standard input for other tools; it was decoded as the one-character text "-"."""

from __future__ import annotations

import json
from typing import Any

from typer.testing import CliRunner

from dlm.cli.main import app

FLAGS = ["--gen-length", "4", "--dtype", "float32", "--device", "cpu", "--json"]


def generate(prompt: str, stdin: bytes | None = None) -> Any:
    return CliRunner().invoke(app, ["generate", "tiny:llada", "-p", prompt, *FLAGS], input=stdin)


def test_a_prompt_from_standard_input_is_that_text_without_its_final_newline() -> None:
    piped = generate("-", b"Paris is\nthe capital\n")
    typed = generate("Paris is\nthe capital")
    assert piped.exit_code == typed.exit_code == 0, piped.output
    assert json.loads(piped.stdout)["prompt_ids"] == json.loads(typed.stdout)["prompt_ids"]


def test_bytes_that_are_not_utf8_on_standard_input_are_one_error_line() -> None:
    result = generate("-", b"\xffab")
    assert result.exit_code == 2 and "the prompt on standard input is not UTF-8 text" in result.output, result.output


def test_a_final_windows_newline_is_dropped_whole() -> None:
    """A file saved with CRLF line ends kept the final newline's carriage return: 'hi\\r' was
    the prompt, one token more than 'hi'."""
    piped = generate("-", b"Paris is\r\nthe capital\r\n")
    typed = generate("Paris is\r\nthe capital")
    assert piped.exit_code == typed.exit_code == 0, piped.output
    assert json.loads(piped.stdout)["prompt_ids"] == json.loads(typed.stdout)["prompt_ids"]
