"""TensorBoard review: a short DQN run with the ReviewCallback on two environments writes every
episode's figures and the model's train/rollout figures to real event files; the evaluation
table (text and scalars) and the hyperparameters (HParams plugin) land there too."""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import yaml
from stable_baselines3.common.callbacks import BaseCallback, CallbackList
from stable_baselines3.common.vec_env import DummyVecEnv

from experiments import SCENARIOS
from agents.spec import make_policy
from agents.dqn import OvercommitDQN
from engine.control import ACTIONS
from env.overcommit_env import OvercommitEnv
from env.scenario_yaml import scenario_from_dict
from rlctl.evaluate import evaluate
from rlctl.report import EVAL_ROWS, ROWS, format_table
from rlctl.tensorboard import TERMS, ReviewCallback, flatten_hparams, log_evaluation, log_hparams
from tests.tensorboard_events import event_files, read_hparams, read_scalars, read_text


def short(name: str, steps: int) -> dict:
    data = yaml.safe_load((SCENARIOS / f"{name}.yaml").read_text())
    return {**data, "name": name, "max_steps": steps}


class EpisodeEnds(BaseCallback):
    """The steps at which the test saw episodes end, and how many."""

    def __init__(self) -> None:
        super().__init__()
        self.steps: list[int] = []

    def _on_step(self) -> bool:
        self.steps += [self.num_timesteps for info in self.locals["infos"] if "summary" in info]
        return True


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("tb")
    sc = scenario_from_dict(short("burst", 10))
    venv = DummyVecEnv([lambda: OvercommitEnv(sc) for _ in range(2)])
    model = OvercommitDQN(env=venv, tensorboard_log=str(root), learning_starts=20, train_freq=4, batch_size=16,
                          buffer_size=1000, seed=0, verbose=0)
    ends = EpisodeEnds()
    model.learn(120, callback=CallbackList([ReviewCallback(window=5), ends]), tb_log_name="run")
    run_dir = Path(model.logger.get_dir())
    assert run_dir == root / "run_1"
    return model, run_dir, ends.steps


def finite(points) -> bool:
    return bool(points) and all(math.isfinite(v) for _, v in points)


def test_every_episode_and_the_models_training_figures_reach_the_event_files(trained):
    model, run_dir, ends = trained
    assert event_files(run_dir)
    scalars = read_scalars(run_dir)
    episode_tags = (["episode/reward", "episode/length", "episode/goodput_tokens_per_s", "episode/tokens_per_s",
                     "episode/kv_util_mean", "episode/kv_util_p99", "episode/oom_events", "episode/preemptions",
                     "episode/overcommit_mean", "episode/shield_overrides", "rolling/reward"]
                    + [f"episode/reward_terms/{t}" for t in TERMS] + [f"episode/raw_terms/{t}" for t in TERMS]
                    + [f"actions/share_{a}" for a in ACTIONS])
    model_tags = ["train/loss", "train/q_mean", "train/td_abs_mean", "train/per_beta", "train/priority_mean",
                  "rollout/exploration_rate"]
    for tag in episode_tags + model_tags:
        assert finite(scalars.get(tag)), f"{tag}: {scalars.get(tag)}"

    # every episode end is written at its own step (episodes ending together are averaged): none lost
    assert len(ends) == 12  # 120 steps / 2 envs / 10 steps per episode
    assert [s for s, _ in scalars["episode/reward"]] == sorted(set(ends))
    assert scalars["episode/count"][-1][1] == len(ends)
    assert all(v == 10 for _, v in scalars["episode/length"])

    # action shares: a distribution over the applied actions at every episode end
    shares = [dict(scalars[f"actions/share_{a}"]) for a in ACTIONS]
    for step in sorted(set(ends)):
        total = sum(s[step] for s in shares)
        assert total == pytest.approx(1.0, abs=1e-5)
        assert all(0 <= s[step] <= 1 for s in shares)

    # the weighted terms add up to the environment's reward; their signs follow the reward's
    terms = [dict(scalars[f"episode/reward_terms/{t}"]) for t in TERMS]
    for step, reward in scalars["episode/reward"]:
        assert sum(t[step] for t in terms) == pytest.approx(reward, rel=1e-4, abs=1e-4)
    w = model.env.get_attr("scenario")[0].reward
    for (s, weighted), (_, raw) in zip(scalars["episode/reward_terms/alloc"], scalars["episode/raw_terms/alloc"]):
        assert weighted == pytest.approx(w.beta * raw, rel=1e-5, abs=1e-6)
    assert all(v <= 0 for _, v in scalars["episode/reward_terms/slo_violation"])
    assert all(v <= 0 for _, v in scalars["episode/reward_terms/ooms"])
    assert all(0 <= v <= 1 for _, v in scalars["episode/kv_util_mean"])
    assert all(1.0 - 1e-6 <= v for _, v in scalars["episode/overcommit_mean"])

    # the model's own figures, including the last gradient step's (dumped at the end of training)
    assert scalars["train/per_beta"][-1][0] == model.num_timesteps
    assert all(0.4 <= v <= 1.0 for _, v in scalars["train/per_beta"])
    assert all(0 <= v <= 1 for _, v in scalars["rollout/exploration_rate"])


