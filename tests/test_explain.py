"""``rlctl explain``: which observation features a trained policy's decisions turn on."""
from __future__ import annotations

import json

import numpy as np

from agents.policy import Policy
from engine.control import ACTIONS, BACK_OFF, SCALE_UP
from env.observation import FEATURES
from rlctl.cli import main
from rlctl.explain import attribute, record

QUEUE = FEATURES.index("queue_tokens")


class QueueReader(Policy):
    """Backs off while the waiting tokens pass half the KV, scales up otherwise: it reads one feature."""

    name = "queue_reader"

    def act(self, obs: np.ndarray) -> int:
        return BACK_OFF if obs[QUEUE] > 0.5 else SCALE_UP


class AllocReader(Policy):
    """Backs off while a fifth of the KV is in use, scales up otherwise."""

    name = "alloc_reader"

    def act(self, obs: np.ndarray) -> int:
        return BACK_OFF if obs[FEATURES.index("alloc_ratio")] > 0.2 else SCALE_UP


def test_only_the_feature_a_policy_reads_changes_its_decisions_and_by_how_many():
    rng = np.random.default_rng(0)
    observations = rng.uniform(size=(200, len(FEATURES))).astype(np.float32)
    decisions = np.array([QueueReader().act(o) for o in observations])
    reference = rng.uniform(0.0, 0.4, size=(50, len(FEATURES))).astype(np.float32)  # its queue mean under 0.5
    rows = {r["feature"]: r for r in attribute(QueueReader(), observations, decisions, reference)}
    backing_off = int((decisions == BACK_OFF).sum())
    assert 0 < backing_off < len(decisions)
    assert rows["queue_tokens"]["changed"] == backing_off and rows["queue_tokens"]["to"] == {"scale_up": backing_off}
    assert all(r["changed"] == 0 for name, r in rows.items() if name != "queue_tokens")
    assert rows["queue_tokens"]["reference_mean"] == float(reference[:, QUEUE].mean())
    # only the decisions of one action are explained when it is named: the scale-ups do not move
    only = {r["feature"]: r for r in attribute(QueueReader(), observations, decisions, reference, SCALE_UP)}
    assert only["queue_tokens"]["changed"] == 0
    first = attribute(QueueReader(), observations, decisions, reference)[0]
    assert first["feature"] == "queue_tokens"  # most decisions changed first


def test_record_keeps_the_policy_s_own_decisions_and_what_it_saw_behind_the_served_shield():
    import dataclasses

    from env.scenario_yaml import load_scenario
    from rlctl.evaluate import make_env

    sc = dataclasses.replace(load_scenario("long_outputs_qwen7b_a10"), max_steps=40)
    observations, decisions = record(AllocReader(), sc, seed=3)
    assert observations.shape == (40, len(FEATURES)) and decisions.shape == (40,)
    assert {BACK_OFF, SCALE_UP} <= set(decisions.tolist())  # the KV passes a fifth in use in this episode
    env = make_env(sc, shield=True)  # the same episode, stepped by hand with the recorded decisions
    obs, _ = env.reset(seed=3)
    for seen, decision in zip(observations, decisions):
        assert np.array_equal(obs, seen) and decision == AllocReader().act(seen)
        obs, *_ = env.step(int(decision))


def test_explain_names_the_features_behind_the_shipped_policy_s_decisions(tmp_path, capsys):
    path = tmp_path / "explain.json"
    assert main(["explain", "--policy", "default", "--scenario", "long_outputs_qwen7b_a10", "--reference",
                 "long_outputs", "--seed", "500", "--steps", "15", "--top", "3", "--json", str(path)]) == 0
    printed = capsys.readouterr().out
    out = json.loads(path.read_text())
    assert (out["scenario"], out["reference"], out["action"]) == ("long_outputs_qwen7b_a10", "long_outputs", None)
    assert sum(out["decisions"].values()) == sum(out["reference_decisions"].values()) == out["explained"] == 15
    assert sorted(r["feature"] for r in out["features"]) == sorted(FEATURES)
    changed = [r["changed"] for r in out["features"]]
    assert changed == sorted(changed, reverse=True) and all(0 <= c <= 15 for c in changed)
    assert all(sum(r["to"].values()) == r["changed"] and set(r["to"]) <= set(ACTIONS) for r in out["features"])
    assert {r["feature"]: r["mean"] for r in out["features"]}["preempt_mode"] == 0.0  # a crashing engine
    assert len([line for line in printed.splitlines() if line.split()[0] in FEATURES]) == 3


def test_explain_refuses_a_baseline_an_unknown_action_and_a_bad_count(capsys):
    base = ["explain", "--scenario", "long_outputs", "--reference", "long_outputs"]
    assert main(base + ["--policy", "watermark"]) == 2
    assert "--policy watermark: explain reads a trained policy" in capsys.readouterr().err
    assert main(base + ["--policy", "unpark:4:ontime:default"]) == 2
    assert "a fallback decides from the decisions before it" in capsys.readouterr().err
    assert main(base + ["--policy", "default", "--action", "jump"]) == 2
    assert "--action must be one of hold, scale_up, back_off, defrag, evict, got 'jump'" in capsys.readouterr().err
    assert main(base + ["--policy", "default", "--top", "0"]) == 2
    assert "--top must be > 0" in capsys.readouterr().err
    assert main(base + ["--policy", "default", "--steps", "0"]) == 2
    assert "--steps must be > 0" in capsys.readouterr().err


def test_a_training_run_s_policy_file_is_named_by_its_path(tmp_path, capsys):
    import shutil

    from experiments import POLICIES

    run = tmp_path / "run"
    run.mkdir()
    shutil.copy(POLICIES / "default.rlpolicy", run / "policy.rlpolicy")
    assert main(["explain", "--policy", str(run / "policy.rlpolicy"), "--scenario", "long_outputs", "--reference",
                 "long_outputs", "--steps", "3", "--json", "-"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["policy"] == str(run / "policy")
    # one scenario as its own reference, on one seed: the same episode, so the same means
    assert all(r["mean"] == r["reference_mean"] for r in out["features"])
    assert out["decisions"] == out["reference_decisions"]


def test_an_action_never_taken_is_said_to_have_nothing_to_explain():
    from rlctl.explain import format_explain

    out = {"policy": "default", "scenario": "steady", "seed": 0, "decisions": {"hold": 3, "evict": 0},
           "reference": "long_outputs", "reference_decisions": {"hold": 2}, "action": "evict", "explained": 0,
           "features": [{"feature": "kv_used", "mean": 0.5, "reference_mean": 0.4, "changed": 0, "to": {}}]}
    text = format_explain(out, top=5)
    assert "its evict decisions: none in this episode, so nothing to explain" in text and "kv_used" not in text
