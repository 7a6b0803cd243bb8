"""Runs of decode iterations advanced at once, for the tensor-free engine: the same books, fewer steps.

Between events, a tensor-free engine's iterations are regular: every running sequence decodes one
token, nothing is admitted, and the clock moves by the cost model's duration for a batch whose
context grows by one token per sequence per iteration. ``decode_run`` finds the longest such run
from now and applies it in one go: the durations from the cost model over the whole run (the same
arithmetic, elementwise), the blocks each sequence needs at the iteration it crosses a block
boundary (allocated in the order the scheduler would, so the same block ids), the iteration log,
the counters, and the sequences that finish at the run's last iteration.

A run stops before anything an iteration-by-iteration engine would do differently: an arrival
due, a waiting request's client giving up (``client_timeout_s``), the caller's time limit, an
allocation that could fail (no free block, a pool segment the device cannot hold), an eviction of a
prefix cache's block that would cut the queue head's cached prefix short, a workspace the
device cannot hold, the iteration in which SGLang's falling ratio would admit the queue's head,
and it ends with the first iteration in which a sequence finishes (the next iteration may admit).
It starts only when nothing could be admitted now: the waiting queue is empty, or its head is held
back by the overcommit factor (or SGLang's rule), by ``max_num_seqs``, by free blocks with nothing
to reclaim, or by the admission headroom. Otherwise
(prefill chunks, swapped sequences, session turns, a restart) the engine steps one iteration.
``tests/test_decode_run.py`` checks the books are identical either way.
"""
from __future__ import annotations

import math

import numpy as np



LATCH = -2  # ``_admission_held``: held for the run, and the run's first iteration marks SGLang's batch full
RULE_LATER = -3  # held for the run after SGLang's code's rule, which each iteration checks first: it marks the
# batch full at the first iteration of the run whose sums refuse the head (``_sglang_first``)


def _admission_held(engine) -> int | None:
    """For how many iterations from now no waiting sequence can be admitted (until one finishes):
    None for as long as the run lasts, 0 when one may be admitted now. Under SGLang's rule the
    ratio falls every iteration, so the head may fit after a while: ``_sglang_held`` says when.
    Under SGLang's code a refusal for memory marks the batch full until it shrinks (``LATCH``: the
    run's first iteration would refuse the head and mark it; a finish, which ends the run, clears it)."""
    s, kv = engine.scheduler, engine.kv
    if not s.waiting:
        return None
    if s.ratio is not None and s.ratio.batch_full:
        return None  # nothing is tried until the running batch shrinks
    if any(q.request.session_id is not None or q.block_table for q in s.waiting):
        return 0  # session turns skip and reclaim: step them exactly
    if len(s.running) >= s.max_num_seqs:
        return None
    head = s.waiting[0]
    nothing_to_reclaim = not any(c.block_table and c.owner is None for c in engine.sessions.values())
    need, headroom = head.blocks_for(len(head)), engine.headroom_blocks()
    # the blocks admission takes now: the whole prompt's, or (vLLM v1) its first chunk's in what the decodes
    # leave, after what a prefix cache kept of a preempted head
    hits = kv.cached_prefix(head)  # a prefix cache's blocks it would take: those free come off the free count
    if s.prompt_chunks:
        start = max(s.admission_start(head), len(hits) * head.block_size)
        need_now = head.blocks_for(start + min(len(head) - start, s.max_num_batched_tokens - len(s.running)))
    else:
        need_now = need
    shared = s.shared_blocks(hits)  # no rule charges them
    need_now -= shared
    short = need_now > kv.blocks.num_free

    def below_headroom() -> bool:  # counting reclaimable blocks is the dearer test: asked last
        return bool(headroom) and kv.blocks.num_free + s.reclaimable_blocks() - need + shared < headroom

    if s.ratio is not None and s.ratio.full_new:  # the scheduler's order: budget, the rule, the headroom, the blocks
        if s.max_num_batched_tokens <= len(s.running):
            return None
        if s.sglang_over(s.sglang_books(), head, s.ratio.value, shared):
            return LATCH
        if not nothing_to_reclaim:
            return 0
        if short and not headroom:
            return LATCH
        return RULE_LATER if short or below_headroom() else 0
    if nothing_to_reclaim and short:
        return None  # free blocks only fall during the run
    if s.ratio is None and s.reserved_blocks() + head.peak_blocks - shared > engine.overcommit * kv.num_blocks:
        return None
    if below_headroom():  # idle contexts only go when reclaimed, which a run never does
        return None
    return 0 if s.ratio is None else -1  # SGLang's rule: counted over the run by ``_sglang_held``


def _sglang_held(engine, k: int) -> int:
    """How many of the next ``k`` iterations SGLang's rule holds the head back."""
    return _sglang_first(engine, k, over=False)


