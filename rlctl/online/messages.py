"""The engine's snapshot on the wire: to and from the protocol's ``Snapshot``, and the sidecar's check of one.

The message carries engine/snapshot.py's ``Snapshot`` field for field under the same names, plus
the engine's ``max_model_len``, an engine id and a sequence number. A snapshot from the wire is
checked before a policy sees it: a histogram of the wrong length, a NaN or infinity, a ratio
outside its bounds, a negative count or an unknown ``max_model_len`` would otherwise turn into a
plausible observation (``observe`` clips) and a confident wrong action. ``SnapshotError`` names
the field, and the sidecar answers INVALID_ARGUMENT with it.
"""
from __future__ import annotations

import dataclasses
import math

from engine.snapshot import HIST_EDGES, Snapshot
from rlctl.online.proto import controller_pb2 as pb

BINS = len(HIST_EDGES) - 1

# How each Snapshot field is checked; every field is listed (tests/test_sidecar.py holds us to it).
RATIOS = ("alloc_ratio", "frag_entropy", "prefill_frac", "device_free", "out_ratio")  # in [0, 1]
MEASURES = ("time_s", "len_mean", "len_std", "decode_ms", "reserved_ratio", "future_expected")  # finite, >= 0
SIGNED = ("alloc_slope",)                                                         # finite
COUNTS = ("queue_len", "swapped", "running", "kv_blocks_used", "kv_blocks_total", "kv_footprint_bytes",
          "oom_events", "preemptions", "tokens_generated", "kv_tokens_total", "max_num_seqs", "tokens_held",
          "future_declared", "waiting_tokens", "waiting_late")                    # integers >= 0
HISTOGRAMS = ("queue_hist", "running_hist")                                       # BINS shares in [0, 1], sum 0 or 1
OTHER = ("overcommit", "restarting", "preempt_mode")                              # > 0 (inf: no reservation); flags
_FIELDS = tuple(f.name for f in dataclasses.fields(Snapshot))  # once: dataclasses.fields() costs microseconds a call
# The longest engine id taken (UTF-8 bytes): a stateful policy keeps state per id, and a metric may count
# by one, so a peer must not make the sidecar hold megabytes for each (a UUID and a host name fit)
MAX_ENGINE_ID = 128


class SnapshotError(ValueError):
    """A snapshot the sidecar refuses; ``field`` is the offending field's name."""

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"snapshot.{field} {problem}")
        self.field = field


def snapshot_message(s: Snapshot, max_model_len: int, engine_id: str = "", seq: int = 0) -> pb.Snapshot:
    """``s`` as the protocol's message."""
    values = {name: getattr(s, name) for name in _FIELDS}
    return pb.Snapshot(engine_id=engine_id, seq=seq, max_model_len=int(max_model_len), **values)


def snapshot_from_message(m: pb.Snapshot) -> tuple[Snapshot, int]:
    """The ``Snapshot`` and ``max_model_len`` a message carries, checked; ``SnapshotError`` names the first bad field."""
    if m.max_model_len <= 0:
        raise SnapshotError("max_model_len", f"must be > 0 (the engine's context length), got {m.max_model_len}")
    if len(m.engine_id.encode()) > MAX_ENGINE_ID:
        raise SnapshotError("engine_id", f"must be at most {MAX_ENGINE_ID} bytes, got {len(m.engine_id.encode())}")
    v = {name: getattr(m, name) for name in _FIELDS}  # each field read from the message once
    for name in RATIOS:
        x = v[name]
        if not 0.0 <= x <= 1.0:  # NaN fails too
            raise SnapshotError(name, f"must be a ratio in [0, 1], got {x}")
    for name in MEASURES:
        x = v[name]
        if not (math.isfinite(x) and x >= 0.0):
            raise SnapshotError(name, f"must be finite and >= 0, got {x}")
    for name in SIGNED:
        x = v[name]
        if not math.isfinite(x):
            raise SnapshotError(name, f"must be finite, got {x}")
    for name in COUNTS:
        x = v[name]
        if x < 0:
            raise SnapshotError(name, f"is a count and must be >= 0, got {x}")
    for name in ("kv_blocks_total", "kv_tokens_total", "max_num_seqs"):  # the scales a policy divides by
        if v[name] <= 0:  # proto3 sends a field it does not know as 0: a sender that predates it
            raise SnapshotError(name, f"must be > 0 (the engine's capacity; a sender that does not set it "
                                      f"is refused), got {v[name]}")
    if v["kv_blocks_used"] > v["kv_blocks_total"]:
        raise SnapshotError("kv_blocks_used", f"({v['kv_blocks_used']}) exceeds kv_blocks_total ({v['kv_blocks_total']})")
    if not v["overcommit"] > 0.0:
        raise SnapshotError("overcommit", f"must be a factor > 0 (inf: no reservation), got {v['overcommit']}")
    for name in HISTOGRAMS:
        h = v[name] = tuple(v[name])
        if len(h) != BINS:
            raise SnapshotError(name, f"must have {BINS} bins (engine/snapshot.py HIST_EDGES), got {len(h)}")
        bad = [x for x in h if not 0.0 <= x <= 1.0]
        if bad:
            raise SnapshotError(name, f"holds shares in [0, 1], got {bad[0]}")
        total = sum(h)
        if total != 0.0 and abs(total - 1.0) > 1e-6:
            raise SnapshotError(name, f"shares must sum to 1 (or all be 0), got {total:.6g}")
    if v["future_expected"] == 0.0 and v["running"] > 0:
        # a sender that predates field 40 (proto3 sends no value as 0); a real estimate is at least one
        # token a running request: read what they declared instead, the estimate's own worst case
        v["future_expected"] = float(v["future_declared"])
    return Snapshot(**v), int(m.max_model_len)
