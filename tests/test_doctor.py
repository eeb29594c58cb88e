"""`dlm doctor`: every item reported (GPU items absent here), and exit 1 naming the blocker
when fed a failure: no disk, a busy port, a kernel that disagrees with its twin."""

from __future__ import annotations

import json
import re
import socket
from pathlib import Path

import pytest
from typer.testing import CliRunner

from dlm.cli import doctor
from dlm.cli.main import app
from dlm.kernels import selftest


@pytest.fixture(autouse=True)
def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    """No network in tests: offline mode, as an operator would set it."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)


def run_doctor(*args: str) -> tuple[int, dict]:
    result = CliRunner().invoke(app, ["doctor", "--json", *args])
    return result.exit_code, json.loads(result.stdout)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_reports_every_item(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    # As on a user's CPU machine: no interpreter (the suite sets it; test_kernel_selftest.py
    # covers the self-test running under it).
    monkeypatch.delenv("TRITON_INTERPRET")
    code, report = run_doctor("--port", str(free_port()))
    assert code == 0 and report["ok"] and report["blockers"] == [], report["blockers"]
    checks = report["checks"]
    expected = {"python", "torch", "driver", "gpus", "nccl", "kernel dispatch", "triton", "dtype", "disk", "port"}
    expected |= {"store", "hub", "tested with", "quantization"} | {f"kernel {name}" for name in selftest.CHECKS}
    assert expected <= set(checks)
    assert checks["torch"]["version"] == torch.__version__
    assert checks["hub"]["offline"] is True
    assert checks["dtype"]["dtype"] in ("float32", "bfloat16") and checks["dtype"]["requested"] == "auto"
    assert checks["tested with"]["matrix"] == doctor.SUPPORT_MATRIX
    if not torch.cuda.is_available():  # this machine: GPU items absent, kernels not compiled
        assert checks["gpus"]["count"] == 0 and checks["nccl"]["version"] is None
        assert checks["kernel rms_norm"]["self_test"] in ("skipped", "absent")
        # probed on this CPU: int8 and int4 run, fp8 is refused with its reason
        assert checks["quantization"]["supported"] == ["int8", "int4"]
        assert "fp8 needs a CUDA device" in checks["quantization"]["refused"]["fp8"]


def test_quantization_is_probed_not_assumed(monkeypatch: pytest.MonkeyPatch) -> None:
    """A method whose kernel fails here is reported with the failure, as a warning."""
    from dlm.engine import quantized_weights

    real = quantized_weights.quantize

    def broken(method, weight, device, group, scale=None):  # noqa: ANN001, ANN202
        if method.name == "int4":
            raise RuntimeError("no int4 kernel on this CPU")
        return real(method, weight, device, group, scale)

    monkeypatch.setattr(quantized_weights, "quantize", broken)
    check = doctor.check_quantization()
    assert check.status == "warn" and check.data["supported"] == ["int8"]
    assert check.data["refused"]["int4"] == "RuntimeError: no int4 kernel on this CPU"


def test_no_disk_is_a_blocker(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(doctor, "free_bytes", lambda path: 10 << 20)
    code, report = run_doctor("--port", str(free_port()))
    assert code == 1 and report["blockers"] == ["disk"]
    assert report["checks"]["disk"]["status"] == "fail"


def test_busy_port_is_a_blocker() -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        code, report = run_doctor("--port", str(busy.getsockname()[1]))
    assert code == 1 and report["blockers"] == ["port"]
    assert report["checks"]["port"]["free"] is False


def test_kernel_mismatch_is_a_blocker(monkeypatch: pytest.MonkeyPatch) -> None:
    def results(device, dtype) -> list[selftest.KernelResult]:
        return [
            selftest.KernelResult(name, "mismatch" if name == "attention" else "ok", "max rel err 3.0e-01")
            for name in selftest.CHECKS
        ]

    monkeypatch.setattr(selftest, "run", results)
    monkeypatch.setenv("DLM_KERNELS", "triton")  # the dispatch runs Triton here (interpreted on CPU)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    code, report = run_doctor("--port", str(free_port()))
    assert code == 1 and report["blockers"] == ["kernel attention"]
    monkeypatch.setenv("DLM_KERNELS", "torch")  # not used: reported, not blocking
    code, report = run_doctor("--port", str(free_port()))
    assert code == 0 and report["checks"]["kernel attention"]["status"] == "warn"


def test_bad_kernel_choice_is_a_blocker(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DLM_KERNELS", "bogus")
    # Not the choice an earlier test of this process cached: it passed only after one did,
    # and alone the whole report died on the default model's load.
    doctor.default_model_choice.cache_clear()
    code, report = run_doctor("--port", str(free_port()))
    doctor.default_model_choice.cache_clear()
    assert code == 1 and report["blockers"] == ["kernel dispatch"]
    assert report["checks"]["dtype"]["status"] == "warn" and "DLM_KERNELS" in report["checks"]["dtype"]["value"]


def test_store_reports_failed_unverified_and_corrupt_versions(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DLM_STORE", str(tmp_path))
    source = {"kind": "local", "path": "/src", "include": [], "exclude": [], "link": False}
    for version, ok in (("v1", True), ("v2", False), ("v3", None)):
        directory = tmp_path / "models" / "m" / version
        directory.mkdir(parents=True)
        verification = {"ok": ok, "at": "2026-01-01", "hashed": True, "family": None, "failures": [], "warnings": []}
        manifest = {
            "name": "m",
            "version": version,
            "source": source,
            "files": [],
            "fetched_at": f"2026-01-0{version[1]}",
            "content_sha256": "0",
            "verification": None if ok is None else verification,
        }
        (directory / "manifest.json").write_text(json.dumps(manifest))
    (tmp_path / "models" / "m" / "v4").mkdir()
    (tmp_path / "models" / "m" / "v4" / "manifest.json").write_text('{"name": "m", "version": ')
    code, report = run_doctor("--port", str(free_port()))
    store = report["checks"]["store"]
    assert code == 0 and store["status"] == "warn"
    assert (store["verified"], store["failed"], store["unverified"], store["corrupt"]) == (
        ["m@v1"],
        ["m@v2"],
        ["m@v3"],
        ["m@v4"],
    )


def test_table_names_the_blocker(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(doctor, "free_bytes", lambda path: 0)
    result = CliRunner().invoke(app, ["doctor", "--port", str(free_port())])
    assert result.exit_code == 1
    assert "blocked by: disk" in result.stdout
    assert "0.0 GiB free" in result.stdout


@pytest.mark.parametrize("port", ["99999", "-1"])
def test_a_port_serve_would_refuse_is_bad_usage(port: str) -> None:
    """`dlm doctor --port` takes a port as `dlm serve --port` does (one validation, one error):
    exit 2 and one `error:` line, never a traceback."""
    result = CliRunner().invoke(app, ["doctor", "--port", port])
    assert result.exit_code == 2 and not isinstance(result.exception, OverflowError), result.exception
    assert result.stderr.startswith("error: invalid setting port:"), result.stderr
    assert len(result.stderr.splitlines()) == 1


@pytest.mark.parametrize("package", ["torch", "triton", "transformers"])
def test_the_support_matrix_names_the_versions_ci_installs(package: str) -> None:
    """`tested with` says what the suite ran on: constraints.txt's pins (docs/install.md), which
    CI installs; the matrix once still said transformers 5.24 after the pin moved to 5.25."""
    text = (Path(__file__).resolve().parent.parent / "constraints.txt").read_text()
    pinned = re.search(rf"^{package}==(\d+\.\d+)", text, re.M)
    assert pinned is not None, f"constraints.txt pins no {package}"
    assert any(entry.split()[0] == pinned.group(1) for entry in doctor.SUPPORT_MATRIX[package]), (
        doctor.SUPPORT_MATRIX[package],
        pinned.group(1),
    )


@pytest.mark.parametrize("variable", ["DLM_STORE", "DLM_HOME"])
def test_a_store_path_that_is_a_file_is_reported(
    variable: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """DLM_STORE (or DLM_HOME) naming a file: every store command refuses it (exit 2), and
    doctor said `store ok, 0 verified`."""
    monkeypatch.delenv("DLM_STORE", raising=False)
    (tmp_path / "afile").write_text("")
    monkeypatch.setenv(variable, str(tmp_path / "afile"))
    code, report = run_doctor("--port", str(free_port()))
    store = report["checks"]["store"]
    assert code == 0 and store["status"] == "warn", store
    assert "unusable store" in store["value"] and "a file" in store["value"]
    assert variable in store["value"]


def test_a_corrupt_deployment_record_is_reported(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A deployment file edited into invalid JSON makes its release and rollback exit 1;
    doctor said `store ok`."""
    monkeypatch.setenv("DLM_STORE", str(tmp_path))
    (tmp_path / "deployments").mkdir()
    (tmp_path / "deployments" / "prod.json").write_text("{")
    code, report = run_doctor("--port", str(free_port()))
    store = report["checks"]["store"]
    assert code == 0 and store["status"] == "warn", store
    assert store["corrupt_deployments"] == ["prod"]
    assert "deployment prod's record is corrupt" in store["value"]
