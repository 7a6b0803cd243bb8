"""``rlctl train``: a short real run writes TensorBoard events, checkpoints and a policy that
``rlctl eval`` loads; ``--resume`` continues where it stopped; bad configurations are refused."""
from __future__ import annotations

import dataclasses

import json
import re
import zipfile
from pathlib import Path

import pytest
import yaml

from experiments import SCENARIOS
from agents.spec import make_policy
from env.scenario import Reward, ScenarioError
from env.scenario_yaml import load_scenario
from rlctl.cli import main
from rlctl.evaluate import evaluate, make_env
from rlctl.train import load_train_config, train


def configs(tmp_path: Path, base: str = "steady", max_steps: int = 20, **extra) -> Path:
    data = yaml.safe_load((SCENARIOS / f"{base}.yaml").read_text())
    scenario = tmp_path / "tiny.yaml"
    scenario.write_text(yaml.safe_dump({**data, "max_steps": max_steps}))
    cfg = tmp_path / "tiny_train.yaml"
    cfg.write_text(yaml.safe_dump({"scenarios": [str(scenario)], "eval_starts": [2450, 3450], "eval_episodes": 1,
                                   "eval_every": 100, "timesteps": 240, "n_envs": 2, "learning_starts": 40,
                                   "buffer_size": 1000, "checkpoint_every": 120, "target_update_interval": 50,
                                   "net_arch": [32, 32], **extra}))
    return cfg


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("train")
    cfg = load_train_config(configs(tmp))
    return tmp, cfg, train(cfg, tmp / "runs", progress_bar=False, baseline_specs=["static:1.0", "vllm"])


def test_a_run_writes_events_checkpoints_and_a_policy_that_eval_loads(run, capsys):
    tmp, cfg, out = run
    rundir = Path(out["run"])
    assert out["timesteps"] >= 240 and list(rundir.glob("events.out.tfevents.*"))
    assert sorted(p.name for p in (rundir / "checkpoints").glob("*.zip"))
    assert set(out["results"]) == {"dqn", "static:1", "vllm"}
    assert out["held_out"] and out["held_out"][0]["timesteps"] >= 100
    policy = make_policy(out["policy"])
    assert policy.header["training"]["scenarios"] == list(cfg.scenarios)
    saved = json.loads((rundir / "evaluation.json").read_text())
    assert saved["results"]["dqn"]["requests_submitted"] == saved["results"]["vllm"]["requests_submitted"]
    assert main(["eval", "--scenario", cfg.scenarios[0], "--policy", out["policy"], "--steps", "5"]) == 0
    assert "policy" in capsys.readouterr().out


def test_resume_continues_from_a_checkpoint_into_a_new_folder_leaving_the_run_it_continues(run):
    tmp, cfg, out = run
    checkpoint = sorted(Path(out["run"], "checkpoints").glob("rl_model_*_steps.zip"))[0]
    before = {p.name: p.read_bytes() for p in Path(out["run"]).iterdir() if p.is_file()}
    # a configuration naming init_policy (every finetune_*.yaml does) resumes: its checkpoint descends from it
    more = train(load_train_config(configs(tmp), timesteps=360, init_policy=out["policy"]), tmp / "runs",
                 resume=str(checkpoint), progress_bar=False, baseline_specs=[])
    assert more["run"] == out["run"] + "_resumed" and more["timesteps"] >= 360
    assert {p.name: p.read_bytes() for p in Path(out["run"]).iterdir() if p.is_file()} == before  # untouched
    assert Path(more["run"], "progress.csv").stat().st_size > 0 and Path(more["policy"]).is_file()


