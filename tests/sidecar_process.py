"""A real ``rlctl serve`` process for the tests, started and always killed; a free port; a policy file; a
metrics scrape."""
from __future__ import annotations

import socket
import subprocess
import sys
import urllib.request
from pathlib import Path

import grpc
from prometheus_client.parser import text_string_to_metric_families

from agents.spec import is_baseline
from rlctl.online.live import ClientTLS, wait_serving
from rlctl.online.proto import controller_pb2_grpc as pb_grpc

REPO = Path(__file__).resolve().parent.parent


# a scrape of this host's metrics never goes through a proxy named in the environment (http_proxy)
_NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def scrape_text(port: int, host: str = "127.0.0.1") -> str:
    """The Prometheus text served at http://host:port/metrics, fetched without any proxy."""
    with _NO_PROXY.open(f"http://{host}:{port}/metrics", timeout=10) as resp:
        return resp.read().decode()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Sidecar:
    """An ``rlctl serve`` process, ready (health SERVING) once constructed; ``stop()`` always kills it."""

    def __init__(self, address: str, policy: str = "watermark", *extra: str, metrics: bool = False,
                 tls: ClientTLS | None = None, allow_baselines: bool | None = None) -> None:
        """``allow_baselines``: pass ``--allow-baselines``; by default exactly when ``policy`` is a baseline spec."""
        self.address, self.tls = address, tls
        self.metrics_port = free_port() if metrics else None
        if allow_baselines is None:
            allow_baselines = is_baseline(policy)
        cmd = [sys.executable, "-m", "rlctl.cli", "serve", "--policy", policy, "--listen", address, *extra]
        cmd += ["--allow-baselines"] if allow_baselines else []
        if self.metrics_port:
            cmd += ["--metrics-port", str(self.metrics_port)]
        self.proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            self._wait_serving()
        except BaseException:
            self.stop()
            raise

    def _wait_serving(self, timeout_s: float = 120.0) -> None:
        try:
            wait_serving(self.address, timeout_s, self.tls, alive=lambda: self.proc.poll() is None)
        except RuntimeError:
            raise AssertionError(f"rlctl serve exited {self.proc.wait()}: {self.proc.stdout.read()}") from None

    def stub(self, ch: grpc.Channel) -> pb_grpc.ControllerStub:
        return pb_grpc.ControllerStub(ch)

    def metrics(self) -> dict[tuple[str, tuple], float]:
        text = scrape_text(self.metrics_port)
        return {(s.name, tuple(sorted(s.labels.items()))): s.value
                for family in text_string_to_metric_families(text) for s in family.samples}

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=30)


def untrained_policy_file(path: Path, seed: int, net_arch: tuple[int, ...] = (32, 16)) -> Path:
    """An exported, untrained Q-network: a real policy file, its weights (and hash) set by ``seed``."""
    from agents.dqn import OvercommitDQN
    from agents.export import export_policy
    from env.overcommit_env import OvercommitEnv
    from env.scenario_yaml import load_scenario

    scenario = load_scenario("burst")
    model = OvercommitDQN(env=OvercommitEnv(scenario), net_arch=net_arch, buffer_size=100, seed=seed, device="cpu")
    export_policy(model, path, scenario=scenario, training_config={"untrained": True, "seed": seed})
    return path
