"""The node's observation: every engine's own features (env/observation.py, in the engines' order),
what each engine holds of the device, and the device's.

| block | features | mapping | range |
|---|---|---|---|
| per engine `<name>/` | env/observation.py's 39 | as for one engine (its KV capacity is what its limit holds) | as there |
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
    """The float32 node observation: each engine's snapshot and memory, then the device's."""
    cap = node.device.capacity
    parts = []
    for name, e in node.engines.items():
        parts.append(observe(snapshots[name], scales))
        parts.append(np.array([_unit(e.device.capacity / cap), _unit(e.device.used / cap), _unit(shares[name])],
                              dtype=np.float32))
    device = [_unit(max(node.device.available(), 0) / cap), _unit(sum(node.limits().values()) / cap / 2)]
    parts.append(np.array(device, dtype=np.float32))
    return np.concatenate(parts).astype(np.float32)
