"""The Gymnasium environment: the checkers' contract, determinism, the reward's terms, the
baselines on a bursty scenario, and bad configuration refused at load naming the field."""
from __future__ import annotations

import math
import warnings

import gymnasium as gym
import numpy as np
import pytest
import yaml

from experiments import SCENARIOS
from agents.spec import make_policy
from env import ENV_ID
from env.observation import FEATURES
from engine.control import ACTIONS
from env.overcommit_env import OvercommitEnv
from env.scenario import ScenarioError
from env.scenario_yaml import bundled_scenarios, load_scenario, scenario_from_dict
from rlctl.evaluate import evaluate


def short(name: str, steps: int = 20) -> dict:
    data = yaml.safe_load((SCENARIOS / f"{name}.yaml").read_text())
    return {**data, "name": name, "max_steps": steps}


def test_every_bundled_scenario_passes_gymnasium_and_sb3_checkers_without_warnings():
    from gymnasium.utils.env_checker import check_env
    from stable_baselines3.common.env_checker import check_env as sb3_check_env

    names = bundled_scenarios()
    assert {"steady", "burst", "long_context", "sessions", "cotenant"} <= set(names)
    for name in names:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            check_env(OvercommitEnv(scenario_from_dict(short(name, 5))), skip_render_check=True)
            sb3_check_env(OvercommitEnv(scenario_from_dict(short(name, 5))), warn=True)


def test_registered_id_makes_the_environment():
    env = gym.make(ENV_ID, scenario=scenario_from_dict(short("burst", 3)))
    obs, info = env.reset(seed=1)
    assert obs.shape == (len(FEATURES),) and env.action_space.n == len(ACTIONS)
    assert info["requests"] > 0


def rollout(env: OvercommitEnv, seed: int, actions: list[int]):
    obs, _ = env.reset(seed=seed)
    out = [obs]
    for a in actions:
        obs, reward, terminated, truncated, info = env.step(a)
        out.append((obs, reward, info["kv_util"], info["overcommit"], info["oom_total"]))
        if terminated or truncated:
            break
    return out


def same(a, b) -> bool:
    return all(np.array_equal(x[0] if isinstance(x, tuple) else x, y[0] if isinstance(y, tuple) else y)
               and (not isinstance(x, tuple) or x[1:] == y[1:]) for x, y in zip(a, b)) and len(a) == len(b)


def test_same_seed_and_actions_give_the_same_trajectory_and_another_seed_does_not():
    sc = scenario_from_dict(short("sessions", 30))
    actions = [int(a) for a in np.random.default_rng(7).integers(0, len(ACTIONS), 30)]
    first = rollout(OvercommitEnv(sc), 3, actions)
    again = rollout(OvercommitEnv(sc), 3, actions)
    other = rollout(OvercommitEnv(sc), 4, actions)
    assert same(first, again)
    assert not same(first, other)


def test_info_carries_the_raw_figures_and_the_episode_summary_is_the_engines():
    from engine.metrics import summarize

    env = OvercommitEnv(scenario_from_dict(short("burst", 8)))
    env.reset(seed=0)
    for _ in range(8):
        obs, reward, terminated, truncated, info = env.step(1)
        assert env.observation_space.contains(obs)
        t = info["reward_terms"]
        w = env.scenario.reward
        assert reward == pytest.approx(w.alpha * t["goodput"] + w.beta * t["alloc"] - w.gamma * t["slo_violation"]
                                       - w.omega * t["ooms"] - w.rho * t["recompute"])
        for key in ("generated_tokens_per_s", "goodput_tokens_per_s", "kv_util", "oom_events", "ttft_p50_s", "overcommit"):
            assert key in info
    assert truncated and not terminated
    summary = info["summary"]
    assert {k: summary[k] for k in summarize(env.engine)} == summarize(env.engine)
    step, top = env.engine.config.overcommit_step, env.engine.config.overcommit_max  # multiplicative steps, capped
    assert summary["actions"]["scale_up"] == 8 and info["overcommit"] == pytest.approx(min(step ** 8, top))


