"""The MPS actuator speaks nvidia-cuda-mps-control's command protocol.

The control binary is replaced by a fake written into tmp_path: a small program that records
exactly what it reads on standard input, one invocation per line of calls.jsonl, and answers as
the control daemon does. What it models: set commands print nothing when they succeed; get
commands print the limit as an integer and "G" or "M" (a default of at least 1 GiB shown in
whole GiB, as drivers show it); a refused command prints the daemon's reason; with no daemon the
client prints "Cannot find MPS control daemon process" and exits 1. The reasons' wording is the
fake's own: the actuator passes whatever the daemon says through, it does not match on it.
"""
from __future__ import annotations

import json
import os
import re
import sys

import pytest

from rlctl.online.mps import GiB, MiB, MPSLimit, client_limit_value, format_limit, parse_client_limit, parse_limit

FAKE = r'''#!{python}
import json, os, re, sys
HERE = {here!r}
data = sys.stdin.buffer.read()
with open(os.path.join(HERE, "calls.jsonl"), "a") as f:
    f.write(json.dumps({{"argv": sys.argv[1:], "stdin": data.decode("latin-1")}}) + "\n")
with open(os.path.join(HERE, "state.json")) as f:
    state = json.load(f)
mode = state.get("mode", "up")
if mode == "down":
    print("Cannot find MPS control daemon process")
    sys.exit(1)
if mode == "broken":
    print("failed to connect: permission denied", file=sys.stderr)
    sys.exit(2)
if mode == "hang":
    import time; time.sleep(30)

def mib(value):
    m = re.fullmatch(r"([1-9][0-9]*)([GM])", value)
    return None if m is None else int(m.group(1)) * (1024 if m.group(2) == "G" else 1)

def show(limit, whole_gib):
    return f"{{limit // 1024}}G" if whole_gib and limit >= 1024 else f"{{limit}}M"

setting = False
for line in data.decode().splitlines():
    cmd = line.split()
    if not cmd:
        continue
    name, args = cmd[0], cmd[1:]
    if name.startswith("get_") and name != "get_server_list" and state.get("gets_broken"):
        print("Error: lost the connection to the MPS server")
    elif name == "get_server_list":
        print("\n".join(str(p) for p in state["servers"]))
    elif name == "set_default_device_pinned_mem_limit" and len(args) == 2:
        dev, value = args
        if state.get("refuse_sets"):
            print("Operation not permitted: the default is locked")
        elif dev not in state["devices"]:
            print(f"Invalid device {{dev}}")
        elif mib(value) is None:
            print(f"Invalid memory limit {{value}}: an integer followed by G or M")
        else:
            state["defaults"][dev] = mib(value)
            setting = True
            state["gets_broken"] = state.get("after_set") == "garbage"
    elif name == "get_default_device_pinned_mem_limit" and len(args) == 1:
        dev = args[0]
        print(show(state["defaults"][dev], True) if dev in state["defaults"] else f"Invalid device {{dev}}")
    elif name == "set_device_pinned_mem_limit" and len(args) == 3:
        pid, dev, value = args
        if pid not in state["servers"]:
            print(f"Server {{pid}} not found")
        elif mib(value) is None:
            print(f"Invalid memory limit {{value}}: an integer followed by G or M")
        else:
            state["server_limits"].setdefault(pid, {{}})[dev] = mib(value)
    elif name == "get_device_pinned_mem_limit" and len(args) == 2:
        pid, dev = args
        limits = state["server_limits"].get(pid, {{}})
        print(show(limits[dev], False) if dev in limits else f"Server {{pid}} not found")
    else:
        print(f"Unrecognized command: {{line}}")
with open(os.path.join(HERE, "state.json"), "w") as f:
    json.dump(state, f)
if setting and state.get("after_set") == "hang":  # the daemon took the set, its answer never comes
    import time; time.sleep(30)
'''


