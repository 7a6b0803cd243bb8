"""How long an iteration or a KV copy takes, when a ``ProfiledExecutor`` does not measure it.

Two kinds, one interface (``iteration_s(shape)``, ``copy_s(nbytes, link)``; a clock that charges a
model's windowed layers less has ``window`` too and takes ``iteration_s(shape, windowed)``):

* ``CostModel``: linear, fitted by ``rlctl profile`` from the torch executor on this hardware, or
  stated. An iteration costs a fixed overhead, a cost per batched token (the weights' work), per
  context token read and per attended (query, key) pair; a copy costs a fixed overhead plus bytes
  over a bandwidth, one pair for copies within the device (compaction) and one for the host link
  (swap).
* ``RooflineCostModel`` (engine/roofline.py): from a device's datasheet figures.

``source`` says where the numbers come from, so that a result can say whether its clock was
measured, fitted or modelled. ``window`` is the sliding window the model's windowed layers attend
through where the clock charges them less (None, or no such attribute, as a cost model of one's own
may have: every layer charged the whole context); a caller then passes the iteration's shape as those
layers see it (``windowed``, ``batch_tokens(work, window)``).
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from engine.scheduler import BatchShape

LINKS = ("device", "host")


@dataclass(frozen=True)
class CostModel:
    fixed_s: float
    per_token_s: float
    per_context_token_s: float
    copy_fixed_s: float
    copy_bytes_per_s: float
    swap_fixed_s: float | None = None       # None: as a copy within the device
    swap_bytes_per_s: float | None = None
    per_attended_s: float = 0.0
    source: str = "stated"

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "source" or value is None:
                continue
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise ValueError(f"cost model: {f.name} must be a finite number >= 0, got {value!r}")
        for name in ("copy_bytes_per_s", "swap_bytes_per_s"):
            if getattr(self, name) == 0:
                raise ValueError(f"cost model: {name} must be > 0")

    @property
    def window(self) -> None:
        """None: a profile of this engine, which reads a windowed layer's whole context too."""
        return None

    def iteration_s(self, shape: BatchShape, windowed: BatchShape | None = None) -> float:
        return float(self.iterations_s(shape.num_tokens, shape.context_tokens, shape.attended))

    def iterations_s(self, num_tokens, context_tokens, attended, windowed_context=None, windowed_attended=None):
        """``iteration_s`` elementwise: each argument an int or an array of ints (a run of decode
        iterations, engine/decode_run.py), with the same arithmetic, so the same durations."""
        return (self.fixed_s + self.per_token_s * num_tokens
                + self.per_context_token_s * context_tokens + self.per_attended_s * attended)

    def copy_s(self, nbytes: int, link: str = "device") -> float:
        if link not in LINKS:
            raise ValueError(f"link must be one of {LINKS}, got {link!r}")
        if not nbytes:
            return 0.0
        if link == "host" and self.swap_bytes_per_s is not None:
            fixed = self.copy_fixed_s if self.swap_fixed_s is None else self.swap_fixed_s
            return fixed + nbytes / self.swap_bytes_per_s
        return self.copy_fixed_s + nbytes / self.copy_bytes_per_s

    def describe(self) -> str:
        return (f"linear cost model ({self.source}): {1e3 * self.fixed_s:.3g} ms + {1e6 * self.per_token_s:.3g} us/token "
                f"+ {1e9 * self.per_context_token_s:.3g} ns/context token")

    def save(self, path: str | Path, **extra) -> None:
        """JSON: the model's fields under "cost_model", plus whatever ``extra`` reports (fit error, grid)."""
        Path(path).write_text(json.dumps({"cost_model": asdict(self), **extra}, indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> "CostModel":
        """Read a file written by ``save`` (``rlctl profile --out``); a bad file names what is wrong."""
        try:
            doc = json.loads(Path(path).read_text())
        except FileNotFoundError:
            raise FileNotFoundError(f"cost model file {path} does not exist") from None
        except json.JSONDecodeError as exc:
            raise ValueError(f"cost model file {path}: not JSON ({exc})") from None
        body = doc.get("cost_model") if isinstance(doc, dict) else None
        if not isinstance(body, dict):
            raise ValueError(f"cost model file {path}: no \"cost_model\" object")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(body) - known)
        if unknown:
            raise ValueError(f"cost model file {path}: unknown field {unknown[0]!r}")
        try:
            return cls(**body)
        except TypeError as exc:
            raise ValueError(f"cost model file {path}: {exc}") from None
