"""One device ledger shared by several processes: the GPU's memory for engines that run as
separate processes (MPS clients, rlctl/online/process_node.py) where no GPU is.

On a GPU the device is shared by the hardware: each client's allocations come out of the same
memory, and one that does not fit fails in whichever process made it. Without one, the engines'
processes charge this ledger instead: a small file (its capacity, then the bytes charged per kind)
mapped into every process and locked around each charge (``fcntl.flock``), so that a charge sees
every other process's charges and refuses, with ``DeviceOOM``, what does not fit. Each engine
charges it through its own ``DeviceShare`` (engine/node.py), whose capacity is its MPS limit.
"""
from __future__ import annotations

import fcntl
import mmap
import os
import struct
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from engine.device import KINDS, Device, DeviceOOM

_LAYOUT = struct.Struct("<q" + "q" * len(KINDS))  # capacity, then bytes charged per kind in KINDS order


class SharedDevice(Device):
    """The ledger in the file at ``path`` (made by ``SharedDevice.create``), as this process sees it."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._fd = os.open(self.path, os.O_RDWR)
        if os.fstat(self._fd).st_size < _LAYOUT.size:
            os.close(self._fd)
            raise ValueError(f"{self.path}: not a shared device ledger ({_LAYOUT.size} bytes expected)")
        self._map = mmap.mmap(self._fd, _LAYOUT.size)
        super().__init__(self._read()[0])

    @classmethod
    def create(cls, path: str | Path, capacity: int) -> "SharedDevice":
        """A new ledger of ``capacity`` bytes, nothing charged, at ``path`` (replacing any file there)."""
        if capacity <= 0:
            raise ValueError(f"device capacity must be > 0 bytes, got {capacity}")
        Path(path).write_bytes(_LAYOUT.pack(int(capacity), *([0] * len(KINDS))))
        return cls(path)

    def close(self) -> None:
        self._map.close()
        os.close(self._fd)

    def _read(self) -> tuple[int, ...]:
        return _LAYOUT.unpack_from(self._map, 0)

    @contextmanager
    def _locked(self) -> Iterator[list[int]]:
        """The charges by kind, read and written back under the file's lock."""
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        try:
            capacity, *charged = self._read()
            before = list(charged)
            yield charged
            if charged != before:
                _LAYOUT.pack_into(self._map, 0, capacity, *charged)
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)

    @property
    def charged(self) -> dict[str, int]:
        """Bytes charged by kind, every process's together."""
        return dict(zip(KINDS, self._read()[1:]))

    @charged.setter
    def charged(self, value) -> None:  # Device.__init__ sets an empty ledger: the file holds it
        pass

    def charge(self, kind: str, nbytes: int) -> None:
        if kind not in KINDS:
            raise ValueError(f"unknown memory kind {kind!r}")
        with self._locked() as charged:
            free = self.capacity - sum(charged)
            if nbytes > free:
                raise DeviceOOM(kind, nbytes, free)
            charged[KINDS.index(kind)] += nbytes

    def release(self, kind: str, nbytes: int) -> None:
        with self._locked() as charged:
            i = KINDS.index(kind)
            if nbytes > charged[i]:
                raise AssertionError(f"releasing {nbytes} B of {kind} but only {charged[i]} B are charged")
            charged[i] -= nbytes

    def set_tenants(self, nbytes: int) -> None:
        if nbytes < 0:
            raise ValueError(f"tenant bytes must be >= 0, got {nbytes}")
        with self._locked() as charged:
            charged[KINDS.index("tenants")] = int(nbytes)
