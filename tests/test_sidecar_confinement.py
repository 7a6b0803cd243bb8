"""The sidecar is confined (rlctl/online/confine.py), against real ``rlctl serve`` processes: a
client's ``ReloadPolicy`` reaches policy files inside ``--policy-dir`` by name and nothing else,
and every other name (a path outside, ``../x``, a missing name, a directory, a symlink leading
out) gets the same words while the old policy keeps serving; baseline specs only with
``--allow-baselines``; a file over the size cap is refused unread; and a listener beyond this
host needs mutual TLS.
"""
from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import grpc
import pytest

from agents.export import MAX_POLICY_BYTES, PolicyFileError, read_capped
from rlctl.online.live import open_channel
from rlctl.online.messages import snapshot_message
from rlctl.online.proto import controller_pb2 as pb
from tests.sidecar_process import REPO, Sidecar, free_port, untrained_policy_file
from tests.test_sidecar import a_snapshot

NOT_FOUND_WORDS = "no policy by that name in the sidecar's policy directory"


@pytest.fixture(scope="module")
def confined(tmp_path_factory):
    """A sidecar serving ``policies/a.rlpolicy`` with ``--policy-dir policies``, no baselines; beside
    the directory, files a client must not reach."""
    root = tmp_path_factory.mktemp("confined")
    policies, outside = root / "policies", root / "outside"
    policies.mkdir()
    outside.mkdir()
    untrained_policy_file(policies / "a.rlpolicy", seed=1)
    untrained_policy_file(policies / "b.rlpolicy", seed=2)
    untrained_policy_file(outside / "x.rlpolicy", seed=3)  # a good policy, but outside the directory
    (outside / "x").write_bytes((outside / "x.rlpolicy").read_bytes())
    (policies / "current.rlpolicy").symlink_to("b.rlpolicy")  # a link that stays inside is followed
    (policies / "out.rlpolicy").symlink_to(outside / "x.rlpolicy")
    (policies / "passwd.rlpolicy").symlink_to("/etc/passwd")
    (policies / "dangling.rlpolicy").symlink_to(outside / "missing.rlpolicy")
    (policies / "sub.rlpolicy").mkdir()
    os.mkfifo(policies / "fifo.rlpolicy")  # opening it for reading would wait for a writer
    (policies / "notes.rlpolicy").write_text("not a policy\n")
    with open(policies / "big.rlpolicy", "wb") as f:  # sparse: 65 MiB by its size, nothing on disk
        f.truncate(MAX_POLICY_BYTES + (1 << 20))
    s = Sidecar(f"unix://{root}/s.sock", str(policies / "a.rlpolicy"), "--policy-dir", str(policies), metrics=True)
    s.policies, s.outside = policies, outside
    yield s
    s.stop()


def reload(s: Sidecar, name: str) -> pb.ReloadPolicyResponse:
    with open_channel(s.address) as ch:
        return s.stub(ch).ReloadPolicy(pb.ReloadPolicyRequest(policy=name), timeout=30)


def refused(s: Sidecar, name: str) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as err:
        reload(s, name)
    return err.value


def serving(s: Sidecar) -> tuple[str, str]:
    """(GetPolicy's hash, the hash on a decision): which policy answers now."""
    with open_channel(s.address) as ch:
        stub = s.stub(ch)
        return (stub.GetPolicy(pb.GetPolicyRequest(), timeout=10).policy_hash,
                stub.Decide(snapshot_message(a_snapshot(), 2048), timeout=10).policy_hash)


# ---- ReloadPolicy ------------------------------------------------------------------------------
def test_names_outside_the_directory_get_the_same_words_as_a_missing_one_and_the_old_policy_serves(confined):
    s = confined
    before = serving(s)
    names = ["/etc/passwd", "../outside/x", "../outside/x.rlpolicy", str(s.outside / "x.rlpolicy"), "..", ".",
             "missing", "missing.rlpolicy", "sub", "out", "passwd", "dangling", "fifo", "", ".hidden",
             "a/../a", "a\0", "x" * 300]
    errors = {name: refused(s, name) for name in names}
    with open_channel(s.address) as ch:
        spec = s.stub(ch).GetPolicy(pb.GetPolicyRequest(), timeout=10).spec
    words = {(e.code(), e.details()) for e in errors.values()}
    assert words == {(grpc.StatusCode.NOT_FOUND, f"reload refused, still serving {spec}: {NOT_FOUND_WORDS} "
                                                 f"(a name is a file name there, e.g. steady or steady.rlpolicy)")}
    for e in errors.values():  # nothing about the file a name led to: not its size, not the directory's path
        assert "passwd" not in e.details() and str(s.outside) not in e.details() and "bytes" not in e.details()
    assert serving(s) == before and before[0] == before[1]


