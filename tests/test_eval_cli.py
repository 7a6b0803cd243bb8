"""``rlctl eval``: every policy on the same episodes, one table, the figures from the env's info."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from experiments import SCENARIOS
from agents.spec import baselines
from rlctl.cli import main


def short_burst(tmp_path: Path, steps: int = 12) -> Path:
    data = yaml.safe_load((SCENARIOS / "burst.yaml").read_text())
    path = tmp_path / "short_burst.yaml"
    path.write_text(yaml.safe_dump({**data, "max_steps": steps, "best_static": 1.5}))
    return path


def test_eval_with_baselines_prints_one_table_and_writes_the_figures(tmp_path, capsys):
    out = tmp_path / "eval.json"
    assert main(["eval", "--scenario", str(short_burst(tmp_path)), "--baselines", "--episodes", "2",
                 "--json", str(out)]) == 0
    table = capsys.readouterr().out
    for row in ("goodput (tok/s)", "KV util p99", "OOM events", "preemptions", "swap out/in", "TTFT p99",
                "TPOT p50", "shield overrides"):
        assert row in table
    results = json.loads(out.read_text())["results"]
    assert list(results) == ["static:1", "static:1.5", "watermark", "vllm", "sglang", "random"] == baselines(1.5)
    for name, r in results.items():
        assert len(r["episodes"]) == 2 and len(r["series"]["kv_util"]) == 12
        mean = sum(e["goodput_tokens_per_s"] for e in r["episodes"]) / 2
        assert abs(r["goodput_tokens_per_s"] - mean) < 1e-9
    # every policy saw the same workloads
    assert len({r["requests_submitted"] for r in results.values()}) == 1


def test_baselines_run_where_the_tuned_factor_is_the_conservative_one(tmp_path, capsys):
    # a trace replayed with --trace takes a scenario whose best_static is 1: the conservative
    # reservation and the tuned factor are then one row, not two specs refused for sharing a label
    path = tmp_path / "tuned_1.yaml"
    path.write_text(yaml.safe_dump({**yaml.safe_load(short_burst(tmp_path).read_text()), "best_static": 1.0}))
    out = tmp_path / "eval.json"
    assert main(["eval", "--scenario", str(path), "--policy", "static:1.0", "--baselines", "--episodes", "1",
                 "--json", str(out)]) == 0
    assert list(json.loads(out.read_text())["results"]) == ["static:1", "watermark", "vllm", "sglang", "random"]
    assert main(["eval", "--policy", "default", "--baselines", "--trace", "arxiv_summarization_lengths_llama2tok.csv",
                 "--load", "1.2", "--steps", "3", "--episodes", "1"]) == 0
    assert "static:1 " in capsys.readouterr().out


def test_eval_refuses_a_bad_policy_or_trace_before_running_anything(tmp_path, capsys):
    out = tmp_path / "eval.json"
    assert main(["eval", "--scenario", str(short_burst(tmp_path)), "--policy", "static:1.0", "--policy", "clairvoyant",
                 "--json", str(out)]) == 2
    err = capsys.readouterr()
    assert "clairvoyant" in err.err and "eval:" not in err.out and not out.exists()
    assert main(["eval", "--trace", str(tmp_path / "missing.csv"), "--policy", "vllm"]) == 2
    assert "missing.csv" in capsys.readouterr().err
    with pytest.raises(SystemExit) as refused:  # argparse's own refusal, before anything runs
        main(["eval", "--scenario", str(short_burst(tmp_path)), "--policy", "vllm", "--episodes", "0"])
    assert refused.value.code == 2 and "argument --episodes: expected a whole number > 0" in capsys.readouterr().err


def test_json_dash_writes_the_document_alone_to_stdout_and_the_table_to_stderr(tmp_path, capsys):
    assert main(["eval", "--scenario", str(short_burst(tmp_path, steps=3)), "--policy", "static:1.5",
                 "--json", "-"]) == 0
    out, err = capsys.readouterr()
    document = json.loads(out)  # nothing else on stdout
    assert document["scenario"] == "short_burst" and list(document["results"]) == ["static:1.5"]
    assert "goodput (tok/s)" in err and "eval: scenario short_burst" in err


def test_the_backlog_note_needs_every_policy_behind_and_every_figure():
    from rlctl.report import backlog_note

    def run(submitted, waiting, late):
        return {"requests_submitted": submitted, "requests_waiting": waiting, "requests_waiting_late": late}

    behind = {"a": run(100, 60, 50), "b": run(100, 30, 10)}
    assert "a 60 (50), b 30 (10); of 100 submitted" in backlog_note(behind)
    assert backlog_note({**behind, "c": run(100, 20, 9)}) is None  # one policy keeps up: not the workload's doing
    assert backlog_note({**behind, "c": run(0, 0, 0)}) is None  # nothing submitted: nothing behind
    assert backlog_note({**behind, "c": {"requests_submitted": 100}}) is None  # figures from an older build
    assert backlog_note({}) is None
    # clients that gave up requests under every policy: the queue cannot grow for ever
    gave_up = {n: {**r, "requests_abandoned": 3} for n, r in behind.items()}
    assert backlog_note(gave_up) is None
    assert backlog_note({**gave_up, "b": {**gave_up["b"], "requests_abandoned": 0}}) is not None


def test_rate_scale_reads_a_scenario_at_another_arrival_rate_and_refuses_what_it_cannot_scale(tmp_path, capsys):
    path = short_burst(tmp_path)
    submitted = {}
    for scale in (None, 2.0):
        js = tmp_path / f"{scale}.json"
        assert main(["eval", "--scenario", str(path), "--policy", "vllm", "--json", str(js)]
                    + (["--rate-scale", str(scale)] if scale else [])) == 0
        document = json.loads(js.read_text())
        submitted[scale] = document["results"]["vllm"]["requests_submitted"]
        assert document["scenario"] == ("short_burst@2" if scale else "short_burst")
    capsys.readouterr()
    assert 1.5 < submitted[2.0] / submitted[None] < 2.5
    for args, why in ((["--rate-scale", "0"], "--rate-scale must be a finite number > 0, got 0"),
                      (["--rate-scale", "inf"], "--rate-scale must be a finite number > 0, got inf"),
                      (["--rate-scale", "2", "--trace", "azure2023_conv.csv"], "--rate-scale applies to a scenario")):
        assert main(["eval", "--scenario", str(path), "--policy", "vllm"] + args) == 2
        assert why in capsys.readouterr().err


def test_a_json_path_that_cannot_be_written_is_refused_before_anything_runs(tmp_path, capsys):
    for bad, why in ((tmp_path / "no" / "such" / "eval.json", "does not exist"), (tmp_path, "not a writable file")):
        assert main(["eval", "--scenario", str(short_burst(tmp_path)), "--policy", "vllm", "--json", str(bad)]) == 2
        out, err = capsys.readouterr()
        assert f"rlctl eval: error: --json {bad}" in err and why in err and "eval:" not in out


def test_eval_says_so_when_every_policy_ends_behind_a_growing_queue(tmp_path, capsys):
    calm = short_burst(tmp_path, steps=12)
    data = yaml.safe_load(calm.read_text())
    flood = tmp_path / "flood.yaml"  # 40 requests a second on the 70B H100: far more than it serves
    flood.write_text(yaml.safe_dump({**data, "workload": {**data["workload"], "arrivals": {"kind": "poisson",
                                                                                          "rate": 40.0}}}))
    for path, noted in ((calm, False), (flood, True)):
        js = tmp_path / "r.json"
        assert main(["eval", "--scenario", str(path), "--policy", "static:1.0", "--policy", "vllm", "--episodes", "1",
                     "--json", str(js)]) == 0
        table = capsys.readouterr().out
        results = json.loads(js.read_text())["results"]
        late = {n: r["requests_waiting_late"] / r["requests_submitted"] for n, r in results.items()}
        assert ("the workload asks more than the deployment serves" in table) == noted
        assert (min(late.values()) >= 0.1) == noted
        assert all(r["requests_waiting"] >= r["requests_waiting_late"] >= 0 for r in results.values())
        if noted:
            r = results["vllm"]
            assert f"vllm {r['requests_waiting']:.0f} ({r['requests_waiting_late']:.0f})" in table


def test_clients_that_give_up_bound_the_queue_and_the_table_counts_them(tmp_path, capsys):
    calm = short_burst(tmp_path, steps=12)
    data = yaml.safe_load(calm.read_text())
    flood = tmp_path / "flood.yaml"  # far more than the deployment serves: the queue grows without a timeout
    flood.write_text(yaml.safe_dump({**data, "workload": {**data["workload"], "arrivals": {"kind": "poisson",
                                                                                          "rate": 40.0}}}))
    figures = {}
    for timeout in (None, 5.0):
        js = tmp_path / f"{timeout}.json"
        assert main(["eval", "--scenario", str(flood), "--policy", "vllm", "--episodes", "1", "--json", str(js)]
                    + (["--client-timeout", str(timeout)] if timeout else [])) == 0
        table = capsys.readouterr().out
        figures[timeout] = json.loads(js.read_text())["results"]["vllm"]
        assert ("given up by clients" in table) == (timeout is not None)
        # the queue no longer grows for ever: no backlog note where clients give up
        assert ("the workload asks more than the deployment serves" in table) == (timeout is None)
    patient, impatient = figures[None], figures[5.0]
    assert patient["requests_abandoned"] == 0 and impatient["requests_abandoned"] > 0
    assert patient["requests_submitted"] == impatient["requests_submitted"]
    # clients leave 5 s after arriving (at the next iteration), so far fewer are left waiting at the end
    assert impatient["requests_waiting"] < patient["requests_waiting"]
    for bad, why in (("0", "--client-timeout must be a finite number of seconds > 0, got 0"),
                     ("nan", "--client-timeout must be a finite number of seconds > 0, got nan")):
        assert main(["eval", "--scenario", str(calm), "--policy", "vllm", "--client-timeout", bad]) == 2
        assert why in capsys.readouterr().err
    assert main(["eval", "--scenario", "node_chat_pair", "--policy", "vllm", "--client-timeout", "5"]) == 2
    assert "--client-timeout applies to one engine's scenarios" in capsys.readouterr().err


def test_eval_says_so_when_no_policy_can_meet_the_slo(tmp_path, capsys):
    reachable = short_burst(tmp_path, steps=15)
    data = yaml.safe_load(reachable.read_text())
    out_of_reach = tmp_path / "impossible.yaml"  # no prefill ends within a millisecond of arrival
    out_of_reach.write_text(yaml.safe_dump({**data, "engine": {**data["engine"], "ttft_slo_s": 0.001}}))
    for path, noted in ((reachable, False), (out_of_reach, True)):
        js = tmp_path / "r.json"
        assert main(["eval", "--scenario", str(path), "--policy", "static:1.0", "--policy", "vllm", "--episodes", "1",
                     "--json", str(js)]) == 0
        table = capsys.readouterr().out
        attained = {n: r["slo_attainment"] for n, r in json.loads(js.read_text())["results"].items()}
        row = next(line for line in table.splitlines() if line.startswith("SLO attained"))
        assert row.split()[2:] == [f"{v:.1%}" for v in attained.values()]  # the row is the figure
        assert ("does not serve this workload within its SLO" in table) == noted
        assert (max(attained.values()) < 0.1) == noted
        if noted:
            assert "TTFT <= 0.001 s" in table


def test_two_policy_files_of_the_same_name_get_a_column_each(tmp_path, capsys, monkeypatch):
    """Every training run writes a policy.rlpolicy: two of them are two columns, labelled by path,
    not one column under 'policy' with the second run's figures in it."""
    from experiments import POLICIES

    shipped = (POLICIES / "default.rlpolicy").read_bytes()
    for run in ("a", "b"):
        (tmp_path / run).mkdir()
        (tmp_path / run / "policy.rlpolicy").write_bytes(shipped)
    out = tmp_path / "eval.json"
    scenario = str(short_burst(tmp_path, steps=3))
    first, second = str(tmp_path / "a" / "policy.rlpolicy"), str(tmp_path / "b" / "policy.rlpolicy")
    assert main(["eval", "--scenario", scenario, "--policy", first, "--policy", second, "--policy", "vllm",
                 "--episodes", "1", "--json", str(out)]) == 0
    results = json.loads(out.read_text())["results"]
    assert list(results) == [str(tmp_path / "a" / "policy"), str(tmp_path / "b" / "policy"), "vllm"]
    assert [r["policy"] for r in results.values()] == list(results)
    header = next(line for line in capsys.readouterr().out.splitlines() if "vllm" in line)
    assert str(tmp_path / "a" / "policy") in header and str(tmp_path / "b" / "policy") in header
    # one file by two names that still share a label: an error naming both, before anything runs
    monkeypatch.chdir(tmp_path)
    (tmp_path / "default.rlpolicy").write_bytes(shipped)
    assert main(["eval", "--scenario", scenario, "--policy", "default", "--policy", "default.rlpolicy",
                 "--json", str(out.with_name("clash.json"))]) == 2
    captured = capsys.readouterr()
    assert "default and default.rlpolicy" in captured.err and "same label" in captured.err
    assert "eval:" not in captured.out and not out.with_name("clash.json").exists()