def test_resume_refuses_what_is_not_a_checkpoint_or_has_nothing_left_to_train_before_writing(run, tmp_path, capsys):
    tmp, cfg, out = run
    checkpoints = sorted(Path(out["run"], "checkpoints").glob("rl_model_*_steps.zip"))
    stray = tmp_path / "rl_model_1_steps.zip"
    stray.write_bytes(checkpoints[0].read_bytes())
    buffer = next(Path(out["run"], "checkpoints").glob("*replay_buffer*.pkl"))
    for bad, why in ((tmp_path / "deep" / "nosuch.zip", "no such file"), (buffer, "not a checkpoint"),
                     (stray, "not in such a folder")):
        with pytest.raises(ValueError, match=why):
            train(cfg, tmp_path / "runs", resume=str(bad), progress_bar=False)
    with pytest.raises(ValueError, match="nothing to train"):
        train(load_train_config(configs(tmp), timesteps=10), tmp_path / "runs", resume=str(checkpoints[-1]),
              progress_bar=False)
    # a zip where a checkpoint belongs that SB3 cannot read (it raised an AssertionError traceback)
    (tmp_path / "fake" / "checkpoints").mkdir(parents=True)
    with zipfile.ZipFile(tmp_path / "fake" / "checkpoints" / "bad.zip", "w") as z:
        z.writestr("notes.txt", "not a model")
    with pytest.raises(ValueError, match="bad.zip: cannot be loaded as a checkpoint of tiny_train"):
        train(cfg, tmp_path / "runs", resume=str(tmp_path / "fake" / "checkpoints" / "bad.zip"), progress_bar=False)
    # the checkpoint's own settings train: a configuration that differs would be recorded as what trained
    (tmp_path / "other").mkdir()
    other = load_train_config(configs(tmp_path / "other", net_arch=[64], learning_rate=0.003), timesteps=360)
    with pytest.raises(ValueError, match=r"learning_rate 0.0005 in the checkpoint, 0.003 in tiny_train; "
                                         r"net_arch \(32, 32\) in the checkpoint, \(64,\) in tiny_train"):
        train(other, tmp_path / "runs", resume=str(checkpoints[0]), progress_bar=False)
    assert main(["train", "--config", str(configs(tmp)), "--resume", str(checkpoints[0]), "--init-policy",
                 out["policy"], "--logdir", str(tmp_path / "runs")]) == 2  # the flag beside it: which one?
    assert "--init-policy starts a new run from a policy file's: give one or the other" in capsys.readouterr().err
    assert not (tmp_path / "runs").exists() and not (tmp_path / "deep").exists()
    assert not Path(out["run"] + "_resumed_2").exists()  # nothing written next to the run either


@pytest.mark.parametrize("extra, field", [({"gama": 0.9}, "gama"), ({"timesteps": 0}, "timesteps"),
                                          ({"seed": 99999999999}, "seed must be at most 2147483647"),
                                          ({"seed": 2 ** 30, "members": 2},
                                           r"seed must be at most 2147483647 \(2\*\*31 - 1\) counting the 2 members' seeds"),
                                          ({"learning_rate": "1e-3"}, r"YAML reads 1e-3 as text: write it as 1.0e-3\)"),
                                          ({"learning_rate": "1.5e3"}, r"YAML reads 1.5e3 as text: write it as 1.5e\+3\)"),
                                          ({"buffer_size": "5e4"}, r"YAML reads 5e4 as text: write it as 50000\)"),
                                          ({"name": "../../escape"}, "name must be a plain folder name"),
                                          ({"name": "/tmp/escape"}, "name must be a plain folder name"),
                                          ({"gamma": 1.5}, "gamma"), ({"scenarios": ["nowhere"]}, "nowhere"), ({"loads": [0]}, "load"),
                                          ({"net_arch": [0]}, "net_arch"),
                                          ({"select_seed": 1000}, "overlap the held-out seeds 1000..1000"),
                                          ({"select_seed": 500}, "select_seed: with eval_starts"),
                                          ({"scenarios": ["node_chat_pair"], "eval_starts": None, "shaping": True},
                                           "shaping"),
                                          ({"reward": {"gamma": -1}}, "reward.gamma: must be >= 0"),
                                          ({"reward": {"gama": 1}}, "reward.gama: unknown key"),
                                          ({"scenarios": ["node_chat_pair"], "eval_starts": None, "reward": {"gamma": 1}},
                                           "reward: a node policy"),
                                          ({"backlog": {"share": 2}}, "backlog share must be in"),
                                          ({"scenarios": ["node_chat_pair"], "eval_starts": None, "backlog": {}},
                                           "backlog: a node policy")])
