"""A node's state on the wire: to and from the protocol's ``NodeSnapshot``, and the sidecar's check of one.

A node (engine/node.py) reports every engine in one message: each engine's ``Snapshot`` (named by
its ``engine_id``, checked as rlctl/online/messages.py checks one engine's), its MPS limit, the
device bytes it holds and its partition share, and the device's capacity and free bytes: what
env/node_observation.py's observation is made of. ``SnapshotError`` names the first bad field
(``engines[1].mps_limit_bytes``, ``engines[0].snapshot.alloc_ratio``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from engine.node import Node
from engine.node_control import action_names
from engine.snapshot import Snapshot
from rlctl.online.messages import SnapshotError, snapshot_from_message, snapshot_message
from rlctl.online.proto import controller_pb2 as pb

# engines on one GPU: MPS serves at most 48 clients a device (Volta and later), so no real node lists more
MAX_NODE_ENGINES = 64


@dataclass(frozen=True)
class NodeState:
    """What a node reported: per engine (in its order) the snapshot, limit, bytes held and share."""

    snapshots: dict[str, Snapshot]
    limits: dict[str, int]
    held: dict[str, int]
    shares: dict[str, float]
    capacity: int
    free: int

    @property
    def names(self) -> list[str]:
        return list(self.snapshots)


def node_snapshot_message(node: Node, snapshots: dict[str, Snapshot], shares: dict[str, float],
                          seq: int = 0) -> pb.NodeSnapshot:
    """``node``'s engines (their last snapshots) and device as the protocol's message."""
    engines = [pb.EngineState(snapshot=snapshot_message(snapshots[n], e.max_model_len, n, seq),
                              mps_limit_bytes=int(e.device.capacity), held_bytes=int(e.device.used),
                              share=float(shares[n]))
               for n, e in node.engines.items()]
    return pb.NodeSnapshot(seq=seq, device_capacity_bytes=int(node.device.capacity),
                           device_free_bytes=int(min(max(node.device.available(), 0), node.device.capacity)),
                           engines=engines)


def node_state_from_message(m: pb.NodeSnapshot) -> NodeState:
    """The ``NodeState`` a message carries, checked; ``SnapshotError`` names the first bad field."""
    if m.device_capacity_bytes <= 0:
        raise SnapshotError("device_capacity_bytes", f"must be > 0, got {m.device_capacity_bytes}")
    if not 0 <= m.device_free_bytes <= m.device_capacity_bytes:
        raise SnapshotError("device_free_bytes", f"must be in [0, device_capacity_bytes = {m.device_capacity_bytes}], "
                                                 f"got {m.device_free_bytes}")
    if not m.engines:
        raise SnapshotError("engines", "must list the node's engines, got none")
    if len(m.engines) > MAX_NODE_ENGINES:
        raise SnapshotError("engines", f"lists {len(m.engines)} engines; a node holds at most {MAX_NODE_ENGINES}")
    snapshots, limits, held, shares = {}, {}, {}, {}
    for i, es in enumerate(m.engines):
        where = f"engines[{i}]"
        name = es.snapshot.engine_id
        if not name:
            raise SnapshotError(f"{where}.snapshot.engine_id", "must name the engine, got an empty name")
        if name in snapshots:
            raise SnapshotError(f"{where}.snapshot.engine_id", f"names engine {name!r} a second time")
        try:
            snapshots[name], _ = snapshot_from_message(es.snapshot)
        except SnapshotError as exc:
            raise SnapshotError(f"{where}.snapshot.{exc.field}", str(exc).split(" ", 1)[1]) from None
        if not 0 < es.mps_limit_bytes <= m.device_capacity_bytes:
            raise SnapshotError(f"{where}.mps_limit_bytes", f"must be in (0, device_capacity_bytes = "
                                                            f"{m.device_capacity_bytes}], got {es.mps_limit_bytes}")
        if not 0 <= es.held_bytes <= es.mps_limit_bytes:
            raise SnapshotError(f"{where}.held_bytes", f"must be in [0, mps_limit_bytes = {es.mps_limit_bytes}], "
                                                       f"got {es.held_bytes}")
        if not (math.isfinite(es.share) and 0.0 <= es.share <= 1.0):
            raise SnapshotError(f"{where}.share", f"must be a share in [0, 1], got {es.share}")
        limits[name], held[name], shares[name] = int(es.mps_limit_bytes), int(es.held_bytes), float(es.share)
    return NodeState(snapshots, limits, held, shares, int(m.device_capacity_bytes), int(m.device_free_bytes))


def check_node_decision(d: pb.NodeDecision, seq: int, names: list[str]) -> str | None:
    """What is wrong with node decision ``d`` for the node snapshot numbered ``seq`` of engines
    ``names``, or None."""
    if d.seq != seq:
        return f"decision for node snapshot {d.seq}, expected {seq}"
    known = action_names(names)
    if not 0 <= d.action < len(known):
        return f"unknown node action id {d.action} (known: 0..{len(known) - 1})"
    if d.action_name != known[d.action]:
        return f"node action {d.action} is {known[d.action]!r}, the decision names it {d.action_name!r}"
    engine, _, what = known[d.action].partition(":")
    if (d.engine_id, d.engine_action) != ((engine, what) if what else ("", "")):
        return (f"node action {known[d.action]!r} moves engine {engine if what else ''!r} by {what!r}, the decision "
                f"says {d.engine_id!r} by {d.engine_action!r}")
    return None
