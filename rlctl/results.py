"""``rlctl results``: the controller against every incumbent and the oracle, scenario by scenario.

For each scenario, on its held-out seeds: the trained policies (one per training seed; the table
gives their mean +- std), the lookahead ``oracle``, the peers (``sglang``, ``vllm``), the tuned
fixed factor (the scenario's ``best_static``), also behind the safety shield the trained policies
act behind, ``watermark`` and ``static:1.0``. The best incumbent is the best of those that run the
same engine (the tuned fixed factor, shielded or not, and ``watermark``) on a crashing engine, and
of those, ``vllm`` and ``sglang`` on a preempting one, where ``vllm`` and ``sglang`` are engines of
that kind. The share of headroom a policy
captures is ``(policy - best incumbent) / (oracle - best incumbent)``; where the oracle does no
better than the best incumbent the table says "no headroom". Every policy runs on the same seeds,
so the policy's ratio to the best incumbent comes with a paired bootstrap interval over the
episodes (``paired_ratio_interval``): how far the ratio moves with the episodes drawn. Under the table, each trained
policy's own goodput, SLO attainment and actions an episode, so that a weight that loses can be
read from the same run.
"""
from __future__ import annotations

import numpy as np

from agents.spec import make_policy, static_spec
from env.scenario import Scenario
from rlctl.evaluate import run_evals

FIGURES = ("goodput_tokens_per_s", "oom_events", "preemptions", "kv_util_mean", "ttft_p99_s", "slo_attainment",
           "requests_abandoned")
ACTIONS = ("hold", "scale_up", "back_off", "defrag", "evict")


SHIELDED = " + shield"


def incumbents(scenario: Scenario) -> list[str]:
    """The policies a controller must beat on this scenario's engine (their rows' names). That
    includes the tuned fixed factor behind the safety shield, as ``rlctl serve`` serves it (the
    shield evicts to host before the KV is full, on a preempting engine too): the trained policy
    acts behind that shield, so a fixed factor is given it too."""
    tuned = static_spec(scenario.best_static)
    same_engine = [tuned, tuned + SHIELDED, "watermark"]
    return same_engine if scenario.engine_config().oom_mode == "crash" else same_engine + ["vllm", "sglang"]


def share(policy: float, incumbent: float, oracle: float) -> float | None:
    """The share of the oracle's headroom over the best incumbent that ``policy`` captures."""
    return None if oracle <= incumbent else (policy - incumbent) / (oracle - incumbent)


def paired_ratio_interval(policy, reference, level: float = 0.95, draws: int = 4000,
                          seed: int = 0) -> tuple[float, float]:
    """The ``level`` interval of ``mean(policy) / mean(reference)`` over episodes run on the same
    seeds (``policy[k]`` and ``reference[k]`` on seed k), by a paired bootstrap: ``draws``
    resamples of the episodes with replacement, each pair kept together, and the percentiles of
    the ratio over them. Fixed ``seed``: the same figures give the same interval."""
    p, r = np.asarray(policy, dtype=float), np.asarray(reference, dtype=float)
    if p.shape != r.shape or p.ndim != 1 or len(p) == 0:
        raise ValueError(f"paired episodes: need two equal, non-empty lists, got {p.shape} and {r.shape}")
    if not 0 < level < 1:
        raise ValueError(f"interval level must be in (0, 1), got {level}")
    picks = np.random.default_rng(seed).integers(0, len(p), size=(draws, len(p)))
    num, den = p[picks].mean(axis=1), r[picks].mean(axis=1)
    ratios = np.divide(num, den, out=np.full(draws, np.nan), where=den > 0)
    ratios = ratios[np.isfinite(ratios)]
    if not len(ratios):
        raise ValueError("paired episodes: the reference has no goodput in any resample")
    tail = 100 * (1 - level) / 2
    return float(np.percentile(ratios, tail)), float(np.percentile(ratios, 100 - tail))


