"""``rlctl sweep``: what a scenario asks of a controller, measured before anyone trains on it.

Every fixed factor of a multiplicative grid up to the scenario's ``overcommit_max``, the rules
(``watermark``), the peers (``vllm``, ``sglang``) and the lookahead ``oracle`` on the same
training seeds, and the verdicts docs/design.md asks of a scenario that needs control:

- memory-bound: ``vllm`` keeps the KV >= 80 % used, and ``static:1.0`` gets <= 0.85x the best
  goodput;
- the best fixed factor (the scenario's ``best_static``, the tuned ``static:K`` baseline);
- where the oracle finds headroom over the best incumbent that runs the same engine;
- for a workload in phases, the best fixed factor of each phase on its own: if they differ, the
  right setting moves (non-stationary).

The result is JSON (``--json``) and one table; experiments/sweeps/ keeps each scenario's.
"""
from __future__ import annotations

import dataclasses

from agents.spec import make_policy, static_sweep
from env.scenario import PhasedWorkload, Scenario
from rlctl.evaluate import run_eval

MEMORY_BOUND_UTIL = 0.80   # vllm's mean KV utilisation at least this
CONSERVATIVE_SHARE = 0.85  # static:1.0's goodput at most this share of the best


def _best(results: dict[str, dict], names: list[str]) -> str:
    return max(names, key=lambda n: results[n]["goodput_tokens_per_s"])


def sweep(scenario: Scenario, episodes: int, seed: int, oracle: bool = True, phases: bool = True,
          jobs: int = 1) -> dict:
    """The sweep of ``scenario`` on seeds ``seed``.. (see the module docstring)."""
    statics = static_sweep(scenario.engine_config().overcommit_max)
    specs = statics + ["watermark", "vllm", "sglang"] + (["oracle"] if oracle else [])
    policies = [make_policy(s) for s in specs]
    results = run_eval(policies, scenario, episodes, seed, shield=False, jobs=jobs)
    static_names = [make_policy(s).name for s in statics]
    best_static = _best(results, static_names)
    everyone = list(results)
    best = _best(results, everyone)
    same_engine = [n for n in static_names + ["watermark"]]
    incumbent = _best(results, same_engine if scenario.engine_config().oom_mode == "crash"
                      else same_engine + ["vllm", "sglang"])
    g = {n: results[n]["goodput_tokens_per_s"] for n in results}
    verdict = {
        "best_static": results[best_static]["policy"],
        "best_static_factor": float(results[best_static]["policy"].split(":")[1]),
        "best_policy": best,
        "best_incumbent": incumbent,
        "vllm_kv_util": results["vllm"]["kv_util_mean"],
        "static1_share_of_best": g[static_names[0]] / g[best] if g[best] > 0 else None,
    }
    verdict["memory_bound"] = (verdict["vllm_kv_util"] >= MEMORY_BOUND_UTIL
                               and (verdict["static1_share_of_best"] or 1.0) <= CONSERVATIVE_SHARE)
    if oracle:
        verdict["oracle_over_incumbent"] = g["oracle"] / g[incumbent] if g[incumbent] > 0 else None
    out = {"scenario": scenario.name, "episodes": episodes, "seeds": [seed, seed + episodes - 1], "verdict": verdict,
           "results": {n: {k: v for k, v in r.items() if k not in ("episodes", "series")} for n, r in results.items()}}
    if phases and isinstance(scenario.workload, PhasedWorkload):
        out["phases"] = {}
        for p in scenario.workload.phases:
            alone = dataclasses.replace(scenario, workload=dataclasses.replace(scenario.workload, phases=(p,)),
                                        name=f"{scenario.name}[{p.name}]")
            r = run_eval([make_policy(s) for s in statics], alone, episodes, seed, shield=False, jobs=jobs)
            out["phases"][p.name] = {"best_static": _best(r, list(r)),
                                     "goodput": {n: x["goodput_tokens_per_s"] for n, x in r.items()},
                                     "oom_events": {n: x["oom_events"] for n, x in r.items()}}
        bests = {v["best_static"] for v in out["phases"].values()}
        verdict["best_static_moves_between_phases"] = len(bests) > 1
    return out


def format_sweep(out: dict) -> str:
    v = out["verdict"]
    lines = [f"sweep of {out['scenario']}, seeds {out['seeds'][0]}..{out['seeds'][1]}:",
             f"{'policy':<12} {'goodput':>9} {'OOMs':>6} {'preempt':>8} {'KV util':>8}"]
    for name, r in out["results"].items():
        lines.append(f"{name:<12} {r['goodput_tokens_per_s']:>9.1f} {r['oom_events']:>6.1f} {r['preemptions']:>8.0f} "
                     f"{100 * r['kv_util_mean']:>7.1f}%")
    lines.append(f"best fixed factor: {v['best_static']}; best policy: {v['best_policy']}; best incumbent: "
                 f"{v['best_incumbent']}")
    share = v["static1_share_of_best"]
    share = "no policy has goodput" if share is None else f"static:1.0 gets {share:.2f}x the best goodput"
    lines.append(f"memory-bound: {v['memory_bound']} (vllm keeps the KV {100 * v['vllm_kv_util']:.0f} % used; {share})")
    if "oracle_over_incumbent" in v:
        over = v["oracle_over_incumbent"]
        lines.append("oracle / best incumbent: " + ("- (the best incumbent has no goodput)" if over is None
                                                    else f"{over:.2f}x"))
    for name, p in out.get("phases", {}).items():
        lines.append(f"phase {name} alone: best fixed factor {p['best_static']}")
    if "best_static_moves_between_phases" in v:
        lines.append(f"the best fixed factor moves between phases: {v['best_static_moves_between_phases']}")
    return "\n".join(lines)