def test_bad_training_configuration_is_refused_naming_the_field(tmp_path, extra, field):
    with pytest.raises(ScenarioError, match=field):
        load_train_config(configs(tmp_path, **extra))


def test_with_select_seed_the_run_keeps_the_network_that_validated_best(tmp_path):
    cfg = load_train_config(configs(tmp_path, base="burst", max_steps=10, eval_starts=None, timesteps=300, n_envs=1,
                                    checkpoint_every=1000, learning_rate=0.01, select_seed=500))
    out = train(cfg, tmp_path / "runs", progress_bar=False, baseline_specs=[])
    selection = out["header"]["selection"]
    steps = [c["timesteps"] for c in selection["candidates"]]
    assert steps == [100, 200, 300] == sorted(steps) and steps[-1] == out["timesteps"]
    best = max(selection["candidates"], key=lambda c: c["validation_reward"])
    assert selection["timesteps"] == best["timesteps"] and selection["seeds"] == [500, 500]
    # the file holds that network: it earns the same reward on the same validation episode
    env = make_env(load_scenario(cfg.scenarios[0]), True)
    kept = evaluate(env, make_policy(out["policy"]), 1, 500)["episode_reward"]
    assert kept == pytest.approx(selection["validation_reward"], abs=1e-6)


def test_init_policy_starts_training_from_the_files_network_and_fine_tunes_it(run, tmp_path):
    import torch

    tmp, cfg, out = run
    start = make_policy(out["policy"]).networks[0].state_dict()
    quick = dict(timesteps=60, n_envs=1, eval_every=1000, checkpoint_every=1000)
    # no gradient step yet (learning_starts past the run): the exported network is the file's, exactly
    kept = train(load_train_config(configs(tmp_path, init_policy=out["policy"], learning_starts=10_000, **quick)),
                 tmp_path / "kept", progress_bar=False, baseline_specs=[])
    kept_net = make_policy(kept["policy"]).networks[0].state_dict()
    assert all(torch.equal(start[k], kept_net[k]) for k in start)
    assert make_policy(kept["policy"]).header["training"]["init_policy"] == out["policy"]
    # the same run without it starts from its own random network
    fresh = train(load_train_config(configs(tmp_path, learning_starts=10_000, **quick)), tmp_path / "fresh",
                  progress_bar=False, baseline_specs=[])
    fresh_net = make_policy(fresh["policy"]).networks[0].state_dict()
    assert not all(torch.equal(start[k], fresh_net[k]) for k in start)
    # with gradient steps it moves from there
    tuned = train(load_train_config(configs(tmp_path, init_policy=out["policy"], learning_starts=10, **quick)),
                  tmp_path / "tuned", progress_bar=False, baseline_specs=[])
    tuned_net = make_policy(tuned["policy"]).networks[0].state_dict()
    assert not all(torch.equal(start[k], tuned_net[k]) for k in start)


def test_fine_tuning_a_file_trained_before_a_feature_starts_blind_to_it(tmp_path):
    """The shipped weights predate ``expected_ratio``: fine-tuning starts from their network with zero
    weights on it (and theirs on the rest), and the new file has this build's whole layout."""
    import torch

    from env.observation import FEATURES

    shipped = make_policy("default")
    assert shipped.blind_to == ["expected_ratio"]
    quick = dict(timesteps=60, n_envs=1, eval_every=1000, checkpoint_every=1000, learning_starts=10_000,
                 net_arch=[128, 128], dueling=True, eval_starts=None, eval_seed=1000)
    out = train(load_train_config(configs(tmp_path, base="long_outputs", init_policy="default", **quick)),
                tmp_path / "ft", progress_bar=False, baseline_specs=[])
    tuned = make_policy(out["policy"])
    assert tuned.inputs is None and tuned.header["observation"]["features"] == list(FEATURES)
    first, theirs = tuned.networks[0][0][0].weight, shipped.networks[0][0][0].weight
    missing = FEATURES.index("expected_ratio")
    assert not first[:, missing].any()
    assert torch.equal(first[:, list(shipped.inputs)], theirs)


