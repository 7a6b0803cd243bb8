"""Continuous batching: the request queues, every move between them, and which tokens run next.

The scheduler owns the queues (arrivals not yet due, waiting, running, swapped) and is the one
place a sequence moves between them: arrive, admit, preempt, requeue, finish, swap out and in,
and the crash that sends everything back. Each iteration mixes decodes and prefill chunks under
``max_num_seqs`` and ``max_num_batched_tokens``. New requests are admitted first come, first
served by the overcommit rule: the peak demand (``prompt + max_tokens``, in blocks) of everything
held may reach ``overcommit x`` KV capacity, and the prompt's blocks must be free now (or, as vLLM
v1 allocates, its first chunk's: ``prompt_chunks``). With a prefix cache, a block running requests
share counts once, and a request is not charged the cached blocks of its prefix that running
requests hold (``shared_blocks``), in every rule.
"""
from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass
from typing import Iterator, NamedTuple

from engine.block_manager import OutOfBlocks
from engine.kv_cache import CopyReport, HostFull, KVCache, NeedBlocks
from engine.sequence import Sequence, Status
from engine.sessions import Sessions


@dataclass(slots=True)
class Work:
    """One sequence's share of an iteration: ``num_tokens`` tokens from ``num_computed`` on."""

    seq: Sequence
    num_tokens: int

    @property
    def produces_token(self) -> bool:
        return self.seq.num_computed + self.num_tokens == len(self.seq.token_ids)


class BatchShape(NamedTuple):
    """What an iteration computes, as a cost model and the workspace charge see it."""

    num_tokens: int      # tokens computed (prefill chunks + one per decode)
    context_tokens: int  # KV tokens attention reads (each sequence's context up to its chunk's end)
    attended: int        # (query, key) pairs attention scores, causal within a chunk


def batch_tokens(work: list[Work], window: int | None = None, chunked: bool = False) -> BatchShape:
    """What ``work`` computes, as a layer attending through a sliding ``window`` sees it, or (``chunked``)
    within aligned chunks of ``window`` keys (None: full attention, every key up to each query)."""
    if window is not None:
        seen = [windowed(w.num_tokens, w.seq.num_computed + w.num_tokens, window, chunked) for w in work]
        return BatchShape(sum(w.num_tokens for w in work), sum(k for k, _ in seen), sum(p for _, p in seen))
    num_tokens = context = attended = 0  # every iteration's: kept to plain arithmetic
    for w in work:
        n, end = w.num_tokens, w.seq.num_computed + w.num_tokens
        num_tokens += n
        context += end
        attended += n * end - n * (n - 1) // 2
    return BatchShape(num_tokens, context, attended)


def windowed(n: int, end: int, window: int | None, chunked: bool = False) -> tuple[int, int]:
    """The keys a chunk of ``n`` queries ending at context ``end`` reads and the (query, key) pairs it
    scores, causally, each query seeing the last ``window`` keys up to its own (None: all of them), or
    (``chunked``: Llama 4's) those of its aligned chunk of ``window`` keys up to its own."""
    if window is None or end <= window:
        return end, n * end - n * (n - 1) // 2
    if chunked:  # the query at position p (from 0) sees p % window + 1 keys, from its chunk's first on
        def pairs(x: int) -> int:  # the queries' at positions 0 .. x - 1
            full, rest = divmod(x, window)
            return full * window * (window + 1) // 2 + rest * (rest + 1) // 2
        return end - (end - n) // window * window, pairs(end) - pairs(end - n)
    first = end - n + 1  # the first query sees keys 1 .. first, the last 1 .. end (counting from 1)
    below = max(0, window - first + 1)  # queries that see fewer keys than the window: first .. window
    pairs = (first + window) * below // 2 + (n - below) * window
    return min(end, n + window - 1), pairs


