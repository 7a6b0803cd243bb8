"""The node's baselines and its lookahead oracle (agents/node_baselines.py, agents/node_oracle.py)
through ``rlctl eval`` on a node scenario: the limits and settings each pins, the watermark's
choice of engine, what overcommit across tenants buys over the static partition, and bad specs
refused naming what is wrong. Real engines on the roofline clock, short episodes."""
from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest
import yaml

from experiments import SCENARIOS
from agents.node_baselines import BLOCK, NodeWatermark, engines_in
from agents.node_spec import make_node_policy, node_baselines
from engine.clone import clone_node
from engine.node_control import NODE_HOLD, encode_action
from env.node_observation import DEVICE_FEATURES, node_features
from env.node_scenario import load_node_scenario
from env.observation import FEATURES
from env.shared_gpu_env import SharedGPUEnv
from rlctl.cli import main

ALLOC = FEATURES.index("alloc_ratio")


def short(name: str = "node_chat_pair", steps: int = 20):
    return dataclasses.replace(load_node_scenario(name), max_steps=steps)


@pytest.mark.parametrize("spec, limits, factor, oom_mode", [
    ("partition", "share", 1.0, "crash"),
    ("overcommit:1.5", 1.5, 1.0, "crash"),
    ("static:2", "limit", 2.0, "crash"),
    ("vllm", "share", math.inf, "preempt"),
    ("sglang", "share", None, "preempt"),
])
def test_each_baseline_pins_its_limits_and_its_engine_settings(spec, limits, factor, oom_mode):
    sc = short(steps=2)
    env = SharedGPUEnv(sc)
    policy = make_node_policy(spec)
    _, info = env.reset(seed=0, options={"engine": policy.engine_overrides})
    cap = sc.gpu.memory_bytes
    want = {t.name: int((min(limits * t.share, 1.0) if isinstance(limits, float) else getattr(t, limits)) * cap)
            for t in sc.tenants}
    assert info["limits"] == want
    if spec in ("partition", "vllm", "sglang"):  # a static partition: the limits never sum past the device
        assert sum(want.values()) <= cap
    else:
        assert sum(want.values()) > cap
    for e in env.node.engines.values():
        assert e.config.oom_mode == oom_mode
        if factor is not None:
            assert e.overcommit == factor
        else:
            assert e.config.admission == "sglang"


def obs_with(alloc: list[float]) -> np.ndarray:
    obs = np.zeros(len(node_features([str(i) for i in range(len(alloc))])), dtype=np.float32)
    for i, u in enumerate(alloc):
        obs[i * BLOCK + ALLOC] = u
    return obs


def test_the_node_watermark_moves_the_most_urgent_engine_and_takes_turns():
    w = NodeWatermark()
    assert engines_in(obs_with([0.8, 0.8, 0.8])) == 3
    assert w.act(obs_with([0.8, 0.8])) == NODE_HOLD  # between the watermarks: nothing to do
    assert w.act(obs_with([0.5, 0.96])) == encode_action(1, "evict")  # evicting outranks scaling a up
    assert w.act(obs_with([0.5, 0.8])) == encode_action(0, "scale_up")
    assert w.act(obs_with([0.995, 0.93])) == encode_action(0, "back_off")  # 99 %: stop outranks 92 %
    # both over 99 %: the engine moved least recently goes first, then the other
    assert w.act(obs_with([0.995, 0.995])) == encode_action(1, "back_off")
    assert w.act(obs_with([0.995, 0.995])) == encode_action(0, "back_off")
    w.reset()
    assert w.act(obs_with([0.995, 0.995])) == encode_action(0, "back_off")
    with pytest.raises(ValueError, match=f"{BLOCK} features per engine and {len(DEVICE_FEATURES)} for the device"):
        w.act(np.zeros(BLOCK + 1, dtype=np.float32))


def test_a_copy_of_the_node_shares_a_copy_of_the_device():
    env = SharedGPUEnv(short(steps=5))
    env.reset(seed=0)
    env.step(0)
    node = env.node
    used, clock, done = node.device.used, node.clock, {n: len(e.completed) for n, e in node.engines.items()}
    copy = clone_node(node)
    assert all(e.device.shared is copy.device for e in copy.engines.values()) and copy.device is not node.device
    copy.advance(clock + 20.0)
    assert copy.clock == clock + 20.0 and sum(len(e.completed) for e in copy.engines.values()) > sum(done.values())
    assert (node.device.used, node.clock, {n: len(e.completed) for n, e in node.engines.items()}) == (used, clock, done)
    assert copy.device.used == sum(e.device.used for e in copy.engines.values())


@pytest.fixture(scope="module")
def table(tmp_path_factory):
    """Every node baseline and the oracle on one short episode of node_chat_pair (seed 0: tenant b
    busy, a quiet), through ``rlctl eval``."""
    out = tmp_path_factory.mktemp("eval") / "node.json"
    assert main(["eval", "--scenario", "node_chat_pair", "--steps", "20", "--seed", "0", "--baselines",
                 "--policy", "oracle", "--json", str(out)]) == 0
    return json.loads(out.read_text())["results"]


