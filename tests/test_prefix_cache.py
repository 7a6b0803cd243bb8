"""A prefix cache (``EngineConfig.prefix_caching``), as vLLM's and SGLang's: a request takes the KV
blocks another computed of the same first tokens, shared while both run and kept while free until
the memory is needed; the tokens generated are those of an engine without it."""
from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from test_kv_invariants import BLOCK_SIZE, TINY, actions, arrivals, build_engine, check_engine_books, drive

from engine.block_manager import BlockManager
from engine.config import EngineConfig, ModelConfig
from engine.engine import Engine
from engine.executor import ProfiledExecutor
from engine.kv_cache import NeedBlocks
from engine.metrics import summarize
from engine.request import Request, RequestError
from env.workloads.replay import ReplaySpec, build_requests
from env.workloads.traces import bundled_trace, read_trace
from test_decode_run import COST, log


# ---- the books ---------------------------------------------------------------------------------
def test_unkeyed_blocks_below_the_pool_go_first_then_cached_ones_least_recently_freed_then_the_pool_grows():
    bm = BlockManager(12, caching=True)
    first = bm.allocate(4, held=8)
    assert first == [0, 1, 2, 3]
    bm.cache(0, "k0")
    bm.cache(1, "k1")
    bm.cache(1, "other")  # a block keeps its first key
    bm.cache(2, "k0")  # a key keeps its first block
    assert bm.lookup("k0") == 0 and bm.lookup("other") is None and bm.key_of == {0: "k0", 1: "k1"}
    bm.free(first)  # cached blocks stay cached while free, the table's last first in line to go
    assert bm.num_free == 12 and list(bm.evictable) == [1, 0]
    assert bm.allocate(6, held=8) == [2, 3, 4, 5, 6, 7]
    assert bm.lookup("k0") == 0 and bm.lookup("k1") == 1
    assert bm.allocate(1, held=8) == [1] and bm.lookup("k1") is None  # evicted: its key forgotten
    assert bm.allocate(2, held=8) == [0, 8]  # the last cached block, then one above the pool's segments
    assert not bm.key_of and not bm.block_of and bm.num_free == 3


def test_a_cached_block_is_claimed_in_use_or_free_and_compaction_keeps_the_keys_of_blocks_in_use():
    bm = BlockManager(8, caching=True)
    ids = bm.allocate(4)
    for b in ids:
        bm.cache(b, f"k{b}")
    bm.free([0, 1])
    assert list(bm.evictable) == [1, 0] and bm.num_used == 2
    bm.claim([0, 2])  # one free (it leaves the free list), one in use (shared)
    assert bm.num_used == 3 and list(bm.evictable) == [1] and bm.ref_counts[2] == 2 and bm.ref_counts[0] == 1
    bm.free([0, 2, 3])
    assert list(bm.evictable) == [1, 3, 0] and bm.ref_counts[2] == 1
    bm.drop_cached()  # what compaction does first: free cached blocks become plain free memory
    assert bm.key_of == {2: "k2"} and not bm.evictable and bm.num_free == 7
    bm.apply_moves(bm.compaction_plan())
    assert bm.key_of == {0: "k2"} and bm.lookup("k2") == 0 and bm.ref_counts[0] == 1
    assert bm.allocate(7) == [1, 2, 3, 4, 5, 6, 7]


def test_an_allocation_the_device_cannot_hold_takes_nothing_neither_cached_blocks_nor_pool_growth():
    # found by review: a refused allocation grew the pool, and one the device could not hold emptied the cache
    eng = Engine(ModelConfig(), EngineConfig(num_blocks=64, block_size=16, segment_blocks=4, prefix_caching=True),
                 executor=ProfiledExecutor(COST))
    kv = eng.kv
    ids = kv.allocate(8)  # the pool holds two segments
    for j, b in enumerate(ids[:4]):
        kv.blocks.cache(b, ("k", j))
    kv.free(ids)  # 0..3 cached and free, 4..7 plain free
    assert kv.allocate(4) == [4, 5, 6, 7] and eng.pool.held_blocks == 8  # unkeyed blocks first: no growth
    eng.device.set_tenants(eng.device.free)  # the device cannot grow the pool
    with pytest.raises(NeedBlocks):
        kv.allocate(8)  # the four cached blocks and four above the pool: cannot be had
    with pytest.raises(NeedBlocks):
        kv.allocate(70)  # more than the pool's blocks
    assert list(kv.blocks.evictable) == [3, 2, 1, 0] and len(kv.blocks.block_of) == 4 and eng.pool.held_blocks == 8
    assert kv.allocate(2) == [3, 2] and kv.blocks.lookup(("k", 3)) is None  # cached ones go, least recently freed
    eng.device.set_tenants(0)
    assert kv.allocate(3) == [8, 9, 10] and list(kv.blocks.evictable) == [1, 0]  # the pool grows before they go


