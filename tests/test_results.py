"""``rlctl results``' incumbents: the tuned fixed factor also runs behind the safety shield the
trained policy acts behind (as ``rlctl serve`` serves a fixed factor), and the best incumbent is
taken over both; a preempting engine adds the peers; the policy's ratio to the best incumbent comes
with a paired interval over the episodes."""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from env.scenario_yaml import load_scenario
from experiments import SCENARIOS
from rlctl.results import SHIELDED, format_results, incumbents, paired_ratio_interval, results


def test_a_crashing_engines_incumbents_include_the_shielded_tuned_factor():
    sc = replace(load_scenario("phase_shift"), max_steps=40)
    out = results(sc, ["default"], episodes=1, seed=1000, oracle=False)
    tuned = f"static:{sc.best_static:g}"
    assert incumbents(sc) == [tuned, tuned + SHIELDED, "watermark"]
    rows = out["rows"]
    assert {tuned, tuned + SHIELDED, "watermark", "vllm", "sglang", "static:1", "dqn"} <= set(rows)
    # the shield evicts before the KV is full: the same factor crashes no more often behind it
    assert rows[tuned + SHIELDED]["oom_events"][0] <= rows[tuned]["oom_events"][0]
    best = max(incumbents(sc), key=lambda n: rows[n]["goodput_tokens_per_s"][0])
    assert out["best_incumbent"] == best
    table = format_results(out)
    assert tuned + SHIELDED in table
    # each weight's own figures and actions, from the same run: 40 decisions an episode
    acts = out["dqn_actions"][0]
    assert set(acts) == {"hold", "scale_up", "back_off", "defrag", "evict"} and sum(acts.values()) == 40
    assert 0 <= rows["dqn"]["slo_attainment"][0] <= 1
    line = next(x for x in table.splitlines() if x.startswith("dqn 0 (default): "))
    assert f"SLO {100 * rows['dqn']['slo_attainment'][0]:.1f} %" in line and f"{acts['scale_up']:.0f} scale_up" in line


def test_a_preempting_engines_incumbents_add_the_peers():
    sc = replace(load_scenario("phase_shift_preempt"), max_steps=20)
    tuned = f"static:{sc.best_static:g}"
    assert incumbents(sc) == [tuned, tuned + SHIELDED, "watermark", "vllm", "sglang"]
    out = results(sc, ["default"], episodes=1, seed=1000, oracle=False)
    assert tuned + SHIELDED in out["rows"]
    # behind the served shield the preempting engine is steered as a crashing one: it runs out no more often
    assert out["rows"][tuned + SHIELDED]["preemptions"][0] <= out["rows"][tuned]["preemptions"][0]
    assert out["best_incumbent"] in incumbents(sc)


def test_one_oom_in_thirty_episodes_shows_in_the_table():
    """Three training seeds x ten episodes, one OOM on one seed: the table must not round it to 0."""
    figures = {"goodput_tokens_per_s": [500.0], "oom_events": [0.0], "preemptions": [0.0], "kv_util_mean": [0.5],
               "ttft_p99_s": [1.0], "slo_attainment": [0.9]}
    dqn = dict(figures, goodput_tokens_per_s=[500.0, 510.0, 490.0], oom_events=[0.0, 0.1, 0.0],
               preemptions=[0.0] * 3, kv_util_mean=[0.5] * 3, ttft_p99_s=[1.0] * 3, slo_attainment=[0.9] * 3)
    out = {"scenario": "s", "oom_mode": "crash", "best_incumbent": "watermark",
           "rows": {"dqn": dqn, "watermark": figures}, "dqn_over": {"watermark": 1.0}}
    row = next(line for line in format_results(out).splitlines() if line.startswith("| dqn |"))
    assert row.split("|")[3].strip() == "0.03 +- 0.05"


