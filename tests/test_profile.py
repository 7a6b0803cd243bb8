"""``rlctl profile``: the fitted cost model, its file, and the engine it times. No timing is judged:
how well the fit does is for the report, not for a test."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest

from engine.config import EngineConfig, ModelConfig
from engine.cost_model import CostModel
from engine.engine import Engine
from engine.executor import ProfiledExecutor
from engine.scheduler import BatchShape
from engine.request import Request
from rlctl.cli import main
from rlctl.profile import HOLD_OUT_EVERY, QUICK_GRID, SECTIONS, Grid, nnls, profile, summary


@pytest.fixture(scope="module")
def profiled(tmp_path_factory):
    cost, report = profile(grid=QUICK_GRID, repeats=2)
    path = tmp_path_factory.mktemp("profile") / "cost.json"
    cost.save(path, report=report)
    return cost, report, path


def test_file_loads_back_to_the_same_model(profiled):
    cost, _, path = profiled
    loaded = CostModel.load(path)
    assert loaded == cost
    assert loaded.source.startswith("fitted by rlctl profile on cpu")


def test_coefficients_are_finite_and_non_negative(profiled):
    cost = profiled[0]
    for name in ("fixed_s", "per_token_s", "per_context_token_s", "per_attended_s", "copy_fixed_s",
                 "copy_bytes_per_s", "swap_fixed_s", "swap_bytes_per_s"):
        value = getattr(cost, name)
        assert math.isfinite(value) and value >= 0, name
    assert cost.copy_bytes_per_s > 0 and cost.swap_bytes_per_s > 0


def test_report_in_the_file_holds_the_fit_errors_and_every_point(profiled):
    cost, _, path = profiled
    doc = json.loads(path.read_text())
    report = doc["report"]
    assert report["device"] == "cpu" and report["model"]["hidden_size"] == ModelConfig().hidden_size
    for section in SECTIONS:
        s = report[section]
        assert math.isfinite(s["held_out_mape_pct"]) and s["held_out_mape_pct"] >= 0, section
        assert math.isfinite(s["train_mape_pct"]) and s["train_mape_pct"] >= 0, section
        held = [p["held_out"] for p in s["points"]]
        assert held == [i % HOLD_OUT_EVERY == HOLD_OUT_EVERY - 1 for i in range(len(held))]
        assert s["held_out_points"] == sum(held) > 0 and s["train_points"] == len(held) - sum(held)
        assert all(p["measured_s"] > 0 for p in s["points"])
    points = report["iterations"]["points"]
    assert len(points) == len(QUICK_GRID.points())
    assert {p["kind"] for p in points} == {"decode", "prefill", "mixed"}
    for p in points:  # the predictions in the report are the saved model's
        shape = BatchShape(p["num_tokens"], p["context_tokens"], p["attended"])
        assert p["predicted_s"] == pytest.approx(cost.iteration_s(shape), rel=1e-9)
        assert p["num_tokens"] == p["decodes"] + p["chunk"]
    for p in report["swap"]["points"]:
        assert p["predicted_s"] == pytest.approx(cost.copy_s(p["bytes"], "host"), rel=1e-9)
    for p in report["compaction"]["points"]:
        assert p["predicted_s"] == pytest.approx(cost.copy_s(p["bytes"], "device"), rel=1e-9)


def test_predicted_iteration_time_grows_with_batch_tokens(profiled):
    cost = profiled[0]
    decodes = [cost.iteration_s(BatchShape(b, b * 512, b * 512)) for b in (1, 8, 64)]
    prefills = [cost.iteration_s(BatchShape(n, n, n * (n + 1) // 2)) for n in (16, 256, 2048)]
    assert decodes == sorted(decodes) and decodes[0] < decodes[-1]
    assert prefills == sorted(prefills) and prefills[0] < prefills[-1]


def test_a_tensor_free_engine_timed_by_the_file_replays_to_completion(profiled):
    cost = CostModel.load(profiled[2])
    engine = Engine(ModelConfig(), EngineConfig(num_blocks=64, max_num_batched_tokens=256),
                    executor=ProfiledExecutor(cost, materialize=False))
    for i in range(6):
        engine.submit(Request(f"r{i}", 0.0, 40 + 30 * i, 8 + i, 16))
    engine.run()
    assert all(r.finish_s is not None and r.output_len == 8 + i for i, r in enumerate(engine.records.values()))
    assert engine.clock == pytest.approx(sum(it.duration_s for it in engine.iterations))  # no copies, no waits
    assert all(it.duration_s >= cost.fixed_s for it in engine.iterations)


def test_summary_warns_of_a_poor_fit_only(profiled):
    cost, report, _ = profiled
    good = {**report, **{s: {**report[s], "held_out_mape_pct": 1.0} for s in SECTIONS}}
    poor = {**good, "swap": {**good["swap"], "held_out_mape_pct": 90.0}}
    assert "warning" not in summary(cost, good)
    assert "warning" in summary(cost, poor) and "load average" in summary(cost, poor)


def test_nnls_recovers_non_negative_coefficients_and_keeps_kkt():
    rng = np.random.default_rng(0)
    a = np.column_stack([np.ones(30), rng.uniform(1, 100, 30), rng.uniform(1e3, 1e5, 30), rng.uniform(1e5, 1e7, 30)])
    x = np.array([1e-3, 2e-5, 0.0, 3e-10])
    assert np.allclose(nnls(a, a @ x), x, rtol=1e-6, atol=1e-15)
    y = a @ np.array([1e-3, -2e-5, 4e-7, 0.0]) + rng.normal(0, 1e-5, 30)  # the unconstrained fit goes negative
    got = nnls(a, y)
    assert (got >= 0).all()
    scaled = a / np.abs(a).max(axis=0)  # KKT in the unit-scaled columns nnls solves in
    grad = scaled.T @ (a @ got - y)
    tol = 1e-9 * np.linalg.norm(y) * np.linalg.norm(scaled)
    assert (grad[got == 0] >= -tol).all() and (np.abs(grad[got > 0]) <= tol).all()


def test_cli_writes_a_loadable_file_and_prints_a_summary(tmp_path, capsys):
    out = tmp_path / "cost.json"
    assert main(["profile", "--quick", "--repeats", "1", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "held-out MAPE" in text and "swap" in text and str(out) in text
    assert CostModel.load(out).source.startswith("fitted by rlctl profile")


@pytest.mark.parametrize("args, named", [
    (["--repeats", "0"], "--repeats"),
    (["--repeats", "-3"], "--repeats"),
    (["--out", "/nonexistent-dir/cost.json"], "--out"),
])
def test_cli_bad_arguments_name_the_argument(tmp_path, capsys, args, named):
    argv = ["profile", "--quick", "--out", str(tmp_path / "c.json"), *args]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("rlctl profile: error:") and named in err
    assert not (tmp_path / "c.json").exists()


def test_cli_out_that_is_a_directory_is_refused(tmp_path, capsys):
    assert main(["profile", "--quick", "--out", str(tmp_path)]) == 2
    assert "--out" in capsys.readouterr().err


def test_bad_grid_and_repeats_are_refused():
    with pytest.raises(ValueError, match="repeats"):
        profile(grid=QUICK_GRID, repeats=0)
    with pytest.raises(ValueError, match="copy_blocks"):
        Grid(copy_blocks=(4, 16))
    with pytest.raises(ValueError, match="> 0"):
        Grid(decode_batches=(0, 4))


def test_load_names_what_is_wrong(tmp_path):
    good = CostModel(1e-3, 1e-5, 1e-8, 1e-4, 1e9)
    path = tmp_path / "cost.json"
    good.save(path)
    assert CostModel.load(path) == good
    missing = tmp_path / "missing.json"
    with pytest.raises(FileNotFoundError, match="missing.json"):
        CostModel.load(missing)
    path.write_text("{not json")
    with pytest.raises(ValueError, match=r"cost\.json: not JSON"):
        CostModel.load(path)
    doc = {"cost_model": {**json.loads(json.dumps(good.__dict__)), "per_bogus_s": 1.0}}
    path.write_text(json.dumps(doc))
    with pytest.raises(ValueError, match="unknown field 'per_bogus_s'"):
        CostModel.load(path)
    path.write_text(json.dumps({"cost_model": {**good.__dict__, "fixed_s": -1.0}}))
    with pytest.raises(ValueError, match="fixed_s"):
        CostModel.load(path)
    path.write_text(json.dumps({"model": {}}))
    with pytest.raises(ValueError, match="cost_model"):
        CostModel.load(path)
