"""Loading a model imports only what serving it needs: building the model on the meta device
must not pull in torch._dynamo (and with it sympy and triton, 145 MiB resident), which
torch.nn.init's fills did through torch's Python decompositions (docs/serve.md#memory)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.serving import ROOT

CHECK = """
import sys
from dlm.engine.llm import LLM
from dlm.engine.params import GenerationParams
llm = LLM(None, dtype="float32", device="cpu")
llm.generate([5, 6, 7], GenerationParams(gen_length=8))
print(sorted(m for m in ("torch._dynamo", "sympy", "triton") if m in sys.modules))
"""


@pytest.mark.slow
def test_loading_and_generating_import_no_compiler_stack() -> None:
    out = subprocess.run([sys.executable, "-c", CHECK], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[]"