class Fake:
    def __init__(self, tmp_path, **state) -> None:
        self.dir = tmp_path
        self.binary = tmp_path / "nvidia-cuda-mps-control"
        self.binary.write_text(FAKE.format(python=sys.executable, here=str(tmp_path)))
        self.binary.chmod(0o755)
        base = {"mode": "up", "devices": ["0", "1"], "defaults": {"0": 4096}, "servers": ["4242"],
                "server_limits": {"4242": {"0": 900}}}
        (tmp_path / "state.json").write_text(json.dumps({**base, **state}))

    def calls(self) -> list[dict]:
        path = self.dir / "calls.jsonl"
        return [json.loads(ln) for ln in path.read_text().splitlines()] if path.exists() else []

    def stdin(self) -> list[str]:
        return [c["stdin"] for c in self.calls()]


@pytest.fixture
def fake(tmp_path):
    return Fake(tmp_path)


def test_set_default_writes_one_command_then_reads_it_back(fake):
    report = MPSLimit(str(fake.binary)).set_default(2 * GiB, device=0)
    assert fake.stdin() == ["set_default_device_pinned_mem_limit 0 2G\n", "get_default_device_pinned_mem_limit 0\n"]
    assert all(c["argv"] == [] for c in fake.calls())  # the client, not the daemon (-d) or anything else
    assert report.applied
    assert report.value == {"requested": "2G", "requested_bytes": 2 * GiB, "read_back_bytes": 2 * GiB}
    assert "read back 2.00 GiB" in report.detail
    # what a default reaches (nvidia-cuda-mps-control(1)): the servers started next, not a running one's clients
    assert "the MPS servers started from now on" in report.detail
    assert "joins that server and takes the server's limit" in report.detail
    assert "a running engine keeps the limit it started with" in report.detail


def test_a_limit_not_in_whole_gib_is_sent_in_mib_and_a_coarser_read_back_is_reported(fake):
    report = MPSLimit(str(fake.binary)).set_default(1044 * MiB + 123)  # rounded down to whole MiB
    assert fake.stdin()[0] == "set_default_device_pinned_mem_limit 0 1044M\n"
    assert report.applied and report.value["read_back_bytes"] == 1 * GiB  # the daemon shows "1G"
    assert "coarser" in report.detail


def test_server_limits_name_the_server_and_the_device(fake):
    mps = MPSLimit(str(fake.binary))
    report = mps.set_server(4242, 900 * MiB, device=1)
    assert fake.stdin() == ["set_device_pinned_mem_limit 4242 1 900M\n", "get_device_pinned_mem_limit 4242 1\n"]
    assert report.applied and report.value["read_back_bytes"] == 900 * MiB
    assert "MPS server 4242 on device 1" in report.detail and "clients started from now on" in report.detail
    assert "the next engine process of that server's user takes it" in report.detail
    got = mps.get_server(4242, 0)
    assert fake.stdin()[-1] == "get_device_pinned_mem_limit 4242 0\n"
    assert got.applied and got.value == 900 * MiB and "900M" in got.detail


def test_get_default_parses_the_answer_with_its_unit(fake):
    report = MPSLimit(str(fake.binary)).get_default("0")
    assert fake.stdin() == ["get_default_device_pinned_mem_limit 0\n"]
    assert report.applied and report.value == 4 * GiB and "4G" in report.detail


@pytest.mark.parametrize("text, nbytes", [
    ("2G", 2 * GiB), ("2048M", 2 * GiB), ("900M\n", 900 * MiB), ("  10G ", 10 * GiB), ("0", 0),
    ("unlimited", None), ("1.5G", None), ("Server 1 not found", None), ("", None)])
def test_parse_limit(text, nbytes):
    assert parse_limit(text) == nbytes


def test_format_limit_uses_whole_units_and_never_rounds_up():
    assert format_limit(2 * GiB) == "2G"
    assert format_limit(1536 * MiB) == "1536M"
    assert format_limit(GiB + MiB - 1) == "1024M"
    with pytest.raises(ValueError):
        format_limit(MiB - 1)


def test_a_refused_set_reports_the_daemons_reason_and_reads_nothing_back(fake):
    mps = MPSLimit(str(fake.binary))
    report = mps.set_default(2 * GiB, device=7)
    assert fake.stdin() == ["set_default_device_pinned_mem_limit 7 2G\n"]
    assert not report.applied and report.detail.endswith("Invalid device 7")
    report = mps.set_server(999, 2 * GiB)
    assert not report.applied and "refused set_device_pinned_mem_limit 999 0 2G: Server 999 not found" in report.detail


