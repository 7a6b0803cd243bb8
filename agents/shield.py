"""The safety shield: an action mask that refuses actions breaking a hard rule (docs/design.md).

Rules (each overridden action becomes ``hold`` and is counted by whoever applies the shield):
- no scale-up while free device memory is below ``min_device_free`` of capacity (a co-tenant
  holds it, or the pool is about to outgrow the device);
- no scale-up while the engine restarts after an OOM (everything it held comes back at once);
- no scale-up past ``max_reserved`` of KV capacity in admitted peak demand.

The same ``filter`` runs in the environment (training, evaluation) and in the sidecar (serving),
on the snapshot the decision is taken on.
"""
from __future__ import annotations

from dataclasses import dataclass

from engine.snapshot import Snapshot
from engine.control import HOLD, SCALE_UP


@dataclass(frozen=True)
class Shield:
    min_device_free: float = 0.05
    max_reserved: float = 3.0

    def allowed(self, action: int, snapshot: Snapshot) -> bool:
        """Whether ``action`` keeps the hard rules, judged on the decision's snapshot."""
        if action != SCALE_UP:
            return True
        if snapshot.device_free < self.min_device_free or snapshot.restarting:
            return False
        return snapshot.reserved_ratio < self.max_reserved

    def filter(self, action: int, snapshot: Snapshot) -> int:
        return action if self.allowed(action, snapshot) else HOLD
