"""The figures' own percentile, histogram, mean and standard deviation give numpy's answers to
the last bit: they replace ``np.percentile``, ``np.histogram``, ``np.mean`` and ``np.std`` on the
environment's per-step path only for speed."""
from __future__ import annotations

import math

import numpy as np

from engine.metrics import percentile
from engine.snapshot import HIST_EDGES, histogram, mean_std


def test_percentile_is_numpys_linear_percentile_bit_for_bit():
    rng = np.random.default_rng(0)
    for trial in range(3000):
        n = int(rng.integers(1, 9)) if trial % 3 == 0 else int(rng.integers(1, 300))
        draws = (rng.random(n), np.round(rng.random(n), 1), np.exp(rng.normal(0, 5, n)))[trial % 3]
        for values in (draws, draws.tolist()):
            for q in (0, 1, 25, 50, 90, 99, 99.9, 100):
                got, want = percentile(values, q), float(np.percentile(values, q))
                assert got == want and math.copysign(1, got) == math.copysign(1, want), (values, q)
    assert math.isnan(percentile([1.0, float("nan")], 50))
    assert math.isnan(percentile(np.array([float("nan"), 1.0, 2.0]), 99))  # numpy sorts a NaN last


def test_mean_std_is_numpys_mean_and_std_bit_for_bit():
    rng = np.random.default_rng(0)
    for trial in range(4000):
        # lengths of a few to thousands of requests (numpy's pairwise sums split at 8 and 128),
        # small and large, including sums past 2**53 where the order of the additions shows
        n = int(rng.integers(1, 20)) if trial % 2 else int(rng.integers(1, 3000))
        lengths = rng.integers(0, (64, 40_000, 2**62)[trial % 3], n).tolist()
        mean, std = mean_std(lengths)
        assert (mean, std) == (float(np.mean(lengths)), float(np.std(lengths))), lengths


def test_histogram_is_numpys_histogram():
    def numpys(lengths):
        if not lengths:
            return (0.0,) * (len(HIST_EDGES) - 1)
        counts, _ = np.histogram(lengths, bins=np.array(HIST_EDGES[:-1] + (np.finfo(float).max,)))
        return tuple((counts / len(lengths)).tolist())

    rng = np.random.default_rng(0)
    edges = [int(e) for e in HIST_EDGES[:-1]]
    near = edges + [e - 1 for e in edges[1:]] + [e + 1 for e in edges] + [10**6]
    for _ in range(2000):
        lengths = [int(rng.choice(near)) if rng.random() < 0.5 else int(rng.integers(0, 40000))
                   for _ in range(int(rng.integers(0, 60)))]
        assert histogram(lengths) == numpys(lengths)