def test_an_error_answer_to_a_get_is_not_a_limit(fake):
    report = MPSLimit(str(fake.binary)).get_server(999, 0)
    assert not report.applied and report.value is None
    assert "Server 999 not found" in report.detail


def test_nothing_but_an_ordinal_or_uuid_reaches_the_daemon(fake):
    mps = MPSLimit(str(fake.binary))
    for bad in ("0\nquit", "0 1", ""):
        with pytest.raises(ValueError):
            mps.set_default(GiB, device=bad)
    with pytest.raises(ValueError):
        mps.get_server(-1)
    assert fake.calls() == []
    mps.get_default("GPU-16128952-b438-556a-00bb-93039ee24e56")  # a UUID is sent as it is
    assert fake.stdin() == ["get_default_device_pinned_mem_limit GPU-16128952-b438-556a-00bb-93039ee24e56\n"]


def test_no_daemon_running_means_mps_is_not_available(tmp_path):
    fake = Fake(tmp_path, mode="down")
    mps = MPSLimit(str(fake.binary))
    report = mps.set_default(2 * GiB)
    assert not report.applied
    assert report.detail.startswith("MPS is not available: the control daemon is not running")
    assert "Cannot find MPS control daemon process" in report.detail
    assert len(fake.calls()) == 1  # nothing more is tried
    assert mps.available().startswith("MPS is not available")
    assert mps.server_pids() == []


def test_a_client_that_exits_non_zero_means_mps_is_not_available(tmp_path):
    fake = Fake(tmp_path, mode="broken")
    report = MPSLimit(str(fake.binary)).get_default(0)
    assert not report.applied
    assert report.detail == ("MPS is not available: " + str(fake.binary)
                             + " exited with status 2 (failed to connect: permission denied)")


def test_a_daemon_that_does_not_answer_in_time_means_mps_is_not_available(tmp_path):
    fake = Fake(tmp_path, mode="hang")
    report = MPSLimit(str(fake.binary), timeout_s=0.5).set_default(GiB)
    assert not report.applied and re.match(r"MPS is not available: .* did not answer within 0.5 s", report.detail)


def test_without_the_binary_mps_is_not_available(tmp_path):
    for binary in (str(tmp_path / "nvidia-cuda-mps-control"), "nvidia-cuda-mps-control-not-installed"):
        mps = MPSLimit(binary)
        report = mps.set_default(2 * GiB)
        assert not report.applied and report.detail == f"MPS is not available: {binary} was not found"
        assert mps.get_server(1, 0).detail.startswith("MPS is not available")
        assert mps.available() == report.detail


def test_a_running_daemon_lists_its_servers(fake):
    mps = MPSLimit(str(fake.binary))
    assert mps.available() is None
    assert mps.server_pids() == [4242]
    assert fake.stdin() == ["get_server_list\n", "get_server_list\n"]


def test_apply_for_an_engine_asks_for_its_weights_workspace_and_kv_plus_a_margin(fake, make_engine):
    from rlctl.online.actuators import engine_memory_bytes

    engine = make_engine(num_blocks=64)
    report = MPSLimit(str(fake.binary)).apply_for(engine, margin_bytes=512 * MiB)
    want = format_limit(engine_memory_bytes(engine) + 512 * MiB)
    assert fake.stdin() == ["get_default_device_pinned_mem_limit 0\n", f"set_default_device_pinned_mem_limit 0 {want}\n",
                            "get_default_device_pinned_mem_limit 0\n", "get_server_list\n"]
    assert report.applied and "daemon-wide default pinned memory limit of device 0" in report.detail


