"""The plain-text tables rlctl prints: one row per figure, one column per run or policy."""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from rlctl.online.engine_metrics import FALLBACK_REASONS

ROWS = [
    ("requests completed", "requests_completed", "{:.0f}"),
    ("goodput (tok/s)", "goodput_tokens_per_s", "{:.1f}"),
    ("on-time tok/s", "ontime_tokens_per_s", "{:.1f}"),
    ("SLO attained", "slo_attainment", "{:.1%}"),
    ("tokens/s", "tokens_per_s", "{:.1f}"),
    ("KV util mean", "kv_util_mean", "{:.1%}"),
    ("KV util p99", "kv_util_p99", "{:.1%}"),
    ("OOM events", "oom_events", "{:.0f}"),
    ("preemptions", "preemptions", "{:.0f}"),
    ("swap out/in (blocks)", None, None),
    ("TTFT p50 (s)", "ttft_p50_s", "{:.3f}"),
    ("TTFT p99 (s)", "ttft_p99_s", "{:.3f}"),
    ("TPOT p50 (ms)", "tpot_p50_s", "ms"),
    ("TPOT p99 (ms)", "tpot_p99_s", "ms"),
    ("engine time (s)", "duration_s", "{:.1f}"),
]


def _cell(summary: dict, key: str | None, fmt: str | None) -> str:
    if key is None:
        return f"{summary['swap_out_blocks']:.0f}/{summary['swap_in_blocks']:.0f}"
    value = summary.get(key)
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{1000 * value:.2f}" if fmt == "ms" else fmt.format(value)


def format_table(columns: dict[str, dict], extra_rows: list | None = None) -> str:
    """A plain-text table: one row per figure, one column per run."""
    rows = ROWS + list(extra_rows or [])
    names = list(columns)
    width = max(len(r[0]) for r in rows)
    cols = [max(12, len(n)) for n in names]
    lines = [" " * width + "  " + "  ".join(n.rjust(w) for n, w in zip(names, cols))]
    for label, key, fmt in rows:
        cells = [_cell(columns[n], key, fmt).rjust(w) for n, w in zip(names, cols)]
        lines.append(label.ljust(width) + "  " + "  ".join(cells))
    return "\n".join(lines)

SLO_OUT_OF_REACH = 0.1  # below this share of finished requests meeting the SLO for every policy, goodput ranks noise


def slo_note(results: dict[str, dict], ttft_slo_s: float | None, tpot_slo_s: float | None) -> str | None:
    """A line saying that no policy of ``results`` gets ``SLO_OUT_OF_REACH`` of its finished
    requests within the SLO (the deployment does not serve this workload within it, whatever they
    admit), or None: goodput, which counts only those requests, then ranks next to nothing."""
    if ttft_slo_s is None and tpot_slo_s is None:
        return None
    best = [r.get("slo_attainment") for r in results.values()]
    if any(b is None or b >= SLO_OUT_OF_REACH for b in best):
        return None
    slo = ", ".join(f"{name} <= {value:g} s" for name, value in (("TTFT", ttft_slo_s), ("TPOT", tpot_slo_s))
                    if value is not None)
    return (f"note: no policy finishes {SLO_OUT_OF_REACH:.0%} of its requests within the SLO ({slo}; best "
            f"{max(best):.1%}): at this load the deployment does not serve this workload within its SLO, "
            "whatever these policies admit, so goodput says little here; compare TTFT and TPOT "
            "(a trace: try a lower --load)")


BACKLOG_SHARE = 0.1  # every policy ending with this share of its requests waiting past the TTFT target: a growing queue


def backlog_note(results: dict[str, dict]) -> str | None:
    """A line saying that every policy of ``results`` ends its episodes with at least
    ``BACKLOG_SHARE`` of the requests submitted still waiting past the TTFT target, or None. The
    workload then asks more than the deployment serves under any of them: the queue grows through
    the episode, and goodput measures which requests an engine that admits the oldest first still
    serves on time, not a steady state. Where clients gave up requests under every policy
    (``client_timeout_s``) the queue cannot grow for ever, and there is no note."""
    keys = ("requests_submitted", "requests_waiting", "requests_waiting_late")
    if not results or any(r.get(k) is None for r in results.values() for k in keys):
        return None  # figures from before these were kept, or a run that keeps none
    if all(r.get("requests_abandoned", 0) > 0 for r in results.values()):
        return None
    if min(r["requests_waiting_late"] / r["requests_submitted"] if r["requests_submitted"] else 0.0
           for r in results.values()) < BACKLOG_SHARE:
        return None
    ends = ", ".join(f"{name} {r['requests_waiting']:.0f} ({r['requests_waiting_late']:.0f})" for name, r in results.items())
    return (f"note: every policy ends its episodes with requests waiting past the TTFT target (mean waiting, "
            f"of them late: {ends}; of {max(r['requests_submitted'] for r in results.values()):.0f} submitted): "
            "the workload asks more than the deployment serves under any of them, so goodput here measures "
            "which requests are still served on time while the queue grows, not a steady state; it counts none of "
            "the work still under way at the end, which on-time tok/s counts where it is on track for its SLO")