def test_a_head_short_of_blocks_with_cached_blocks_keeps_the_same_books_fast_and_stepped():
    # found by review: stepping claimed and freed the head's cached blocks each iteration it was refused,
    # which the fast path does not, and the two then evicted different blocks
    prompt = tuple(i % 500 for i in range(7, 167))  # 10 blocks

    def run(fast: bool) -> Engine:
        cfg = EngineConfig(num_blocks=40, block_size=16, segment_blocks=4, max_model_len=640, max_num_batched_tokens=2048,
                           overcommit=math.inf, overcommit_max=math.inf, prefix_caching=True)
        eng = Engine(ModelConfig(), cfg, executor=ProfiledExecutor(COST), fast_forward=fast)
        eng.submit(Request("X", 0.0, 160, 1, 1, prompt_ids=prompt))
        eng.submit(Request("R2", 1.0, 320, 200, 200))
        eng.submit(Request("R1", 1.0, 80, 60, 60))
        eng.submit(Request("H", 1.05, 360, 5, 5, prompt_ids=prompt + tuple((i * 7) % 500 for i in range(200))))
        eng.run()
        return eng

    stepped, fast = run(False), run(True)
    assert summarize(stepped) == summarize(fast) and stepped.counters == fast.counters
    assert log(stepped) == log(fast) and stepped.kv.prefix_hit_tokens == fast.kv.prefix_hit_tokens


def test_a_head_taking_its_prompt_by_chunks_keeps_the_same_books_fast_and_stepped_when_an_eviction_lets_it_in():
    # found by review: its need counts the free cached blocks it would take, and one eviction dropped two of
    # them (the first of its chain was the least recently freed), letting it in where the fast path held it
    prompt = tuple(range(1, 33))

    def run(fast: bool) -> Engine:
        cfg = EngineConfig(num_blocks=24, block_size=16, segment_blocks=4, max_model_len=384, max_num_batched_tokens=64,
                           prompt_blocks="chunk", oom_mode="preempt", overcommit=math.inf, overcommit_max=math.inf,
                           prefix_caching=True)
        eng = Engine(ModelConfig(), cfg, executor=ProfiledExecutor(COST), fast_forward=fast)
        eng.submit(Request("X", 0.0, 17, 1, 1, prompt_ids=prompt[:16] + (99,)))
        eng.submit(Request("Y", 0.0, 33, 2, 2, prompt_ids=prompt + (98,)))  # its first block computed again, unkeyed
        eng.submit(Request("Z", 0.0, 49, 1, 1, prompt_ids=tuple(range(200, 249))))
        while eng.has_work():
            eng.step()
        eng.submit(Request("R", eng.clock, 299, 60, 60))  # takes every unkeyed block
        while not eng.scheduler.running or eng.scheduler.running[0].num_generated < 1:
            eng.step()
        eng.submit(Request("H", eng.clock, 200, 5, 5, prompt_ids=prompt + tuple(range(300, 468))))
        eng.step()
        assert [q.id for q in eng.scheduler.waiting] == ["H"]
        eng.run()
        return eng

    stepped, fast = run(False), run(True)
    assert summarize(stepped) == summarize(fast) and stepped.counters == fast.counters and log(stepped) == log(fast)