# ---- the daemon-wide default: replaced, then restored ------------------------------------------
def test_apply_reads_the_default_it_replaces_once_and_restore_puts_it_back(fake):
    mps = MPSLimit(str(fake.binary))
    assert mps.apply(2 * GiB).applied and mps.apply(3 * GiB).applied  # a second engine: no second read
    (report,) = mps.restore()
    assert fake.stdin() == [
        "get_default_device_pinned_mem_limit 0\n",
        "set_default_device_pinned_mem_limit 0 2G\n", "get_default_device_pinned_mem_limit 0\n", "get_server_list\n",
        "set_default_device_pinned_mem_limit 0 3G\n", "get_default_device_pinned_mem_limit 0\n", "get_server_list\n",
        "set_default_device_pinned_mem_limit 0 4G\n", "get_default_device_pinned_mem_limit 0\n"]
    assert report.applied and report.detail.startswith("restored (as the daemon showed it before): daemon-wide "
                                                       "default") and "4.00 GiB" in report.detail
    assert json.loads((fake.dir / "state.json").read_text())["defaults"]["0"] == 4096  # as it was
    assert mps.restore() == [] and len(fake.calls()) == 9  # restored once, nothing left to do


def test_apply_names_the_servers_running_and_that_a_default_between_whole_gib_comes_back_rounded(tmp_path):
    """A server running (4242) keeps its clients, a new engine process of its user among them, at its own
    limit: the report says so. The daemon shows 1044 MiB as 1G, so restore can only put 1G back: said too."""
    fake = Fake(tmp_path, defaults={"0": 1044})
    mps = MPSLimit(str(fake.binary))
    report = mps.apply(2 * GiB)
    assert report.applied and "get_server_list\n" in fake.stdin()
    assert "MPS servers running now: 4242, so an engine process of their users" in report.detail
    assert "showed 1.00 GiB" in report.detail and "put back rounded down" in report.detail
    (restored,) = mps.restore()
    assert restored.applied and json.loads((tmp_path / "state.json").read_text())["defaults"]["0"] == 1024
    (tmp_path / "none").mkdir()
    quiet = Fake(tmp_path / "none", servers=[], defaults={"0": 4096 + 512})
    report = MPSLimit(str(quiet.binary)).apply(2 * GiB)  # shown as 4G: the same caveat; no server: no notice
    assert report.applied and "MPS servers running now" not in report.detail and "rounded down" in report.detail


def test_a_default_that_could_not_be_put_back_is_never_changed(tmp_path):
    fake = Fake(tmp_path, defaults={"0": 0})  # no limit on device 0; device 7 unknown, its default unreadable
    mps = MPSLimit(str(fake.binary))
    for dev, why in ((0, "(no limit)"), (7, "(unreadable: ")):
        report = mps.apply(GiB, device=dev)
        assert not report.applied and f"device {dev} not changed: the default there {why}" in report.detail
        assert f"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT={dev}=<limit>" in report.detail
    assert not any(c.startswith("set_") for c in fake.stdin())  # only reads: nothing to restore
    assert mps.restore() == [] and json.loads((fake.dir / "state.json").read_text())["defaults"] == {"0": 0}


@pytest.mark.parametrize("after_set", ["garbage", "hang"])
def test_a_set_whose_answer_fails_may_have_changed_the_default_and_restore_puts_it_back_all_the_same(
        tmp_path, after_set):
    # found by review: the default replaced was kept only after a set read back, so a set the daemon took but
    # whose read-back failed (or whose answer never came) left every later MPS server on the host at the new one
    fake = Fake(tmp_path, after_set=after_set)
    mps = MPSLimit(str(fake.binary), timeout_s=1.0)
    report = mps.apply(2 * GiB)
    assert not report.applied and "the default it would replace (4.00 GiB) is put back at the end" in report.detail
    assert json.loads((tmp_path / "state.json").read_text())["defaults"]["0"] == 2048  # the daemon took it
    (restored,) = mps.restore()
    assert "set_default_device_pinned_mem_limit 0 4G\n" in fake.stdin()
    assert json.loads((tmp_path / "state.json").read_text())["defaults"]["0"] == 4096  # put back
    assert restored.detail.startswith("restored (as the daemon showed it before)")