def test_an_init_policy_that_does_not_fit_is_refused_naming_what_differs(run, tmp_path):
    tmp, cfg, out = run
    with pytest.raises(ScenarioError, match=r"init_policy default: its network is net_arch \[128, 128\], dueling True; "
                                            r"this configuration's is net_arch \[32, 32\], dueling True"):
        load_train_config(configs(tmp_path, init_policy="default"))
    with pytest.raises(ScenarioError, match=r"init_policy nowhere.rlpolicy: policy file nowhere.rlpolicy: no such file"):
        load_train_config(configs(tmp_path, init_policy="nowhere.rlpolicy"))
    with pytest.raises(ScenarioError, match=r"init_policy static:2: not a trained policy"):
        load_train_config(configs(tmp_path, init_policy="static:2"))
    with pytest.raises(ScenarioError, match=r"fine-tuning starts one engine's network; this configuration trains an ensemble of 2"):
        load_train_config(configs(tmp_path, init_policy=out["policy"], members=2))
    with pytest.raises(ScenarioError, match=r"trained for a node of engines"):
        load_train_config(configs(tmp_path, init_policy="node_reasoning_trio", net_arch=[128, 128]))
    scenario = yaml.safe_load(Path(load_train_config(configs(tmp_path)).scenarios[0]).read_text())
    other = tmp_path / "other_scales.yaml"
    other.write_text(yaml.safe_dump({**scenario, "observation": {"queue_scale": 64}}))
    with pytest.raises(ScenarioError, match=r"trained with observation.queue_scale = 1024, scenario other_scales has 64"):
        load_train_config(configs(tmp_path, init_policy=out["policy"], scenarios=[str(other)]))
    # the CLI's override reaches the same check
    assert main(["train", "--config", str(configs(tmp_path)), "--init-policy", "static:2", "--no-progress"]) != 0


def test_a_shipped_training_config_loads_by_name_and_an_unknown_name_lists_them():
    import re

    from experiments import TRAIN, bundled

    cfg = load_train_config("steady")
    assert cfg.name == "steady" and cfg == load_train_config(TRAIN / "steady.yaml")
    shipped = re.escape(", ".join(bundled(TRAIN, ".yaml")))  # every shipped name, steady among them
    assert "steady" in shipped and "finetune_a10" in shipped
    with pytest.raises(ScenarioError, match=r"training config stedy: no such file \(bundled: " + shipped + r"\)"):
        load_train_config("stedy")


@pytest.mark.parametrize("reference, suffixes", [("long_outputs", ("no_double", "no_dueling", "no_per", "vanilla")),
                                                 ("default", ("no_per", "vanilla"))])
def test_each_shipped_ablation_is_the_reference_run_with_only_its_switches_off(reference, suffixes):
    """The README's ablations compare these runs: anything else that differed would be measured too."""
    full = load_train_config(reference)
    assert (full.double, full.dueling, full.prioritized, full.n_steps) == (True, True, True, 3)
    # the default's ablations were measured before it took the shaped reward (README, Results)
    full = dataclasses.replace(full, shaping=False)
    switches = {"no_double": {"double": False}, "no_dueling": {"dueling": False}, "no_per": {"prioritized": False},
                "vanilla": {"double": False, "dueling": False, "prioritized": False, "n_steps": 1}}
    for suffix in suffixes:
        name = f"{reference}_{suffix}"
        assert load_train_config(name) == dataclasses.replace(full, name=name, **switches[suffix])


def test_the_shipped_selecting_config_is_the_default_with_only_its_validation_seed_added():
    assert load_train_config("default_select") == dataclasses.replace(load_train_config("default"),
                                                                      name="default_select", select_seed=500)


def test_the_shipped_ensemble_config_is_the_default_with_only_its_members_added():
    assert load_train_config("default_ensemble") == dataclasses.replace(load_train_config("default"),
                                                                        name="default_ensemble", members=2)


def test_the_three_member_ensemble_is_the_default_with_only_its_members_and_blind_feature_added():
    assert load_train_config("default_ensemble3") == dataclasses.replace(
        load_train_config("default"), name="default_ensemble3", members=3, blind=("expected_ratio",))