def test_an_oom_ends_the_episode_only_when_the_scenario_says_so():
    data = short("burst", 150)
    for terminate in (False, True):
        env = OvercommitEnv(scenario_from_dict({**data, "terminate_on_oom": terminate}),
                            engine_overrides={"overcommit": 4.0})
        env.reset(seed=0)
        while True:
            *_, terminated, truncated, info = env.step(0)
            if terminated or truncated:
                break
        assert info["oom_total"] >= 1
        assert terminated == terminate
        assert (info["step"] < 150) == terminate
        if terminate:
            assert info["oom_events"] == 1


def test_a_co_tenant_takes_device_memory_as_its_schedule_says():
    env = OvercommitEnv(scenario_from_dict(short("cotenant", 150)))
    env.reset(seed=2)
    levels = set()
    for _ in range(150):
        *_, terminated, truncated, info = env.step(0)
        levels.add(round(env.engine.device.charged["tenants"] / env.engine.device.capacity, 2))
        if terminated or truncated:
            break
    assert levels <= {0.0, 0.1, 0.2} and len(levels) >= 2


@pytest.fixture(scope="module")
def burst_baselines():
    env = OvercommitEnv(load_scenario("burst"))
    return {spec: evaluate(env, make_policy(spec), episodes=2, seed=0)
            for spec in ("static:1.0", "static:2.0", "static:3.0", "watermark", "vllm", "random")}


def test_on_bursts_the_baselines_order_as_physics_says(burst_baselines):
    r = burst_baselines
    assert r["static:1.0"]["oom_events"] == 0
    assert r["static:1.0"]["kv_util_mean"] == min(x["kv_util_mean"] for x in r.values())
    assert r["static:3.0"]["oom_events"] > 0
    assert r["vllm"]["preemptions"] > 0 and r["vllm"]["oom_events"] == 0
    assert r["static:2.0"]["goodput_tokens_per_s"] > r["static:1.0"]["goodput_tokens_per_s"]
    assert r["static:3.0"]["goodput_tokens_per_s"] < r["static:1.0"]["goodput_tokens_per_s"]


GENERATED = {"arrivals": {"kind": "poisson", "rate": 1.0}, "prompt": {"kind": "lognormal", "mean": 100, "sigma": 1},
             "output": {"kind": "lognormal", "mean": 100, "sigma": 1}}


def test_a_whole_length_bound_written_with_a_point_reads_as_its_integer():
    from env.workload_builder import _lengths

    data = {**short("burst"), "workload": {**GENERATED, "output": {"kind": "lognormal", "mean": 100, "sigma": 1,
                                                                   "low": 16.0, "high": 16000.0}}}
    lengths = _lengths(scenario_from_dict(data).workload.output)  # it loads (it was refused), and reads ints
    assert (lengths.low, lengths.high) == (16, 16000) and type(lengths.low) is type(lengths.high) is int


