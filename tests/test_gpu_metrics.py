"""The serving GPU's series on /metrics (guides 000/001 watch memory and utilization): the
bytes allocated now, the peak since start, and the utilization where NVML (pynvml) is there to
say it; none on a CPU. torch.cuda is mocked: the same calls a GPU answers."""

from __future__ import annotations

import math
from unittest import mock

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from dlm.cli.server.metrics import ServerMetrics
from tests.serving import in_process_server

DEVICE = torch.device("cuda", 0)


def samples(metrics: ServerMetrics) -> dict[str, float]:
    return {
        s.name: s.value
        for family in text_string_to_metric_families(metrics.render().decode())
        for s in family.samples
        if s.name.startswith("dlm_gpu_")
    }


def cuda(utilization: object) -> mock._patch:  # type: ignore[type-arg]
    """torch.cuda answering for one device: 100 bytes now, 300 at the peak; `utilization` is
    what torch.cuda.utilization returns, or the exception it raises."""
    calls = {"memory_allocated": mock.Mock(return_value=100), "max_memory_allocated": mock.Mock(return_value=300)}
    calls["utilization"] = mock.Mock(
        side_effect=utilization if isinstance(utilization, Exception) else None, return_value=utilization
    )
    return mock.patch.multiple(torch.cuda, **calls)


def test_memory_now_and_its_peak() -> None:
    metrics = ServerMetrics()
    with cuda(ModuleNotFoundError("pynvml module not found, please install pynvml")):
        metrics.watch_gpu(DEVICE)
        assert torch.cuda.max_memory_allocated.call_args is None  # read at scrape time, not before
        found = samples(metrics)
        torch.cuda.max_memory_allocated.assert_called_with(DEVICE)
    # without pynvml torch cannot say how busy the GPU is: no series rather than a made-up 0
    assert found == {"dlm_gpu_memory_allocated_bytes": 100, "dlm_gpu_memory_max_allocated_bytes": 300}


def test_utilization_where_nvml_says_it() -> None:
    metrics = ServerMetrics()
    with cuda(42):
        metrics.watch_gpu(DEVICE)
        assert samples(metrics)["dlm_gpu_utilization_ratio"] == pytest.approx(0.42)
        torch.cuda.utilization.side_effect = RuntimeError("NVML_ERROR_GPU_IS_LOST")
        assert math.isnan(samples(metrics)["dlm_gpu_utilization_ratio"])  # a scrape never fails for it


def test_no_gpu_series_on_a_cpu() -> None:
    with in_process_server(model="tiny:llada", device="cpu", warmup=False) as client:
        text = client.get("/metrics").text
    assert "dlm_gpu_" not in text, [line for line in text.splitlines() if "gpu" in line]
