"""Arrival processes: when the requests (or sessions) of a synthetic workload arrive.

Each process produces an increasing stream of arrival times from 0, in chunks that do not depend
on how many are wanted, so a seed gives the same first arrivals whatever the horizon.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from env.workloads._checks import non_negative, positive, whole

_CHUNK = 1024  # gaps drawn per step of a renewal process


class ArrivalProcess(ABC):
    """A stochastic arrival process; all randomness comes from the generator passed in."""

    @property
    @abstractmethod
    def mean_rate(self) -> float:
        """Long-run arrivals per second."""

    @abstractmethod
    def _chunks(self, rng: np.random.Generator) -> Iterator[np.ndarray]:
        """Consecutive, increasing blocks of arrival times (seconds from 0); never ends."""

    def times(self, duration_s: float, rng: np.random.Generator) -> np.ndarray:
        """All arrival times in [0, duration_s), increasing."""
        duration_s = positive("duration_s", duration_s)
        kept = []
        for chunk in self._chunks(rng):
            if chunk.size and chunk[-1] >= duration_s:
                kept.append(chunk[chunk < duration_s])
                break
            kept.append(chunk)
        return np.concatenate(kept)

    def first(self, count: int, rng: np.random.Generator) -> np.ndarray:
        """The first ``count`` arrival times, increasing."""
        count = whole("count", count, 0)
        chunks, kept, have = self._chunks(rng), [np.empty(0)], 0
        while have < count:
            kept.append(next(chunks))
            have += kept[-1].size
        return np.concatenate(kept)[:count]


def _renewal(gaps, rng: np.random.Generator) -> Iterator[np.ndarray]:
    """Arrival times of a renewal process whose i.i.d. gaps ``gaps(rng, n)`` draws."""
    start = 0.0
    while True:
        chunk = start + np.cumsum(gaps(rng, _CHUNK))
        start = float(chunk[-1])
        yield chunk


@dataclass(frozen=True)
class PoissonArrivals(ArrivalProcess):
    """Memoryless arrivals at ``rate`` per second (exponential gaps)."""

    rate: float

    def __post_init__(self) -> None:
        positive("rate", self.rate)

    @property
    def mean_rate(self) -> float:
        return float(self.rate)

    def _chunks(self, rng: np.random.Generator) -> Iterator[np.ndarray]:
        return _renewal(lambda r, n: r.exponential(1.0 / self.rate, n), rng)


@dataclass(frozen=True)
class GammaArrivals(ArrivalProcess):
    """A renewal process with gamma gaps: mean gap 1/rate, coefficient of variation ``cv``.

    cv = 1 is Poisson; cv > 1 is bursty (clusters of short gaps between long silences);
    cv < 1 is more regular than Poisson.
    """

    rate: float
    cv: float

    def __post_init__(self) -> None:
        positive("rate", self.rate)
        positive("cv", self.cv)

    @property
    def mean_rate(self) -> float:
        return float(self.rate)

    def _chunks(self, rng: np.random.Generator) -> Iterator[np.ndarray]:
        shape = 1.0 / self.cv**2
        scale = 1.0 / (self.rate * shape)
        return _renewal(lambda r, n: r.gamma(shape, scale, n), rng)


@dataclass(frozen=True)
class MarkovModulatedArrivals(ArrivalProcess):
    """Poisson arrivals whose rate follows a hidden Markov chain (an MMPP).

    State i lasts an exponential time with mean ``mean_dwell_s[i]`` and emits arrivals at
    ``rates[i]``; it then moves to one of the other states, chosen uniformly. The first state is
    drawn by the chain's long-run share of time, so the process is stationary from 0.
    """

    rates: tuple[float, ...]
    mean_dwell_s: tuple[float, ...]

    def __post_init__(self) -> None:
        if len(self.rates) < 2 or len(self.rates) != len(self.mean_dwell_s):
            raise ValueError(
                "rates and mean_dwell_s must give two or more states, one entry each; "
                f"got {len(self.rates)} rates and {len(self.mean_dwell_s)} dwell times"
            )
        for i, rate in enumerate(self.rates):
            non_negative(f"rates[{i}]", rate)
        for i, dwell in enumerate(self.mean_dwell_s):
            positive(f"mean_dwell_s[{i}]", dwell)
        if max(self.rates) <= 0:
            raise ValueError("rates: at least one state must have a rate > 0")

    @property
    def mean_rate(self) -> float:
        # Uniform jumps make every state equally visited, so time shares follow the dwell times.
        dwell = np.asarray(self.mean_dwell_s, dtype=float)
        return float(np.dot(self.rates, dwell) / dwell.sum())

    def _chunks(self, rng: np.random.Generator) -> Iterator[np.ndarray]:
        dwell_means = np.asarray(self.mean_dwell_s, dtype=float)
        states = len(self.rates)
        state = int(rng.choice(states, p=dwell_means / dwell_means.sum()))
        start = 0.0
        while True:
            dwell = rng.exponential(dwell_means[state])
            count = rng.poisson(self.rates[state] * dwell)
            yield start + np.sort(rng.uniform(0.0, dwell, count))
            start += dwell
            other = int(rng.integers(states - 1))
            state = other if other < state else other + 1
