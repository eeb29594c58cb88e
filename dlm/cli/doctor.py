"""`dlm doctor`'s checks: is this machine ready to serve, and if not, what blocks it?

Each check returns one `Check`: a status (ok, info, warn, or fail = a blocker), a one-line
value for the table, and its data for `--json`. Only what stops `dlm serve` from working
with its defaults is a blocker: a Triton kernel that does not compile or disagrees with its
torch twin on this device, an invalid `DLM_KERNELS`, too little free disk under the store,
the default port in use. Missing GPUs, an unreachable hub or unverified store versions are
reported, not blocking (CPU serving and offline stores are supported uses).

Everything is bounded so the whole run takes a few seconds: the hub check is one HEAD
request with a short timeout, started first and run beside the others.
"""

from __future__ import annotations

import platform
import shutil
import socket
import sys
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import cache
from importlib import metadata
from pathlib import Path
from typing import Any

from dlm.cli.hub import hub_status

# Below this much free disk under the store a fetch of even a small model fails.
MIN_FREE_DISK = 1 << 30
# Below this, warn: one 8B checkpoint in bf16 is about 16 GB.
LOW_FREE_DISK = 20 << 30

# What this version of dlm was tested with (the suite and benchmarks were run on these).
SUPPORT_MATRIX: dict[str, Any] = {
    "python": ["3.11"],
    "os": ["Linux x86_64"],
    "torch": ["2.13 (CPU build)"],
    "triton": ["3.9 (interpreter on CPU)"],
    "transformers": ["5.25"],
    # benchmarks/gpu_check.py, every section (docs/benchmarks.md, "GPU"), on a lent device.
    "gpus": ["NVIDIA H200 (torch 2.11 CUDA 13, triton 3.6)"],
}


@dataclass
class Check:
    name: str
    status: str  # ok | info | warn | fail (a blocker)
    value: str
    data: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {**self.data, "status": self.status, "value": self.value}


@dataclass
class Report:
    checks: list[Check]

    @property
    def blockers(self) -> list[str]:
        return [check.name for check in self.checks if check.status == "fail"]

    def to_dict(self) -> dict[str, Any]:
        return {
            "ok": not self.blockers,
            "blockers": self.blockers,
            "checks": {check.name: check.to_dict() for check in self.checks},
        }


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def check_python() -> Check:
    required = metadata.metadata("dlm")["Requires-Python"] if _version("dlm") else None
    data = {"version": platform.python_version(), "implementation": platform.python_implementation()}
    return Check("python", "ok", f"{data['version']} ({sys.executable})", {**data, "requires": required})


def check_torch() -> Check:
    import torch

    cuda, hip = torch.version.cuda, getattr(torch.version, "hip", None)
    build = f"CUDA {cuda}" if cuda else f"ROCm {hip}" if hip else "CPU-only"
    cudnn = torch.backends.cudnn.version() if cuda and torch.backends.cudnn.is_available() else None
    data = {"version": torch.__version__, "build": build, "cuda_runtime": cuda, "cudnn": cudnn}
    return Check("torch", "ok", f"{torch.__version__}, {build}", data)


def nvidia_driver() -> str | None:
    """The NVIDIA kernel driver's version, from /proc (no subprocess, no NVML)."""
    try:
        first = Path("/proc/driver/nvidia/version").read_text().splitlines()[0]
    except (OSError, IndexError):
        return None
    words = first.split()
    return next((w for w in words if w[:1].isdigit() and "." in w), first)


def check_driver() -> Check:
    version = nvidia_driver()
    if version is None:
        return Check("driver", "info", "absent (no NVIDIA driver loaded)", {"nvidia": None})
    return Check("driver", "ok", f"NVIDIA {version}", {"nvidia": version})


def check_gpus() -> Check:
    import torch

    if not torch.cuda.is_available():
        return Check("gpus", "info", "absent (CPU serving)", {"count": 0, "devices": []})
    devices = []
    for index in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(index)
        devices.append(
            {
                "index": index,
                "name": props.name,
                "memory_gib": round(props.total_memory / 2**30, 1),
                "compute_capability": f"{props.major}.{props.minor}",
            }
        )
    value = ", ".join(f"{d['name']} {d['memory_gib']} GiB sm_{d['compute_capability']}" for d in devices)
    return Check("gpus", "ok", value, {"count": len(devices), "devices": devices})


