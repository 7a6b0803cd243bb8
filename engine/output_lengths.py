"""What the requests' output lengths look like so far: the Kaplan-Meier estimate over the requests
that finished (their output lengths, events) and those still running (what they have generated,
censored), and what it expects a running request still to generate.

A serving engine knows both: its finished requests' output lengths and its running requests'
token counts. The snapshot's ``future_expected`` (over the last 256 finished) and the ``lookahead``
reference's draws (agents/oracle.py, over every request of the episode) use the same estimator.
"""
from __future__ import annotations

import numpy as np


def kaplan_meier(ended, going) -> tuple[np.ndarray, np.ndarray]:
    """The Kaplan-Meier estimate of the output length: the lengths at which some request ended
    (ascending) and the share going past each. ``ended``: lengths of requests that finished;
    ``going``: what requests still running have generated (censored: each goes on at least one more)."""
    done, going = np.sort(np.asarray(ended, dtype=np.int64)), np.sort(np.asarray(going, dtype=np.int64))
    if done.size == 0:
        return np.zeros(0, dtype=np.int64), np.zeros(0)
    lengths, count = np.unique(done, return_counts=True)
    # at risk at length t: every request that ended at t or later, or is still going at t - 1 or more
    # (a request stops as soon as it has generated its length: one still going after g runs to g + 1 at least)
    at_risk = (done.size - np.searchsorted(done, lengths)) + (going.size - np.searchsorted(going, lengths - 1))
    return lengths, np.cumprod(1.0 - count / at_risk)


def expected_remaining(lengths: np.ndarray, survival: np.ndarray, generated, max_tokens) -> np.ndarray:
    """What each running request is expected still to generate, given the estimate (``kaplan_meier``)
    and that it goes past what it has ``generated``: E[min(L, max_tokens) - generated | L > generated],
    the sum over t in [generated, max_tokens) of P(L > t) / P(L > generated). As in the lookahead's
    draws, the estimate's mass past its longest length runs to ``max_tokens``, and a request the
    estimate has no mass for (none finished yet, or it is past every length that ended) to its
    ``max_tokens``: what it declared."""
    g, m = np.asarray(generated, dtype=np.float64), np.asarray(max_tokens, dtype=np.float64)
    if len(lengths) == 0:
        return np.maximum(m - g, 0.0)
    xs = np.concatenate(([0.0], lengths.astype(np.float64)))
    share = np.concatenate(([1.0], survival))  # P(L > t) for xs[j] <= t < xs[j + 1] (the last: past every length)
    area = np.concatenate(([0.0], np.cumsum(np.diff(xs) * share[:-1])))  # sum of P(L > t) for t < xs[j]

    def below(x):  # sum of P(L > t) for 0 <= t < x, and P(L > x)
        j = np.searchsorted(xs, x, side="right") - 1
        return area[j] + (x - xs[j]) * share[j], share[j]

    top, _ = below(np.maximum(m, g))
    start, going = below(g)
    with np.errstate(divide="ignore", invalid="ignore"):
        out = np.where(going > 0, (top - start) / np.where(going > 0, going, 1.0), m - g)
    return np.maximum(out, 0.0)
