"""Actuators: what a decision changes outside the policy, each saying what it did or why it could not.

docs/design.md's "Online" lists four ways to act on a live engine's memory:

* ``EngineQuota``: the engine's own KV quota and admission (``Engine.set_overcommit``,
  ``Engine.set_admit_headroom``), in process and immediate;
* ``TorchMemoryFraction``: ``torch.cuda.set_per_process_memory_fraction`` in the engine's process
  (immediate, but it only limits new allocations);
* ``rlctl.online.mps.MPSLimit``: NVIDIA MPS pinned device-memory limits, which bind only the MPS clients
  (engine processes) that start after they are set;
* ``rlctl.online.nvml.NVMLTelemetry``: what the driver says about the devices (read only).

None of them raises on a machine that lacks what it drives: each returns an ``ActuatorReport``
with ``applied=False`` and the reason, so the live loop can log it and carry on.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

DEFAULT_FRACTION_MARGIN = 0.05  # of the device: the allocator's rounding and fragmentation, cuBLAS workspaces


@dataclass(frozen=True)
class ActuatorReport:
    """What an actuator did (``applied``) or why it could not, in words (``detail``), and the value
    in force or read (``value``: a number, a dict, or None)."""

    name: str
    applied: bool
    detail: str
    value: Any = None

    def to_dict(self) -> dict:
        return asdict(self)


def engine_memory_bytes(engine) -> int:
    """Bytes the engine needs on its device at most: weights, a full batch's activation workspace
    and its whole KV capacity (every block it may hold), as the engine sizes its own budget."""
    return engine.memory.total


class EngineQuota:
    """The engine's KV quota: the overcommit factor its admission applies (immediate)."""

    name = "engine_quota"

    def __init__(self, engine) -> None:
        self.engine = engine

    def apply(self, factor: float) -> ActuatorReport:
        """Set the factor; the engine clamps it to its configured range and the report gives the
        factor in force."""
        eng = self.engine
        try:
            eng.set_overcommit(float(factor))
        except (TypeError, ValueError) as exc:
            return ActuatorReport(self.name, False, f"overcommit not changed: {exc}", eng.overcommit)
        return self.report(asked=factor)

    def apply_headroom(self, share: float) -> ActuatorReport:
        """Set the admission headroom: the share of the KV a new request must leave free."""
        eng = self.engine
        try:
            eng.set_admit_headroom(float(share))
        except (TypeError, ValueError) as exc:
            return ActuatorReport(self.name, False, f"admission headroom not changed: {exc}", eng.overcommit)
        return self.report()

    def report(self, asked: float | None = None) -> ActuatorReport:
        """The factor in force (``asked``: what it was set to, when clamped)."""
        eng = self.engine
        cfg, in_force = eng.config, eng.overcommit
        detail = f"overcommit {in_force:g} in force"
        if asked is not None and in_force != asked:
            detail += f" ({asked:g} asked, clamped to [{cfg.overcommit_min:g}, {cfg.overcommit_max:g}])"
        if eng.admit_headroom:
            detail += f"; a new request must leave {eng.admit_headroom:.0%} of the KV free"
        reserved, limit = eng.reserved_blocks(), in_force * eng.num_blocks
        if reserved > limit:
            detail += (f"; admission paused until the held peak demand ({reserved} blocks) fits "
                       f"{limit:.0f} blocks")
        return ActuatorReport(self.name, True, detail, in_force)


class TorchMemoryFraction:
    """``torch.cuda.set_per_process_memory_fraction`` for the engine's process.

    The fraction is the engine's memory (``engine_memory_bytes``) over the device's total, plus
    ``margin`` of the device. It caps what PyTorch's caching allocator may reserve from now on: it
    frees nothing already reserved, and memory outside the allocator (the CUDA context, NCCL) is
    not counted.
    """

    name = "torch_memory_fraction"

    def __init__(self, device: str = "cuda:0", margin: float = DEFAULT_FRACTION_MARGIN) -> None:
        if not 0 <= margin < 1:
            raise ValueError(f"margin must be in [0, 1), got {margin}")
        self.device, self.margin = device, margin

    def fraction_for(self, engine, total_bytes: int) -> float:
        """The fraction of a device of ``total_bytes`` that ``engine`` needs, margin included (at most 1)."""
        if total_bytes <= 0:
            raise ValueError(f"device total must be > 0 bytes, got {total_bytes}")
        return min(1.0, engine_memory_bytes(engine) / total_bytes + self.margin)

    def _cuda(self) -> str | None:
        """Why this actuator cannot act here, or None."""
        import torch

        if not torch.cuda.is_available():
            return "CUDA is not available"
        if torch.device(self.device).type != "cuda":
            return f"{self.device} is not a CUDA device"
        return None

    def _index(self):
        """The engine's CUDA device with its index ("cuda" alone means the current device):
        ``set_per_process_memory_fraction`` refuses a device without one."""
        import torch

        dev = torch.device(self.device)
        return dev if dev.index is not None else torch.device("cuda", torch.cuda.current_device())

    def apply(self, fraction: float) -> ActuatorReport:
        reason = self._cuda()
        if reason is not None:
            return ActuatorReport(self.name, False, reason)
        import torch

        if not (isinstance(fraction, (int, float)) and math.isfinite(fraction) and 0 < fraction <= 1):
            return ActuatorReport(self.name, False, f"memory fraction must be in (0, 1], got {fraction!r}")
        try:
            torch.cuda.set_per_process_memory_fraction(float(fraction), self._index())
        except (RuntimeError, ValueError) as exc:
            return ActuatorReport(self.name, False, f"set_per_process_memory_fraction failed: {exc}")
        total = torch.cuda.get_device_properties(self._index()).total_memory
        return ActuatorReport(
            self.name, True,
            f"{self._index()}: this process may allocate {fraction:.4f} of {total / 2**30:.1f} GiB "
            f"({fraction * total / 2**30:.2f} GiB); only new allocations are limited, memory already "
            f"reserved stays", float(fraction))

    def apply_for(self, engine) -> ActuatorReport:
        """Set the fraction ``engine`` needs on this device (``fraction_for``)."""
        reason = self._cuda()
        if reason is not None:
            return ActuatorReport(self.name, False, reason)
        import torch

        total = torch.cuda.get_device_properties(self._index()).total_memory
        report = self.apply(self.fraction_for(engine, total))
        if report.applied:
            report = ActuatorReport(report.name, True, report.detail + (
                f" (engine: {engine_memory_bytes(engine) / 2**30:.2f} GiB of weights, workspace and KV "
                f"capacity, plus a margin of {self.margin:.0%} of the device)"), report.value)
        return report
