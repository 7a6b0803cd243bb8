"""Several engines on one device: MPS clients with their own limits on one ledger.

The engines run the tiny model (on real KV tensors where it matters), timed by a stated cost
model, so that what happens (who runs out of memory, and when) does not depend on how busy the
machine is.
"""
from __future__ import annotations

import pytest

from engine.config import EngineConfig, ModelConfig, memory_plan
from engine.cost_model import CostModel
from engine.device import Device, DeviceOOM
from engine.executor import ProfiledExecutor
from engine.node import DeviceShare, Node
from engine.node_control import action_names, decode_action, encode_action, resize, run_node_interval
from engine.request import Request

MODEL = ModelConfig()
CFG = EngineConfig(block_size=16, max_model_len=512, max_num_batched_tokens=64, segment_blocks=8,
                   restart_downtime_s=1.0, max_num_seqs=32)
COST = CostModel(fixed_s=1.5e-3, per_token_s=2e-5, per_context_token_s=2e-7, copy_fixed_s=1e-5, copy_bytes_per_s=2e9)
BLOCK = MODEL.kv_bytes_per_token() * CFG.block_size


def workspace(tensors: bool) -> int:
    """The device's room for one iteration's workspace: a fused kernel's full batch without tensors,
    the torch executor's largest with them (padding, masks and score matrices: engine/attention.py)."""
    if tensors:
        return ProfiledExecutor(COST, materialize=True).max_workspace_bytes(MODEL, CFG, CFG.max_model_len)
    return MODEL.workspace_bytes(CFG.max_num_batched_tokens, 0)


def limit(blocks: int, tensors: bool = False) -> int:
    """The MPS limit that holds ``blocks`` KV blocks beside the weights and a full batch's workspace."""
    from dataclasses import replace
    return memory_plan(MODEL, replace(CFG, num_blocks=blocks), workspace=workspace(tensors) if tensors else None).total


def node(device_blocks: int, limits: tuple[int, int], oom_mode: str = "crash", tensors: bool = False) -> Node:
    """Two engines a and b; the device holds both models, one full batch's workspace at a time and
    ``device_blocks`` KV blocks in all. ``tensors``: real KV tensors (else the same books without them)."""
    n = Node(Device(2 * MODEL.weight_bytes() + workspace(tensors) + device_blocks * BLOCK))
    for name, blocks in zip("ab", limits):
        n.add(name, MODEL, EngineConfig(**{**CFG.__dict__, "oom_mode": oom_mode}), limit(blocks, tensors),
              executor=ProfiledExecutor(COST, materialize=tensors))
    return n


def requests(prefix: str, count: int, at: float, prompt: int, output: int) -> list[Request]:
    """``count`` requests 10 ms apart from ``at``, each declaring twice the output it really makes."""
    return [Request(f"{prefix}{i}", at + 0.01 * i, prompt, output, 2 * output) for i in range(count)]


def serve_pair(n: Node) -> tuple:
    """Three requests to a, three to b 50 ms later (400 tokens each, declaring 800), run until served."""
    a, b = n.engines["a"], n.engines["b"]
    for r in requests("a", 3, 0.0, 100, 400):
        a.submit(r)
    for r in requests("b", 3, 0.05, 100, 400):
        b.submit(r)
    for k in range(1, 400):
        run_node_interval(n, 0, 0.5 * k)
        if not n.has_work():
            break
    return a, b


def test_a_client_keeps_its_workspace_until_it_gives_kv_back():
    """PyTorch's caching allocator: an iteration's workspace stays with the MPS client, so another
    client cannot take it between iterations; only growth past it is charged, and giving KV back
    (the engine empties its cache) returns it."""
    dev = Device(10_000)
    a, b = DeviceShare(dev, 8_000, "a"), DeviceShare(dev, 8_000, "b")
    a.charge("kv", 1_000)
    with a.transient("workspace", 3_000):
        assert dev.used == 4_000
    assert a.charged["workspace"] == 3_000 and dev.used == 4_000  # kept after the iteration
    with a.transient("workspace", 2_000):
        pass
    assert dev.used == 4_000  # a smaller iteration runs on what is kept
    b.charge("kv", 6_000)  # b takes everything left
    with pytest.raises(DeviceOOM):
        b.charge("kv", 1)
    with a.transient("workspace", 3_000):  # a's next iteration still runs
        pass
    with pytest.raises(DeviceOOM):
        with a.transient("workspace", 3_001):
            pass
    assert a.charged["workspace"] == 3_000 and dev.used == 10_000  # a refused growth changes nothing
    a.release("kv", 1_000)
    assert a.charged["workspace"] == 0 and dev.used == 6_000
    b.charge("kv", 2_000)  # b can have it now, up to its own limit
    with a.transient("workspace", 1_000):  # an engine whose process ends (a crash, a restart) gives it back too
        pass
    a.give_back()
    assert a.charged["workspace"] == 0 and dev.used == 8_000
    with pytest.raises(ValueError, match="workspace"):
        with a.transient("kv", 1):
            pass


def test_a_share_charges_its_limit_and_the_device():
    device = Device(1000)
    a, b = DeviceShare(device, 700, "a"), DeviceShare(device, 700, "b")  # limits sum to 1.4x the device
    a.charge("kv", 600)
    assert (a.free, b.free, device.free) == (100, 400, 400)
    with pytest.raises(DeviceOOM):
        a.charge("kv", 101)  # over its own limit, though the device has room
    b.charge("kv", 400)
    with pytest.raises(DeviceOOM):
        b.charge("kv", 1)  # under its limit, but the device is full: a holds the rest
    assert (a.used, b.used, device.used) == (600, 400, 1000)  # a refused charge changes nothing
    a.release("kv", 600)
    assert (a.free, b.free, device.free) == (600, 300, 600)


