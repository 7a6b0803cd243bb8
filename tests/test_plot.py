"""``rlctl.plot.draw``: two baselines on a short bursty episode drawn to a real PNG; bad input
and a path that cannot be written are refused naming what is wrong."""
from __future__ import annotations


import pytest
import yaml

from experiments import SCENARIOS
from agents.spec import make_policy
from env.overcommit_env import OvercommitEnv
from env.scenario_yaml import scenario_from_dict
from rlctl.evaluate import evaluate
from rlctl.plot import draw

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def results() -> dict[str, dict]:
    data = yaml.safe_load((SCENARIOS / "burst.yaml").read_text())
    env = OvercommitEnv(scenario_from_dict({**data, "name": "burst", "max_steps": 10}))
    return {spec: evaluate(env, make_policy(spec), episodes=1, seed=0) for spec in ("static:1.0", "vllm")}


def test_draws_a_png_of_plausible_size(results, tmp_path):
    from matplotlib.image import imread

    assert any(v == float("inf") for v in results["vllm"]["series"]["overcommit"])  # drawn clipped
    out = tmp_path / "burst.png"
    draw(results, str(out), title="burst: static:1.0 vs vllm")

    data = out.read_bytes()
    assert data[:8] == PNG_MAGIC
    assert len(data) > 10_000
    height, width = imread(str(out)).shape[:2]
    assert 600 <= width <= 3000 and 600 <= height <= 3000


def test_bad_path_and_bad_results_are_refused_naming_them(results, tmp_path):
    missing = tmp_path / "no-such-dir" / "plot.png"
    with pytest.raises(FileNotFoundError, match="no-such-dir"):
        draw(results, str(missing))
    assert not missing.parent.exists()
    with pytest.raises(ValueError, match="is a directory"):
        draw(results, str(tmp_path))
    with pytest.raises(ValueError, match="no results"):
        draw({}, str(tmp_path / "x.png"))
    broken = {"vllm": {**results["vllm"], "series": {k: v for k, v in results["vllm"]["series"].items()
                                                      if k != "kv_util"}}}
    with pytest.raises(ValueError, match="'vllm'.*kv_util"):
        draw(broken, str(tmp_path / "x.png"))
    assert not (tmp_path / "x.png").exists()
