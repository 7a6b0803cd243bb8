"""Runs of decode iterations advanced at once keep exactly the books of stepping one at a time.

For many seeds, every bundled scenario and random action sequences, the environment with the
fast path (``Engine.fast_forward``, engine/decode_run.py) and without it gives the same
observations, rewards, episode figures, counters and iteration log, bit for bit.
"""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.config import EngineConfig, ModelConfig
from engine.control import ACTIONS, apply_action
from engine.cost_model import CostModel
from engine.engine import Engine
from engine.executor import ProfiledExecutor
from engine.metrics import summarize
from engine.records import IterationLog
from engine.roofline import L40S_48GB, RooflineCostModel
from engine.request import Request
from env.overcommit_env import OvercommitEnv
from env.scenario_yaml import bundled_scenarios, load_scenario
from dataclasses import replace

STEPS = 60


def episode(scenario, seed: int, actions_seed: int, fast: bool):
    env = OvercommitEnv(scenario)
    obs, _ = env.reset(seed=seed)
    env.engine.fast_forward = fast
    rng = np.random.default_rng(actions_seed)
    trace = [obs]
    while True:
        obs, reward, terminated, truncated, info = env.step(int(rng.integers(len(ACTIONS))))
        trace += [obs, reward, info["kv_util"], info["goodput_tokens_per_s"]]
        if terminated or truncated:
            return trace, info["summary"], env.engine


def log(engine: Engine) -> dict:
    return {name: engine.iterations.column(name).tolist() for name in IterationLog.COLUMNS}


@pytest.mark.parametrize("name", bundled_scenarios())
def test_fast_and_exact_keep_the_same_books_on_every_scenario(name):
    sc = replace(load_scenario(name), max_steps=STEPS)
    for seed, actions_seed in ((0, 1), (7, 2)):
        exact, exact_summary, e = episode(sc, seed, actions_seed, fast=False)
        fast, fast_summary, f = episode(sc, seed, actions_seed, fast=True)
        assert len(exact) == len(fast)
        for a, b in zip(exact, fast):
            assert np.array_equal(a, b)
        assert exact_summary == fast_summary
        assert e.counters == f.counters and e.clock == f.clock and e.traffic == f.traffic
        assert log(e) == log(f)
        assert [vars(r) for r in e.completed] == [vars(r) for r in f.completed]


COST = CostModel(fixed_s=2e-3, per_token_s=3e-5, per_context_token_s=4e-8, per_attended_s=1e-9, copy_fixed_s=1e-5,
                 copy_bytes_per_s=2e9)


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**31), st.sampled_from(["crash", "preempt"]), st.sampled_from([1.0, 1.5, 2.5]),
       st.integers(8, 96), st.floats(0.0, 0.9), st.sampled_from(["overcommit", "sglang", "sglang:code"]),
       st.sampled_from([0.0, 0.15]),
       st.sampled_from([None, 0.4, 1.5]), st.sampled_from(["whole", "chunk"]),
       st.sampled_from(["recomputed", "cached", "lru", "prefix cache"]), st.sampled_from([None, 48]))
