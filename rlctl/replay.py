"""Replaying requests through the engine at a fixed overcommit factor, and the table it prints."""
from __future__ import annotations

import math
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from engine.checkpoint import load_checkpoint, read_config
from engine.config import EngineConfig, ModelConfig
from engine.engine import Engine
from engine.metrics import summarize
from env.workloads import ReplaySpec, build_requests, read_trace
from env.workloads.request import Request


def bundled_trace(name: str) -> Path:
    """A trace file shipped with the package (see env/workloads/data/README.md)."""
    return Path(str(resources.files("env.workloads") / "data" / name))


@dataclass(frozen=True)
class Deployment:
    """The engine a replay runs: model, KV capacity and scheduling limits."""

    num_blocks: int = 640  # ~10k tokens of KV: a 7B fp16 model on a 24 GB GPU, the seed's memory-bound case
    block_size: int = 16
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    max_model_len: int = 8192
    restart_downtime_s: float = 10.0
    ttft_slo_s: float | None = None
    tpot_slo_s: float | None = None
    model_dir: str | None = None
    device: str = "cpu"
    seed: int = 0


def build_engine(dep: Deployment, overcommit: float, oom_mode: str) -> Engine:
    """An engine for ``dep`` whose overcommit range admits ``overcommit`` (a static policy)."""
    if dep.model_dir:
        model = load_checkpoint(dep.model_dir, device=dep.device)
        mcfg = model.config
    else:
        model, mcfg = None, ModelConfig()
    cfg = EngineConfig(
        block_size=dep.block_size, num_blocks=dep.num_blocks, max_num_seqs=dep.max_num_seqs,
        max_num_batched_tokens=dep.max_num_batched_tokens, max_model_len=min(dep.max_model_len, mcfg.max_position),
        oom_mode=oom_mode, restart_downtime_s=dep.restart_downtime_s, overcommit=overcommit,
        overcommit_min=min(1.0, overcommit), overcommit_max=max(2.0, overcommit),
        ttft_slo_s=dep.ttft_slo_s, tpot_slo_s=dep.tpot_slo_s, seed=dep.seed)
    return Engine(mcfg, cfg, model=model, torch_device=dep.device)


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
        return f"{summary['swap_out_blocks']}/{summary['swap_in_blocks']}"
    value = summary.get(key)
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{1000 * value:.2f}" if fmt == "ms" else fmt.format(value)


def format_table(columns: dict[str, dict]) -> str:
    """A plain-text table: one row per figure, one column per run."""
    names = list(columns)
    width = max(len(r[0]) for r in ROWS)
    cols = [max(12, len(n)) for n in names]
    lines = [" " * width + "  " + "  ".join(n.rjust(w) for n, w in zip(names, cols))]
    for label, key, fmt in ROWS:
        cells = [_cell(columns[n], key, fmt).rjust(w) for n, w in zip(names, cols)]
        lines.append(label.ljust(width) + "  " + "  ".join(cells))
    return "\n".join(lines)