def test_the_paired_interval_brackets_the_ratio_and_narrows_when_the_episodes_agree():
    """Episodes on the same seeds move together: the interval is of the pairs, not of two free samples."""
    rng = np.random.default_rng(1)
    base = rng.uniform(500, 700, size=30)  # seeds differ by far more than the policies do
    steady = base * 1.04  # 4 % better on every seed
    noisy = base * rng.uniform(0.94, 1.14, size=30)  # 4 % better on average, by seed -6 % .. +14 %
    lo, hi = paired_ratio_interval(steady, base)
    assert lo == pytest.approx(1.04) and hi == pytest.approx(1.04)
    lo2, hi2 = paired_ratio_interval(noisy, base)
    ratio = noisy.mean() / base.mean()
    assert lo2 < ratio < hi2 and hi2 - lo2 > 0.02
    assert paired_ratio_interval(noisy, base) == (lo2, hi2)  # the same figures give the same interval
    # unpaired, the spread between seeds (about 8 % of the mean) would swamp a 4 % gain: paired, it does not
    assert lo2 > 1.0
    with pytest.raises(ValueError, match="equal, non-empty"):
        paired_ratio_interval(noisy[:5], base)
    with pytest.raises(ValueError, match="level"):
        paired_ratio_interval(noisy, base, level=1.0)


def test_the_table_gives_the_ratio_to_the_best_incumbent_with_its_interval():
    sc = replace(load_scenario("long_outputs_l40s_preempt"), max_steps=20)
    out = results(sc, ["default", "default_seed1"], episodes=3, seed=1000, oracle=False)
    vs = out["dqn_over_best"]
    best = out["rows"][out["best_incumbent"]]["goodput_tokens_per_s"][0]
    assert vs["episodes"] == 3 and vs["ratio"] == pytest.approx(np.mean(out["rows"]["dqn"]["goodput_tokens_per_s"]) / best)
    lo, hi = vs["interval_95"]
    assert lo <= vs["ratio"] <= hi
    assert f"{vs['ratio']:.3f}x, 95 % interval {lo:.3f}x to {hi:.3f}x" in format_results(out)


def test_with_clients_that_give_up_the_table_counts_the_requests_they_gave_up(tmp_path, capsys):
    import json

    from rlctl.cli import main

    out_file = tmp_path / "r.json"
    assert main(["results", "--policy", "default", "--scenario", "long_outputs", "--episodes", "1", "--no-oracle",
                 "--client-timeout", "10", "--json", str(out_file)]) == 0
    table = capsys.readouterr().out
    [out] = json.loads(out_file.read_text())
    rows = out["rows"]
    assert out["client_timeout_s"] == 10.0 and "clients giving up at 10 s" in table
    # an overloaded long-output episode: clients give up under every rule, the policy's included
    assert all(r["requests_abandoned"][0] > 0 for r in rows.values())
    dqn = next(line for line in table.splitlines() if line.startswith("| dqn |"))
    assert dqn.rstrip(" |").endswith(f"| {rows['dqn']['requests_abandoned'][0]:.0f}")
    assert "given up" not in format_results(dict(out, client_timeout_s=None))  # clients that wait: no column
    assert main(["results", "--policy", "default", "--scenario", "long_outputs", "--client-timeout", "0"]) == 2
    assert "--client-timeout must be a finite number of seconds > 0, got 0" in capsys.readouterr().err


def test_an_episode_too_short_for_any_answer_prints_and_writes_its_figures(tmp_path, capsys, monkeypatch):
    """Three decisions of long outputs: no request finishes, so SLO attainment and TTFT have no value.
    The table prints them as '-' (it raised a TypeError after the work was done, and the JSON was lost);
    the same file given twice is two weights, each with its line; --json - is standard output."""
    from rlctl.cli import main

    monkeypatch.chdir(tmp_path)
    short = tmp_path / "short.yaml"
    short.write_text((SCENARIOS / "long_outputs.yaml").read_text().replace("max_steps: 150",
                                                                                           "max_steps: 3"))
    assert main(["results", "--policy", "default", "default", "--scenario", str(short), "--episodes", "1",
                 "--no-oracle", "--json", "-"]) == 0
    out, err = capsys.readouterr()
    data = json.loads(out)
    assert data[0]["rows"]["dqn"]["slo_attainment"] == [None, None] and len(data[0]["dqn_actions"]) == 2
    assert "dqn 0 (default): 0.0 tok/s, SLO - %" in err and "dqn 1 (default): 0.0 tok/s, SLO - %" in err
    assert "dqn's goodput over: - (no incumbent has goodput)" in err
    assert not Path("-").exists()