def test_the_wide_experiment_is_the_default_with_only_long_outputs_on_a_second_deployment_added():
    default = load_train_config("default")
    extra = ("long_outputs_8b_h200", "long_outputs_8b_h200_preempt")
    assert load_train_config("default_wide") == dataclasses.replace(default, name="default_wide",
                                                                    scenarios=default.scenarios + extra)


def test_the_cap16_experiment_is_the_default_with_only_the_crashing_long_outputs_cap_raised():
    default = load_train_config("default")
    assert default.scenarios[0] == "long_outputs"
    assert load_train_config("default_cap16") == dataclasses.replace(
        default, name="default_cap16", scenarios=("long_outputs_cap16",) + default.scenarios[1:])
    plain, raised = load_scenario("long_outputs"), load_scenario("long_outputs_cap16")
    assert (plain.engine["overcommit_max"], raised.engine["overcommit_max"]) == (8.0, 16.0)
    assert raised.engine["overcommit_max"] == load_scenario("long_outputs_preempt").engine["overcommit_max"]
    assert dataclasses.replace(raised, name=plain.name, description=plain.description,
                               engine={**raised.engine, "overcommit_max": 8.0}) == plain


def test_the_bothcaps_experiment_is_the_default_with_the_cap16_long_outputs_added_beside_the_capped_one():
    default = load_train_config("default")
    assert load_train_config("default_bothcaps") == dataclasses.replace(
        default, name="default_bothcaps", scenarios=default.scenarios[:1] + ("long_outputs_cap16",) + default.scenarios[1:])


def test_the_slo_experiment_is_the_default_with_only_its_training_reward_changed():
    """Its training scenarios pay the SLO term; the held-out evaluation keeps each scenario's own reward."""
    from rlctl.train import held_out, training_scenarios

    slo, default = load_train_config("default_slo"), load_train_config("default")
    assert slo == dataclasses.replace(default, name="default_slo", reward=Reward(gamma=1.0))
    trained, plain = training_scenarios(slo), training_scenarios(default)
    assert [s.reward for s in trained] == [Reward(gamma=1.0)] * len(plain) != [s.reward for s in plain]
    assert [dataclasses.replace(s, reward=p.reward) for s, p in zip(trained, plain)] == plain
    assert held_out(slo) == held_out(default)
    assert load_train_config("default_slo_half") == dataclasses.replace(slo, name="default_slo_half", reward=Reward(gamma=0.5))


def test_the_late_experiment_is_the_default_with_late_answers_paid_half():
    default = load_train_config("default")
    assert load_train_config("default_late") == dataclasses.replace(default, name="default_late", reward=Reward(kappa=0.5))


def test_the_a10_fine_tuning_is_its_scratch_run_started_from_the_shipped_default():
    tuned, scratch = load_train_config("finetune_a10"), load_train_config("finetune_a10_scratch")
    assert tuned.init_policy == "default" and scratch.init_policy is None
    assert tuned == dataclasses.replace(scratch, name="finetune_a10", init_policy="default")


def test_the_overload_fine_tuning_starts_from_the_default_on_default_overloads_mixture():
    tuned, overload = load_train_config("finetune_overload"), load_train_config("default_overload")
    assert tuned.init_policy == "default" and tuned.scenarios == overload.scenarios and tuned.loads == overload.loads
    assert (tuned.timesteps, tuned.exploration_fraction) == (60_000, 0.1)