def _sglang_first(engine, k: int, over: bool) -> int:
    """The first of the next ``k`` iterations (0-based) in which SGLang's rule refuses the head
    (``over``) or admits it, ``k`` if none: at iteration j the running sequences hold j more tokens
    each, may generate j fewer, and the ratio has decayed j more times (the same sums, in the same
    arithmetic, as the scheduler's)."""
    s = engine.scheduler
    ratio, head = s.ratio, s.waiting[0]
    shared = s.shared_blocks(engine.kv.cached_prefix(head))  # running sequences hold them through the run
    held, _, _ = s.sglang_books()
    nd = len(s.running)
    remaining = np.array([q.request.max_tokens - q.num_generated for q in s.running], dtype=np.int64)
    value = ratio.value
    for j in range(k):
        future = int(np.minimum(remaining - j, ratio.clip).sum())
        if s.sglang_over((held + nd * j, future, 0), head, value, shared) == over:
            return j
        value = max(value - ratio.step, ratio.min)
    return k


def _eviction_matters(s, hits: list[int]) -> bool:
    """Whether evicting a cached free block of the head's prefix ``hits`` could change its admission:
    with prompt chunks, when more than one is free; and when a block running requests hold comes after
    a free one (``Scheduler.shared_blocks`` would count fewer once the free one is gone)."""
    free = np.flatnonzero(s.kv.blocks.ref_counts[hits] == 0) if hits else np.empty(0, dtype=np.int64)
    if s.prompt_chunks and free.size > 1:
        return True
    return bool(free.size) and len(hits) - free.size > free[0]  # a block in use past the first free one


def _decode_books(running, block_size: int, max_model_len: int) -> tuple[list[int], list[int], int] | None:
    """What a run needs of each running sequence, read in one pass: the iteration in which it
    produces its last token, the first iteration past its block table, and the tokens computed
    in all. None when one is not decoding (a prefill chunk, or its first token still to come):
    the engine steps that iteration exactly."""
    finish, first, computed = [], [], 0
    for q in running:
        length, done = len(q.token_ids), q.num_computed
        if length - done > 1 or q.record.first_token_s is None:
            return None
        finish.append(min(q.stop_at - q.num_generated, max_model_len - length))
        first.append(len(q.block_table) * block_size - done + 1)
        computed += done
    return finish, first, computed