def test_a_baseline_reload_is_refused_without_allow_baselines(confined):
    before = serving(confined)
    for spec in ("random", "static:1e9", "watermark"):
        err = refused(confined, spec)
        assert err.code() == grpc.StatusCode.PERMISSION_DENIED
        assert f"{spec} is a baseline spec" in err.details() and "--allow-baselines" in err.details()
    assert serving(confined) == before


def test_a_file_over_the_cap_is_refused_unread_and_the_old_policy_serves(confined):
    before = serving(confined)
    err = refused(confined, "big")
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"policy file big.rlpolicy: {MAX_POLICY_BYTES + (1 << 20)} bytes, over the {MAX_POLICY_BYTES}-byte cap" \
        in err.details()
    err = refused(confined, "notes")  # inside the directory, the loader says what is wrong with the file
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "notes.rlpolicy: not an rlctl policy file" in err.details()
    assert serving(confined) == before


def test_a_policy_in_the_directory_reloads_by_name_and_a_link_inside_is_followed(confined):
    s = confined
    a = serving(s)[0]
    response = reload(s, "b")
    assert response.previous.policy_hash == a and response.current.spec == "b.rlpolicy"
    b = response.current.policy_hash
    assert b != a and serving(s) == (b, b)
    assert reload(s, "a.rlpolicy").current.policy_hash == a and serving(s) == (a, a)
    linked = reload(s, "current")
    assert linked.current.policy_hash == b and linked.current.spec == "current.rlpolicy"
    reload(s, "a")
    m = s.metrics()
    assert m[("rlctl_sidecar_reloads_total", (("result", "ok"),))] >= 4


def test_reload_is_off_without_a_policy_dir_and_a_baseline_reloads_with_allow_baselines(sidecars, tmp_path):
    off = sidecars(f"unix://{tmp_path}/off.sock", "static:1.0")
    err = refused(off, "watermark")
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION and "started without --policy-dir" in err.details()
    assert serving(off)[0] == serving(off)[1]
    (tmp_path / "policies").mkdir()
    on = sidecars(f"unix://{tmp_path}/on.sock", "static:1.0", "--policy-dir", str(tmp_path / "policies"))
    assert reload(on, "watermark").current.spec == "watermark"


def test_read_capped_reads_at_most_one_byte_past_the_cap(tmp_path):
    r, w = os.pipe()  # a pipe's size is 0 to fstat: only the capped read can catch it
    writer = threading.Thread(target=lambda: (os.write(w, b"x" * 1000), os.close(w)))
    writer.start()
    with os.fdopen(r, "rb") as f:
        with pytest.raises(PolicyFileError, match="p.rlpolicy: 101 bytes, over the 100-byte cap"):
            read_capped(f, Path("p.rlpolicy"), 100)
    writer.join()


# ---- what rlctl serve refuses at startup -------------------------------------------------------
def serve_fails(*args: str) -> str:
    out = subprocess.run([sys.executable, "-m", "rlctl.cli", "serve", *args], cwd=REPO, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 2, out.stderr
    return out.stderr


def test_a_listener_beyond_loopback_without_a_client_ca_exits_2(tmp_path):
    for tls in ([], ["--tls-cert", str(tmp_path / "server.crt"), "--tls-key", str(tmp_path / "server.key")]):
        err = serve_fails("--policy", "static:1.0", "--allow-baselines", "--listen", f"0.0.0.0:{free_port()}", *tls)
        assert "is not a loopback address" in err and "only with mutual TLS" in err and "--tls-client-ca" in err


def test_serve_refuses_a_baseline_without_the_flag_an_oversized_file_and_a_missing_policy_dir(tmp_path):
    sock = f"unix://{tmp_path}/s.sock"
    assert "--policy random is a baseline spec: serve one only with --allow-baselines" in serve_fails(
        "--policy", "random", "--listen", sock)
    big = tmp_path / "big.rlpolicy"
    with open(big, "wb") as f:
        f.truncate(3 << 20)
    assert f"policy file {big}: {3 << 20} bytes, over the {2 << 20}-byte cap" in serve_fails(
        "--policy", str(big), "--max-policy-mib", "2", "--listen", sock)
    assert f"--policy-dir {tmp_path / 'nowhere'}: not a directory" in serve_fails(
        "--policy", "static:1.0", "--allow-baselines", "--policy-dir", str(tmp_path / "nowhere"), "--listen", sock)
    assert not (tmp_path / "s.sock").exists()
