"""``oracle``: a lookahead reference that may see the future. It measures headroom; it is never served.

Every ``every_s`` of engine time it copies the episode's engine (engine/clone.py: the queues, the
requests still to arrive with their true output lengths, the co-tenant's schedule) once per plan,
runs each copy ``horizon_s`` ahead holding the plan, one decision interval at a time, and sets the
plan whose copy scored best. A plan is a candidate overcommit factor and a housekeeping rule: evict
to host whenever the KV is ``evict_at`` in use, or not. On a crashing engine every plan evicts (the
shield's rule there), so that a high factor is judged with the safety valve a controller has, not
as a crash waiting to happen; on a preempting engine both are scored (evicting keeps long contexts
that recomputing would redo, and on some workloads it thrashes). The horizon is meant to cover
request lifetimes (tens of seconds), so that admitting a long request is judged by what it does to
the memory later, not in the next interval. The score is the environment's reward over the horizon:
output tokens of requests that finished within their SLO, plus the tokens that requests still
unfinished produced, if they are still on track for their SLO (work under way counts, or the last
seconds of every horizon would look idle; work already late does not, or thrashing would look
productive), over the reward's normaliser, less omega per OOM event. Candidate factors: ``levels``
up to the scenario's ``overcommit_max``, the scenario's tuned fixed factor (``best_static``, so
that the best incumbent's own setting is always on the table), and no reservation at all (factor
inf) on a preempting engine.

A controller's share of headroom is ``(controller - best incumbent) / (oracle - best incumbent)``.
``lookahead`` (``Lookahead``, below) is the same search without the requests' output lengths.
"""
from __future__ import annotations

import math
from collections import deque

import numpy as np

from agents.policy import Policy
from engine import metrics
from engine.clone import clone
from engine.control import EVICT, HOLD, run_interval
from engine.metrics import generated_so_far, work_under_way
from engine.output_lengths import kaplan_meier
from env.workload_builder import earlier_outputs

LEVELS = (1.0, 1.25, 1.5, 2.0, 2.5, 3.0, 4.0, 6.0, 8.0, 12.0, 16.0)


class Oracle(Policy):
    def __init__(self, horizon_s: float = 120.0, every_s: float = 10.0, levels: tuple[float, ...] = LEVELS,
                 evict_at: float = 0.95) -> None:
        if not (horizon_s > 0 and every_s > 0) or not levels or min(levels) <= 0:
            raise ValueError(f"oracle: horizon and period must be > 0 s and levels > 0, got {horizon_s}, {every_s}, "
                             f"{levels}")
        self.horizon_s, self.every_s, self.levels, self.evict_at = horizon_s, every_s, tuple(levels), evict_at
        self.name = "oracle"
        self.engine_overrides = {"overcommit_min": min(levels), "overcommit_max": math.inf}
        self.env = None
        self._next = 0.0
        self.chosen: list[tuple[float, float, bool]] = []  # (engine time, factor, evicting at evict_at)
        self._evicting = True

    def reset(self, seed: int | None = None, env=None) -> None:
        if env is None:
            raise ValueError("the oracle looks inside its environment: rlctl eval gives it one")
        self.env, self._next, self.chosen, self._evicting = env, 0.0, [], True

    def candidates(self) -> tuple[float, ...]:
        scenario = self.env.scenario
        cfg = scenario.engine_config()
        levels = {f for f in self.levels if f <= cfg.overcommit_max}
        if min(self.levels) <= scenario.best_static <= cfg.overcommit_max:
            levels.add(scenario.best_static)
        return tuple(sorted(levels)) + ((math.inf,) if cfg.oom_mode == "preempt" else ())

    def plans(self) -> list[tuple[float, bool]]:
        """(factor, whether to evict at ``evict_at``) pairs to score: a crashing engine always evicts
        (the shield's rule there); a preempting one may evict or recompute, whichever scores better."""
        preempting = self.env.scenario.engine_config().oom_mode == "preempt"
        return [(f, evicting) for f in self.candidates() for evicting in ((False, True) if preempting else (True,))]

    def score(self, factor: float, evicting: bool = True) -> float:
        """The reward a copy of the engine earns holding ``factor`` over the horizon (evicting to
        host at ``evict_at`` of the KV in use, or not); the mean over ``futures``' copies."""
        return float(np.mean([self._score(e, factor, evicting) for e in self.futures()]))

    def futures(self) -> list:
        """The copies of the engine a plan is scored on: one, with the true future."""
        return [clone(self.env.engine)]

    def _score(self, e, factor: float, evicting: bool) -> float:
        env = self.env
        e.set_overcommit(factor)
        start = metrics.mark(e)
        before = generated_so_far(e)
        events, interval = deque(env.events), env.scenario.decision_interval_s
        snap = e.last_snapshot
        for k in range(1, int(self.horizon_s / interval) + 1):
            snap = run_interval(e, self._rule(snap, evicting), start.time_s + k * interval, events,
                                env.scenario.evict_free_share).snapshot
        figures = metrics.since(e, start)
        span = figures["duration_s"]
        good = figures["goodput_tokens_per_s"] * span + work_under_way(e, before)
        w, interval = env.scenario.reward, env.scenario.decision_interval_s
        return w.alpha * good / (env.tokens_per_s_scale * interval) - w.omega * figures["oom_events"]

    def _rule(self, snap, evicting: bool) -> int:
        return (EVICT if evicting and snap is not None and not snap.restarting and snap.alloc_ratio >= self.evict_at
                else HOLD)

    def act(self, obs: np.ndarray) -> int:
        e = self.env.engine
        if e.clock >= self._next:
            self._next = e.clock + self.every_s
            scores = {plan: self.score(*plan) for plan in self.plans()}
            # a tie means the factor does not bind within the horizon: the larger one admits what
            # arrives before the next plan without changing what the horizon showed (and on a tie
            # between evicting and not, not: nothing moves to the host that need not)
            factor, self._evicting = max(scores, key=lambda p: (scores[p], p[0], not p[1]))
            e.set_overcommit(factor)
            self.chosen.append((e.clock, factor, self._evicting))
        return self._rule(e.last_snapshot, self._evicting)