def test_a_request_taking_cached_blocks_reclaims_idle_contexts_not_them_and_its_own_keys_are_kept_for_a_preemption():
    # found by review: a head reclaimed the cached blocks it had just taken, computing them again, and every
    # finished request's blocks were kept cached under its own keys, which nothing could ever find
    prompt = tuple(range(1, 65))  # 4 blocks
    cfg = EngineConfig(num_blocks=16, block_size=16, segment_blocks=4, max_model_len=256, max_num_batched_tokens=512,
                       overcommit=math.inf, overcommit_max=math.inf, prefix_caching=True)
    eng = Engine(ModelConfig(), cfg, executor=ProfiledExecutor(COST), fast_forward=False)
    eng.submit(Request("X", 0.0, 65, 1, 1, prompt_ids=prompt + (99,)))
    eng.submit(Request("S", 0.0, 127, 1, 1, session_id="s"))  # its context stays, idle: 8 blocks
    eng.run()
    assert len(eng.kv.blocks.evictable) == 4 and eng.kv.blocks.num_free == 8
    eng.submit(Request("H", eng.clock, 160, 1, 1, prompt_ids=prompt + tuple(range(200, 296))))  # 10 blocks
    before = eng.counters.prefill_tokens
    eng.step()
    assert eng.kv.prefix_hit_tokens == 64 and eng.counters.prefill_tokens - before == 96
    assert eng.counters.contexts_dropped == 1

    plain = Engine(ModelConfig(), EngineConfig(num_blocks=64, block_size=16, segment_blocks=4, prefix_caching=True),
                   executor=ProfiledExecutor(COST))
    for i in range(12):
        plain.submit(Request(f"q{i}", float(i), 60, 4, 4))  # one at a time: nothing they hold can be shared
    plain.run()
    assert not plain.kv.blocks.key_of and plain.pool.held_blocks == 4


@pytest.mark.parametrize("rule", ["overcommit", "sglang", "sglang:code"])
def test_every_admission_rule_counts_a_block_running_requests_share_once(rule):
    # 64 blocks of 16 = 1,024 tokens. A holds 481 tokens (30 full blocks) and may generate 100; B's first
    # 480 tokens are A's. Counted per request, B would not fit: at factor 1 A's and B's peaks are 37 + 38 > 64
    # blocks; under SGLang's rule 482 + 496 + 0.7 x (98 + 100) > 1,024 tokens (its code: 482 + 0.7 x 98 + 496
    # + 100). A shared block is memory held once, as SGLang's radix tree holds it: B is charged its 16 own tokens
    stem = tuple(i % 500 for i in range(1, 481))
    admitted = {}
    for prefix in (False, True):
        cfg = EngineConfig(num_blocks=64, block_size=16, max_model_len=1024, max_num_batched_tokens=1024,
                           overcommit=1.0, prefix_caching=prefix, oom_mode="preempt",
                           admission="overcommit" if rule == "overcommit" else "sglang",
                           sglang_rule="code" if rule == "sglang:code" else "spec")
        eng = Engine(ModelConfig(), cfg, executor=ProfiledExecutor(COST))
        eng.submit(Request("A", 0.0, 481, 100, 100, prompt_ids=stem + (7,)))
        eng.step()
        eng.submit(Request("B", eng.clock, 496, 100, 100, prompt_ids=stem + tuple(range(300, 316))))
        eng.step()
        s = eng.scheduler
        admitted[prefix] = [q.id for q in s.running]
        if prefix:
            assert s.running[1].block_table[:30] == s.running[0].block_table[:30] and eng.kv.blocks.num_shared == 30
            assert s.reserved_blocks() == 37 + 38 - 30
            if rule != "overcommit":
                assert s.sglang_books()[0] == 483 + 497 - 480
    assert admitted == {False: ["A"], True: ["A", "B"]}


def test_prefix_caching_is_refused_beside_the_preempted_kv_models_and_hash_ids_need_their_block_size():
    with pytest.raises(ValueError, match="preempted_kv 'lru'.*leave preempted_kv 'recomputed'"):
        EngineConfig(prefix_caching=True, preempted_kv="lru")
    with pytest.raises(ValueError, match="prefix_caching must be true or false, got 'yes'"):
        EngineConfig(prefix_caching="yes")
    eng = Engine(ModelConfig(), EngineConfig(prefix_caching=True), executor=ProfiledExecutor(COST))
    with pytest.raises(RequestError, match="hash_ids need hash_block_tokens.*got None"):
        eng.submit(Request("r", 0.0, 40, 5, 5, hash_ids=(1, 2)))
    with pytest.raises(RequestError, match="hash id 1.5 is not a whole number"):
        eng.submit(Request("r", 0.0, 40, 5, 5, hash_ids=(1, 1.5), hash_block_tokens=32))
    assert not eng.records and not eng.has_work()  # nothing of a refused request stays


# ---- the engine on real KV -----------------------------------------------------------------------
def tiny(prefix: bool, **kw) -> Engine:
    return build_engine(num_blocks=64, max_model_len=256, prefix_caching=prefix, **kw)


