"""Policies over an episode, drawn: what ``rlctl eval --plot`` writes.

``draw(results, path)`` takes what ``rlctl.evaluate.evaluate`` returns for each policy (its
``series``: one value per environment step, at the step's end on the engine clock) and writes
one PNG of four panels sharing the time axis:

1. KV utilisation (%): the mean over each decision interval;
2. overcommit factor: the factor in force over each interval; ``inf`` (no reservation, the
   vllm baseline) is drawn at ``OVERCOMMIT_CAP``, which the legend says;
3. waiting queue (requests) at the end of each interval;
4. OOM events, cumulative (a step each time one happens, a marker at the interval it fell in),
   and preemptions, cumulative (dashed), where a policy had any.

OOM intervals are also marked by faint vertical lines in the policy's colour on every panel.
matplotlib draws with its Agg canvas directly (no pyplot, no global backend switched).
"""
from __future__ import annotations

import math
from pathlib import Path

OVERCOMMIT_CAP = 4.0  # an infinite (or larger) factor is drawn at this height
REQUIRED = ("time_s", "kv_util", "overcommit", "queue_len", "oom_events")


def _series(name: str, result: dict) -> dict[str, list]:
    """The series of one policy's result, checked: every key present, all of one length."""
    if not isinstance(result, dict) or not isinstance(result.get("series"), dict):
        raise ValueError(f"plot: result of {name!r} has no 'series' (expected what rlctl.evaluate.evaluate returns)")
    series = result["series"]
    missing = [k for k in REQUIRED if k not in series]
    if missing:
        raise ValueError(f"plot: series of {name!r} lacks {', '.join(missing)}")
    lengths = {k: len(series[k]) for k in REQUIRED + ("preemptions",) if k in series}
    if len(set(lengths.values())) != 1:
        raise ValueError(f"plot: series of {name!r} have different lengths: {lengths}")
    if not lengths["time_s"]:
        raise ValueError(f"plot: series of {name!r} is empty (no steps)")
    return series


def _check_path(path: str | Path) -> Path:
    out = Path(path)
    folder = out.parent.resolve()
    if not folder.is_dir():
        raise FileNotFoundError(f"plot: {path}: directory {folder} does not exist")
    if out.is_dir():
        raise ValueError(f"plot: {path}: is a directory, not a file")
    return out


def _steps(t: list[float], y: list[float]) -> tuple[list[float], list[float]]:
    """A value per interval ending at t[i], as a step line from the episode's start (t = 0)."""
    return [0.0, *t], [y[0], *y]


def draw(results: dict[str, dict], path: str | Path, title: str = "") -> None:
    """One PNG at ``path``: KV utilisation, overcommit factor, waiting queue and OOM events over
    engine time, one line per policy. ``results`` maps a policy name to its ``evaluate`` result.

    Raises ``ValueError`` for empty or malformed results and ``FileNotFoundError`` (naming the
    path) when the directory to write in does not exist, before anything is drawn.
    """
    if not results:
        raise ValueError("plot: no results to draw")
    checked = {name: _series(name, r) for name, r in results.items()}
    out = _check_path(path)

    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    fig = Figure(figsize=(10, 10), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    kv, oc, queue, ooms = fig.subplots(4, 1, sharex=True)
    clipped_any = False
    for i, (name, s) in enumerate(checked.items()):
        color = f"C{i % 10}"
        t = [float(x) for x in s["time_s"]]
        x, y = _steps(t, [100.0 * float(v) for v in s["kv_util"]])
        kv.step(x, y, where="pre", color=color, label=name)

        factors = [float(v) for v in s["overcommit"]]
        clipped = any(not math.isfinite(f) or f > OVERCOMMIT_CAP for f in factors)
        clipped_any |= clipped
        x, y = _steps(t, [min(f, OVERCOMMIT_CAP) if not math.isnan(f) else f for f in factors])
        oc.step(x, y, where="pre", color=color,
                label=f"{name} (inf / > {OVERCOMMIT_CAP:g} drawn at {OVERCOMMIT_CAP:g})" if clipped else name)

        queue.plot(t, [int(v) for v in s["queue_len"]], color=color, label=name)

        per_step = [int(v) for v in s["oom_events"]]
        cumulative, total = [], 0
        for n in per_step:
            total += n
            cumulative.append(total)
        ooms.step([0.0, *t], [0, *cumulative], where="post", color=color, label=f"{name}: {total} OOM events")
        hit = [(tt, c) for tt, n, c in zip(t, per_step, cumulative) if n > 0]
        if hit:
            ooms.plot([h[0] for h in hit], [h[1] for h in hit], "v", color=color, markersize=6)
            for ax in (kv, oc, queue):
                for tt, _ in hit:
                    ax.axvline(tt, color=color, alpha=0.25, linewidth=0.8)
        pre = [int(v) for v in s.get("preemptions", [])]
        if pre and pre[-1] > 0:
            ooms.step([0.0, *t], [0, *pre], where="post", color=color, linestyle="--",
                      label=f"{name}: {pre[-1]} preemptions")

    oc.axhline(1.0, color="grey", linestyle=":", linewidth=1, label="1.0: conservative reservation")
    if clipped_any:
        oc.axhline(OVERCOMMIT_CAP, color="grey", linestyle="--", linewidth=0.8)
    kv.set_ylabel("KV utilisation (%)")
    kv.set_ylim(0, 105)
    oc.set_ylabel("overcommit factor (x)")
    oc.set_ylim(0, OVERCOMMIT_CAP * 1.08)
    queue.set_ylabel("waiting queue (requests)")
    queue.set_ylim(bottom=0, top=max(1.0, queue.get_ylim()[1]))
    ooms.set_ylabel("events (cumulative)")
    ooms.set_ylim(bottom=0, top=max(1.0, ooms.get_ylim()[1]))
    for ax in (queue, ooms):
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ooms.set_xlabel("engine time (s)")
    ooms.set_xlim(left=0)
    for ax, what in ((kv, "KV utilisation (mean over each decision interval)"), (oc, "overcommit factor"),
                     (queue, "requests waiting for admission"),
                     (ooms, "OOM events (markers: intervals with one) and preemptions (dashed)")):
        ax.set_title(what, fontsize=9, loc="left")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8, loc="upper left")
    fig.suptitle(title or f"{', '.join(checked)} over an episode")
    try:
        fig.savefig(out, format="png")
    except OSError as exc:
        raise ValueError(f"plot: {path}: cannot be written ({exc.strerror or exc})") from None
