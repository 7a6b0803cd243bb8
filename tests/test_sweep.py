"""``rlctl sweep``: every fixed factor, the rules and the peers on a scenario, and its verdict."""
from __future__ import annotations

import json
from pathlib import Path

from experiments import SCENARIOS
from rlctl.cli import main


def test_a_sweep_where_no_policy_has_goodput_prints_its_verdict_and_writes_json_to_stdout(tmp_path, capsys,
                                                                                         monkeypatch):
    """Three decisions of long outputs: no request finishes, so static:1.0's share of the best is
    undefined. The verdict says so (formatting it raised a TypeError after the sweep had run, and the
    JSON was lost), and --json - writes the document to standard output, as every other --json does
    (it wrote a file named '-')."""
    monkeypatch.chdir(tmp_path)
    short = tmp_path / "short.yaml"
    short.write_text((SCENARIOS / "long_outputs.yaml").read_text().replace("max_steps: 150", "max_steps: 3"))
    assert main(["sweep", "--scenario", str(short), "--episodes", "1", "--no-oracle", "--json", "-"]) == 0
    out, err = capsys.readouterr()
    verdict = json.loads(out)["verdict"]
    assert verdict["static1_share_of_best"] is None and verdict["memory_bound"] is False
    assert "no policy has goodput" in err and "best fixed factor: static:1" in err
    assert not (tmp_path / "-").exists()
    assert main(["sweep", "--scenario", str(short), "--episodes", "1", "--no-oracle", "--json", "s.json"]) == 0
    assert json.loads(Path("s.json").read_text())["verdict"] == verdict
