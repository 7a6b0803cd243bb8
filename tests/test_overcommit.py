"""Overcommit is real: on the bundled Azure trace it trades idle KV for throughput, and past a
point it runs the engine out of memory, which costs time but never a request.

The engines run the real model on real KV tensors, timed by a stated cost model (about what the
torch executor measures for the tiny model on this CPU) so that the figures, and the tests, do
not depend on how busy the machine is.
"""
from __future__ import annotations

import pytest

from engine.metrics import summarize
from env.workloads import ReplaySpec
from engine.config import EngineConfig
from engine.cost_model import CostModel
from engine.executor import ProfiledExecutor
from env.workloads import bundled_trace
from rlctl.replay import build_engine, load_requests

# A memory-bound deployment: 128 blocks of 16 tokens, clients declaring max_tokens = 1024.
DEPLOYMENT = EngineConfig(num_blocks=128, max_model_len=2048, restart_downtime_s=1.0)
CPU_COST = CostModel(fixed_s=1.5e-3, per_token_s=2e-5, per_context_token_s=2e-7, copy_fixed_s=1e-5,
                     copy_bytes_per_s=2e9)


def azure(time_scale: float, duration_s: float) -> list:
    spec = ReplaySpec(max_tokens="fixed:1024", time_scale=time_scale, duration_s=duration_s, max_model_len=2048)
    return load_requests(bundled_trace("azure2023_conv.csv"), spec)


def run(requests, factor: float, oom: str = "crash", check_reservation: bool = False):
    engine = build_engine(DEPLOYMENT, factor, oom, executor=ProfiledExecutor(CPU_COST, materialize=True))
    engine.keep_outputs = True
    for r in requests:
        engine.submit(r)
    while engine.step():
        if check_reservation:
            assert engine.scheduler.reserved_blocks() <= engine.kv.num_blocks
    return engine, summarize(engine)


@pytest.fixture(scope="module")
def steady():
    """30 s of the trace compressed 40x: a queue builds at factor 1.0."""
    requests = azure(40.0, 30.0)
    assert len(requests) > 40
    return requests, {f: run(requests, f, check_reservation=f == 1.0) for f in (1.0, 1.6)}


def test_factor_one_with_crash_semantics_never_runs_out_of_memory(steady):
    requests, runs = steady
    engine, figures = runs[1.0]
    assert figures["oom_events"] == 0 and figures["preemptions"] == 0
    assert figures["requests_completed"] == len(requests)


def test_a_higher_factor_raises_kv_utilisation_and_throughput(steady):
    _, runs = steady
    conservative, overcommitted = runs[1.0][1], runs[1.6][1]
    assert overcommitted["kv_util_mean"] > conservative["kv_util_mean"] + 0.05
    assert overcommitted["tokens_per_s"] > conservative["tokens_per_s"]
    assert overcommitted["ttft_p50_s"] < conservative["ttft_p50_s"]


def test_a_burst_past_capacity_crashes_requeues_and_loses_no_request(steady):
    requests = azure(1000.0, 30.0)  # the same 30 s arriving within a tenth of a second
    engine, figures = run(requests, 3.0)
    assert figures["oom_events"] > 0
    assert figures["requests_completed"] == len(requests)
    assert any(r.restarts for r in engine.records.values())
    for r in requests:
        assert engine.records[r.request_id].output_len == min(r.output_len, r.max_tokens)
    # every token survives the restarts: the same requests, never crashed, generate the same
    reference, _ = steady[1][1.0]
    for r in requests:
        assert engine.outputs[r.request_id] == reference.outputs[r.request_id]


def test_vllm_semantics_preempt_instead_of_crashing():
    requests = azure(1000.0, 30.0)
    engine, figures = run(requests, float("inf"), oom="preempt")
    assert figures["oom_events"] == 0 and figures["preemptions"] > 0
    assert figures["requests_completed"] == len(requests)


