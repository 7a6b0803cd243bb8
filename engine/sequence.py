"""A sequence: one request's tokens, its KV location and its life in the engine."""
from __future__ import annotations

import enum
import hashlib
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
        # a prefix cache's: whether its blocks may be shared (a session's turns hold their context in the
        # session store instead), and how many of its first blocks are cached under its keys
        self.cacheable = request.session_id is None
        self.keyed = 0
        self.shareable = self._shareable()  # blocks past these are keyed by the request itself (``block_key``)
        self.preempted_tokens = 0  # tokens it had computed when preempted: recomputed at readmission past the hits
        self._chain: list[bytes] | None = None  # ``_chained``'s digests
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

    def block_key(self, j: int) -> tuple:
        """What the ``j``-th full block holds, as a prefix cache keys it: equal keys, equal tokens in
        the block and in every block before it. A prompt's blocks are keyed by their content where
        the client gave the tokens, else by the trace's hash ids that cover them (``Request.hash_ids``),
        each chained to those before it (SHA-256, as vLLM's); the rest, generated tokens among them,
        by the request itself (its own KV again, after a preemption: ``KVCache.cache``'s ``own``)."""
        req, size, end = self.request, self.block_size, (j + 1) * self.block_size
        if j < self.shareable:
            if req.prompt_ids is not None:
                return ("t", self._chained(j, lambda n: self.token_ids[n * size:(n + 1) * size]))
            hbt = req.hash_block_tokens  # a hash id names that many tokens: part of what it keys
            return ("h", hbt, self._chained((end - 1) // hbt, lambda k: (req.hash_ids[k],)), j)
        return ("r", self.id, j)

    def _shareable(self) -> int:
        """The first full blocks whose keys another request may share: the prompt's, where its ids
        or a trace's hash ids say what they hold (none for a session's turn)."""
        req = self.request
        if not self.cacheable or self.context_len:
            return 0
        if req.prompt_ids is not None:
            return req.prompt_len // self.block_size
        if req.hash_ids:
            return min(req.prompt_len, len(req.hash_ids) * req.hash_block_tokens) // self.block_size
        return 0

    def _chained(self, i: int, part) -> bytes:
        """The digest of ``part(0)`` .. ``part(i)``, each chained to the one before (a request's
        prompt is keyed one way: by its ids or by its hash ids)."""
        chain = self._chain
        if chain is None:
            chain = self._chain = []
        while len(chain) <= i:
            before = chain[-1] if chain else b""
            chain.append(hashlib.sha256(before + repr(tuple(part(len(chain)))).encode()).digest())
        return chain[i]

    @property
    def done(self) -> bool:
        return self.num_generated >= self.stop_at