class NewTokenRatio:
    """SGLang's adaptive reservation. A request is admitted while the tokens held by the running
    requests and the new one, plus ``value`` x the tokens they may still generate (each clipped at
    ``clip``), fit the KV capacity; with ``full_new`` (SGLang's code) the new request, and those
    admitted before it in the same iteration, are charged their clipped future in full instead.
    ``value`` starts at ``init`` and falls linearly to ``init x min_factor`` over ``decay_steps``
    decode iterations. When a decode iteration finds no free block and retracts a request, it goes
    back to ``init`` (issue 9's rule) or is re-estimated from the requests still running
    (``estimate_after_retract``, SGLang's code, which also puts it back to ``init`` when idle).

    SGLang's code also stops trying to admit once an admission is refused for memory: the running
    batch is marked full (``batch_is_full``) until it shrinks, a request finishing or retracted, so a
    falling ratio alone admits no one (``batch_full``; not issue 9's rule). A batch that was empty is
    replaced by the requests admitted with the refusal, unmarked."""

    def __init__(self, init: float, min_factor: float, decay_steps: int, clip: int, full_new: bool = False) -> None:
        self.init, self.clip, self.full_new = init, clip, full_new
        self.min = init * min_factor
        self.step = (init - self.min) / decay_steps
        self.value = init
        self.set_by_retract = False  # SGLang's code sets it in the decode batch that retracts, and decays it in the others
        self.batch_full = False  # SGLang's code: an admission refused for memory; cleared when the running batch shrinks

    def decode_batch(self) -> None:
        """One decode iteration: the ratio decays, unless a retract set it in this one."""
        if self.set_by_retract:
            self.set_by_retract = False
        else:
            self.decay()

    def decay(self) -> None:
        self.value = max(self.value - self.step, self.min)

    def reset(self) -> None:
        self.value = self.init

    def estimate_after_retract(self, running: list[Sequence], steps: int) -> None:
        """SGLang's ratio after a retract, from the sequences still running: what they generated
        plus ``steps`` more each, over what they declared (unclipped), at most 1. With none left
        running (SGLang never retracts its last request; rlctl's engine must, when a co-tenant
        holds the memory it needs) there is nothing to estimate from, and the ratio starts again."""
        self.set_by_retract = True
        if not running:
            self.reset()
            return
        generated = sum(s.num_generated for s in running) + steps * len(running)
        self.value = min(1.0, generated / (sum(s.request.max_tokens for s in running) + 1))

    def future(self, seq: Sequence) -> int:
        """Tokens ``seq`` may still generate, clipped."""
        return min(seq.request.max_tokens - seq.num_generated, self.clip)


