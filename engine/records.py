"""The engine's records: what happened to each request, each iteration and each OOM, and its counters.

Every figure a run reports (engine/metrics.py) is computed from these.
"""
from __future__ import annotations

from dataclasses import dataclass


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
    iterations: int = 0


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
