"""Replaying a trace: the stated rules that turn its records into the engine's requests.

A trace records arrivals and real lengths, not a deployment: its rate is low for one GPU of today,
its prompts may exceed the model's context and it never says what max_tokens a client declared.
A ReplaySpec states each of those choices, and ``describe()`` says them in one line, so a result
can always name the workload it was measured on.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from env.workloads._checks import non_negative, positive, whole
from env.workloads.arrivals import PoissonArrivals
from engine.request import Request
from env.workloads.sizing import MaxTokensRule, sized_request
from env.workloads.traces import Trace

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ReplaySpec:
    """How a trace becomes requests.

    - ``max_tokens``: the declared-limit rule, ``"fixed:N"`` or ``"scale:X"`` (see sizing).
    - ``time_scale``: compression factor; a record at trace time t arrives at
      (t - start_s) / time_scale, so 2 replays twice as fast.
    - ``start_s``, ``duration_s``: the window [start_s, start_s + duration_s) of trace time
      that is replayed; ``duration_s`` None runs to the end.
    - ``max_model_len``: prompts clipped to max_model_len - 1 tokens and outputs so that
      prompt + output <= max_model_len; None clips nothing.
    - ``rate_rps``, ``seed``: length-only traces have no arrival times, so their rows (in file
      order) get Poisson arrivals at ``rate_rps`` in trace time, drawn from ``seed``; window and
      time scale then apply as to any trace. Required for such traces, refused for the others.
    - ``limit``: keep at most this many requests (the earliest after the window).
    """

    max_tokens: str
    time_scale: float = 1.0
    start_s: float = 0.0
    duration_s: float | None = None
    max_model_len: int | None = None
    rate_rps: float | None = None
    seed: int = 0
    limit: int | None = None

    def __post_init__(self) -> None:
        self.max_tokens_rule()
        positive("time_scale", self.time_scale)
        non_negative("start_s", self.start_s)
        if self.duration_s is not None:
            positive("duration_s", self.duration_s)
        if self.max_model_len is not None:
            whole("max_model_len", self.max_model_len, 2)
        if self.rate_rps is not None:
            positive("rate_rps", self.rate_rps)
        whole("seed", self.seed, 0)
        if self.limit is not None:
            whole("limit", self.limit, 1)

    def max_tokens_rule(self) -> MaxTokensRule:
        return MaxTokensRule.parse(self.max_tokens, name="max_tokens")

    def describe(self) -> str:
        """One line stating compression, window, clipping, max_tokens rule and arrivals."""
        end = "end" if self.duration_s is None else f"{self.start_s + self.duration_s:g} s"
        if self.max_model_len is None:
            clipping = "no clipping (lengths >= 1 token)"
        else:
            clipping = (
                f"prompts clipped to {self.max_model_len - 1} and prompt+output to "
                f"{self.max_model_len} tokens"
            )
        cap = "" if self.max_model_len is None else ", at most max_model_len - prompt"
        parts = [
            f"replay: time compressed {self.time_scale:g}x "
            f"(arrival = (t - {self.start_s:g} s) / {self.time_scale:g})",
            f"window [{self.start_s:g} s, {end}) of trace time",
            clipping,
            f"max_tokens {self.max_tokens} (at least the real output{cap})",
        ]
        if self.rate_rps is not None:
            parts.append(
                f"length-only arrivals Poisson {self.rate_rps:g} rps in trace time, "
                f"seed {self.seed}"
            )
        if self.limit is not None:
            parts.append(f"first {self.limit} requests")
        return "; ".join(parts)


def build_requests(trace: Trace, spec: ReplaySpec) -> list[Request]:
    """The requests ``spec`` replays from ``trace``, sorted by arrival.

    Ids are ``"<file stem>-<row>"`` with the record's 0-based row in the file, so a request keeps
    its id whatever the window. Hash ids are cut to the blocks of a clipped prompt.
    """
    log.info("%s: %s", trace.path.name, spec.describe())
    times = _trace_times(trace, spec)
    end = math.inf if spec.duration_s is None else spec.start_s + spec.duration_s
    rows = np.flatnonzero((times >= spec.start_s) & (times < end))
    rows = rows[np.argsort(times[rows], kind="stable")][: spec.limit]  # by arrival, then file order

    rule, stem, requests = spec.max_tokens_rule(), Path(trace.path.name.removesuffix(".gz")).stem, []
    for row in rows.tolist():
        record = trace.record(row)
        request = sized_request(
            f"{stem}-{row}",
            (float(times[row]) - spec.start_s) / spec.time_scale,
            record.prompt_len,
            record.output_len,
            rule,
            spec.max_model_len,
            hash_ids=record.hash_ids,
            hash_block_tokens=trace.hash_block_tokens,
        )
        if trace.hash_block_tokens and request.prompt_len < record.prompt_len:
            kept = math.ceil(request.prompt_len / trace.hash_block_tokens)
            request = replace(request, hash_ids=record.hash_ids[:kept])
        requests.append(request)
    return requests


def _trace_times(trace: Trace, spec: ReplaySpec) -> np.ndarray:
    """Each record's arrival in trace time: recorded, or drawn for a length-only trace."""
    if trace.has_arrivals:
        if spec.rate_rps is not None:
            raise ValueError(
                f"rate_rps is for length-only traces; {trace.path} ({trace.format}) "
                "has its own arrival times"
            )
        return trace.arrivals
    if spec.rate_rps is None:
        raise ValueError(
            f"rate_rps is required: {trace.path} is a length-only trace with no arrival times"
        )
    rng = np.random.default_rng(spec.seed)
    return np.asarray(PoissonArrivals(spec.rate_rps).first(len(trace), rng), dtype=np.float64)