def test_a_share_is_checked():
    device = Device(1000)
    with pytest.raises(ValueError, match="more than the device"):
        DeviceShare(device, 1001, "a")
    share = DeviceShare(device, 500, "a")
    share.charge("weights", 300)
    with pytest.raises(ValueError, match="below the 300 B it holds"):
        share.set_limit(200)
    with pytest.raises(TypeError, match="Node.device"):
        share.set_tenants(10)


@pytest.mark.parametrize("tensors", [False, True])
def test_engines_size_their_kv_from_their_limits(tensors):
    # with tensors the torch executor's workspace, far larger than a fused kernel's, comes first
    n = node(100, (80, 60), tensors=tensors)
    assert [e.num_blocks for e in n.engines.values()] == [80, 60]
    assert sum(n.limits().values()) > n.device.capacity  # overcommitted across tenants
    assert n.device.charged["weights"] == 2 * MODEL.weight_bytes()


@pytest.mark.parametrize("mode", ["crash", "preempt"])
def test_a_tenant_that_grows_runs_the_other_out_of_memory_and_no_request_is_lost(mode):
    # each limit holds 96 blocks, the device 120 in all; a's sequences will hold its whole limit, and
    # b's, admitted 50 ms later, grow into what a left until the device has no more. Without tensors:
    # the torch executor's room for its largest workspace (engine/attention.py) is, for this tiny
    # model, many times its KV, and b would grow into it
    n = node(120, (96, 96), mode)
    a, b = serve_pair(n)
    assert not n.has_work()
    assert b.ooms and {o.cause for o in b.ooms} == {"device ledger"}  # the pool or a batch did not fit
    assert {o.source for o in b.ooms} <= {"kv pool growth", "iteration workspace"}
    assert all(o.mode == mode for o in b.ooms)
    if mode == "crash":
        assert b.counters.oom_events == len(b.ooms)
    else:
        assert b.counters.preemptions > 0 and b.counters.oom_events == 0
    assert not a.ooms  # a grew first: the engine whose allocation failed is the one that pays
    for e in (a, b):  # every request finished with every token it asked for
        assert len(e.completed) == len(e.records) == 3
        assert all(r.output_len == 400 for r in e.completed)
    assert n.device.used == sum(e.device.used for e in n.engines.values())


def test_within_a_static_partition_no_tenant_runs_the_other_out():
    n = node(120, (60, 60))  # the limits sum to the device: a partition
    a, b = serve_pair(n)
    assert not a.ooms and not b.ooms
    assert len(a.completed) == len(b.completed) == 3


def test_a_new_limit_takes_effect_through_a_graceful_restart():
    n = node(120, (60, 60))
    a = n.engines["a"]
    for r in requests("a", 4, 0.0, 100, 200):
        a.submit(r)
    run_node_interval(n, 0, 1.0)
    held = len(a.scheduler.running)
    assert held > 0
    a.set_overcommit(1.5)
    effect = run_node_interval(n, encode_action(0, "resize"), 1.5).effect
    assert effect["restarted"] and effect["engine"] == "a" and a.num_blocks == 90
    assert n.share("a").capacity == limit(90) and a.overcommit == 1.0
    assert a.counters.restarts == 1 and a.counters.oom_events == 0 and not a.ooms
    assert a.down_until == pytest.approx(1.0 + CFG.restart_downtime_s, abs=0.05) or a.clock >= 1.5
    for k in range(4, 400):
        run_node_interval(n, 0, 0.5 * k)
        if not n.has_work():
            break
    assert len(a.completed) == 4 and all(r.output_len == 200 for r in a.completed)
    assert resize(n, "a") == {"restarted": False}  # at factor 1 the limit in force already backs the quota


def test_bad_limits_are_refused_naming_the_engine():
    n = node(100, (50, 50))
    with pytest.raises(ValueError, match="'a' is empty or already"):
        n.add("a", MODEL, CFG, limit(40))
    with pytest.raises(ValueError, match="engine 'c'.*less than one 512-token sequence"):
        n.add("c", MODEL, CFG, limit(10))
    with pytest.raises(ValueError, match="engine 'a': an MPS limit must be in"):
        n.set_limit("a", n.device.capacity + 1)
    with pytest.raises(ValueError, match="cannot hold one 512-token sequence"):
        n.set_limit("a", limit(10))
    assert n.engines["a"].num_blocks == 50 and n.engines["a"].counters.restarts == 0


def test_engines_advance_in_lockstep():
    n = node(100, (50, 50))
    a, b = n.engines["a"], n.engines["b"]
    for r in requests("a", 3, 0.0, 100, 300):
        a.submit(r)  # b has nothing to do: it idles with the node
    run_node_interval(n, 0, 2.0)
    assert a.clock >= 2.0 and b.clock == 2.0 and n.clock == 2.0


def test_the_flat_action_names_every_engine_action_once():
    names = action_names(["a", "b"])
    assert names[0] == "hold" and len(names) == 11 and names[encode_action(1, "evict")] == "b:evict"
    assert [decode_action(encode_action(i, w), 2) for i, w in ((0, "scale_up"), (1, "resize"))] == \
        [(0, "scale_up"), (1, "resize")]
    with pytest.raises(ValueError, match="0..10"):
        decode_action(11, 2)
