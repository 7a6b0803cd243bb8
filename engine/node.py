"""Several engines on one device: a node of MPS clients, each with its own pinned-memory limit.

Each engine runs as it does alone; what changes is the device it charges. ``DeviceShare`` is one
MPS client's view of the shared ``Device``: its own limit (what ``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT``
pins) and whatever the device has left, so a charge fails with ``DeviceOOM`` when either is
exceeded, and the engine whose allocation failed takes its own OOM path (crash or preempt). The
limits may sum to more than the device: overcommit across tenants.

An engine sizes its KV capacity from its limit, as vLLM sizes it from the memory it sees
(``kv_blocks_within``), and its pool grows and shrinks within it. MPS binds a limit only when a
client starts, so a new limit takes effect through a graceful restart (``Node.set_limit``:
every request held is requeued with its tokens, the KV is recomputed, the engine is down for its
restart time). Within the limit the engine's own quota, the overcommit factor, moves live.

Time: each engine keeps its own clock (its executor's durations). The node advances them in
lockstep slices of ``slice_s``: in each slice every engine runs to the slice's end, the one
furthest behind first, so no engine takes memory more than a slice ahead of another. An engine
whose pool holds no block at a slice's end gives the pool's memory back (a compaction that moves
nothing and costs nothing); a pool with blocks in use shrinks only when compacted (``defrag``). Compute
sharing between clients is the cost models' business (a scenario derates each engine's roofline
by its share of the GPU); the node shares memory.
"""
from __future__ import annotations

from collections import deque
from contextlib import contextmanager
from dataclasses import replace
from typing import Iterator

from engine.config import EngineConfig, ModelConfig, kv_blocks_within, max_model_len
from engine.control import Event, advance
from engine.device import KINDS, Device, DeviceOOM
from engine.engine import Engine
from engine.executor import TorchExecutor


class DeviceShare(Device):
    """One MPS client's memory on a shared ``Device``: ``capacity`` is its pinned-memory limit.

    Every charge is made against the limit and against the shared device's ledger; either one
    refusing raises ``DeviceOOM`` and changes nothing. ``charged`` is this client's own ledger,
    by kind; the shared device's is the sum over its clients (and its other tenants).

    An iteration's workspace stays with the client once used, as PyTorch's caching allocator
    keeps it: only growth past the largest workspace kept is charged, and the client keeps it
    until it gives KV memory back (the engine then empties its cache) or its process ends. So
    another client cannot take it between two iterations; the client runs out of memory when its
    KV pool must grow and the device has nothing left."""

    def __init__(self, device: Device, limit: int, name: str = "") -> None:
        if limit > device.capacity:
            raise ValueError(f"engine {name!r}: an MPS limit of {limit} B is more than the device's {device.capacity} B")
        super().__init__(limit, device.torch_device)
        self.shared, self.name = device, name
        self.cached = 0  # workspace bytes kept after the iteration that used them

    @property
    def free(self) -> int:
        """Bytes this client can still charge: within its limit and what the device has left."""
        return min(self.capacity - self.used, self.shared.free)

    def available(self) -> int:
        return min(self.capacity - self.used, self.shared.available())

    def held(self) -> int:
        return self.used if self.torch_device.type != "cuda" else super().held()

    def charge(self, kind: str, nbytes: int) -> None:
        if kind not in KINDS:
            raise ValueError(f"unknown memory kind {kind!r}")
        if nbytes > self.capacity - self.used:  # the client's own limit: MPS refuses the allocation
            raise DeviceOOM(kind, nbytes, self.capacity - self.used)
        self.shared.charge(kind, nbytes)  # the device has run out: another client holds the rest
        self.charged[kind] += nbytes

    def release(self, kind: str, nbytes: int) -> None:
        super().release(kind, nbytes)
        self.shared.release(kind, nbytes)
        if kind == "kv":  # KV given back: the engine empties its cache, the kept workspace too
            self._drop_cache()

    def give_back(self) -> None:
        """The client empties its cache (it gave KV back, or its process ended): the kept workspace goes."""
        self._drop_cache()
        super().give_back()

    def _drop_cache(self) -> None:
        if self.cached:
            self.cached, kept = 0, self.cached
            self.release("workspace", kept)

    @contextmanager
    def transient(self, kind: str, nbytes: int) -> Iterator[None]:
        """An iteration's workspace: charged only past what the client already keeps, then kept."""
        if kind != "workspace":
            raise ValueError(f"only an iteration's workspace is transient, got {kind!r}")
        if nbytes > self.cached:
            self.charge(kind, nbytes - self.cached)
            self.cached = nbytes
        yield

    def set_tenants(self, nbytes: int) -> None:
        raise TypeError("memory outside the node is the shared device's: set it on Node.device")

    def set_limit(self, limit: int) -> None:
        """A new pinned-memory limit: only at a (re)start, with nothing but what the client holds."""
        if not 0 < limit <= self.shared.capacity:
            raise ValueError(f"engine {self.name!r}: an MPS limit must be in (0, {self.shared.capacity}] B, got {limit}")
        if limit < self.used:
            raise ValueError(f"engine {self.name!r}: an MPS limit of {limit} B is below the {self.used} B it holds")
        self.capacity = int(limit)