class Lookahead(Oracle):
    """``lookahead``: the oracle without the output lengths. Each plan is scored on ``samples``
    copies of the engine in which every request not yet finished (running, waiting, on the host,
    still to arrive) stops at a length drawn from what the episode has shown so far, not at its
    own: the Kaplan-Meier estimate over the requests finished (their output lengths) and those
    still running (at least what they have generated), drawn given what each has generated, with
    the mass past the longest output seen put at the request's declared ``max_tokens``. Arrival
    times, prompts and the co-tenant's schedule stay known. Every plan of one decision is scored on the same draws. Where
    it gets as much as the oracle, the oracle's headroom did not need the output lengths; where
    it gets less, the difference is what knowing them was worth to this search. An evaluation
    reference, like the oracle; never served.

    ``warm`` (``lookahead:N:warm``): the estimate also holds the output lengths of one other episode
    of the same workload (drawn with another seed), as a server that has been serving the workload
    for a while knows their distribution, where an episode's own few minutes cannot show the long
    ones (they are still running when it ends). It knows the distribution, not the lengths."""

    def __init__(self, samples: int = 2, warm: bool = False, **kwargs) -> None:
        super().__init__(**kwargs)
        if isinstance(samples, bool) or not isinstance(samples, int) or samples < 1:
            raise ValueError(f"lookahead: samples must be a whole number >= 1, got {samples!r}")
        self.samples, self.warm = samples, bool(warm)
        self.name = ("lookahead" if samples == 2 and not warm else f"lookahead:{samples}") + (":warm" if warm else "")
        self._seed, self._decisions, self._draws, self.history = 0, 0, (None, []), []

    def reset(self, seed: int | None = None, env=None) -> None:
        super().reset(seed, env)
        self._seed, self._decisions, self._draws = seed or 0, 0, (None, [])
        sc = env.scenario
        self.history = earlier_outputs(sc.workload, sc.episode_s, env.engine.max_model_len, self._seed) if self.warm else []

    def act(self, obs: np.ndarray) -> int:
        if self.env.engine.clock >= self._next:
            self._decisions += 1  # a new decision: new draws, shared by its plans
        return super().act(obs)

    def draws(self) -> list[dict[str, int]]:
        """``samples`` draws of every unfinished request's length (request id -> length)."""
        engine = self.env.engine
        lengths, survival = output_length_estimate(engine, self.history)
        s = engine.scheduler
        unfinished = [p[2] for p in s.pending] + s.unfinished()
        out = []
        for k in range(self.samples):
            rng = np.random.default_rng([self._seed, self._decisions, k])
            out.append({q.id: draw_length(lengths, survival, q.num_generated, q.request.max_tokens, rng)
                        for q in unfinished})
        return out

    def futures(self) -> list:
        """The copies, every plan of one decision on the same draws (made once, at its first plan)."""
        key = (self._decisions, self.env.engine.clock)
        if self._draws[0] != key:
            self._draws = key, self.draws()
        copies = []
        for drawn in self._draws[1]:
            e = clone(self.env.engine)
            s = e.scheduler
            for seq in [p[2] for p in s.pending] + s.unfinished():
                seq.stop_at = drawn[seq.id]
            copies.append(e)
        return copies


def output_length_estimate(engine, history=()) -> tuple[np.ndarray, np.ndarray]:
    """``kaplan_meier`` over ``engine``'s requests: the finished ones' output lengths (and the
    lengths in ``history``), and what the ones still going have generated."""
    return kaplan_meier(list(history) + [r.output_len for r in engine.completed if r.output_len > 0],
                        [q.num_generated for q in engine.scheduler.unfinished() if q.num_generated > 0])




def draw_length(lengths: np.ndarray, survival: np.ndarray, generated: int, max_tokens: int, rng) -> int:
    """One output length for a request that has generated ``generated`` tokens, from the estimate
    (``output_length_estimate``) given that it goes past ``generated``; the estimate's mass past
    its longest length, and everything where it has none, stops at ``max_tokens``."""
    later = lengths > generated
    first = int(np.argmax(later)) if later.any() else len(lengths)
    before = survival[first - 1] if first > 0 else 1.0  # the share going past ``generated``
    if before <= 0 or first == len(lengths):
        return int(max_tokens)
    mass = np.diff(np.concatenate(([before], survival[first:]))) * -1.0  # P(L = lengths[i]) for i >= first
    u = rng.random() * before
    i = int(np.searchsorted(np.cumsum(mass), u, side="right"))
    return int(min(lengths[first + i], max_tokens)) if i < len(mass) else int(max_tokens)
