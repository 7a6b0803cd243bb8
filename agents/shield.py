"""The safety shield: an action mask that refuses actions breaking a hard rule (docs/design.md).

Rules (each overridden action is counted by whoever applies the shield):
- no scale-up while free device memory is below ``min_device_free`` of capacity (a co-tenant
  holds it, or the pool is about to outgrow the device);
- no scale-up while the engine restarts after an OOM (everything it held comes back at once);
- no scale-up while the factor is already ``max_slack`` x the admitted peak demand (in KV
  capacities, or x 1 while less than one is admitted): a scale-up there admits nothing now, and
  leaves a latitude that a run of admissions uses up faster than backing off can take it back;
- on a crashing engine, no scale-up past ``max_reserved`` of KV capacity in admitted peak demand,
  and at ``evict_at`` of the KV in use an eviction to host in place of hold, scale-up or defrag,
  and with ``evict_on_back_off`` of a back-off too (backing off admits nothing more, but the
  running batch still grows into the last blocks): a crash loses everything held, a swap nothing;
- on a crashing engine, the engine admits a new request only while ``admit_headroom`` of the KV
  stays free after it (``Engine.set_admit_headroom``; reclaimable blocks count as free): between
  two decisions the queue can fill the KV past ``evict_at`` before an eviction can act. With
  ``growth_interval_s`` the headroom also holds the blocks the running batch decodes into before
  the next decision, that far off: each running sequence's tokens at the last interval's decode
  iteration time, in whole blocks (``growth_blocks``). A fixed share did not: a batch of 120
  sequences at 24 ms an iteration takes ~3 % of an H100's KV in 2 s, and the queue had filled all
  but the 2 % before it (README, "Results").
Each overridden scale-up becomes ``hold``.

With ``preempt_as_crash`` (the served shield) a preempting engine is steered as a crashing one:
the policy reads its ``preempt_mode`` as 0 and the crash rules bind it, so it is kept from running
out rather than left to preempt and recompute. The default policy, served that way, preempts
nowhere and earns more on the long-output scenarios than it does as trained (README, "Results");
``view`` is what the policy and the rules see, in the environment and in the sidecar alike.

The same ``filter`` runs in the environment (evaluation) and in the sidecar (serving), on the
snapshot the decision is taken on. Training runs behind ``TRAINING``, the same rules but the
slack, ``preempt_as_crash`` (a policy learns each engine's OOM mode as it is), the headroom and
the eviction in place of a back-off (the rules the shipped weights were trained behind): policies
trained behind the slack rule did worse on long outputs (README, "Results"), so both are rules of
evaluation and serving. The node shield's engines have no slack rule at all: the node
policies were trained without it.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from engine.control import ACTIONS, BACK_OFF, EVICT, HOLD, SCALE_UP
from engine.node_control import NODE_HOLD, decode_action, encode_action
from engine.snapshot import Snapshot


MAX_HEADROOM = 0.5  # past this a headroom would keep the KV half empty: the batch's growth is then not the risk


def growth_blocks(snapshot: Snapshot, interval_s: float) -> int:
    """Blocks the running batch of ``snapshot`` may decode into over ``interval_s``: each running
    sequence one token an iteration at the last interval's mean decode iteration time, rounded up
    to whole blocks (0 with no interval, nothing running or no iteration timed yet)."""
    if interval_s <= 0 or snapshot.running <= 0 or snapshot.decode_ms <= 0 or snapshot.kv_blocks_total <= 0:
        return 0
    block_size = max(snapshot.kv_tokens_total // snapshot.kv_blocks_total, 1)
    tokens = min(interval_s * 1000.0 / snapshot.decode_ms, snapshot.kv_tokens_total)  # no more than the whole KV
    return snapshot.running * math.ceil(tokens / block_size)


@dataclass(frozen=True)
class Shield:
    min_device_free: float = 0.05
    max_reserved: float = 8.0
    evict_at: float = 0.95
    max_slack: float = 1.5
    preempt_as_crash: bool = True
    admit_headroom: float = 0.02
    evict_on_back_off: bool = True
    growth_interval_s: float = 2.0  # the decision interval the headroom covers the batch's growth over; 0: none

    def view(self, snapshot: Snapshot) -> Snapshot:
        """The engine as the policy observes it and the rules judge it (module docstring)."""
        if self.preempt_as_crash and snapshot.preempt_mode:
            return dataclasses.replace(snapshot, preempt_mode=False)
        return snapshot

    def headroom(self, snapshot: Snapshot) -> float:
        """The admission headroom the engine of ``snapshot`` runs with until the next decision
        (module docstring): a share of the KV, below 1."""
        if self.view(snapshot).preempt_mode:
            return 0.0
        growth = growth_blocks(snapshot, self.growth_interval_s) / max(snapshot.kv_blocks_total, 1)
        return min(self.admit_headroom + growth, MAX_HEADROOM)

    def may_rise(self, snapshot: Snapshot) -> bool:
        """Whether the factor may rise at all: not while free device memory is below ``min_device_free``,
        nor while the engine restarts. A scale-up must also keep the rules of ``allowed``; a policy that
        pins its factor (``static:K`` served) waits on this alone to raise the engine's to its own."""
        return snapshot.device_free >= self.min_device_free and not snapshot.restarting

    def allowed(self, action: int, snapshot: Snapshot) -> bool:
        """Whether ``action`` keeps the hard rules, judged on the decision's snapshot."""
        snapshot = self.view(snapshot)
        if action != SCALE_UP:
            return True
        if not self.may_rise(snapshot):
            return False
        if self.max_slack < math.inf and snapshot.overcommit >= self.max_slack * max(snapshot.reserved_ratio, 1.0):
            return False
        # a preempting engine recomputes what does not fit; only a crashing one must bound its demand
        return snapshot.preempt_mode or snapshot.reserved_ratio < self.max_reserved

    def filter(self, action: int, snapshot: Snapshot) -> int:
        """The action to apply: ``action`` if it keeps the rules; on a crashing engine whose KV is
        ``evict_at`` full, an eviction to host instead of anything that would let it grow on;
        else hold."""
        snapshot = self.view(snapshot)
        if (not snapshot.preempt_mode and not snapshot.restarting and snapshot.alloc_ratio >= self.evict_at
                and action != EVICT and (action != BACK_OFF or self.evict_on_back_off)):
            return EVICT
        return action if self.allowed(action, snapshot) else HOLD


# what a policy learns behind (module docstring)
TRAINING = Shield(max_slack=math.inf, preempt_as_crash=False, admit_headroom=0.0, evict_on_back_off=False,
                  growth_interval_s=0.0)


@dataclass(frozen=True)
class NodeShield:
    """The shield of a node's flat actions (engine/node_control.py): ``Shield``'s rules on the
    engine an action moves (a refused scale-up becomes the node-wide hold), and a node-wide hold
    while a crashing engine's KV is ``evict_at`` full becomes that engine's eviction (the first
    such engine's). ``resize`` (a graceful restart) and actions on other engines pass."""

    engine: Shield = TRAINING

    def filter(self, action: int, snapshots: dict[str, Snapshot]) -> int:
        names = list(snapshots)
        decoded = decode_action(action, len(names))
        if decoded is None:
            for i, name in enumerate(names):
                if self.engine.filter(HOLD, snapshots[name]) == EVICT:
                    return encode_action(i, "evict")
            return action
        i, what = decoded
        if what == "resize":
            return action
        applied = self.engine.filter(ACTIONS.index(what), snapshots[names[i]])
        return NODE_HOLD if applied == HOLD else encode_action(i, ACTIONS[applied])
