"""``rlctl bench engine`` and ``rlctl bench env`` run end to end and report what they promise;
timings are never judged."""
from __future__ import annotations

import json
import math

import pytest

from experiments import SCENARIOS
from engine.config import ModelConfig
from rlctl.bench import BenchSizes, run_bench
from tests.sidecar_process import REPO


def test_small_engine_bench_reports_every_figure_and_generates_what_transformers_does():
    pytest.importorskip("transformers")
    sizes = BenchSizes(decode_model=ModelConfig(), batch=4, prompt_len=16, new_tokens=6,
                       kv_model=ModelConfig(), kv_blocks=32, block_size=4, seq_blocks=2, repeats=1)
    report = run_bench("engine", sizes, device="cpu")

    json.dumps(report)  # the CLI prints it as JSON
    assert report["device"] == "cpu"
    for key in ("torch_version", "torch_threads", "repeats", "bench_s"):
        assert key in report
    decode = report["decode"]
    assert decode["batch"] == 4 and decode["prompt_len"] == 16 and decode["new_tokens"] == 6
    assert decode["decode_tokens"] == 4 * 5  # the first token of each comes from the prefill
    for key in ("engine_decode_tok_s", "hf_decode_tok_s", "ratio"):
        assert key in decode
    assert decode["tokens_identical"] is True

    compaction = report["compaction"]
    assert compaction["blocks_moved"] > 0
    assert compaction["bytes_moved"] == compaction["blocks_moved"] * compaction["block_bytes"]
    for key in ("compaction_bytes_per_s", "torch_copy_bytes_per_s", "ratio"):
        assert compaction[key] > 0
    assert compaction["compaction_kept_data"] is True



def test_small_env_bench_reports_every_figure_finite_and_positive():
    import yaml

    from env.scenario_yaml import scenario_from_dict
    from rlctl.bench import EnvBenchSizes

    data = yaml.safe_load((SCENARIOS / "burst.yaml").read_text())
    scenario = scenario_from_dict({**data, "name": "burst", "max_steps": 3})
    # seconds=0: one episode per measurement; one parallel process (spawned, so it still crosses a process)
    report = run_bench("env", EnvBenchSizes(scenario=scenario, seconds=0.0, processes=1, top=3))

    json.dumps(report)  # the CLI prints it as JSON
    assert report["scenario"] == "burst" and report["deployment"] == "llama70b-4bit-h100"
    assert report["max_steps"] == 3 and report["policy"] == "random"
    single = report["single"]
    assert single["episodes"] == 1 and single["steps"] == 3
    for key in ("steps_per_s", "engine_s_per_wall_s", "iterations_per_s", "iterations_per_step", "us_per_iteration",
                "wall_s", "engine_iterations"):
        assert math.isfinite(single[key]) and single[key] > 0, key
    parallel = report["parallel"]
    assert parallel["processes"] == 1 and len(parallel["per_process_steps_per_s"]) == 1
    assert parallel["steps"] == 3 and parallel["episodes"] == 1
    for key in ("aggregate_steps_per_s", "mean_per_process_steps_per_s", "aggregate_engine_s_per_wall_s",
                "ratio_to_single"):
        assert math.isfinite(parallel[key]) and parallel[key] > 0, key
    profile = report["profile"]
    assert profile["episode_steps"] == 3 and 0 < profile["engine_run_share"] <= 1
    for name in ("top_internal", "top_cumulative", "top_files_internal"):
        assert len(profile[name]) == 3
        assert all(0 < e["share"] <= 1 for e in profile[name])
    assert all(":" in e["function"] for e in profile["top_cumulative"])  # file:function
    assert isinstance(report["bound_by"], str) and "iterations per step" in report["bound_by"]
    assert report["target_steps_per_s"] == 1000 and report["ratio_to_target"] == pytest.approx(report["single"]["steps_per_s"] / 1000, rel=1e-2)
    assert math.isfinite(report["ratio_to_target"]) and report["ratio_to_target"] > 0
    machine = report["machine"]
    assert machine["cpu_count"] >= 1 and machine["python"] and machine["torch_version"]


def test_env_bench_refuses_bad_sizes_and_unknown_benchmarks():
    from rlctl.bench import EnvBenchSizes

    with pytest.raises(ValueError, match="seconds"):
        EnvBenchSizes(seconds=-1)
    with pytest.raises(ValueError, match="processes"):
        EnvBenchSizes(processes=0)
    with pytest.raises(ValueError, match="known: engine, env"):
        run_bench("nope")