def test_the_timeout_fine_tuning_trains_each_scenario_also_with_clients_giving_up_at_its_ttft_multiple(tmp_path):
    from rlctl.train import episode_weights, held_out, training_scenarios

    tuned, overload = load_train_config("finetune_timeout"), load_train_config("finetune_overload")
    assert tuned == dataclasses.replace(overload, name="finetune_timeout", scenarios=overload.scenarios[:-1],
                                        client_timeout_ttft=1.5)
    scenarios = training_scenarios(tuned)
    plain = training_scenarios(dataclasses.replace(tuned, client_timeout_ttft=None))
    assert len(scenarios) == 2 * len(plain) == 2 * 8 * 3
    for k, name in enumerate(tuned.scenarios):  # each scenario at its three loads, then its twin at them
        own, twins = scenarios[6 * k:6 * k + 3], scenarios[6 * k + 3:6 * k + 6]
        assert own == plain[3 * k:3 * k + 3]
        for o, t in zip(own, twins):
            cfg = o.engine_config()
            assert cfg.client_timeout_s is None and t.name.replace("+gives_up_1.5x", "") == o.name != t.name
            assert t.engine_config().client_timeout_s == pytest.approx(1.5 * cfg.ttft_slo_s)
            assert dataclasses.replace(t, name=o.name, engine=o.engine) == o  # nothing else differs
    assert held_out(tuned) == held_out(dataclasses.replace(tuned, client_timeout_ttft=None))  # evaluated as they are
    weighted = dataclasses.replace(tuned, scenarios=("long_outputs", "sessions"), weights=(1.0, 3.0))
    assert episode_weights(weighted) == [1.0] * 6 + [3.0] * 6
    for bad in (0, -1, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="client_timeout_ttft"):
            dataclasses.replace(tuned, client_timeout_ttft=bad)


def test_every_shipped_training_config_pins_its_environment_count():
    """The demo and the README's tables come from these: one per core would change them with the machine."""
    from experiments import TRAIN, bundled
    from rlctl.cli import DEMO_CONFIG

    assert DEMO_CONFIG in bundled(TRAIN, ".yaml") and load_train_config(DEMO_CONFIG).n_envs == 2
    assert {name: load_train_config(name).n_envs for name in bundled(TRAIN, ".yaml")} == dict.fromkeys(
        bundled(TRAIN, ".yaml"), 2)


def test_a_mixture_draws_its_scenarios_each_episode_and_passes_the_checkers():
    import warnings

    from gymnasium.utils.env_checker import check_env

    from env.mixture import MixtureEnv
    from env.scenario_yaml import load_scenario

    short = [dataclasses.replace(load_scenario(n), max_steps=3) for n in ("long_outputs", "sessions_preempt")]
    env = MixtureEnv(short)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_env(env, skip_render_check=True)
    seen = set()
    env.reset(seed=0)
    for _ in range(12):
        env.reset()
        seen.add(env.scenario.name)
    assert seen == {"long_outputs", "sessions_preempt"}
    other = dataclasses.replace(short[1], observation=dataclasses.replace(short[1].observation, queue_scale=9))
    with pytest.raises(ValueError, match="share their observation scales"):
        MixtureEnv([short[0], other])


def test_a_weighted_mixture_draws_its_scenarios_by_their_weights_and_a_bad_weight_is_refused(tmp_path):
    from env.mixture import MixtureEnv
    from env.scenario_yaml import load_scenario
    from rlctl.train import episode_weights, training_scenarios

    short = [dataclasses.replace(load_scenario(n), max_steps=3) for n in ("long_outputs", "sessions_preempt")]
    env = MixtureEnv(short, weights=[1, 3])
    env.reset(seed=0)
    drawn = []
    for _ in range(400):
        env.reset()
        drawn.append(env.scenario.name)
    assert 0.68 < drawn.count("sessions_preempt") / len(drawn) < 0.82  # 3 in 4
    # without weights the draw is the one it always was (so the shipped runs retrain bit for bit):
    # a uniform index, then the episode's seed, from the generator the first reset's seed made
    from gymnasium.utils import seeding

    plain, (rng, _) = MixtureEnv(short), seeding.np_random(5)
    names = [plain.reset(seed=5) and plain.scenario.name] + [plain.reset() and plain.scenario.name for _ in range(11)]
    expected = []
    for _ in names:
        expected.append(short[int(rng.integers(2))].name)
        rng.integers(2**31)
    assert names == expected and len(set(names)) == 2
    with pytest.raises(ValueError, match="weights"):
        MixtureEnv(short, weights=[1])
    # a configuration's weights are its scenarios', at each of their loads
    path = configs(tmp_path, base="long_outputs", max_steps=3, eval_starts=None)
    data = yaml.safe_load(Path(path).read_text())
    Path(path).write_text(yaml.safe_dump({**data, "scenarios": ["long_outputs", "sessions_preempt"],
                                          "loads": [0.8, 1.0], "weights": [1, 3]}))
    cfg = load_train_config(path)
    assert episode_weights(cfg) == [1, 1, 3, 3] and len(training_scenarios(cfg)) == 4
    for bad in ([1], [1, 0]):
        Path(path).write_text(yaml.safe_dump({**data, "scenarios": ["long_outputs", "sessions_preempt"], "weights": bad}))
        with pytest.raises(ScenarioError, match="weights"):
            load_train_config(path)


