"""The lookahead oracle and the engine copies it rolls forward.

A copy of a tensor-free engine runs on exactly as the engine would (the same books), and running
it leaves the engine untouched; the oracle plans a factor from its candidates every period, and
the episode it steers is what the engine does with those factors (its rollouts change nothing)."""
from __future__ import annotations

from dataclasses import replace

from agents.spec import make_policy
from engine.clone import clone
from engine.control import advance
from engine.metrics import summarize
from env.overcommit_env import OvercommitEnv
from env.scenario_yaml import load_scenario
from rlctl.evaluate import run_episode


def sessions_at(seconds: float) -> OvercommitEnv:
    env = OvercommitEnv(load_scenario("sessions"))
    env.reset(seed=1)
    for k in range(int(seconds / 2)):
        env.step(4 if k % 7 == 0 else 1)  # swapped contexts and sequences, a raised factor
    return env


def test_a_copy_runs_on_as_the_engine_does_and_leaves_it_untouched():
    env, twin = sessions_at(60), sessions_at(60)
    copy = clone(env.engine)
    advance(copy, copy.clock + 120)
    assert summarize(env.engine) == summarize(twin.engine) and env.engine.counters == twin.engine.counters
    advance(env.engine, env.engine.clock + 120)
    assert summarize(copy) == summarize(env.engine) and copy.counters == env.engine.counters
    assert copy.clock == env.engine.clock and copy.traffic == env.engine.traffic


def test_the_oracle_plans_from_its_candidates_and_its_rollouts_change_nothing():
    sc = replace(load_scenario("long_outputs_preempt"), max_steps=30)
    env = OvercommitEnv(sc)
    oracle = make_policy("oracle")
    summary, _ = run_episode(env, oracle, seed=3)
    times = [t for t, _ in oracle.chosen]
    assert times[0] == 0.0 and all(b - a >= oracle.every_s for a, b in zip(times, times[1:]))
    assert {f for _, f in oracle.chosen} <= set(oracle.candidates())  # inf is one on a preempting engine
    # the same episode with the chosen factors set directly: the same books
    replay = OvercommitEnv(sc)
    replay.reset(seed=3, options={"engine": oracle.engine_overrides})
    plan = list(oracle.chosen)
    while True:
        if plan and plan[0][0] <= replay.engine.clock:
            replay.engine.set_overcommit(plan.pop(0)[1])
        *_, terminated, truncated, info = replay.step(0)
        if terminated or truncated:
            break
    assert info["summary"]["goodput_tokens_per_s"] == summary["goodput_tokens_per_s"]
    assert replay.engine.counters == env.engine.counters
