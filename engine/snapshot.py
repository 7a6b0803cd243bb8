"""The snapshot: every quantity docs/design.md's "What the controller sees" lists, taken at a decision.

Values here are raw (ratios, counts, milliseconds, tokens); turning them into a bounded float32
observation is the environment's job, so the sidecar and the environment read the same record.
"""
from __future__ import annotations

import math
from bisect import bisect_right
from dataclasses import dataclass

import numpy as np

from engine.output_lengths import expected_remaining, kaplan_meier

# Fixed log-spaced bin edges (tokens) for the waiting-prompt and running-context histograms.
HIST_EDGES = (0, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, math.inf)
LENGTH_WINDOW_S = 60.0
OUT_RATIO_WINDOW = 64  # finished requests out_ratio averages over
OUTPUT_LENGTH_WINDOW = 256  # finished requests future_expected's length estimate reads


@dataclass(frozen=True)
class Snapshot:
    time_s: float
    alloc_ratio: float        # KV blocks in use / capacity
    alloc_slope: float        # change of alloc_ratio per second over the last interval
    frag_entropy: float       # normalised entropy of free-run lengths, in [0, 1]
    queue_len: int            # requests waiting for admission
    prefill_frac: float       # share of running sequences in prefill
    len_mean: float           # context length of requests completed in the last 60 s (tokens)
    len_std: float
    swapped: int              # sequences and session contexts whose KV is on the host
    decode_ms: float          # mean decode iteration time in the last interval
    overcommit: float         # current factor
    reserved_ratio: float     # admitted peak demand / capacity
    device_free: float        # free device memory / capacity
    queue_hist: tuple[float, ...]    # waiting prompt lengths, share per bin
    running_hist: tuple[float, ...]  # running context lengths, share per bin
    running: int = 0
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    kv_footprint_bytes: int = 0
    oom_events: int = 0
    preemptions: int = 0
    tokens_generated: int = 0
    restarting: bool = False
    # what memory the running requests hold and may still ask for, and how much of what they
    # declare requests really use: the overcommit decision's evidence
    kv_tokens_total: int = 0      # KV capacity in tokens
    max_num_seqs: int = 0
    preempt_mode: bool = False    # an OOM preempts (True) or crashes the engine (False)
    tokens_held: int = 0          # tokens of the running sequences (context, prompt, output so far)
    future_declared: int = 0      # tokens the running sequences may still generate by their max_tokens
    waiting_tokens: int = 0       # tokens of the waiting sequences
    out_ratio: float = 1.0        # output / declared max_tokens of the last 64 requests finished (1 before any)
    future_expected: float = 0.0  # tokens the running sequences are expected still to generate, given what each
                                  # has generated, by the output lengths of the last 256 finished (engine/output_lengths.py)
    waiting_late: int = 0         # requests waiting for their first token past the TTFT target (0 without one):
                                  # served now, they are late whatever comes next (Engine.waiting_late)


def histogram(lengths: list[int]) -> tuple[float, ...]:
    """Share of ``lengths`` (token counts, >= 0) in each ``HIST_EDGES`` bin (all zeros when empty).
    Counted with ``bisect``, not ``np.histogram`` (the same counts and shares, a tenth of the
    time on a few dozen lengths, twice a decision)."""
    if not lengths:
        return (0.0,) * (len(HIST_EDGES) - 1)
    counts = [0] * (len(HIST_EDGES) - 1)
    for n in lengths:  # bin i holds [HIST_EDGES[i], HIST_EDGES[i + 1]), the last one everything above
        counts[bisect_right(HIST_EDGES, n, 1, len(HIST_EDGES) - 1) - 1] += 1
    return tuple(c / len(lengths) for c in counts)


def mean_std(values: list[int]) -> tuple[float, float]:
    """``np.mean`` and ``np.std`` of a non-empty list of integers, to the last bit: the reductions
    numpy's own ``_mean`` and ``_var`` make, without their argument handling (~20 us a call)."""
    arr = np.array(values)
    mean = np.add.reduce(arr, dtype=np.float64, keepdims=True)
    mean /= arr.size
    dev = np.subtract(arr, mean)
    np.square(dev, out=dev)
    return float(mean[0]), math.sqrt(np.add.reduce(dev, dtype=np.float64) / arr.size)


def take_snapshot(engine, previous: Snapshot | None) -> Snapshot:
    """Read the engine now; ``previous`` is the last decision's snapshot (for slope and means)."""
    s, kv, now = engine.scheduler, engine.kv, engine.clock
    alloc = kv.blocks.usage()
    since = previous.time_s if previous else 0.0
    dt = now - since
    slope = (alloc - previous.alloc_ratio) / dt if previous and dt > 0 else 0.0
    log = engine.iterations
    first = log.find(since)  # the iterations of the last interval
    decodes = log.column("duration_s", first)[log.column("decode_tokens", first) > 0]
    finished = [f for f in engine.finished_lengths if f[0] >= now - LENGTH_WINDOW_S]
    len_mean, len_std = mean_std([f[1] for f in finished]) if finished else (0.0, 0.0)
    on_host = len(s.swapped) + engine.sessions.on_host()
    running_lengths, waiting_lengths = [len(q) for q in s.running], [len(q) for q in s.waiting]
    dev = engine.device
    return Snapshot(
        time_s=now, alloc_ratio=alloc, alloc_slope=slope, frag_entropy=kv.blocks.frag_entropy(),
        queue_len=len(s.waiting), prefill_frac=(sum(q.in_prefill for q in s.running) / len(s.running)) if s.running else 0.0,
        len_mean=len_mean, len_std=len_std,
        swapped=on_host, decode_ms=1000.0 * float(np.add.reduce(decodes) / decodes.size) if decodes.size else 0.0,
        overcommit=engine.overcommit, reserved_ratio=s.reserved_blocks() / kv.num_blocks,
        device_free=max(dev.available(), 0) / dev.capacity,
        queue_hist=histogram(waiting_lengths), running_hist=histogram(running_lengths),
        running=len(s.running), kv_blocks_used=kv.blocks.num_used, kv_blocks_total=kv.num_blocks,
        kv_footprint_bytes=engine.pool.footprint_bytes(), oom_events=engine.counters.oom_events,
        preemptions=engine.counters.preemptions, tokens_generated=engine.counters.tokens_generated,
        restarting=engine.down_until is not None, kv_tokens_total=kv.num_blocks * engine.pool.block_size,
        max_num_seqs=s.max_num_seqs, preempt_mode=engine.config.oom_mode == "preempt",
        tokens_held=sum(running_lengths),
        future_declared=sum(max(q.request.max_tokens - q.num_generated, 0) for q in s.running),
        waiting_tokens=sum(waiting_lengths),
        out_ratio=float(np.add.reduce(np.array(engine.out_ratios)) / len(engine.out_ratios)) if engine.out_ratios else 1.0,
        future_expected=future_expected(engine), waiting_late=engine.waiting_late())


def future_expected(engine) -> float:
    """What the running sequences are expected still to generate: ``expected_remaining`` over the
    Kaplan-Meier estimate of the last ``OUTPUT_LENGTH_WINDOW`` finished requests' output lengths,
    the unfinished ones' token counts censored."""
    running = engine.scheduler.running
    if not running:
        return 0.0
    going = [q.num_generated for q in engine.scheduler.unfinished() if q.num_generated > 0]
    lengths, survival = kaplan_meier(engine.output_lengths, going)
    return float(np.add.reduce(expected_remaining(lengths, survival, [q.num_generated for q in running],
                                                  [q.request.max_tokens for q in running])))
