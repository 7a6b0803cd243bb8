"""Traffic that stays on this host never goes through a proxy named in the environment: with
``http_proxy``, ``https_proxy`` and ``grpc_proxy`` pointing at a proxy that is not there, a sidecar
decides over a unix socket and over loopback TCP, and the engine's metrics scrape over loopback.
The same environment does break a plain gRPC channel and a plain ``urlopen`` to loopback, so the
test stands in a hostile environment, not a harmless one."""
from __future__ import annotations

import urllib.error
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from engine.config import EngineConfig
from rlctl.online.addresses import channel_options, check_metrics_addr, is_local_target
from rlctl.online.engine_metrics import EngineMetrics
from rlctl.online.live import LiveController
from tests.sidecar_process import free_port, scrape_text
from tests.test_live_metrics import profiled_engine


@pytest.fixture
def unreachable_proxy(monkeypatch):
    proxy = f"http://127.0.0.1:{free_port()}"  # nothing listens there: a request through it fails
    for name in ("http_proxy", "https_proxy", "grpc_proxy", "HTTP_PROXY", "HTTPS_PROXY"):
        monkeypatch.setenv(name, proxy)
    for name in ("no_proxy", "NO_PROXY", "no_grpc_proxy"):
        monkeypatch.delenv(name, raising=False)
    return proxy


def test_a_sidecar_decides_over_a_unix_socket_and_loopback_despite_the_proxy(unreachable_proxy, sidecars, tmp_path):
    for address in (f"unix://{tmp_path}/s.sock", f"127.0.0.1:{free_port()}"):
        sidecars(address, "static:1.4")  # started and found SERVING through open_channel, in this environment
        controller = LiveController(address, deadline_s=5.0)
        engine = profiled_engine(EngineConfig(num_blocks=64), 1.0, "crash")
        try:
            decision = controller.step(engine, 0.5)
        finally:
            controller.close()
        assert decision is not None and controller.decisions == 1 and sum(controller.fallbacks.values()) == 0
        assert decision.overcommit == 1.4 and engine.overcommit == 1.4

    # the control: the same environment sends a plain channel to loopback into the proxy, and it fails
    s = sidecars(f"127.0.0.1:{free_port()}", "static:1.4")
    with grpc.insecure_channel(s.address) as plain, pytest.raises(grpc.RpcError) as caught:
        health_pb2_grpc.HealthStub(plain).Check(health_pb2.HealthCheckRequest(), timeout=5)
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE


def test_a_loopback_metrics_scrape_bypasses_the_proxy(unreachable_proxy):
    metrics = EngineMetrics(model_name="tiny")
    server, _ = metrics.start_http(0)
    try:
        text = scrape_text(server.server_port)
        with pytest.raises(urllib.error.URLError):  # the control: urllib's default opener takes the proxy
            urllib.request.urlopen(f"http://127.0.0.1:{server.server_port}/metrics", timeout=5)
    finally:
        server.shutdown()
        server.server_close()
    assert 'vllm:num_requests_running{engine="0",model_name="tiny"} 0.0' in text


@pytest.mark.parametrize("address, local", [
    ("unix:///tmp/rlctl.sock", True), ("127.0.0.1:50051", True), ("127.3.2.1:1", True), ("localhost:50051", True),
    ("[::1]:50051", True), ("dns:///localhost:50051", True), ("10.0.0.5:50051", False),
    ("sidecar.internal:50051", False), ("[2001:db8::1]:443", False)])
def test_only_local_targets_switch_the_proxy_off(address, local):
    assert is_local_target(address) is local
    assert channel_options(address) == ([("grpc.enable_http_proxy", 0)] if local else [])


def test_a_metrics_address_beyond_loopback_needs_the_explicit_opt_in():
    for ok in ("127.0.0.1", "127.0.0.2", "::1", "localhost"):
        check_metrics_addr(ok, public=False)
    for beyond in ("0.0.0.0", "::", "192.0.2.7", "metrics.example"):
        with pytest.raises(ValueError, match=f"--metrics-addr {beyond}: not a loopback address.*--metrics-public"):
            check_metrics_addr(beyond, public=False)
        check_metrics_addr(beyond, public=True)
    with pytest.raises(ValueError, match="expected a host name or IP address"):
        check_metrics_addr("", public=True)