def test_an_ensemble_trains_its_members_at_once_each_as_its_seed_would_alone(tmp_path):
    import numpy as np
    from safetensors.torch import load_file

    from agents.export import load_policy

    cfg = load_train_config(configs(tmp_path, base="burst", max_steps=10, eval_starts=None, timesteps=200, n_envs=1,
                                    checkpoint_every=1000, members=2, seed=1))
    out = train(cfg, tmp_path / "runs", progress_bar=False, baseline_specs=["static:1.0"])
    ensemble = load_policy(out["policy"])
    assert ensemble.header["version"] == 3 and ensemble.header["network"]["members"] == 2
    assert [m["seed"] for m in ensemble.header["members"]] == [2, 3]  # seed * members + k
    assert set(out["results"]) == {"dqn", "static:1"} and len(out["held_out"]) == 2
    members = [load_policy(Path(run) / "policy.rlpolicy") for run in out["members"]]
    assert [m.file_sha256 for m in members] == [m["sha256"] for m in ensemble.header["members"]]
    obs = np.random.default_rng(0).random((64, ensemble.obs_dim), dtype=np.float32)
    q = [m.q_values(obs) for m in members]
    assert not np.allclose(q[0], q[1])  # two seeds, two networks: the mean is not either one
    assert np.allclose(ensemble.q_values(obs), (q[0] + q[1]) / 2, atol=1e-6)
    # the second member is the run that seed gives alone, bit for bit
    alone = train(dataclasses.replace(cfg, members=1, seed=3), tmp_path / "alone", progress_bar=False,
                  baseline_specs=[])
    mine, theirs = load_file(Path(out["members"][1]) / "policy.rlpolicy"), load_file(alone["policy"])
    assert set(mine) == set(theirs) and all((mine[k] == theirs[k]).all() for k in mine)
    with pytest.raises(ValueError, match="ensemble of 2"):
        train(cfg, tmp_path / "runs", resume=str(tmp_path / "any.zip"), progress_bar=False)


def test_several_configs_and_seeds_end_with_a_row_each_even_where_two_configs_share_a_name(tmp_path, capsys):
    """``--config A B --seeds 0 1``: a row per config, mean +- std over its seeds, and the same rows
    in comparison.json; two configs both named tiny_train.yaml keep a row each, labelled by path."""
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    first, second = configs(a, max_steps=10, timesteps=120), configs(b, max_steps=10, timesteps=120, learning_rate=0.003)
    logdir = tmp_path / "runs"
    assert main(["train", "--config", str(first), str(second), "--seeds", "0", "1", "--logdir", str(logdir),
                 "--no-progress"]) == 0
    table = capsys.readouterr().out
    data = json.loads((logdir / "comparison.json").read_text())
    labels = [f"dqn {first.with_suffix('')}", f"dqn {second.with_suffix('')}"]
    assert [k for k in data if k.startswith("dqn")] == labels
    for label, config in zip(labels, (first, second)):
        assert data[label]["config"] == str(config) and data[label]["seeds"] == [0, 1]
        values = data[label]["goodput_tokens_per_s"]["values"]
        assert len(values) == 2 and abs(data[label]["goodput_tokens_per_s"]["mean"] - sum(values) / 2) < 1e-9
        assert len(set(data[label]["runs"])) == 2
        assert any(line.startswith(f"| {label} |") or label in line for line in table.splitlines())
    assert "static:1" in data and "vllm" in data  # the first run's baselines


