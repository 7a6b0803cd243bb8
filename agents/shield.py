"""The safety shield: an action mask that refuses actions breaking a hard rule (DESIGN.md).

Rules (each overridden action becomes ``hold`` and is counted by whoever applies the shield):
- no scale-up while free device memory is below ``min_device_free`` of capacity (a co-tenant
  holds it, or the pool is about to outgrow the device);
- no scale-up while the engine restarts after an OOM (everything it held comes back at once);
- no scale-up past ``max_reserved`` of KV capacity in admitted peak demand.

The same ``filter`` runs in the environment (training, evaluation) and in the sidecar (serving).
"""
from __future__ import annotations

from dataclasses import dataclass

from env.overcommit_env import HOLD, SCALE_UP


@dataclass(frozen=True)
class Shield:
    min_device_free: float = 0.05
    max_reserved: float = 3.0

    def allowed(self, action: int, engine) -> bool:
        if action != SCALE_UP:
            return True
        dev = engine.device
        if dev.free / dev.capacity < self.min_device_free or engine.down_until is not None:
            return False
        return engine.scheduler.reserved_blocks() / engine.kv.num_blocks < self.max_reserved

    def filter(self, action: int, engine) -> int:
        return action if self.allowed(action, engine) else HOLD
