"""Block ids of the KV pool: the free list, reference counts, and the shape of the block map.

Free blocks are handed out lowest id first so that data packs at the bottom of the pool and the
tail can be released. The block manager knows nothing of tensors; ``KVPool`` holds those.

With ``caching`` (``EngineConfig.prefix_caching``) it also keeps a prefix cache's books, as vLLM's
and SGLang's: a full block whose KV was computed may carry a key (``Sequence.block_key``: what
its tokens and every token before them are), by which a later request with the same prefix takes
it (``claim``) instead of computing it again. A keyed block whose last holder frees it stays
cached while free: it counts as free, and is handed out (its key forgotten) only when no unkeyed
free block is left, least recently freed first (SGLang's radix cache evicts only when it must;
vLLM's one queue of free blocks evicts the least recently freed whatever it holds). Where the
device cannot grow the pool (``KVCache.allocate``), cached blocks go before the blocks above the
pool's held segments.
"""
from __future__ import annotations

import math
from collections import OrderedDict
from typing import Hashable

import numpy as np


class OutOfBlocks(RuntimeError):
    """Every block the engine may hold is in use."""


class BlockManager:
    def __init__(self, num_blocks: int, caching: bool = False) -> None:
        self.num_blocks = num_blocks
        self.ref_counts = np.zeros(num_blocks, dtype=np.int32)
        self._free = list(range(num_blocks - 1, -1, -1))  # descending: the lowest free id is last; unkeyed
        self.num_used = 0
        self.num_shared = 0  # references past each block's first: what counting a shared block once subtracts
        self.caching = caching
        self.key_of: dict[int, Hashable] = {}  # a cached block's key, whether in use or free
        self.block_of: dict[Hashable, int] = {}
        self.evictable: OrderedDict[int, None] = OrderedDict()  # free keyed blocks, least recently freed first

    @property
    def num_free(self) -> int:
        return self.num_blocks - self.num_used

    def usage(self) -> float:
        return self.num_used / self.num_blocks

    def allocate(self, n: int, held: int | None = None) -> list[int]:
        """The ``n`` lowest free block ids, each with reference count 1; all or nothing. Free blocks
        that hold a prefix cache's keys come after the unkeyed ones (with ``held``: after those below
        it, the blocks the pool's segments hold now), least recently freed first, and lose their keys."""
        if n > self.num_free:
            raise OutOfBlocks(f"{n} blocks needed, {self.num_free} free")
        free = self._free
        if self.evictable:
            return self._allocate_evicting(n, self.num_blocks if held is None else held)
        if n == 1:  # a decode crossing into a new block: most allocations
            ids = [free.pop()]
            self.ref_counts[ids[0]] = 1
        else:
            ids = free[:-n - 1:-1]
            del free[-n:]
            self.ref_counts[ids] = 1
        self.num_used += n
        return ids

    def _allocate_evicting(self, n: int, held: int) -> list[int]:
        free, ids = self._free, []
        while len(ids) < n and free and free[-1] < held:
            ids.append(free.pop())
        while len(ids) < n and self.evictable:
            block, _ = self.evictable.popitem(last=False)
            del self.block_of[self.key_of.pop(block)]
            ids.append(block)
        while len(ids) < n:
            ids.append(free.pop())
        self.ref_counts[ids] = 1
        self.num_used += n
        return ids

    # ---- the prefix cache (``caching``) ----------------------------------------------------------
    def top_taken(self, n: int, held: int | None = None) -> int:
        """The highest id ``allocate(n, held)`` would take of the unkeyed free blocks (-1: none), so
        that the pool can hold it before anything changes. ``held`` must be the pool's held blocks:
        every id below it is in use, cached or unkeyed free."""
        unkeyed = n if held is None else n - len(self.evictable)
        if held is not None and unkeyed <= held - self.num_used - len(self.evictable):
            return -1  # the unkeyed blocks below the pool and the cached ones suffice
        return self._free[-min(unkeyed, len(self._free))] if self._free and unkeyed > 0 else -1

    def lookup(self, key: Hashable) -> int | None:
        """The block cached under ``key``, or None."""
        return self.block_of.get(key)

    def cache(self, block: int, key: Hashable) -> None:
        """Cache a block in use under ``key``; a key already cached (another block computed the same
        prefix first) keeps its block, and a block keeps its first key."""
        if key not in self.block_of and block not in self.key_of:
            self.key_of[block], self.block_of[key] = key, block

    def num_free_among(self, ids: list[int]) -> int:
        """How many of ``ids`` are free (cached): what claiming them takes from the free blocks."""
        return int(np.count_nonzero(self.ref_counts[ids] == 0)) if ids else 0

    def forget(self, block: int) -> None:
        """A block in use is no longer cached under its key (if it had one)."""
        if self.ref_counts[block] <= 0:
            raise AssertionError(f"block {block} is free: a free cached block is forgotten only when handed out")
        key = self.key_of.pop(block, None)
        if key is not None:
            del self.block_of[key]

    def claim(self, ids: list[int]) -> None:
        """Another holder takes cached blocks, in use or free (those leave the free list)."""
        for b in ids:
            if self.ref_counts[b] == 0:
                del self.evictable[b]
                self.num_used += 1
            else:
                self.num_shared += 1
            self.ref_counts[b] += 1

    def drop_cached(self) -> None:
        """Forget every free cached block (they stay free); cached blocks in use keep their keys."""
        for b in self.evictable:
            del self.block_of[self.key_of.pop(b)]
        if self.evictable:
            self._free = np.flatnonzero(self.ref_counts == 0)[::-1].tolist()
            self.evictable.clear()

    def share(self, ids: list[int]) -> None:
        """Another holder takes a reference to blocks already in use."""
        for b in ids:
            if self.ref_counts[b] <= 0:
                raise AssertionError(f"block {b} is free and cannot be shared")
            self.ref_counts[b] += 1
            self.num_shared += 1

    def free(self, ids: list[int]) -> None:
        """Drop one reference to each block; a block whose count reaches zero is free again."""
        if not ids:
            return
        idx = np.asarray(ids)  # a block table names each block once
        counts = self.ref_counts[idx]
        if (counts <= 0).any():
            raise AssertionError(f"block {int(idx[np.argmax(counts <= 0)])} freed twice")
        if self.num_shared:
            self.num_shared -= int(np.count_nonzero(counts > 1))
        counts -= 1
        self.ref_counts[idx] = counts
        released = idx[counts == 0]
        if not released.size:
            return
        self.num_used -= released.size
        if self.key_of:  # keyed blocks stay cached, the last of a table first to go (vLLM's order)
            gone = set(released.tolist())
            keyed = [b for b in reversed(ids) if b in gone and b in self.key_of]
            if keyed:
                self.evictable.update(dict.fromkeys(keyed))
                released = released[~np.isin(released, keyed)]
                if not released.size:
                    return
        released = np.sort(released)[::-1].tolist()
        free = self._free
        if not free or released[0] < free[-1]:  # all below the lowest free id: they go last
            free.extend(released)
        elif released[-1] > free[0]:  # all above the highest: they go first
            free[:0] = released
        else:  # two descending runs, which the sort merges
            free.extend(released)
            free.sort(reverse=True)

    def highest_used(self) -> int:
        """The highest block id in use, or -1 when the pool is empty."""
        used = np.flatnonzero(self.ref_counts)
        return int(used[-1]) if used.size else -1

    def free_runs(self) -> list[int]:
        """Lengths of the maximal runs of free blocks over the whole block map."""
        free = np.zeros(self.num_blocks + 2, dtype=bool)  # padded: a run may start or end at either end
        np.equal(self.ref_counts, 0, out=free[1:-1])
        edges = np.flatnonzero(free[1:] != free[:-1])
        return (edges[1::2] - edges[::2]).tolist()

    def holes(self) -> int:
        """Free blocks below the highest block in use: what makes the footprint larger than the data."""
        top = self.highest_used()
        return int(np.count_nonzero(self.ref_counts[:max(top, 0)] == 0))

    def frag_entropy(self) -> float:
        """Normalised Shannon entropy of free-run lengths: 0 for one run, 1 for all single holes."""
        runs = self.free_runs()
        total = sum(runs)
        if len(runs) <= 1 or total <= 1:
            return 0.0
        h = -sum(p * math.log(p) for p in (r / total for r in runs))
        return min(h / math.log(total), 1.0)  # all single holes: 1, where rounding may give 1 + 1e-16

    def compaction_plan(self) -> list[tuple[int, int]]:
        """(source, destination) moves that pack the blocks in use into ids 0 .. num_used - 1:
        every block in use above that prefix moves into a hole below it. Both lists ascend, so
        neighbouring blocks stay neighbours and ``KVPool.copy_blocks`` copies them as one run."""
        packed = self.num_used
        sources = np.flatnonzero(self.ref_counts[packed:]) + packed
        holes = np.flatnonzero(self.ref_counts[:packed] == 0)
        return list(zip(sources.tolist(), holes.tolist()))

    def apply_moves(self, moves: list[tuple[int, int]]) -> None:
        """Record that each source block's data and references now live at its destination.
        Sources must be in use, destinations free, and no block may appear twice."""
        if not moves:
            return
        src, dst = np.asarray(moves, dtype=np.int64).T
        rc = self.ref_counts
        bad = np.flatnonzero((rc[src] <= 0) | (rc[dst] != 0))
        if bad.size:
            raise AssertionError(f"bad move {src[bad[0]]} -> {dst[bad[0]]}")
        if len(np.unique(np.concatenate((src, dst)))) != 2 * len(moves):
            raise AssertionError("bad moves: a block is moved, or moved to, more than once")
        if self.evictable:
            raise AssertionError("cached free blocks are dropped (drop_cached) before blocks move")
        if self.key_of:  # a moved block keeps its key
            keys = [(d, self.key_of.pop(b)) for b, d in zip(src.tolist(), dst.tolist()) if b in self.key_of]
            for d, key in keys:
                self.key_of[d], self.block_of[key] = key, d
        rc[dst], rc[src] = rc[src], 0
        self._free = np.flatnonzero(rc == 0)[::-1].tolist()