def test_jobs_run_the_episodes_in_processes_with_the_same_figures(tmp_path, capsys):
    """An episode depends only on its policy, scenario, shield and seed: run in two processes (the
    oracle's first, in whatever order they finish) every figure and time series is the one run
    one after another gives, the trained policy behind the shield and the baselines bare."""
    scenario = short_burst(tmp_path, steps=8)
    documents = []
    for jobs in ("1", "2"):
        out = tmp_path / f"jobs{jobs}.json"
        assert main(["eval", "--scenario", str(scenario), "--policy", "static:1.5", "--policy", "default",
                     "--policy", "oracle", "--policy", "watermark", "--episodes", "2", "--seed", "7",
                     "--jobs", jobs, "--json", str(out)]) == 0
        documents.append(json.loads(out.read_text())["results"])
    serial, parallel = documents
    assert list(parallel) == list(serial) == ["static:1.5", "default", "oracle", "watermark"]
    assert parallel == serial
    # the episodes differ (seeds 7 and 8), so a mix-up of seeds or policies would show
    assert serial["static:1.5"]["episodes"][0] != serial["static:1.5"]["episodes"][1]


def test_two_policies_of_one_name_are_refused_until_labelled(tmp_path):
    """Every training run writes a policy.rlpolicy: two of them in one evaluation would share the
    name the figures are keyed by, and one's figures would stand for both."""
    import dataclasses
    import shutil

    from agents.spec import label_policies, make_policy
    from experiments import POLICIES
    from env.scenario_yaml import load_scenario
    from rlctl.evaluate import run_evals

    specs = []
    for run, shipped in (("a", "default"), ("b", "default_seed2")):
        (tmp_path / run).mkdir()
        specs.append(str(shutil.copy(POLICIES / f"{shipped}.rlpolicy", tmp_path / run / "policy.rlpolicy")))
    policies = {spec: make_policy(spec) for spec in specs}
    assert [p.name for p in policies.values()] == ["policy", "policy"]
    scenario = dataclasses.replace(load_scenario("steady"), max_steps=6)  # where the two weights act apart
    with pytest.raises(ValueError, match=r"'policy' named more than once.*label_policies"):
        run_evals([(p, True) for p in policies.values()], scenario, 1, 1000)
    results = run_evals([(p, True) for p in label_policies(policies).values()], scenario, 1, 1000)
    assert list(results) == [s.removesuffix(".rlpolicy") for s in specs]
    actions = [results[label]["episodes"][0]["actions"] for label in results]
    alone = [run_evals([(make_policy(spec), True)], scenario, 1, 1000)["policy"]["episodes"][0]["actions"]
             for spec in specs]
    assert actions == alone and actions[0] != actions[1]


