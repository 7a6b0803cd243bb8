"""An episode's requests from a scenario's workload: a trace window or a generator draw.

A trace episode replays ``episode_s`` of engine time, i.e. ``episode_s x time_scale`` of trace
time, from a window start drawn uniformly from ``starts`` (default: anywhere in the trace). A
generator episode draws its arrivals and lengths for ``episode_s``. Both draw only from the
generator they are given, so one seed gives one workload.
"""
from __future__ import annotations

from dataclasses import replace
from functools import lru_cache
from pathlib import Path

import numpy as np

from env.scenario import Distribution, PhasedWorkload, TraceWorkload, Workload
from env.workloads import (
    EmpiricalLengths, GammaArrivals, LogNormalLengths, MarkovModulatedArrivals, ParetoLengths, PoissonArrivals,
    ReplaySpec, Request, Trace, build_requests, bundled_trace, generate, generate_phases, generate_sessions,
    read_trace)
from env.workloads._checks import positive

def trace_path(name: str) -> Path:
    """A bundled trace by file name, or a path."""
    p = Path(name).expanduser()
    if not p.exists() and bundled_trace(name).exists():
        return bundled_trace(name)
    if not p.exists():
        known = sorted(x.name for x in bundled_trace("").glob("*.*") if x.suffix != ".md")
        raise FileNotFoundError(f"trace {name}: no such file (bundled: {', '.join(known)})")
    return p


@lru_cache(maxsize=16)
def _trace(path: Path) -> Trace:
    return read_trace(path)


def load_trace(name: str) -> Trace:
    """A bundled trace by file name, or the trace at a path; read once."""
    return _trace(trace_path(name))


def trace_span(w: TraceWorkload) -> float:
    """Trace seconds the workload's trace covers (arrival times, or rows / rate for length-only traces)."""
    t = _trace(trace_path(w.trace))
    if t.has_arrivals:
        return t.last_arrival_s
    return len(t) / w.rate_rps


# Each value goes to its distribution as written: the distribution checks it and names it ("mean must be
# > 0"), where a conversion here would read "fast" as a float's error and a low of 1.5 as 1.
def _arrivals(d: Distribution):
    p = d.params
    if d.kind == "poisson":
        return PoissonArrivals(p["rate"])
    if d.kind == "gamma":
        return GammaArrivals(p["rate"], p["cv"])
    return MarkovModulatedArrivals(_numbers(p, "rates"), _numbers(p, "mean_dwell_s"))


def _numbers(p: dict, key: str) -> tuple:
    if not isinstance(p[key], list):
        raise ValueError(f"{key} must be a list of numbers, one a state, got {p[key]!r}")
    return tuple(p[key])


def _bound(value):
    """A length bound as written: a whole number written with a point (16000.0) reads as the integer it
    is; 1.5 stays 1.5, for the distribution to refuse."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


def _lengths(d: Distribution):
    p = d.params
    if d.kind == "lognormal":
        return LogNormalLengths(p["mean"], p["sigma"], _bound(p.get("low", 1)), _bound(p.get("high")))
    if d.kind == "pareto":
        return ParetoLengths(p["alpha"], _bound(p["low"]), _bound(p["high"]))
    if not isinstance(p["trace"], str) or not p["trace"]:
        raise ValueError(f"trace must name a trace file, got {p['trace']!r}")
    if p["column"] not in ("prompt", "output"):
        raise ValueError(f"column must be prompt or output, got {p['column']!r}")
    return _empirical(trace_path(p["trace"]), p["column"])


def check_distribution(d: Distribution, arrivals: bool) -> None:
    """Build ``d`` (an arrival process, or a length distribution) once, so that a bad value fails at
    load naming its key (``ValueError``)."""
    (_arrivals if arrivals else _lengths)(d)


@lru_cache(maxsize=16)
def _empirical(path: Path, column: str) -> EmpiricalLengths:
    """A trace's recorded lengths, built once per trace and column (every episode draws from them)."""
    t = _trace(path)
    return EmpiricalLengths((t.prompt_lens if column == "prompt" else t.output_lens).tolist())


def _first_prompt(sessions: dict):
    """The opening turns' length distribution a sessions workload names, if any."""
    first = sessions.get("first_prompt")
    return _lengths(Distribution(first["kind"], {k: v for k, v in first.items() if k != "kind"})) if first else None


def check_workload(w: Workload) -> None:
    """Build everything a workload names once, so that a bad one fails at load."""
    if isinstance(w, PhasedWorkload):
        for p in w.phases:
            _arrivals(p.arrivals)
            _lengths(p.prompt)
            _lengths(p.output)
        return
    if isinstance(w, TraceWorkload):
        t = _trace(trace_path(w.trace))
        if t.has_arrivals and w.rate_rps is not None:
            raise ValueError(f"rate_rps is for length-only traces; {w.trace} has arrival times")
        if not t.has_arrivals and w.rate_rps is None:
            raise ValueError(f"rate_rps is required: {w.trace} is a length-only trace")
        return
    _arrivals(w.arrivals)
    _lengths(w.prompt)
    _lengths(w.output)
    if w.sessions is not None:
        s = w.sessions
        if "mean_turns" not in s or "mean_think_s" not in s:
            raise ValueError("sessions needs mean_turns and mean_think_s")
        _first_prompt(s)
        if positive("sessions.mean_turns", s["mean_turns"]) < 1:
            raise ValueError(f"sessions.mean_turns must be >= 1 (every session has a turn), got {s['mean_turns']!r}")
        positive("sessions.mean_think_s", s["mean_think_s"])


HISTORY_STREAM = 0x0EA51E7  # the second entry of an earlier episode's seed sequence: never an episode's own seed


