"""The node's vocabulary and its decision interval: one flat action over (engine, action).

Action 0 holds every engine. Action ``1 + i * 5 + j`` applies ``ENGINE_ACTIONS[j]`` to the
node's i-th engine and holds the others: ``scale_up``, ``back_off``, ``defrag`` and ``evict`` are
engine/control.py's actions on that engine (its quota, the overcommit factor, moves live);
``resize`` restarts it gracefully under the MPS limit that backs its quota now (the factor's
blocks become its KV capacity and the factor returns to 1), since MPS binds a limit only at a
client's start. One decision moves one engine: docs/design.md says why.

``run_node_interval`` is ``run_interval`` for a node: apply the action, advance every engine in
lockstep to the next decision time, snapshot each. The environment (env/shared_gpu_env.py) and a
node's live loop run it alike.
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

from engine.control import ACTIONS, Event, apply_action
from engine.node import Node
from engine.snapshot import Snapshot

ENGINE_ACTIONS = ("scale_up", "back_off", "defrag", "evict", "resize")
NODE_HOLD = 0


def action_names(names: list[str]) -> tuple[str, ...]:
    """Every node action's name: ``hold``, then ``<engine>:<action>`` per engine."""
    return ("hold",) + tuple(f"{n}:{a}" for n in names for a in ENGINE_ACTIONS)


def decode_action(action: int, n_engines: int) -> tuple[int, str] | None:
    """(engine index, engine action name) of a flat node action; None for the node-wide hold."""
    count = 1 + len(ENGINE_ACTIONS) * n_engines
    if isinstance(action, bool) or not isinstance(action, int) or not 0 <= action < count:
        raise ValueError(f"node action must be one of 0..{count - 1} (hold, then {len(ENGINE_ACTIONS)} per engine: "
                         f"{', '.join(ENGINE_ACTIONS)}), got {action!r}")
    if action == NODE_HOLD:
        return None
    i, j = divmod(action - 1, len(ENGINE_ACTIONS))
    return i, ENGINE_ACTIONS[j]


def encode_action(engine_index: int, name: str) -> int:
    """The flat node action that applies ``name`` (one of ``ENGINE_ACTIONS``) to engine ``engine_index``."""
    if name not in ENGINE_ACTIONS:
        raise ValueError(f"engine action must be one of {', '.join(ENGINE_ACTIONS)}, got {name!r}")
    return 1 + engine_index * len(ENGINE_ACTIONS) + ENGINE_ACTIONS.index(name)


def resize(node: Node, name: str) -> dict:
    """Restart engine ``name`` under the MPS limit that backs its quota (factor x KV capacity),
    within the device and at least one sequence's worth; nothing when that is its capacity now
    or it has no finite quota."""
    e = node.engines[name]
    if not math.isfinite(e.overcommit):
        return {"restarted": False}
    least = math.ceil(e.max_model_len / e.config.block_size)
    target = max(round(e.overcommit * e.num_blocks), least)
    limit = min(node.limit_for(name, target), node.device.capacity)
    if node.limit_for(name, e.num_blocks) == limit or not node.set_limit(name, limit):
        return {"restarted": False}
    e.set_overcommit(1.0)
    return {"restarted": True, "limit_bytes": limit, "kv_blocks": e.num_blocks}


def apply_node_action(node: Node, action: int, evict_free_share: float) -> dict:
    """Apply one flat node action now; what it did, with the engine it was applied to."""
    decoded = decode_action(action, len(node.engines))
    if decoded is None:
        return {}
    i, what = decoded
    name = node.names[i]
    if what == "resize":
        return {"engine": name, **resize(node, name)}
    return {"engine": name, **apply_action(node.engines[name], ACTIONS.index(what), evict_free_share)}


@dataclass(frozen=True)
class NodeInterval:
    """One decision interval of the node: what the action did, when it started, each engine's snapshot."""

    effect: dict
    start_s: float
    snapshots: dict[str, Snapshot]


def run_node_interval(node: Node, action: int, until: float, events: dict[str, deque[Event]] | None = None,
                      evict_free_share: float = 0.2) -> NodeInterval:
    """Apply ``action``, run every engine in lockstep to ``until`` (``Node.advance``), snapshot each."""
    start = node.clock
    effect = apply_node_action(node, action, evict_free_share)
    node.advance(until, events)
    return NodeInterval(effect, start, {n: e.snapshot() for n, e in node.engines.items()})

