"""The sidecar and the live loop, against real ``rlctl serve`` processes: a replay steered over a
unix socket and over loopback completes with every request served; a policy reloaded mid-replay
takes over without a failed decision; and every fault (the sidecar killed, a decision past its
deadline, an unknown action id, malformed snapshots, a file that is not a policy) ends in a clear
gRPC status or a counted fallback, never in a lost request.

The engine is the tensor-free profiled one on a stated cost model (tests/test_overcommit.py's
deployment), so that the replays take milliseconds of CPU and no figure depends on timing.
"""
from __future__ import annotations

import dataclasses
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest

from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from experiments import SCENARIOS
from engine.config import EngineConfig
from engine.cost_model import CostModel
from engine.executor import ProfiledExecutor
from engine.snapshot import Snapshot
from env.observation import FEATURES
from env.workloads import ReplaySpec
from rlctl.online.live import ClientTLS, LiveController, check_decision, open_channel, replay_live
from rlctl.report import LIVE_ROWS
from rlctl.online.messages import (COUNTS, HISTOGRAMS, MEASURES, OTHER, RATIOS, SIGNED, SnapshotError, snapshot_from_message,
                            snapshot_message)
from rlctl.online.proto import SERVICE_NAME, controller_pb2 as pb
from env.workloads import bundled_trace
from rlctl.replay import build_engine, load_requests
from rlctl.online.sidecar import check_listen
from tests.sidecar_process import REPO, Sidecar, free_port, untrained_policy_file

DEPLOYMENT = EngineConfig(num_blocks=128, max_model_len=2048, restart_downtime_s=1.0)
CPU_COST = CostModel(fixed_s=1.5e-3, per_token_s=2e-5, per_context_token_s=2e-7, copy_fixed_s=1e-5,
                     copy_bytes_per_s=2e9)
INTERVAL_S = 0.25  # engine seconds between decisions: ~45 decisions in the ~11 s the window takes


# ---- helpers -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def watermark_sidecar(tmp_path_factory):
    """One watermark sidecar on a unix socket, metrics on, for the tests that only talk to it."""
    s = Sidecar(f"unix://{tmp_path_factory.mktemp('sock')}/s.sock", "watermark", metrics=True)
    yield s
    s.stop()


def small_engine():
    return build_engine(DEPLOYMENT, 1.0, "crash", executor=ProfiledExecutor(CPU_COST, materialize=False))


def requests():
    spec = ReplaySpec(max_tokens="fixed:1024", time_scale=40.0, duration_s=30.0, max_model_len=2048)
    return load_requests(bundled_trace("azure2023_conv.csv"), spec)


def steered_replay(controller: LiveController, interval_s: float = INTERVAL_S) -> tuple[dict, list]:
    reqs = requests()
    engine = small_engine()
    try:
        figures = replay_live(reqs, engine, controller, interval_s)
    finally:
        controller.close()
    assert figures["requests_completed"] == figures["requests_submitted"] == len(reqs) > 40
    assert figures["requests_unfinished"] == 0
    for r in reqs:  # no request lost, none cut short
        assert engine.records[r.request_id].output_len == min(r.output_len, r.max_tokens)
    return figures, reqs


def a_snapshot() -> Snapshot:
    return small_engine().snapshot()


def trained_policy_file(path: Path) -> Path:
    """A policy file from a short DQN run (tests/test_export.py's recipe)."""
    import yaml

    from agents.dqn import OvercommitDQN
    from agents.export import export_policy
    from env.overcommit_env import OvercommitEnv
    from env.scenario_yaml import scenario_from_dict

    data = yaml.safe_load((SCENARIOS / "burst.yaml").read_text())
    scenario = scenario_from_dict({**data, "name": "burst", "max_steps": 5})
    model = OvercommitDQN(env=OvercommitEnv(scenario), net_arch=(32, 16), learning_starts=50, buffer_size=500,
                          batch_size=16, train_freq=4, target_update_interval=50, seed=0, device="cpu")
    model.learn(200)
    export_policy(model, path, scenario=scenario, training_config={"total_timesteps": 200})
    return path


# ---- the wire format, without a server ---------------------------------------------------------
def test_the_snapshot_message_carries_every_snapshot_field_and_the_check_covers_each():
    names = {f.name for f in dataclasses.fields(Snapshot)}
    assert names <= set(pb.Snapshot.DESCRIPTOR.fields_by_name)
    assert set(RATIOS + MEASURES + SIGNED + COUNTS + HISTOGRAMS + OTHER) == names
    snap = a_snapshot()
    back, max_model_len = snapshot_from_message(snapshot_message(snap, 2048, "e", 3))
    assert back == snap and max_model_len == 2048


