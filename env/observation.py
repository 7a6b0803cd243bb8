"""The observation vector: docs/design.md's snapshot features, each mapped into a documented range.

| index | feature | mapping | range |
|---|---|---|---|
| 0 | alloc_ratio | as is | [0, 1] |
| 1 | alloc_slope | slope / slope_scale, clipped | [-1, 1] |
| 2 | frag_entropy | as is | [0, 1] |
| 3 | queue_len | log1p(n) / log1p(queue_scale), clipped | [0, 1] |
| 4 | prefill_frac | as is | [0, 1] |
| 5, 6 | len_mean, len_std | tokens / max_model_len, clipped | [0, 1] |
| 7 | swapped | log1p(n) / log1p(swapped_scale), clipped | [0, 1] |
| 8 | decode_ms | ms / decode_ms_scale, clipped | [0, 1] |
| 9 | overcommit | factor / overcommit_scale, clipped (inf: 1) | [0, 1] |
| 10 | reserved_ratio | ratio / overcommit_scale, clipped | [0, 1] |
| 11 | device_free | as is | [0, 1] |
| 12 | restarting | 1 while the engine restarts after an OOM | {0, 1} |
| 13-22 | queue_hist | share of waiting prompts per log-spaced bin | [0, 1] |
| 23-32 | running_hist | share of running contexts per bin | [0, 1] |

The scales live in the scenario (``observation:``), so that a saved policy can state the layout
it was trained on.
"""
from __future__ import annotations

import math

import numpy as np

from engine.snapshot import HIST_EDGES, Snapshot
from env.scenario import Observation

_BINS = [f"{a}-{b}" for a, b in zip(HIST_EDGES[:-1], HIST_EDGES[1:])]
FEATURES = (["alloc_ratio", "alloc_slope", "frag_entropy", "queue_len", "prefill_frac", "len_mean", "len_std",
             "swapped", "decode_ms", "overcommit", "reserved_ratio", "device_free", "restarting"]
            + [f"queue_hist[{b}]" for b in _BINS] + [f"running_hist[{b}]" for b in _BINS])
LOW = np.zeros(len(FEATURES), dtype=np.float32)
LOW[FEATURES.index("alloc_slope")] = -1.0
HIGH = np.ones(len(FEATURES), dtype=np.float32)


def _unit(x: float) -> float:
    return min(max(x, 0.0), 1.0)


def observe(s: Snapshot, scales: Observation, max_model_len: int) -> np.ndarray:
    """The float32 observation of snapshot ``s``, every entry within [LOW, HIGH]."""
    head = [
        _unit(s.alloc_ratio),
        min(max(s.alloc_slope / scales.slope_scale, -1.0), 1.0),
        _unit(s.frag_entropy),
        _unit(math.log1p(s.queue_len) / math.log1p(scales.queue_scale)),
        _unit(s.prefill_frac),
        _unit(s.len_mean / max_model_len),
        _unit(s.len_std / max_model_len),
        _unit(math.log1p(s.swapped) / math.log1p(scales.swapped_scale)),
        _unit(s.decode_ms / scales.decode_ms_scale),
        _unit(s.overcommit / scales.overcommit_scale),
        _unit(s.reserved_ratio / scales.overcommit_scale),
        _unit(s.device_free),
        1.0 if s.restarting else 0.0,
    ]
    return np.array(head + list(s.queue_hist) + list(s.running_hist), dtype=np.float32)
