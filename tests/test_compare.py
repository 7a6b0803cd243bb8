"""``rlctl compare``: candidates against references on a committed set of cases, each pair on the
same episodes behind the shield, the geometric mean of their goodput ratios and the OOMs summed; the
bundled sets load, and a bad set or pairing is refused before an episode runs; each case's ratio
comes with a paired interval over the episodes."""
from __future__ import annotations

import json
import math

import pytest
import yaml

from agents.spec import make_policy
from env.scenario import ScenarioError
from experiments import CASES, bundled
from rlctl.cli import main
from rlctl.compare import Case, compare, format_compare, load_cases, scenario, verdict
from rlctl.evaluate import run_evals


def _cases(tmp_path, cases, **extra):
    path = tmp_path / "cases.yaml"
    path.write_text(yaml.safe_dump({"episodes": 1, "seed": 500, "steps": 12, "cases": cases, **extra}))
    return path


def test_each_ratio_is_the_pairs_goodput_on_the_same_episodes_as_rlctl_eval_runs_them(tmp_path):
    path = _cases(tmp_path, [{"scenario": "steady"}, {"trace": "azure2023_conv.csv", "deployment": "llama7b-fp16-a10",
                                                          "load": 1.2}])
    cases = load_cases(path)
    out = compare(["default", "watermark"], ["static:1", "static:2"], cases, say=lambda _: None)
    assert [(r["case"], r["pair"]) for r in out["rows"]] == [
        ("steady", 0), ("steady", 1), ("azure2023_conv.csv on llama7b-fp16-a10 at load 1.2", 0),
        ("azure2023_conv.csv on llama7b-fp16-a10 at load 1.2", 1)]
    # the same figures as rlctl eval gives on the same seed: the trained policy behind the shield, a baseline bare
    for case in cases.cases:
        alone = run_evals([(make_policy("default"), True), (make_policy("static:1"), False)], scenario(cases, case), 1, 500)
        row = next(r for r in out["rows"] if r["case"] == case.label() and r["pair"] == 0)
        assert row["candidate"] == alone["default"]["goodput_tokens_per_s"]
        assert row["reference"] == alone["static:1"]["goodput_tokens_per_s"]
    ratios = [r["ratio"] for r in out["rows"]]
    assert all(r is not None and r > 0 for r in ratios)
    assert out["geometric_mean_by_pair"] == pytest.approx(math.prod(ratios) ** (1 / len(ratios)))
    # the verdict's mean: over the cases, of the pairs' mean goodput
    by_case = []
    for case in cases.cases:
        rows = [r for r in out["rows"] if r["case"] == case.label()]
        by_case.append(sum(r["candidate"] for r in rows) / sum(r["reference"] for r in rows))
        assert out["by_case"][case.label()]["ratio"] == pytest.approx(by_case[-1])
    assert out["geometric_mean"] == pytest.approx(math.prod(by_case) ** (1 / len(by_case)))
    assert out["candidate_ooms"] == sum(r["candidate_ooms"] for r in out["rows"])
    # each case's ratio with its paired interval; one episode a side: the interval is the ratio itself
    for case in out["by_case"].values():
        lo, hi = case["interval_95"]
        assert lo == pytest.approx(case["ratio"]) and hi == pytest.approx(case["ratio"])


def test_each_cases_interval_pairs_the_episodes_and_brackets_its_ratio(tmp_path):
    out = compare(["default", "default_seed1"], ["watermark", "static:2"],
                  load_cases(_cases(tmp_path, [{"scenario": "long_outputs"}], episodes=4, steps=30)), say=lambda _: None)
    rows = out["rows"]
    assert all(len(r["candidate_episodes"]) == len(r["reference_episodes"]) == 4 for r in rows)
    assert all(r["candidate"] == pytest.approx(sum(r["candidate_episodes"]) / 4) for r in rows)
    case = out["by_case"]["long_outputs"]
    lo, hi = case["interval_95"]
    assert lo <= case["ratio"] <= hi and lo < hi  # four episodes that differ: an interval, not a point
    assert f"95 % interval {lo:.3f}x to {hi:.3f}x" in format_compare(out)


def test_a_policy_against_itself_is_one_and_the_bar_judges_the_mean_and_the_ooms(tmp_path):
    out = compare(["default"], ["default"], load_cases(_cases(tmp_path, [{"scenario": "long_outputs"}], steps=20)),
                  say=lambda _: None)
    assert out["geometric_mean"] == 1.0 and out["geometric_mean_by_pair"] == 1.0
    assert verdict(out, 1.0) and not verdict(out, 1.001)
    more = {**out, "candidate_ooms": out["reference_ooms"] + 1}  # as good, but one more crash: not met
    assert not verdict(more, 1.0)
    nothing = {**out, "geometric_mean": None, "left_out": ["long_outputs"]}  # no reference goodput anywhere
    assert not verdict(nothing, 0.5)
    assert "bar 0.5x with no more OOMs: not judged: no case could be compared" in format_compare(nothing, 0.5)


def test_a_candidate_without_goodput_scores_zero_and_a_reference_without_it_has_no_ratio():
    from rlctl.compare import _geometric_mean, _ratio

    assert _ratio(0.0, 50.0) == 0.0 and _ratio(10.0, 0.0) is None and _ratio(0.0, 0.0) is None
    assert _geometric_mean([0.0, 2.0]) == 0.0 and _geometric_mean([None, 4.0, 1.0]) == pytest.approx(2.0)
    assert _geometric_mean([None]) is None