class Scheduler:
    """Before any allocation fails, blocks that no running sequence needs are reclaimed
    (``reclaim``): blocks a waiting turn took, then idle session contexts. ``ratio`` (SGLang's
    admission rule) replaces the overcommit rule when given. With ``prompt_chunks`` a new request
    takes only its first chunk's blocks (``EngineConfig.prompt_blocks: chunk``, vLLM v1's way). With
    ``cache_preempted`` a preempted sequence is readmitted with the KV it had computed
    (``EngineConfig.preempted_kv: cached``: ``Sequence.cached``, ``admission_start``)."""

    def __init__(self, kv: KVCache, sessions: Sessions, max_num_seqs: int, max_num_batched_tokens: int,
                 ratio: NewTokenRatio | None = None, prompt_chunks: bool = False, cache_preempted: bool = False) -> None:
        self.kv, self.sessions, self.ratio, self.prompt_chunks = kv, sessions, ratio, prompt_chunks
        self.cache_preempted = cache_preempted
        self._recomputed = 0  # tokens readmissions will compute again that were computed before (``take_recomputed``)
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.pending: list[tuple[float, int, Sequence]] = []  # a heap of (arrival time, submission order, seq)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order
        self.swapped: deque[Sequence] = deque()
        self._submitted = 0
        self._admissions = 0

    # ---- arrivals --------------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        """A submitted sequence, to join the waiting queue at its arrival time."""
        heapq.heappush(self.pending, (seq.request.arrival_s, self._submitted, seq))
        self._submitted += 1

    def arrive(self, now: float) -> None:
        while self.pending and self.pending[0][0] <= now:
            self.waiting.append(heapq.heappop(self.pending)[2])

    def next_arrival(self) -> float | None:
        return self.pending[0][0] if self.pending else None

    def abandon(self, now: float, timeout_s: float) -> list[Sequence]:
        """Every sequence with no first token ``timeout_s`` after its arrival leaves (its client gave
        up), wherever it is: waiting, running its prefill, or on the host. The KV it holds is freed,
        and a session's turn leaves its session idle. Returns them."""
        gone = [q for q in self.unfinished() if q.record.first_token_s is None and q.record.arrival_s + timeout_s <= now]
        for seq in gone:
            for queue in (self.waiting, self.running, self.swapped):
                if seq in queue:
                    queue.remove(seq)
                    if queue is self.running:
                        self._shrunk()
                    break
            if seq.block_table:
                self.kv.cache(seq)
                self.kv.free(seq.block_table)
            if seq.host_kv is not None:
                self.kv.host.drop(seq.host_kv)
            seq.block_table, seq.host_kv, seq.num_computed = [], None, 0
            if seq.request.session_id is not None:
                self.sessions.release(seq)
            seq.status = Status.ABANDONED
        return gone

    def next_abandonment(self, timeout_s: float) -> float | None:
        """When the next sequence with no first token is given up (None: there is none)."""
        first = min((q.record.arrival_s for q in self.unfinished() if q.record.first_token_s is None), default=None)
        return None if first is None else first + timeout_s

    def busy(self) -> bool:
        """Whether anything has arrived and is not finished."""
        return bool(self.waiting or self.running or self.swapped)

    def has_work(self) -> bool:
        return bool(self.pending) or self.busy()

    def unfinished(self) -> list[Sequence]:
        """Every sequence that has arrived and not finished: waiting, running, on the host."""
        return [*self.waiting, *self.running, *self.swapped]

    def reserved_blocks(self) -> int:
        """Admitted peak demand in blocks: the overcommit rule's left-hand side. A block that running
        requests share (a prefix cache's) counts once, as the memory it is."""
        return (sum(s.peak_blocks for s in self.running) + sum(s.peak_blocks for s in self.swapped)
                - self.kv.blocks.num_shared)

    def shared_blocks(self, found: list[int]) -> int:
        """Blocks of a cached prefix ``found`` (``KVCache.cached_prefix``) that running requests hold:
        admitting its request takes no more memory for them, so no admission rule charges them again."""
        return len(found) - self.kv.blocks.num_free_among(found)

    def holders(self) -> Iterator:
        """Every holder of a block table that points into the pool (sequences, session contexts)."""
        yield from (q for q in self.running + list(self.waiting) if q.block_table)
        yield from self.sessions.holders()

    # ---- the next iteration ----------------------------------------------------------------------
    def reclaim(self, keep: Sequence | None = None) -> bool:
        """Free blocks nobody is running on: a waiting turn gives back what it took (``keep`` aside:
        the cached blocks a request being admitted took), else the least recently used idle context
        is dropped (and recomputed later). Whether anything was freed."""
        for seq in self.waiting:
            if seq.block_table and seq is not keep:
                self.kv.free(seq.block_table)
                seq.block_table, seq.num_computed = [], 0
                return True
        return self.sessions.drop_least_recent()

    def _grow(self, seq: Sequence, num_tokens: int, readmit: bool = False) -> None:
        """Blocks for ``seq``'s first ``num_tokens``; ``readmit``: after a preemption, taking back
        first what a prefix cache still holds of its own (``KVCache.allocate``)."""
        if num_tokens <= len(seq.block_table) * seq.block_size:
            return  # the table holds them already (most decodes): nothing to allocate
        need = seq.blocks_for(num_tokens) - len(seq.block_table)
        while need > 0:
            try:
                seq.block_table += self.kv.allocate(need, seq if readmit else None)
                return
            except NeedBlocks:
                if not self.reclaim(keep=seq if seq.cacheable else None):
                    raise
                need = seq.blocks_for(num_tokens) - len(seq.block_table)  # reclaim may take a turn's own context

    def _attach(self, seq: Sequence) -> None:
        """``sessions.attach``: hand ``seq`` its session's KV. When its context must come back from
        the host and does not fit while nothing runs or waits on the host, idle contexts are dropped
        (``reclaim``) until it does, as for a swap-in: nothing running will free blocks, and the
        head of the queue would wait for ever."""
        while True:
            try:
                return self.sessions.attach(seq)
            except NeedBlocks:
                if self.running or self.swapped or not self.reclaim():
                    raise

    def _admit(self, seq: Sequence) -> None:
        self.waiting.remove(seq)
        seq.status = Status.RUNNING
        seq.admit_order = self._admissions
        self._admissions += 1
        self.running.append(seq)

    def _swap_in(self, swap_in_reserve: int) -> None:
        """Swapped sequences come back first, oldest first, while their blocks are free."""
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
            seq.host_kv, seq.keyed = None, 0  # new blocks, unkeyed: keyed when they are freed
            self.swapped.popleft()
            seq.status = Status.RUNNING
            self.running.append(seq)
            self.running.sort(key=lambda s: s.admit_order)

    def reclaimable_blocks(self) -> int:
        """Blocks ``reclaim`` could free: waiting turns' and idle session contexts'."""
        return (sum(len(q.block_table) for q in self.waiting)
                + sum(len(c.block_table) for c in self.sessions.holders() if c.owner is None))

    def schedule(self, overcommit: float, swap_in_reserve: int = 0, admit: bool = True,
                 headroom: int = 0) -> list[Work]:
        """The next iteration's work. Raises ``NeedBlocks`` when a running sequence cannot grow
        (``DeviceOOM`` when a swap-in cannot be copied); blocks taken before that stay with their
        sequences, so calling again is safe.

        Swapped sequences come back only while ``swap_in_reserve`` blocks stay free (the free
        share an eviction asked for), unless nothing else runs. A waiting turn of a session starts
        only when its session is idle, and takes the session's context and KV. With ``admit``
        False nothing new is admitted: as in vLLM, an iteration that had to preempt admits none.
        While anything is held, a new request is admitted only if ``headroom`` blocks stay free
        after its prompt's, counting reclaimable blocks as free (its own session context among
        them): the KV a running batch has left to grow into before a crash or a preemption.
        """
        budget = self.max_num_batched_tokens
        self._swap_in(swap_in_reserve)
        work: list[Work] = []
        prefills = []  # a decode's growth reclaims only waiting turns and idle contexts: no phase changes
        for seq in self.running:  # decodes first: they hold memory and each needs one token
            computed = seq.num_computed
            if len(seq.token_ids) - computed > 1:  # ``seq.in_prefill``, asked of every sequence
                prefills.append(seq)
                continue
            if computed >= len(seq.block_table) * seq.block_size:  # its token starts a new block
                self._grow(seq, computed + 1)
            work.append(Work(seq, 1))
            budget -= 1
        for seq in prefills:  # then the chunks of prefills already under way
            if budget > 0:
                n = min(seq.num_uncomputed, budget)
                self._grow(seq, seq.num_computed + n)
                work.append(Work(seq, n))
                budget -= n

        if self.swapped or not admit or not self.waiting:
            return work  # nothing new is admitted while admitted work waits on the host (or nothing waits)
        if self.ratio is not None and self.ratio.batch_full and self.running:
            return work  # SGLang's code: refused for memory, it tries again once the running batch shrinks
        limit = overcommit * self.kv.num_blocks
        reserved = self.reserved_blocks()
        books = self.sglang_books() if self.ratio is not None else None
        # SGLang's code marks the running batch full on a refusal for memory; with none decoding before this
        # iteration (a prompt still in chunks is not in SGLang's running batch) the batch it marks is replaced
        # by the requests prefilled now, and the mark is lost
        marks = (self.ratio is not None and self.ratio.full_new
                 and any(len(q.token_ids) - q.num_computed <= 1 for q in self.running))
        available = None  # free and reclaimable blocks, counted when a request first meets the headroom
        for seq in list(self.waiting):
            if len(self.running) >= self.max_num_seqs or budget <= 0:
                break
            if not self.sessions.admissible(seq):
                continue
            found = self.kv.cached_prefix(seq)  # what a prefix cache holds of its first tokens ([] without one)
            shared = self.shared_blocks(found)
            # with nothing held the head is admitted whatever the rule, so the engine never stalls
            if self.running or self.swapped:
                if self.ratio is None and reserved + seq.peak_blocks - shared > limit:
                    break
                if self.ratio is not None and self.sglang_over(books, seq, self.ratio.value, shared):
                    self.ratio.batch_full = marks
                    break
                if headroom:
                    if available is None:
                        available = self.kv.blocks.num_free + self.reclaimable_blocks()
                    if available - seq.blocks_for(len(seq)) + shared < headroom:
                        break
            hits = 0
            try:
                self._attach(seq)
                if not seq.block_table:  # a session turn (never cached) may have taken its context's blocks
                    if found:  # taken only if the rest fits (or reclaiming may make it fit), as vLLM checks first
                        start = len(found) * seq.block_size
                        end = start + min(len(seq) - start, budget) if self.prompt_chunks else len(seq)
                        take = seq.blocks_for(end) - shared
                        free = self.kv.blocks.num_free + self.reclaimable_blocks()
                        if take > free:
                            raise NeedBlocks(take, OutOfBlocks(f"{take} blocks needed, {free} free or reclaimable"))
                        self.kv.claim(seq, found)
                    seq.block_table = found
                    hits = seq.keyed = len(found)
                    seq.num_computed = hits * seq.block_size
                attached = seq.num_computed
                start = self.admission_start(seq)
                n = min(len(seq) - start, budget)
                # the whole prompt's blocks must be free now, or (vLLM v1) its first chunk's
                self._grow(seq, start + n if self.prompt_chunks else len(seq), readmit=seq.cached > 0)
                if seq.num_computed != attached:  # reclaiming took the context it had attached: all is computed
                    start = seq.num_computed       # again (the blocks grown cover it: it starts no later)
                    n = min(len(seq) - start, budget)
                    hits = 0
            except NeedBlocks:
                if hits and seq.block_table:  # the cached blocks it took go back, still cached
                    self.kv.free(seq.block_table)
                    seq.block_table, seq.num_computed = [], 0
                if self.ratio is not None:
                    self.ratio.batch_full = marks
                break
            if self.kv.blocks.caching and seq.cacheable:
                self.kv.prefix_query_tokens += len(seq)
                self.kv.prefix_hit_tokens += hits * seq.block_size
            if seq.cached:  # readmitted after a preemption: what the cache no longer holds is computed again
                self._recomputed += max(seq.cached - start, 0)
                seq.cached = 0
            if seq.preempted_tokens:  # the same, past what a prefix cache held of it (``KVCache.cached_prefix``)
                self._recomputed += max(seq.preempted_tokens - start, 0)
                seq.preempted_tokens = 0
            seq.num_computed = start
            self._admit(seq)
            reserved += seq.peak_blocks - shared
            if available is not None:
                available -= seq.blocks_for(len(seq)) - shared
            if self.ratio is not None:
                books = self.sglang_with(books, seq, shared)
            work.append(Work(seq, n))
            budget -= n
        return work

    def admission_start(self, seq: Sequence) -> int:
        """Where ``seq``'s computation starts when it is admitted: after its session's context, or
        after what a prefix cache kept of it when it was preempted (``cache_preempted``: those tokens
        are not computed again; its last token always is, to produce the next)."""
        cached = seq.cached
        if cached and self.kv.order is not None:  # vLLM's prefix cache: what other requests have not taken
            cached = min(cached, self.kv.order.kept(seq) * seq.block_size)
        return max(seq.num_computed, min(cached, len(seq) - 1))

    def take_recomputed(self) -> int:
        """Tokens computed before a preemption that readmissions since the last call compute again
        (with a prefix cache, ``cache_preempted``; without one a preemption counts them itself)."""
        n, self._recomputed = self._recomputed, 0
        return n

    def sglang_books(self) -> tuple[int, int, int]:
        """SGLang's admission books over the running sequences: the tokens they hold (a prefix
        cache's shared blocks once: SGLang's tree holds them once), the tokens they may still
        generate (clipped), both weighed by the ratio, and the tokens charged in full (none yet:
        only a request admitted in this iteration is, under SGLang's code)."""
        held = sum(len(q) for q in self.running) - self.kv.blocks.num_shared * self.kv.pool.block_size
        return held, sum(self.ratio.future(q) for q in self.running), 0

    def sglang_over(self, books: tuple[int, int, int], seq: Sequence, ratio: float, shared: int = 0) -> bool:
        """Whether admitting ``seq`` on top of ``books`` breaks SGLang's rule at ``ratio``. Issue 9's
        rule weighs its future at the ratio and admits while the sum fits the KV capacity; SGLang's
        code (``NewTokenRatio.full_new``, ``PrefillAdder.add_one_req``) charges its prompt and the
        tokens it may still generate (clipped) in full, and refuses a sum that reaches the capacity.
        Its prompt is charged but for the ``shared`` blocks of it running requests hold (``shared_blocks``:
        SGLang charges what it must compute and what it locks of the cache's free tokens)."""
        held, future, full = books
        capacity = self.kv.num_blocks * self.kv.pool.block_size
        prompt = len(seq) - shared * seq.block_size
        if self.ratio.full_new:
            return held + ratio * future + full + prompt + self.ratio.future(seq) >= capacity
        return held + prompt + ratio * (future + self.ratio.future(seq)) > capacity  # ``full`` stays 0 here

    def sglang_with(self, books: tuple[int, int, int], seq: Sequence, shared: int = 0) -> tuple[int, int, int]:
        """The books with ``seq`` admitted: its future at the ratio (issue 9's rule) or, with its
        prompt, in full (SGLang's code, which books its declared ``max_tokens``, clipped, for the
        rest of the iteration; from the next one on it runs and is weighed at the ratio); its prompt
        but for the ``shared`` blocks, as ``sglang_over`` charges it."""
        held, future, full = books
        prompt = len(seq) - shared * seq.block_size
        if self.ratio.full_new:
            return held, future, full + prompt + min(seq.request.max_tokens, self.ratio.clip)
        return held + prompt, future + self.ratio.future(seq), full

    # ---- leaving the running queue ---------------------------------------------------------------
    def requeue(self, seq: Sequence, front: bool = True) -> None:
        """Put a sequence whose KV is gone back in the queue, at the front (or the back), to be recomputed."""
        seq.num_computed = seq.keyed = 0
        seq.block_table = []
        seq.host_kv = None
        seq.status = Status.WAITING
        (self.waiting.appendleft if front else self.waiting.append)(seq)

    def preempt_newest(self) -> int | None:
        """vLLM's preemption: the newest running sequence frees its blocks and waits to be
        recomputed, first in the queue. The tokens it must recompute (none where a cache keeps them),
        or None when nothing runs."""
        if not self.running:
            return None
        return self._preempt(max(self.running, key=lambda s: s.admit_order), front=True)

    def retract_fewest_outputs(self) -> int | None:
        """SGLang's retract (``ScheduleBatch.retract_decode``): the running sequence with the fewest
        output tokens (of those, the longest prompt) frees its blocks and waits to be recomputed,
        last in the queue. The tokens it must recompute (none where a cache keeps them), or None
        when nothing runs."""
        if not self.running:
            return None
        return self._preempt(min(self.running, key=lambda s: (s.num_generated, -s.request.prompt_len)), front=False)

    def _shrunk(self) -> None:
        """The running batch lost a sequence: SGLang's code tries to admit again."""
        if self.ratio is not None:
            self.ratio.batch_full = False

    def _preempt(self, seq: Sequence, front: bool) -> int:
        lost = seq.num_computed
        if self.cache_preempted:  # a cache keeps it: what is recomputed is counted at the readmission
            seq.cached, lost = lost, 0
        elif self.kv.blocks.caching and seq.cacheable:  # likewise, past what the prefix cache gives back
            seq.preempted_tokens, lost = lost, 0
        self.running.remove(seq)
        self._shrunk()
        # where a prefix cache is kept (``KVCache.free``), its full blocks stay cached while no one takes them
        self.kv.cache(seq, own=True)
        self.kv.free(seq.block_table, owner=seq, kept=seq.cached // seq.block_size)
        self.requeue(seq, front)
        seq.record.preemptions += 1
        return lost

    def lose_all(self) -> list[Sequence]:
        """A crash: every held sequence (running or swapped) goes back to the front of the queue,
        oldest first, and waiting turns lose the blocks they took. The KV itself is reset by the
        caller. Returns the sequences that were held."""
        held = sorted(self.running + list(self.swapped), key=lambda q: q.admit_order)
        self.running, self.swapped = [], deque()
        self._shrunk()
        for seq in self.waiting:
            seq.block_table, seq.num_computed, seq.cached = [], 0, 0  # the process's prefix cache goes with it
            seq.preempted_tokens = 0
        for seq in reversed(held):
            self.requeue(seq)
            seq.cached = seq.preempted_tokens = 0
        return held

    def finish(self, seq: Sequence, now: float) -> None:
        """A finished sequence leaves: its blocks are freed, or kept by its session for the next turn."""
        seq.status = Status.FINISHED
        self.running.remove(seq)
        self._shrunk()
        if seq.request.session_id is None:
            self.kv.cache(seq)
            self.kv.free(seq.block_table)
        else:
            self.sessions.keep(seq, now)
        seq.block_table = []

    def evict(self, target_free: int, report: CopyReport) -> None:
        """Move idle session contexts (least recently used first), then the newest running
        sequences, to host memory until ``target_free`` blocks are free or the host is full;
        ``report`` counts what moved. ``DeviceOOM`` (a copy could not be made) stops it with the
        victim in place and what moved before it moved."""
        running = [q for q in self.running if q.block_table]
        for v in self.sessions.idle() + sorted(running, key=lambda q: -q.admit_order):
            if self.kv.blocks.num_free >= target_free:
                break
            n = len(v.block_table)
            if isinstance(v, Sequence):
                self.kv.cache(v)  # its blocks stay cached on the device while free
            try:
                host = self.kv.swap_out(v.block_table)
            except HostFull:
                break
            v.block_table, v.host_kv = [], host
            report.blocks += n
            report.bytes += n * self.kv.pool.block_bytes
            if isinstance(v, Sequence):
                self.running.remove(v)
                self._shrunk()
                v.status = Status.SWAPPED
                self.swapped.append(v)
                report.sequences += 1
            else:
                report.contexts += 1
