"""A node live: two engines on one GPU steered by one real ``rlctl serve --node`` process through
``DecideNode`` (rlctl/online/node_live.py), every request completed, faults counted; the node
protocol's checks on both sides."""
from __future__ import annotations

import json
import subprocess
import sys

import grpc
import pytest
import yaml

from engine.node_control import encode_action
from env.shared_gpu_env import SharedGPUEnv
from rlctl.online.node_live import NodeLiveController, replay_node_live
from rlctl.online.node_messages import node_snapshot_message
from rlctl.online.proto import controller_pb2 as pb
from rlctl.online.proto import controller_pb2_grpc as pb_grpc
from tests.sidecar_process import REPO, Sidecar

SCENARIOS = REPO / "experiments" / "scenarios"


def chat_pair(tmp_path, steps: int = 15) -> str:
    """node_chat_pair (two tenants with offset busy and quiet phases), ``steps`` decisions long."""
    data = yaml.safe_load((SCENARIOS / "node_chat_pair.yaml").read_text())
    data.update(max_steps=steps, name="chat_pair_short")
    path = tmp_path / "chat_pair_short.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


def both_busy(tmp_path, mode: str, steps: int = 30) -> str:
    """Both tenants busy at once (8 req/s of ShareGPT conversations each), their MPS limits summing
    to 1.4x the device, OOMs by ``mode``: if one grows, the device runs out."""
    data = yaml.safe_load((SCENARIOS / "node_chat_pair.yaml").read_text())
    for t in data["tenants"]:
        t["engine"]["oom_mode"] = mode
        t.pop("phase_offset")
        t["workload"] = {"arrivals": {"kind": "poisson", "rate": 8.0},
                         "prompt": {"kind": "trace", "trace": "sharegpt_8k_lengths_llama2tok.csv", "column": "prompt"},
                         "output": {"kind": "trace", "trace": "sharegpt_8k_lengths_llama2tok.csv", "column": "output"},
                         "max_tokens": "fixed:4096"}
    data.pop("cycle")
    data.update(max_steps=steps, name=f"both_busy_{mode}")
    path = tmp_path / f"both_busy_{mode}.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


def live(scenario: str, address: str, seed: int = 0, **kwargs):
    env = SharedGPUEnv(scenario)
    env.reset(seed=seed)
    submitted = {n: len(e.records) for n, e in env.node.engines.items()}
    controller = NodeLiveController(address, env.shares, **kwargs)
    try:
        return env.node, submitted, replay_node_live(env.node, controller, env.scenario.decision_interval_s)
    finally:
        controller.close()


def every_request_completed(node, submitted, figures) -> None:
    for name, e in node.engines.items():
        assert submitted[name] > 0
        assert figures["engines"][name]["requests_completed"] == submitted[name], name
        assert figures["engines"][name]["requests_unfinished"] == 0, name


def test_two_engines_under_one_sidecar_complete_every_request(tmp_path):
    address = f"unix://{tmp_path}/node.sock"
    sidecar = Sidecar(address, "watermark", "--node", allow_baselines=True)
    try:
        node, submitted, figures = live(chat_pair(tmp_path), address)
    finally:
        sidecar.stop()
    every_request_completed(node, submitted, figures)
    assert figures["controller_decisions"] == figures["intervals"] > 0
    assert figures["fallbacks"] == 0 and figures["reconnects"] == 0
    # the node watermark scales up whichever engine needs it: the decisions name both engines
    moved = {name.split(":")[0] for name, n in figures["node_actions"].items() if n and name != "hold"}
    assert moved == {"a", "b"}
    assert sum(figures["node_actions"].values()) == figures["controller_decisions"]


def test_a_sidecar_that_goes_away_falls_back_and_loses_no_request(tmp_path):
    address = f"unix://{tmp_path}/node.sock"
    sidecar = Sidecar(address, "watermark", "--node", allow_baselines=True)
    env = SharedGPUEnv(chat_pair(tmp_path))
    env.reset(seed=1)
    controller = NodeLiveController(address, env.shares, safe_factor=1.0, backoff_s=0.01, backoff_max_s=0.05)
    try:
        for k in range(1, 4):
            assert controller.step_node(env.node, k * 2.0) is not None
        sidecar.stop()  # mid-run: every later interval runs under the safe factor
        k = 3
        while env.node.has_work():
            k += 1
            assert controller.step_node(env.node, k * 2.0) is None
    finally:
        controller.close()
        sidecar.stop()
    report = controller.report()
    assert report["controller_decisions"] == 3
    assert report["fallbacks_connection"] == k - 3 > 0 and report["reconnects"] > 0
    assert all(e.overcommit == 1.0 for e in env.node.engines.values())
    for e in env.node.engines.values():
        assert len(e.completed) == len(e.records) > 0


