"""``rlctl/Overcommit-v0``: the engine, a workload and a decision interval as a Gymnasium env.

Each step is one decision interval (``engine.control.run_interval``, the loop the live engine
uses too): apply one of docs/design.md's five actions, run the engine for ``decision_interval_s`` of
engine time (the tensor-free ``ProfiledExecutor`` on the deployment's roofline clock, or a given
cost model), and return the observation of the snapshot taken then.

Reward, each term over the interval just ended (``engine.metrics.since``), weights from the
scenario's ``reward``:

    r = alpha * throughput + beta * alloc - gamma * slo_violation - omega * ooms

- throughput: output tokens of requests that finished in the interval and met the SLO (every
  finished one when no SLO is set), per second, over ``tokens_per_s_scale`` (default: the
  deployment's full-batch decode rate, so about 1 at best). A request counts once, when it
  finishes, so tokens recomputed after a crash earn nothing twice.
- alloc: mean KV utilisation over the interval's iterations, in [0, 1].
- slo_violation: share of the requests that finished in the interval or are waiting at its end
  that missed (or, waiting, already exceed) the TTFT/TPOT target, in [0, 1]; 0 without an SLO.
- ooms: OOM events in the interval. With omega = 10 one OOM costs more than any interval can earn.

Episodes end when the workload is served (terminated), at an OOM if ``terminate_on_oom``
(terminated), or after ``max_steps`` (truncated). ``info`` carries the raw figures of the step,
and at the end of an episode ``summary``: ``engine.metrics.summarize`` of the whole episode, so
that evaluation never recomputes a figure differently.
"""
from __future__ import annotations

from collections import deque
from pathlib import Path

import gymnasium as gym
import numpy as np
from gymnasium import spaces

from engine import metrics
from engine.control import ACTIONS, Event, run_interval
from engine.engine import Engine
from engine.executor import ProfiledExecutor
from engine.metrics import summarize
from engine.roofline import DEPLOYMENTS
from engine.scheduler import BatchShape
from env.observation import FEATURES, HIGH, LOW, observe
from env.scenario import Scenario
from env.scenario_yaml import load_scenario
from env.workload_builder import episode_requests

# reward term -> (weight of the scenario's ``reward``, sign)
REWARD_TERMS = {"throughput": ("alpha", 1.0), "alloc": ("beta", 1.0), "slo_violation": ("gamma", -1.0),
                "ooms": ("omega", -1.0)}


