"""rlctl as a user installs it: a wheel built from this checkout and installed outside it runs
``rlctl eval`` on a shipped scenario and finds a shipped training configuration by name, with no
checkout on the path; ``rlctl --version``; and the protocol stubs import with the ``client``
extra's packages alone (no torch).

The installed interpreter runs with ``-S``: no site-packages are processed, so the development
environment's editable install (a finder pointing at a checkout) cannot answer an import; its path
is the installed wheel, then this interpreter's site-packages for the requirements (torch, ...).
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from rlctl import __version__
from rlctl.cli import main

REPO = Path(__file__).resolve().parent.parent
COPY_IGNORE = shutil.ignore_patterns(".git", ".venv", "__pycache__", "runs", "build", "dist", "*.egg-info",
                                     ".pytest_cache", ".hypothesis", ".ruff_cache")
OURS = ("engine", "env", "agents", "rlctl", "experiments")


def site_dirs() -> list[str]:
    """This interpreter's site-packages (the requirements; a .venv inside the checkout included):
    under -S their .pth files, an editable install's finder among them, are not run."""
    return [p for p in sys.path if p.endswith(("site-packages", "dist-packages"))]


def run_isolated(args: list[str], path: list[str], cwd: Path, timeout: float = 240) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")} | {"PYTHONPATH": os.pathsep.join(path)}
    return subprocess.run([sys.executable, "-S", *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> tuple[Path, Path, Path]:
    """(the wheel, the folder it is installed in, a working directory outside the checkout)."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    shutil.copytree(REPO, src, ignore=COPY_IGNORE)  # building writes build/ and *.egg-info into the tree it builds
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    done = subprocess.run(pip + ["wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp / "dist"), str(src)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    (wheel,) = (tmp / "dist").glob("rlctl-*.whl")
    target = tmp / "site"
    done = subprocess.run(pip + ["install", "--no-deps", "--no-compile", "--target", str(target), str(wheel)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    work = tmp / "elsewhere"
    work.mkdir()
    return wheel, target, work


def test_the_wheel_ships_the_experiments_the_traces_and_the_protocol(installed):
    wheel, _, _ = installed
    names = set(zipfile.ZipFile(wheel).namelist())
    for shipped in (REPO / "experiments").rglob("*"):  # every data file, not a byte-code cache
        if shipped.is_file() and "__pycache__" not in shipped.parts:
            assert shipped.relative_to(REPO).as_posix() in names
    assert {"experiments/scenarios/steady.yaml", "experiments/train/steady.yaml", "env/workloads/data/azure2023_conv.csv",
            "experiments/checkpoints/Qwen3-8B/config.json",
            "rlctl/online/proto/rlctl/controller/v1/controller.proto"} <= names
    assert not any(n.startswith("tests/") for n in names)


def test_the_installed_wheel_runs_eval_and_finds_shipped_names_outside_the_checkout(installed):
    _, target, work = installed
    path = [str(target), *site_dirs()]
    probe = ("import json, importlib; from rlctl.train import load_train_config; cfg = load_train_config('steady'); "
             f"print(json.dumps({{m: importlib.import_module(m).__file__ for m in {OURS!r}}} | "
             "{'scenarios': cfg.scenarios, 'n_envs': cfg.n_envs}))")
    done = run_isolated(["-c", probe], path, work)
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout)
    for module in OURS:  # every package from the wheel, none from a checkout
        assert Path(found[module]).is_relative_to(target), (module, found[module])
    assert found["scenarios"] == ["steady"] and found["n_envs"] == 2

    done = run_isolated(["-m", "rlctl.cli", "eval", "--scenario", "steady", "--episodes", "1", "--steps", "5",
                         "--baselines"], path, work)
    assert done.returncode == 0, done.stderr
    assert "eval: scenario steady" in done.stdout
    for row in ("requests completed", "goodput (tok/s)", "KV util mean", "OOM events", "episode reward"):
        assert re.search(rf"^{re.escape(row)} ", done.stdout, re.M), row
    assert "watermark" in done.stdout and "vllm" in done.stdout

    done = run_isolated(["-m", "rlctl.cli", "--version"], path, work)
    assert done.returncode == 0 and done.stdout.strip() == f"rlctl {__version__}"


def client_requirements(wheel: Path) -> list[Requirement]:
    """The ``client`` extra, as the wheel's metadata declares it."""
    with zipfile.ZipFile(wheel) as z:
        meta = z.read(next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))).decode()
    reqs = [Requirement(line.split(":", 1)[1].strip()) for line in meta.splitlines() if line.startswith("Requires-Dist:")]
    return [r for r in reqs if r.marker is not None and r.marker.evaluate({"extra": "client"})
            and not r.marker.evaluate({"extra": ""})]


def link_distributions(names: list[str], into: Path) -> None:
    """Link the files of the installed distributions ``names`` and of what they require (not their
    extras) into ``into``: a folder that holds those and nothing else."""
    seen: set[str] = set()
    todo = list(names)
    while todo:
        dist = metadata.distribution(todo.pop())
        key = dist.metadata["Name"].lower()
        if key in seen:
            continue
        seen.add(key)
        todo += [r.name for r in map(Requirement, dist.requires or []) if r.marker is None or r.marker.evaluate()]
        root = Path(dist.locate_file(""))
        for f in dist.files:
            parts = f.parts
            if parts[0].endswith(".dist-info") or parts[0] == ".." or "__pycache__" in parts:
                continue
            namespace = len(parts) > 2 and not (root / parts[0] / "__init__.py").exists()  # google/protobuf/...
            top = Path(*parts[:2]) if namespace else Path(parts[0])
            if not (into / top).exists():
                (into / top).parent.mkdir(parents=True, exist_ok=True)
                (into / top).symlink_to(root / top)


def test_the_client_extra_alone_runs_the_protocol_stubs(installed, tmp_path):
    wheel, target, work = installed
    client = client_requirements(wheel)
    assert sorted(r.name for r in client) == ["grpcio", "protobuf"]
    link_distributions([r.name for r in client], tmp_path)
    probe = ("import sys, grpc\n"
             "from rlctl.online.proto import SERVICE_NAME, controller_pb2 as pb, controller_pb2_grpc as pb_grpc\n"
             "snap = pb.Snapshot(engine_id='e', seq=1, queue_hist=[0.0] * 10)\n"
             "assert pb.Snapshot.FromString(snap.SerializeToString()) == snap\n"
             "with grpc.insecure_channel('unix:///nonexistent.sock') as ch:\n"
             "    pb_grpc.ControllerStub(ch)\n"
             "for heavy in ('torch', 'numpy'):\n"
             "    try:\n"
             "        __import__(heavy)\n"
             "    except ImportError:\n"
             "        continue\n"
             "    raise SystemExit(heavy + ' is importable: the path is not the client extra alone')\n"
             "print(SERVICE_NAME)\n")
    done = run_isolated(["-c", probe], [str(target), str(tmp_path)], work)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "rlctl.controller.v1.Controller"


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0 and capsys.readouterr().out.strip() == f"rlctl {__version__}"
