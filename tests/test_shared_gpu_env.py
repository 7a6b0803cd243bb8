"""``rlctl/SharedGPU-v0``: several engines on one GPU as one environment: the checkers' contract,
determinism, the flat action over (engine, action), the node's books, and bad scenarios refused
naming the field."""
from __future__ import annotations

import math
import warnings

import gymnasium as gym
import numpy as np
import pytest
import yaml

from env import NODE_ENV_ID
from env.node_observation import node_features
from env.node_scenario import load_node_scenario, node_scenario_from_dict
from env.scenario import ScenarioError
from env.scenario_yaml import bundled_scenarios, load_scenario
from env.shared_gpu_env import SharedGPUEnv
from experiments import SCENARIOS


def short(name: str, steps: int = 20, **changes) -> dict:
    data = yaml.safe_load((SCENARIOS / f"{name}.yaml").read_text())
    return {**data, "name": name, "max_steps": steps, **changes}


def test_every_node_scenario_passes_gymnasium_and_sb3_checkers_without_warnings():
    from gymnasium.utils.env_checker import check_env
    from stable_baselines3.common.env_checker import check_env as sb3_check_env

    names = bundled_scenarios(node=True)
    assert len(names) >= 2 and not set(names) & set(bundled_scenarios())
    for name in names:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            check_env(SharedGPUEnv(node_scenario_from_dict(short(name, 5))), skip_render_check=True)
            sb3_check_env(SharedGPUEnv(node_scenario_from_dict(short(name, 5))), warn=True)


def test_the_registered_id_makes_a_node_with_one_observation_block_per_engine():
    env = gym.make(NODE_ENV_ID, scenario=node_scenario_from_dict(short("node_chat_pair", 3)))
    obs, info = env.reset(seed=1)
    names = ["a", "b"]
    assert obs.shape == (len(node_features(names)),) and env.action_space.n == 1 + 5 * len(names)
    assert info["requests"] > 0 and sum(info["limits"].values()) > env.unwrapped.node.device.capacity


def rollout(env: SharedGPUEnv, seed: int, actions: list[int], options: dict | None = None):
    obs, _ = env.reset(seed=seed, options=options)
    out = [obs]
    for a in actions:
        obs, reward, terminated, truncated, info = env.step(a)
        out.append((obs, reward, info["oom_total"], info["restarts"], info["engines"]))
        if terminated or truncated:
            break
    return out


def test_same_seed_and_actions_give_the_same_trajectory():
    env = SharedGPUEnv(node_scenario_from_dict(short("node_chat_pair", 30)))
    actions = list(np.random.default_rng(3).integers(env.action_space.n, size=30))
    a, b = rollout(env, 7, actions), rollout(env, 7, actions)
    assert len(a) == len(b)
    for x, y in zip(a[1:], b[1:]):
        assert np.array_equal(x[0], y[0]) and x[1:] == y[1:]
    c = rollout(env, 8, actions)
    assert not all(np.array_equal(x[0], y[0]) for x, y in zip(a[1:], c[1:]))


def test_an_action_moves_only_its_engine():
    env = SharedGPUEnv(node_scenario_from_dict(short("node_chat_pair", 5)))
    env.reset(seed=0)
    _, _, _, _, info = env.step(1 + 5 * 1 + 0)  # b: scale up
    assert info["applied_action"] == "b:scale_up"
    assert info["engines"]["b"]["overcommit"] == pytest.approx(1.25) and info["engines"]["a"]["overcommit"] == 1.0
    _, _, _, _, info = env.step(1 + 5 * 1 + 4)  # b: resize to back its quota: a graceful restart
    assert info["effect"]["restarted"] and info["restarts"] == 1 and info["oom_total"] == 0
    assert info["engines"]["b"]["restarting"] and info["engines"]["b"]["overcommit"] == 1.0
    assert info["engines"]["b"]["limit"] > info["engines"]["a"]["limit"]