def test_a_pair_without_goodput_is_left_out_and_named(tmp_path):
    # one decision of long outputs finishes no request: no ratio to take
    out = compare(["static:2"], ["static:1"], load_cases(_cases(tmp_path, [{"scenario": "long_outputs"}], steps=1)),
                  say=lambda _: None)
    assert out["rows"][0]["ratio"] is None and out["left_out"] == ["long_outputs (pair 0)"]
    assert out["geometric_mean"] is None and not verdict(out, 0.5)


def test_a_case_with_clients_that_give_up_runs_as_rlctl_eval_runs_it(tmp_path):
    cases = load_cases(_cases(tmp_path, [{"scenario": "long_outputs", "client_timeout": 5}], steps=30))
    sc = scenario(cases, cases.cases[0])
    assert sc.engine_config().client_timeout_s == 5.0
    out = compare(["static:1"], ["vllm"], cases, say=lambda _: None)
    alone = run_evals([(make_policy("static:1"), False)], sc, 1, 500)
    assert out["rows"][0]["candidate"] == alone["static:1"]["goodput_tokens_per_s"]
    assert alone["static:1"]["requests_abandoned"] > 0  # a reservation of every max_tokens: the queue waits


def test_the_bundled_sets_load_with_every_case_checked():
    assert {"validation", "parking"} <= set(bundled(CASES, ".yaml"))
    validation, parking = load_cases("validation"), load_cases("parking")
    assert len(validation.cases) == 8 and (validation.seed, validation.episodes) == (500, 3)
    assert all(c.trace and c.load == 1.2 for c in parking.cases) and parking.seed == 4100


@pytest.mark.parametrize("cases, extra, words", [
    ([{}], {}, "give a scenario, or a trace"),
    ([{"trace": "azure2023_conv.csv"}], {}, "give load"),
    ([{"scenario": "steady", "load": 1.2}], {}, "apply to a trace"),
    ([{"scenario": "no_such_scenario"}], {}, "no_such_scenario"),
    ([{"trace": "azure2023_conv.csv", "deployment": "no-such-gpu", "load": 1.2}], {}, "no-such-gpu"),
    ([{"scenario": "steady", "seeds": 3}], {}, "unknown key"),
    ([{"scenario": "steady"}], {"episodes": 0}, "episodes must be > 0"),
    ([{"scenario": "steady"}], {"steps": -1}, "steps must be > 0"),
    ([{"scenario": "steady"}], {"seed": -1}, "seed must be >= 0"),
    ([{"scenario": "steady"}, {"scenario": "steady"}], {}, "steady listed more than once"),
    ([{"scenario": "steady", "client_timeout": 0}], {}, r"cases\[0\].client_timeout must be a finite number > 0"),
    ([{"trace": "azure2023_conv.csv", "load": -1}], {}, r"cases\[0\].load must be a finite number > 0, got -1"),
])
def test_a_bad_set_of_cases_is_refused_naming_what_is_wrong(tmp_path, cases, extra, words):
    with pytest.raises((ScenarioError, ValueError), match=words):
        load_cases(_cases(tmp_path, cases, **extra))


def test_the_command_refuses_bad_input_before_running_and_writes_the_verdict(tmp_path, capsys):
    assert main(["compare", "--candidate", "static:2", "--reference", "static:1", "static:2", "--cases",
                 str(_cases(tmp_path, [{"scenario": "steady"}]))]) == 2
    assert "as many candidates as references" in capsys.readouterr().err
    assert main(["compare", "--candidate", "static:2", "--reference", "static:1", "--cases", "nope"]) == 2
    err = capsys.readouterr().err
    assert "no such file" in err and "validation" in err
    assert main(["compare", "--candidate", "no_such.rlpolicy", "--reference", "static:1", "--cases",
                 str(_cases(tmp_path, [{"scenario": "steady"}]))]) == 2
    assert "no_such.rlpolicy" in capsys.readouterr().err
    assert main(["compare", "--candidate", "static:2", "--reference", "static:1", "--bar", "-1", "--cases",
                 str(_cases(tmp_path, [{"scenario": "steady"}]))]) == 2
    assert "--bar" in capsys.readouterr().err
    out = tmp_path / "out.json"
    assert main(["compare", "--candidate", "static:2", "--reference", "static:1", "--bar", "1.0", "--json", str(out),
                 "--cases", str(_cases(tmp_path, [{"scenario": "steady"}]))]) == 0
    printed = capsys.readouterr().out
    data = json.loads(out.read_text())
    assert data["bar"] == 1.0 and data["met"] == verdict(data, 1.0)
    assert f"bar 1x with no more OOMs: {'met' if data['met'] else 'not met'}" in printed
    assert f"{data['geometric_mean']:.3f}x" in printed


def test_a_case_names_itself():
    assert Case(scenario="steady").label() == "steady"
    assert Case(scenario="steady", client_timeout=30).label() == "steady, clients giving up at 30 s"
    assert Case(trace="t.csv", deployment="d", load=1.2).label() == "t.csv on d at load 1.2"
    assert Case(scenario="trace_a10", trace="t.csv", load=1.2).label() == "t.csv on trace_a10's deployment at load 1.2 (trace_a10)"
    assert Case(trace="t.csv", load=1.2).label() == "t.csv on trace's deployment at load 1.2"
