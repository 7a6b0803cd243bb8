"""``rlctl compare``: candidate policies against reference policies on a fixed set of cases, the way a
change to the controller is judged before it ships (README, "Results": "What was tried and not
shipped").

A set of cases (``experiments/cases/NAME.yaml``, or a file of the same form) names the scenarios or
the traces on deployments at a load, the seeds and the episodes; it is committed before the
candidate runs, so that the judgement cannot be chosen after it. Candidate k is paired with
reference k (the same training seed, or whatever pairs them), each as ``rlctl eval`` runs it (a
trained policy behind the safety shield, as it is served; a baseline bare), and every (case, pair)
gives the ratio of their mean goodput over the same episodes.
The verdict is the geometric mean over the cases of the candidates' mean goodput over the
references' (the form of the published rules), with the OOM events summed on each side: a bar
(``--bar``) is met when that mean is at least the bar and the candidate has no more OOMs. The
geometric mean of the (case, pair) ratios is printed beside it. A candidate with no goodput where
its reference has some scores 0, which no bar meets; a case or pair whose reference has no goodput
has no ratio, and is listed and left out of that mean. Each case's ratio comes with its paired 95 %
interval over the episodes (``rlctl.results.paired_ratio_interval``; on each seed, the mean over the
pairs of each side), so that a margin can be read against how far the episodes move it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from agents.spec import is_trained, make_policy
from env.scenario import ScenarioError
from env.scenario_yaml import from_mapping, read_yaml
from experiments import CASES, bundled, find
from rlctl.evaluate import eval_scenario, run_evals
from rlctl.results import paired_ratio_interval


@dataclass(frozen=True)
class Case:
    """A bundled scenario (``scenario``), or a trace replayed at ``load`` times what ``deployment``
    sustains (``rlctl eval --trace T --load X --deployment D``, on the bundled ``trace`` scenario's
    settings unless ``scenario`` names others); with ``client_timeout``, clients that give up a
    request still without its first token that many seconds after it arrived (``--client-timeout``)."""
    scenario: str | None = None
    trace: str | None = None
    deployment: str | None = None
    load: float | None = None
    client_timeout: float | None = None

    def label(self) -> str:
        gives_up = f", clients giving up at {self.client_timeout:g} s" if self.client_timeout is not None else ""
        if self.trace is None:
            return str(self.scenario) + gives_up
        where = self.deployment or f"{self.scenario or 'trace'}'s deployment"
        return (f"{self.trace} on {where} at load {self.load:g}" + (f" ({self.scenario})" if self.scenario else "")
                + gives_up)


@dataclass(frozen=True)
class Cases:
    name: str
    cases: tuple[Case, ...]
    episodes: int = 3
    seed: int = 500
    steps: int | None = None  # decisions an episode (default: each scenario's own)


def load_cases(name: str | Path) -> Cases:
    """A set of cases from its YAML, or a shipped one by name (``validation``:
    experiments/cases/validation.yaml); unknown keys and bad values fail naming the field, and every
    case's scenario, trace and deployment are checked before anything runs."""
    p = find(name, CASES, ".yaml")
    data = read_yaml(p, f"cases {name}: no such file (bundled: {', '.join(bundled(CASES, '.yaml'))})")
    if isinstance(data, dict):
        data = {"name": p.stem, **data}
    try:
        cases = from_mapping(Cases, data, str(p))
        for key in ("episodes", "steps"):
            if getattr(cases, key) is not None and getattr(cases, key) <= 0:
                raise ValueError(f"{key} must be > 0, got {getattr(cases, key)}")
        if cases.seed < 0:
            raise ValueError(f"seed must be >= 0, got {cases.seed}")
        for i, case in enumerate(cases.cases):
            if case.scenario is None and case.trace is None:
                raise ValueError(f"cases[{i}]: give a scenario, or a trace with its load")
            if case.trace is not None and case.load is None:
                raise ValueError(f"cases[{i}]: a trace is replayed at a load; give load")
            if case.trace is None and (case.deployment is not None or case.load is not None):
                raise ValueError(f"cases[{i}]: deployment and load apply to a trace")
            for key in ("load", "client_timeout"):  # named here, not by the rlctl eval flags they stand for
                value = getattr(case, key)
                if value is not None and not (math.isfinite(value) and value > 0):
                    raise ValueError(f"cases[{i}].{key} must be a finite number > 0, got {value!r}")
            scenario(cases, case)  # a bad name fails now, naming what it looked for
        labels = [case.label() for case in cases.cases]
        twice = sorted({x for x in labels if labels.count(x) > 1})
        if twice:
            raise ValueError(f"cases: {', '.join(twice)} listed more than once")
    except ValueError as exc:
        raise ScenarioError(str(exc) if str(exc).startswith(str(p)) else f"{p}: {exc}") from None
    return cases


def scenario(cases: Cases, case: Case):
    """The scenario ``case`` runs, as ``rlctl eval`` would build it."""
    return eval_scenario(case.scenario, case.trace, None, None, cases.steps, case.load, case.deployment,
                         say=lambda _: None, client_timeout=case.client_timeout)


