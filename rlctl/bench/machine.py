"""What every benchmark report carries: the machine it ran on, and timings rounded to what they can tell."""
from __future__ import annotations

import os
import platform

import numpy
import torch


def sig(x: float | None, digits: int = 4) -> float | None:
    """``x`` to ``digits`` significant digits: a timing has no more than that to tell."""
    return None if x is None else float(f"{x:.{digits}g}")


def machine(**extra) -> dict:
    """The machine and software a benchmark ran on, so that figures from different machines can be
    compared (each figure is also a ratio to a reference measured in the same run)."""
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    return {
        "cpu_count": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "load_average_1m_at_start": round(load[0], 2) if load else None,
        "platform": platform.platform(), "processor": platform.processor() or platform.machine(),
        "python": platform.python_version(), "torch_version": torch.__version__, "numpy_version": numpy.__version__,
        **extra,
    }
