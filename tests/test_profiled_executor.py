"""The profiled executor is the same engine: given the torch executor's measured durations it
keeps exactly the same books (admission, completion order, block counts, OOM events) without
running the model or holding a single KV tensor."""
from __future__ import annotations

import pytest

from engine.config import EngineConfig, ModelConfig
from engine.engine import Engine
from engine.executor import ProfiledExecutor, TorchExecutor
from engine.request import Request
from engine.roofline import DEPLOYMENTS
from engine.scheduler import BatchShape
from env.workloads import ReplaySpec
from env.workloads import bundled_trace
from rlctl.replay import build_engine, load_requests
from tests.test_overcommit import DEPLOYMENT


class LoggingTorch(TorchExecutor):
    """The torch executor, noting every duration it puts on the engine clock."""

    def __init__(self) -> None:
        self.iterations: list[float] = []
        self.copies: list[float] = []

    def execute(self, work):
        tokens, seconds = super().execute(work)
        self.iterations.append(seconds)
        return tokens, seconds

    def timed(self, fn, link):
        seconds = super().timed(fn, link)
        if seconds:
            self.copies.append(seconds)
        return seconds


class Measured:
    """A cost model that answers with the torch run's measured durations, in order."""

    def __init__(self, log: LoggingTorch) -> None:  # iteration_s(shape) and copy_s alone, as a user's may have
        self.iterations, self.copies = list(log.iterations), list(log.copies)

    def iteration_s(self, shape: BatchShape) -> float:
        return self.iterations.pop(0)

    def copy_s(self, nbytes: int, link: str = "device") -> float:
        return self.copies.pop(0) if nbytes else 0.0


def books(executor):
    """Replay a burst of the Azure trace at overcommit 3.0 (OOMs), with a compaction and an
    eviction forced on the way; everything the engine decided, in order."""
    engine = build_engine(DEPLOYMENT, 3.0, "crash", executor=executor)
    admitted = []
    attach = engine.sessions.attach

    def noting(seq):
        admitted.append((seq.id, engine.clock))
        attach(seq)

    engine.sessions.attach = noting
    spec = ReplaySpec(max_tokens="fixed:1024", time_scale=1000.0, duration_s=20.0, max_model_len=2048)
    for r in load_requests(bundled_trace("azure2023_conv.csv"), spec):
        engine.submit(r)
    steps, evicted = 0, False
    while engine.step():
        steps += 1
        if steps == 40:
            engine.compact()
        if steps >= 80 and not evicted and engine.scheduler.running:
            evicted = engine.evict(0.95).blocks > 0
    return {
        "admitted": admitted,
        "completed": [(r.request_id, r.first_token_s, r.finish_s, r.output_len, r.restarts) for r in engine.completed],
        "iterations": [(it.end_s, it.decode_tokens, it.prefill_tokens, it.alloc_ratio) for it in engine.iterations],
        "counters": engine.counters,
        "swaps": engine.kv.traffic,
        "materialized": engine.pool.footprint_bytes() if executor.materialize else None,
    }


def test_given_the_torch_durations_the_profiled_executor_keeps_identical_books():
    torch_log = LoggingTorch()
    real = books(torch_log)
    measured = Measured(torch_log)
    profiled = books(ProfiledExecutor(measured, materialize=False))
    assert real["counters"].oom_events > 0 and real["counters"].compactions == 1 and real["swaps"].out_blocks > 0
    assert not measured.iterations and not measured.copies  # every measured duration used, in order
    for key in ("admitted", "completed", "iterations", "counters", "swaps"):
        assert profiled[key] == real[key], key


def test_the_roofline_clock_is_a_model_of_the_datasheet():
    d = DEPLOYMENTS["llama70b-4bit-h100"]
    c = d.cost_model()
    decode = c.iteration_s(BatchShape(1, 1000, 1000))
    # one decode reads the weights once: bounded below by weight bytes over the bandwidth
    assert decode > d.model.weight_bytes() / d.gpu.memory_bytes_per_s
    big = c.iteration_s(BatchShape(256, 256_000, 256_000))
    assert decode < big < 256 * decode  # batching amortises the weight reads
    prefill = c.iteration_s(BatchShape(2048, 2048, 2048 * 2049 // 2))
    assert prefill > 2 * 2048 * d.model.param_count() * 0.9 / d.gpu.peak_flops  # compute-bound
    assert c.copy_s(10**9, "host") > c.copy_s(10**9, "device")  # PCIe is slower than HBM
    assert c.copy_s(0, "host") == 0.0
    for dep in DEPLOYMENTS.values():
        assert dep.num_blocks() * dep.block_size * dep.model.kv_bytes_per_token() < dep.gpu.memory_bytes


def test_a_cost_model_of_ones_own_needs_only_iteration_s_and_copy_s():
    # the interface a user's cost model implements: no window, iteration_s(shape) alone
    class Mine:
        source = "mine"

        def iteration_s(self, shape: BatchShape) -> float:
            return 1e-3 + 1e-6 * shape.context_tokens

        def copy_s(self, nbytes: int, link: str = "device") -> float:
            return 0.0

    eng = Engine(ModelConfig(), EngineConfig(num_blocks=64, max_model_len=512), executor=ProfiledExecutor(Mine()))
    eng.submit(Request("a", 0.0, 10, 5, 5))
    eng.run()
    assert eng.clock == pytest.approx(5e-3 + 1e-6 * (10 + 11 + 12 + 13 + 14))
