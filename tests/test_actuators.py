"""Each actuator reports what it did or why it could not: the engine's quota on a real (tensor-free)
engine; the CUDA memory fraction and NVML where there is no GPU, and NVML's answers formatted
from a fake device (the functions of pynvml replaced: the protocol rlctl speaks to NVML)."""
from __future__ import annotations

import ctypes.util
import math
from types import SimpleNamespace

import pynvml
import pytest
import torch

from engine.config import EngineConfig
from engine.cost_model import CostModel
from engine.executor import ProfiledExecutor
from engine.request import Request
from rlctl.online.actuators import EngineQuota, TorchMemoryFraction, engine_memory_bytes
from rlctl.online.nvml import NVMLTelemetry
from rlctl.replay import build_engine

COST = CostModel(fixed_s=1.5e-3, per_token_s=2e-5, per_context_token_s=2e-7, copy_fixed_s=1e-5, copy_bytes_per_s=2e9)
GiB = 1 << 30


@pytest.fixture
def engine():
    return build_engine(EngineConfig(num_blocks=128, max_model_len=2048), 1.0, "crash",
                        executor=ProfiledExecutor(COST, materialize=False))


def test_engine_quota_sets_the_factor_and_reports_the_one_in_force(engine):
    quota = EngineQuota(engine)
    report = quota.apply(1.5)
    assert report.applied and report.value == 1.5 == engine.overcommit
    assert report.detail == "overcommit 1.5 in force"
    report = quota.apply(9.0)  # beyond the configured range, [1, 4] by default
    assert report.applied and report.value == 4.0 == engine.overcommit
    assert "9 asked, clamped to [1, 4]" in report.detail
    assert quota.apply(0.5).value == 1.0 == engine.overcommit
    assert quota.apply(math.inf).value == 4.0


@pytest.mark.parametrize("bad", [math.nan, 0.0, -1.0, "high"])
def test_engine_quota_refuses_a_factor_that_is_not_one_and_changes_nothing(engine, bad):
    report = EngineQuota(engine).apply(bad)
    assert not report.applied and report.value == 1.0 == engine.overcommit
    assert report.detail.startswith("overcommit not changed")


def test_backing_off_below_the_held_demand_says_admission_pauses(engine):
    quota = EngineQuota(engine)
    quota.apply(2.0)
    for i in range(6):  # 100 + 1024 tokens of peak demand each: 71 blocks
        engine.submit(Request(f"r{i}", 0.0, 100, 20, 1024))
    engine.step()
    held = engine.scheduler.reserved_blocks()
    assert held > 128
    report = quota.apply(1.0)
    assert report.applied
    assert f"admission paused until the held peak demand ({held} blocks) fits 128 blocks" in report.detail


def test_the_engines_memory_is_its_weights_workspace_and_kv_capacity(engine):
    # the engine sizes its own budget device the same way (EngineConfig.device_bytes unset)
    assert engine_memory_bytes(engine) == engine.device.capacity
    frac = TorchMemoryFraction(margin=0.05)
    assert frac.fraction_for(engine, 4 * engine.device.capacity) == pytest.approx(0.30)
    assert frac.fraction_for(engine, engine.device.capacity // 2) == 1.0
    with pytest.raises(ValueError):
        TorchMemoryFraction(margin=1.0)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_torch_memory_fraction_without_cuda_says_so(engine):
    frac = TorchMemoryFraction()
    for report in (frac.apply(0.5), frac.apply_for(engine)):
        assert not report.applied and report.detail == "CUDA is not available" and report.value is None


@pytest.mark.skipif(ctypes.util.find_library("nvidia-ml") is not None, reason="this machine has the NVML library")
def test_nvml_without_a_gpu_reports_no_gpu():
    report = NVMLTelemetry().read()
    assert not report.applied and report.detail.startswith("no GPU: ") and report.value is None


def test_nvml_errors_at_init_are_a_clean_no_gpu(monkeypatch):
    def no_driver():
        raise pynvml.NVMLError(pynvml.NVML_ERROR_DRIVER_NOT_LOADED)

    monkeypatch.setattr(pynvml, "nvmlInit", no_driver)
    report = NVMLTelemetry().read()
    assert not report.applied and report.detail == "no GPU: Driver Not Loaded"


class FakeNVML:
    """One device as NVML describes it; ``supported=False``: a device without utilisation or
    process accounting (NVML answers NOT_SUPPORTED)."""

    def __init__(self, monkeypatch, supported: bool = True) -> None:
        self.shutdowns = 0

        def not_supported(*_):
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)

        fns = {
            "nvmlInit": lambda: None,
            "nvmlShutdown": self._shutdown,
            "nvmlSystemGetDriverVersion": lambda: "560.35.03",
            "nvmlDeviceGetCount": lambda: 1,
            "nvmlDeviceGetHandleByIndex": lambda i: f"handle{i}",
            "nvmlDeviceGetName": lambda h: b"NVIDIA H200",  # bytes, as older bindings return it
            "nvmlDeviceGetUUID": lambda h: "GPU-5d1e3b8a-0000-0000-0000-000000000000",
            "nvmlDeviceGetMemoryInfo": lambda h: SimpleNamespace(total=140 * GiB, used=12 * GiB, free=128 * GiB),
            "nvmlDeviceGetUtilizationRates":
                (lambda h: SimpleNamespace(gpu=37, memory=12)) if supported else not_supported,
            "nvmlDeviceGetComputeRunningProcesses": (lambda h: [SimpleNamespace(pid=1234, usedGpuMemory=2 * GiB),
                                                                SimpleNamespace(pid=99, usedGpuMemory=None)])
            if supported else not_supported,
        }
        for name, fn in fns.items():
            monkeypatch.setattr(pynvml, name, fn)

    def _shutdown(self) -> None:
        self.shutdowns += 1


def test_nvml_reads_memory_utilisation_and_processes(monkeypatch):
    nvml = FakeNVML(monkeypatch)
    report = NVMLTelemetry().read()
    assert report.applied
    assert report.detail == ("GPU 0 NVIDIA H200: 12.00 GiB used of 140.00 GiB (128.00 GiB free), "
                             "37% busy, memory 12% busy, 2 compute processes")
    assert report.value == {"driver_version": "560.35.03", "devices": [{
        "index": 0, "name": "NVIDIA H200", "uuid": "GPU-5d1e3b8a-0000-0000-0000-000000000000",
        "memory_total_bytes": 140 * GiB, "memory_used_bytes": 12 * GiB, "memory_free_bytes": 128 * GiB,
        "gpu_util_percent": 37, "memory_util_percent": 12,
        "processes": [{"pid": 1234, "used_bytes": 2 * GiB}, {"pid": 99, "used_bytes": None}]}]}
    assert nvml.shutdowns == 1


def test_nvml_leaves_out_what_a_device_does_not_support(monkeypatch):
    nvml = FakeNVML(monkeypatch, supported=False)
    report = NVMLTelemetry().read()
    device = report.value["devices"][0]
    assert report.applied and device["gpu_util_percent"] is None and device["processes"] is None
    assert report.detail == "GPU 0 NVIDIA H200: 12.00 GiB used of 140.00 GiB (128.00 GiB free)"
    assert nvml.shutdowns == 1