def shared_prompts() -> list[Request]:
    """A and B share their first 20 prompt ids; C and D a trace's first two hash ids (8 tokens each)."""
    rng = np.random.default_rng(0)
    common = rng.integers(0, TINY.vocab_size, 20).tolist()
    a = tuple(common + rng.integers(0, TINY.vocab_size, 7).tolist())
    b = tuple(common + rng.integers(0, TINY.vocab_size, 5).tolist())
    return [Request("A", 0.0, len(a), 12, 12, prompt_ids=a),
            Request("C", 0.0, 22, 9, 9, hash_ids=(1, 2, 3), hash_block_tokens=8),
            Request("B", 0.0, len(b), 10, 10, prompt_ids=b),
            Request("D", 0.0, 20, 11, 11, hash_ids=(1, 2, 9), hash_block_tokens=8)]


def test_requests_sharing_their_first_tokens_take_the_blocks_computed_and_generate_the_same_tokens():
    requests = shared_prompts()
    on, off = tiny(True), tiny(False)
    ids = [on._prompt_ids(r) for r in requests[1::2]]  # C's and D's: the same where their hash ids are
    assert ids[0][:16] == ids[1][:16] and ids[0][16:20] != ids[1][16:20]
    for eng in (on, off):
        for r in requests[:2]:
            eng.submit(r)
        eng.step()
        eng.step()
        assert not eng.completed and not eng.scheduler.waiting  # A and C are decoding when B and D arrive
        for r in requests[2:]:
            eng.submit(replace(r, arrival_s=eng.clock))
        eng.step()
        check_engine_books(eng)
    held = {q.id: q.block_table for q in on.scheduler.running}
    assert held["B"][:5] == held["A"][:5] and held["D"][:4] == held["C"][:4]  # shared while both run
    assert (on.kv.blocks.ref_counts[held["A"][:5] + held["C"][:4]] == 2).all()
    assert on.kv.blocks.num_used == off.kv.blocks.num_used - 9
    on.run()
    off.run()
    assert on.outputs == off.outputs and len(on.outputs) == 4
    # B's 20 shared tokens (5 blocks) and D's 16 (two hash ids) were not computed again
    assert on.kv.prefix_hit_tokens == 36 and on.counters.prefill_tokens == off.counters.prefill_tokens - 36
    assert on.kv.prefix_query_tokens == sum(r.prompt_len for r in requests)
    assert summarize(on)["prefix_cache_hit_rate"] == pytest.approx(36 / sum(r.prompt_len for r in requests))
    assert summarize(off)["prefix_cache_hit_rate"] == 0.0
    # finished, their blocks stay cached while free: A's prompt again takes all but its last block's
    assert on.kv.blocks.num_used == 0 and len(on.kv.blocks.evictable) > 0
    on.submit(Request("A2", on.clock, requests[0].prompt_len, 3, 3, prompt_ids=requests[0].prompt_ids))
    on.step()
    assert on.kv.prefix_hit_tokens == 36 + 24 and on.scheduler.running[0].num_computed == 27
    # a hash id names its block and those before it: one repeated after another first id shares nothing past it
    # (found by review: keyed by its own id alone, F's second block was taken for E's, after other tokens)
    on.run()
    on.submit(Request("F", on.clock, 20, 2, 2, hash_ids=(5, 6, 7), hash_block_tokens=8))
    on.run()
    on.submit(Request("E", on.clock, 20, 2, 2, hash_ids=(1, 6, 7), hash_block_tokens=8))
    on.step()
    assert on.kv.prefix_hit_tokens == 36 + 24 + 8  # C's first 8 tokens, not F's next 8
    # hash ids with another block size name other tokens (found by review: they shared keys)
    on.run()
    on.submit(Request("G", on.clock, 20, 2, 2, hash_ids=(1, 2, 3), hash_block_tokens=10))
    on.step()
    assert on.kv.prefix_hit_tokens == 36 + 24 + 8