def test_eval_runs_every_node_baseline_and_the_oracle(table):
    sc = load_node_scenario("node_chat_pair")
    assert list(table) == ["oracle"] + node_baselines(sc)
    assert node_baselines(sc)[:3] == ["partition", "overcommit:1.5", "static:1"]  # the scenario's tuned K
    for name, r in table.items():
        assert r["requests_submitted"] == table["partition"]["requests_submitted"] > 0, name  # the same workload
        assert r["a/requests_completed"] + r["b/requests_completed"] == r["requests_completed"], name
    assert table["partition"]["limits"] == {t.name: int(t.share * sc.gpu.memory_bytes) for t in sc.tenants}


def test_overcommit_across_tenants_beats_the_static_partition_on_a_burst(table):
    part, over = table["partition"], table["overcommit:1.5"]
    # the busy tenant b borrows what the quiet one leaves: more goodput, no OOM, a not starved
    assert over["b/goodput_tokens_per_s"] > 1.2 * part["b/goodput_tokens_per_s"]
    assert over["a/goodput_tokens_per_s"] >= part["a/goodput_tokens_per_s"]
    assert over["oom_events"] == part["oom_events"] == 0
    assert over["slo_attainment_min"] > part["slo_attainment_min"]


def test_the_node_oracle_steers_every_engine_without_an_oom(table):
    oracle = table["oracle"]
    assert oracle["oom_events"] == 0 and oracle["restarts"] == 0  # it keeps the scenario's limits
    assert oracle["goodput_tokens_per_s"] > table["partition"]["goodput_tokens_per_s"]
    assert oracle["goodput_tokens_per_s"] >= table["overcommit:1.5"]["goodput_tokens_per_s"]
    assert oracle["slo_attainment_min"] >= table["partition"]["slo_attainment_min"]


def test_the_node_oracle_chooses_a_factor_per_engine():
    from agents.node_oracle import NodeOracle

    env = SharedGPUEnv(short(steps=6))
    oracle = NodeOracle(horizon_s=8.0, every_s=4.0, levels=(0.5, 2.0))
    obs, _ = env.reset(seed=0, options={"engine": oracle.engine_overrides})
    oracle.reset(0, env=env)
    for _ in range(6):
        obs, *_ = env.step(oracle.act(obs))
    assert [t for t, _ in oracle.chosen] == [0.0, 4.0, 8.0]
    assert all(set(f) == {"a", "b"} and set(f.values()) <= {0.5, 2.0} for _, f in oracle.chosen)
    assert {n: e.overcommit for n, e in env.node.engines.items()} == oracle.chosen[-1][1]
    with pytest.raises(ValueError, match="looks inside its node environment"):
        NodeOracle().reset(0, env=None)


@pytest.mark.parametrize("args, message", [
    (["--policy", "overcommit:x"], "needs a number K, e.g. overcommit:1.5"),
    (["--policy", "overcommit:0"], "K must be > 0"),
    (["--policy", "partitoin"], "node policy 'partitoin' does not exist: use partition, overcommit:K"),
    (["--policy", "partition", "--trace", "azure2023_conv"], "--trace applies to one engine's scenarios, not to node"),
    (["--policy", "partition", "--static-sweep"], "on a node use --policy overcommit:K"),
    (["--policy", "partition", "--rate-scale", "0.5"], "--rate-scale applies to one engine's scenarios, not to node"),
    (["--policy", "partition", "--steps", "0"], "--steps must be > 0"),
    ([], "give --policy SPEC"),
])
def test_bad_node_eval_input_is_refused_naming_it(args, message, capsys):
    assert main(["eval", "--scenario", "node_chat_pair", *args]) == 2
    assert message in capsys.readouterr().err


def test_a_node_whose_clients_give_up_counts_them_for_that_tenant_and_the_node(tmp_path, capsys):
    """A tenant whose engine sets client_timeout_s (node scenario YAML): the table counts the
    requests its clients gave up, the tenant's and the node's; a tenant whose clients wait has no row."""
    data = yaml.safe_load((SCENARIOS / "node_reasoning.yaml").read_text())
    data["tenants"][0]["engine"] = {**data["tenants"][0]["engine"], "client_timeout_s": 5.0}
    path = tmp_path / "node_gives_up.yaml"
    path.write_text(yaml.safe_dump(data))
    out = tmp_path / "node.json"
    assert main(["eval", "--scenario", str(path), "--steps", "40", "--seed", "0", "--policy", "partition",
                 "--json", str(out)]) == 0
    text = capsys.readouterr().out
    r = json.loads(out.read_text())["results"]["partition"]
    assert r["a/requests_abandoned"] > 0 == r["b/requests_abandoned"]  # only a's clients give up
    assert r["requests_abandoned"] == r["a/requests_abandoned"]
    rows = {line.split("  ")[0]: line for line in text.splitlines()}
    assert f"{r['a/requests_abandoned']:.0f}" in rows["a: given up by clients"].split()[-1]
    assert "given up by clients" in rows and "b: given up by clients" not in rows