def test_a_run_blind_to_a_feature_never_reads_it_and_its_file_says_so(tmp_path):
    """``blind``: the network trains without the named features and its file leaves them out of its
    layout, so it loads as a file trained before them does: the same action whatever they say."""
    import numpy as np

    from env.observation import FEATURES

    cfg = load_train_config(configs(tmp_path, base="long_outputs", eval_starts=None, timesteps=120, n_envs=1,
                                    checkpoint_every=1000, blind=["expected_ratio"]))
    assert cfg.blind == ("expected_ratio",)
    out = train(cfg, tmp_path / "runs", progress_bar=False, baseline_specs=[])
    policy = make_policy(out["policy"])
    assert policy.blind_to == ["expected_ratio"]
    assert policy.header["observation"]["features"] == [f for f in FEATURES if f != "expected_ratio"]
    assert policy.header["network"]["obs_dim"] == len(FEATURES) - 1
    obs = np.random.default_rng(0).random((256, len(FEATURES)), dtype=np.float32)
    moved = obs.copy()
    moved[:, FEATURES.index("expected_ratio")] = 1.0 - moved[:, FEATURES.index("expected_ratio")]
    assert np.array_equal(policy.q_values(obs), policy.q_values(moved))
    assert not np.array_equal(policy.q_values(obs), policy.q_values(obs[:, ::-1].copy()))  # it reads the rest


@pytest.mark.parametrize("blind, match", [(["no_such_feature"], "no_such_feature"),
                                          (["queue_len", "queue_len"], "distinct")])
def test_a_bad_blind_list_is_refused_naming_it(tmp_path, blind, match):
    with pytest.raises(ScenarioError, match=match):
        load_train_config(configs(tmp_path, blind=blind))


def test_blind_fine_tuning_is_refused(tmp_path):
    with pytest.raises(ScenarioError, match="blind: fine-tuning"):
        load_train_config(configs(tmp_path, init_policy="default", blind=["expected_ratio"]))


def test_the_noqueuetokens_experiment_is_the_default_blind_to_the_waiting_tokens_as_well():
    assert load_train_config("default_noqueuetokens") == dataclasses.replace(
        load_train_config("default"), name="default_noqueuetokens", blind=("expected_ratio", "queue_tokens"))


def test_the_backlog_experiment_is_the_default_with_half_its_episodes_starting_behind():
    from env.scenario import Backlog

    assert load_train_config("default_backlog") == dataclasses.replace(
        load_train_config("default"), name="default_backlog", blind=("expected_ratio",),
        backlog=Backlog(share=0.5, kv=(0.5, 2.0)))


def test_the_seeds_table_takes_a_figure_only_over_the_runs_that_have_it():
    """A run whose held-out episodes gave no request its first token has no TTFT (None): the table and
    comparison.json take the mean over the runs that have one (np.mean over a None raised a TypeError
    after every run had trained, and comparison.json was lost), and '-' where none has."""
    from types import SimpleNamespace

    from rlctl.report import compare

    def figures(goodput, ttft):
        return {"goodput_tokens_per_s": goodput, "tokens_per_s": goodput, "kv_util_mean": 0.5, "kv_util_p99": 0.9,
                "oom_events": 0.0, "ttft_p99_s": ttft, "episode_reward": 1.0}

    runs = [("a.yaml", SimpleNamespace(seed=0), {"run": "runs/a", "results": {"dqn": figures(10.0, 2.0),
                                                                              "vllm": figures(0.0, None)}}),
            ("a.yaml", SimpleNamespace(seed=1), {"run": "runs/a_2", "results": {"dqn": figures(20.0, None),
                                                                                "vllm": figures(0.0, None)}})]
    text, data = compare(runs)
    assert data["dqn a"]["ttft_p99_s"] == {"mean": 2.0, "std": 0.0, "runs": 1, "values": [2.0, None]}
    assert data["dqn a"]["goodput_tokens_per_s"]["mean"] == 15.0
    dqn, vllm = (next(line for line in text.splitlines() if line.startswith(k)) for k in ("dqn a", "vllm"))
    assert re.split(r"\s{2,}", dqn)[-2] == "2.0" and re.split(r"\s{2,}", vllm)[-2] == "-"  # the TTFT column
