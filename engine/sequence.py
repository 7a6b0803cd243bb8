"""A sequence: one request's tokens, its KV location and its life in the engine."""
from __future__ import annotations

import enum
import math

import torch

from engine.records import RequestRecord
from engine.request import Request


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"
    FINISHED = "finished"
    ABANDONED = "abandoned"  # its client gave up before its first token (EngineConfig.client_timeout_s)


class Sequence:
    """Owns its token ids and its block table (logical block i -> physical block id).

    ``token_ids`` is the whole context: a session's earlier turns, this turn's prompt, and the
    tokens generated so far. KV exists for the first ``num_computed`` of them. A sequence whose
    KV was lost (restart, preemption) keeps its tokens and recomputes them on readmission.
    """

    def __init__(self, request: Request, token_ids: list[int], context_len: int, block_size: int,
                 record: RequestRecord, max_model_len: int) -> None:
        self.request = request
        self.id = request.request_id  # a request is frozen: read on every iteration, kept
        # tokens it generates before it stops: its real output, up to the limit it declared
        self.stop_at = min(request.output_len, request.max_tokens)
        self.token_ids = token_ids
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.context_len = context_len  # tokens that came from the session before this turn
        self.record = record
        self.num_computed = 0
        self.num_generated = 0
        # tokens whose KV a prefix cache would still hold after a preemption (``EngineConfig.preempted_kv:
        # cached``): readmitted, it starts computing after them
        self.cached = 0
        self.block_table: list[int] = []
        self.host_kv: torch.Tensor | None = None  # KV blocks on the host while swapped
        self.status = Status.WAITING
        self.admit_order = -1
        self.contextualized = request.session_id is None  # a turn gets its session's context once

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def context_len(self) -> int:
        return self._context_len

    @context_len.setter
    def context_len(self, tokens: int) -> None:
        self._context_len = tokens
        # blocks this request may need at most: its context and prompt plus ``max_tokens``, up to
        # the model length where generation stops anyway (read on every admission: kept, not derived)
        peak = min(tokens + self.request.prompt_len + self.request.max_tokens, self.max_model_len)
        self.peak_blocks = math.ceil(peak / self.block_size)

    @property
    def num_uncomputed(self) -> int:
        return len(self.token_ids) - self.num_computed

    @property
    def in_prefill(self) -> bool:
        # ``num_uncomputed > 1``, written out: the scheduler asks it of every sequence every iteration
        return len(self.token_ids) - self.num_computed > 1

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold KV for the first ``num_tokens`` tokens."""
        return math.ceil(num_tokens / self.block_size)

    @property
    def done(self) -> bool:
        return self.num_generated >= self.stop_at