def earlier_outputs(w: Workload, episode_s: float, max_model_len: int, seed: int) -> list[int]:
    """The output lengths of one other episode of ``w``, its requests drawn from the seed sequence
    (``seed``, ``HISTORY_STREAM``), each where the engine ends it (at ``max_tokens`` at most): what
    a server long at work on this workload has seen finish. Empty for a trace, whose other windows
    may hold this episode's own requests (a fixed window always does)."""
    if isinstance(w, TraceWorkload):
        return []
    requests, _ = episode_requests(w, episode_s, max_model_len, np.random.default_rng([seed, HISTORY_STREAM]))
    return [min(r.output_len, r.max_tokens) for r in requests]


def episode_requests(w: Workload, episode_s: float, max_model_len: int, rng: np.random.Generator,
                     phase_spans: list[tuple[float, float, int]] | None = None) -> tuple[list[Request], str]:
    """The requests of one episode and a line saying how they were made; a phased workload follows
    ``phase_spans`` ((start, length, phase index)) where given, else draws its own."""
    if isinstance(w, PhasedWorkload):
        phases = [(_arrivals(p.arrivals), _lengths(p.prompt), _lengths(p.output), p.mean_dwell_s) for p in w.phases]
        requests = generate_phases(phases=phases, max_tokens_rule=w.max_tokens, duration_s=episode_s, rng=rng,
                                   max_model_len=max_model_len, spans=phase_spans)
        names = "/".join(p.name or str(i) for i, p in enumerate(w.phases))
        return requests, f"generated: phases {names}, max_tokens {w.max_tokens}, {len(requests)} requests"
    if isinstance(w, TraceWorkload):
        window = episode_s * w.time_scale
        low, high = w.starts if w.starts is not None else (0.0, max(trace_span(w) - window, 0.0))
        start = float(rng.uniform(low, high)) if high > low else float(low)
        seed = int(rng.integers(2**31))
        spec = ReplaySpec(max_tokens=w.max_tokens, time_scale=w.time_scale, start_s=start, duration_s=window,
                          max_model_len=max_model_len, rate_rps=w.rate_rps, seed=seed)
        return build_requests(_trace(trace_path(w.trace)), spec), f"{w.trace}: {spec.describe()}"
    common = dict(prompt_lengths=_lengths(w.prompt), output_lengths=_lengths(w.output), max_tokens_rule=w.max_tokens,
                  duration_s=episode_s, rng=rng, max_model_len=max_model_len)
    if w.sessions is None:
        requests = generate(arrivals=_arrivals(w.arrivals), **common)
    else:
        s = w.sessions
        first = _first_prompt(s)
        requests = generate_sessions(session_arrivals=_arrivals(w.arrivals), mean_turns=s["mean_turns"],
                                     mean_think_s=s["mean_think_s"], first_prompt_lengths=first, **common)
    return requests, f"generated: {w.arrivals.kind} arrivals, max_tokens {w.max_tokens}, {len(requests)} requests"


def asked_output_rate(w: Workload, episode_s: float, max_model_len: int) -> float:
    """Output tokens per second ``w`` asks for (each request's real output, up to its max_tokens) on one
    reference draw (seed 0) of an episode of ``episode_s``. Where that draw asks for nothing (a trace's
    window in one of its gaps), which as a normaliser would make every reward a multiple of 1e9, the rate
    over what the trace's episodes draw from (``_trace_output_rate``; a generated workload: over 32
    episodes' time); 0 where even that asks for nothing."""
    requests, _ = episode_requests(w, episode_s, max_model_len, np.random.default_rng(0))
    if not requests and isinstance(w, TraceWorkload):
        return _trace_output_rate(w, episode_s, max_model_len)
    if not requests:
        episode_s *= 32
        requests, _ = episode_requests(w, episode_s, max_model_len, np.random.default_rng(0))
    return sum(min(r.output_len, r.max_tokens) for r in requests) / episode_s


def _trace_output_rate(w: TraceWorkload, episode_s: float, max_model_len: int) -> float:
    """The output rate over what a trace workload's episodes draw from: trace time from its first window
    start to its last window's end where the workload gives ``starts``, else the whole trace (a
    length-only trace's rows at their drawn arrivals, however late the last comes)."""
    if w.starts is not None:
        low, high = w.starts
        duration = high + episode_s * w.time_scale - low
    else:
        low, duration = 0.0, None
    spec = ReplaySpec(max_tokens=w.max_tokens, time_scale=w.time_scale, start_s=low, duration_s=duration,
                      max_model_len=max_model_len, rate_rps=w.rate_rps, seed=0)
    requests = build_requests(_trace(trace_path(w.trace)), spec)
    if not requests:
        return 0.0
    if duration is not None:
        seconds = duration / w.time_scale
    else:  # to a second of trace time past the last arrival
        seconds = max(r.arrival_s for r in requests) + 1.0 / w.time_scale
    return sum(min(r.output_len, r.max_tokens) for r in requests) / seconds


def front_loaded(requests: list[Request], tokens: float) -> list[Request]:
    """``requests`` with the first of them in arrival order arriving at time 0 instead, until their
    prompts hold ``tokens`` (the one that reaches it included): a backlog the engine starts behind.
    Of a multi-turn session only the opening turn moves; its later turns keep their times, so they
    still come after it."""
    out, held, opened = [], 0, set()
    for r in sorted(requests, key=lambda r: r.arrival_s):
        opening = r.session_id is None or r.session_id not in opened
        if r.session_id is not None:
            opened.add(r.session_id)
        if held < tokens and opening:
            held += r.prompt_len
            r = replace(r, arrival_s=0.0)
        out.append(r)
    return sorted(out, key=lambda r: r.arrival_s)
