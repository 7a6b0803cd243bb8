"""The engine's records: what happened to each request, each iteration and each OOM, and its counters.

Every figure a run reports (engine/metrics.py) is computed from these.
"""
from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np


@dataclass
class RequestRecord:
    """What happened to one request; TTFT, TPOT and goodput are computed from these."""

    request_id: str
    arrival_s: float
    prompt_len: int
    max_tokens: int
    output_len: int = 0
    first_token_s: float | None = None
    finish_s: float | None = None
    preemptions: int = 0
    restarts: int = 0
    session_id: str | None = None
    abandoned_s: float | None = None  # when its client gave up waiting for the first token

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.arrival_s

    @property
    def tpot_s(self) -> float | None:
        if self.finish_s is None or self.first_token_s is None or self.output_len < 2:
            return None
        return (self.finish_s - self.first_token_s) / (self.output_len - 1)


@dataclass
class Counters:
    oom_events: int = 0
    preemptions: int = 0
    compactions: int = 0
    compaction_blocks: int = 0
    compaction_bytes: int = 0
    compaction_s: float = 0.0
    contexts_reused: int = 0
    contexts_swapped_in: int = 0
    contexts_dropped: int = 0
    tokens_generated: int = 0
    prefill_tokens: int = 0
    recomputed_tokens: int = 0  # tokens whose KV was lost (preemption, crash) and must be computed again
    iterations: int = 0
    restarts: int = 0  # graceful restarts (a new MPS limit taking effect), not OOM events
    abandoned: int = 0  # requests whose clients gave up before their first token (client_timeout_s)


@dataclass
class Iteration:
    end_s: float
    duration_s: float
    decode_tokens: int
    prefill_tokens: int
    alloc_ratio: float
    generated: int = 0  # tokens produced (decodes, and prefill chunks that reached their end)


@dataclass(frozen=True)
class OOMEvent:
    """Where an out-of-memory event came from. ``source``: "kv blocks" (a running sequence needed
    a block and every block was in use), "kv pool growth" (the pool could not grow on the device),
    "iteration workspace" (the device ledger refused a batch's workspace) or "iteration
    activations" (the forward pass ran out of device memory); ``cause`` names the failure
    underneath ("every block in use", "device ledger", "OutOfMemoryError")."""

    time_s: float
    source: str
    cause: str
    mode: str

    def __str__(self) -> str:
        return f"{self.source}: {self.cause}"


class IterationLog:
    """Every iteration, column by column: end time, duration, decode and prefill tokens, KV
    utilisation after it, tokens generated. The engine appends one iteration at a time and a
    run of decodes at once (engine/decode_run.py); the figures read whole columns (``column``) over
    an index range, and ``find`` turns a time into an index. Read one at a time, it gives
    ``Iteration`` records. (Columns, not a list of records: a long run logs hundreds of thousands
    of iterations, and as objects they cost more to make and to garbage-collect than to simulate.)"""

    COLUMNS = tuple(f.name for f in fields(Iteration))
    _DTYPES = {"end_s": np.float64, "duration_s": np.float64, "decode_tokens": np.int64, "prefill_tokens": np.int64,
               "alloc_ratio": np.float64, "generated": np.int64}

    def __init__(self, capacity: int = 1024) -> None:
        self._n = 0
        self._cols = {name: np.empty(capacity, dtype=self._DTYPES[name]) for name in self.COLUMNS}

    def __len__(self) -> int:
        return self._n

    def _reserve(self, extra: int) -> None:
        need = self._n + extra
        size = len(self._cols["end_s"])
        if need > size:
            size = max(need, 2 * size)
            for name, col in self._cols.items():
                grown = np.empty(size, dtype=col.dtype)
                grown[:self._n] = col[:self._n]
                self._cols[name] = grown

    def append(self, end_s: float, duration_s: float, decode_tokens: int, prefill_tokens: int, alloc_ratio: float,
               generated: int) -> None:
        self._reserve(1)
        n, c = self._n, self._cols
        c["end_s"][n], c["duration_s"][n], c["decode_tokens"][n] = end_s, duration_s, decode_tokens
        c["prefill_tokens"][n], c["alloc_ratio"][n], c["generated"][n] = prefill_tokens, alloc_ratio, generated
        self._n += 1

    def extend(self, **columns) -> None:
        """Many iterations at once: each column an array (or a value for all of them)."""
        k = len(columns["end_s"])
        self._reserve(k)
        for name in self.COLUMNS:
            self._cols[name][self._n:self._n + k] = columns[name]
        self._n += k

    def column(self, name: str, start: int = 0, stop: int | None = None) -> np.ndarray:
        """A read-only view of one column over iterations [start, stop)."""
        stop = self._n if stop is None else min(stop, self._n)
        view = self._cols[name][start:stop]
        view.flags.writeable = False
        return view

    def find(self, time_s: float) -> int:
        """The index of the first iteration that ends after ``time_s``."""
        return int(np.searchsorted(self._cols["end_s"][:self._n], time_s, side="right"))

    def __getitem__(self, i: int | slice) -> Iteration | list[Iteration]:
        if isinstance(i, slice):
            return [self[k] for k in range(*i.indices(self._n))]
        if i < 0:
            i += self._n
        if not 0 <= i < self._n:
            raise IndexError(f"iteration {i} of {self._n}")
        return Iteration(*(self._cols[name][i].item() for name in self.COLUMNS))

    def __iter__(self):
        for i in range(self._n):
            yield self[i]