def test_a_co_tenant_taking_device_memory_makes_the_pool_growth_an_oom_event():
    requests = azure(1000.0, 10.0)
    engine = build_engine(DEPLOYMENT, 1.0, "crash", executor=ProfiledExecutor(CPU_COST, materialize=True))
    for r in requests:
        engine.submit(r)
    engine.step()
    # another process takes all but what the engine holds now: the next segment cannot be had
    engine.device.set_tenants(engine.device.free)
    while engine.counters.oom_events == 0 and engine.step():
        pass
    assert engine.counters.oom_events == 1
    assert engine.pool.footprint_bytes() == 0  # the crash gave the pool's memory back
    engine.device.set_tenants(0)
    engine.run()
    assert all(r.finish_s is not None for r in engine.records.values())


def test_without_tensors_the_engine_keeps_the_same_books():
    """The cost-model clock with no KV tensors admits, finishes and crashes exactly as with them."""
    requests = azure(1000.0, 10.0)
    runs = []
    for materialize in (True, False):
        engine = build_engine(DEPLOYMENT, 3.0, "crash", executor=ProfiledExecutor(CPU_COST, materialize))
        for r in requests:
            engine.submit(r)
        blocks = []
        while engine.step():
            blocks.append(engine.kv.blocks.num_used)
        order = sorted(engine.records.values(), key=lambda r: r.finish_s)
        runs.append(([(r.request_id, r.finish_s, r.restarts) for r in order], blocks, engine.counters.oom_events))
    assert runs[0] == runs[1]
    assert runs[0][2] > 0


def test_vllm_v1_takes_a_prompts_blocks_chunk_by_chunk_and_loses_no_token():
    """``prompt_blocks: chunk`` (``vllm_chunked``): a prompt longer than the free blocks is admitted on
    its first chunk's, where the whole prompt's must wait; a later chunk that finds no block preempts
    the newest request (here the prompt itself, part way through its prefill), which is recomputed
    and generates the same tokens as when nothing was preempted."""
    from dataclasses import replace
    from engine.engine import Engine
    from engine.config import ModelConfig
    from engine.request import Request

    def serve(prompt_blocks: str):
        cfg = replace(DEPLOYMENT, num_blocks=32, max_model_len=512, max_num_batched_tokens=64, oom_mode="preempt",
                      overcommit=float("inf"), overcommit_max=float("inf"), prompt_blocks=prompt_blocks)
        engine = Engine(ModelConfig(), cfg, executor=ProfiledExecutor(CPU_COST, materialize=True))
        engine.keep_outputs = True
        engine.submit(Request("A", 0.0, 300, 120, 120))  # 19 blocks once prefilled, 27 at its end
        engine.submit(Request("B", 0.0, 250, 20, 20))    # 16 blocks: more than A leaves free
        together, cut = False, False
        while engine.step():
            running = {q.request.request_id: q for q in engine.scheduler.running}
            if "A" in running and "B" in running and engine.records["A"].first_token_s is not None:
                together = True
                assert len(running["B"].block_table) < running["B"].blocks_for(250)  # only its chunks so far
            b = engine.records["B"]
            cut |= b.preemptions > 0 and b.first_token_s is None
        return engine, together, cut

    whole, together, cut = serve("whole")
    assert not together and whole.counters.preemptions == 0  # B waits for A's blocks
    chunked, together, cut = serve("chunk")
    assert together and cut and chunked.counters.preemptions > 0
    assert chunked.records["B"].finish_s is not None and chunked.records["A"].finish_s is not None
    assert chunked.outputs == whole.outputs
    with pytest.raises(ValueError, match="prompt_blocks must be 'whole' or 'chunk'"):
        replace(DEPLOYMENT, prompt_blocks="chunks")


