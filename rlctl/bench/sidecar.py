"""``rlctl bench sidecar``: what asking the sidecar costs the live loop. Decide latency (p50, p99)
and decisions/s, one decision in flight, over a unix socket and over loopback TCP to an
``rlctl serve`` process, and the Live stream over the unix socket; each against two references
measured in the same run: a plain in-process call of the same policy (observe + act + shield) on
the same engine snapshots, and gRPC's own floor, an RPC with (almost) nothing to do on the same
server and channel (the health service's Check). Where Linux says, also the server's CPU time
per call, which a loaded machine inflates far less than it does the latency's tail.
A benchmark, not a test: it measures and reports.
"""
from __future__ import annotations

import queue
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import grpc
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from agents.dqn import OvercommitDQN
from agents.export import export_policy
from agents.spec import is_baseline
from engine.config import EngineConfig
from engine.cost_model import CostModel
from engine.executor import ProfiledExecutor
from env.overcommit_env import OvercommitEnv
from env.scenario_yaml import load_scenario
from env.workloads import ReplaySpec, bundled_trace
from rlctl.bench.machine import machine, sig
from rlctl.online.confine import Confinement
from rlctl.online.live import open_channel, wait_serving
from rlctl.online.messages import snapshot_message
from rlctl.online.proto import controller_pb2_grpc as pb_grpc
from rlctl.online.served import WrongScope, load_served_policy
from rlctl.online.sidecar import TORCH_THREADS
from rlctl.replay import build_engine, load_requests


