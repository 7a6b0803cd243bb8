"""The KV cache: block ids (``BlockManager``) and their tensors (``KVPool``) kept in step, plus the
host pool that evicted blocks move to.

Every change of block ownership goes through here, so that ids handed out always have device
memory behind them and a failure leaves nothing half-done.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Iterable

import torch

from engine.block_manager import BlockManager, OutOfBlocks
from engine.device import DeviceOOM
from engine.kv_pool import KVPool


class NeedBlocks(RuntimeError):
    """Blocks could not be had: every block is in use, or the device could not grow the pool."""

    def __init__(self, n: int, cause: Exception) -> None:
        super().__init__(f"{n} KV blocks could not be allocated: {cause}")
        self.n, self.cause = n, cause


class HostFull(RuntimeError):
    """The host pool's budget cannot take more blocks."""


@dataclass
class HostPool:
    """Host memory for evicted KV blocks, with its own budget (pinned on CUDA)."""

    capacity: int
    pin: bool
    used: int = 0

    def store(self, data: torch.Tensor) -> torch.Tensor:
        nbytes = data.numel() * data.element_size()
        if self.used + nbytes > self.capacity:
            raise HostFull(f"host pool: {nbytes} B needed, {self.capacity - self.used} B free")
        if data.is_meta:  # a pool without tensors: the host keeps the books only
            host = data
        else:
            host = torch.empty(data.shape, dtype=data.dtype, pin_memory=self.pin)
            host.copy_(data)
        self.used += nbytes
        return host

    def drop(self, data: torch.Tensor) -> None:
        self.used -= data.numel() * data.element_size()


@dataclass
class CopyReport:
    """What a compaction or an eviction moved and what it cost."""

    blocks: int = 0
    bytes: int = 0
    seconds: float = 0.0
    bytes_released: int = 0
    contexts: int = 0
    sequences: int = 0


@dataclass
class SwapTraffic:
    """Blocks and bytes moved between device and host since the engine started."""

    out_blocks: int = 0
    in_blocks: int = 0
    bytes: int = 0


class FreeOrder:
    """The order in which vLLM's prefix cache hands free blocks out again, kept as counts
    (``EngineConfig.preempted_kv: lru``): a queue of who freed the free blocks, oldest first. A
    preempted sequence frees its blocks last first, its full blocks marked as its own; an allocation
    takes the blocks freed longest ago; what is still marked as a sequence's own when it is
    readmitted is the prefix of its KV the cache still holds. Every other free is unmarked."""

    def __init__(self, num_blocks: int) -> None:
        self.queue: deque[list] = deque([[None, num_blocks]])  # [owner, blocks]; the oldest first
        self.own: dict = {}  # owner -> its entry in the queue

    def freed(self, n: int, owner=None, kept: int = 0) -> None:
        kept = min(kept, n)
        if n > kept:
            self.queue.append([None, n - kept])
        if kept:
            self.own[owner] = entry = [owner, kept]
            self.queue.append(entry)

    def kept(self, owner) -> int:
        """Blocks of ``owner``'s prefix still cached."""
        entry = self.own.get(owner)
        return entry[1] if entry is not None else 0

    def taken(self, n: int, owner=None) -> None:
        """``n`` blocks allocated to ``owner``: what is still cached of its own first, then the oldest."""
        entry = self.own.pop(owner, None) if owner is not None else None
        if entry is not None:  # its own blocks leave the queue (the entry stays, emptied, until it is first)
            use = min(entry[1], n)
            entry[0], entry[1], n = None, entry[1] - use, n - use
        queue = self.queue
        while n > 0:
            entry = queue[0]
            k = min(entry[1], n)
            entry[1] -= k
            n -= k
            if entry[1] == 0:
                queue.popleft()
                if entry[0] is not None and self.own.get(entry[0]) is entry:
                    del self.own[entry[0]]
        while queue and queue[0][1] == 0:
            queue.popleft()


