"""The experiments behind every published figure, shipped inside the installed package so that
a wheel install finds them by name, as a checkout does: the scenarios (``scenarios/*.yaml``,
``load_scenario("burst")``), the training configurations (``train/*.yaml``,
``rlctl train --config steady``), trained policies (``policies/*.rlpolicy``,
``rlctl eval --policy NAME``), each scenario's sweep (``sweeps/*.json``, ``rlctl sweep``), the sets
of cases a change to the controller is judged on (``cases/*.yaml``, ``rlctl compare``) and the
``config.json`` of public checkpoints, without weights (``checkpoints/NAME/``, a deployment as
``NAME@GPU``). This package is data and one lookup; it imports nothing of ours.
"""
from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parent
SCENARIOS, TRAIN, POLICIES, CHECKPOINTS = ROOT / "scenarios", ROOT / "train", ROOT / "policies", ROOT / "checkpoints"
CASES = ROOT / "cases"


def bundled(folder: Path, suffix: str) -> list[str]:
    """The names shipped in ``folder`` (file names without ``suffix``)."""
    return sorted(p.name[: -len(suffix)] for p in folder.glob(f"*{suffix}"))


def find(name: str | Path, folder: Path, suffix: str) -> Path:
    """``name`` as a path when that file exists or ``name`` is not a bare name; else the shipped
    ``folder/<name><suffix>`` when there is one. A missing file comes back as ``Path(name)``, for
    the caller to refuse naming what it looked for."""
    path = Path(name)
    if path.exists() or len(path.parts) != 1 or path.suffix:
        return path
    shipped = folder / f"{path}{suffix}"
    return shipped if shipped.is_file() else path