def check_nccl() -> Check:
    import torch
    import torch.distributed as dist

    if not (torch.cuda.is_available() and dist.is_available() and dist.is_nccl_available()):
        return Check("nccl", "info", "absent (tensor parallelism uses gloo on CPU)", {"version": None})
    version = ".".join(map(str, torch.cuda.nccl.version()))
    return Check("nccl", "ok", version, {"version": version})


def serving_device() -> Any:
    """The device `dlm serve` picks by default."""
    import torch

    return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")


@cache
def default_model_choice() -> Any:
    """What `--dtype auto` chooses for the default model on the serving device: decided per
    model (on a CPU by timing it, dlm/engine/cpu_plan.py), so the model is loaded to say."""
    from dlm.engine.llm import LLM

    return LLM(None, dtype="auto", device=str(serving_device())).dtype_choice


def check_dtype() -> Check:
    from dlm.engine.errors import DlmError

    try:
        choice = default_model_choice()
    except DlmError as exc:  # e.g. a bad DLM_KERNELS: its own check is the blocker, this says why no dtype
        return Check("dtype", "warn", f"not chosen: the default model did not load ({exc})")
    value = f"{choice.name} on {choice.device} for the default model: {choice.reason}"
    return Check("dtype", "ok", value, choice.to_dict())


def check_quantization() -> Check:
    """Which `--quantization` methods run here: each is probed (a small weight quantized and
    multiplied on the serving device, checked against the dense product), not assumed from
    the declaration. One the device should run but that fails its probe is a warning; serving
    without quantization is unaffected."""
    from dlm.engine.quantization import METHODS
    from dlm.engine.quantized_weights import probe

    device = serving_device()
    results = {name: probe(method, device) for name, method in METHODS.items()}
    supported = [name for name, why in results.items() if why is None]
    broken = [name for name, why in results.items() if why is not None and device.type in METHODS[name].devices]
    value = ", ".join(supported) or "none"
    value += "".join(f"; {name}: {why}" for name, why in results.items() if why is not None)
    data = {
        "device": str(device),
        "supported": supported,
        "refused": {n: w for n, w in results.items() if w},
        "library": {n: METHODS[n].library for n in results},
    }
    return Check("quantization", "warn" if broken else "ok", value, data)


def check_kernels() -> list[Check]:
    """DLM_KERNELS, triton, and every kernel's self-test on the serving device (in the dtype
    auto picks there), and how bf16 linear weights are held there."""
    import torch

    from dlm.kernels import dispatch, selftest

    device = serving_device()
    try:
        backend = dispatch.backend(device)
    except dispatch.KernelChoiceError as exc:
        return [Check("kernel dispatch", "fail", str(exc))]
    triton = _version("triton")
    layout = dispatch.linear_layout(torch.bfloat16, device)
    checks = [
        Check("kernel dispatch", "ok", f"{backend} on {device.type}", {"backend": backend, "device": str(device)}),
        Check("triton", "ok" if triton else "info", triton or "absent", {"version": triton}),
        # How bf16 linear weights are held here (docs/kernels.md#packed-bf16-linear-weights-cpu).
        Check("linear weights", "info", f"bf16: {layout}", {"bf16": layout}),
    ]
    dtype = default_model_choice().dtype
    # A failing kernel blocks only where the dispatch would run it (not under DLM_KERNELS=torch).
    failed = "fail" if backend == "triton" else "warn"
    for result in selftest.run(device, dtype):
        status = {"ok": "ok", "skipped": "info", "absent": "info"}.get(result.status, failed)
        value = f"{result.status}" + (f": {result.detail}" if result.detail else "")
        data = {"self_test": result.status, "detail": result.detail, "seconds": round(result.seconds, 3)}
        checks.append(Check(f"kernel {result.name}", status, value, data))
    return checks