@pytest.mark.parametrize("mode", ["crash", "preempt"])
def test_a_tenant_made_to_grow_runs_the_device_out_and_no_request_is_lost(tmp_path, mode):
    # the sidecar answers a:scale_up to every decision (a fault injected on the wire): engine a
    # admits without bound while b is busy too, and their limits sum to more than the device
    address = f"unix://{tmp_path}/node.sock"
    grow_a = encode_action(0, "scale_up")
    sidecar = Sidecar(address, "watermark", "--node", "--fault-action", str(grow_a), allow_baselines=True)
    try:
        node, submitted, figures = live(both_busy(tmp_path, mode), address)
    finally:
        sidecar.stop()
    every_request_completed(node, submitted, figures)
    assert figures["node_actions"] == {"a:scale_up": figures["controller_decisions"]}
    a, b = node.engines["a"], node.engines["b"]
    if mode == "crash":  # a's OOMs crash it; its requests are requeued and served after the restart
        assert a.counters.oom_events > 0
        assert any(r.restarts for r in a.records.values())
    else:  # the device runs out under b too: b preempts (its OOM path) though its own quota never moved
        assert b.overcommit == 1.0 and b.counters.preemptions > 0 and a.counters.preemptions > 0
        assert a.counters.oom_events == b.counters.oom_events == 0


def test_the_node_protocol_is_checked_on_both_sides(tmp_path):
    node_address, one_address = f"unix://{tmp_path}/node.sock", f"unix://{tmp_path}/one.sock"
    node_sidecar = Sidecar(node_address, "watermark", "--node", allow_baselines=True, metrics=True)
    one_sidecar = Sidecar(one_address, "watermark")
    env = SharedGPUEnv(chat_pair(tmp_path))
    env.reset(seed=0)
    snapshots = {n: e.snapshot() for n, e in env.node.engines.items()}
    msg = node_snapshot_message(env.node, snapshots, env.shares, seq=7)
    try:
        with grpc.insecure_channel(node_address) as ch:
            stub = pb_grpc.ControllerStub(ch)
            d = stub.DecideNode(msg, timeout=10)
            assert d.seq == 7 and d.policy_hash
            with pytest.raises(grpc.RpcError) as exc:  # one engine's call to a node sidecar
                stub.Decide(msg.engines[0].snapshot, timeout=10)
            assert exc.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "DecideNode" in exc.value.details()
            for change, field in ((lambda m: setattr(m.engines[1], "mps_limit_bytes", 0), "engines[1].mps_limit_bytes"),
                                  (lambda m: setattr(m.engines[1].snapshot, "engine_id", "a"), "engines[1].snapshot.engine_id"),
                                  (lambda m: setattr(m.engines[0].snapshot, "alloc_ratio", 1.5),
                                   "engines[0].snapshot.alloc_ratio"),
                                  (lambda m: setattr(m, "device_free_bytes", m.device_capacity_bytes + 1),
                                   "device_free_bytes"),
                                  (lambda m: m.ClearField("engines"), "engines"),
                                  (lambda m: [m.engines.add().CopyFrom(m.engines[0]) or
                                              setattr(m.engines[-1].snapshot, "engine_id", f"more-{k}")
                                              for k in range(63)], "lists 65 engines; a node holds at most 64")):
                bad = pb.NodeSnapshot()
                bad.CopyFrom(msg)
                change(bad)
                with pytest.raises(grpc.RpcError) as exc:
                    stub.DecideNode(bad, timeout=10)
                assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT and field in exc.value.details(), field
            for k in range(3):  # engines named by the client: the metrics count by action and field, not by name
                other = pb.NodeSnapshot()
                other.CopyFrom(msg)
                for i, es in enumerate(other.engines):
                    es.snapshot.engine_id = f"engine-{k}-{i}"
                stub.DecideNode(other, timeout=10)
        labels = {dict(k[1]).get("action") for k, v in node_sidecar.metrics().items()
                  if k[0] == "rlctl_sidecar_decisions_total" and v}
        assert labels and all(a == "hold" or a.startswith("node:") for a in labels), labels
        fields = {dict(k[1])["field"] for k, v in node_sidecar.metrics().items()
                  if k[0] == "rlctl_sidecar_invalid_requests_total" and v}
        assert {"engines[].mps_limit_bytes", "engines[].snapshot.alloc_ratio", "engines"} <= fields, fields
        with grpc.insecure_channel(one_address) as ch:  # a node's call to one engine's sidecar
            with pytest.raises(grpc.RpcError) as exc:
                pb_grpc.ControllerStub(ch).DecideNode(msg, timeout=10)
            assert exc.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "--node" in exc.value.details()
    finally:
        node_sidecar.stop()
        one_sidecar.stop()


def test_rlctl_replay_node_runs_live_and_says_what_happened(tmp_path):
    address = f"unix://{tmp_path}/node.sock"
    sidecar = Sidecar(address, "watermark", "--node", allow_baselines=True)
    out = tmp_path / "node.json"
    try:
        run = subprocess.run([sys.executable, "-m", "rlctl.cli", "replay", "--node", chat_pair(tmp_path), "--controller",
                              address, "--seed", "2", "--json", str(out)], cwd=REPO, capture_output=True, text=True,
                             timeout=300)
    finally:
        sidecar.stop()
    assert run.returncode == 0, run.stderr
    assert "0 fallbacks" in run.stdout and "requests completed" in run.stdout
    figures = json.loads(out.read_text())
    assert figures["fallbacks"] == 0 and figures["seed"] == 2
    assert all(f["requests_unfinished"] == 0 for f in figures["engines"].values())
    refused = subprocess.run([sys.executable, "-m", "rlctl.cli", "replay", "--node", chat_pair(tmp_path)], cwd=REPO,
                             capture_output=True, text=True, timeout=120)
    assert refused.returncode != 0 and "--controller" in refused.stderr