@pytest.mark.parametrize("policy, kind", [("watermark", "baseline"),
                                          (f"unpark:4:ontime:{REPO / 'experiments/policies/default.rlpolicy'}", "file")])
def test_small_sidecar_bench_reports_latency_and_ratios_for_every_transport(policy, kind):
    from rlctl.bench import SidecarBenchSizes

    report = run_bench("sidecar", SidecarBenchSizes(policy=policy, snapshots=10, decisions=20, warmup=2))
    json.dumps(report)
    assert report["snapshots"] == 10 and report["decisions"] == 20 and report["policy_kind"] == kind
    calls = [report["in_process"], report["unix"]["decide"], report["unix"]["live_stream"], report["loopback"]["decide"]]
    for call in calls:
        for key in ("p50_us", "p99_us", "mean_us", "decisions_per_s"):
            assert math.isfinite(call[key]) and call[key] > 0, key
    for call in calls[1:]:
        for key in ("p50_ratio_to_in_process", "p99_ratio_to_in_process", "throughput_ratio_to_in_process",
                    "p50_ratio_to_empty_rpc", "p99_ratio_to_empty_rpc"):
            assert math.isfinite(call[key]) and call[key] > 0, key
    for transport in ("unix", "loopback"):  # gRPC's floor, measured on the same server in the same run
        floor = report[transport]["empty_rpc"]
        assert math.isfinite(floor["p50_us"]) and floor["p50_us"] > 0
        assert report[transport]["decide"]["p50_ratio_to_empty_rpc"] == pytest.approx(
            report[transport]["decide"]["p50_us"] / floor["p50_us"], rel=0.01)
    with pytest.raises(ValueError, match="decisions"):
        SidecarBenchSizes(decisions=0)


def test_sidecar_bench_refuses_a_node_policy_naming_what_it_measures(capsys):
    """The benchmark times one engine's Decide: a node policy is refused before any server starts, and a
    one-engine policy's own loading error (here, a missing file) is passed on as the sidecar words it."""
    from rlctl.bench import SidecarBenchSizes
    from rlctl.cli import main

    node = REPO / "experiments/policies/node_reasoning_trio.rlpolicy"
    with pytest.raises(ValueError, match="a node policy; rlctl bench sidecar measures one engine's decisions"):
        run_bench("sidecar", SidecarBenchSizes(policy=str(node), snapshots=2, decisions=2, warmup=1))
    assert main(["bench", "sidecar", "--policy", str(node)]) == 2
    assert "a node policy" in capsys.readouterr().err
    with pytest.raises(ValueError, match="nope.rlpolicy") as missing:
        run_bench("sidecar", SidecarBenchSizes(policy="nope.rlpolicy", snapshots=2, decisions=2, warmup=1))
    assert "node" not in str(missing.value)


def test_bench_json_is_a_path_or_dash_like_every_other_json_option(tmp_path, monkeypatch, capsys):
    import rlctl.bench
    from rlctl.cli import main

    monkeypatch.setattr(rlctl.bench, "run_bench", lambda what, sizes=None: {"benchmark": what, "steps_per_s": 281.0})
    assert main(["bench", "env"]) == 0
    assert capsys.readouterr().out == "benchmark: env\nsteps_per_s: 281.0\n"
    assert main(["bench", "env", "--json", "-"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out) == {"benchmark": "env", "steps_per_s": 281.0} and "steps_per_s: 281.0" in err
    assert main(["bench", "env", "--json", str(tmp_path / "env.json")]) == 0
    assert "steps_per_s: 281.0" in capsys.readouterr().out
    assert json.loads((tmp_path / "env.json").read_text()) == {"benchmark": "env", "steps_per_s": 281.0}


def test_bench_sidecar_serves_the_policy_given_as_rlctl_serve_takes_it(monkeypatch, capsys):
    import rlctl.bench
    from rlctl.bench import SidecarBenchSizes
    from rlctl.cli import main

    asked = []
    monkeypatch.setattr(rlctl.bench, "run_bench", lambda what, sizes=None: asked.append((what, sizes)) or {"ok": 1})
    spec = "unpark:4:ontime:experiments/policies/default.rlpolicy"
    assert main(["bench", "sidecar", "--policy", spec]) == 0 and main(["bench", "sidecar"]) == 0
    assert asked == [("sidecar", SidecarBenchSizes(policy=spec)), ("sidecar", None)]
    assert main(["bench", "env", "--policy", "watermark"]) == 2
    assert "--policy applies to rlctl bench sidecar, not to bench env" in capsys.readouterr().err
