"""The shield refuses a scale-up that breaks a hard rule and evicts a crashing engine's nearly full
KV, judged on the decision's snapshot, and the environment counts every override; served, it steers a
preempting engine as a crashing one."""
from __future__ import annotations

import dataclasses

import yaml

from experiments import SCENARIOS
from agents.policy import Policy
from agents.shield import NodeShield, Shield
from engine.control import BACK_OFF, DEFRAG, EVICT, HOLD, SCALE_UP
from engine.node_control import NODE_HOLD, encode_action
from env.observation import FEATURES
from env.overcommit_env import OvercommitEnv
from env.scenario_yaml import scenario_from_dict
from rlctl.evaluate import make_env
from rlctl.online.served import ServedPolicy


def test_scale_up_is_refused_with_little_free_device_memory_or_while_restarting():
    data = yaml.safe_load((SCENARIOS / "cotenant.yaml").read_text())
    env = OvercommitEnv(scenario_from_dict({**data, "name": "c", "max_steps": 3}), shield=Shield())
    env.reset(seed=0)
    snap = env.engine.last_snapshot
    shield = Shield()
    assert shield.filter(SCALE_UP, snap) == SCALE_UP
    assert shield.filter(SCALE_UP, dataclasses.replace(snap, device_free=0.01)) == HOLD
    assert shield.filter(SCALE_UP, dataclasses.replace(snap, restarting=True)) == HOLD
    assert shield.filter(SCALE_UP, dataclasses.replace(snap, reserved_ratio=8.5, overcommit=9.0)) == HOLD
    # no scale-up once the factor is max_slack x the admitted demand: it would admit nothing now
    assert shield.filter(SCALE_UP, dataclasses.replace(snap, reserved_ratio=2.0, overcommit=2.9)) == SCALE_UP
    assert shield.filter(SCALE_UP, dataclasses.replace(snap, reserved_ratio=2.0, overcommit=3.0)) == HOLD
    assert shield.filter(SCALE_UP, dataclasses.replace(snap, reserved_ratio=0.2, overcommit=1.5)) == HOLD
    assert shield.filter(BACK_OFF, dataclasses.replace(snap, device_free=0.0)) == BACK_OFF
    # without preempt_as_crash a preempting engine recomputes what does not fit: its demand is not bounded
    as_is = Shield(preempt_as_crash=False)
    assert as_is.filter(SCALE_UP, dataclasses.replace(snap, reserved_ratio=8.5, overcommit=9.0,
                                                      preempt_mode=True)) == SCALE_UP
    assert shield.filter(SCALE_UP, dataclasses.replace(snap, reserved_ratio=8.5, overcommit=9.0,
                                                       preempt_mode=True)) == HOLD
    # a crashing engine whose KV is nearly full evicts to host instead of growing on
    full = dataclasses.replace(snap, alloc_ratio=0.96)
    assert [shield.filter(a, full) for a in (HOLD, SCALE_UP, DEFRAG, BACK_OFF, EVICT)] == [EVICT] * 5
    # a back-off admits nothing more but lets the running batch grow on: only training lets it pass
    trained = make_env(env.scenario, shield=True, training=True).shield
    assert [trained.filter(a, full) for a in (HOLD, SCALE_UP, DEFRAG, BACK_OFF, EVICT)] == [EVICT, EVICT, EVICT,
                                                                                           BACK_OFF, EVICT]
    assert as_is.filter(HOLD, dataclasses.replace(full, preempt_mode=True)) == HOLD
    assert shield.filter(HOLD, dataclasses.replace(full, preempt_mode=True)) == EVICT  # steered as a crashing one
    assert shield.filter(HOLD, dataclasses.replace(full, restarting=True)) == HOLD
    dev = env.engine.device
    dev.set_tenants(dev.charged["tenants"] + dev.free)  # another process takes every free byte
    env.engine.snapshot()
    *_, info = env.step(SCALE_UP)
    assert info["action"] == "scale_up" and info["applied_action"] == "hold"
    assert info["shield_overrides"] == 1 and env.engine.overcommit == 1.0


