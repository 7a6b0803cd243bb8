"""Invariants of the KV memory model under random operation sequences.

The block books (reference counts, free list), the pool's real tensors and the device ledger must
agree after every allocation, share, free, swap and compaction; KV contents must survive swaps and
compaction bit for bit; and an engine pushed around by compaction and eviction must finish every
request with the same tokens as an engine left alone.
"""
from __future__ import annotations

import math
from collections import Counter
from contextlib import contextmanager
from unittest import mock

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from engine.block_manager import OutOfBlocks
from engine.config import EngineConfig, ModelConfig
from engine.device import Device, DeviceOOM
from engine.engine import Engine
from engine.kv_cache import HostFull, KVCache, NeedBlocks
from engine.kv_pool import KVPool
from engine.sequence import Status
from engine.request import Request

TINY = ModelConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_layers=2, num_heads=2, num_kv_heads=1)
BLOCK_SIZE = 4
SEGMENT_BLOCKS = 8
BLOCK_BYTES = TINY.kv_bytes_per_token() * BLOCK_SIZE

seeds = st.integers(0, 2**31 - 1)
picks = st.integers(0, 1_000)  # which holder a rule acts on, modulo how many there are


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


# ---- the KV cache on its own -------------------------------------------------------------------
class KVCacheMachine(RuleBasedStateMachine):
    """Holders ("sequences") own block tables; the model keeps what each one's blocks must contain."""

    def __init__(self) -> None:
        super().__init__()
        self.tables: dict[int, list[int]] = {}  # holder -> block table on the device
        self.expected: dict[int, torch.Tensor] = {}  # holder -> its blocks' contents, [n, *block_shape]
        self.on_host: dict[int, torch.Tensor] = {}  # holder -> the host copy swap_out returned
        self.next_holder = 0

    @initialize(num_blocks=st.sampled_from([32, 44, 48]), host_blocks=st.integers(2, 16))
    def build(self, num_blocks: int, host_blocks: int) -> None:
        # 44 blocks leave a short last segment; the device could hold the pool twice over
        self.device = Device(2 * num_blocks * BLOCK_BYTES)
        self.pool = KVPool(TINY, BLOCK_SIZE, num_blocks, SEGMENT_BLOCKS, self.device)
        self.kv = KVCache(self.pool, host_blocks * BLOCK_BYTES)

    # ---- helpers ---------------------------------------------------------------------------------
    def _pick(self, holders: dict, i: int) -> int:
        return sorted(holders)[i % len(holders)]

    def _random_blocks(self, n: int, seed: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(seed)
        return torch.randn((n,) + self.pool.block_shape, generator=g, dtype=self.pool.dtype)

    def _write(self, ids: list[int], seed: int) -> torch.Tensor:
        """Fill ``ids`` with fresh data and update every holder that shares one of them."""
        data = self._random_blocks(len(ids), seed)
        self.pool.write_blocks(ids, data)
        where = {b: i for i, b in enumerate(ids)}
        for h, table in self.tables.items():
            for j, b in enumerate(table):
                if b in where:
                    self.expected[h][j] = data[where[b]]
        return data.clone()

    def _allocate(self, n: int) -> list[int] | None:
        rc_before = self.kv.blocks.ref_counts.copy()
        free_before = np.flatnonzero(rc_before == 0)
        try:
            ids = self.kv.allocate(n)
        except NeedBlocks as exc:
            np.testing.assert_array_equal(self.kv.blocks.ref_counts, rc_before)  # all or nothing
            assert self.kv.blocks.num_free == len(free_before)
            if isinstance(exc.cause, OutOfBlocks):
                assert n > len(free_before)
                event("allocate: out of blocks")
            else:
                assert isinstance(exc.cause, DeviceOOM) and n <= len(free_before)
                event("allocate: device OOM")
            return None
        assert ids == free_before[:n].tolist()  # lowest free first
        return ids

    # ---- rules -----------------------------------------------------------------------------------
    @rule(n=st.integers(1, 12), seed=seeds)
    def allocate(self, n: int, seed: int) -> None:
        ids = self._allocate(n)
        if ids is None:
            return
        h, self.next_holder = self.next_holder, self.next_holder + 1
        self.tables[h] = ids
        self.expected[h] = torch.empty((n,) + self.pool.block_shape, dtype=self.pool.dtype)
        self._write(ids, seed)

    @precondition(lambda self: self.tables)
    @rule(i=picks, n=st.integers(1, 6), seed=seeds)
    def grow(self, i: int, n: int, seed: int) -> None:
        h = self._pick(self.tables, i)
        ids = self._allocate(n)
        if ids is None:
            return
        self.tables[h] = self.tables[h] + ids
        self.expected[h] = torch.cat([self.expected[h], self._random_blocks(n, 0)])
        self._write(ids, seed)

    @precondition(lambda self: self.tables)
    @rule(i=picks, seed=seeds)
    def rewrite(self, i: int, seed: int) -> None:
        """Writing through one holder is seen by every holder sharing the blocks."""
        self._write(self.tables[self._pick(self.tables, i)], seed)

    @precondition(lambda self: self.tables)
    @rule(i=picks)
    def free(self, i: int) -> None:
        h = self._pick(self.tables, i)
        self.kv.free(self.tables.pop(h))
        del self.expected[h]

    @precondition(lambda self: self.tables)
    @rule(i=picks)
    def share(self, i: int) -> None:
        source = self._pick(self.tables, i)
        self.kv.blocks.share(self.tables[source])
        h, self.next_holder = self.next_holder, self.next_holder + 1
        self.tables[h] = list(self.tables[source])
        self.expected[h] = self.expected[source].clone()
        event("share")

    @precondition(lambda self: self.tables)
    @rule(i=picks)
    def swap_out(self, i: int) -> None:
        h = self._pick(self.tables, i)
        table, host = self.tables[h], self.kv.host
        used, rc_before, out_blocks = host.used, self.kv.blocks.ref_counts.copy(), self.kv.traffic.out_blocks
        try:
            copy = self.kv.swap_out(table)
        except HostFull:
            assert used + len(table) * BLOCK_BYTES > host.capacity
            assert host.used == used  # nothing moved
            np.testing.assert_array_equal(self.kv.blocks.ref_counts, rc_before)
            event("swap_out: host full")
            return
        assert torch.equal(copy, self.expected[h])
        assert host.used == used + len(table) * BLOCK_BYTES
        assert self.kv.traffic.out_blocks == out_blocks + len(table)
        del self.tables[h]
        self.on_host[h] = copy

    @precondition(lambda self: self.on_host)
    @rule(i=picks)
    def swap_in(self, i: int) -> None:
        h = self._pick(self.on_host, i)
        copy, host = self.on_host[h], self.kv.host
        used, rc_before = host.used, self.kv.blocks.ref_counts.copy()
        try:
            ids = self.kv.swap_in(copy)
        except NeedBlocks:
            assert host.used == used  # the copy stays on the host
            np.testing.assert_array_equal(self.kv.blocks.ref_counts, rc_before)
            event("swap_in: no blocks")
            return
        assert torch.equal(self.pool.read_blocks(ids), self.expected[h])  # the round trip is bit-identical
        assert host.used == used - nbytes(copy)
        assert all(rc_before[b] == 0 for b in ids)
        self.tables[h] = ids
        event("swap_in: round trip")
        del self.on_host[h]

    @rule()
    def compact(self) -> None:
        blocks = self.kv.blocks
        rc_before, footprint_before = blocks.ref_counts.copy(), self.pool.footprint_bytes()
        used = blocks.num_used
        moves = self.kv.compact()
        for src, dst in moves.items():
            assert rc_before[src] > 0 and rc_before[dst] == 0 and dst < src
        # only blocks above the packed prefix move, each once
        assert len(moves) == int(np.count_nonzero(rc_before[used:]))
        self.tables = {h: [moves.get(b, b) for b in t] for h, t in self.tables.items()}

        assert blocks.holes() == 0
        assert np.flatnonzero(blocks.ref_counts).tolist() == list(range(used))
        # every whole segment above the packed prefix went back to the device
        packed = min(math.ceil(used / SEGMENT_BLOCKS) * SEGMENT_BLOCKS, self.pool.num_blocks) * BLOCK_BYTES
        footprint = self.pool.footprint_bytes()
        assert footprint == packed <= footprint_before
        if footprint_before > packed:
            assert footprint < footprint_before
            event("compact: tail released")
        # contents are checked by the invariant below, against tables rewritten through the moves

    @rule()
    def crash(self) -> None:
        """A restart loses every block and host copy and gives the whole pool back."""
        self.kv.reset()
        self.tables, self.expected, self.on_host = {}, {}, {}
        assert self.kv.blocks.num_used == 0 and self.pool.footprint_bytes() == 0 and self.kv.host.used == 0

    @rule(spare_segments=st.integers(0, 2))
    def squeeze_device(self, spare_segments: int) -> None:
        """Another tenant takes all but a few segments' worth of the device."""
        ours = self.device.used - self.device.charged["tenants"]
        spare = spare_segments * SEGMENT_BLOCKS * BLOCK_BYTES
        self.device.set_tenants(max(self.device.capacity - ours - spare, 0))

    @rule()
    def unsqueeze_device(self) -> None:
        self.device.set_tenants(0)

    # ---- invariants ------------------------------------------------------------------------------
    @invariant()
    def every_block_has_exactly_its_holders(self) -> None:
        blocks = self.kv.blocks
        rc = blocks.ref_counts
        holders = Counter(b for t in self.tables.values() for b in t)
        assert (rc >= 0).all()
        assert {int(b): int(rc[b]) for b in np.flatnonzero(rc)} == dict(holders)
        assert all(len(set(t)) == len(t) for t in self.tables.values())
        assert blocks.num_used + blocks.num_free == blocks.num_blocks
        assert blocks.num_used == int(np.count_nonzero(rc))

    @invariant()
    def tables_point_into_held_segments(self) -> None:
        assert all(0 <= b < self.pool.held_blocks for t in self.tables.values() for b in t)

    @invariant()
    def ledgers_match_what_is_held(self) -> None:
        assert self.device.charged["kv"] == self.pool.footprint_bytes()
        assert sum(nbytes(s) for s in self.pool.segments) == self.pool.footprint_bytes()
        assert self.kv.host.used == sum(nbytes(c) for c in self.on_host.values()) <= self.kv.host.capacity

    @invariant()
    def contents_are_what_was_written(self) -> None:
        for h, table in self.tables.items():
            assert torch.equal(self.pool.read_blocks(table), self.expected[h]), f"holder {h}"

    @invariant()
    def fragmentation_measures_describe_the_block_map(self) -> None:
        blocks = self.kv.blocks
        runs, run = [], 0  # maximal runs of free blocks, read off the block map one block at a time
        for free in (blocks.ref_counts == 0).tolist() + [False]:
            if free:
                run += 1
            elif run:
                runs, run = runs + [run], 0
        assert blocks.free_runs() == runs
        assert sum(runs) == blocks.num_free
        top = blocks.highest_used()
        assert blocks.holes() == sum(1 for b in range(max(top, 0)) if blocks.ref_counts[b] == 0)

        entropy, total = blocks.frag_entropy(), sum(runs)
        assert 0.0 <= entropy <= 1.0
        if len(runs) <= 1:
            assert entropy == 0.0
        else:  # Shannon entropy of the run lengths, normalised so that all single holes give 1
            shannon = -sum(r / total * math.log(r / total) for r in runs)
            assert entropy == pytest.approx(shannon / math.log(total))
            if all(r == 1 for r in runs):
                assert entropy == pytest.approx(1.0)


KVCacheMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=50, deadline=None)
TestKVCache = KVCacheMachine.TestCase