def test_evaluation_table_scalars_and_hparams_land_in_the_run(trained):
    model, run_dir, _ = trained
    env = OvercommitEnv(scenario_from_dict(short("burst", 5)))
    results = {p.name: evaluate(env, p, episodes=1, seed=0) for p in (make_policy("static:1.0"), make_policy("vllm"))}
    step = model.num_timesteps
    log_evaluation(model.logger, results, step)  # through the model's own TensorBoard writer

    texts = read_text(run_dir)
    [(text_step, table)] = texts["eval/table/text_summary"]
    assert text_step == step
    md = {}
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("|") and len(cells) == 1 + len(results):
            md[cells[0]] = cells[1:]
    assert md["figure"] == list(results)
    plain = format_table(results, extra_rows=EVAL_ROWS).splitlines()
    width = max(len(label) for label, _, _ in ROWS + EVAL_ROWS)
    for line in plain[1:]:  # the same figures, cell for cell, as format_table prints them
        label, cells = line[:width].strip(), line[width + 2:].split()
        assert md[label] == cells, label

    scalars = read_scalars(run_dir)
    for name, figures in results.items():
        for key in ("goodput_tokens_per_s", "tokens_per_s", "kv_util_mean", "kv_util_p99", "oom_events",
                    "preemptions", "ttft_p50_s", "ttft_p99_s", "episode_reward"):
            tag = f"eval/{name}/{key}"
            if figures[key] is None:
                assert tag not in scalars
            else:
                [(s, v)] = scalars[tag]
                assert s == step and v == pytest.approx(figures[key], rel=1e-5, abs=1e-6)
    assert "eval/static:1/goodput_tokens_per_s" in scalars and "eval/vllm/kv_util_p99" in scalars

    # the same through a run directory, at another step
    log_evaluation(run_dir, results, step + 1)
    assert [s for s, _ in read_text(run_dir)["eval/table/text_summary"]] == [step, step + 1]

    hparams = {"learning_rate": model.learning_rate, "net_arch": (128, 128), "double": model.double,
               "buffer_size": np.int64(1000), "exploration": {"final_eps": 0.05, "fraction": 0.1},
               "scenario": "burst", "seed": None}
    metrics = {"hp/goodput": results["static:1"]["goodput_tokens_per_s"],
               "hp/final_loss": read_scalars(run_dir)["train/loss"][-1][1], "hp/none": None}
    session = log_hparams(run_dir, hparams, metrics)
    assert session == run_dir / "hparams"
    [(rel, data)] = read_hparams(run_dir).items()
    assert rel == "hparams"
    hp = data["hparams"]
    assert hp["learning_rate"] == pytest.approx(1e-4) and hp["buffer_size"] == 1000
    assert hp["net_arch"] == "[128, 128]" and hp["scenario"] == "burst" and hp["seed"] == "None"
    assert hp["exploration.final_eps"] == pytest.approx(0.05) and hp["double"] in (True, 1.0)
    assert sorted(data["metrics"]) == ["hp/final_loss", "hp/goodput"]
    session_scalars = read_scalars(session)
    assert session_scalars["hp/goodput"][0][1] == pytest.approx(metrics["hp/goodput"], rel=1e-5)
    assert finite(session_scalars["hp/final_loss"])


def test_subprocess_environments_are_accumulated_each_with_its_own_weights(tmp_path):
    from functools import partial

    from stable_baselines3.common.vec_env import SubprocVecEnv

    # episodes of 5 and 7 steps never end at the same step in 24 vector steps; beta differs
    fast = scenario_from_dict({**short("burst", 5), "reward": {"beta": 0.5}})
    slow = scenario_from_dict({**short("burst", 7), "reward": {"beta": 2.0}})
    venv = SubprocVecEnv([partial(OvercommitEnv, fast), partial(OvercommitEnv, slow)])
    try:
        model = OvercommitDQN(env=venv, tensorboard_log=str(tmp_path), learning_starts=1000, seed=0)
        model.learn(48, callback=ReviewCallback(), tb_log_name="sub")
    finally:
        venv.close()
    scalars = read_scalars(tmp_path)
    lengths = dict(scalars["episode/length"])
    assert sorted(lengths.items()) == [(10, 5), (14, 7), (20, 5), (28, 7), (30, 5), (40, 5), (42, 7)]
    raw = dict(scalars["episode/raw_terms/alloc"])
    for step, weighted in scalars["episode/reward_terms/alloc"]:
        beta = 0.5 if lengths[step] == 5 else 2.0
        assert weighted == pytest.approx(beta * raw[step], rel=1e-5, abs=1e-6)
    terms = [dict(scalars[f"episode/reward_terms/{t}"]) for t in TERMS]
    for step, reward in scalars["episode/reward"]:
        assert sum(t[step] for t in terms) == pytest.approx(reward, rel=1e-4, abs=1e-4)


def test_flatten_hparams_gives_only_plain_values():
    flat = flatten_hparams({"a": {"b": 1, "c": {"d": np.float32(0.5)}}, "e": [1, 2], "f": None, "g": Path("x"),
                            "h": np.array([1.5, 2.0]), "i": True, "j": "s"})
    assert flat == {"a.b": 1, "a.c.d": 0.5, "e": "[1, 2]", "f": "None", "g": "x", "h": "[1.5, 2.0]", "i": True, "j": "s"}
    assert all(type(v) in (int, float, str, bool) for v in flat.values())