class OvercommitEnv(gym.Env):
    """See the module docstring. ``engine_overrides`` pin engine settings for every episode (a
    baseline's: ``{"overcommit": inf, "oom_mode": "preempt"}`` for vllm); ``reset(options=
    {"engine": {...}})`` does it for one. ``shield`` (agents/shield.py) filters every action."""

    metadata = {"render_modes": []}

    def __init__(self, scenario: Scenario | str | Path = "burst", engine_overrides: dict | None = None,
                 cost_model=None, shield=None) -> None:
        self.scenario = scenario if isinstance(scenario, Scenario) else load_scenario(scenario)
        self.deployment = DEPLOYMENTS[self.scenario.deployment]
        self.cost = cost_model or self.deployment.cost_model()
        self.engine_overrides = dict(engine_overrides or {})
        self.shield = shield
        self.observation_space = spaces.Box(LOW, HIGH, dtype=np.float32)
        self.action_space = spaces.Discrete(len(ACTIONS))
        self.feature_names = FEATURES
        cfg = self.scenario.engine_config()
        r = self.scenario.reward
        full = BatchShape(cfg.max_num_seqs, cfg.max_num_seqs * 1024, cfg.max_num_seqs * 1024)
        self.tokens_per_s_scale = r.tokens_per_s_scale or cfg.max_num_seqs / self.cost.iteration_s(full)
        self.engine: Engine | None = None

    # ---- episode -------------------------------------------------------------------------------
    def reset(self, *, seed: int | None = None, options: dict | None = None):
        super().reset(seed=seed)
        sc, rng = self.scenario, self.np_random
        overrides = {**self.engine_overrides, **((options or {}).get("engine") or {})}
        factor = overrides.pop("overcommit", None)
        cfg = sc.engine_config(seed=int(rng.integers(2**31)), **overrides)
        if factor is not None:  # a pinned factor (a static policy's) is in range by definition
            cfg = cfg.pinned(float(factor))
        self.engine = Engine(self.deployment.model, cfg, executor=ProfiledExecutor(self.cost))
        requests, self.workload_line = episode_requests(sc.workload, sc.episode_s, self.engine.max_model_len, rng)
        for req in requests:
            self.engine.submit(req)
        self._events = self._cotenant_events(rng)
        self._steps = 0
        self.shield_overrides = 0
        self.actions_taken = [0] * len(ACTIONS)
        while self._events and self._events[0][0] <= 0.0:
            self._events.popleft()[1](self.engine)
        snap = self.engine.snapshot()
        return observe(snap, sc.observation, self.engine.max_model_len), {
            "time_s": 0.0, "workload": self.workload_line, "requests": len(requests), "overcommit": self.engine.overcommit}

    def _cotenant_events(self, rng: np.random.Generator) -> deque[Event]:
        """The co-tenant's schedule: its share of device memory, redrawn after each hold."""
        c = self.scenario.cotenant
        events: deque[Event] = deque()
        if c is None:
            return events
        t = 0.0
        while t < self.scenario.episode_s:
            share = float(rng.choice(c.levels))
            events.append((t, lambda e, share=share: e.device.set_tenants(int(share * e.device.capacity))))
            t += float(rng.exponential(c.mean_hold_s))
        return events

    def step(self, action):
        if self.engine is None:
            raise RuntimeError("step() before reset()")
        if not self.action_space.contains(action):
            raise ValueError(f"action must be one of 0..{len(ACTIONS) - 1} ({', '.join(ACTIONS)}), got {action!r}")
        sc, e = self.scenario, self.engine
        requested = int(action)
        applied = requested if self.shield is None else self.shield.filter(requested, e.last_snapshot)
        self.shield_overrides += applied != requested
        self.actions_taken[applied] += 1
        start = metrics.mark(e)
        self._steps += 1
        interval = run_interval(e, applied, self._steps * sc.decision_interval_s, self._events, sc.evict_free_share)
        obs = observe(interval.snapshot, sc.observation, e.max_model_len)
        figures = metrics.since(e, start)
        terms = {"throughput": figures["goodput_tokens_per_s"] / self.tokens_per_s_scale, "alloc": figures["kv_util"],
                 "slo_violation": figures["slo_violation"], "ooms": figures["oom_events"]}
        weighted = {k: sign * getattr(sc.reward, w) * terms[k] for k, (w, sign) in REWARD_TERMS.items()}
        reward = weighted["throughput"] + weighted["alloc"] + weighted["slo_violation"] + weighted["ooms"]
        waiting, running, swapped = e.queue_lengths()
        info = {
            "time_s": e.clock, "step": self._steps, "action": ACTIONS[requested], "applied_action": ACTIONS[applied],
            "overcommit": e.overcommit, "generated_tokens_per_s": figures["generated_tokens_per_s"],
            "goodput_tokens_per_s": figures["goodput_tokens_per_s"], "kv_util": figures["kv_util"],
            "requests_completed": figures["requests_completed"], "queue_len": waiting, "running": running,
            "swapped": swapped, "oom_events": figures["oom_events"], "oom_total": e.counters.oom_events,
            "preemptions": e.counters.preemptions, "restarting": e.down_until is not None,
            "ttft_p50_s": figures["ttft_p50_s"], "shield_overrides": self.shield_overrides, **interval.effect,
            "reward_terms": terms, "weighted_reward_terms": weighted,
        }
        terminated = not e.has_work() or (sc.terminate_on_oom and terms["ooms"] > 0)
        truncated = not terminated and self._steps >= sc.max_steps
        if terminated or truncated:
            info["summary"] = self.summary()
        return obs, float(reward), terminated, truncated, info

    def summary(self) -> dict:
        """The episode so far: ``summarize`` of the engine plus what the controller did."""
        e = self.engine
        return {**summarize(e), "shield_overrides": self.shield_overrides, "steps": self._steps,
                "actions": dict(zip(ACTIONS, self.actions_taken)), "final_overcommit": e.overcommit,
                "workload": self.workload_line, "scenario": self.scenario.name,
                "clock": "cost model: " + self.cost.describe()}


def make_env(scenario: Scenario | str | Path = "burst", **kwargs) -> OvercommitEnv:
    return OvercommitEnv(scenario, **kwargs)