@pytest.mark.parametrize("patch, field", [
    ({"workload": {"trace": "azure2023_conv.csv", "time_scal": 2}}, "workload.time_scal"),
    ({"bogus": 1}, "bogus"),
    ({"workload": {"arrivals": {"kind": "poisson", "rate": -1.0}, "prompt": {"kind": "lognormal", "mean": 100, "sigma": 1},
                   "output": {"kind": "lognormal", "mean": 100, "sigma": 1}}}, "rate"),
    ({"max_steps": 0}, "max_steps"),
    ({"decision_interval_s": -2}, "decision_interval_s"),
    ({"workload": {"trace": "no_such_trace.csv"}}, "no_such_trace.csv"),
    ({"deployment": "tpu-v9"}, "deployment"),
    ({"reward": {"omega": "ten"}}, "reward.omega"),
    ({"engine": {"num_blockz": 3}}, "engine"),
    ({"cotenant": {"levels": [0.0, 1.5]}}, "cotenant.levels[1]"),
    ({"workload": {"trace": "azure2023_conv.csv", "max_tokens": "some"}}, "max_tokens"),
    # a distribution's value of the wrong type or range names its key and where it sits (each raised a
    # TypeError or KeyError traceback, was refused without the field, or was cut to an integer)
    *[({"workload": {**GENERATED, **w}}, f) for w, f in [
        ({"arrivals": {"kind": "mmpp", "rates": [1, 2], "mean_dwell_s": 10}}, "workload.arrivals: mean_dwell_s must be a list"),
        ({"arrivals": {"kind": "poisson", "rate": "fast"}}, "workload.arrivals: rate must be a finite number, got 'fast'"),
        ({"output": {"kind": "lognormal", "mean": -2500, "sigma": 1}}, "workload.output: mean must be > 0"),
        ({"output": {"kind": "pareto", "alpha": 1.2, "low": 1.5, "high": 100.0}}, "workload.output: low must be an integer"),
        ({"prompt": {"kind": "trace", "trace": 5, "column": "prompt"}}, "workload.prompt: trace must name a trace file"),
        ({"sessions": {"mean_turns": 3, "mean_think_s": 5, "first_prompt": "x"}},
         "workload.sessions.first_prompt: must be a mapping with a kind"),
        ({"sessions": {"mean_turns": 3, "mean_think_s": 5, "first_prompt": {"kind": "poisson", "rate": 3}}},
         "workload.sessions.first_prompt.kind: unknown kind 'poisson'"),
        ({"sessions": {"mean_turns": -3, "mean_think_s": 5}}, "sessions.mean_turns must be > 0, got -3"),
        ({"sessions": {"mean_turns": "x", "mean_think_s": 5}}, "sessions.mean_turns must be a finite number"),
    ]],
])
def test_bad_configuration_fails_at_load_naming_the_field(patch, field):
    data = {**short("burst"), **patch}
    with pytest.raises(ScenarioError, match=field.replace("[", r"\[").replace("]", r"\]")):
        scenario_from_dict(data)


def test_a_window_after_the_traces_end_a_folder_and_a_binary_file_are_refused_by_name(tmp_path, capsys):
    """A trace scenario whose windows start past its trace's last arrival replayed empty episodes (0
    goodput, no warning); a folder or a binary file where a YAML file belongs raised a traceback."""
    from rlctl.cli import main

    with pytest.raises(ScenarioError, match=r"workload.starts: its windows start at 1e\+09 s or later, where "
                                            r"azure2023_conv.csv has no request left \(it spans 3\d{3}"):
        scenario_from_dict({**short("steady"), "workload": {"trace": "azure2023_conv.csv", "starts": [1e9, 2e9]}})
    folder, binary = tmp_path / "adir.yaml", tmp_path / "bin.yaml"
    folder.mkdir()
    binary.write_bytes(b"\xff\xfe\x00\x01")
    for path, why in ((folder, "a directory, not a YAML file"), (binary, "cannot be read as a YAML file")):
        assert main(["sweep", "--scenario", str(path), "--episodes", "1", "--no-oracle"]) == 2
        assert f"{path}: {why}" in capsys.readouterr().err
    assert main(["compare", "--candidate", "default", "--reference", "default", "--cases", str(tmp_path)]) == 2
    assert "a directory, not a YAML file" in capsys.readouterr().err


def test_a_missing_scenario_file_and_an_unknown_policy_are_refused_by_name(tmp_path):
    with pytest.raises(ScenarioError, match="nowhere.yaml"):
        load_scenario(tmp_path / "nowhere.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("workload: [1, 2\n")
    with pytest.raises(ScenarioError, match="bad.yaml"):
        load_scenario(bad)
    for spec in ("greedy", "static:", "static:-1", "static:abc"):
        with pytest.raises(ValueError, match="policy"):
            make_policy(spec)
    env = OvercommitEnv(scenario_from_dict(short("burst", 2)))
    env.reset(seed=0)
    with pytest.raises(ValueError, match="action"):
        env.step(7)
    assert not math.isnan(env.step(0)[1])