def nearest_existing(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def free_bytes(path: Path) -> int:
    return shutil.disk_usage(nearest_existing(path)).free


def check_disk() -> Check:
    from dlm.cli.store.store import default_store_root

    root = default_store_root()
    free = free_bytes(root)
    data = {"path": str(root), "free_bytes": free}
    value = f"{free / 2**30:.1f} GiB free under {root}"
    if free < MIN_FREE_DISK:
        return Check("disk", "fail", f"{value} (need at least {MIN_FREE_DISK / 2**30:.0f} GiB)", data)
    return Check("disk", "warn" if free < LOW_FREE_DISK else "ok", value, data)


def port_in_use(host: str, port: int) -> str | None:
    """Why `host:port` cannot be bound (None: it is free), as uvicorn would bind it."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            return exc.strerror or str(exc)
    return None


def check_port(port: int) -> Check:
    from dlm.cli.server.config import ServeConfig

    host = ServeConfig.model_fields["host"].default
    busy = port_in_use(host, port)
    data = {"host": host, "port": port, "free": busy is None}
    if busy:
        return Check("port", "fail", f"{host}:{port} is not free ({busy}); serve with --port", data)
    return Check("port", "ok", f"{host}:{port} is free", data)


def check_store() -> Check:
    from dlm.cli.store.records import Manifest
    from dlm.cli.store.releases import readable_states
    from dlm.cli.store.store import CorruptVersion, Store, default_store_root, store_env, store_root_problem
    from dlm.engine.errors import DlmError

    store = Store(default_store_root())
    if (problem := store_root_problem(store.root)) is not None:  # every store command refuses it (exit 2)
        source = "DLM_STORE" if store_env() else "DLM_HOME"
        return Check("store", "warn", f"unusable store: {problem} (check {source})", {"root": str(store.root)})
    states: dict[str, list[str]] = {"verified": [], "unverified": [], "failed": [], "corrupt": []}
    try:
        for name in store.models():
            manifests, corrupt = store.versions(name)
            versions: list[Manifest | CorruptVersion] = [*manifests, *corrupt]
            for version in versions:
                states[version.state].append(version.ref)
        deployments = readable_states(store)[1]  # {deployment: why} for the unreadable ones
    except (DlmError, OSError) as exc:
        return Check("store", "warn", f"unreadable store at {store.root}: {exc}", {"root": str(store.root)})
    data = {"root": str(store.root), **states, "corrupt_deployments": sorted(deployments)}
    counts = f"{len(states['verified'])} verified"
    problems = []
    if states["failed"] or states["unverified"] or states["corrupt"]:
        bad = ", ".join(states["failed"] + states["unverified"] + states["corrupt"])
        fix = "`dlm verify` them, or `dlm rm` then `dlm fetch` a failed or corrupt one"
        problems.append(f"unverified, failed or corrupt: {bad} ({fix})")
    for deployment, why in sorted(deployments.items()):  # its release and rollback refuse to run
        problems.append(f"deployment {deployment}'s record is corrupt: {why}")
    if problems:
        return Check("store", "warn", f"{counts}; {'; '.join(problems)}", data)
    return Check("store", "ok", f"{counts} at {store.root}", data)


def probe_hub() -> Check:
    """One bounded HEAD request to the hub endpoint, unless offline mode is set."""
    status = hub_status()
    if status.offline:
        return Check("hub", "info", "offline mode (HF_HUB_OFFLINE): only local checkpoints", {"offline": True})
    data: dict[str, Any] = {"offline": False, "endpoint": status.endpoint}
    if status.problem is not None:
        return Check("hub", "warn", f"{status.problem}; set HF_HUB_OFFLINE=1 to skip", data)
    return Check("hub", "ok", f"{status.endpoint} reachable (HTTP {status.http_status})", data)


def check_support_matrix() -> Check:
    tested = ", ".join(f"{key} {'/'.join(v) if v else 'none yet'}" for key, v in SUPPORT_MATRIX.items())
    return Check("tested with", "info", tested, {"matrix": SUPPORT_MATRIX})


def diagnose(port: int) -> Report:
    """Run every check; the hub request runs beside the local ones."""
    with ThreadPoolExecutor(max_workers=1) as pool:
        hub: Future[Check] = pool.submit(probe_hub)
        local: list[Callable[[], Check | list[Check]]] = [
            check_python,
            check_torch,
            check_driver,
            check_gpus,
            check_nccl,
            check_kernels,
            check_dtype,
            check_quantization,
            check_disk,
            lambda: check_port(port),
            check_store,
        ]
        checks: list[Check] = []
        for run in local:
            found = run()
            checks.extend(found if isinstance(found, list) else [found])
        checks.append(hub.result())
    checks.append(check_support_matrix())
    return Report(checks)
