"""scripts/setup refuses a Python older than 3.10 (naming the one it found and its version) or a
missing one, before it touches anything. It runs from a copy of the script in a folder of its own,
so that a regression could not reach this checkout's .venv. (Its full run, the recovery of a
half-made .venv and the choice of torch are checked by hand on a fresh clone; see the README.)"""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def run_setup(tmp_path: Path, python: str) -> subprocess.CompletedProcess:
    (tmp_path / "scripts").mkdir()
    shutil.copy(REPO / "scripts" / "setup", tmp_path / "scripts" / "setup")
    shutil.copy(REPO / "pyproject.toml", tmp_path / "pyproject.toml")
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "CONDA_PREFIX")} | {"PYTHON": python}
    return subprocess.run(["bash", str(tmp_path / "scripts" / "setup")], capture_output=True, text=True, env=env,
                          timeout=60)


def test_an_old_python_is_refused_by_name_and_version(tmp_path):
    old = tmp_path / "python3.9"
    old.write_text('#!/bin/sh\ncase "$2" in *print*) echo 3.9.18;; *) exit 1;; esac\n')
    old.chmod(0o755)
    done = run_setup(tmp_path, str(old))
    assert done.returncode == 1
    assert f"setup: rlctl needs Python 3.10 or newer; {old} ({old}) is Python 3.9.18" in done.stderr
    assert not (tmp_path / ".venv").exists()


def test_a_missing_python_is_refused(tmp_path):
    done = run_setup(tmp_path, str(tmp_path / "no-such-python"))
    assert done.returncode == 1 and "no Python found as" in done.stderr and "3.10 or newer" in done.stderr
    assert not (tmp_path / ".venv").exists()