def test_a_preempted_request_takes_back_what_the_cache_still_holds_and_counts_only_the_rest_recomputed():
    # tensor-free, preempt mode: B's growth preempts A, which is readmitted on its own cached blocks
    cfg = EngineConfig(num_blocks=20, block_size=16, max_model_len=320, oom_mode="preempt", overcommit=math.inf,
                       overcommit_max=math.inf, prefix_caching=True)
    eng = Engine(ModelConfig(), cfg, executor=ProfiledExecutor(COST))
    eng.submit(Request("A", 0.0, 100, 150, 150))
    eng.submit(Request("B", 0.0, 100, 150, 150))
    eng.run()
    assert eng.counters.preemptions >= 1
    a = eng.records["A"]
    assert a.preemptions + eng.records["B"].preemptions == eng.counters.preemptions
    assert eng.kv.prefix_hit_tokens > 0
    # every token lost to a preemption is either taken back from the cache or counted as recomputed
    off = Engine(ModelConfig(), EngineConfig(**{**cfg.__dict__, "prefix_caching": False}),
                 executor=ProfiledExecutor(COST))
    off.submit(Request("A", 0.0, 100, 150, 150))
    off.submit(Request("B", 0.0, 100, 150, 150))
    off.run()
    assert eng.counters.recomputed_tokens + eng.kv.prefix_hit_tokens >= off.counters.recomputed_tokens > 0
    assert eng.counters.recomputed_tokens < off.counters.recomputed_tokens
    assert eng.counters.prefill_tokens == off.counters.prefill_tokens - eng.kv.prefix_hit_tokens


