"""What the engine and the actuators ask of ``torch.cuda``, checked call by call.

This machine has no GPU, so ``torch.cuda``'s functions are replaced by recorders that answer as a
device would; the test pins down the exact calls and arguments (the GPU check runs them for real
when a GPU is lent).
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from engine.config import ModelConfig
from engine.device import Device
from engine.kv_pool import KVPool
from rlctl.online.actuators import TorchMemoryFraction

GiB = 1 << 30


@pytest.fixture
def fake_cuda(monkeypatch):
    calls: list[tuple] = []
    state = {"free": 30 * GiB, "total": 80 * GiB, "reserved": 10 * GiB, "allocated": 8 * GiB}
    c = torch.cuda
    monkeypatch.setattr(c, "is_available", lambda: True)
    monkeypatch.setattr(c, "current_device", lambda: 1)
    monkeypatch.setattr(c, "mem_get_info", lambda dev=None: (calls.append(("mem_get_info", dev)), (state["free"], state["total"]))[1])
    monkeypatch.setattr(c, "memory_reserved", lambda dev=None: state["reserved"])
    monkeypatch.setattr(c, "memory_allocated", lambda dev=None: state["allocated"])
    monkeypatch.setattr(c, "empty_cache", lambda: calls.append(("empty_cache",)))
    monkeypatch.setattr(c, "set_per_process_memory_fraction",
                        lambda fraction, device=None: calls.append(("set_per_process_memory_fraction", fraction, device)))
    monkeypatch.setattr(c, "get_device_properties", lambda dev: SimpleNamespace(total_memory=state["total"], name="H100"))
    return SimpleNamespace(calls=calls, state=state)


def test_the_memory_fraction_names_the_engines_device_index(fake_cuda):
    report = TorchMemoryFraction(device="cuda").apply(0.5)
    assert report.applied, report.detail
    assert fake_cuda.calls[-1] == ("set_per_process_memory_fraction", 0.5, torch.device("cuda", 1))
    TorchMemoryFraction(device="cuda:0").apply(0.25)
    assert fake_cuda.calls[-1] == ("set_per_process_memory_fraction", 0.25, torch.device("cuda", 0))


def test_free_device_memory_is_what_the_driver_reports_so_another_process_shows(fake_cuda):
    dev = Device(80 * GiB, "cuda")
    dev.charge("weights", 40 * GiB)
    # the ledger sees 40 GiB free; the driver 30 GiB free, plus 2 GiB this process caches unused
    assert dev.free == 40 * GiB and dev.available() == 32 * GiB
    assert fake_cuda.calls[-1] == ("mem_get_info", torch.device("cuda"))
    fake_cuda.state["free"] = 1 * GiB  # another process takes the rest of the device
    assert dev.available() == 3 * GiB
    assert dev.held() == 10 * GiB  # what the process really holds is the allocator's reservation


def test_released_segments_go_back_to_the_device(fake_cuda, monkeypatch):
    dev = Device(80 * GiB, "cuda")
    dev.give_back()
    assert fake_cuda.calls[-1] == ("empty_cache",)
    given = []
    cpu = Device(GiB)
    monkeypatch.setattr(cpu, "give_back", lambda: given.append(True))
    pool = KVPool(ModelConfig(), 16, 64, 8, cpu, materialize=True)
    pool.ensure(40)
    assert pool.release_tail(9) > 0 and given == [True]  # once per release, after the segments went
    assert pool.release_tail(9) == 0 and given == [True]
