"""The engine never stalls: every iteration runs work, waits (the clock moves), crashes (and restarts
after its downtime) or preempts and runs the rest; nothing loops without the clock moving.

Random workloads, random co-tenants taking and giving back device memory, random controller
actions, in both OOM modes: every request completes within a bounded number of iterations. And
every baseline finishes an episode of every bundled scenario.
"""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agents.spec import baselines, make_policy
from engine.config import EngineConfig, ModelConfig, memory_plan
from engine.control import ACTIONS, apply_action
from engine.cost_model import CostModel
from engine.engine import Engine
from engine.executor import ProfiledExecutor
from engine.request import Request
from env.overcommit_env import OvercommitEnv
from env.scenario_yaml import bundled_scenarios, load_scenario
from rlctl.evaluate import run_episode

COST = CostModel(fixed_s=1e-3, per_token_s=2e-5, per_context_token_s=2e-7, copy_fixed_s=1e-5, copy_bytes_per_s=2e9)
MODEL = ModelConfig(num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2)
MAX_ITERATIONS = 50_000


@st.composite
def runs(draw):
    n = draw(st.integers(1, 14))
    reqs = []
    for i in range(n):
        prompt = draw(st.integers(1, 300))
        output = draw(st.integers(1, 200))
        declared = draw(st.integers(output, 600))
        reqs.append(Request(f"r{i}", draw(st.floats(0.0, 0.5)), prompt, output, declared,
                            session_id=draw(st.sampled_from([None, None, "a", "b"]))))
    tenants = sorted(draw(st.lists(st.tuples(st.floats(0.0, 0.6), st.floats(0.0, 0.95)), max_size=6)))
    actions = draw(st.lists(st.integers(0, len(ACTIONS) - 1), max_size=40))
    mode = draw(st.sampled_from(["crash", "preempt"]))
    factor = draw(st.sampled_from([1.0, 1.5, 3.0, float("inf")]))
    return reqs, tenants, actions, mode, factor


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(runs())
def test_random_workloads_cotenants_and_actions_always_finish_without_stalling(run):
    reqs, tenants, actions, mode, factor = run
    cfg = EngineConfig(num_blocks=64, segment_blocks=8, max_num_seqs=8, max_num_batched_tokens=256, max_model_len=1024,
                       oom_mode=mode, restart_downtime_s=0.05, host_bytes=1 << 20, overcommit_max=4.0)
    cfg = cfg.pinned(factor) if factor > 4.0 else cfg
    eng = Engine(MODEL, cfg, executor=ProfiledExecutor(COST))
    eng.set_overcommit(factor)
    capacity = memory_plan(MODEL, cfg).total
    for r in reqs:
        eng.submit(r)
    # the co-tenant's memory over time (a share of the device), given back at the end
    schedule = [(t, int(share * capacity)) for t, share in tenants] + [(0.7, 0)]
    actions = list(actions)
    iterations = stalled = longest = 0
    while eng.has_work():
        while schedule and schedule[0][0] <= eng.clock:
            eng.device.set_tenants(schedule.pop(0)[1])
        if actions and iterations % 5 == 0:
            apply_action(eng, actions.pop(0), 0.5)
        before = (eng.clock, len(eng.completed), eng.counters.iterations)
        assert eng.step() or not eng.has_work()
        iterations += 1
        stalled = stalled + 1 if (eng.clock, len(eng.completed), eng.counters.iterations) == before else 0
        longest = max(longest, stalled)
        assert iterations < MAX_ITERATIONS, f"{len(eng.completed)}/{len(reqs)} done after {iterations} iterations"
    # a crash is the only step that neither runs nor moves the clock, and the next one restarts
    assert longest <= 1
    assert len(eng.completed) == len(reqs)
    # each served in full, or up to the context length where a long session's turn must stop
    assert all(0 < eng.records[r.request_id].output_len <= min(r.output_len, r.max_tokens) for r in reqs)


def test_a_turn_whose_context_is_on_the_host_gets_back_in_past_an_idle_context_filling_the_kv():
    # found by the test above: nothing runs, the head turn's context (15 blocks) is on the host, an
    # idle context of another session holds 50 of the 64 blocks, and the turn waited for ever
    cfg = EngineConfig(num_blocks=64, segment_blocks=8, max_num_seqs=8, max_num_batched_tokens=256, max_model_len=1024,
                       host_bytes=1 << 20)
    eng = Engine(MODEL, cfg, executor=ProfiledExecutor(COST))

    def run(*reqs: Request) -> int:
        for r in reqs:
            eng.submit(r)
        n = 0
        while eng.has_work() and n < 1000:
            assert eng.step() or not eng.has_work()
            n += 1
        return n

    run(Request("b1", 0.0, 226, 1, 1, session_id="b"))
    eng.evict(0.99)
    assert eng.sessions["b"].where == "host"
    run(Request("a1", eng.clock, 800, 1, 1, session_id="a"))
    assert eng.sessions["a"].where == "device" and eng.kv.blocks.num_free == 64 - 50
    assert run(Request("b2", eng.clock, 1, 1, 1, session_id="b")) < 1000
    assert len(eng.completed) == 3
    assert eng.sessions["b"].where == "device" and eng.sessions["a"].where == "dropped"  # recomputed next turn


@pytest.mark.parametrize("scenario", bundled_scenarios())
def test_every_baseline_finishes_an_episode_of_every_bundled_scenario(scenario):
    sc = load_scenario(scenario)
    env = OvercommitEnv(sc)
    for spec in baselines(sc.best_static):
        summary, series = run_episode(env, make_policy(spec), seed=1000)
        assert summary["steps"] <= sc.max_steps
        assert np.all(np.diff(series["time_s"]) > 0)  # the engine's clock moved every decision
