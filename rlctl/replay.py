"""Replaying requests through the engine at a fixed overcommit factor."""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from engine.checkpoint import declared_kv_cache_dtype, load_checkpoint
from engine.config import EngineConfig, ModelConfig
from engine.engine import Engine
from engine.executor import ProfiledExecutor
from engine.metrics import summarize
from env.workload_builder import load_trace
from env.workloads import ReplaySpec, TraceError, build_requests
from engine.request import Request


# The replay default: ~10k tokens of KV (640 blocks x 16), what a 7B fp16 model has on a 24 GB
# GPU: memory-bound on Azure-like traffic, the seed deployment's case (see docs/design.md).
DEFAULT_ENGINE = EngineConfig(num_blocks=640)


def build_engine(cfg: EngineConfig, overcommit: float, oom_mode: str, model_dir: str | None = None,
                 device: str = "cpu", executor: ProfiledExecutor | None = None,
                 kv_cache_dtype: str | None = None) -> Engine:
    """An engine on ``cfg`` running a static policy: ``overcommit`` fixed (its range widened to
    admit it), ``oom_mode`` semantics, the tiny seeded model or the checkpoint in ``model_dir``, its KV
    held in ``kv_cache_dtype`` (``ModelConfig.kv_cache_dtype``; None: the one the checkpoint declares, as
    vLLM holds it, else the model's), timed by ``executor`` (default: the torch executor's measured time)."""
    model = load_checkpoint(model_dir, device=device) if model_dir else None
    cfg = replace(cfg, oom_mode=oom_mode).pinned(overcommit)
    if kv_cache_dtype is None:
        declared = declared_kv_cache_dtype(model_dir) if model_dir else None
        kv_cache_dtype = declared if declared and not model.config.kv_lora_rank else "auto"
    model_config = replace(model.config if model else ModelConfig(), kv_cache_dtype=kv_cache_dtype)
    return Engine(model_config, cfg, model=model, torch_device=device, executor=executor)


def load_requests(trace: str | Path, spec: ReplaySpec) -> list[Request]:
    """The requests a replay's window holds (``trace``: a file, or a bundled trace by name); a window that
    starts after the trace's last record is refused, where a scenario's drawn window may simply be empty."""
    records = load_trace(str(trace))
    requests = build_requests(records, spec)
    if not requests and records.has_arrivals and spec.start_s > records.last_arrival_s:
        raise TraceError(records.path, f"the window starts at {spec.start_s:g} s of trace time, after the "
                                       f"trace's last arrival ({records.last_arrival_s:g} s)")
    return requests


def replay(requests: list[Request], engine: Engine, duration_s: float | None = None) -> dict:
    """Run every request to completion (or until ``duration_s`` of engine time) and summarise."""
    for r in requests:
        engine.submit(r)
    engine.run(until=duration_s)
    return summarize(engine)