def test_a_set_the_daemon_refused_leaves_nothing_to_put_back(tmp_path):
    # found by review: a refused set was "restored" all the same, and the daemon shows a default between whole GiB
    # rounded down, so a run that changed nothing lowered the default from 2.5 GiB to 2
    fake = Fake(tmp_path, refuse_sets=True, defaults={"0": 2560})
    mps = MPSLimit(str(fake.binary))
    report = mps.apply(3 * GiB)
    assert not report.applied and "refused" in report.detail and "put back" not in report.detail
    assert mps.restore() == [] and json.loads((tmp_path / "state.json").read_text())["defaults"]["0"] == 2560


@pytest.fixture
def fake_on_path(fake, monkeypatch):
    """The fake control binary as the one on PATH, where rlctl's own commands find it."""
    monkeypatch.setenv("PATH", f"{fake.dir}:{os.environ['PATH']}")
    return fake


@pytest.mark.parametrize("fails", [False, True], ids=["replay ends", "replay fails"])
def test_mps_next_limit_says_it_is_daemon_wide_and_restores_the_default_when_the_replay_ends(
        fake_on_path, fails, sidecars, tmp_path, monkeypatch, capsys):
    import rlctl.cli as cli
    import rlctl.online.live as live
    from rlctl.online.actuators import engine_memory_bytes
    from tests.test_live_metrics import ARGS, profiled_engine

    address = f"unix://{tmp_path}/s.sock"
    sidecars(address, "static:1.2")
    built = []
    monkeypatch.setattr(cli, "build_engine", lambda *a, **kw: built.append(profiled_engine(*a, **kw)) or built[-1])

    class Failing(live.LiveController):
        def step(self, engine, until):
            if fails and self.decisions == 2:
                raise ValueError("the engine failed mid-replay")
            return super().step(engine, until)

    monkeypatch.setattr(live, "LiveController", Failing)
    rc = cli.main(ARGS + ["--limit", "8", "--controller", address, "--mps-next-limit"])
    out, err = capsys.readouterr()
    assert rc == (2 if fails else 0) and ("the engine failed mid-replay" in err) == fails
    need = format_limit(engine_memory_bytes(built[0]) + 512 * MiB)
    assert fake_on_path.stdin() == [
        "get_default_device_pinned_mem_limit 0\n",                                     # what it replaces
        f"set_default_device_pinned_mem_limit 0 {need}\n", "get_default_device_pinned_mem_limit 0\n",
        "get_server_list\n",                                                          # who would not take it
        "set_default_device_pinned_mem_limit 0 4G\n", "get_default_device_pinned_mem_limit 0\n"]  # restored
    assert json.loads((fake_on_path.dir / "state.json").read_text())["defaults"]["0"] == 4096
    assert "daemon-wide: every MPS server started on this host from now on takes it" in out
    assert ("mps: restored (as the daemon showed it before): daemon-wide default pinned memory limit of device 0 "
            "set to 4G") in out


