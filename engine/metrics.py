"""The figures of a run, computed here and only here: goodput, throughput, KV utilisation,
TTFT/TPOT, OOMs, preemptions, swaps.

Two views of the same records: ``summarize`` over a span of engine time (a replay, an episode),
and ``since`` over one decision interval, from a ``Mark`` taken at its start (the environment's
reward terms and step figures). Both count a request once, when it finishes: throughput is the
output tokens of requests finished in the span; goodput only those of requests that met the SLO
(all finished ones when none is set). Generated tokens are every token produced in the span,
finished or not. On-time tokens count, beside goodput's, the tokens streamed so far by the
requests still unfinished at the end that are on track for their SLO (``on_track``): goodput over a
window that ends with long outputs under way counts none of their work, and so favours a batch
drained before the window closes over one that keeps serving (docs/design.md, "Figures"). KV
utilisation is time-weighted over iterations; its p99 is over iterations.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


def percentile(values, q: float) -> float:
    """``float(np.percentile(values, q))`` (its default, linear method) of a non-empty list or
    array, to the last bit: the same virtual index, neighbours and interpolation, without
    ``np.percentile``'s general machinery, which costs ~30 us a call and the environment takes
    five a step. Data with a NaN go to ``np.percentile`` itself."""
    if isinstance(values, np.ndarray):
        ordered = np.sort(values).tolist()
        nan = ordered and ordered[-1] != ordered[-1]  # numpy sorts NaNs last
    else:
        ordered = sorted(values)
        nan = any(v != v for v in ordered)
    if nan:  # numpy's answer is NaN
        return float(np.percentile(values, q))
    n = len(ordered)
    virtual = (n - 1) * (q / 100)
    if virtual >= n - 1:  # numpy takes the last value for both neighbours (index -1)
        below = above = -1
    else:
        below = math.floor(virtual)
        above = below + 1
    gamma = virtual - below
    a, b = ordered[below], ordered[above]
    diff = b - a
    return b - diff * (1 - gamma) if gamma >= 0.5 else a + diff * gamma


def _pct(values: list[float], q: float) -> float | None:
    return percentile(values, q) if values else None


def meets_slo(record, ttft_slo_s: float | None, tpot_slo_s: float | None) -> bool:
    """A finished request meets its SLO when its TTFT and TPOT are within the targets set."""
    if record.finish_s is None:
        return False
    if ttft_slo_s is not None and record.ttft_s > ttft_slo_s:
        return False
    if tpot_slo_s is not None and record.tpot_s is not None and record.tpot_s > tpot_slo_s:
        return False
    return True


def _figures(engine, done: list, its: tuple[int, int], span: float) -> dict:
    """What ``done`` (records finished in the span) and ``its`` (the index range of its iterations)
    say, per second of ``span``."""
    cfg = engine.config
    good = [r for r in done if meets_slo(r, cfg.ttft_slo_s, cfg.tpot_slo_s)]
    ttft = [r.ttft_s for r in done]
    tpot = [r.tpot_s for r in done if r.tpot_s is not None]
    produced, on_time = sum(r.output_len for r in done), sum(r.output_len for r in good)
    return {
        "requests_completed": len(done),
        "tokens_per_s": produced / span,
        "goodput_tokens": on_time,
        "goodput_tokens_per_s": on_time / span,
        "late_tokens": produced - on_time,
        "generated_tokens_per_s": int(engine.iterations.column("generated", *its).sum()) / span,
        "slo_attainment": len(good) / len(done) if done else None,
        "slo_missed": len(done) - len(good),
        "ttft_p50_s": _pct(ttft, 50), "ttft_p99_s": _pct(ttft, 99),
        "tpot_p50_s": _pct(tpot, 50), "tpot_p99_s": _pct(tpot, 99),
    }


def kv_utilisation(engine, its: tuple[int, int]) -> tuple[float, float] | None:
    """(time-weighted mean, p99 over iterations) of KV utilisation over the iteration index range
    ``its``, or None without iterations."""
    if its[1] <= its[0]:
        return None
    util = engine.iterations.column("alloc_ratio", *its)
    weights = engine.iterations.column("duration_s", *its)
    total = weights.sum()  # np.average's own two reductions, without its argument handling
    mean = float(np.multiply(util, weights).sum() / total) if total > 0 else float(util.mean())
    return mean, percentile(util, 99)


def summarize(engine, start_s: float = 0.0, end_s: float | None = None) -> dict:
    """Every figure of the span [start_s, end_s] of engine time (default: the whole run so far)."""
    end_s = engine.clock if end_s is None else end_s
    span = max(end_s - start_s, 1e-9)
    done = [r for r in engine.completed if start_s <= r.finish_s <= end_s]
    its = (engine.iterations.find(start_s), engine.iterations.find(end_s))  # ending in (start_s, end_s]
    util_mean, util_p99 = kv_utilisation(engine, its) or (0.0, 0.0)
    traffic = engine.traffic
    figures = _figures(engine, done, its, span)
    return {
        "duration_s": span,
        "requests_submitted": len(engine.records),
        "requests_completed": figures["requests_completed"],
        "requests_unfinished": len(engine.records) - len(engine.completed),
        # the queue as it stands now (as requests_unfinished): arrived, no first token yet; and of
        # those, waiting past the TTFT target already
        "requests_waiting": len(engine.waiting_since()),
        "requests_waiting_late": engine.waiting_late(),
        # requests whose clients gave up before their first token (EngineConfig.client_timeout_s)
        "requests_abandoned": engine.counters.abandoned,
        "tokens_per_s": figures["tokens_per_s"],
        "goodput_tokens_per_s": figures["goodput_tokens_per_s"],
        "generated_tokens_per_s": figures["generated_tokens_per_s"],
        # goodput's tokens and those streamed on track by the requests unfinished now
        "ontime_tokens_per_s": (figures["goodput_tokens"] + work_under_way(engine)) / span,
        "slo_attainment": figures["slo_attainment"],
        "kv_util_mean": util_mean,
        "kv_util_p99": util_p99,
        "oom_events": engine.counters.oom_events,
        "preemptions": engine.counters.preemptions,
        "recomputed_tokens": engine.counters.recomputed_tokens,
        "swap_out_blocks": traffic.out_blocks,
        "swap_in_blocks": traffic.in_blocks,
        "swap_bytes": traffic.bytes,
        "compactions": engine.counters.compactions,
        # tokens a prefix cache held at admission over those looked up (EngineConfig.prefix_caching)
        "prefix_cache_hit_rate": engine.kv.prefix_hit_tokens / max(engine.kv.prefix_query_tokens, 1),
        **{k: figures[k] for k in ("ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "tpot_p99_s")},
    }


def generated_so_far(engine) -> dict[str, int]:
    """Tokens generated so far by every request the engine holds unfinished (queued, running, on the host)."""
    return {q.id: q.num_generated for q in engine.scheduler.unfinished()}


def on_track(engine, seq) -> bool:
    """Whether an unfinished request can still meet its SLO as it has run so far: its first token
    came (or can still come) within the TTFT target, and its tokens so far came within the TPOT target."""
    cfg, r, now = engine.config, seq.record, engine.clock
    if r.first_token_s is None:
        return cfg.ttft_slo_s is None or now - r.arrival_s <= cfg.ttft_slo_s
    if cfg.ttft_slo_s is not None and r.first_token_s - r.arrival_s > cfg.ttft_slo_s:
        return False
    return (cfg.tpot_slo_s is None or seq.num_generated < 2
            or (now - r.first_token_s) / (seq.num_generated - 1) <= cfg.tpot_slo_s)


def work_under_way(engine, before: dict[str, int] | None = None, late: bool = False) -> int:
    """Tokens generated since ``before`` (``generated_so_far`` then; all so far without it) by the
    requests still unfinished now that are on track for their SLO (with ``late``: those no longer
    on track): what a horizon's end counts of work under way, and the potential of the training
    reward's shaping (env/overcommit_env.py)."""
    before = before or {}
    return sum(q.num_generated - before.get(q.id, 0) for q in engine.scheduler.unfinished()
               if on_track(engine, q) != late)


