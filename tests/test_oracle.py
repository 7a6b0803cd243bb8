"""The lookahead oracle and the engine copies it rolls forward.

A copy of a tensor-free engine runs on exactly as the engine would (the same books), and running
it leaves the engine untouched; the oracle plans a factor from its candidates every period, and
the episode it steers is what the engine does with those factors (its rollouts change nothing)."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from agents.spec import make_policy
from engine.clone import clone
from engine.control import EVICT, HOLD, advance
from engine.metrics import generated_so_far, on_track, summarize
from engine.request import Request
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
    times = [t for t, _, _ in oracle.chosen]
    assert times[0] == 0.0 and all(b - a >= oracle.every_s for a, b in zip(times, times[1:]))
    assert {(f, ev) for _, f, ev in oracle.chosen} <= set(oracle.plans())  # inf is one on a preempting engine
    assert set(oracle.plans()) == {(f, ev) for f in oracle.candidates() for ev in (False, True)}
    # the same episode with the chosen plans set directly: the same books
    replay = OvercommitEnv(sc)
    replay.reset(seed=3, options={"engine": oracle.engine_overrides})
    plan, evicting = list(oracle.chosen), True
    while True:
        if plan and plan[0][0] <= replay.engine.clock:
            _, factor, evicting = plan.pop(0)
            replay.engine.set_overcommit(factor)
        full = replay.engine.last_snapshot is not None and replay.engine.last_snapshot.alloc_ratio >= oracle.evict_at
        *_, terminated, truncated, info = replay.step(EVICT if evicting and full else HOLD)
        if terminated or truncated:
            break
    assert info["summary"]["goodput_tokens_per_s"] == summary["goodput_tokens_per_s"]
    assert replay.engine.counters == env.engine.counters


def test_the_oracle_scores_work_under_way_only_while_it_can_still_meet_its_slo(make_engine):
    eng = make_engine(num_blocks=64, block_size=4, segment_blocks=8, max_num_seqs=1, ttft_slo_s=1.0, tpot_slo_s=0.5)
    eng.submit(Request("a", 0.0, 8, 40, 40))
    eng.submit(Request("b", 0.0, 8, 40, 40))  # waits behind a: one sequence at a time
    eng.step()
    eng.step()
    assert set(generated_so_far(eng)) == {"a", "b"}
    a, b = (next(q for q in eng.scheduler.running + list(eng.scheduler.waiting) if q.id == i) for i in "ab")
    assert a.num_generated >= 1 and on_track(eng, a) and on_track(eng, b)
    eng.clock = 2.0  # b has waited past its TTFT target; a's tokens came at > 0.5 s each
    assert not on_track(eng, b) and not on_track(eng, a)


def test_the_oracle_always_evicts_on_a_crashing_engine_and_weighs_it_on_a_preempting_one():
    oracle = make_policy("oracle")
    env = OvercommitEnv(load_scenario("long_outputs"))
    env.reset(seed=0)
    oracle.reset(seed=0, env=env)
    assert {ev for _, ev in oracle.plans()} == {True}  # the shield's rule on a crashing engine
    full = replace(env.engine.snapshot(), alloc_ratio=0.99)
    assert oracle._rule(full, True) == EVICT and oracle._rule(replace(full, alloc_ratio=0.5), True) == HOLD
    assert oracle._rule(full, False) == HOLD


def test_a_drawn_length_goes_past_what_was_generated_and_never_past_max_tokens():
    import numpy as np

    from agents.oracle import draw_length
    from engine.output_lengths import kaplan_meier

    rng = np.random.default_rng(0)
    lengths, survival = kaplan_meier([5, 5, 10, 20], [])
    draws = [draw_length(lengths, survival, 0, 1000, rng) for _ in range(4000)]
    shares = {n: draws.count(n) / len(draws) for n in (5, 10, 20)}
    assert set(draws) == {5, 10, 20} and abs(shares[5] - 0.5) < 0.03 and abs(shares[10] - 0.25) < 0.03
    # given 7 generated: 10 or 20, each as likely
    later = [draw_length(lengths, survival, 7, 1000, rng) for _ in range(2000)]
    assert set(later) == {10, 20} and abs(later.count(10) / len(later) - 0.5) < 0.04
    assert {draw_length(lengths, survival, 0, 8, rng) for _ in range(200)} == {5, 8}  # capped at max_tokens
    # past the longest length seen, or with nothing seen: the declared limit
    assert draw_length(lengths, survival, 20, 1000, rng) == 1000
    empty = kaplan_meier([], [])
    assert draw_length(*empty, 0, 512, rng) == 512
    # the mass a request still going leaves past the longest end goes to the limit
    lengths, survival = kaplan_meier([4], [9])
    assert {draw_length(lengths, survival, 0, 64, rng) for _ in range(200)} == {4, 64}


def test_the_lookahead_scores_on_drawn_lengths_and_leaves_the_engine_as_it_was():
    sc = replace(load_scenario("long_outputs"), max_steps=20)
    env = OvercommitEnv(sc)
    lookahead = make_policy("lookahead")
    assert lookahead.name == "lookahead" and lookahead.samples == 2
    run_episode(env, lookahead, seed=3)  # through its decisions: requests finished, some running
    engine = env.engine
    assert engine.completed and engine.scheduler.running
    truth = {q.id: q.stop_at for q in engine.scheduler.unfinished() + [p[2] for p in engine.scheduler.pending]}
    before = summarize(engine)
    copies = lookahead.futures()
    assert len(copies) == 2 and summarize(engine) == before
    assert {q.id: q.stop_at for q in engine.scheduler.unfinished() + [p[2] for p in engine.scheduler.pending]} == truth
    drawn = {q.id: q.stop_at for q in copies[0].scheduler.unfinished() + [p[2] for p in copies[0].scheduler.pending]}
    assert drawn.keys() == truth.keys() and drawn != truth
    for q in copies[0].scheduler.unfinished():
        assert q.num_generated < q.stop_at <= q.request.max_tokens
    # the draws are the decision's: the same again, so that every plan is scored on the same futures
    again = {q.id: q.stop_at for q in lookahead.futures()[0].scheduler.unfinished()}
    assert again == {q.id: q.stop_at for q in copies[0].scheduler.unfinished()}
    # and the same episode gives the same figures
    twin, env2 = make_policy("lookahead"), OvercommitEnv(sc)
    assert run_episode(env2, twin, seed=3)[0]["goodput_tokens_per_s"] == summarize(engine)["goodput_tokens_per_s"]


def test_lookahead_n_draws_n_futures_and_is_a_reference_not_a_trained_policy():
    from agents.spec import is_reference, is_trained

    sc = replace(load_scenario("long_outputs"), max_steps=6)
    env = OvercommitEnv(sc)
    eight = make_policy("lookahead:8")
    assert eight.name == "lookahead:8" and eight.samples == 8
    run_episode(env, eight, seed=3)
    assert len(eight.futures()) == 8
    assert is_reference("lookahead:8") and is_reference("oracle") and not is_trained("lookahead:8")
    assert not is_reference("default") and is_trained("default")
    for bad in ("lookahead:0", "lookahead:x", "lookahead:-2", "lookahead:2.5", "lookahead:2:cold", "lookahead:2:warm:1"):
        with pytest.raises(ValueError, match="lookahead:N needs a whole number N >= 1"):
            make_policy(bad)


def test_the_warm_lookahead_knows_an_earlier_episodes_lengths_not_this_ones():
    from agents.oracle import output_length_estimate

    env = OvercommitEnv(load_scenario("long_outputs"))  # five minutes of arrivals: the history is as long
    warm, cold = make_policy("lookahead:2:warm"), make_policy("lookahead")
    assert warm.name == "lookahead:2:warm" and warm.warm and not cold.warm
    env.reset(seed=5)
    warm.reset(5, env=env)
    # an episode of the same workload: as many outputs as it has requests, none past max_tokens,
    # and not this episode's (whose true lengths are what the lookahead must not see)
    history = warm.history
    truth = sorted(q.stop_at for q in [p[2] for p in env.engine.scheduler.pending] + env.engine.scheduler.unfinished())
    assert len(history) > 100 and max(history) <= 16384 and sorted(history) != truth
    assert abs(np.mean(history) - 2500) < 500  # the workload's lognormal mean, as the engine ends them
    # before anything finishes, the cold estimate has nothing and the warm one the history
    assert len(output_length_estimate(env.engine)[0]) == 0
    lengths, _ = output_length_estimate(env.engine, history)
    assert len(lengths) > 50
    drawn = warm.draws()[0]
    assert np.mean(list(drawn.values())) < 8000  # not every unfinished request at its 16k max_tokens
    cold.reset(5, env=env)
    declared = {q.id: q.request.max_tokens for q in [p[2] for p in env.engine.scheduler.pending]}
    assert cold.draws()[0] == declared  # nothing seen: each at its declared limit
    # the same seed, the same history; another seed, another
    again = make_policy("lookahead:2:warm")
    again.reset(5, env=env)
    other = make_policy("lookahead:2:warm")
    other.reset(6, env=env)
    assert again.history == history and other.history != history
