"""Device telemetry through NVML (``pynvml``, from the ``nvidia-ml-py`` package).

``NVMLTelemetry().read()`` returns an ``ActuatorReport`` whose value holds, per device: name,
UUID, memory total / used / free in bytes, GPU and memory-controller utilisation in percent, and
the compute processes with the device memory each uses (where the driver tells). Where there is
no GPU, no driver or no NVML library it returns ``applied=False`` and "no GPU: <reason>"; it
never raises, so the live loop runs on without a GPU.
"""
from __future__ import annotations

from rlctl.online.actuators import ActuatorReport


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class NVMLTelemetry:
    name = "nvml"

    def _optional(self, nvml, fn, *args):
        """``fn(*args)``, or None where the device does not support it."""
        try:
            return fn(*args)
        except nvml.NVMLError:
            return None

    def _device(self, nvml, index: int) -> dict:
        handle = nvml.nvmlDeviceGetHandleByIndex(index)
        mem = nvml.nvmlDeviceGetMemoryInfo(handle)
        util = self._optional(nvml, nvml.nvmlDeviceGetUtilizationRates, handle)
        uuid = self._optional(nvml, nvml.nvmlDeviceGetUUID, handle)
        procs = self._optional(nvml, nvml.nvmlDeviceGetComputeRunningProcesses, handle)
        return {
            "index": index,
            "name": _text(nvml.nvmlDeviceGetName(handle)),
            "uuid": _text(uuid) if uuid is not None else None,
            "memory_total_bytes": int(mem.total),
            "memory_used_bytes": int(mem.used),
            "memory_free_bytes": int(mem.free),
            "gpu_util_percent": int(util.gpu) if util is not None else None,
            "memory_util_percent": int(util.memory) if util is not None else None,
            # usedGpuMemory is None where the driver cannot say (in containers, under MPS)
            "processes": None if procs is None else [
                {"pid": int(p.pid), "used_bytes": None if p.usedGpuMemory is None else int(p.usedGpuMemory)}
                for p in procs],
        }

    def read(self) -> ActuatorReport:
        try:
            import pynvml as nvml
        except ImportError as exc:
            return ActuatorReport(self.name, False, f"no GPU: pynvml is not installed ({exc})")
        try:
            nvml.nvmlInit()
        except nvml.NVMLError as exc:  # no library, no driver, no device
            return ActuatorReport(self.name, False, f"no GPU: {exc}")
        try:
            driver = _text(self._optional(nvml, nvml.nvmlSystemGetDriverVersion) or "unknown")
            devices = [self._device(nvml, i) for i in range(nvml.nvmlDeviceGetCount())]
        except nvml.NVMLError as exc:
            return ActuatorReport(self.name, False, f"no GPU: NVML could not read the devices ({exc})")
        finally:
            try:
                nvml.nvmlShutdown()
            except nvml.NVMLError:
                pass
        value = {"driver_version": driver, "devices": devices}
        if not devices:
            return ActuatorReport(self.name, False, "no GPU: NVML sees no device", value)
        return ActuatorReport(self.name, True, "; ".join(self._line(d) for d in devices), value)

    @staticmethod
    def _line(d: dict) -> str:
        gib = 2 ** 30
        line = (f"GPU {d['index']} {d['name']}: {d['memory_used_bytes'] / gib:.2f} GiB used of "
                f"{d['memory_total_bytes'] / gib:.2f} GiB ({d['memory_free_bytes'] / gib:.2f} GiB free)")
        if d["gpu_util_percent"] is not None:
            line += f", {d['gpu_util_percent']}% busy, memory {d['memory_util_percent']}% busy"
        if d["processes"] is not None:
            line += f", {len(d['processes'])} compute process{'es' if len(d['processes']) != 1 else ''}"
        return line