def test_a_prefix_cache_readmits_a_preempted_request_with_what_it_still_holds():
    """``preempted_kv`` on the tensor-free engine. ``cached`` (``vllm_cached``, ``sglang_cached``): a
    preempted request is readmitted with all the KV it had computed, so nothing is computed again.
    ``lru`` (``vllm_v1``, with chunks): with what vLLM's prefix cache still holds of it, its full blocks
    freed last first and free blocks handed out oldest first, so part is computed again. A restart
    loses the cache with everything else and counts it; real KV tensors refuse both."""
    from dataclasses import replace
    from engine.engine import Engine
    from engine.config import ModelConfig

    requests = azure(1000.0, 30.0)
    engines = {}
    for kept in ("recomputed", "cached", "lru"):
        engine = build_engine(replace(DEPLOYMENT, preempted_kv=kept), float("inf"), "preempt",
                              executor=ProfiledExecutor(CPU_COST))
        for r in requests:
            engine.submit(r)
        lost, seen = 0, {}
        while engine.step():
            for q in engine.scheduler.waiting:  # what each preemption left to the cache
                if q.record.preemptions > seen.get(q.id, 0):
                    seen[q.id] = q.record.preemptions
                    lost += q.cached
        engines[kept] = engine, lost
    (full, _), (cached, _), (lru, lru_lost) = engines["recomputed"], engines["cached"], engines["lru"]
    assert min(e.counters.preemptions for e, _ in engines.values()) > 0
    assert full.counters.recomputed_tokens > 0 and cached.counters.recomputed_tokens == 0
    assert cached.counters.prefill_tokens < full.counters.prefill_tokens
    assert 0 < lru.counters.recomputed_tokens < lru_lost  # some of what it had computed was still cached, not all
    for e, _ in engines.values():
        assert all(r.finish_s is not None for r in e.records.values())
    # a restart takes the cache with it, and what it held is counted as lost
    engine = build_engine(replace(DEPLOYMENT, preempted_kv="cached"), float("inf"), "preempt",
                          executor=ProfiledExecutor(CPU_COST))
    for r in requests:
        engine.submit(r)
    while engine.counters.preemptions == 0:
        engine.step()
    held = sum(q.cached for q in engine.scheduler.waiting)
    assert held > 0 and engine.counters.recomputed_tokens == 0
    engine.restart()
    assert not any(q.cached for q in engine.scheduler.waiting)
    assert engine.counters.recomputed_tokens >= held
    for kept in ("cached", "lru"):
        with pytest.raises(ValueError, match="a model for the tensor-free engine"):
            Engine(ModelConfig(), replace(DEPLOYMENT, preempted_kv=kept), executor=ProfiledExecutor(CPU_COST, True))


def test_vllms_free_block_order_keeps_a_victims_prefix_longest():
    """``FreeOrder``: blocks freed longest ago are handed out first, a victim's last blocks before
    its first, and a readmitted victim takes back what is left of its own."""
    from engine.kv_cache import FreeOrder

    order = FreeOrder(10)
    order.taken(6)                       # 4 free, never used
    order.freed(5, owner="v", kept=4)    # its partial last block, then its 4 full blocks, last first
    assert order.kept("v") == 4
    order.taken(5)                       # the 4 never used, then its partial block
    assert order.kept("v") == 4
    order.taken(2)                       # two of its own, its last ones
    assert order.kept("v") == 2
    order.freed(3)
    order.taken(3, owner="v")            # its 2 back, and 1 from the front (its own are gone from there)
    assert order.kept("v") == 0
    assert sum(n for _, n in order.queue) == 2


def test_a_turn_whose_context_is_reclaimed_while_it_is_admitted_computes_it_again():
    """A waiting session turn holds its context's blocks; when its own admission runs short and the
    scheduler reclaims them, the turn computes its context again (it once kept the context's length
    as computed and read another sequence's KV: a review found it), token for token as with room."""
    from dataclasses import replace
    from engine.engine import Engine
    from engine.config import ModelConfig
    from engine.request import Request

    def serve(num_blocks: int):
        cfg = replace(DEPLOYMENT, num_blocks=num_blocks, max_model_len=512, oom_mode="preempt",
                      overcommit=float("inf"), overcommit_max=float("inf"))
        engine = Engine(ModelConfig(), cfg, executor=ProfiledExecutor(CPU_COST, materialize=True))
        engine.keep_outputs = True
        engine.submit(Request("t1", 0.0, 40, 1, 1, session_id="t"))
        engine.submit(Request("s1", 0.0, 100, 4, 4, session_id="s"))
        engine.submit(Request("R", 0.3, 300, 40, 40))
        engine.submit(Request("s2", 0.333, 60, 8, 8, session_id="s"))  # its context: s1's 104 tokens
        engine.run()
        return engine

    tight, roomy = serve(32), serve(128)
    assert tight.counters.prefill_tokens > roomy.counters.prefill_tokens  # the context was computed again
    assert tight.outputs == roomy.outputs