def test_the_node_shield_keeps_the_engine_rules_but_the_slack():
    data = yaml.safe_load((SCENARIOS / "cotenant.yaml").read_text())
    env = OvercommitEnv(scenario_from_dict({**data, "name": "c", "max_steps": 3}), shield=Shield())
    env.reset(seed=0)
    snap = env.engine.last_snapshot
    full = dataclasses.replace(snap, alloc_ratio=0.96)
    slack = dataclasses.replace(snap, reserved_ratio=1.0, overcommit=4.0)
    node = NodeShield()
    # a crashing engine's full KV is evicted, a preempting one's left to preemption
    assert node.filter(NODE_HOLD, {"a": snap, "b": full}) == encode_action(1, "evict")
    assert node.filter(NODE_HOLD, {"a": snap, "b": dataclasses.replace(full, preempt_mode=True)}) == NODE_HOLD
    assert node.filter(encode_action(0, "scale_up"), {"a": dataclasses.replace(snap, device_free=0.0), "b": snap}) \
        == NODE_HOLD
    # a scale-up past the single engine's slack passes (the node policies were trained without it)
    assert Shield().filter(SCALE_UP, slack) == HOLD
    assert node.filter(encode_action(0, "scale_up"), {"a": slack, "b": snap}) == encode_action(0, "scale_up")


def test_a_policy_trains_behind_the_rules_but_the_slack_and_is_served_behind_all():
    sc = scenario_from_dict({**yaml.safe_load((SCENARIOS / "cotenant.yaml").read_text()), "name": "c", "max_steps": 3})
    served, trained = make_env(sc, shield=True).shield, make_env(sc, shield=True, training=True).shield
    env = OvercommitEnv(sc, shield=served)
    env.reset(seed=0)
    snap = dataclasses.replace(env.engine.last_snapshot, reserved_ratio=1.0, overcommit=4.0)
    trained_snap = dataclasses.replace(snap, reserved_ratio=8.5, overcommit=9.0)
    assert served.filter(SCALE_UP, snap) == HOLD and trained.filter(SCALE_UP, snap) == SCALE_UP
    assert served.filter(SCALE_UP, trained_snap) == trained.filter(SCALE_UP, trained_snap) == HOLD  # the rest alike
    assert make_env(sc, shield=False, training=True).shield is None


def test_the_served_shield_has_the_policy_see_a_preempting_engine_as_a_crashing_one():
    sc = scenario_from_dict({**yaml.safe_load((SCENARIOS / "long_outputs_preempt.yaml").read_text()), "name": "p",
                             "max_steps": 3})
    index = FEATURES.index("preempt_mode")
    served, trained = make_env(sc, shield=True), make_env(sc, shield=True, training=True)
    for env, seen in ((served, 0.0), (trained, 1.0), (make_env(sc, shield=False), 1.0)):
        obs, _ = env.reset(seed=0)
        assert obs[index] == seen
        obs, *_ = env.step(HOLD)
        assert obs[index] == seen
    snap = served.engine.last_snapshot
    assert snap.preempt_mode and not served.shield.view(snap).preempt_mode and trained.shield.view(snap) is snap
    # the sidecar observes through the same view (rlctl/online/served.py)
    seen = []

    class Recorder(Policy):
        name = "recorder"

        def act(self, obs):
            seen.append(obs[index])
            return HOLD

    for shield in (served.shield, trained.shield):
        ServedPolicy("recorder", Recorder(), sc.observation, "", None, shield=shield).decide(snap)
    assert seen == [0.0, 1.0]


def test_the_served_shield_sets_the_engines_admission_headroom_and_training_runs_without():
    crash, preempt = (scenario_from_dict({**yaml.safe_load((SCENARIOS / f"{name}.yaml").read_text()), "name": name,
                                          "max_steps": 3}) for name in ("long_outputs", "long_outputs_preempt"))
    served = Shield().admit_headroom
    assert served > 0
    for sc, shield, expected in ((crash, Shield(), served), (preempt, Shield(), served),  # steered as a crashing one
                                 (preempt, Shield(preempt_as_crash=False), 0.0), (crash, None, 0.0),
                                 (crash, make_env(crash, shield=True, training=True).shield, 0.0)):
        env = OvercommitEnv(sc, shield=shield)
        env.reset(seed=0)
        assert env.engine.admit_headroom == expected
        if shield is not None:  # what the sidecar's decisions carry (tests/test_sidecar.py)
            assert shield.headroom(env.engine.snapshot()) == expected
