"""Continuous batching: the waiting, running and swapped queues, and which tokens run next.

Each iteration mixes decodes and prefill chunks under ``max_num_seqs`` and
``max_num_batched_tokens``. New requests are admitted first come, first served by the overcommit
rule: the peak demand (``prompt + max_tokens``, in blocks) of everything held may reach
``overcommit x`` KV capacity, and the prompt's blocks must be free now.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Callable, NamedTuple

from engine.kv_cache import KVCache, NeedBlocks
from engine.sequence import Sequence, Status


@dataclass
class Work:
    """One sequence's share of an iteration: ``num_tokens`` tokens from ``num_computed`` on."""

    seq: Sequence
    num_tokens: int

    @property
    def produces_token(self) -> bool:
        return self.seq.num_computed + self.num_tokens == len(self.seq)


class BatchShape(NamedTuple):
    """What an iteration computes, as a cost model and the workspace charge see it."""

    num_tokens: int      # tokens computed (prefill chunks + one per decode)
    context_tokens: int  # KV tokens attention reads (each sequence's context up to its chunk's end)
    attended: int        # (query, key) pairs attention scores, causal within a chunk


def batch_tokens(work: list[Work]) -> BatchShape:
    num_tokens = context = attended = 0
    for w in work:
        n, end = w.num_tokens, w.seq.num_computed + w.num_tokens
        num_tokens += n
        context += end
        attended += n * end - n * (n - 1) // 2
    return BatchShape(num_tokens, context, attended)


class Scheduler:
    """``reclaim`` frees blocks that no running sequence needs (idle session contexts, blocks a
    waiting turn took) and says whether it freed any; it is tried before any allocation fails."""

    def __init__(self, kv: KVCache, max_num_seqs: int, max_num_batched_tokens: int,
                 reclaim: Callable[[], bool]) -> None:
        self.kv = kv
        self.reclaim = reclaim
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order
        self.swapped: deque[Sequence] = deque()
        self._admissions = 0

    def reserved_blocks(self) -> int:
        """Admitted peak demand in blocks: the overcommit rule's left-hand side."""
        return sum(s.peak_blocks for s in self.running) + sum(s.peak_blocks for s in self.swapped)

    def _grow(self, seq: Sequence, num_tokens: int) -> None:
        need = seq.blocks_for(num_tokens) - len(seq.block_table)
        while need > 0:
            try:
                seq.block_table += self.kv.allocate(need)
                return
            except NeedBlocks:
                if not self.reclaim():
                    raise
                need = seq.blocks_for(num_tokens) - len(seq.block_table)  # reclaim may take seq's own

    def _admit(self, seq: Sequence) -> None:
        seq.status = Status.RUNNING
        seq.admit_order = self._admissions
        self._admissions += 1
        self.running.append(seq)

    def schedule(self, overcommit: float, admissible: Callable[[Sequence], bool],
                 attach: Callable[[Sequence], None], swap_in_reserve: int = 0) -> list[Work]:
        """The next iteration's work. Raises ``NeedBlocks`` when a running sequence cannot grow;
        blocks taken before that stay with their sequences, so calling again is safe.

        ``admissible`` says whether a waiting sequence may start now (its session is idle) and
        completes its tokens with the session's context; ``attach`` hands it the context's KV.
        Swapped sequences come back only while ``swap_in_reserve`` blocks stay free (the free
        share an eviction asked for), unless nothing else runs.
        """
        budget = self.max_num_batched_tokens
        # Swapped sequences come back first, oldest first, while their blocks are free.
        while self.swapped and len(self.running) < self.max_num_seqs:
            seq = self.swapped[0]
            need = seq.host_kv.shape[0] + 1
            if self.running and need + swap_in_reserve > self.kv.blocks.num_free:
                break
            if need > self.kv.blocks.num_free:
                if not self.running and self.reclaim():  # nothing running will free blocks
                    continue
                break
            try:
                seq.block_table = self.kv.swap_in(seq.host_kv)
            except NeedBlocks:
                break
            seq.host_kv = None
            self.swapped.popleft()
            seq.status = Status.RUNNING
            self.running.append(seq)
            self.running.sort(key=lambda s: s.admit_order)

        work: list[Work] = []
        for seq in self.running:  # decodes first: they hold memory and each needs one token
            if not seq.in_prefill:
                self._grow(seq, seq.num_computed + 1)
                work.append(Work(seq, 1))
                budget -= 1
        for seq in self.running:  # then the chunks of prefills already under way
            if seq.in_prefill and budget > 0:
                n = min(seq.num_uncomputed, budget)
                self._grow(seq, seq.num_computed + n)
                work.append(Work(seq, n))
                budget -= n

        if self.swapped:
            return work  # nothing new is admitted while admitted work waits on the host
        limit = overcommit * self.kv.num_blocks
        reserved = self.reserved_blocks()
        for seq in list(self.waiting):
            if len(self.running) >= self.max_num_seqs or budget <= 0:
                break
            if not admissible(seq):
                continue
            # with nothing held the head is admitted whatever the factor, so the engine never stalls
            if reserved + seq.peak_blocks > limit and (self.running or self.swapped):
                break
            try:
                attach(seq)
                self._grow(seq, len(seq))  # the whole prompt's blocks must be free now
            except NeedBlocks:
                break
            self.waiting.remove(seq)
            self._admit(seq)
            reserved += seq.peak_blocks
            n = min(seq.num_uncomputed, budget)
            work.append(Work(seq, n))
            budget -= n
        return work

    def requeue(self, seq: Sequence) -> None:
        """Put a sequence whose KV is gone back at the front of the queue, to be recomputed."""
        seq.num_computed = 0
        seq.block_table = []
        seq.host_kv = None
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)
