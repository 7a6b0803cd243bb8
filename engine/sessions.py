"""Multi-turn sessions: each session's context kept between turns, and the rules a turn follows.

A turn waits for the turn before it (the session's ``owner``), continues the session's tokens,
and takes its KV: reused from the device, swapped back in from the host, or recomputed if it was
dropped. Idle contexts are the first memory given back when blocks run short, least recently
used first, as a prefix cache evicts.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Iterator

import torch

from engine.kv_cache import KVCache
from engine.sequence import Sequence


@dataclass
class SessionContext:
    """The tokens of a session so far and where their KV is: device blocks, host copy, or nowhere
    (dropped: the next turn recomputes it). ``owner`` is the turn that holds the session from
    its admission until it finishes; later turns wait for it."""

    session_id: str
    token_ids: list[int] = field(default_factory=list)
    num_computed: int = 0
    block_table: list[int] = field(default_factory=list)
    host_kv: torch.Tensor | None = None
    last_used_s: float = 0.0
    owner: str | None = None

    @property
    def where(self) -> str:
        if self.block_table:
            return "device"
        return "host" if self.host_kv is not None else "dropped"


class Sessions(Mapping):
    """Every session's context, by session id (read it as a mapping); ``counters`` (the engine's)
    count reuse, swap-ins and drops."""

    def __init__(self, kv: KVCache, counters, max_model_len: int) -> None:
        self.kv, self.counters, self.max_model_len = kv, counters, max_model_len
        self.contexts: dict[str, SessionContext] = {}

    def __getitem__(self, session_id: str) -> SessionContext:
        return self.contexts[session_id]

    def __iter__(self) -> Iterator[str]:
        return iter(self.contexts)

    def __len__(self) -> int:
        return len(self.contexts)

    def admissible(self, seq: Sequence) -> bool:
        """Whether ``seq`` may start now (its session is idle); the first time, its tokens are
        completed with the session's context."""
        sid = seq.request.session_id
        if sid is None:
            return True
        ctx = self.contexts.setdefault(sid, SessionContext(sid))
        if ctx.owner not in (None, seq.id):
            return False
        if not seq.contextualized:
            seq.contextualized = True
            if len(ctx.token_ids) + seq.request.prompt_len >= self.max_model_len:
                self.drop(ctx, forget=True)  # the history no longer fits: the turn starts afresh
            seq.context_len = len(ctx.token_ids)
            seq.token_ids = ctx.token_ids + seq.token_ids
        return True

    def attach(self, seq: Sequence) -> None:
        """Hand ``seq`` its session's KV (swapped back in first if it is on the host); ``NeedBlocks``
        leaves the context on the host."""
        sid = seq.request.session_id
        if sid is None or seq.num_computed or seq.block_table:
            return
        ctx = self.contexts[sid]
        if ctx.host_kv is not None:
            ids = self.kv.swap_in(ctx.host_kv)
            self.counters.contexts_swapped_in += 1
            ctx.block_table, ctx.host_kv = ids, None
        if ctx.block_table:
            seq.block_table, seq.num_computed = ctx.block_table, ctx.num_computed
            ctx.block_table = []
            self.counters.contexts_reused += 1
        ctx.owner = seq.id

    def keep(self, seq: Sequence, now: float) -> None:
        """A finished turn leaves its tokens and KV to its session."""
        ctx = self.contexts[seq.request.session_id]
        ctx.token_ids, ctx.num_computed = seq.token_ids, seq.num_computed
        ctx.block_table, ctx.owner, ctx.last_used_s = seq.block_table, None, now

    def drop(self, ctx: SessionContext, forget: bool = False) -> None:
        """Give back a context's KV (the next turn recomputes it); ``forget`` its tokens too."""
        if ctx.block_table:
            self.kv.free(ctx.block_table)
        if ctx.host_kv is not None:
            self.kv.host.drop(ctx.host_kv)
        if ctx.block_table or ctx.host_kv is not None:
            self.counters.contexts_dropped += 1
        ctx.block_table, ctx.host_kv = [], None
        if forget:
            ctx.token_ids, ctx.num_computed = [], 0

    def release(self, seq: Sequence) -> None:
        """A turn leaves before its first token (its client gave up): the session is idle again, and
        the KV the turn took from it is gone with the turn (the next turn recomputes the context)."""
        ctx = self.contexts.get(seq.request.session_id)
        if ctx is not None and ctx.owner == seq.id:
            ctx.owner, ctx.num_computed = None, 0

    def idle(self) -> list[SessionContext]:
        """Contexts holding device blocks that no turn is running on, least recently used first."""
        return sorted((c for c in self.contexts.values() if c.block_table and c.owner is None),
                      key=lambda c: c.last_used_s)

    def drop_least_recent(self) -> bool:
        """Drop the least recently used idle context; whether there was one."""
        idle = [c for c in self.contexts.values() if c.block_table and c.owner is None]
        if not idle:
            return False
        self.drop(min(idle, key=lambda c: c.last_used_s))
        return True

    def lose_all(self) -> None:
        """A crash: every context's KV is gone (a turn that held its session still holds it)."""
        for ctx in self.contexts.values():
            if ctx.block_table or ctx.host_kv is not None:
                self.counters.contexts_dropped += 1
            ctx.block_table, ctx.host_kv = [], None

    def holders(self) -> Iterator[SessionContext]:
        """Contexts whose block tables point into the pool."""
        return (c for c in self.contexts.values() if c.block_table)

    def on_host(self) -> int:
        return sum(1 for c in self.contexts.values() if c.host_kv is not None)
