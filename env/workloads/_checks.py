"""Argument checks shared by the workload modules, so every bad argument fails the same way."""
from __future__ import annotations

import math
from numbers import Integral, Real


def positive(name: str, value: object) -> float:
    """``value`` as a float, if it is a finite number > 0; else a ValueError naming ``name``."""
    number = _finite(name, value)
    if number <= 0:
        raise ValueError(f"{name} must be > 0, got {value!r}")
    return number


def non_negative(name: str, value: object) -> float:
    """``value`` as a float, if it is a finite number >= 0; else a ValueError naming ``name``."""
    number = _finite(name, value)
    if number < 0:
        raise ValueError(f"{name} must be >= 0, got {value!r}")
    return number


def whole(name: str, value: object, minimum: int) -> int:
    """``value`` as an int, if it is an integer >= ``minimum``; else a ValueError naming it."""
    if isinstance(value, bool) or not isinstance(value, Integral):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value!r}")
    return int(value)


def _finite(name: str, value: object) -> float:
    # bool is an int to Python, but True as a rate is always a mistake.
    if isinstance(value, bool) or not isinstance(value, Real) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    return float(value)