def test_a_sender_that_predates_future_expected_is_read_as_declaring_its_worst_case():
    snap = dataclasses.replace(a_snapshot(), running=3, future_declared=4000, future_expected=1234.5)
    assert snapshot_from_message(snapshot_message(snap, 2048))[0].future_expected == 1234.5
    m = snapshot_message(snap, 2048)
    m.ClearField("future_expected")  # what an older sender's message holds: proto3's 0
    assert snapshot_from_message(m)[0].future_expected == 4000
    idle = dataclasses.replace(snap, running=0, future_declared=0, future_expected=0.0)
    assert snapshot_from_message(snapshot_message(idle, 2048))[0].future_expected == 0.0
    m.future_expected = -1.0
    with pytest.raises(SnapshotError, match="snapshot.future_expected "):
        snapshot_from_message(m)


@pytest.mark.parametrize("change, field", [
    ({"queue_hist": [0.5, 0.5]}, "queue_hist"),
    ({"running_hist": [float("nan")] + [0.0] * 9}, "running_hist"),
    ({"alloc_ratio": float("nan")}, "alloc_ratio"),
    ({"device_free": 1.5}, "device_free"),
    ({"alloc_slope": float("inf")}, "alloc_slope"),
    ({"queue_len": -1}, "queue_len"),
    ({"overcommit": 0.0}, "overcommit"),
    ({"max_model_len": 0}, "max_model_len"),
])
def test_a_malformed_snapshot_is_refused_naming_the_field(change, field):
    m = snapshot_message(a_snapshot(), 2048)
    for k, v in change.items():
        if isinstance(v, list):
            del getattr(m, k)[:]
            getattr(m, k).extend(v)
        else:
            setattr(m, k, v)
    with pytest.raises(SnapshotError, match=f"snapshot.{field} ") as err:
        snapshot_from_message(m)
    assert err.value.field == field


def test_a_decision_is_checked_before_the_engine_applies_it():
    ok = pb.Decision(seq=4, action=1, action_name="scale_up", overcommit=1.2)
    assert check_decision(ok, 4) is None
    assert "unknown action id 9" in check_decision(pb.Decision(seq=4, action=9, overcommit=1.2), 4)
    assert "expected 4" in check_decision(pb.Decision(seq=3, action=0, action_name="hold", overcommit=1.0), 4)
    assert "names it" in check_decision(pb.Decision(seq=4, action=0, action_name="evict", overcommit=1.0), 4)
    assert "not a factor > 0" in check_decision(pb.Decision(seq=4, action=0, action_name="hold",
                                                            overcommit=float("nan")), 4)
    # inf is a factor (no reservation): a snapshot carries it, and a hold echoes it back
    assert check_decision(pb.Decision(seq=4, action=0, action_name="hold", overcommit=float("inf")), 4) is None
    # a headroom past the most the shield asks (0.5) would throttle admission: a wrong sidecar's, refused
    for share in (0.51, 0.99, 1.0, -0.1, float("nan")):
        bad = pb.Decision(seq=4, action=0, action_name="hold", overcommit=1.0, admit_headroom=share)
        assert "admission headroom" in check_decision(bad, 4)
    assert check_decision(pb.Decision(seq=4, action=0, action_name="hold", overcommit=1.0, admit_headroom=0.5), 4) is None


def test_the_decision_carries_the_shields_admission_headroom_and_the_engine_takes_it(sidecars, tmp_path):
    from agents.shield import Shield

    s = sidecars(f"unix://{tmp_path}/s.sock", "static:1")  # the engine's own factor: only the headroom moves
    engine = small_engine()
    assert engine.admit_headroom == 0.0
    controller = LiveController(s.address, deadline_s=2.0)
    try:
        d = controller.step(engine, INTERVAL_S)
    finally:
        controller.close()
    assert d.admit_headroom == Shield().admit_headroom > 0 and engine.admit_headroom == d.admit_headroom
    assert engine.overcommit == 1.0 and controller.actuator_changes["engine_quota"] == 1  # a change, counted
    assert "of the KV free" in controller.actuators["engine_quota"].detail