@st.composite
def shared_workloads(draw):
    """A pool too small for everything at once; prompts drawn from two shared prefixes."""
    num_blocks = draw(st.integers(8, 14))
    room = (num_blocks - 1) * BLOCK_SIZE
    rng = np.random.default_rng(draw(st.integers(0, 2**31 - 1)))
    stems = [rng.integers(0, TINY.vocab_size, room).tolist() for _ in range(2)]
    n = draw(st.integers(3, 6))
    requests = []
    for i, t in enumerate(arrivals(draw, n)):
        prompt = draw(st.integers(room // 4, room // 2))
        shared = draw(st.integers(0, prompt))
        ids = stems[draw(st.integers(0, 1))][:shared] + rng.integers(0, TINY.vocab_size, prompt - shared).tolist()
        max_tokens = draw(st.integers(1, room - prompt))
        requests.append(Request(f"r{i}", t, prompt, max_tokens, max_tokens, prompt_ids=tuple(ids)))
    config = dict(num_blocks=num_blocks, oom_mode=draw(st.sampled_from(["crash", "preempt"])),
                  overcommit=draw(st.sampled_from([2.0, math.inf, 1.0])), restart_downtime_s=0.5,
                  host_bytes=draw(st.sampled_from([num_blocks, 2, 0])) * TINY.kv_bytes_per_token() * BLOCK_SIZE)
    return config, requests, draw(actions)


def check_cache_books(eng: Engine) -> None:
    bm = eng.kv.blocks
    assert all(bm.block_of[k] == b for b, k in bm.key_of.items()) and len(bm.block_of) == len(bm.key_of)
    assert all(bm.ref_counts[b] == 0 and b in bm.key_of and b < eng.pool.held_blocks for b in bm.evictable)
    assert not set(bm.evictable) & set(bm._free) and len(bm._free) + len(bm.evictable) == bm.num_free
    # only running requests share blocks, so that the admission rules count each once (``num_shared``)
    running = [b for q in eng.scheduler.running for b in q.block_table]
    assert bm.num_shared == int(np.maximum(bm.ref_counts - 1, 0).sum()) == len(running) - len(set(running))


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(shared_workloads())
def test_shared_prefixes_under_compaction_eviction_and_oom_keep_the_books_and_the_tokens(workload):
    config, requests, perturbations = workload
    eng = build_engine(prefix_caching=True, **config)
    step = eng.step

    def checked_step() -> bool:
        more = step()
        check_cache_books(eng)
        return more

    eng.step = checked_step
    drive(eng, requests, perturbations, noise_seed=1)
    if eng.kv.prefix_hit_tokens:
        event("prefix cache: hits")
    ref = drive(build_engine(**config), requests, [], noise_seed=2)
    assert eng.outputs == ref.outputs


# ---- a trace with hash ids ---------------------------------------------------------------------
def test_mooncakes_hash_ids_share_prompts_and_the_cache_computes_less_and_serves_sooner():
    trace = read_trace(bundled_trace("mooncake_fast25_synthetic.jsonl"))
    spec = ReplaySpec(max_tokens="fixed:1024", time_scale=0.4, duration_s=120.0, max_model_len=32768, seed=0)
    requests = build_requests(trace, spec)
    assert all(r.hash_block_tokens == 512 and len(r.hash_ids) == math.ceil(r.prompt_len / 512) for r in requests)
    # the prompt tokens an unbounded cache could give: each request's first hash ids that an earlier one had
    seen, shareable = set(), 0
    for r in requests:
        k = next((k for k, h in enumerate(r.hash_ids) if h not in seen), len(r.hash_ids))
        shareable += min(k * 512, r.prompt_len)
        seen.update(r.hash_ids)
    ideal = shareable / sum(r.prompt_len for r in requests)

    def run(prefix: bool, num_blocks: int) -> Engine:
        cfg = EngineConfig(num_blocks=num_blocks, block_size=16, max_model_len=32768, max_num_batched_tokens=8192,
                           prefix_caching=prefix)
        eng = Engine(ModelConfig(max_position=32768), cfg, executor=ProfiledExecutor(COST))
        for r in requests:
            eng.submit(r)
        eng.run()
        return eng

    big, small, off = run(True, 200_000), run(True, 12_000), run(False, 200_000)
    hit = summarize(big)["prefix_cache_hit_rate"]
    assert 0.75 * ideal < hit <= ideal  # what the cache gives is nearly all a cache could: full 16-token blocks
    assert 0 < summarize(small)["prefix_cache_hit_rate"] < 0.5 * hit  # a KV of 12,000 blocks keeps far less
    assert big.counters.prefill_tokens == off.counters.prefill_tokens - big.kv.prefix_hit_tokens
    assert summarize(big)["ttft_p50_s"] < summarize(off)["ttft_p50_s"]
    assert len(big.completed) == len(off.completed) == len(requests)


def test_replay_and_eval_keep_a_prefix_cache_on_request_and_refuse_what_it_cannot_run_with(tmp_path, capsys):
    import json

    from rlctl.cli import main

    # a Mooncake-format trace of five requests, four of them sharing their first hash id (512 tokens)
    trace = tmp_path / "shared.jsonl"
    rows = [{"timestamp": 300 * i, "input_length": 600, "output_length": 8, "hash_ids": [7, 100 + i]}
            for i in range(4)] + [{"timestamp": 1200, "input_length": 590, "output_length": 8, "hash_ids": [8, 9]}]
    trace.write_text("".join(json.dumps(r) + "\n" for r in rows))
    trace_text = trace.read_text()
    figures = {}
    for on in (False, True):
        js = tmp_path / f"{on}.json"
        assert main(["replay", "--trace", str(trace), "--duration", "5", "--max-tokens", "fixed:8", "--json", str(js)]
                    + (["--prefix-caching"] if on else [])) == 0
        out = capsys.readouterr().out
        assert ("prefix cache hit rate" in out) == on and ("a prefix cache" in out) == on
        figures[on] = json.loads(js.read_text())
    # the three later requests take the first's 512 tokens (32 blocks of 16)
    assert figures[True]["prefix_cache_hit_rate"] == pytest.approx(3 * 512 / (4 * 600 + 590))
    assert figures[False]["prefix_cache_hit_rate"] == 0 and figures[True]["engine"]["prefix_caching"]
    assert figures[True]["requests_completed"] == figures[False]["requests_completed"] == 5
    assert trace.read_text() == trace_text

    assert main(["eval", "--trace", str(trace), "--time-scale", "1", "--policy", "static:1", "--steps", "3",
                 "--prefix-caching"]) == 0
    out = capsys.readouterr().out
    assert "prefix cache: 51.4% of shared.jsonl's prompt tokens open with hash ids an earlier prompt had" in out
    assert "prefix cache hit rate" in out

    assert main(["eval", "--policy", "vllm_v1", "--policy", "vllm", "--prefix-caching",
                 "--scenario", "long_outputs_preempt"]) == 2
    assert "--policy vllm_v1 cannot run on scenario long_outputs_preempt: preempted_kv 'lru'" in capsys.readouterr().err
    assert main(["eval", "--policy", "vllm", "--prefix-caching", "--scenario", "node_chat_pair"]) == 2
    assert "--prefix-caching applies to one engine's scenarios" in capsys.readouterr().err
    assert main(["replay", "--node", "node_chat_pair", "--controller", f"unix://{tmp_path}/none.sock",
                 "--prefix-caching"]) == 2
    assert "--prefix-caching applies to one engine's replay" in capsys.readouterr().err
    # the check of what a policy pins leaves a static factor outside the scenario's range to run, as before
    assert main(["eval", "--policy", "static:6", "--scenario", "burst", "--steps", "2"]) == 0
