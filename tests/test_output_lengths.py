"""The output-length estimate (engine/output_lengths.py) and what the snapshot reads from it."""
from __future__ import annotations

import numpy as np

from engine.output_lengths import expected_remaining, kaplan_meier
from engine.request import Request
from engine.snapshot import OUTPUT_LENGTH_WINDOW


def test_kaplan_meier_counts_the_requests_still_going_as_at_least_so_long():
    # ended at 1, 2, 3; one still going after 2 tokens, so 3 at least: at risk 4, 3, 2
    lengths, survival = kaplan_meier([3, 1, 2], [2])
    assert list(lengths) == [1, 2, 3]
    assert list(survival) == [0.75, 0.5, 0.25]
    assert list(kaplan_meier([3], [2])[1]) == [0.5] and list(kaplan_meier([3], [1])[1]) == [0.0]
    # without censoring it is the empirical distribution
    lengths, survival = kaplan_meier([5, 5, 10, 20], [])
    assert list(lengths) == [5, 10, 20] and list(survival) == [0.5, 0.25, 0.0]
    assert kaplan_meier([], [7])[0].size == 0


def by_hand(lengths, survival, generated: int, max_tokens: int) -> float:
    """E[min(L, max_tokens) - generated | L > generated], token by token."""
    def going_past(t):  # P(L > t); the mass past the longest length never ends
        past = [s for n, s in zip(lengths, survival) if n <= t]
        return past[-1] if past else 1.0
    if len(lengths) == 0 or going_past(generated) == 0:
        return max(max_tokens - generated, 0)
    return sum(going_past(t) for t in range(generated, max_tokens)) / going_past(generated)


def test_the_expected_remaining_length_is_the_estimate_s_conditional_mean_capped_at_max_tokens():
    lengths, survival = kaplan_meier([5, 5, 10, 20], [])  # P(L = 5, 10, 20) = 1/2, 1/4, 1/4
    cases = [(0, 1000), (3, 1000), (5, 1000), (7, 1000), (12, 15), (0, 8), (19, 1000), (20, 1000), (30, 25)]
    got = expected_remaining(lengths, survival, [g for g, _ in cases], [m for _, m in cases])
    for (g, m), x in zip(cases, got):
        assert np.isclose(x, by_hand(lengths, survival, g, m)), (g, m, x)
    assert np.isclose(got[0], 0.5 * 5 + 0.25 * 10 + 0.25 * 20)      # nothing generated: the mean
    assert np.isclose(got[3], 0.5 * (10 - 7) + 0.5 * (20 - 7))       # 7 generated: 10 or 20, as likely
    assert np.isclose(got[5], 0.5 * 5 + 0.5 * 8)                     # capped at max_tokens
    assert got[7] == 1000 - 20 and got[8] == 0                       # past every length that ended; past its cap
    # a request still going leaves mass past the longest end: it runs to max_tokens
    lengths, survival = kaplan_meier([4], [9])
    assert np.isclose(expected_remaining(lengths, survival, [0], [64])[0], 0.5 * 4 + 0.5 * 64)
    assert np.isclose(expected_remaining(lengths, survival, [9], [64])[0], 64 - 9)
    # nothing finished yet: what they declared
    assert list(expected_remaining(*kaplan_meier([], [3]), [3, 0], [10, 7])) == [7, 7]
    # the same as by hand on a long-tailed sample with censoring
    rng = np.random.default_rng(0)
    ended, going = rng.lognormal(5, 1, 300).astype(int) + 1, rng.integers(1, 400, 40)
    lengths, survival = kaplan_meier(ended, going)
    for g, m in [(0, 4096), (50, 4096), (300, 512), (900, 4096), (int(lengths[-1]), 5000)]:
        assert np.isclose(expected_remaining(lengths, survival, [g], [m])[0], by_hand(lengths, survival, g, m))


def test_the_snapshot_expects_what_the_running_requests_still_generate_by_the_last_finished(make_engine):
    eng = make_engine(num_blocks=256, block_size=4, segment_blocks=8, max_num_seqs=4)
    assert eng.snapshot().future_expected == 0  # nothing running
    eng.submit(Request("a", 0.0, 8, 3, 40))
    eng.submit(Request("b", 0.0, 8, 30, 40))
    eng.step()
    assert eng.snapshot().future_expected == eng.snapshot().future_declared  # nothing finished: what they declared
    while eng.records["a"].finish_s is None:
        eng.step()
    eng.submit(Request("c", eng.clock, 8, 9, 40))
    eng.step()
    snap, running = eng.snapshot(), eng.scheduler.running
    lengths, survival = kaplan_meier([3], [q.num_generated for q in eng.scheduler.unfinished() if q.num_generated])
    assert np.isclose(snap.future_expected, sum(by_hand(lengths, survival, q.num_generated, q.request.max_tokens)
                                                 for q in running))
    assert snap.future_expected < snap.future_declared
    # the estimate reads the last OUTPUT_LENGTH_WINDOW finished requests only
    assert eng.output_lengths.maxlen == OUTPUT_LENGTH_WINDOW and list(eng.output_lengths) == [3]


def test_the_observation_reads_the_expected_demand_as_a_share_of_the_capacity_over_the_factor_scale(make_engine):
    """Expected demand runs to several times the KV on a loaded deployment (3.4x the median on the
    L40S's long outputs): it is scaled as the declared demand is, by ``overcommit_scale``, not
    clipped at twice the capacity."""
    from env.observation import FEATURES, observe
    from env.scenario import Observation

    eng = make_engine(num_blocks=256, block_size=4, segment_blocks=8, max_num_seqs=4, overcommit=4.0)
    for i in range(4):
        eng.submit(Request(f"r{i}", 0.0, 8, 30, 600))
    eng.step()
    snap, scales = eng.snapshot(), Observation()
    x = observe(snap, scales)[FEATURES.index("expected_ratio")]
    want = (snap.tokens_held + snap.future_expected) / snap.kv_tokens_total / scales.overcommit_scale
    assert 2.0 < want * scales.overcommit_scale and 0 < want < 1 and np.isclose(x, want)


def test_an_episode_starts_with_the_window_of_a_server_long_at_work_and_no_other_draw_moves():
    from env.overcommit_env import OvercommitEnv
    from env.scenario_yaml import load_scenario
    from env.workload_builder import earlier_outputs

    env = OvercommitEnv(load_scenario("long_outputs"))
    env.reset(seed=7)
    engine, sc = env.engine, env.scenario
    window = list(engine.output_lengths)
    earlier = earlier_outputs(sc.workload, sc.episode_s, engine.max_model_len, engine.config.seed)
    assert len(window) == OUTPUT_LENGTH_WINDOW and window == earlier[-OUTPUT_LENGTH_WINDOW:]
    assert max(window) <= 16384 and 1500 < np.mean(window) < 3500  # lognormal, mean 2,500
    own = sorted(p[2].stop_at for p in engine.scheduler.pending)
    assert own and sorted(earlier) != own  # another stretch of the workload, not this episode's requests
    # the window is drawn from its own stream: the episode's requests are those drawn without it
    from env.workload_builder import episode_requests
    rng = np.random.default_rng(7)
    rng.integers(2**31)  # the engine's seed, drawn first (OvercommitEnv.reset)
    requests, _ = episode_requests(sc.workload, sc.episode_s, engine.max_model_len, rng)
    assert sorted(min(r.output_len, r.max_tokens) for r in requests) == own
    # a trace's other windows may be this episode's: its window starts empty
    trace = OvercommitEnv(load_scenario("trace"))
    trace.reset(seed=7)
    assert len(trace.engine.output_lengths) == 0
