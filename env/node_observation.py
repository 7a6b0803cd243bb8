"""The node's observation: every engine's own features (env/observation.py, in the engines' order),
what each engine holds of the device, and the device's.

| block | features | mapping | range |
|---|---|---|---|
| per engine `<name>/` | env/observation.py's 40 | as for one engine (its KV capacity is what its limit holds) | as there |
| per engine | `<name>/limit` | its MPS limit / device capacity | [0, 1] |
| per engine | `<name>/held` | device bytes it holds (weights, KV pool, workspace) / device capacity | [0, 1] |
| per engine | `<name>/share` | its static partition share of the device | [0, 1] |
| device | `device/free` | free device memory / capacity | [0, 1] |
| device | `device/limits` | the engines' limits summed / capacity / 2, clipped | [0, 1] |

Token counts stay shares of each engine's own capacity, so the layout depends on the number of
engines and their names, not on the deployments.
"""
from __future__ import annotations

import numpy as np

from engine.node import Node
from engine.snapshot import Snapshot
from env.observation import FEATURES, HIGH, LOW, observe
from env.scenario import Observation

ENGINE_EXTRAS = ("limit", "held", "share")
DEVICE_FEATURES = ("device/free", "device/limits")


def node_features(names: list[str]) -> list[str]:
    """The node observation's feature names for engines ``names``, in order."""
    return [f"{n}/{f}" for n in names for f in list(FEATURES) + list(ENGINE_EXTRAS)] + list(DEVICE_FEATURES)


def node_bounds(names: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """(low, high) of the node observation."""
    extra = np.zeros(len(ENGINE_EXTRAS), dtype=np.float32)
    low = np.concatenate([np.concatenate([LOW, extra]) for _ in names] + [np.zeros(len(DEVICE_FEATURES), np.float32)])
    high = np.concatenate([np.concatenate([HIGH, extra + 1]) for _ in names] + [np.ones(len(DEVICE_FEATURES), np.float32)])
    return low.astype(np.float32), high.astype(np.float32)


def _unit(x: float) -> float:
    return min(max(x, 0.0), 1.0)


def observe_node(node: Node, snapshots: dict[str, Snapshot], shares: dict[str, float], scales: Observation) -> np.ndarray:
    """The float32 node observation of ``node``: each engine's snapshot and memory, then the device's."""
    return observe_node_state(snapshots, {n: e.device.capacity for n, e in node.engines.items()},
                              {n: e.device.used for n, e in node.engines.items()}, shares, node.device.capacity,
                              max(node.device.available(), 0), scales)


def observe_node_state(snapshots: dict[str, Snapshot], limits: dict[str, int], held: dict[str, int],
                       shares: dict[str, float], capacity: int, free: int, scales: Observation) -> np.ndarray:
    """The float32 node observation from what a node reports (in the environment, or on the wire to
    a sidecar): each engine's snapshot, MPS limit, bytes held and partition share, in the order of
    ``snapshots``; the device's capacity and free bytes."""
    parts = []
    for name, snap in snapshots.items():
        parts.append(observe(snap, scales))
        parts.append(np.array([_unit(limits[name] / capacity), _unit(held[name] / capacity), _unit(shares[name])],
                              dtype=np.float32))
    device = [_unit(free / capacity), _unit(sum(limits[n] for n in snapshots) / capacity / 2)]
    parts.append(np.array(device, dtype=np.float32))
    return np.concatenate(parts).astype(np.float32)
