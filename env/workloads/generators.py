"""Synthetic workloads: independent requests, and multi-turn sessions.

A workload is an arrival process, length distributions and a max_tokens rule; the result is a
list of Requests sorted by arrival. All randomness comes from the ``numpy.random.Generator``
passed in, drawn in a fixed order, so one seed gives one workload.
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np

from env.workloads._checks import positive, whole
from env.workloads.arrivals import ArrivalProcess
from env.workloads.lengths import LengthDistribution
from engine.request import Request
from env.workloads.sizing import MaxTokensRule, sized_request


def generate(
    *,
    arrivals: ArrivalProcess,
    prompt_lengths: LengthDistribution,
    output_lengths: LengthDistribution,
    max_tokens_rule: str,
    duration_s: float,
    rng: np.random.Generator,
    max_model_len: int | None = None,
    id_prefix: str = "req",
) -> list[Request]:
    """Independent requests arriving in [0, duration_s), ids ``"<id_prefix>-<n>"`` in arrival order.

    Prompt and output lengths are drawn independently, then clipped to ``max_model_len`` and
    given a declared max_tokens by ``max_tokens_rule`` ("fixed:N" or "scale:X", see sizing).
    """
    rule = _check_common("arrivals", arrivals, max_tokens_rule, duration_s, rng, max_model_len)
    times = arrivals.times(duration_s, rng)
    prompts = prompt_lengths.sample(times.size, rng)
    outputs = output_lengths.sample(times.size, rng)
    return [
        sized_request(f"{id_prefix}-{i}", t, p, o, rule, max_model_len)
        for i, (t, p, o) in enumerate(zip(times, prompts, outputs))
    ]


def generate_phases(
    *,
    phases: list[tuple[ArrivalProcess, LengthDistribution, LengthDistribution, float]],
    max_tokens_rule: str,
    duration_s: float,
    rng: np.random.Generator,
    max_model_len: int | None = None,
    id_prefix: str = "ph",
    spans: list[tuple[float, float, int]] | None = None,
) -> list[Request]:
    """Requests whose mix moves between phases, each (arrivals, prompt lengths, output lengths,
    mean dwell time): the phases follow each other in order from one drawn at random, each for an
    exponential dwell time, and within a phase requests are drawn as ``generate`` draws them.
    ``spans`` ((start, length, phase index), in order) gives the schedule instead: a node's tenants
    follow one clock with their phases offset (env/node_scenario.py)."""
    if not phases:
        raise ValueError("phases: give at least one phase")
    for i, (_, _, _, dwell) in enumerate(phases):
        positive(f"phases[{i}].mean_dwell_s", dwell)
    if spans is not None:
        out = []
        for n, (start, span, k) in enumerate(spans):
            arrivals, prompts, outputs, _ = phases[k % len(phases)]
            span = min(span, duration_s - start)
            if span > 0:
                segment = generate(arrivals=arrivals, prompt_lengths=prompts, output_lengths=outputs,
                                   max_tokens_rule=max_tokens_rule, duration_s=span, rng=rng,
                                   max_model_len=max_model_len, id_prefix=f"{id_prefix}{n}")
                out += [replace(r, arrival_s=r.arrival_s + start) for r in segment]
        return out
    t, k, n, out = 0.0, int(rng.integers(len(phases))), 0, []
    while t < duration_s:
        arrivals, prompts, outputs, dwell = phases[k]
        span = min(float(rng.exponential(dwell)), duration_s - t)
        if span > 0:
            segment = generate(arrivals=arrivals, prompt_lengths=prompts, output_lengths=outputs,
                               max_tokens_rule=max_tokens_rule, duration_s=span, rng=rng, max_model_len=max_model_len,
                               id_prefix=f"{id_prefix}{n}")
            out += [replace(r, arrival_s=r.arrival_s + t) for r in segment]
        t, k, n = t + span, (k + 1) % len(phases), n + 1
    return out


def generate_sessions(
    *,
    session_arrivals: ArrivalProcess,
    mean_turns: float,
    mean_think_s: float,
    prompt_lengths: LengthDistribution,
    output_lengths: LengthDistribution,
    max_tokens_rule: str,
    duration_s: float,
    rng: np.random.Generator,
    first_prompt_lengths: LengthDistribution | None = None,
    max_model_len: int | None = None,
    id_prefix: str = "sess",
) -> list[Request]:
    """Multi-turn sessions; every turn is a Request with ``session_id`` set, sorted by arrival.

    Sessions start by ``session_arrivals``. A session has a geometric number of turns with mean
    ``mean_turns`` (at least one). Turn k+1 arrives an exponential think time (mean
    ``mean_think_s``) after turn k *arrived*, not after it finished, so a slow engine can still
    hold turn k when turn k+1 comes; the engine must keep a session's turns in order.
    A turn's ``prompt_len`` is only its new tokens (``first_prompt_lengths`` for the opening
    turn, default ``prompt_lengths``); the engine holds the context before it. Turns arriving at
    or after ``duration_s`` are left out, as in ``generate``. Ids: session ``"<id_prefix>-<s>"``,
    turn ``"<id_prefix>-<s>-t<k>"``, both counted from 0.
    """
    rule = _check_common(
        "session_arrivals", session_arrivals, max_tokens_rule, duration_s, rng, max_model_len
    )
    if positive("mean_turns", mean_turns) < 1:
        raise ValueError(f"mean_turns must be >= 1 (every session has a turn), got {mean_turns!r}")
    positive("mean_think_s", mean_think_s)

    starts = session_arrivals.times(duration_s, rng)
    turns = rng.geometric(1.0 / mean_turns, starts.size)
    think = rng.exponential(mean_think_s, int(turns.sum()))  # one per turn, unused for openings
    if first_prompt_lengths is None:
        first_prompt_lengths = prompt_lengths
    opening = first_prompt_lengths.sample(starts.size, rng)
    follow_ups = prompt_lengths.sample(int(turns.sum()) - starts.size, rng)
    outputs = output_lengths.sample(int(turns.sum()), rng)

    turn_rows = []  # (arrival, session, turn, prompt, output)
    drawn = 0  # index into think and outputs, which have one entry per turn
    for session, (start, count) in enumerate(zip(starts, turns)):
        arrival = start
        for turn in range(count):
            if turn:
                arrival += think[drawn]
            prompt = opening[session] if turn == 0 else follow_ups[drawn - session - 1]
            turn_rows.append((arrival, session, turn, prompt, outputs[drawn]))
            drawn += 1
    turn_rows.sort()
    return [
        sized_request(
            f"{id_prefix}-{s}-t{k}", t, p, o, rule, max_model_len, session_id=f"{id_prefix}-{s}"
        )
        for t, s, k, p, o in turn_rows
        if t < duration_s
    ]


def _check_common(
    name: str,
    arrivals: ArrivalProcess,
    max_tokens_rule: str,
    duration_s: float,
    rng: np.random.Generator,
    max_model_len: int | None,
) -> MaxTokensRule:
    if not isinstance(arrivals, ArrivalProcess):
        raise ValueError(f"{name} must be an ArrivalProcess, got {arrivals!r}")
    if not isinstance(rng, np.random.Generator):
        raise ValueError(f"rng must be a numpy.random.Generator, got {type(rng).__name__}")
    positive("duration_s", duration_s)
    if max_model_len is not None:
        whole("max_model_len", max_model_len, 2)
    return MaxTokensRule.parse(max_tokens_rule, name="max_tokens_rule")