def decode_run(engine, until: float | None) -> int:
    """Advance a run of decode iterations (see the module docstring); how many (0: step exactly)."""
    s, kv, pool, dev = engine.scheduler, engine.kv, engine.pool, engine.device
    running = s.running
    if (engine.down_until is not None or not running or s.swapped or pool.materialize
            or not hasattr(engine.executor.cost, "iterations_s")
            or (s.ratio is not None and s.ratio.set_by_retract)):  # its next decode does not decay: step it
        return 0
    nxt = s.next_arrival()
    if nxt is not None and nxt <= engine.clock:
        return 0
    bs = engine.config.block_size
    books = _decode_books(running, bs, engine.max_model_len)
    if books is None:
        return 0
    admission = _admission_held(engine)
    if admission == 0:
        return 0
    finish, first, base = books  # iterations until each sequence finishes, the first past its table
    nd = len(running)
    horizon = min(finish)
    if horizon < 1:
        return 0
    j = np.arange(1, horizon + 1, dtype=np.int64)
    context = base + nd * j
    cost = engine.executor.cost
    window = getattr(cost, "window", None)  # a cost model of one's own may have none
    if window is None:
        durations = cost.iterations_s(nd, context, context)
    elif getattr(cost, "window_chunked", False):  # a chunked layer's decode at iteration j reads its chunk's keys
        done = np.array([q.num_computed for q in running], dtype=np.int64)  # up to its own, at done + j - 1
        seen = ((done[None, :] + j[:, None] - 1) % window + 1).sum(axis=1)
        durations = cost.iterations_s(nd, context, context, seen, seen)
    else:  # a windowed layer's decode at iteration j reads min(its context, the window) keys: summed
        # over the sequences, those still short of the window (done + j < window) give done + j each
        done = np.sort(np.array([q.num_computed for q in running], dtype=np.int64))
        below = np.searchsorted(done, window - j, side="left")
        seen = np.concatenate(([0], np.cumsum(done)))[below] + below * j + (nd - below) * window
        durations = cost.iterations_s(nd, context, context, seen, seen)
    times = np.add.accumulate(np.concatenate(([engine.clock], durations)))  # iteration j starts at times[j - 1]
    ends = times[1:]
    timeout = engine.config.client_timeout_s  # a client giving up changes the queue: step that iteration
    gone = s.next_abandonment(timeout) if timeout is not None else None
    limit = min(x for x in (until, nxt, gone, math.inf) if x is not None)
    k = int(np.searchsorted(times[:-1], limit, side="left"))  # iterations that start before the limit
    k = min(k, horizon)
    if admission == -1:
        k = _sglang_held(engine, k)
    if k < 1:
        return 0
    # the blocks each sequence needs, at the iteration it needs them, in the scheduler's order
    needs: list[tuple[int, int]] = []  # (iteration, position in running)
    for i, f in enumerate(first):
        if f <= k:
            needs += [(jj, i) for jj in range(max(f, 1), k + 1, bs)]
    needs.sort()
    # with a prefix cache, an eviction that cuts the head's cached prefix short may change what it is charged,
    # so the run ends before it: a head taking its prompt chunk by chunk needs its chunk's blocks and the
    # cached free ones it would take (one eviction may drop several of those and let it in), and the blocks
    # of its prefix running requests hold past a free one go uncharged only while that one stays cached
    if s.waiting and kv.blocks.evictable:
        unkeyed = kv.blocks.num_free - len(kv.blocks.evictable)  # allocations before the first eviction
        if unkeyed < len(needs) and needs[unkeyed][0] <= k and _eviction_matters(s, kv.cached_prefix(s.waiting[0])):
            k = needs[unkeyed][0] - 1
    # blocks come lowest id first: the free ones below the pool's held segments, then (the pool
    # growing a segment at a time) the ones above, in order, and a prefix cache's free blocks last
    free_blocks, held, free_bytes = kv.blocks.num_free, pool.held_blocks, dev.free
    below = held - kv.blocks.num_used - len(kv.blocks.evictable)
    grown, segment = 0, pool.segment_blocks  # grown: blocks the pool adds
    growth = np.zeros(k, dtype=np.int64)  # device bytes the pool grows by, by iteration
    for n, (jj, _) in enumerate(needs):
        if jj > k:
            break
        if n >= free_blocks:
            k = jj - 1
            break
        block = held + n - below
        if n >= below and block >= held + grown:
            top = min((block // segment + 1) * segment, pool.num_blocks)
            extra = (top - held - grown) * pool.block_bytes
            if extra > free_bytes - grown * pool.block_bytes:  # the device cannot hold the segment
                k = jj - 1
                break
            growth[jj - 1] += extra
            grown = top - held
    if k < 1:
        return 0
    # each iteration's workspace must fit what the device has free then; the workspace grows and
    # the free bytes fall over the run, so when the last iteration's fits, every one's does
    if engine.model_config.workspace_bytes(nd, int(context[k - 1])) > free_bytes - int(growth[:k].sum()):
        workspace = engine.model_config.workspace_bytes(nd, context[:k])
        over = np.flatnonzero(workspace > free_bytes - np.cumsum(growth[:k]))
        if over.size:
            k = int(over[0])
            if k < 1:
                return 0
    if admission == LATCH or (admission == RULE_LATER and _sglang_first(engine, k, over=True) < k):
        s.ratio.batch_full = True  # as the iteration that refuses the head marks it; a finish in the last clears it
    _apply(engine, k, needs, durations[:k], ends[:k], nd, finish)
    return k


def _apply(engine, k: int, needs: list[tuple[int, int]], durations, ends, nd: int, finish: list[int]) -> None:
    """Make the books say ``k`` decode iterations ran."""
    kv = engine.kv
    running = list(engine.scheduler.running)
    events = [(jj, i) for jj, i in needs if jj <= k]
    used = kv.blocks.num_used
    if events:  # one allocation for the run: the same ids, lowest first, in the scheduler's order
        for (_, i), block in zip(events, kv.allocate(len(events))):
            running[i].block_table.append(block)
    # blocks in use after each iteration: those held before plus the run's allocations so far
    usage = used + np.searchsorted(np.array([jj for jj, _ in events], dtype=np.int64), np.arange(1, k + 1), side="right")
    tokens = [0] * k  # a tensor-free engine's tokens
    for q in running:
        q.token_ids.extend(tokens)
        q.num_computed += k
        q.num_generated += k
    if engine.scheduler.ratio is not None:
        for _ in range(k):  # one decay per decode iteration, as the engine steps them
            engine.scheduler.ratio.decay()
    c = engine.counters
    c.iterations += k
    c.tokens_generated += nd * k
    engine.clock = float(ends[-1])
    for q, f in zip(running, finish):
        if f == k:
            engine._finish(q)
    usage = usage / kv.num_blocks
    usage[-1] = kv.blocks.usage()  # the last iteration's, after the sequences that finished in it left
    engine.iterations.extend(end_s=ends, duration_s=durations, decode_tokens=nd, prefill_tokens=0, alloc_ratio=usage,
                             generated=nd)
