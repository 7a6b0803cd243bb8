"""The device the engine's memory is charged against, and the engine's out-of-memory error.

On CUDA the real allocator decides (a failed allocation raises ``torch.OutOfMemoryError``, which
becomes ``DeviceOOM``); on CPU a budget with a stated capacity plays the device, holding real host
tensors. Either way the ledger says where every byte went: weights, activation workspace, KV
pool, and other tenants of the same device.
"""
from __future__ import annotations

from collections import defaultdict
from contextlib import contextmanager
from typing import Iterator

import torch

KINDS = ("weights", "workspace", "kv", "tenants")


class DeviceOOM(RuntimeError):
    """The device could not provide memory the engine asked for."""

    def __init__(self, what: str, nbytes: int, free: int) -> None:
        super().__init__(f"out of device memory: {what} needs {nbytes} B, {free} B free")
        self.what, self.nbytes, self.free = what, nbytes, free


class Device:
    """A memory budget: ``capacity`` bytes, charged by kind.

    ``charge`` raises ``DeviceOOM`` when the bytes do not fit and changes nothing then. On CUDA,
    ``alloc`` also makes the real allocation and turns ``torch.OutOfMemoryError`` into ``DeviceOOM``.
    """

    def __init__(self, capacity: int, torch_device: str | torch.device = "cpu") -> None:
        if capacity <= 0:
            raise ValueError(f"device capacity must be > 0 bytes, got {capacity}")
        self.capacity = int(capacity)
        self.torch_device = torch.device(torch_device)
        self.charged: dict[str, int] = defaultdict(int)

    @classmethod
    def for_torch(cls, torch_device: str | torch.device, capacity: int | None) -> "Device":
        dev = torch.device(torch_device)
        if dev.type == "cuda":
            free, total = torch.cuda.mem_get_info(dev)
            return cls(min(capacity or total, total), dev)
        if capacity is None:
            raise ValueError("a CPU budget device needs a stated capacity in bytes")
        return cls(capacity, dev)

    @property
    def used(self) -> int:
        return sum(self.charged.values())

    @property
    def free(self) -> int:
        """Bytes the ledger has not charged: what the engine's own allocations are checked against."""
        return self.capacity - self.used

    def available(self) -> int:
        """Free memory as the device itself sees it, for the controller's snapshot. On CUDA another
        process's memory is in no ledger: the driver's free memory (``torch.cuda.mem_get_info``)
        plus what this process's allocator holds but does not use, capped by the ledger's free
        bytes. Elsewhere, the ledger's (a scenario's co-tenant is charged to it)."""
        if self.torch_device.type != "cuda":
            return self.free
        driver_free, _ = torch.cuda.mem_get_info(self.torch_device)
        cached = torch.cuda.memory_reserved(self.torch_device) - torch.cuda.memory_allocated(self.torch_device)
        return min(self.free, driver_free + cached)

    def held(self) -> int:
        """Bytes this process really holds on the device: the CUDA allocator's reservation (the
        ledger's charges elsewhere)."""
        if self.torch_device.type != "cuda":
            return self.used - self.charged["tenants"]
        return torch.cuda.memory_reserved(self.torch_device)

    def give_back(self) -> None:
        """Return memory the engine released (KV segments) to the device, so that another process
        (or the next segment) can have it: on CUDA the caching allocator would otherwise keep it."""
        if self.torch_device.type == "cuda":
            torch.cuda.empty_cache()

    def charge(self, kind: str, nbytes: int) -> None:
        if kind not in KINDS:
            raise ValueError(f"unknown memory kind {kind!r}")
        if nbytes > self.free:
            raise DeviceOOM(kind, nbytes, self.free)
        self.charged[kind] += nbytes

    def release(self, kind: str, nbytes: int) -> None:
        if nbytes > self.charged[kind]:
            raise AssertionError(f"releasing {nbytes} B of {kind} but only {self.charged[kind]} B are charged")
        self.charged[kind] -= nbytes

    def alloc(self, kind: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """Charge and allocate a real tensor on the device; on failure nothing stays charged."""
        nbytes = dtype.itemsize
        for d in shape:
            nbytes *= d
        self.charge(kind, nbytes)
        try:
            with self.allocating(kind):
                # zeros, not empty: attention masks unwritten slots, but 0 * NaN would still be NaN
                return torch.zeros(shape, dtype=dtype, device=self.torch_device)
        except DeviceOOM:
            self.release(kind, nbytes)
            raise

    @contextmanager
    def allocating(self, site: str) -> Iterator[None]:
        """Around every device allocation the engine makes outside the ledger (the forward pass,
        compaction's copy, swap out and in): a CUDA out-of-memory error becomes ``DeviceOOM``
        naming ``site``, so the engine handles it as an OOM event instead of dying."""
        try:
            yield
        except torch.OutOfMemoryError as exc:
            raise DeviceOOM(site, 0, self.free) from exc

    @contextmanager
    def transient(self, kind: str, nbytes: int) -> Iterator[None]:
        """Charge ``nbytes`` for the duration of a block (an iteration's activation workspace)."""
        self.charge(kind, nbytes)
        try:
            yield
        finally:
            self.release(kind, nbytes)

    def set_tenants(self, nbytes: int) -> None:
        """Other processes' memory on this device (a scenario's co-tenant). May exceed the free bytes."""
        if nbytes < 0:
            raise ValueError(f"tenant bytes must be >= 0, got {nbytes}")
        self.charged["tenants"] = int(nbytes)
