"""A node's live loop: several engines on one GPU (engine/node.py) steered by one sidecar.

Every ``decision_interval_s`` of engine time the node sends one ``NodeSnapshot`` to the sidecar
(``DecideNode``, started with ``rlctl serve --node``): every engine's snapshot, each naming its
engine, with its MPS limit, the device bytes it holds and its partition share, and the device's
capacity and free bytes. The decision that comes back is checked (the sequence number, a known
node action whose name, engine and engine action agree) and applied by
``engine.node_control.run_node_interval``, the interval the environment (env/shared_gpu_env.py)
runs too: one action moves at most one engine; ``resize`` restarts that engine gracefully under
the MPS limit that backs its quota (every request it held is requeued with its tokens).

Faults are handled as rlctl/online/live.py handles them for one engine (the same reasons,
counts, backoff and reconnects): a deadline miss, a lost connection, an RPC error or a decision
that fails the check runs that interval under the safe static policy, every engine at the safe
factor (or the lower one in force), holding.
"""
from __future__ import annotations

from engine.control import ACTIONS
from engine.metrics import summarize
from engine.node import Node
from engine.node_control import ENGINE_ACTIONS, NODE_HOLD, action_names, run_node_interval
from rlctl.online.live import LiveController
from rlctl.online.node_messages import check_node_decision, node_snapshot_message
from rlctl.online.process_node import ProcessNode
from rlctl.online.proto import controller_pb2 as pb


class NodeLiveController(LiveController):
    """Asks the sidecar at ``address`` for each node decision and applies it to a node; see the
    module docstring. ``shares`` are the engines' static partition shares (what the node policy
    sees); the other arguments are ``LiveController``'s."""

    def __init__(self, address: str, shares: dict[str, float], **kwargs) -> None:
        super().__init__(address, **kwargs)
        self.shares = dict(shares)
        self.node_actions: dict[str, int] = {}
        self.restarts = 0

    def step_node(self, node: Node, until: float, events=None) -> pb.NodeDecision | None:
        """One decision interval of ``node`` steered by the sidecar (or the safe policy after a
        fault: None), then ``run_node_interval`` to ``until``."""
        if set(self.shares) != set(node.engines):
            raise ValueError(f"shares are given for engines {sorted(self.shares)}, the node has {node.names}")
        snapshots = {n: e.last_snapshot or e.snapshot() for n, e in node.engines.items()}
        d = self._decide_node(node, snapshots)
        effect = run_node_interval(node, NODE_HOLD if d is None else d.action, until, events, self.evict_free_share).effect
        self.restarts += bool(effect.get("restarted"))
        return d

    def _decide_node(self, node: Node, snapshots) -> pb.NodeDecision | None:
        d = self._ask(node, "DecideNode", lambda seq: node_snapshot_message(node, snapshots, self.shares, seq),
                      lambda d, seq: check_node_decision(d, seq, node.names))
        if d is None:
            return None
        self.node_actions[d.action_name] = self.node_actions.get(d.action_name, 0) + 1
        what = d.engine_action or "hold"
        self._tally(d, what if what in ACTIONS else None)  # resize has no one-engine action to count
        return d

    def _safe_policy(self, node: Node) -> None:
        for e in node.engines.values():  # the safe static policy: every engine at this factor (or the lower one
            if e.overcommit > self.safe_factor:  # in force), holding: a fallback never admits more
                e.set_overcommit(self.safe_factor)

    def report(self) -> dict:
        out = super().report()
        for key in ("actuators", "actuator_changes"):  # one engine's actuators: a node's limits move by resize
            out.pop(key)
        return {**out, "node_actions": dict(self.node_actions), "restarts_by_resize": self.restarts,
                "engine_actions": list(ENGINE_ACTIONS)}


def replay_node_live(node: Node | ProcessNode, controller: NodeLiveController, decision_interval_s: float = 2.0,
                     max_intervals: int = 1_000_000) -> dict:
    """Run every engine's submitted requests to completion with ``controller`` deciding every
    ``decision_interval_s`` of engine time (first at time 0); the node's figures, each engine's,
    and the controller's. ``node`` is an in-process node or one of engine processes
    (rlctl/online/process_node.py): the same interval, checks and fallbacks run on either."""
    if not decision_interval_s > 0:
        raise ValueError(f"decision interval must be > 0 s, got {decision_interval_s}")
    k = 0
    while node.has_work():
        if k >= max_intervals:
            raise RuntimeError(f"the node still has work after {max_intervals} decision intervals")
        k += 1
        controller.step_node(node, k * decision_interval_s)
    engines = node.figures() if isinstance(node, ProcessNode) else {
        n: {**summarize(e), "restarts": e.counters.restarts, "mps_limit_bytes": e.device.capacity}
        for n, e in node.engines.items()}
    return {"engines": engines, "intervals": k, "actions": list(action_names(node.names)),
            "decision_interval_s": decision_interval_s, **controller.report()}
