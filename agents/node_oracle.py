"""The node's ``oracle``: agents/oracle.py's lookahead extended to several engines on one GPU. It
measures headroom; it is never served.

Every ``every_s`` of engine time it copies the whole node (engine/clone.py ``clone_node``: every
engine with the requests still to arrive and their true lengths, and the device they share) and
chooses each engine's overcommit factor in turn (coordinate ascent over the engines, one pass):
for each candidate it runs a copy ``horizon_s`` ahead with the factors chosen so far and keeps
the best by the environment's reward (work still under way counted as agents/oracle.py counts
it: only while on track for its SLO). In the copies as in the episode it keeps house with one
action per interval, the node's own rule: on a crashing engine whose KV is ``evict_at`` in use, an
eviction to host; else a compaction of the engine whose pool holds the most free blocks, when
they are over ``defrag_waste`` of its capacity (a pool shrinks only when compacted, and what one
engine holds another cannot have). The MPS limits stay the scenario's: the oracle does not
restart engines. Candidates: ``levels``, and no reservation (factor inf) on a preempting engine.
"""
from __future__ import annotations

import math

import numpy as np

from agents.policy import Policy
from engine import metrics
from engine.clone import clone_node
from engine.metrics import generated_so_far, work_under_way
from engine.node_control import NODE_HOLD, encode_action, run_node_interval

LEVELS = (0.5, 1.0, 1.5, 2.0, 3.0, 4.0)


class NodeOracle(Policy):
    def __init__(self, horizon_s: float = 60.0, every_s: float = 10.0, levels: tuple[float, ...] = LEVELS,
                 evict_at: float = 0.95, defrag_waste: float = 0.25) -> None:
        if not (horizon_s > 0 and every_s > 0) or not levels or min(levels) <= 0:
            raise ValueError(f"oracle: horizon and period must be > 0 s and levels > 0, got {horizon_s}, {every_s}, "
                             f"{levels}")
        self.horizon_s, self.every_s, self.levels = horizon_s, every_s, tuple(levels)
        self.evict_at, self.defrag_waste = evict_at, defrag_waste
        self.name = "oracle"
        self.engine_overrides = {"overcommit_min": min(levels), "overcommit_max": math.inf}
        self.env = None
        self._next = 0.0
        self.chosen: list[tuple[float, dict]] = []

    def reset(self, seed: int | None = None, env=None) -> None:
        if env is None or not hasattr(env, "node"):
            raise ValueError("the node oracle looks inside its node environment: rlctl eval gives it one")
        self.env, self._next, self.chosen = env, 0.0, []

    def rule(self, node) -> int:
        """The housekeeping action: evict a crashing engine about to fill, else compact the most wasteful pool."""
        waste = {}
        for i, e in enumerate(node.engines.values()):
            if e.down_until is not None:
                continue
            if e.config.oom_mode == "crash" and e.kv_usage() >= self.evict_at:
                return encode_action(i, "evict")
            waste[i] = (e.pool.held_blocks - e.blocks_used()) / e.num_blocks
        worst = max(waste, key=waste.get, default=None)
        return encode_action(worst, "defrag") if worst is not None and waste[worst] > self.defrag_waste else NODE_HOLD

    def score(self, factors: dict[str, float]) -> float:
        """The reward a copy of the node earns over the horizon with every engine at ``factors``."""
        env = self.env
        node = clone_node(env.node)
        for name, f in factors.items():
            node.engines[name].set_overcommit(f)
        marks = {n: metrics.mark(e) for n, e in node.engines.items()}
        before = {n: generated_so_far(e) for n, e in node.engines.items()}
        interval, start = env.scenario.decision_interval_s, node.clock
        for k in range(1, int(self.horizon_s / interval) + 1):
            run_node_interval(node, self.rule(node), start + k * interval, None, env.scenario.evict_free_share)
        good, ooms = 0.0, 0
        for n, e in node.engines.items():
            f = metrics.since(e, marks[n])
            good += f["goodput_tokens"] + work_under_way(e, before[n])
            ooms += f["oom_events"]
        w = env.scenario.reward
        return w.alpha * good / (env.tokens_per_s_scale * interval) - w.omega * ooms

    def candidates(self, name: str) -> tuple[float, ...]:
        preempting = self.env.node.engines[name].config.oom_mode == "preempt"
        return self.levels + ((math.inf,) if preempting else ())

    def act(self, obs: np.ndarray) -> int:
        node = self.env.node
        if node.clock >= self._next:
            self._next = node.clock + self.every_s
            factors = {n: e.overcommit for n, e in node.engines.items()}
            for name in node.engines:
                scores = {f: self.score({**factors, name: f}) for f in self.candidates(name)}
                # a tie means the factor does not bind within the horizon: the larger admits more
                factors[name] = max(scores, key=lambda f: (scores[f], f))
            for name, f in factors.items():
                node.engines[name].set_overcommit(f)
            self.chosen.append((node.clock, dict(factors)))
        return self.rule(node)
