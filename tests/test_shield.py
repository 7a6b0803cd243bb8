"""The shield refuses a scale-up that breaks a hard rule, judged on the decision's snapshot, and
the environment counts every override."""
from __future__ import annotations

import dataclasses

import yaml

from experiments import SCENARIOS
from agents.shield import Shield
from engine.control import BACK_OFF, HOLD, SCALE_UP
from env.overcommit_env import OvercommitEnv
from env.scenario_yaml import scenario_from_dict


def test_scale_up_is_refused_with_little_free_device_memory_or_while_restarting():
    data = yaml.safe_load((SCENARIOS / "cotenant.yaml").read_text())
    env = OvercommitEnv(scenario_from_dict({**data, "name": "c", "max_steps": 3}), shield=Shield())
    env.reset(seed=0)
    snap = env.engine.last_snapshot
    shield = Shield()
    assert shield.filter(SCALE_UP, snap) == SCALE_UP
    assert shield.filter(SCALE_UP, dataclasses.replace(snap, device_free=0.01)) == HOLD
    assert shield.filter(SCALE_UP, dataclasses.replace(snap, restarting=True)) == HOLD
    assert shield.filter(SCALE_UP, dataclasses.replace(snap, reserved_ratio=3.5)) == HOLD
    assert shield.filter(BACK_OFF, dataclasses.replace(snap, device_free=0.0)) == BACK_OFF
    dev = env.engine.device
    dev.set_tenants(dev.charged["tenants"] + dev.free)  # another process takes every free byte
    env.engine.snapshot()
    *_, info = env.step(SCALE_UP)
    assert info["action"] == "scale_up" and info["applied_action"] == "hold"
    assert info["shield_overrides"] == 1 and env.engine.overcommit == 1.0
