"""Timing the engine's executor on synthetic batches and copies, through the engine's own code on
real KV tensors (what ``rlctl profile`` fits its cost model to).

Each batch's sequences get their blocks from the engine's KV cache, so attention gathers through
real block tables from a real segmented pool; a point's time is the median of ``repeats`` runs
after one warm-up run, and its shape is ``batch_tokens(work)``, what a cost model sees in a
replay. Copies (compaction of k blocks into k holes, swap out and in of k blocks) are timed by the
executor's ``timed``, as the engine times them.
"""
from __future__ import annotations

import statistics
from typing import NamedTuple

import numpy as np

from engine.engine import Engine
from engine.records import RequestRecord
from engine.request import Request
from engine.scheduler import Work, batch_tokens
from engine.sequence import Sequence


class Point(NamedTuple):
    """One batch: ``decodes`` sequences decoding one token each at contexts spread around
    ``context``, plus (if ``chunk``) one prefill chunk of ``chunk`` tokens after ``chunk_start``
    tokens already computed."""

    decodes: int
    context: int
    chunk: int = 0
    chunk_start: int = 0

    @property
    def kind(self) -> str:
        return "mixed" if self.decodes and self.chunk else "decode" if self.decodes else "prefill"

    @property
    def max_tokens(self) -> int:
        """KV tokens the batch holds at most (decode contexts reach 1.5 x the mean)."""
        return self.decodes * (self.context * 3 // 2 + 1) + self.chunk_start + self.chunk


def _work(engine: Engine, sid: str, computed: int, num_tokens: int, rng: np.random.Generator) -> Work:
    """A sequence of ``computed + num_tokens`` tokens whose first ``computed`` have KV in the pool."""
    n = computed + num_tokens
    seq = Sequence(Request(sid, 0.0, n, 1, 1), rng.integers(0, engine.model_config.vocab_size, n).tolist(), 0,
                   engine.config.block_size, RequestRecord(sid, 0.0, n, 1), engine.max_model_len)
    seq.block_table = engine.kv.allocate(seq.blocks_for(n))
    seq.num_computed = computed
    return Work(seq, num_tokens)


def _batch(engine: Engine, p: Point, rng: np.random.Generator) -> list[Work]:
    work = []
    if p.decodes:  # contexts uniform in [context / 2, 3 context / 2], the exact mean when alone
        ctxs = [p.context] if p.decodes == 1 else rng.integers(p.context // 2, p.context * 3 // 2 + 1, p.decodes)
        work += [_work(engine, f"d{i}", max(int(c), 2) - 1, 1, rng) for i, c in enumerate(ctxs)]
    if p.chunk:
        work.append(_work(engine, "p", p.chunk_start, p.chunk, rng))
    return work


def _median_time(fn, repeats: int) -> float:
    fn()  # warm-up: the first run of a shape pays for allocations
    return statistics.median(fn() for _ in range(repeats))


def measure_iterations(engine: Engine, points: list[Point], repeats: int, seed: int) -> list[dict]:
    rows = []
    for i, p in enumerate(points):
        work = _batch(engine, p, np.random.default_rng([seed, i]))
        seconds = _median_time(lambda: engine.executor.execute(work)[1], repeats)
        rows.append({"kind": p.kind, **p._asdict(), **batch_tokens(work)._asdict(), "measured_s": seconds})
        for w in work:
            engine.kv.free(w.seq.block_table)
    return rows


def measure_copies(engine: Engine, sizes: tuple[int, ...], repeats: int) -> tuple[list[dict], list[dict]]:
    """Compaction of k blocks into k holes, and swap out / in of k blocks, for each k in ``sizes``."""
    kv, timed, block_bytes = engine.kv, engine.executor.timed, engine.pool.block_bytes

    def compact(k: int) -> float:
        ids, moves = kv.allocate(2 * k), {}  # lowest free first: 0 .. 2k-1
        kv.free(ids[:k])  # k holes below k blocks in use

        def move() -> int:
            moves.update(kv.compact())
            return len(moves) * block_bytes

        seconds = timed(move, "device")
        kv.free([moves.get(b, b) for b in ids[k:]])
        return seconds

    def swap_out(k: int) -> float:
        ids, host = kv.allocate(k), []

        def move() -> int:
            host.append(kv.swap_out(ids))
            return k * block_bytes

        seconds = timed(move, "host")
        kv.host.drop(host[0])
        return seconds

    def swap_in(k: int) -> float:
        host, ids = kv.swap_out(kv.allocate(k)), []

        def move() -> int:
            ids.extend(kv.swap_in(host))
            return k * block_bytes

        seconds = timed(move, "host")
        kv.free(ids)
        return seconds

    compaction = [{"blocks": k, "bytes": k * block_bytes, "measured_s": _median_time(lambda: compact(k), repeats)}
                  for k in sizes]
    swaps = [{"direction": d, "blocks": k, "bytes": k * block_bytes, "measured_s": _median_time(lambda: fn(k), repeats)}
             for k in sizes for d, fn in (("out", swap_out), ("in", swap_in))]
    return compaction, swaps