EVAL_ROWS = [
    ("shield overrides", "shield_overrides", "{:.0f}"),
    ("episode reward", "episode_reward", "{:.1f}"),
]
# where clients give up (EngineConfig.client_timeout_s): the requests they gave up before a first token
ABANDONED_ROW = ("given up by clients", "requests_abandoned", "{:.0f}")
PREFIX_ROW = ("prefix cache hit rate", "prefix_cache_hit_rate", "{:.1%}")  # rlctl replay --prefix-caching

# rows rlctl replay adds to its table when a sidecar steers the engine
LIVE_ROWS = [("controller decisions", "controller_decisions", "{:.0f}")] + [
    (f"fallbacks: {r}", f"fallbacks_{r}", "{:.0f}") for r in FALLBACK_REASONS] + [
    ("reconnects", "reconnects", "{:.0f}"),
    ("shield overrides", "shield_overrides", "{:.0f}")]

def format_actuators(figures: dict) -> str:
    """The last report of each actuator and how many changed something, one line each."""
    lines = ["actuators (last report; reports that changed something):"]
    for name, r in figures["actuators"].items():
        lines.append(f"  {name} ({figures['actuator_changes'].get(name, 0)}): "
                     f"{'applied' if r['applied'] else 'not applied'}: {r['detail']}")
    return "\n".join(lines)


def _spread(values: list) -> dict:
    """Mean and std over the runs that have the figure (None where a run has none: no request got a
    first token, so it has no TTFT); ``runs`` counts them."""
    have = [v for v in values if v is not None]
    return {"mean": float(np.mean(have)) if have else None, "std": float(np.std(have)) if have else None,
            "runs": len(have), "values": values}


def compare(runs: list[tuple[str, object, dict]]) -> tuple[str, dict]:
    """One row per config: the held-out figures of its runs, mean +- std over seeds, and the
    baselines of the first run (the same held-out episodes for every run). A config's row and its
    key in the figures are ``dqn NAME``, the name its file's, or its path where two share a name."""
    keys = ("goodput_tokens_per_s", "tokens_per_s", "kv_util_mean", "kv_util_p99", "oom_events", "ttft_p99_s",
            "episode_reward")
    rows, data = [], {}
    paths = list(dict.fromkeys(str(p) for p, _, _ in runs))
    stems = [Path(p).stem for p in paths]
    for path, stem in zip(paths, stems):  # a config by its name, or by its path where two share the name
        label = f"dqn {stem if stems.count(stem) == 1 else str(Path(path).with_suffix(''))}"
        mine = [(cfg, out) for p, cfg, out in runs if str(p) == path]
        figures = {k: [out["results"]["dqn"][k] for _, out in mine] for k in keys}
        seeds = [cfg.seed for cfg, _ in mine]
        data[label] = {"config": path, "seeds": seeds, "runs": [out["run"] for _, out in mine],
                       **{k: _spread(v) for k, v in figures.items()}}
        rows.append((label, f"{','.join(map(str, seeds))}", figures))
    first = runs[0][2]["results"]
    for name, r in first.items():
        if name != "dqn":
            rows.append((name, "-", {k: [r[k]] for k in keys}))
            data[name] = {k: r[k] for k in keys}

    def cell(values: list, pct: bool = False) -> str:
        spread, scale = _spread(values), 100 if pct else 1
        if spread["mean"] is None:
            return "-"  # no run has the figure (a TTFT where no request got its first token)
        return f"{scale * spread['mean']:.1f}" + (f" +- {scale * spread['std']:.1f}" if spread["runs"] > 1 else "")

    header = ["policy", "seeds", "goodput tok/s", "tokens/s", "KV util %", "KV p99 %", "OOMs", "TTFT p99 s", "reward"]
    lines = [header]
    for name, seeds, f in rows:
        lines.append([name, seeds, cell(f["goodput_tokens_per_s"]), cell(f["tokens_per_s"]),
                      cell(f["kv_util_mean"], True), cell(f["kv_util_p99"], True), cell(f["oom_events"]),
                      cell(f["ttft_p99_s"]), cell(f["episode_reward"])])
    widths = [max(len(r[i]) for r in lines) for i in range(len(header))]
    text = "\n".join("  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
                     for r in lines)
    return text, data