@pytest.mark.parametrize("interval_s", [INTERVAL_S, 2.0])
def test_the_headroom_holds_the_running_batchs_growth_over_the_interval_serve_is_told(sidecars, tmp_path, interval_s):
    from agents.shield import Shield

    s = sidecars(f"unix://{tmp_path}/s.sock", "static:1", "--decision-interval", str(interval_s),
                 "--policy-dir", str(tmp_path))
    engine = small_engine()
    for req in requests()[:24]:
        engine.submit(dataclasses.replace(req, arrival_s=0.0))
    controller = LiveController(s.address, deadline_s=2.0)
    decided = []
    try:
        controller.step(engine, INTERVAL_S)
        for k in (2, 3):  # a reloaded policy is served behind the same shield
            seen = engine.last_snapshot  # what the next decision is taken on
            decided.append((seen, controller.step(engine, k * INTERVAL_S)))
            with open_channel(s.address) as ch:
                s.stub(ch).ReloadPolicy(pb.ReloadPolicyRequest(policy="static:1.0"), timeout=30)
    finally:
        controller.close()
    for seen, d in decided:
        assert seen.running > 0 and seen.decode_ms > 0
        assert d.admit_headroom == Shield(growth_interval_s=interval_s).headroom(seen) > Shield().admit_headroom
    assert engine.admit_headroom == decided[-1][1].admit_headroom


def test_serve_refuses_a_decision_interval_that_is_not_a_positive_number(tmp_path):
    for bad in ("0", "-1", "nan"):
        out = subprocess.run([sys.executable, "-m", "rlctl.cli", "serve", "--policy", "static:1", "--allow-baselines",
                              "--decision-interval", bad, "--listen", f"unix://{tmp_path}/s.sock"], cwd=REPO,
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 2
        assert f"rlctl serve: error: --decision-interval must be > 0 s, got {float(bad)}" in out.stderr
        assert not (tmp_path / "s.sock").exists()


def test_serve_listens_beyond_loopback_only_with_mutual_tls():
    from rlctl.online.sidecar import TLSFiles

    for ok in ("unix:///tmp/x.sock", "127.0.0.1:5000", "localhost:0", "[::1]:5000"):
        check_listen(ok, None)
        check_listen(ok, TLSFiles("cert.pem", "key.pem"))  # server-only TLS is enough on this host
    for bad in ("0.0.0.0:5000", "10.1.2.3:5000", "example.com:5000", "[::]:5000"):
        for tls in (None, TLSFiles("cert.pem", "key.pem")):
            with pytest.raises(ValueError, match="not a loopback address.*only with mutual TLS"):
                check_listen(bad, tls)
        check_listen(bad, TLSFiles("cert.pem", "key.pem", "ca.pem"))
    with pytest.raises(ValueError, match="HOST:PORT"):
        check_listen("127.0.0.1", None)


def test_a_unix_socket_gRPC_could_not_bind_is_refused_saying_why(tmp_path):
    """gRPC reports only "Failed to bind" for a socket in a folder that does not exist or a path longer
    than a unix socket holds: both are refused first, saying which."""
    with pytest.raises(ValueError, match=f"directory {tmp_path / 'nowhere'} does not exist"):
        check_listen(f"unix://{tmp_path}/nowhere/s.sock", None)
    deep = tmp_path / ("d" * 100)
    deep.mkdir()
    with pytest.raises(ValueError, match=r"the socket's path is \d+ bytes; a unix socket's holds at most 107"):
        check_listen(f"unix://{deep}/s.sock", None)
    check_listen(f"unix://{tmp_path}/s.sock", None)


def _serve_exits(listen: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rlctl.cli", "serve", "--policy", "static:8", "--allow-baselines",
                           "--listen", listen], cwd=REPO, capture_output=True, text=True, timeout=120)


def test_a_second_sidecar_on_a_socket_in_use_is_refused_and_the_first_keeps_its_engines(sidecars, tmp_path):
    address = f"unix://{tmp_path}/s.sock"
    first = sidecars(address, "watermark")
    out = _serve_exits(address)
    assert out.returncode == 2 and "another process is listening on" in out.stderr
    with open_channel(address) as ch:  # still the first one's socket, answering with its policy
        assert first.stub(ch).GetPolicy(pb.GetPolicyRequest(), timeout=10).spec == "watermark"
    assert first.proc.poll() is None


def test_a_stale_socket_is_replaced_and_a_file_that_is_not_one_is_kept(sidecars, tmp_path):
    import socket

    stale = tmp_path / "stale.sock"
    with socket.socket(socket.AF_UNIX) as dead:  # a socket file nothing listens on any more
        dead.bind(str(stale))
    sidecars(f"unix://{stale}", "watermark")
    kept = tmp_path / "notes.txt"
    kept.write_text("mine")
    out = _serve_exits(f"unix://{kept}")
    assert out.returncode == 2 and "exists and is not a socket; refusing to replace it" in out.stderr
    assert kept.read_text() == "mine"