# ---- the engine under compaction and eviction ------------------------------------------------
def build_engine(**kw) -> Engine:
    return Engine(TINY, EngineConfig(block_size=BLOCK_SIZE, segment_blocks=4, **kw), keep_outputs=True)


@contextmanager
def noise_in_fresh_segments(seed: int):
    """Fill every segment a pool takes with finite noise, seeded per engine.

    Decodes gather whole blocks and mask the slots nobody wrote yet; freed blocks keep their old
    data when reused. Finite noise that differs between two engines catches any unmasked read of
    such a slot, since the two would then generate different tokens.
    """
    ensure = KVPool.ensure
    gen = torch.Generator().manual_seed(seed)

    def noisy_ensure(pool: KVPool, block_id: int) -> None:
        held = pool.num_segments
        try:
            ensure(pool, block_id)
        finally:
            for seg in pool.segments[held:]:
                if seg is not None:
                    seg.copy_(torch.randn(seg.shape, generator=gen, dtype=seg.dtype))

    with mock.patch.object(KVPool, "ensure", noisy_ensure):
        yield


@contextmanager
def one_thread():
    """The tiny model's attention is ~10x faster on one CPU thread than on two (thread overhead)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def drive(eng: Engine, requests: list[Request], perturbations: list, noise_seed: int) -> Engine:
    """Submit ``requests``, run them all to the end with ``perturbations`` between the first steps."""
    with noise_in_fresh_segments(noise_seed), one_thread():
        for r in requests:
            eng.submit(r)
        run_to_end(eng, perturbations)
    assert_all_finished(eng, requests)
    return eng


def check_engine_books(eng: Engine) -> None:
    """Every block table the engine holds accounts for exactly the blocks in use; ledgers agree."""
    s = eng.scheduler
    holders = [q.block_table for q in s.running + list(s.waiting) + list(s.swapped)]
    holders += [c.block_table for c in eng.sessions.values()]
    counts = Counter(b for t in holders for b in t)
    rc = eng.kv.blocks.ref_counts
    assert {int(b): int(rc[b]) for b in np.flatnonzero(rc)} == dict(counts)
    assert eng.kv.blocks.num_shared == sum(c - 1 for c in counts.values())
    assert all(b < eng.pool.held_blocks for b in counts)
    assert all(not q.block_table for q in s.swapped)
    assert eng.device.charged["kv"] == eng.pool.footprint_bytes()
    on_host = [q.host_kv for q in s.swapped] + [c.host_kv for c in eng.sessions.values() if c.host_kv is not None]
    assert eng.kv.host.used == sum(nbytes(h) for h in on_host)


def perturb(eng: Engine, action) -> None:
    """One controller action between steps: compact, or evict to a free share."""
    if action == "compact":
        eng.compact()
        assert eng.kv.blocks.holes() == 0
        event("engine: compact")
    elif action is not None:
        before = eng.kv.traffic.out_blocks
        report = eng.evict(action)
        assert eng.kv.traffic.out_blocks == before + report.blocks
        if report.blocks:
            event("engine: evicted")


def run_to_end(eng: Engine, actions: list, max_iterations: int = 3000) -> None:
    for action in actions:
        perturb(eng, action)
        check_engine_books(eng)
        if not eng.step():
            break
        check_engine_books(eng)
    for _ in range(max_iterations):
        if not eng.step():
            break
        check_engine_books(eng)
    assert not eng.has_work(), "the engine stopped making progress"


def assert_all_finished(eng: Engine, requests: list[Request]) -> None:
    for r in requests:
        rec = eng.records[r.request_id]
        assert rec.finish_s is not None, r.request_id
        assert rec.output_len == min(r.output_len, r.max_tokens), r.request_id
        assert len(eng.outputs[r.request_id]) == rec.output_len


def arrivals(draw, n: int) -> list[float]:
    """Nondecreasing arrival times, so submission order is arrival order."""
    gaps = draw(st.lists(st.sampled_from([0.0, 0.0, 0.002]), min_size=n, max_size=n))
    return np.cumsum(gaps).tolist()


# between steps: evict to a free share (simplest: evict all it can), compact, or nothing
actions = st.lists(st.one_of(st.floats(0.0, 1.0).map(lambda f: 1.0 - f), st.just("compact"), st.none()),
                   min_size=4, max_size=40)


@st.composite
def tight_workloads(draw):
    """A pool too small for everything at once; each request fits on its own."""
    num_blocks = draw(st.integers(6, 12))
    room = (num_blocks - 1) * BLOCK_SIZE  # one block spare, so a swapped sequence can always return
    n = draw(st.integers(3, 6))
    shapes = []
    for _ in range(n):  # the simplest draw fills a third of the pool and grows to all of it
        prompt = draw(st.integers(room // 3, room - 1))
        max_tokens = room - prompt - draw(st.integers(0, room - prompt - 1))
        output_len = max_tokens + draw(st.integers(-(max_tokens // 2), 4))  # stops early, or at max_tokens
        shapes.append((prompt, output_len, max_tokens))
    order = draw(st.permutations(range(n)))
    times = arrivals(draw, n)
    requests = [Request(f"r{i}", t, *shapes[i]) for i, t in zip(order, times)]
    config = dict(num_blocks=num_blocks, oom_mode=draw(st.sampled_from(["crash", "preempt"])),
                  overcommit=draw(st.sampled_from([2.0, math.inf, 1.5, 1.0])),
                  host_bytes=draw(st.sampled_from([num_blocks, num_blocks // 2, 2, 0])) * BLOCK_BYTES,
                  restart_downtime_s=0.5)
    return config, requests, draw(actions)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(tight_workloads())
def test_compaction_and_eviction_finish_every_request_with_the_same_tokens(workload):
    config, requests, perturbations = workload
    eng = drive(build_engine(**config), requests, perturbations, noise_seed=1)
    assert eng.kv.blocks.num_used == 0 and eng.kv.host.used == 0
    assert eng.kv.traffic.in_blocks <= eng.kv.traffic.out_blocks
    eng.compact()  # with nothing in use, the whole pool goes back to the device
    assert eng.pool.footprint_bytes() == 0 and eng.device.charged["kv"] == 0
    if eng.counters.oom_events:
        event("engine: crash")
    if eng.counters.preemptions:
        event("engine: preempt")

    ref = drive(build_engine(**config), requests, [], noise_seed=2)
    assert eng.outputs == ref.outputs


LAST_TURN = 3  # prompt and output tokens of the turn each session gets after the workload


@st.composite
def session_workloads(draw):
    """Multi-turn sessions and single requests in a pool that holds all of them at once, so that
    only compaction and eviction move their KV; turns of a session arrive in order."""
    sessions = [[(draw(st.integers(1, 10)), draw(st.integers(1, 8)), draw(st.integers(1, 8)))
                 for _ in range(draw(st.integers(2, 3)))] for _ in range(draw(st.integers(1, 3)))]
    singles = [(draw(st.integers(1, 10)), draw(st.integers(1, 8)), draw(st.integers(1, 8)))
               for _ in range(draw(st.integers(0, 2)))]
    # every session's whole history, its last turn included (LAST_TURN tokens), fits at once
    need = sum(math.ceil((sum(p + m for p, _, m in turns) + 2 * LAST_TURN) / BLOCK_SIZE) for turns in sessions)
    need += sum(math.ceil((p + m) / BLOCK_SIZE) for p, _, m in singles)
    # who comes next: a session (its next turn) or a single request
    queue = [("s", k) for k, turns in enumerate(sessions) for _ in turns] + [("x", j) for j in range(len(singles))]
    queue = draw(st.permutations(queue))
    times, turn_of = arrivals(draw, len(queue)), Counter()
    requests = []
    for (kind, k), t in zip(queue, times):
        if kind == "s":
            shape, turn_of[k] = sessions[k][turn_of[k]], turn_of[k] + 1
            requests.append(Request(f"s{k}t{turn_of[k]}", t, *shape, session_id=f"s{k}"))
        else:
            requests.append(Request(f"x{k}", t, *singles[k]))
    config = dict(num_blocks=need + 2, overcommit=draw(st.sampled_from([1.0, 2.0])),
                  host_bytes=draw(st.sampled_from([need, need // 2, 2])) * BLOCK_BYTES)
    return config, requests, draw(actions)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(session_workloads())
def test_session_contexts_survive_compaction_and_eviction(workload):
    config, requests, perturbations = workload
    eng = drive(build_engine(**config), requests, perturbations, noise_seed=1)
    contexts = eng.sessions.values()
    assert eng.kv.blocks.num_used == sum(len(c.block_table) for c in contexts)  # only idle contexts hold blocks
    assert eng.kv.host.used == sum(nbytes(c.host_kv) for c in contexts if c.host_kv is not None)
    assert not any(c.owner for c in contexts)
    ref = drive(build_engine(**config), requests, [], noise_seed=2)
    assert eng.outputs == ref.outputs

    # one more turn per session, after a compaction and an eviction that move the idle contexts
    last_turns = [Request(f"{sid}-last", 0.0, LAST_TURN, LAST_TURN, LAST_TURN, session_id=sid)
                  for sid in sorted(eng.sessions)]
    drive(eng, last_turns, ["compact", 1.0, "compact"], noise_seed=3)
    drive(ref, last_turns, [], noise_seed=4)
    if eng.counters.contexts_swapped_in:
        event("engine: context swapped in")
    assert eng.outputs == ref.outputs


# ---- engine bugs found by the tests above, pinned ----------------------------------------------------------------
def test_a_session_turn_whose_prompt_blocks_are_not_free_yet_is_admitted_later():
    eng = build_engine(num_blocks=8, overcommit=2.0)
    eng.submit(Request("a", 0.0, 20, 8, 8))  # 5 of the 8 blocks
    eng.submit(Request("s1", 0.0, 16, 2, 2, session_id="S"))  # needs 4 blocks: 3 are free until "a" ends
    eng.run(max_iterations=2000)
    assert eng.records["a"].finish_s is not None
    assert eng.records["s1"].finish_s is not None


def test_a_swapped_sequence_returns_when_only_an_idle_context_holds_its_blocks():
    eng = build_engine(num_blocks=16, overcommit=2.0)
    eng.submit(Request("t", 0.0, 28, 16, 16, session_id="S"))  # 7 blocks now, 11 as an idle context
    eng.submit(Request("x", 0.0, 24, 8, 8))  # 6 blocks
    eng.step()
    assert [q.id for q in eng.scheduler.running] == ["t", "x"]
    eng.evict((eng.kv.blocks.num_free + 6) / eng.kv.num_blocks)  # the newest running sequence: x
    assert eng.records["x"].finish_s is None and eng.scheduler.swapped[0].status is Status.SWAPPED
    eng.run(max_iterations=3000)
    assert eng.records["t"].finish_s is not None
    assert eng.records["x"].finish_s is not None


def test_copy_blocks_splits_runs_at_segment_boundaries():
    # consecutive moves whose sources or destinations cross from one segment into the next
    pool = KVPool(TINY, BLOCK_SIZE, 32, 4, Device(64 * BLOCK_BYTES))
    pool.ensure(31)
    ids = list(range(32))
    data = torch.randn((32,) + pool.block_shape, generator=torch.Generator().manual_seed(0))
    pool.write_blocks(ids, data)
    moves = [(10, 2), (11, 3), (12, 4), (13, 5), (21, 6), (22, 7), (23, 8), (30, 14), (31, 15)]
    pool.copy_blocks(moves)
    expected = data.clone()
    for src, dst in moves:
        expected[dst] = data[src]
    assert torch.equal(pool.read_blocks(ids), expected)


@pytest.mark.parametrize("holes", [5, 12, 13, 18])
def test_all_single_holes_give_an_entropy_of_exactly_one(holes):
    """With these counts of single holes the normalised entropy rounds to 1 + 1e-16; a sidecar
    refuses a snapshot ratio past 1, so the engine must report 1."""
    from engine.block_manager import BlockManager

    blocks = BlockManager(2 * holes + 1)
    ids = blocks.allocate(2 * holes + 1)
    blocks.free(ids[1::2])
    assert blocks.free_runs() == [1] * holes and blocks.frag_entropy() == 1.0
