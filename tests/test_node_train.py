"""``rlctl train`` on a node scenario: a short real run trains a DQN on rlctl/SharedGPU-v0, judges
it against the node's baselines on held-out seeds, and exports a node policy that ``rlctl eval``
loads and runs, and refuses where it does not belong; bad node training configurations are refused."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import yaml

from agents.node_spec import make_node_policy
from env.node_observation import node_features
from env.node_scenario import load_node_scenario
from env.scenario import ScenarioError
from experiments import POLICIES, SCENARIOS
from rlctl.cli import main
from rlctl.train import is_node_config, load_train_config


def configs(tmp_path: Path, **extra) -> Path:
    data = yaml.safe_load((SCENARIOS / "node_chat_pair.yaml").read_text())
    scenario = tmp_path / "tiny_node.yaml"
    scenario.write_text(yaml.safe_dump({**data, "name": "tiny_node", "max_steps": 10}))
    cfg = tmp_path / "tiny_node_train.yaml"
    cfg.write_text(yaml.safe_dump({"scenarios": [str(scenario)], "eval_episodes": 1, "eval_every": 100,
                                   "timesteps": 200, "n_envs": 1, "learning_starts": 40, "buffer_size": 1000,
                                   "checkpoint_every": 100, "target_update_interval": 50, "net_arch": [32, 32],
                                   **extra}))
    return cfg


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("node_train")
    cfg = configs(tmp)
    assert main(["train", "--config", str(cfg), "--logdir", str(tmp / "runs"), "--no-progress"]) == 0
    (rundir,) = (tmp / "runs").iterdir()
    return tmp, load_train_config(cfg), rundir


def test_a_node_run_trains_judges_against_the_node_baselines_and_exports_a_node_policy(run):
    tmp, cfg, rundir = run
    assert is_node_config(cfg)
    saved = json.loads((rundir / "evaluation.json").read_text())
    assert saved["timesteps"] >= 200 and saved["held_out"] and list(rundir.glob("events.out.tfevents.*"))
    assert list(saved["results"]) == ["dqn", "partition", "overcommit:1.5", "static:1", "watermark", "vllm", "sglang",
                                      "random"]
    dqn = saved["results"]["dqn"]
    assert dqn["requests_submitted"] == saved["results"]["partition"]["requests_submitted"] > 0
    assert {"a/goodput_tokens_per_s", "b/goodput_tokens_per_s", "slo_attainment_min"} <= set(dqn)
    header = saved["header"]
    assert header["node"] == {"engines": ["a", "b"], "deployments": ["llama7b-fp16-h100"] * 2}
    assert header["observation"]["features"] == node_features(["a", "b"]) and len(header["actions"]) == 11
    # the review: every node action's share at each episode end, a distribution over the applied actions
    from tests.tensorboard_events import read_scalars

    scalars = read_scalars(rundir)
    shares = [dict(scalars[f"actions/share_{a.replace(':', '/')}"]) for a in header["actions"]]
    assert "actions/share_scale_up" not in scalars and len(shares[0]) >= 200 // 10
    for step in shares[0]:
        assert sum(s[step] for s in shares) == pytest.approx(1.0, abs=1e-5)


def test_the_node_policy_loads_and_acts_in_eval(run, capsys):
    tmp, cfg, rundir = run
    policy = make_node_policy(str(rundir / "policy.rlpolicy"), ["a", "b"])
    obs = np.zeros(len(node_features(["a", "b"])), dtype=np.float32)
    assert 0 <= policy.act(obs) < 11
    out = tmp / "eval.json"
    assert main(["eval", "--scenario", cfg.scenarios[0], "--policy", str(rundir / "policy.rlpolicy"), "--steps", "4",
                 "--json", str(out)]) == 0
    assert "a: goodput (tok/s)" in capsys.readouterr().out
    (r,) = json.loads(out.read_text())["results"].values()
    assert r["steps"] == 4 and sum(r["actions"].values()) == 4


@pytest.mark.parametrize("scenario, message", [
    ("steady", "trained for a node of engines ['a', 'b']: evaluate it on a node scenario"),
    ("node_mixed", "trained on a node of engines ['a', 'b'], this node has ['reason', 'chat']"),
])
def test_a_node_policy_is_refused_where_it_does_not_belong(run, capsys, scenario, message):
    tmp, cfg, rundir = run
    assert main(["eval", "--scenario", scenario, "--policy", str(rundir / "policy.rlpolicy"), "--steps", "2"]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("extra", [{"loads": [1.5]}, {"eval_starts": [0, 100]}, {"scenarios": ["node_chat_pair", "steady"]}])
def test_bad_node_training_configuration_is_refused_naming_the_field(tmp_path, extra):
    with pytest.raises(ScenarioError, match="scenarios: a node policy trains on one node scenario"):
        load_train_config(configs(tmp_path, **extra))


def test_the_shipped_node_training_configs_load():
    for name in ("node_chat_pair", "node_mixed", "node_reasoning", "node_reasoning_preempt", "node_reasoning_trio"):
        cfg = load_train_config(name)
        assert is_node_config(cfg) and cfg.scenarios == (name,) and cfg.n_envs == 2


def test_the_shipped_node_policies_load_by_name_and_steer_their_node(capsys):
    """experiments/policies/node_*.rlpolicy: what the README's node results evaluate, each on its node."""
    shipped = sorted(p.stem for p in POLICIES.glob("node_*.rlpolicy"))
    assert "node_reasoning_preempt" in shipped
    for name in shipped:
        policy = make_node_policy(name, load_node_scenario(name).names)
        assert policy.header["node"]["engines"] == load_node_scenario(name).names
        assert main(["eval", "--scenario", name, "--policy", name, "--steps", "3"]) == 0
        assert name in capsys.readouterr().out