@dataclass(frozen=True)
class Mark:
    """Where an interval starts: the clock, and how far the engine's logs and counters had got."""

    time_s: float
    completed: int
    iterations: int
    oom_events: int
    preemptions: int
    recomputed_tokens: int
    abandoned: int


def mark(engine) -> Mark:
    c = engine.counters
    return Mark(engine.clock, len(engine.completed), len(engine.iterations), c.oom_events, c.preemptions,
                c.recomputed_tokens, c.abandoned)


def since(engine, start: Mark) -> dict:
    """The figures of the interval from ``start`` to now, with ``slo_violation``: the share of the
    requests that finished in it, are waiting at its end or were given up by their clients in it
    that missed (or, waiting, already exceed; given up, never met) the TTFT/TPOT target, in [0, 1]
    (0 without an SLO). KV utilisation of an interval with no iteration is the utilisation now."""
    span = max(engine.clock - start.time_s, 1e-9)
    cfg = engine.config
    done = engine.completed[start.completed:]
    its = (start.iterations, len(engine.iterations))
    figures = _figures(engine, done, its, span)
    util = kv_utilisation(engine, its)
    late = engine.waiting_late()
    gone = engine.counters.abandoned - start.abandoned
    judged = len(done) + engine.queue_lengths()[0] + gone
    slo_set = cfg.ttft_slo_s is not None or cfg.tpot_slo_s is not None
    figures.update(
        duration_s=span, kv_util=util[0] if util else engine.kv_usage(),
        slo_violation=(figures["slo_missed"] + late + gone) / judged if slo_set and judged else 0.0,
        oom_events=engine.counters.oom_events - start.oom_events,
        preemptions=engine.counters.preemptions - start.preemptions,
        recomputed_tokens=engine.counters.recomputed_tokens - start.recomputed_tokens)
    return figures
