"""A node whose engines are processes (rlctl/online/process_node.py): each an MPS client started
with its own ``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT``, checked exactly in the process's environment;
one device ledger shared by all; a restart under a new limit that loses nothing; the live loop and
``rlctl replay --node --processes`` against a real node sidecar."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from engine.device import Device
from engine.executor import ProfiledExecutor
from engine.node import Node
from engine.node_control import encode_action, run_node_interval
from engine.roofline import DEPLOYMENTS
from engine.shared_device import SharedDevice
from env.node_scenario import load_node_scenario
from rlctl.online.mps import CLIENT_LIMIT_ENV, client_limit_value
from rlctl.online.node_live import NodeLiveController, replay_node_live
from rlctl.online.process_node import EngineProcessError, ProcessNode
from tests.sidecar_process import REPO, Sidecar
from tests.test_node_live import both_busy, chat_pair


def environ_of(pid: int) -> dict[str, str]:
    """The environment process ``pid`` was started with, as the kernel keeps it."""
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(entry.decode().split("=", 1) for entry in raw if entry)


def small_environ() -> dict[str, str]:
    return {"PATH": os.environ["PATH"], "PYTHONPATH": str(REPO), "HOME": os.environ.get("HOME", "/tmp"),
            "OMP_NUM_THREADS": "1"}


def run_to_completion(node: ProcessNode, step_s: float = 10.0) -> None:
    t = node.clock
    while node.has_work():
        t += step_s
        node.advance(t)


def completed_every_request(node: ProcessNode) -> None:
    figures = node.figures()
    for name in node.names:
        assert figures[name]["requests_completed"] == figures[name]["requests_submitted"] > 0, name


def test_each_engine_is_a_process_started_with_its_own_limit_and_sized_to_it(tmp_path):
    scenario = chat_pair(tmp_path, steps=5)
    sc, base = load_node_scenario(scenario), small_environ()
    with ProcessNode(scenario, seed=0, environ=base) as node:
        pids = {n: e.pids[0] for n, e in node.engines.items()}
        assert len(set(pids.values())) == 2 and os.getpid() not in pids.values()
        in_process = Node(Device(sc.gpu.memory_bytes))
        for t in sc.tenants:
            limit = ProcessNode.exact_limit(sc.limit_bytes(t))
            # the child's environment is the node's plus its own limit, nothing else: no daemon-wide default
            assert environ_of(pids[t.name]) == {**base, CLIENT_LIMIT_ENV: client_limit_value({0: limit})}
            assert node.engines[t.name].device.capacity == limit
            # sized to the limit as an engine in the node's own process is
            twin = in_process.add(t.name, DEPLOYMENTS[t.deployment].model, node.engines[t.name].base_config, limit,
                                  executor=ProfiledExecutor(sc.cost_model(t)))
            assert node.engines[t.name].num_blocks == twin.num_blocks
        # one device: every process's weights (and nothing else yet) are charged to the same ledger
        assert node.device.used == sum(e.device.used for e in node.engines.values()) == in_process.device.used


def test_a_new_limit_restarts_the_process_under_it_and_loses_nothing(tmp_path):
    scenario = chat_pair(tmp_path, steps=10)
    base = small_environ()
    with ProcessNode(scenario, seed=1, environ=base) as node:
        node.advance(12.0)
        a = node.engines["a"]
        old_pid, old_blocks = a.pids[0], a.num_blocks
        held = a.state["counters"]
        a.set_overcommit(0.5)
        limit = node.limit_for("a", round(0.5 * old_blocks))
        # the node's own action, as the environment and the live loop apply it: resize a to its quota
        effect = run_node_interval(node, encode_action(0, "resize"), 14.0).effect
        assert effect["restarted"] and effect["limit_bytes"] == limit and a.overcommit == 1.0
        new_pid = a.pids[-1]
        assert a.pids == [old_pid, new_pid] and new_pid != old_pid
        assert not Path(f"/proc/{old_pid}").exists()  # the old client is gone: MPS binds a limit only at a start
        assert environ_of(new_pid) == {**base, CLIENT_LIMIT_ENV: client_limit_value({0: ProcessNode.exact_limit(limit)})}
        assert a.num_blocks < old_blocks and a.state["down"] and a.state["clock"] == 14.0  # down: its restart time
        assert not node.set_limit("a", limit)  # the limit in force: no restart
        run_to_completion(node)
        completed_every_request(node)
        assert node.figures()["a"]["restarts"] == 1 and held["restarts"] == 0
        assert node.figures()["a"]["env_limits"] == [client_limit_value({0: ProcessNode.exact_limit(x)})
                                                      for x in (node.scenario.limit_bytes(node.scenario.tenants[0]), limit)]
        # what the first process had admitted was handed over, its record counting the restart
        assert any(r.restarts for r in node.records["a"].values())
        assert node.device.used == sum(e.device.used for e in node.engines.values())  # the old process gave back all


def test_the_shared_ledger_refuses_what_another_process_holds(tmp_path):
    path = tmp_path / "device"
    first = SharedDevice.create(path, 1000)
    second = SharedDevice(path)  # another process's view: the same file
    first.charge("kv", 700)
    assert second.used == 700 and second.free == 300
    with pytest.raises(Exception, match="out of device memory"):
        second.charge("kv", 301)
    second.charge("workspace", 300)
    first.release("kv", 700)
    assert second.charged == {"weights": 0, "workspace": 300, "kv": 0, "tenants": 0}
    first.close()
    second.close()


def test_a_tenant_made_to_grow_runs_the_shared_device_out_across_processes(tmp_path):
    scenario = both_busy(tmp_path, "crash", steps=20)
    with ProcessNode(scenario, seed=0, environ=small_environ()) as node:
        node.engines["a"].set_overcommit(8.0)  # a admits without bound while b is busy too
        run_to_completion(node, step_s=2.0)
        completed_every_request(node)
        figures = node.figures()
        assert figures["a"]["oom_events"] + figures["b"]["oom_events"] > 0  # the device ran out in some process
        assert all(f["pids"] == f["pids"][:1] for f in figures.values())  # an OOM is the engine's, not a new client


def test_a_process_that_refuses_or_dies_is_named(tmp_path):
    scenario = chat_pair(tmp_path, steps=5)
    with ProcessNode(scenario, seed=0, environ=small_environ()) as node:
        a = node.engines["a"]
        with pytest.raises(EngineProcessError, match="refused set_overcommit.*must be a number > 0, got -1.0"):
            a.set_overcommit(-1.0)
        a.snapshot()  # the process is still up and answers
        a.proc.kill()
        with pytest.raises(EngineProcessError, match="'a'.*exited"):
            a.snapshot()
    bad = subprocess.run([sys.executable, "-m", "rlctl.online.engine_process", "--scenario", scenario, "--tenant", "a",
                          "--config", "{}", "--ledger", str(tmp_path / "none")], env=small_environ(), cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and CLIENT_LIMIT_ENV in bad.stderr


def test_a_process_that_stops_answering_is_named_and_ended_and_the_node_does_not_wait_for_ever(tmp_path):
    # found by review: an engine process stopped (SIGSTOP) held every tenant's lockstep advance with no error
    import signal
    import time

    scenario = chat_pair(tmp_path, steps=5)
    with ProcessNode(scenario, seed=0, environ=small_environ(), reply_timeout_s=2.0) as node:
        a = node.engines["a"]
        os.kill(a.proc.pid, signal.SIGSTOP)
        start = time.monotonic()
        with pytest.raises(EngineProcessError, match=r"engine 'a' \(pid \d+\) did not answer advance within 2 s"):
            node.advance(node.slice_s)
        assert time.monotonic() - start < 30 and a.proc.wait(timeout=10) == -signal.SIGKILL
        assert node.engines["b"].snapshot() is not None  # the other engine's process still answers
    with pytest.raises(ValueError, match="reply_timeout_s must be > 0 s"):
        ProcessNode(scenario, environ=small_environ(), reply_timeout_s=0)


def test_one_sidecar_steers_the_engine_processes_live(tmp_path):
    address = f"unix://{tmp_path}/node.sock"
    scenario = chat_pair(tmp_path, steps=15)
    sidecar = Sidecar(address, "watermark", "--node", allow_baselines=True)
    try:
        with ProcessNode(scenario, seed=0, environ=small_environ()) as node:
            controller = NodeLiveController(address, {t.name: t.share for t in node.scenario.tenants})
            try:
                figures = replay_node_live(node, controller, node.scenario.decision_interval_s)
            finally:
                controller.close()
    finally:
        sidecar.stop()
    assert figures["controller_decisions"] == figures["intervals"] > 0 and figures["fallbacks"] == 0
    for f in figures["engines"].values():
        assert f["requests_completed"] == f["requests_submitted"] > 0
    moved = {name.split(":")[0] for name, n in figures["node_actions"].items() if n and name != "hold"}
    assert moved == {"a", "b"}


def test_rlctl_replay_node_processes_says_what_each_process_was_started_with(tmp_path):
    address = f"unix://{tmp_path}/node.sock"
    sidecar = Sidecar(address, "watermark", "--node", allow_baselines=True)
    out = tmp_path / "node.json"
    try:
        run = subprocess.run([sys.executable, "-m", "rlctl.cli", "replay", "--node", chat_pair(tmp_path, steps=8),
                              "--controller", address, "--processes", "--seed", "1", "--json", str(out)], cwd=REPO,
                             capture_output=True, text=True, timeout=300)
    finally:
        sidecar.stop()
    assert run.returncode == 0, run.stderr
    assert "every engine its own process" in run.stdout and f"{CLIENT_LIMIT_ENV}=0=" in run.stdout
    figures = json.loads(out.read_text())
    assert figures["fallbacks"] == 0
    assert all(f["requests_completed"] == f["requests_submitted"] for f in figures["engines"].values())
    refused = subprocess.run([sys.executable, "-m", "rlctl.cli", "replay", "--processes", "--trace", "x.csv"],
                             cwd=REPO, capture_output=True, text=True, timeout=120)
    assert refused.returncode != 0 and "--node" in refused.stderr
