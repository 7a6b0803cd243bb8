"""The shield refuses a scale-up that breaks a hard rule and evicts a crashing engine's nearly full
KV, judged on the decision's snapshot, and the environment counts every override."""
from __future__ import annotations

import dataclasses

import yaml

from experiments import SCENARIOS
from agents.shield import Shield
from engine.control import BACK_OFF, DEFRAG, EVICT, HOLD, SCALE_UP
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
    assert shield.filter(SCALE_UP, dataclasses.replace(snap, reserved_ratio=8.5)) == HOLD
    assert shield.filter(BACK_OFF, dataclasses.replace(snap, device_free=0.0)) == BACK_OFF
    # a preempting engine recomputes what does not fit: its admitted demand is not bounded
    assert shield.filter(SCALE_UP, dataclasses.replace(snap, reserved_ratio=8.5, preempt_mode=True)) == SCALE_UP
    # a crashing engine whose KV is nearly full evicts to host instead of growing on
    full = dataclasses.replace(snap, alloc_ratio=0.96)
    assert [shield.filter(a, full) for a in (HOLD, SCALE_UP, DEFRAG, BACK_OFF, EVICT)] == [EVICT, EVICT, EVICT,
                                                                                          BACK_OFF, EVICT]
    assert shield.filter(HOLD, dataclasses.replace(full, preempt_mode=True)) == HOLD
    assert shield.filter(HOLD, dataclasses.replace(full, restarting=True)) == HOLD
    dev = env.engine.device
    dev.set_tenants(dev.charged["tenants"] + dev.free)  # another process takes every free byte
    env.engine.snapshot()
    *_, info = env.step(SCALE_UP)
    assert info["action"] == "scale_up" and info["applied_action"] == "hold"
    assert info["shield_overrides"] == 1 and env.engine.overcommit == 1.0