def test_random_engines_keep_the_same_books(seed, mode, factor, num_blocks, tenant_share, admission, headroom, timeout,
                                            prompt_blocks, preempted_kv, window):
    rng = np.random.default_rng(seed)
    sessions = [None, None, "a", "b"]  # idle contexts: blocks the headroom counts as free
    prompts = rng.integers(1, 200, size=30)
    # prompts from three chains of hash ids (32 tokens each): a prefix cache's hits
    reqs = [Request(f"r{i}", float(rng.uniform(0, 3)), int(prompts[i]), int(rng.integers(1, 300)),
                    int(rng.integers(300, 600)), session_id=sessions[int(rng.integers(4))],
                    hash_ids=tuple(range(c, c + -(-int(prompts[i]) // 32))), hash_block_tokens=32)
            for i, c in zip(range(int(rng.integers(1, 30))), rng.integers(3, size=30) * 100)]
    prefix = preempted_kv == "prefix cache"
    actions = rng.integers(len(ACTIONS), size=40).tolist()

    def books(fast: bool):
        cfg = EngineConfig(num_blocks=num_blocks, segment_blocks=4, max_num_seqs=12, max_num_batched_tokens=256,
                           max_model_len=min(1024, num_blocks * 16), oom_mode=mode, restart_downtime_s=0.3,
                           overcommit_max=3.0, overcommit=factor, admission=admission.split(":")[0],
                           sglang_rule="code" if admission == "sglang:code" else "spec",
                           sglang_new_token_ratio_decay_steps=40, client_timeout_s=timeout, prompt_blocks=prompt_blocks,
                           preempted_kv="recomputed" if prefix else preempted_kv, prefix_caching=prefix)
        # a roofline clock whose second layer attends through a 48-token window, or a profile's
        cost = COST if window is None else RooflineCostModel(L40S_48GB, ModelConfig(sliding_window=window,
                                                                                  window_layers=(1,)))
        eng = Engine(ModelConfig(), cfg, executor=ProfiledExecutor(cost), fast_forward=fast)
        eng.set_admit_headroom(headroom)
        for r in reqs:
            if r.prompt_len < eng.max_model_len:
                eng.submit(r)
        k = 0
        while eng.has_work() and k < 400:
            k += 1
            if k == 5:
                eng.device.set_tenants(int(tenant_share * eng.device.free))
            if k == 15:
                eng.device.set_tenants(0)
            apply_action(eng, actions[k % len(actions)], 0.3)
            eng.run(until=k * 0.25)
        return (summarize(eng), eng.counters, log(eng), [vars(r) for r in eng.completed], eng.clock,
                [vars(r) for r in eng.records.values()])

    assert books(False) == books(True)


def test_sglangs_code_marks_its_batch_full_in_the_middle_of_a_run_as_stepping_does():
    # "H" is held back by the admission headroom, which the scheduler checks after SGLang's rule; with
    # the ratio at its floor the rule's sums grow with every decode and refuse H part way through the
    # run, marking the batch full, so that once H's client gives up "H2" still waits for A to finish.
    # A run that only saw the headroom would have tried H2 (a review found it)
    def run(fast: bool):
        cfg = EngineConfig(num_blocks=100, max_num_seqs=12, max_num_batched_tokens=2048, max_model_len=1600,
                           admission="sglang", sglang_rule="code", sglang_new_token_ratio_decay_steps=10,
                           client_timeout_s=1.0)
        eng = Engine(ModelConfig(), cfg, executor=ProfiledExecutor(COST), fast_forward=fast)
        eng.set_admit_headroom(0.15)
        eng.submit(Request("A", 0.0, 800, 1000, 1000))
        eng.run(until=0.06)
        eng.submit(Request("H", eng.clock, 560, 10, 10))
        eng.submit(Request("H2", eng.clock + 0.1, 16, 5, 5))
        eng.run(until=eng.clock + 0.999)
        marked = eng.scheduler.ratio.batch_full
        eng.run()
        return marked, summarize(eng), log(eng), [vars(r) for r in eng.records.values()]

    exact, fast = run(False), run(True)
    assert exact[0] and exact[3][2]["first_token_s"] is None  # H2 never served: it gave up behind the mark
    assert fast == exact


def test_a_windowed_clock_keeps_the_same_books_and_charges_only_the_window():
    # a roofline clock whose layers 1 and 3 of 4 read the last 64 keys: decodes past the window cost
    # less than under full attention, and runs of them advanced at once keep the books of stepping; read
    # in chunks of 64 (Llama 4's), each query reads its chunk's keys up to its own, fewer again
    def books(window: int | None, fast: bool, chunked: bool = False):
        model = ModelConfig(num_layers=4, sliding_window=window, window_layers=(1, 3) if window else (),
                            window_chunked=chunked)
        cfg = EngineConfig(num_blocks=256, max_num_seqs=8, max_num_batched_tokens=256, max_model_len=2048)
        eng = Engine(ModelConfig(), cfg, executor=ProfiledExecutor(RooflineCostModel(L40S_48GB, model)),
                     fast_forward=fast)
        for i in range(6):
            eng.submit(Request(f"r{i}", 0.05 * i, 40 + 30 * i, 400, 400))
        eng.run()
        return summarize(eng), eng.counters, log(eng), [vars(r) for r in eng.completed], eng.clock

    windowed = books(64, fast=False)
    assert windowed == books(64, fast=True)
    assert windowed[-1] < books(None, fast=False)[-1]  # the same work, sooner
    chunked = books(64, fast=False, chunked=True)
    assert chunked == books(64, fast=True, chunked=True)
    assert chunked[-1] < windowed[-1]


def test_a_windowed_chunk_reads_and_scores_what_a_brute_count_finds():
    from engine.scheduler import windowed

    for window in (1, 2, 3, 5, 8):
        for end in range(1, 24):
            for n in range(1, end + 1):
                keys, pairs = set(), 0
                for q in range(end - n + 1, end + 1):  # positions counted from 1
                    seen = range(max(1, q - window + 1), q + 1)
                    keys.update(seen)
                    pairs += len(seen)
                assert windowed(n, end, window) == (len(keys), pairs), (n, end, window)
                keys, pairs = set(), 0  # in aligned chunks of the window's length (Llama 4's)
                for q in range(end - n + 1, end + 1):
                    seen = range((q - 1) // window * window + 1, q + 1)
                    keys.update(seen)
                    pairs += len(seen)
                assert windowed(n, end, window, chunked=True) == (len(keys), pairs), (n, end, window)
    assert windowed(5, 40, None) == (40, 5 * 40 - 10)  # full attention
