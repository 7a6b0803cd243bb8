"""Running out of device memory anywhere the engine allocates is an engine event, never a dead process.

A CUDA device raises ``torch.OutOfMemoryError`` from whichever allocation finds no memory: the
KV pool's growth, an iteration's workspace or activations, compaction's copy, a swap out or in.
This machine has no GPU, so ``FaultyDevice`` plays one: it raises exactly that error from the
next allocation at a chosen site, and the engine must record an OOM event there, take its OOM
path (crash or preempt), leak no block or byte, and still serve every request to the same tokens.
"""
from __future__ import annotations

from contextlib import contextmanager

import pytest
import torch

from engine.config import EngineConfig, ModelConfig, max_model_len, memory_plan
from engine.cost_model import CostModel
from engine.device import Device, DeviceOOM
from engine.engine import Engine
from engine.executor import ProfiledExecutor
from engine.request import Request
from tests.test_kv_invariants import check_engine_books

COST = CostModel(fixed_s=1e-3, per_token_s=1e-5, per_context_token_s=1e-7, copy_fixed_s=1e-5, copy_bytes_per_s=1e9)
SOURCES = {"kv": "kv pool growth", "workspace": "iteration workspace", "forward": "iteration activations",
           "compaction": "compaction", "swap out": "swap out", "swap in": "swap in"}


class FaultyDevice(Device):
    """A CPU budget device whose next ``times`` allocations at ``site`` (once ``arm``-ed) fail as
    CUDA's do: ``torch.OutOfMemoryError`` (the workspace, a ledger charge, with ``DeviceOOM``)."""

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity, "cpu")
        self.site, self.left, self.fired = None, 0, 0

    def arm(self, site: str, times: int = 1) -> None:
        self.site, self.left = site, times

    def _fire(self, site: str) -> bool:
        if site == self.site and self.left > 0:
            self.left -= 1
            self.fired += 1
            return True
        return False

    @contextmanager
    def allocating(self, site: str):
        with super().allocating(site):
            if self._fire(site):
                raise torch.OutOfMemoryError(f"CUDA out of memory (injected at {site})")
            yield

    def charge(self, kind: str, nbytes: int) -> None:
        if kind == "workspace" and self._fire(kind):
            raise DeviceOOM(kind, nbytes, self.free)
        super().charge(kind, nbytes)


def requests() -> list[Request]:
    lengths = [(24, 60), (40, 19), (16, 75), (52, 33), (30, 46), (20, 64)]
    return [Request(f"r{i}", 0.0, p, o, o) for i, (p, o) in enumerate(lengths)]


def engine(mode: str, device: Device | None = None) -> Engine:
    mc, cfg = ModelConfig(), EngineConfig(num_blocks=48, segment_blocks=2, max_num_seqs=8, max_num_batched_tokens=128,
                                         max_model_len=768, oom_mode=mode, restart_downtime_s=0.5, seed=3)
    executor = ProfiledExecutor(COST, materialize=True)
    if device is None:  # the engine's own plan: its executor's largest workspace
        workspace = executor.max_workspace_bytes(mc, cfg, max_model_len(mc, cfg))
        device = FaultyDevice(memory_plan(mc, cfg, workspace=workspace).total)
    eng = Engine(mc, cfg, executor=executor, device=device, keep_outputs=True)
    for r in requests():
        eng.submit(r)
    return eng


@pytest.fixture(scope="module")
def reference() -> dict[str, list[int]]:
    eng = engine("crash")
    while eng.step():
        pass
    return eng.outputs


def reach(eng: Engine, site: str) -> None:
    """Step until the engine is where ``site`` allocates, arm the fault, and make it allocate."""
    dev: FaultyDevice = eng.device
    if site == "compaction":
        while eng.kv.blocks.holes() == 0:
            assert eng.step(), "no hole to compact"
        dev.arm(site)
        eng.compact()
    elif site == "swap out":
        for _ in range(6):
            eng.step()
        dev.arm(site)
        eng.evict(0.9)
    elif site == "swap in":
        for _ in range(6):
            eng.step()
        assert eng.evict(0.9).sequences > 0
        dev.arm(site)
    elif site == "kv":  # the pool cannot grow: admissions wait, and the first sequence to need a block OOMs
        for _ in range(3):
            eng.step()
        eng.compact()  # the pool gives back its free tail, so decoding soon needs a new segment
        dev.arm(site, times=10**6)
        for _ in range(2000):
            if eng.ooms:
                dev.arm(site, times=0)
                return
            assert eng.step(), "the run ended before a running sequence needed the pool to grow"
    else:
        dev.arm(site)
    for _ in range(2000):
        if dev.fired:
            return
        assert eng.step(), f"the run ended before an allocation at {site}"
    raise AssertionError(f"no allocation at {site}")


@pytest.mark.parametrize("mode", ["crash", "preempt"])
@pytest.mark.parametrize("site", list(SOURCES))
def test_an_out_of_memory_error_at_each_allocation_is_an_engine_oom_event(site, mode, reference):
    eng = engine(mode)
    reach(eng, site)
    assert [str(o) for o in eng.ooms][-1].startswith(SOURCES[site] + ": ")
    assert eng.ooms[-1].mode == mode
    if mode == "crash":
        assert eng.counters.oom_events == 1 and eng.down_until is not None
    else:
        assert eng.counters.oom_events == 0
    check_engine_books(eng)  # no block or byte leaked: tables account for every block, ledger = pool
    while eng.step():
        pass
    check_engine_books(eng)
    assert len(eng.completed) == len(requests())
    assert eng.outputs == reference  # every request served, to the same tokens
    assert eng.device.charged["workspace"] == 0
