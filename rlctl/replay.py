"""Replaying requests through the engine at a fixed overcommit factor, and the table it prints."""
from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

from engine.checkpoint import load_checkpoint
from engine.config import EngineConfig, ModelConfig
from engine.engine import Engine
from engine.executor import ProfiledExecutor
from engine.metrics import summarize
from env.workloads import ReplaySpec, build_requests, read_trace
from env.workloads.request import Request


# The replay default: ~10k tokens of KV (640 blocks x 16), what a 7B fp16 model has on a 24 GB
# GPU: memory-bound on Azure-like traffic, the seed deployment's case (see DESIGN.md).
DEFAULT_ENGINE = EngineConfig(num_blocks=640)


def build_engine(cfg: EngineConfig, overcommit: float, oom_mode: str, model_dir: str | None = None,
                 device: str = "cpu", executor: ProfiledExecutor | None = None) -> Engine:
    """An engine on ``cfg`` running a static policy: ``overcommit`` fixed (its range widened to
    admit it), ``oom_mode`` semantics, the tiny seeded model or the checkpoint in ``model_dir``,
    timed by ``executor`` (default: the torch executor's measured time)."""
    model = load_checkpoint(model_dir, device=device) if model_dir else None
    cfg = replace(cfg, overcommit=overcommit, oom_mode=oom_mode, overcommit_min=min(cfg.overcommit_min, overcommit),
                  overcommit_max=max(cfg.overcommit_max, overcommit))
    return Engine(model.config if model else ModelConfig(), cfg, model=model, torch_device=device, executor=executor)


def load_requests(trace: str | Path, spec: ReplaySpec) -> list[Request]:
    return build_requests(read_trace(trace), spec)


def replay(requests: list[Request], engine: Engine, duration_s: float | None = None) -> dict:
    """Run every request to completion (or until ``duration_s`` of engine time) and summarise."""
    for r in requests:
        engine.submit(r)
    engine.run(until=duration_s)
    return summarize(engine)


ROWS = [
    ("requests completed", "requests_completed", "{:.0f}"),
    ("goodput (tok/s)", "goodput_tokens_per_s", "{:.1f}"),
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