def compare(candidates: list[str], references: list[str], cases: Cases, jobs: int = 1, say=print) -> dict:
    """Each candidate against its reference on every case (module docstring); every figure."""
    if not candidates or len(candidates) != len(references):
        raise ValueError(f"give as many candidates as references, paired in order; got {len(candidates)} "
                         f"candidate(s) and {len(references)} reference(s)")
    policies = []  # every file is read before any episode runs
    for side, specs in (("candidate", candidates), ("reference", references)):
        for k, spec in enumerate(specs):
            policy = make_policy(spec)
            policy.name = f"{side} {k}"
            policies.append((policy, is_trained(str(spec))))
    rows = []
    for case in cases.cases:
        sc = scenario(cases, case)
        out = run_evals(policies, sc, cases.episodes, cases.seed, jobs)
        for k in range(len(candidates)):
            c, r = out[f"candidate {k}"], out[f"reference {k}"]
            row = {"case": case.label(), "pair": k, "candidate": c["goodput_tokens_per_s"],
                   "reference": r["goodput_tokens_per_s"],
                   "candidate_ooms": int(sum(e["oom_events"] for e in c["episodes"])),
                   "reference_ooms": int(sum(e["oom_events"] for e in r["episodes"])),
                   "candidate_preemptions": c["preemptions"], "reference_preemptions": r["preemptions"],
                   "candidate_episodes": [e["goodput_tokens_per_s"] for e in c["episodes"]],
                   "reference_episodes": [e["goodput_tokens_per_s"] for e in r["episodes"]]}
            row["ratio"] = _ratio(row["candidate"], row["reference"])
            rows.append(row)
            say(format_row(row))
    by_case = {}
    for case in dict.fromkeys(r["case"] for r in rows):
        # on each seed, each side's mean over the pairs: the episodes the interval resamples
        cs, rs = (np.mean([x[f"{side}_episodes"] for x in rows if x["case"] == case], axis=0)
                  for side in ("candidate", "reference"))
        c, r = float(np.mean(cs)), float(np.mean(rs))
        interval = list(paired_ratio_interval(cs, rs)) if r > 0 else None
        by_case[case] = {"candidate": c, "reference": r, "ratio": _ratio(c, r), "interval_95": interval}
    return {"cases": cases.name, "episodes": cases.episodes, "seeds": [cases.seed, cases.seed + cases.episodes - 1],
            "candidates": list(candidates), "references": list(references), "rows": rows, "by_case": by_case,
            "geometric_mean": _geometric_mean([c["ratio"] for c in by_case.values()]),
            "geometric_mean_by_pair": _geometric_mean([r["ratio"] for r in rows]),
            "candidate_ooms": sum(r["candidate_ooms"] for r in rows),
            "reference_ooms": sum(r["reference_ooms"] for r in rows),
            "left_out": [f"{r['case']} (pair {r['pair']})" for r in rows if r["ratio"] is None]}


def _ratio(candidate: float, reference: float) -> float | None:
    """Candidate over reference goodput; None where the reference has none (nothing to compare with)."""
    return candidate / reference if reference > 0 else None


def _geometric_mean(ratios: list[float | None]) -> float | None:
    ratios = [r for r in ratios if r is not None]
    if not ratios:
        return None
    return 0.0 if min(ratios) == 0 else float(math.exp(np.mean(np.log(ratios))))


def verdict(out: dict, bar: float) -> bool:
    """Whether ``out`` meets ``bar``: the geometric mean over the cases at least the bar, and no more OOMs."""
    g = out["geometric_mean"]
    return g is not None and g >= bar and out["candidate_ooms"] <= out["reference_ooms"]


def format_row(row: dict) -> str:
    ratio = "-" if row["ratio"] is None else f"{row['ratio']:.3f}x"
    return (f"| {row['case']} | {row['pair']} | {row['candidate']:.1f} ({row['candidate_ooms']} OOM) | "
            f"{row['reference']:.1f} ({row['reference_ooms']} OOM) | {ratio} |")


def format_compare(out: dict, bar: float | None = None) -> str:
    """The table of every (case, pair) and the verdict under it."""
    lines = [f"**{out['cases']}**: seeds {out['seeds'][0]}..{out['seeds'][1]}, candidates "
             f"{', '.join(out['candidates'])} against {', '.join(out['references'])}", "",
             "| case | pair | candidate goodput (OOMs) | reference goodput (OOMs) | ratio |", "|---|---|---|---|---|"]
    lines += [format_row(r) for r in out["rows"]]
    lines.append("")
    for case, c in out["by_case"].items():
        ratio = "-" if c["ratio"] is None else f"{c['ratio']:.3f}x"
        if c.get("interval_95"):
            ratio += f"; 95 % interval {c['interval_95'][0]:.3f}x to {c['interval_95'][1]:.3f}x"
        lines.append(f"{case}: {c['candidate']:.1f} against {c['reference']:.1f} ({ratio})")
    g, by_pair = out["geometric_mean"], out["geometric_mean_by_pair"]
    lines += ["", "geometric mean over the cases of the pairs' mean goodput, candidate over reference: "
              + ("-" if g is None else f"{g:.3f}x") + f"; OOMs summed: candidate {out['candidate_ooms']}, "
              f"reference {out['reference_ooms']}; over the (case, pair) ratios: "
              + ("-" if by_pair is None else f"{by_pair:.3f}x")]
    if out["left_out"]:
        lines.append(f"left out (no reference goodput): {', '.join(out['left_out'])}")
    if bar is not None:
        lines.append(f"bar {bar:g}x with no more OOMs: " + (
            "not judged: no case could be compared (every reference got no goodput)" if out["geometric_mean"] is None
            else "met" if verdict(out, bar) else "not met"))
    return "\n".join(lines)
