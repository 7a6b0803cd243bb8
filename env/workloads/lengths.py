"""Token-length distributions for synthetic workloads: long-tailed, as real prompts and outputs are.

Each draws whole token counts clipped to stated bounds; all randomness comes from the generator
passed in.
"""
from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from env.workloads._checks import non_negative, positive, whole


class LengthDistribution(ABC):
    """A distribution of token counts."""

    @abstractmethod
    def sample(self, count: int, rng: np.random.Generator) -> np.ndarray:
        """``count`` token counts as an int64 array."""


def _check_bounds(low: int, high: int | None) -> None:
    whole("low", low, 1)
    if high is not None and whole("high", high, 1) < low:
        raise ValueError(f"high must be >= low ({low}), got {high}")


@dataclass(frozen=True)
class LogNormalLengths(LengthDistribution):
    """Lognormal lengths with the given ``mean`` (before clipping) and log-space ``sigma``.

    Parameterised by the mean rather than the log-mean because the mean is what a trace's
    statistics report; sigma sets the tail (about 1 for chat prompts, 0 gives a constant).
    """

    mean: float
    sigma: float
    low: int = 1
    high: int | None = None

    def __post_init__(self) -> None:
        positive("mean", self.mean)
        non_negative("sigma", self.sigma)
        _check_bounds(self.low, self.high)

    def sample(self, count: int, rng: np.random.Generator) -> np.ndarray:
        log_mean = math.log(self.mean) - self.sigma**2 / 2
        values = np.rint(rng.lognormal(log_mean, self.sigma, whole("count", count, 0)))
        return np.clip(values, self.low, self.high).astype(np.int64)


@dataclass(frozen=True)
class ParetoLengths(LengthDistribution):
    """Bounded Pareto lengths on [low, high] with tail index ``alpha`` (smaller: heavier tail)."""

    alpha: float
    low: int
    high: int

    def __post_init__(self) -> None:
        positive("alpha", self.alpha)
        _check_bounds(self.low, self.high)

    def sample(self, count: int, rng: np.random.Generator) -> np.ndarray:
        # Inverse of the bounded Pareto CDF, so no draw is wasted on rejection.
        u = rng.uniform(0.0, 1.0, whole("count", count, 0))
        tail = 1.0 - (self.low / self.high) ** self.alpha
        values = self.low * (1.0 - u * tail) ** (-1.0 / self.alpha)
        return np.clip(np.rint(values), self.low, self.high).astype(np.int64)


@dataclass(frozen=True)
class EmpiricalLengths(LengthDistribution):
    """Lengths resampled with replacement from observed ones, for instance a trace's prompts."""

    values: Sequence[int]

    def __post_init__(self) -> None:
        object.__setattr__(self, "values", tuple(int(v) for v in self.values))  # frozen, hashable
        if len(self.values) == 0:
            raise ValueError("values must not be empty")
        if min(self.values) < 0:
            raise ValueError(f"values must be >= 0, got {min(self.values)}")
        object.__setattr__(self, "_array", np.asarray(self.values, dtype=np.int64))  # drawn from every episode

    def sample(self, count: int, rng: np.random.Generator) -> np.ndarray:
        return rng.choice(self._array, whole("count", count, 0))
