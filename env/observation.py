"""The observation vector: the snapshot's features, each mapped into a documented range, with
nothing that depends on the deployment: token counts are shares of the KV capacity, requests are
shares of ``max_num_seqs``, so one policy can steer an A10 and an H200.

| index | feature | mapping | range |
|---|---|---|---|
| 0 | alloc_ratio | KV blocks in use / capacity | [0, 1] |
| 1 | alloc_slope | its change per second / slope_scale, clipped | [-1, 1] |
| 2 | frag_entropy | as is | [0, 1] |
| 3 | queue_len | log1p(n) / log1p(queue_scale), clipped | [0, 1] |
| 4 | queue_tokens | waiting tokens / KV capacity, clipped | [0, 1] |
| 5 | prefill_frac | share of running sequences in prefill | [0, 1] |
| 6 | running_frac | running sequences / max_num_seqs | [0, 1] |
| 7, 8 | len_mean, len_std | finished context lengths (last 60 s): log1p(tokens) / log1p(KV capacity) | [0, 1] |
| 9 | out_ratio | output / declared max_tokens of the last 64 requests finished (1 before any) | [0, 1] |
| 10 | swapped | log1p(n) / log1p(swapped_scale), clipped | [0, 1] |
| 11 | overcommit | factor / overcommit_scale, clipped (inf: 1) | [0, 1] |
| 12 | reserved_ratio | admitted peak demand / capacity / overcommit_scale, clipped | [0, 1] |
| 13 | held_ratio | tokens of the running sequences / KV capacity, clipped | [0, 1] |
| 14 | declared_ratio | (held + what they may still generate by max_tokens) / KV capacity / overcommit_scale | [0, 1] |
| 15 | projected_ratio | (held + out_ratio x what they may still generate) / KV capacity / 2, clipped | [0, 1] |
| 16 | expected_ratio | (held + what they are expected still to generate, given what each has generated: future_expected) / KV capacity / overcommit_scale | [0, 1] |
| 17 | device_free | free device memory / capacity | [0, 1] |
| 18 | restarting | 1 while the engine restarts after an OOM | {0, 1} |
| 19 | preempt_mode | 1 if an OOM preempts, 0 if it crashes the engine | {0, 1} |
| 20-29 | queue_hist | share of waiting prompts per log-spaced bin | [0, 1] |
| 30-39 | running_hist | share of running contexts per bin | [0, 1] |

``expected_ratio`` came later than the others: a policy file trained before it is loaded blind
to it (agents/export.py) and acts as it did.

The scales live in the scenario (``observation:``), so that a saved policy can state the layout
it was trained on.
"""
from __future__ import annotations

import math

import numpy as np

from engine.snapshot import HIST_EDGES, Snapshot
from env.scenario import Observation

_BINS = [f"{a}-{b}" for a, b in zip(HIST_EDGES[:-1], HIST_EDGES[1:])]
FEATURES = (["alloc_ratio", "alloc_slope", "frag_entropy", "queue_len", "queue_tokens", "prefill_frac", "running_frac",
             "len_mean", "len_std", "out_ratio", "swapped", "overcommit", "reserved_ratio", "held_ratio",
             "declared_ratio", "projected_ratio", "expected_ratio", "device_free", "restarting", "preempt_mode"]
            + [f"queue_hist[{b}]" for b in _BINS] + [f"running_hist[{b}]" for b in _BINS])
LOW = np.zeros(len(FEATURES), dtype=np.float32)
LOW[FEATURES.index("alloc_slope")] = -1.0
HIGH = np.ones(len(FEATURES), dtype=np.float32)


def seen(blind: tuple[str, ...]) -> np.ndarray:
    """The positions of the features a network trained blind to ``blind`` reads, in order
    (rlctl/train.py ``blind``; its policy file's layout, agents/export.py)."""
    return np.array([i for i, f in enumerate(FEATURES) if f not in blind])


def _unit(x: float) -> float:
    return min(max(x, 0.0), 1.0)


def observe(s: Snapshot, scales: Observation) -> np.ndarray:
    """The float32 observation of snapshot ``s``, every entry within [LOW, HIGH]."""
    capacity = max(s.kv_tokens_total, 1)
    log_capacity = math.log1p(capacity)
    head = [
        _unit(s.alloc_ratio),
        min(max(s.alloc_slope / scales.slope_scale, -1.0), 1.0),
        _unit(s.frag_entropy),
        _unit(math.log1p(s.queue_len) / math.log1p(scales.queue_scale)),
        _unit(s.waiting_tokens / capacity),
        _unit(s.prefill_frac),
        _unit(s.running / max(s.max_num_seqs, 1)),
        _unit(math.log1p(s.len_mean) / log_capacity),
        _unit(math.log1p(s.len_std) / log_capacity),
        _unit(s.out_ratio),
        _unit(math.log1p(s.swapped) / math.log1p(scales.swapped_scale)),
        _unit(s.overcommit / scales.overcommit_scale),
        _unit(s.reserved_ratio / scales.overcommit_scale),
        _unit(s.tokens_held / capacity),
        _unit((s.tokens_held + s.future_declared) / capacity / scales.overcommit_scale),
        _unit((s.tokens_held + s.out_ratio * s.future_declared) / capacity / 2.0),
        _unit((s.tokens_held + s.future_expected) / capacity / scales.overcommit_scale),
        _unit(s.device_free),
        1.0 if s.restarting else 0.0,
        1.0 if s.preempt_mode else 0.0,
    ]
    return np.array(head + list(s.queue_hist) + list(s.running_hist), dtype=np.float32)