def test_the_limits_a_baseline_pins_and_the_node_summary():
    env = SharedGPUEnv(node_scenario_from_dict(short("node_chat_pair", 10)))
    sc = env.scenario
    _, info = env.reset(seed=0, options={"engine": {"limits": "partition"}})
    assert info["limits"] == {t.name: int(t.share * sc.gpu.memory_bytes) for t in sc.tenants}
    assert sum(info["limits"].values()) <= env.node.device.capacity
    _, info = env.reset(seed=0, options={"engine": {"limits": 1.2, "overcommit": math.inf, "oom_mode": "preempt"}})
    assert info["limits"]["a"] == int(0.6 * sc.gpu.memory_bytes)
    assert all(e.config.oom_mode == "preempt" and math.isinf(e.overcommit) for e in env.node.engines.values())
    rewards, done = [], False
    while not done:
        _, r, term, trunc, info = env.step(0)
        rewards.append(r)
        done = term or trunc
    s = info["summary"]
    assert s["requests_completed"] == s["a/requests_completed"] + s["b/requests_completed"] > 0
    assert s["goodput_tokens_per_s"] == pytest.approx(
        sum(s[f"{n}/goodput_tokens_per_s"] for n in "ab"), rel=0.01)  # the engines' clocks end within an iteration
    # the rewards of an episode add up to its node goodput (omega x OOMs aside)
    assert sum(rewards) + sc.reward.omega * s["oom_events"] == pytest.approx(
        s["goodput_tokens_per_s"] * s["duration_s"] / (env.tokens_per_s_scale * sc.decision_interval_s), rel=0.01)
    with pytest.raises(ValueError, match="limits must be"):
        env.reset(seed=0, options={"engine": {"limits": "all"}})


def test_phases_are_offset_so_peaks_do_not_align():
    env = SharedGPUEnv(node_scenario_from_dict(short("node_chat_pair", 150)))
    env.reset(seed=5)
    arrivals = {n: np.array([r.arrival_s for r in e.records.values()]) for n, e in env.node.engines.items()}
    per_10s = {n: np.histogram(a, bins=np.arange(0, 301, 10))[0] for n, a in arrivals.items()}
    assert np.corrcoef(per_10s["a"], per_10s["b"])[0, 1] < 0  # one busy while the other is quiet


@pytest.mark.parametrize("change, field", [
    ({"tenants": []}, "tenants"),
    ({"cycle": None}, "tenants[0].workload.phases"),
    ({"cycle": {"mean_dwell_s": [60.0, 0.0]}}, "cycle.mean_dwell_s[1]"),
])
def test_bad_node_scenarios_are_refused_naming_the_field(change, field):
    with pytest.raises(ScenarioError, match=field.replace("[", r"\[").replace("]", r"\]")):
        node_scenario_from_dict(short("node_chat_pair", 5, **change))


@pytest.mark.parametrize("key, value, field", [
    ("share", 0.8, "tenants"), ("limit", 1.5, "tenants[0].limit"), ("limit", 0.1, "tenants[0].limit"),
    ("deployment", "llama7b-fp16-a10", "tenants[1].deployment"), ("name", "b", "tenants[0].name"),
    ("engine", {"oom_mode": "explode"}, "tenants[0].engine"), ("compute_share", 0.0, "tenants[0].compute_share"),
])
def test_bad_tenants_are_refused_naming_the_field(key, value, field):
    data = short("node_chat_pair", 5)
    data["tenants"] = [{**data["tenants"][0], key: value}, data["tenants"][1]]
    if field == "tenants[1].deployment":  # a node is one GPU: the tenant that differs from the first is named
        data["tenants"] = [data["tenants"][1], {**data["tenants"][0], "name": "a"}]
    with pytest.raises(ScenarioError, match=field.replace("[", r"\[").replace("]", r"\]")):
        node_scenario_from_dict(data)


def test_a_node_scenario_is_not_an_engine_scenario():
    with pytest.raises(ScenarioError, match="node scenario.*SharedGPU-v0"):
        load_scenario("node_chat_pair")
    assert load_node_scenario("node_chat_pair").names == ["a", "b"]
