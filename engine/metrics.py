"""The figures a replay reports, computed once from the engine's records and iteration log."""
from __future__ import annotations

import numpy as np


def _pct(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def meets_slo(record, ttft_slo_s: float | None, tpot_slo_s: float | None) -> bool:
    """A finished request meets its SLO when its TTFT and TPOT are within the targets set."""
    if record.finish_s is None:
        return False
    if ttft_slo_s is not None and record.ttft_s > ttft_slo_s:
        return False
    if tpot_slo_s is not None and record.tpot_s is not None and record.tpot_s > tpot_slo_s:
        return False
    return True


def summarize(engine, start_s: float = 0.0, end_s: float | None = None) -> dict:
    """Goodput, tokens/s, KV utilisation, OOMs, preemptions, swaps, TTFT/TPOT over [start_s, end_s].

    Throughput counts tokens of requests finished in the window, so a request is counted once.
    Goodput counts only those of requests that met the SLO (all finished ones when none is set).
    KV utilisation is time-weighted over iterations; its p99 is over iterations.
    """
    end_s = engine.clock if end_s is None else end_s
    span = max(end_s - start_s, 1e-9)
    cfg = engine.config
    records = list(engine.records.values())
    done = [r for r in records if r.finish_s is not None and start_s <= r.finish_s <= end_s]
    good = [r for r in done if meets_slo(r, cfg.ttft_slo_s, cfg.tpot_slo_s)]
    its = [it for it in engine.iterations if start_s < it.end_s <= end_s]
    util = np.array([it.alloc_ratio for it in its]) if its else np.zeros(1)
    weights = np.array([it.duration_s for it in its]) if its else np.ones(1)
    ttft = [r.ttft_s for r in done]
    tpot = [r.tpot_s for r in done if r.tpot_s is not None]
    traffic = engine.kv.traffic
    return {
        "duration_s": span,
        "requests_submitted": len(records),
        "requests_completed": len(done),
        "requests_unfinished": sum(1 for r in records if r.finish_s is None),
        "tokens_per_s": sum(r.output_len for r in done) / span,
        "goodput_tokens_per_s": sum(r.output_len for r in good) / span,
        "slo_attainment": len(good) / len(done) if done else None,
        "kv_util_mean": float(np.average(util, weights=weights)) if weights.sum() > 0 else float(util.mean()),
        "kv_util_p99": float(np.percentile(util, 99)),
        "oom_events": engine.counters.oom_events,
        "preemptions": engine.counters.preemptions,
        "swap_out_blocks": traffic.out_blocks,
        "swap_in_blocks": traffic.in_blocks,
        "swap_bytes": traffic.bytes,
        "compactions": engine.counters.compactions,
        "ttft_p50_s": _pct(ttft, 50), "ttft_p99_s": _pct(ttft, 99),
        "tpot_p50_s": _pct(tpot, 50), "tpot_p99_s": _pct(tpot, 99),
    }
