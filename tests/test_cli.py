"""The `dlm` command line: light help, the JSON contract, and one-line errors with exit 2."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from dlm.engine import default_model
from tests.cli_process import dlm
from tests.generate_cli import generate_json

pytestmark = pytest.mark.slow  # every test here starts processes

ROOT = Path(__file__).resolve().parent.parent


def subcommands() -> list[str]:
    import typer.main

    from dlm.cli.main import app

    return sorted(typer.main.get_command(app).commands)  # type: ignore[attr-defined]


def test_help_imports_neither_torch_nor_transformers() -> None:
    """`dlm --help` and every subcommand's `--help` stay light: no torch, no transformers.

    One interpreter runs them in turn and names the first command after which a heavy module
    is loaded (a module, once imported, stays in sys.modules, so the first offender is exact)."""
    code = (
        "import sys, json; from typer.testing import CliRunner; from dlm.cli.main import app;"
        f"cmds = {[[]] + [[c] for c in subcommands()]!r}; out = [];"
        "runner = CliRunner()\n"
        "for c in cmds:\n"
        "    r = runner.invoke(app, [*c, '--help'])\n"
        "    heavy = sorted(m for m in ('torch', 'transformers') if m in sys.modules)\n"
        "    out.append([' '.join(c), r.exit_code, 'Usage' in r.output, heavy])\n"
        "print(json.dumps(out))"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    for command, exit_code, has_usage, heavy in json.loads(proc.stdout):
        assert exit_code == 0 and has_usage, f"dlm {command} --help failed"
        assert heavy == [], f"dlm {command} --help imported {heavy}"


def test_generate_json_contract(tiny_llada: Path) -> None:
    payload = generate_json(tiny_llada, [5, 17, 42], "--gen-length", "16", "--block-length", "8", "--threshold", "0.5")
    for key in ("output_ids", "text", "nfe", "seconds", "tokens_per_second", "finish_reason"):
        assert key in payload
    assert len(payload["output_ids"]) == 16
    assert 1 <= payload["nfe"] <= 16
    assert payload["finish_reason"] in ("stop", "length")


def test_generate_default_model_with_text_and_chat() -> None:
    result = dlm("generate", "--prompt", "Hello there", "--chat", "--gen-length", "32", "--json")
    assert result.returncode == 0, result.stderr
    payload = json.loads(result.stdout)
    assert default_model.NAME in payload["model"]
    assert isinstance(payload["text"], str) and payload["nfe"] == 32
    from dlm.engine.dtype import native_bf16_flags

    # auto on CPU: fp32 unless the CPU has native bf16, then the probe decides (tests/test_dtype.py)
    assert payload["dtype"] in (("bfloat16", "float32") if native_bf16_flags() else ("float32",))


@pytest.mark.parametrize(
    "args, message",
    [
        (["/no/such/model", "--prompt-ids", "1,2"], "no model at"),
        (["{tiny}", "--prompt-ids", "1,2", "--gen-length", "30", "--block-length", "0"], "block_length must be"),
        (
            ["{tiny}", "--prompt-ids", "1,2", "--gen-length", "8", "--min-tokens", "9"],
            "min_tokens (9) must not exceed gen_length",
        ),
        (["{tiny}", "--prompt-ids", "1,2", "--threshold", "0"], "threshold must be in (0, 1]"),
        (["{tiny}", "--prompt-ids", "1,2", "--threshold", "1.5"], "threshold must be in (0, 1]"),
        (["{tiny}", "--prompt-ids", "1,2", "--gen-length", "512"], "maximum length"),
        (["{tiny}", "--prompt-ids", "1,x"], "comma-separated integers"),
        (["{tiny}"], "exactly one of --prompt or --prompt-ids"),
        (["{tiny}", "--prompt", "hi"], "no tokenizer"),
        (["{unknown}", "--prompt-ids", "1,2"], "unsupported model_type"),
        (["{tiny}", "--prompt-ids", "1,2", "--dtype", "int3"], "unknown dtype"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(args: list[str], message: str, tiny_llada: Path, tmp_path: Path) -> None:
    unknown = tmp_path / "unknown"
    unknown.mkdir()
    (unknown / "config.json").write_text(json.dumps({"model_type": "mystery"}))
    args = [a.replace("{tiny}", str(tiny_llada)).replace("{unknown}", str(unknown)) for a in args]
    result = dlm("generate", *args)
    assert result.returncode == 2, result.stdout + result.stderr
    assert message in result.stderr
    assert "Traceback" not in result.stderr
    assert len([line for line in result.stderr.splitlines() if line.strip()]) == 1, result.stderr


@pytest.mark.parametrize(
    "args, env, message",
    [
        (["--device", "cuda"], {}, "no CUDA device"),
        ([], {"DLM_KERNELS": "bogus"}, "DLM_KERNELS must be auto, torch or triton"),
        ([], {"DLM_KERNELS": "triton", "TRITON_INTERPRET": "0"}, "needs a CUDA device or TRITON_INTERPRET=1"),
    ],
)
def test_device_and_kernel_errors_are_one_line(args: list[str], env: dict, message: str, tiny_llada: Path) -> None:
    import torch

    if args and torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    result = dlm("generate", str(tiny_llada), "--prompt-ids", "1,2", *args, env=env)
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr.startswith("error:") and message in result.stderr
    assert len([line for line in result.stderr.splitlines() if line.strip()]) == 1, result.stderr


@pytest.mark.parametrize("command", [[], ["generate"], ["serve"], ["deploy", "kubernetes"]])
def test_help_shows_no_type_label_on_flags(command: list[str]) -> None:
    """On/off flags take no value, so their help lines carry no `<bool>` label."""
    result = dlm(*command, "--help")
    assert result.returncode == 0, result.stderr
    assert "--help" in result.stdout and "<bool>" not in result.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["generate", "--gen-lenght", "5"], "error: No such option: --gen-lenght"),
        (["estimate"], "error: Missing argument"),
        (["nosuchcommand"], "error: No such command"),
    ],
)
def test_a_command_line_click_refuses_is_one_error_line(args: list[str], message: str) -> None:
    """An unknown flag, a missing argument or command: one `error:` line and exit 2, as
    every other usage error (not a boxed panel)."""
    result = dlm(*args)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [result.stderr.strip()] and result.stderr.startswith(message)


@pytest.mark.parametrize(
    "args", [["models", "--json"], ["models"], ["doctor", "--json"], ["--version"], ["--help"]], ids=" ".join
)
def test_a_reader_that_closed_stdout_ends_the_command_quietly(args: list[str], tmp_path: Path) -> None:
    """`dlm models --json | head -1` on a long listing: the reader is gone before dlm writes.
    Like a shell tool (and rich's own listings), the command ends without a word on stderr
    (it printed `error: [Errno 32] Broken pipe`) and exits 1, not with a traceback."""
    import os

    read_end, write_end = os.pipe()
    os.close(read_end)  # closed before dlm starts: its first write to stdout meets no reader
    try:
        result = subprocess.run(
            [sys.executable, "-m", "dlm", *args],
            cwd=ROOT,
            stdout=write_end,
            stderr=subprocess.PIPE,
            text=True,
            timeout=300,
            env={**os.environ, "DLM_HOME": str(tmp_path)},
        )
    finally:
        os.close(write_end)
    assert result.stderr == ""
    assert result.returncode == 1