class Node:
    """Engines sharing one ``Device``, each an MPS client (``DeviceShare``) with its own limit."""

    def __init__(self, device: Device, slice_s: float = 0.5) -> None:
        if not slice_s > 0:
            raise ValueError(f"slice_s must be > 0, got {slice_s}")
        self.device, self.slice_s = device, slice_s
        self.engines: dict[str, Engine] = {}
        self.clock = 0.0

    def add(self, name: str, model_config: ModelConfig, config: EngineConfig, limit: int, **engine_kwargs) -> Engine:
        """An engine named ``name`` under an MPS limit of ``limit`` bytes, its KV capacity sized to it."""
        if not name or name in self.engines:
            raise ValueError(f"engine name {name!r} is empty or already in the node")
        share = DeviceShare(self.device, int(limit), name)
        executor = engine_kwargs.setdefault("executor", TorchExecutor())
        blocks = kv_blocks_within(model_config, config, int(limit), workspace=lambda c: executor.max_workspace_bytes(
            model_config, c, max_model_len(model_config, c)))
        if blocks * config.block_size < min(config.max_model_len, model_config.max_position):
            raise ValueError(f"engine {name!r}: an MPS limit of {limit / 1e9:.2f} GB holds {blocks} KV blocks, "
                             f"less than one {config.max_model_len}-token sequence after its weights and workspace")
        cfg = replace(config, num_blocks=blocks)
        try:
            engine = Engine(model_config, cfg, device=share, **engine_kwargs)
        except DeviceOOM as exc:
            raise ValueError(f"engine {name!r}: its weights do not fit the device beside the others' ({exc})") from None
        self.engines[name] = engine
        return engine

    @property
    def names(self) -> list[str]:
        return list(self.engines)

    def share(self, name: str) -> DeviceShare:
        return self.engines[name].device

    def limits(self) -> dict[str, int]:
        return {n: e.device.capacity for n, e in self.engines.items()}

    def has_work(self) -> bool:
        return any(e.has_work() for e in self.engines.values())

    def advance(self, until: float, events: dict[str, deque[Event]] | None = None) -> None:
        """Run every engine to ``until`` in lockstep slices (see the module docstring), applying
        each engine's ``events`` at their times. An engine with nothing left idles: its clock
        follows the node's."""
        events = events or {}
        while self.clock < until:
            self.clock = min(self.clock + self.slice_s, until)
            for name in sorted(self.engines, key=lambda n: self.engines[n].clock):
                e = self.engines[name]
                advance(e, self.clock, events.get(name))
                if e.clock < self.clock and not e.has_work():
                    e.clock = self.clock
                if e.blocks_used() == 0 and e.footprint_bytes() > 0 and e.down_until is None:
                    e.compact()  # moves nothing: an empty pool gives its memory back to the others

    def limit_for(self, name: str, num_blocks: int) -> int:
        """The MPS limit an engine needs to hold ``num_blocks`` KV blocks (weights, a full batch's
        workspace and the blocks: ``memory_plan``)."""
        e = self.engines[name]
        return e.plan_memory(replace(e.config, num_blocks=num_blocks)).total

    def set_limit(self, name: str, limit: int) -> bool:
        """Restart engine ``name`` gracefully under a new MPS limit (MPS binds a limit only at a
        client's start); its KV capacity is sized to the new limit. False when it is the limit in
        force (no restart)."""
        e, share = self.engines[name], self.share(name)
        limit = int(limit)
        if limit == share.capacity:
            return False
        if not 0 < limit <= self.device.capacity:
            raise ValueError(f"engine {name!r}: an MPS limit must be in (0, {self.device.capacity}] B, got {limit}")
        blocks = kv_blocks_within(e.model_config, e.config, limit, e.memory.weights, e.max_workspace_bytes)
        e.restart(blocks)  # raises, changing nothing, when the blocks cannot hold one sequence
        share.set_limit(limit)
        return True