def test_sigterm_mid_replay_still_puts_the_daemons_default_back(fake_on_path, sidecars, tmp_path):
    import signal
    import subprocess
    import time

    from tests.sidecar_process import REPO
    from tests.test_live_metrics import ARGS

    address = f"unix://{tmp_path}/s.sock"
    sidecars(address, "static:1.2", "--fault-delay-ms", "100")  # slow decisions: a replay that runs a while
    # rlctl replay's own main, on a tensor-free engine (one holding its KV on the CPU is refused the MPS limit)
    main = ("import sys, rlctl.cli as cli, tests.test_live_metrics as t; cli.build_engine = t.profiled_engine; "
            "sys.exit(cli.main(sys.argv[1:]))")
    replay = subprocess.Popen([sys.executable, "-c", main, *ARGS, "--controller", address, "--mps-next-limit"],
                              cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 120
        while not any(c.startswith("set_") for c in fake_on_path.stdin()):  # the default changed
            assert replay.poll() is None and time.monotonic() < deadline, replay.stdout.read() if replay.poll() else ""
            time.sleep(0.05)
        time.sleep(0.5)  # mid-replay
        replay.send_signal(signal.SIGTERM)
        assert replay.wait(timeout=60) == 128 + signal.SIGTERM
    finally:
        replay.kill()
    out = replay.stdout.read()
    assert fake_on_path.stdin()[-2:] == ["set_default_device_pinned_mem_limit 0 4G\n",
                                         "get_default_device_pinned_mem_limit 0\n"]  # restored
    assert json.loads((fake_on_path.dir / "state.json").read_text())["defaults"]["0"] == 4096
    assert ("mps: restored (as the daemon showed it before): daemon-wide default pinned memory limit of device 0 "
            "set to 4G") in out


def test_mps_next_limit_is_refused_for_an_engine_holding_its_kv_on_the_cpu(fake_on_path, sidecars, tmp_path, capsys):
    # found by review: a replay of the tiny model on the CPU set the GPU's daemon-wide default to what it needs
    import rlctl.cli as cli
    from tests.test_live_metrics import ARGS

    address = f"unix://{tmp_path}/s.sock"
    sidecars(address, "static:1.2")
    assert cli.main(ARGS + ["--controller", address, "--mps-next-limit"]) == 2
    assert "this engine holds its KV on cpu: run it with --device cuda" in capsys.readouterr().err
    assert fake_on_path.calls() == []  # the daemon was never asked anything


def test_the_first_signal_ends_the_replay_a_second_waits_for_the_clean_up_and_an_ignored_one_stays_ignored():
    import signal
    import time

    from rlctl.online.live import _terminate_by_exception

    term, hup = signal.getsignal(signal.SIGTERM), signal.signal(signal.SIGHUP, signal.SIG_IGN)  # as under nohup
    reached, cleaned = False, False
    try:
        with pytest.raises(SystemExit) as ended:
            with _terminate_by_exception():
                assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
                try:
                    os.kill(os.getpid(), signal.SIGTERM)
                    time.sleep(5)  # the handler raises before this ends
                    reached = True
                finally:
                    os.kill(os.getpid(), signal.SIGTERM)  # a second one, during the clean-up: no exception
                    time.sleep(0.01)
                    cleaned = True
        assert ended.value.code == 128 + signal.SIGTERM and cleaned and not reached
        assert signal.getsignal(signal.SIGTERM) is term and signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGHUP, hup)


def test_the_gpu_check_limits_its_own_two_clients_and_only_reads_the_daemons_defaults(fake_on_path):
    import torch

    from tests.gpu.checks import NO_CUDA, Deadline, Sizes, check_mps

    result = check_mps(Sizes.cpu(), Deadline(60), limit_bytes=2 * GiB)
    assert fake_on_path.stdin() == ["get_server_list\n", "get_default_device_pinned_mem_limit 0\n",
                                    "get_default_device_pinned_mem_limit 0\n", "get_server_list\n",
                                    "get_device_pinned_mem_limit 4242 0\n"]  # no set_ command: nothing changed
    # each child's own environment carried its own limit: two clients at once, as a node's engines run
    assert {n: c["limit_env"] for n, c in result["clients"].items()} == {"a": "0=2G", "b": "0=1G"}
    assert result["daemon_default_before"]["value"] == result["daemon_default_after"]["value"] == 4 * GiB
    if torch.cuda.is_available():  # a GPU without MPS behind the fake: the limit is not enforced
        assert result["status"] == "failed" and "passed its 0=2G limit" in result["error"]
    else:
        assert result["status"] == "skipped" and result["reason"] == NO_CUDA
        assert not any(c["cuda"] for c in result["clients"].values())



def test_a_clients_own_limit_is_written_and_read_as_mps_takes_it():
    assert client_limit_value({0: 3 * GiB + 5 * MiB + 7}) == "0=3077M"  # whole MiB, rounded down
    assert client_limit_value({0: 2 * GiB, "GPU-1a2b": 512 * MiB}) == "0=2G,GPU-1a2b=512M"
    assert parse_client_limit("0=2G,GPU-1a2b=512M") == {"0": 2 * GiB, "GPU-1a2b": 512 * MiB}
    for bad in ("", "0", "0=", "0=lots", "0 1=2G", "0=2G,0=1G", "0=0M"):
        with pytest.raises(ValueError, match="CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"):
            parse_client_limit(bad)
    with pytest.raises(ValueError, match="at least 1 MiB"):
        client_limit_value({0: 1000})