def test_a_bad_jobs_count_is_refused_naming_the_option(tmp_path, capsys):
    for bad in ("0", "-2", "two"):
        with pytest.raises(SystemExit) as stop:
            main(["eval", "--scenario", str(short_burst(tmp_path, steps=3)), "--policy", "vllm", "--jobs", bad])
        assert stop.value.code == 2
        assert "--jobs" in capsys.readouterr().err


def test_a_burstgpt_trace_replays_at_a_load(tmp_path, capsys):
    # a trace in BurstGPT's format, which no bundled file has: read, sized to the deployment, replayed
    lines = ["Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type"]
    for i in range(300):
        prompt, out = 200 + 37 * (i % 29), 20 + 53 * (i % 11)
        lines.append(f"{1.7 * i:.1f},{'GPT-4' if i % 5 == 0 else 'ChatGPT'},{prompt},{out},{prompt + out},Conversation log")
    trace = tmp_path / "burstgpt.csv"
    trace.write_text("\n".join(lines) + "\n")
    out = tmp_path / "eval.json"
    assert main(["eval", "--policy", "default", "--policy", "watermark", "--trace", str(trace), "--load", "1.2",
                 "--steps", "5", "--episodes", "1", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "burstgpt.csv" in printed and "puts it at 1.2x" in printed
    results = json.loads(out.read_text())["results"]
    assert results["default"]["requests_submitted"] > 0 and results["default"]["steps"] == 5