def test_localhost_is_bound_on_every_loopback_or_not_at_all():
    import socket

    taken = socket.socket()  # the port held on 127.0.0.1 by someone else
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    with taken:
        out = _serve_exits(f"localhost:{port}")
    assert out.returncode == 2 and f"cannot listen on 127.0.0.1:{port}" in out.stderr


def test_a_bind_that_fails_on_one_loopback_lets_go_of_the_other():
    import asyncio
    import socket

    from rlctl.online.confine import Confinement
    from rlctl.online.served import load_served_policy
    from rlctl.online.sidecar import _bindable, start_server

    if _bindable("::1") is None:
        pytest.skip("this host has no IPv6 loopback")
    taken = socket.socket(socket.AF_INET6)  # the port held on ::1 by someone else; 127.0.0.1 free
    taken.bind(("::1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    with taken:
        confinement = Confinement(allow_baselines=True)
        with pytest.raises(ValueError, match=rf"cannot listen on \[::1\]:{port}"):
            asyncio.run(start_server(load_served_policy("watermark", confinement), f"localhost:{port}", confinement))
    with socket.socket() as after:  # 127.0.0.1:port was bound first, and let go again
        after.bind(("127.0.0.1", port))


def test_cheap_decisions_run_on_the_event_loop_and_a_big_network_in_a_thread(tmp_path):
    from rlctl.online.confine import Confinement
    from agents.export import NUMPY_MAX_PARAMETERS
    from rlctl.online.served import load_served_policy

    small = load_served_policy(str(untrained_policy_file(tmp_path / "small.rlpolicy", seed=0)), Confinement())
    big = load_served_policy(str(untrained_policy_file(tmp_path / "big.rlpolicy", seed=0, net_arch=(512, 512))),
                             Confinement())
    assert small.inline and not big.inline and big.policy.parameters > NUMPY_MAX_PARAMETERS
    assert big.policy.forward is None  # it acts through torch, in the sidecar's one torch thread
    assert load_served_policy("watermark", Confinement(allow_baselines=True)).inline


# ---- end to end --------------------------------------------------------------------------------
def test_a_replay_steered_over_a_unix_socket_completes_with_no_fallback(watermark_sidecar):
    s = watermark_sidecar
    with open_channel(s.address) as ch:
        health = health_pb2_grpc.HealthStub(ch)
        for service in ("", SERVICE_NAME):
            assert health.Check(health_pb2.HealthCheckRequest(service=service)).status == health_pb2.HealthCheckResponse.SERVING
        assert SERVICE_NAME in ProtoReflectionDescriptorDatabase(ch).get_services()
        info = s.stub(ch).GetPolicy(pb.GetPolicyRequest())
    assert info.kind == "baseline" and info.spec == "watermark" and len(info.features) == len(FEATURES)
    before = s.metrics()
    figures, _ = steered_replay(LiveController(s.address, deadline_s=2.0))
    assert figures["controller_decisions"] > 20 and figures["fallbacks"] == 0 and figures["reconnects"] == 0
    assert figures["actions"]["scale_up"] > 0  # watermark scales up while usage is low
    after = s.metrics()
    decided = sum(v - before.get(k, 0) for k, v in after.items() if k[0] == "rlctl_sidecar_decisions_total")
    assert decided == figures["controller_decisions"]
    assert after[("rlctl_sidecar_decision_latency_seconds_count", ())] >= decided


def test_a_replay_steered_over_loopback_completes_and_the_live_stream_answers_in_order(sidecars):
    s = sidecars(f"127.0.0.1:{free_port()}", "static:1.3")
    with open_channel(s.address) as ch:
        assert SERVICE_NAME in ProtoReflectionDescriptorDatabase(ch).get_services()
        msgs = [snapshot_message(a_snapshot(), 2048, "stream", seq) for seq in range(1, 6)]
        answers = list(s.stub(ch).Live(iter(msgs), timeout=10))
    assert [d.seq for d in answers] == [1, 2, 3, 4, 5]
    assert all(d.action_name == "hold" and d.overcommit == 1.3 for d in answers)
    figures, _ = steered_replay(LiveController(s.address, deadline_s=2.0))
    assert figures["controller_decisions"] > 20 and figures["fallbacks"] == 0
    assert figures["actions"]["hold"] == figures["controller_decisions"]


def test_a_pinned_factor_above_the_engines_waits_while_the_shield_lets_no_factor_rise(sidecars, tmp_path):
    # found by review: static:4 served took an engine restarting with 1 % of its device free from 1.0 to 4.0 in one
    # decision, past the shield (which filters actions only), and counted no override
    s = sidecars(f"unix://{tmp_path}/s.sock", "static:4")
    base = dataclasses.replace(a_snapshot(), overcommit=1.0)
    cases = [(base, 4.0, False), (dataclasses.replace(base, restarting=True), 1.0, True),
             (dataclasses.replace(base, device_free=0.01), 1.0, True),
             (dataclasses.replace(base, overcommit=6.0, restarting=True), 4.0, False)]  # lowering it always goes
    with open_channel(s.address) as ch:
        for seq, (snap, factor, override) in enumerate(cases, 1):
            d = s.stub(ch).Decide(snapshot_message(snap, 2048, "pinned", seq), timeout=10)
            assert (d.overcommit, d.shield_override) == (factor, override)


def test_the_replay_command_prints_the_controllers_figures(watermark_sidecar, tmp_path, capsys):
    import json

    from rlctl.cli import main

    out = tmp_path / "live.json"
    rc = main(["replay", "--trace", str(bundled_trace("azure2023_conv.csv")), "--time-scale", "20", "--duration", "5",
               "--max-tokens", "fixed:16", "--blocks", "64", "--limit", "4", "--controller", watermark_sidecar.address,
               "--decision-interval", "0.05", "--deadline-ms", "2000", "--json", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    for label, _, _ in LIVE_ROWS:
        assert label in text
    figures = json.loads(out.read_text())
    assert figures["requests_completed"] == 4 and figures["controller_decisions"] > 0 and figures["fallbacks"] == 0


def test_a_replay_steered_by_the_served_on_time_fallback_sends_what_it_reads_and_loses_nothing(sidecars, tmp_path):
    """The fallback reads ``waiting_late``, which the live loop sends with every snapshot: no decision refused."""
    shipped = REPO / "experiments" / "policies" / "default.rlpolicy"
    s = sidecars(f"unix://{tmp_path}/s.sock", f"unpark:4:ontime:{shipped}", metrics=True)
    figures, _ = steered_replay(LiveController(s.address, deadline_s=2.0))
    assert figures["controller_decisions"] > 20 and figures["fallbacks"] == 0
    assert not any(k[0] == "rlctl_sidecar_invalid_requests_total" and v for k, v in s.metrics().items())


def test_get_policy_names_the_features_a_served_file_was_trained_without(sidecars, tmp_path):
    """The shipped weights predate ``expected_ratio``: served, they read nothing from it, and say so."""
    s = sidecars(f"unix://{tmp_path}/s.sock", str(REPO / "experiments" / "policies" / "default.rlpolicy"))
    with open_channel(s.address) as ch:
        info = s.stub(ch).GetPolicy(pb.GetPolicyRequest())
    assert info.kind == "file" and list(info.features) == FEATURES
    assert list(info.blind_to) == ["expected_ratio"]


def test_reload_policy_mid_replay_swaps_without_a_failed_decision(sidecars, tmp_path):
    policies = tmp_path / "policies"
    policies.mkdir()
    trained_policy_file(policies / "burst.rlpolicy")
    (policies / "notes.rlpolicy").write_text("not a policy\n")
    s = sidecars(f"unix://{tmp_path}/s.sock", "static:1.0", "--policy-dir", str(policies), metrics=True)
    channel = open_channel(s.address)
    stub = s.stub(channel)
    first = stub.GetPolicy(pb.GetPolicyRequest())
    swapped: dict = {}

    class ReloadingController(LiveController):
        def step(self, engine, until):
            if self.decisions == 10 and not swapped:
                swapped["response"] = stub.ReloadPolicy(pb.ReloadPolicyRequest(policy="burst"))
            return super().step(engine, until)

    try:
        figures, _ = steered_replay(ReloadingController(s.address, deadline_s=2.0))
        now = stub.GetPolicy(pb.GetPolicyRequest())
        with pytest.raises(grpc.RpcError) as err:
            stub.ReloadPolicy(pb.ReloadPolicyRequest(policy="notes"))
        kept = stub.GetPolicy(pb.GetPolicyRequest())
    finally:
        channel.close()
    assert figures["fallbacks"] == 0 and figures["controller_decisions"] > 20
    response = swapped["response"]
    assert response.previous.policy_hash == first.policy_hash and response.current.kind == "file"
    assert figures["policy_hashes"] == [first.policy_hash, response.current.policy_hash]
    assert now.policy_hash == response.current.policy_hash == now.file_sha256 and now.max_model_len == 0
    assert now.spec == "burst.rlpolicy" and now.name == "burst"  # the name in the directory, not its path
    assert list(now.blind_to) == [] == list(first.blind_to)  # trained in this layout; a baseline reads it all
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "still serving" in err.value.details() and "not an rlctl policy file" in err.value.details()
    assert kept.policy_hash == now.policy_hash
    m = s.metrics()
    assert m[("rlctl_sidecar_reloads_total", (("result", "ok"),))] == 1
    assert m[("rlctl_sidecar_reloads_total", (("result", "failed"),))] == 1


def test_mutual_tls_serves_a_client_with_a_certificate_and_refuses_one_without(sidecars, tmp_path):
    pki = make_pki(tmp_path)
    port = free_port()
    tls = ClientTLS(str(pki["ca"]), str(pki["client.crt"]), str(pki["client.key"]), server_name="localhost")
    s = sidecars(f"127.0.0.1:{port}", "static:1.2", "--tls-cert", str(pki["server.crt"]), "--tls-key",
                 str(pki["server.key"]), "--tls-client-ca", str(pki["ca"]), tls=tls)
    controller = LiveController(s.address, deadline_s=2.0, tls=tls)
    try:
        assert controller.step(small_engine(), INTERVAL_S) is not None
    finally:
        controller.close()
    anonymous = LiveController(s.address, deadline_s=2.0, tls=ClientTLS(str(pki["ca"]), server_name="localhost"))
    try:
        assert anonymous.step(small_engine(), INTERVAL_S) is None and anonymous.fallbacks["connection"] == 1
    finally:
        anonymous.close()


def make_pki(folder: Path) -> dict[str, Path]:
    """A CA, and a server and a client certificate it signed (openssl)."""
    import shutil

    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")
    p = {n: folder / n for n in ("ca", "ca.key", "server.key", "server.csr", "server.crt", "client.key",
                                 "client.csr", "client.crt", "san.cnf")}
    p["san.cnf"].write_text("subjectAltName=DNS:localhost,IP:127.0.0.1\n")
    run = lambda *a: subprocess.run(["openssl", *a], check=True, capture_output=True)  # noqa: E731
    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=rlctl-test-ca",
        "-keyout", str(p["ca.key"]), "-out", str(p["ca"]))
    for who in ("server", "client"):
        run("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={'localhost' if who == 'server' else 'engine'}",
            "-keyout", str(p[f"{who}.key"]), "-out", str(p[f"{who}.csr"]))
        run("x509", "-req", "-in", str(p[f"{who}.csr"]), "-CA", str(p["ca"]), "-CAkey", str(p["ca.key"]),
            "-CAcreateserial", "-days", "1", "-extfile", str(p["san.cnf"]), "-out", str(p[f"{who}.crt"]))
    return p


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGHUP"])
def test_health_turns_not_serving_when_the_sidecar_shuts_down(sidecars, tmp_path, sig):
    """SIGTERM, and SIGHUP as a closed terminal sends it (it killed the sidecar without a graceful stop,
    leaving its socket file behind)."""
    import signal

    s = sidecars(f"unix://{tmp_path}/s.sock", "watermark")
    seen = []
    with open_channel(s.address) as ch:
        watch = health_pb2_grpc.HealthStub(ch).Watch(health_pb2.HealthCheckRequest(), timeout=30)
        seen.append(next(watch).status)
        s.proc.send_signal(getattr(signal, sig))
        try:
            for answer in watch:
                seen.append(answer.status)
        except grpc.RpcError:
            pass  # the server is gone
    assert seen[:2] == [health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING]
    assert s.proc.wait(timeout=30) == 0
    assert "shutting down" in s.proc.stdout.read()
    assert not (tmp_path / "s.sock").exists()


# ---- faults ------------------------------------------------------------------------------------
def test_the_sidecar_killed_mid_replay_falls_back_reconnects_and_loses_no_request(sidecars, tmp_path):
    address = f"unix://{tmp_path}/s.sock"
    s = sidecars(address, "watermark")
    events: dict = {}

    class Chaos(LiveController):
        def step(self, engine, until):
            if self.decisions == 5 and "killed" not in events:
                s.stop()
                events["killed"] = self.decisions
            elif self.fallbacks["connection"] >= 3 and "restarted" not in events:
                sidecars(address, "watermark")
                events["restarted"] = self.decisions
            return super().step(engine, until)

    figures, _ = steered_replay(Chaos(address, deadline_s=2.0, backoff_s=0.001, backoff_max_s=0.01), interval_s=0.1)
    assert events["killed"] == events["restarted"] == 5
    assert figures["fallbacks_connection"] >= 3 and figures["fallbacks"] == figures["fallbacks_connection"]
    assert figures["reconnects"] >= 1
    assert figures["controller_decisions"] > 5  # steered again once the sidecar was back
    assert "connection" in figures["last_fault"]


def test_a_ca_file_rotated_while_the_sidecar_is_away_is_a_fault_and_the_fallback_keeps_the_headroom(sidecars, tmp_path):
    pki = make_pki(tmp_path)
    port = free_port()
    tls = ClientTLS(str(pki["ca"]), server_name="localhost")
    serve = lambda: sidecars(f"127.0.0.1:{port}", "static:1", "--tls-cert", str(pki["server.crt"]),  # noqa: E731
                             "--tls-key", str(pki["server.key"]), tls=tls)
    s = serve()
    engine = small_engine()
    controller = LiveController(s.address, deadline_s=2.0, tls=tls, backoff_s=0.001, backoff_max_s=0.001)
    try:
        assert controller.step(engine, INTERVAL_S) is not None and engine.admit_headroom > 0  # the shield's
        s.stop()
        rotated = pki["ca"].read_bytes()
        pki["ca"].unlink()  # the CA file is being replaced while the sidecar is away
        headroom = engine.admit_headroom
        assert controller.step(engine, 2 * INTERVAL_S) is None and controller.fallbacks["connection"] == 1
        assert engine.admit_headroom == headroom and engine.overcommit == 1.0  # the shield's share kept
        time.sleep(0.01)
        assert controller.step(engine, 3 * INTERVAL_S) is None  # rebuilding the channel fails: a fault, not a crash
        assert controller.fallbacks["error"] == 1 and "reconnecting: FileNotFoundError" in controller.last_fault
        pki["ca"].write_bytes(rotated)
        serve()
        time.sleep(0.01)
        assert controller.step(engine, 4 * INTERVAL_S) is not None and controller.reconnects == 1
    finally:
        controller.close()


@pytest.mark.parametrize("factor, fallback", [(1.5, 1.5), (3.0, 2.0)])
def test_a_fallback_never_admits_more_than_the_decisions_it_stands_in_for(tmp_path, factor, fallback):
    # found by review: an engine the policy had backed off to 1.5, with a headroom, fell back to the safe factor 2.0
    # and no headroom, admitting more at the moment the sidecar was lost (an OOM restart, say)
    engine = small_engine()
    engine.set_overcommit(factor)
    engine.set_admit_headroom(0.1)
    controller = LiveController(f"unix://{tmp_path}/nobody.sock", deadline_s=0.5, safe_factor=2.0)
    try:
        assert controller.step(engine, INTERVAL_S) is None and controller.fallbacks["connection"] == 1
    finally:
        controller.close()
    assert engine.overcommit == fallback and engine.admit_headroom == 0.1


def test_a_decision_slower_than_the_deadline_falls_back_while_health_still_answers(sidecars, tmp_path):
    s = sidecars(f"unix://{tmp_path}/s.sock", "watermark", "--fault-delay-ms", "1000")
    with open_channel(s.address) as ch:  # the slow decision runs off the event loop: health answers meanwhile
        slow = threading.Thread(target=lambda: s.stub(ch).Decide(snapshot_message(a_snapshot(), 2048), timeout=5))
        slow.start()
        time.sleep(0.05)
        t0 = time.perf_counter()
        health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert time.perf_counter() - t0 < 0.5  # a blocked event loop would answer after the decision, ~1 s
        slow.join()
    # the engine runs an interval in well under a millisecond: a backoff that short still lets it reconnect
    figures, _ = steered_replay(LiveController(s.address, deadline_s=0.05, backoff_s=0.001, backoff_max_s=0.002))
    assert figures["controller_decisions"] == 0
    assert figures["fallbacks_deadline"] == figures["fallbacks"] > 0 and figures["reconnects"] > 0
    assert "DEADLINE_EXCEEDED" in figures["last_fault"]


def test_an_unknown_action_id_is_a_counted_invalid_fallback(sidecars, tmp_path):
    s = sidecars(f"unix://{tmp_path}/s.sock", "watermark", "--fault-action", "9")
    figures, _ = steered_replay(LiveController(s.address, deadline_s=2.0, backoff_s=0.001, backoff_max_s=0.001))
    assert figures["controller_decisions"] == 0
    assert figures["fallbacks_invalid"] == figures["fallbacks"] > 0
    assert "unknown action id 9" in figures["last_fault"]


def test_malformed_snapshots_get_invalid_argument_naming_the_field_and_are_counted(watermark_sidecar):
    s = watermark_sidecar
    good = snapshot_message(a_snapshot(), 2048)
    cases = {"queue_hist": lambda m: m.queue_hist.append(0.0), "alloc_ratio": lambda m: setattr(m, "alloc_ratio", float("nan")),
             "device_free": lambda m: setattr(m, "device_free", 2.0), "swapped": lambda m: setattr(m, "swapped", -3),
             # the scales a policy divides by: a sender that predates them sends 0, which read as a full engine
             "kv_tokens_total": lambda m: setattr(m, "kv_tokens_total", 0),
             "max_num_seqs": lambda m: setattr(m, "max_num_seqs", 0),
             "kv_blocks_total": lambda m: setattr(m, "kv_blocks_total", 0)}
    before = s.metrics()
    with open_channel(s.address) as ch:
        stub = s.stub(ch)
        for field, spoil in cases.items():
            m = pb.Snapshot()
            m.CopyFrom(good)
            spoil(m)
            with pytest.raises(grpc.RpcError) as err:
                stub.Decide(m, timeout=5)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert err.value.details().startswith(f"snapshot.{field} ")
        assert stub.Decide(good, timeout=5).action_name in ("hold", "scale_up")  # still serving
    after = s.metrics()
    for field in cases:
        key = ("rlctl_sidecar_invalid_requests_total", (("field", field),))
        assert after[key] - before.get(key, 0) == 1


def test_an_engine_id_longer_than_the_bound_is_refused_and_a_long_one_taken(watermark_sidecar):
    """A stateful policy keeps state per engine id: a peer sending megabyte ids grew the sidecar by
    4 MB an id. Past 128 bytes an id is INVALID_ARGUMENT naming the field; 128 bytes are taken."""
    from rlctl.online.messages import MAX_ENGINE_ID

    s = watermark_sidecar
    with open_channel(s.address) as ch:
        stub = s.stub(ch)
        with pytest.raises(grpc.RpcError) as err:
            stub.Decide(snapshot_message(a_snapshot(), 2048, "é" * MAX_ENGINE_ID), timeout=5)  # 256 bytes
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert err.value.details() == f"snapshot.engine_id must be at most {MAX_ENGINE_ID} bytes, got 256"
        assert stub.Decide(snapshot_message(a_snapshot(), 2048, "e" * MAX_ENGINE_ID), timeout=5).action_name


def test_an_engine_asking_at_another_interval_than_the_sidecars_is_counted_and_said_once(sidecars, tmp_path):
    """The shield's headroom covers --decision-interval's growth: an engine asking every 10 s behind a
    sidecar at 2 s is counted (each such snapshot) and said once; one asking every 2 s is not."""
    import dataclasses

    s = sidecars(f"unix://{tmp_path}/s.sock", "watermark", metrics=True)
    key = ("rlctl_sidecar_interval_mismatches_total", ())
    with open_channel(s.address) as ch:
        stub = s.stub(ch)
        for engine, step in (("on-time", 2.0), ("slow", 10.0)):
            for seq in range(4):
                snap = dataclasses.replace(a_snapshot(), time_s=100.0 + step * seq)
                stub.Decide(snapshot_message(snap, 2048, engine, seq), timeout=5)
            if engine == "on-time":
                assert s.metrics().get(key, 0) == 0
    assert s.metrics()[key] == 3  # the slow engine's three gaps of 10 s
    s.stop()
    out = s.proc.stdout.read()
    assert out.count("asks every 10 s of engine time; this sidecar's --decision-interval is 2 s") == 1
    assert "engine slow" in out


def test_serve_refuses_a_file_that_is_not_a_policy(tmp_path):
    notes = tmp_path / "some.txt"
    notes.write_text("hello\n")
    out = subprocess.run([sys.executable, "-m", "rlctl.cli", "serve", "--policy", str(notes), "--listen",
                          f"unix://{tmp_path}/s.sock"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert f"rlctl serve: error: policy file {notes}: not an rlctl policy file" in out.stderr
    assert not (tmp_path / "s.sock").exists()