# ---- rlctl bench sidecar -----------------------------------------------------------------------
@dataclass(frozen=True)
class SidecarBenchSizes:
    """What ``rlctl bench sidecar`` runs; the defaults take well under a minute on two CPU cores."""

    policy: str | None = None  # a policy spec or file; None: an untrained network of the training shape, exported
    snapshots: int = 200       # distinct snapshots, taken every 0.1 s of a replay of the bundled Azure trace
    decisions: int = 2000      # timed decisions per transport, cycling through the snapshots
    warmup: int = 200

    def __post_init__(self) -> None:
        for name in ("snapshots", "decisions"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.warmup < 0:
            raise ValueError(f"warmup must be >= 0, got {self.warmup}")


def _bench_snapshots(n: int) -> tuple[list, int]:
    """``n`` snapshots of a busy engine (tensor-free, on a stated cost model) and its max_model_len."""

    cost = CostModel(fixed_s=1.5e-3, per_token_s=2e-5, per_context_token_s=2e-7, copy_fixed_s=1e-5, copy_bytes_per_s=2e9)
    engine = build_engine(EngineConfig(num_blocks=128, max_model_len=2048), 1.5, "crash",
                          executor=ProfiledExecutor(cost, materialize=False))
    spec = ReplaySpec(max_tokens="fixed:1024", time_scale=10.0, duration_s=600.0, max_model_len=2048)
    for r in load_requests(bundled_trace("azure2023_conv.csv"), spec):
        engine.submit(r)
    snaps = [engine.snapshot()]
    while len(snaps) < n and engine.has_work():
        engine.run(until=engine.clock + 0.1)
        snaps.append(engine.snapshot())
    return snaps, engine.max_model_len


def _bench_policy_file(folder: Path) -> str:
    """An untrained Q-network of the training configuration's shape, exported: a decision's cost
    does not depend on the weights."""

    scenario = load_scenario("steady")
    model = OvercommitDQN(env=OvercommitEnv(scenario), buffer_size=1000, device="cpu")  # the default network
    path = folder / "untrained.rlpolicy"
    export_policy(model, path, scenario=scenario, training_config={"untrained": True})
    return str(path)


BLOCK = 100  # calls of one kind in a row: the kinds alternate in blocks, so that a change in the machine's load
             # falls on all of them alike


def _server_cpu_s(pid: int) -> float | None:
    """CPU seconds used so far by every thread of process ``pid`` (Linux's schedstat, in ns), or None."""
    try:
        return sum(int(Path(t, "schedstat").read_text().split()[0]) for t in Path(f"/proc/{pid}/task").iterdir()) / 1e9
    except (OSError, ValueError, IndexError):
        return None


def _interleaved(calls: dict[str, Callable[[int], object]], n: int, warmup: int,
                 server_cpu: Callable[[], float | None] = lambda: None) -> dict[str, dict]:
    """Latency (p50, p99, mean), calls/s and, where it can be read, the server's CPU time per call,
    of each of ``calls``, timed ``n`` times each, one call in flight, the kinds alternating in blocks."""
    times: dict[str, list[float]] = {k: [] for k in calls}
    wall = dict.fromkeys(calls, 0.0)
    cpu: dict[str, float | None] = dict.fromkeys(calls, 0.0)
    for call in calls.values():
        for i in range(warmup):
            call(i)
    for start in range(0, n, BLOCK):
        for kind, call in calls.items():
            c0, t_block = server_cpu(), time.perf_counter()
            for i in range(start, min(n, start + BLOCK)):
                t0 = time.perf_counter()
                call(i)
                times[kind].append(time.perf_counter() - t0)
            wall[kind] += time.perf_counter() - t_block
            c1 = server_cpu()
            cpu[kind] = None if c0 is None or c1 is None or cpu[kind] is None else cpu[kind] + c1 - c0
    out = {}
    for kind, ts in times.items():
        ts.sort()
        pick = lambda q: ts[min(len(ts) - 1, int(q * len(ts)))]  # noqa: E731
        out[kind] = {"p50_us": sig(1e6 * pick(0.5)), "p99_us": sig(1e6 * pick(0.99)),
                     "mean_us": sig(1e6 * wall[kind] / n), "decisions_per_s": sig(n / wall[kind])}
        if cpu[kind] is not None:
            out[kind]["server_cpu_us_per_call"] = sig(1e6 * cpu[kind] / n)
    return out


def _over_the_wire(address: str, policy: str, msgs: list, sizes: SidecarBenchSizes, stream: bool) -> dict:
    """Start ``rlctl serve`` on ``address`` and time, from this process, closed-loop Decide calls,
    with ``stream`` the Live stream (one snapshot in flight), and gRPC's own floor: the health
    service's Check on the same server and channel, an RPC with (almost) nothing to do."""
    baseline = ["--allow-baselines"] if is_baseline(policy) else []
    proc = subprocess.Popen([sys.executable, "-m", "rlctl.cli", "serve", "--policy", policy, "--listen", address,
                             *baseline], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_serving(address, 120.0, alive=lambda: proc.poll() is None)
        with open_channel(address) as ch:
            stub, health = pb_grpc.ControllerStub(ch), health_pb2_grpc.HealthStub(ch)
            check = health_pb2.HealthCheckRequest()
            calls = {"empty_rpc": lambda i: health.Check(check, timeout=5),
                     "decide": lambda i: stub.Decide(msgs[i % len(msgs)](), timeout=5)}
            q: queue.Queue = queue.Queue()
            if stream:
                answers = stub.Live(iter(q.get, None))

                def one(i: int):
                    q.put(msgs[i % len(msgs)]())
                    return next(answers)

                calls["live_stream"] = one
            try:
                return _interleaved(calls, sizes.decisions, sizes.warmup, lambda: _server_cpu_s(proc.pid))
            finally:
                q.put(None)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def bench_sidecar(sizes: SidecarBenchSizes | None = None) -> dict:
    """Decide latency (p50/p99) and decisions/s over a unix socket and over loopback against a
    plain in-process call of the same policy (observe + act + shield) on the same snapshots."""


    sizes = sizes or SidecarBenchSizes()
    t0 = time.perf_counter()
    load_at_start = machine()
    snaps, max_model_len = _bench_snapshots(sizes.snapshots)
    with tempfile.TemporaryDirectory(prefix="rlctl-bench-") as folder:
        policy = sizes.policy or _bench_policy_file(Path(folder))
        try:
            served = load_served_policy(policy, Confinement(allow_baselines=True))
        except WrongScope as exc:
            if exc.node_policy:  # the benchmark has no --node
                raise ValueError(f"--policy {policy}: a node policy; rlctl bench sidecar measures one engine's "
                                 "decisions (Decide), so give it one engine's policy") from None
            raise
        threads = torch.get_num_threads()
        torch.set_num_threads(TORCH_THREADS)  # as rlctl serve runs it
        try:
            in_process = _interleaved({"in_process": lambda i: served.decide(snaps[i % len(snaps)])},
                                      sizes.decisions, sizes.warmup)["in_process"]
        finally:
            torch.set_num_threads(threads)
        # the wire path builds each message as the live loop does, so that cost is counted
        msgs = [lambda s=s, k=k: snapshot_message(s, max_model_len, "bench", k) for k, s in enumerate(snaps)]
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        transports = {"unix": _over_the_wire(f"unix://{folder}/sidecar.sock", policy, msgs, sizes, stream=True),
                      "loopback": _over_the_wire(f"127.0.0.1:{port}", policy, msgs, sizes, stream=False)}
    for t in transports.values():
        floor = t["empty_rpc"]
        for kind, call in t.items():
            call["p50_ratio_to_in_process"] = sig(call["p50_us"] / in_process["p50_us"], 3)
            call["p99_ratio_to_in_process"] = sig(call["p99_us"] / in_process["p99_us"], 3)
            call["throughput_ratio_to_in_process"] = sig(call["decisions_per_s"] / in_process["decisions_per_s"], 3)
            if kind != "empty_rpc":
                call["p50_ratio_to_empty_rpc"] = sig(call["p50_us"] / floor["p50_us"], 3)
                call["p99_ratio_to_empty_rpc"] = sig(call["p99_us"] / floor["p99_us"], 3)

    return {
        "policy": sizes.policy or f"untrained network {list(served.policy.header['network']['net_arch'])}, dueling "
                                  f"{served.policy.header['network']['dueling']} (exported)",
        "policy_kind": served.kind, "snapshots": len(snaps), "decisions": sizes.decisions,
        "warmup": sizes.warmup, "mode": "closed loop: one decision in flight, the client in this process, "
                                        "rlctl serve in another; on each transport the calls alternate in blocks "
                                        f"of {BLOCK}",
        "empty_rpc": "gRPC's floor: the health service's Check on the same server and channel",
        "in_process": in_process, **transports,
        "machine": load_at_start | {"grpc_version": grpc.__version__, "torch_threads": TORCH_THREADS},
        "bench_s": round(time.perf_counter() - t0, 1),
    }