def results(scenario: Scenario, policy_files: list[str], episodes: int, seed: int, oracle: bool = True,
            jobs: int = 1) -> dict:
    tuned = static_spec(scenario.best_static)
    specs = [static_spec(1.0), tuned, "watermark", "vllm", "sglang"] + (["oracle"] if oracle else [])
    entries = [(make_policy(s), False) for s in dict.fromkeys(specs)]
    shielded = make_policy(tuned)
    shielded.name += SHIELDED
    trained = [make_policy(p) for p in policy_files]
    for k, policy in enumerate(trained):  # a row each, whatever the files are called
        policy.name = f"dqn {k}"
    baseline = run_evals(entries + [(shielded, True)] + [(p, True) for p in trained], scenario, episodes, seed, jobs)
    dqn = [baseline.pop(p.name) for p in trained]
    rows = {"dqn": {k: [d[k] for d in dqn] for k in FIGURES}}
    # each weight's actions an episode, in the order of ``policies`` (a file given twice is two weights)
    actions = [{a: float(np.mean([e["actions"].get(a, 0) for e in d["episodes"]])) for a in ACTIONS} for d in dqn]
    for name, r in baseline.items():
        rows[name] = {k: [r[k]] for k in FIGURES}
    best = max(incumbents(scenario), key=lambda n: baseline[n]["goodput_tokens_per_s"])
    config = scenario.engine_config()
    out = {"scenario": scenario.name, "oom_mode": config.oom_mode, "client_timeout_s": config.client_timeout_s,
           "best_incumbent": best,
           "rows": rows, "seeds": [seed, seed + episodes - 1], "policies": list(policy_files),
           "dqn_actions": actions}
    if oracle:
        inc, orc = baseline[best]["goodput_tokens_per_s"], baseline["oracle"]["goodput_tokens_per_s"]
        out["share_of_headroom"] = {n: share(float(np.mean(r["goodput_tokens_per_s"])), inc, orc)
                                    for n, r in rows.items()}
    g = float(np.mean(rows["dqn"]["goodput_tokens_per_s"]))
    out["dqn_over"] = {n: g / baseline[n]["goodput_tokens_per_s"] if baseline[n]["goodput_tokens_per_s"] else None
                       for n in baseline}
    # the policy's goodput on each seed (the mean over its weights) against the best incumbent's
    per_seed = np.mean([[e["goodput_tokens_per_s"] for e in d["episodes"]] for d in dqn], axis=0)
    ref = [e["goodput_tokens_per_s"] for e in baseline[best]["episodes"]]
    ratio = out["dqn_over"][best]
    out["dqn_over_best"] = {"ratio": ratio, "episodes": len(ref),
                            "interval_95": None if ratio is None else list(paired_ratio_interval(per_seed, ref))}
    return out


def _cell(values: list, pct: bool = False, digits: int = 1) -> str:
    values = [v for v in values if v is not None]
    if not values:
        return "-"
    scale = 100 if pct else 1
    mean = scale * float(np.mean(values))
    return f"{mean:.{digits}f}" + (f" +- {scale * float(np.std(values)):.{digits}f}" if len(values) > 1 else "")


def format_results(out: dict) -> str:
    """One markdown table: a row per policy. OOMs an episode have two digits, so that one OOM in
    the 30 episodes of three training seeds x ten episodes shows (0.03), where one would round it away.
    Where clients give up (``client_timeout_s``), a column counts the requests they gave up an episode."""
    timeout = out.get("client_timeout_s")
    gives_up = f"; clients giving up at {timeout:g} s" if timeout is not None else ""
    head = f"**{out['scenario']}** ({out['oom_mode']}{gives_up}; best incumbent {out['best_incumbent']})"
    extra = " given up |" if timeout is not None else ""
    lines = [head, "", "| policy | goodput tok/s | OOMs | preemptions | KV util % | TTFT p99 s | SLO attained % | share of headroom |"
             + extra, "|---|---|---|---|---|---|---|---|" + ("---|" if extra else "")]
    shares = out.get("share_of_headroom", {})
    for name, r in out["rows"].items():
        s = shares.get(name)
        cell = "no headroom" if "share_of_headroom" in out and s is None else ("-" if s is None else f"{s:.2f}")
        lines.append(f"| {name} | {_cell(r['goodput_tokens_per_s'])} | {_cell(r['oom_events'], digits=2)} | "
                     f"{_cell(r['preemptions'], digits=0)} | {_cell(r['kv_util_mean'], pct=True)} | "
                     f"{_cell(r['ttft_p99_s'])} | {_cell(r['slo_attainment'], pct=True)} | {cell} |"
                     + (f" {_cell(r['requests_abandoned'], digits=0)} |" if extra else ""))
    over = ", ".join(f"{n} {x:.2f}x" for n, x in out["dqn_over"].items() if x is not None)
    lines += ["", f"dqn's goodput over: {over or '- (no incumbent has goodput)'}"]
    vs = out.get("dqn_over_best")
    if vs and vs["interval_95"]:
        lo, hi = vs["interval_95"]
        lines.append(f"dqn over the best incumbent ({out['best_incumbent']}): {vs['ratio']:.3f}x, 95 % interval "
                     f"{lo:.3f}x to {hi:.3f}x (paired bootstrap over its {vs['episodes']} episodes)")
    for k, (f, acts) in enumerate(zip(out.get("policies", []), out.get("dqn_actions", []))):
        by_weight = ", ".join(f"{v:.0f} {a}" for a, v in acts.items())
        goodput, slo = out["rows"]["dqn"]["goodput_tokens_per_s"][k], out["rows"]["dqn"]["slo_attainment"][k]
        lines.append(f"dqn {k} ({f}): {goodput:.1f} tok/s, SLO {_cell([slo], pct=True)} %; "
                     f"actions an episode: {by_weight}")
    return "\n".join(lines)