class KVCache:
    """With ``prefix``, a prefix cache (``EngineConfig.prefix_caching``): the books in
    ``BlockManager``, the keys from ``Sequence.block_key``; ``cached_prefix`` finds a new request's
    cached prefix, ``cache`` keys what a sequence has computed. ``prefix_hit_tokens`` over
    ``prefix_query_tokens`` is its hit rate, as vLLM reports it (tokens found cached over tokens
    looked up at admission, a readmitted request's generated tokens included)."""

    def __init__(self, pool: KVPool, host_bytes: int, lru: bool = False, prefix: bool = False) -> None:
        self.pool = pool
        self.traffic = SwapTraffic()
        self.blocks = BlockManager(pool.num_blocks, caching=prefix)
        self.host = HostPool(host_bytes, pin=pool.device.torch_device.type == "cuda")
        self.order = FreeOrder(pool.num_blocks) if lru else None
        self.prefix_hit_tokens = self.prefix_query_tokens = 0

    @property
    def num_blocks(self) -> int:
        return self.blocks.num_blocks

    def allocate(self, n: int, owner=None) -> list[int]:
        """``n`` blocks with device memory behind them, or ``NeedBlocks`` and no change; where a
        ``FreeOrder`` is kept, the blocks still cached for ``owner`` are the first taken."""
        if n <= 0:
            return []
        blocks, held = self.blocks, None
        if n > blocks.num_free:
            raise NeedBlocks(n, OutOfBlocks(f"{n} blocks needed, {blocks.num_free} free"))
        if blocks.evictable:  # a prefix cache's free blocks go last: the pool grows first, where the device lets it
            try:
                self.pool.ensure(blocks.top_taken(n))
            except DeviceOOM:  # it does not: the cached blocks go before those above the pool, and if they are
                held = self.pool.held_blocks  # not enough, a refusal takes none of them
                try:
                    self.pool.ensure(blocks.top_taken(n, held))
                except DeviceOOM as exc:
                    raise NeedBlocks(n, exc) from exc
        try:
            ids = blocks.allocate(n, held)
        except OutOfBlocks as exc:
            raise NeedBlocks(n, exc) from exc
        try:
            self.pool.ensure(max(ids))
        except DeviceOOM as exc:
            self.blocks.free(ids)
            raise NeedBlocks(n, exc) from exc
        if self.order is not None:
            self.order.taken(n, owner)
        return ids

    def free(self, ids: list[int], owner=None, kept: int = 0) -> None:
        """Drop a reference to each block; ``owner``'s first ``kept`` blocks stay cached for it
        while nothing takes them (``FreeOrder``, where the engine keeps one)."""
        if self.order is None:
            self.blocks.free(ids)
            return
        used = self.blocks.num_used
        self.blocks.free(ids)
        self.order.freed(used - self.blocks.num_used, owner, kept)

    def cached_prefix(self, seq) -> list[int]:
        """The longest run of ``seq``'s first full blocks the prefix cache holds, short of its last
        token (computed again to produce the next, as vLLM and SGLang do); ``claim`` takes them."""
        if not (self.blocks.caching and seq.cacheable):
            return []
        ids = []
        for j in range((len(seq.token_ids) - 1) // seq.block_size):
            block = self.blocks.lookup(seq.block_key(j))
            if block is None:
                break
            ids.append(block)
        return ids

    def claim(self, seq, ids: list[int]) -> None:
        """``seq`` takes the cached blocks ``cached_prefix`` found; those keyed by ``seq`` itself (its
        own KV, kept from a preemption) are its alone again, and unkeyed."""
        self.blocks.claim(ids)
        for b in ids[seq.shareable:]:
            self.blocks.forget(b)

    def cache(self, seq, own: bool = False) -> None:
        """Key ``seq``'s full blocks computed since the last call that another request may share, so
        that later requests find them; with ``own`` (a preemption) the rest too, keyed by ``seq``
        itself, for its readmission (nothing else could find them)."""
        if not (self.blocks.caching and seq.cacheable):
            return
        full = min(seq.num_computed // seq.block_size, len(seq.block_table))
        if seq.keyed > full:  # its table was replaced since (a swap-in, a requeue)
            seq.keyed = 0
        top = full if own else min(full, seq.shareable)
        for j in range(seq.keyed, top):
            self.blocks.cache(seq.block_table[j], seq.block_key(j))
        seq.keyed = max(seq.keyed, top)

    def swap_out(self, ids: list[int]) -> torch.Tensor:
        """Copy blocks to the host and free them on the device; ``HostFull`` or ``DeviceOOM`` (the
        copy could not be made) leaves them in place."""
        with self.pool.device.allocating("swap out"):
            host = self.host.store(self.pool.read_blocks(ids))
        self.free(ids)
        self.traffic.out_blocks += len(ids)
        self.traffic.bytes += len(ids) * self.pool.block_bytes
        return host

    def swap_in(self, host: torch.Tensor) -> list[int]:
        """Bring blocks back from the host into newly allocated device blocks. ``NeedBlocks``
        (no blocks) or ``DeviceOOM`` (the copy could not be made) leaves them on the host and
        takes no block."""
        ids = self.allocate(host.shape[0])
        try:
            with self.pool.device.allocating("swap in"):
                self.pool.write_blocks(ids, host)
        except DeviceOOM:
            self.free(ids)
            raise
        self.host.drop(host)
        self.traffic.in_blocks += len(ids)
        self.traffic.bytes += len(ids) * self.pool.block_bytes
        return ids

    def compact(self, holders: Iterable = ()) -> dict[int, int]:
        """Move the highest blocks in use into the lowest holes, rewrite the block table of every
        holder (anything with a ``block_table``: this is the one place block ids change) and
        release the freed tail. Returns the moves as {old id: new id}."""
        moves = dict(self.blocks.compaction_plan())  # a prefix cache's free blocks are holes like any free one
        if moves:
            with self.pool.device.allocating("compaction"):  # a failed copy changes no book: sources are intact
                self.pool.copy_blocks(list(moves.items()))
        self.blocks.drop_cached()  # cached free blocks are free memory: compaction packs and releases them
        self.blocks.apply_moves(list(moves.items()))
        self.pool.release_tail(self.blocks.highest_used())
        if moves:
            for holder in holders:
                holder.block_table = [moves.get(b, b) for b in holder.block_table]
        return moves

    def reset(self, num_blocks: int | None = None) -> None:
        """A crash or a restart: every block and every host copy is gone, the pool's memory
        returned; a restart under a new memory limit sizes the pool to ``num_blocks``."""
        self.pool.release_all()
        if num_blocks is not None:
            self.pool.resize(num_blocks)
        self.blocks = BlockManager(self.pool.num_blocks, caching=self.blocks.caching)
        self.host.used = 0
        if self.order is not None:
            self.order = FreeOrder(self.pool.num_blocks)
