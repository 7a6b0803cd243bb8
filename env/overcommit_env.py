"""``rlctl/Overcommit-v0``: the engine, a workload and a decision interval as a Gymnasium env.

Each step is one decision interval (``engine.control.run_interval``, the loop the live engine
uses too): apply one of docs/design.md's five actions, run the engine for ``decision_interval_s`` of
engine time (the tensor-free ``ProfiledExecutor`` on the deployment's roofline clock, or a given
cost model), and return the observation of the snapshot taken then.

Reward, each term over the interval just ended (``engine.metrics.since``), weights from the
scenario's ``reward`` (env/scenario.py ``Reward``):

    r = alpha * goodput + kappa * late - gamma * slo_violation - omega * ooms - rho * recompute + beta * alloc

- goodput: output tokens of requests that finished in the interval and met the SLO (every
  finished one when no SLO is set), per ``decision_interval_s``, over ``tokens_per_s_scale`` (default: the
  scenario's offered output tokens per second, measured on one draw of its workload, or where that
  asks for nothing over the windows its episodes draw from: ``asked_output_rate``, so a step
  that serves all that is asked is about 1 on every deployment). A request counts once, when it
  finishes, so the rewards of an episode add up to its goodput (``tests/test_reward.py``).
- late: output tokens of requests that finished in the interval past their SLO, on goodput's
  scale (weight 0 by default: a late answer earns nothing).
- slo_violation: share of the requests that finished in the interval or are waiting at its end
  that missed (or, waiting, already exceed) the TTFT/TPOT target, in [0, 1]; 0 without an SLO.
- ooms: OOM events in the interval.
- recompute: tokens whose KV was lost to preemption or a crash in the interval (to be computed
  again), over what a step of the normaliser produces.
- alloc: mean KV utilisation over the interval's iterations, in [0, 1]; weight 0 by default.

Training may add potential-based shaping (``shaping_gamma``, Ng, Harada and Russell 1999):
``+ shaping_gamma * phi(s') - phi(s)``, with ``phi`` alpha times the tokens generated so far by the
unfinished requests still on track for their SLO (``engine.metrics.work_under_way``), plus kappa
times those of the ones no longer on track, on the goodput's scale. Goodput pays a request when it
finishes, which for a reasoning-length output is minutes after the admission that earned it; the
shaping pays its tokens as they come and takes them back when it finishes (when goodput pays them)
or falls off track (a crash, a preemption, a missed target), so that the credit is near the
decision. With ``shaping_gamma`` the agent's own
discount the optimal policy is unchanged. Off by default: evaluation scores the plain reward.

An episode's engine starts as a server long at work on its workload does: the window of finished
output lengths that ``expected_ratio`` reads (``Engine.output_lengths``) holds those of an earlier
stretch of the same workload (``earlier_outputs``, drawn from the engine's own seed, so no other
draw of the episode moves), not nothing; an episode's few minutes would not show it the long
outputs, which are still running when it ends. A trace's window starts empty.

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
from engine.roofline import deployment
from engine.config import max_model_len
from env.observation import FEATURES, HIGH, LOW, observe
from env.scenario import Backlog, Scenario
from env.scenario_yaml import load_scenario
from env.workload_builder import asked_output_rate, earlier_outputs, episode_requests, front_loaded

# reward term -> (weight of the scenario's ``reward``, sign)
REWARD_TERMS = {"goodput": ("alpha", 1.0), "late": ("kappa", 1.0), "slo_violation": ("gamma", -1.0),
                "ooms": ("omega", -1.0), "recompute": ("rho", -1.0), "alloc": ("beta", 1.0)}


class OvercommitEnv(gym.Env):
    """See the module docstring. ``engine_overrides`` pin engine settings for every episode (a
    baseline's: ``{"overcommit": inf, "oom_mode": "preempt"}`` for vllm); ``reset(options=
    {"engine": {...}})`` does it for one. ``shield`` (agents/shield.py) filters every action, sets the
    engine's admission headroom, and its ``view`` of each snapshot is what the policy observes.
    ``backlog`` (env/scenario.py ``Backlog``; training only) starts a share of episodes behind."""

    metadata = {"render_modes": []}

    def __init__(self, scenario: Scenario | str | Path = "burst", engine_overrides: dict | None = None,
                 cost_model=None, shield=None, shaping_gamma: float | None = None,
                 backlog: Backlog | None = None) -> None:
        if shaping_gamma is not None and not 0 <= shaping_gamma <= 1:
            raise ValueError(f"shaping_gamma must be in [0, 1] or None, got {shaping_gamma!r}")
        self.scenario = scenario if isinstance(scenario, Scenario) else load_scenario(scenario)
        self.deployment = deployment(self.scenario.deployment)
        self.cost = cost_model or self.deployment.cost_model()
        self.engine_overrides = dict(engine_overrides or {})
        self.shield = shield
        self.shaping_gamma = shaping_gamma
        self.backlog = backlog
        self.observation_space = spaces.Box(LOW, HIGH, dtype=np.float32)
        self.action_space = spaces.Discrete(len(ACTIONS))
        self.feature_names = FEATURES
        self.tokens_per_s_scale = self.scenario.reward.tokens_per_s_scale or offered_output_rate(self.scenario)
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
        self.engine.output_lengths.extend(earlier_outputs(sc.workload, sc.episode_s, self.engine.max_model_len, cfg.seed))
        requests, self.workload_line = episode_requests(sc.workload, sc.episode_s, self.engine.max_model_len, rng)
        if self.backlog is not None and rng.random() < self.backlog.share:
            kv_tokens = self.engine.kv.num_blocks * self.engine.pool.block_size
            requests = front_loaded(requests, float(rng.uniform(*self.backlog.kv)) * kv_tokens)
            self.workload_line += f"; starts behind: {sum(r.arrival_s == 0.0 for r in requests)} requests at time 0"
        for req in requests:
            self.engine.submit(req)
        self.events = self._cotenant_events(rng)
        self._steps = 0
        self.shield_overrides = 0
        self.actions_taken = [0] * len(ACTIONS)
        self._potential = 0.0
        while self.events and self.events[0][0] <= 0.0:
            self.events.popleft()[1](self.engine)
        snap = self.engine.snapshot()
        if self.shield is not None:
            self.engine.set_admit_headroom(self.shield.headroom(snap))
        return self._observe(snap), {
            "time_s": 0.0, "workload": self.workload_line, "requests": len(requests), "overcommit": self.engine.overcommit}

    def _observe(self, snapshot) -> np.ndarray:
        """The observation of ``snapshot`` as the shield has the policy see it (agents/shield.py)."""
        return observe(snapshot if self.shield is None else self.shield.view(snapshot), self.scenario.observation)

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
        if isinstance(action, (bool, np.bool_)) or not self.action_space.contains(action):  # True is not scale_up
            raise ValueError(f"action must be one of 0..{len(ACTIONS) - 1} ({', '.join(ACTIONS)}), got {action!r}")
        sc, e = self.scenario, self.engine
        requested = int(action)
        applied = requested if self.shield is None else self.shield.filter(requested, e.last_snapshot)
        if self.shield is not None:  # the headroom of this interval, as the sidecar's decision carries it
            e.set_admit_headroom(self.shield.headroom(e.last_snapshot))
        self.shield_overrides += applied != requested
        self.actions_taken[applied] += 1
        start = metrics.mark(e)
        self._steps += 1
        interval = run_interval(e, applied, self._steps * sc.decision_interval_s, self.events, sc.evict_free_share)
        obs = self._observe(interval.snapshot)
        figures = metrics.since(e, start)
        scale = self.tokens_per_s_scale
        # per nominal interval, so that an episode's rewards add up to its goodput tokens exactly
        terms = {"goodput": figures["goodput_tokens"] / (scale * sc.decision_interval_s),
                 "late": figures["late_tokens"] / (scale * sc.decision_interval_s),
                 "slo_violation": figures["slo_violation"],
                 "ooms": figures["oom_events"], "recompute": figures["recomputed_tokens"] / (scale * sc.decision_interval_s),
                 "alloc": figures["kv_util"]}
        weighted = {k: sign * getattr(sc.reward, w) * terms[k] for k, (w, sign) in REWARD_TERMS.items()}
        reward = sum(weighted.values())
        if self.shaping_gamma is not None:
            under_way = sc.reward.alpha * metrics.work_under_way(e)
            if sc.reward.kappa:  # the off-track pass only where late work is paid (kappa is 0 by default)
                under_way += sc.reward.kappa * metrics.work_under_way(e, late=True)
            potential = under_way / (scale * sc.decision_interval_s)
            weighted["shaping"] = self.shaping_gamma * potential - self._potential
            reward += weighted["shaping"]
            self._potential = potential
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


def offered_output_rate(scenario: Scenario) -> float:
    """Output tokens per second the scenario's workload asks for (each request's real output, up
    to its max_tokens), on one reference draw (``asked_output_rate``): the goodput normaliser."""
    cfg = scenario.engine_config()
    mml = max_model_len(deployment(scenario.deployment).model, cfg)
    rate = asked_output_rate(scenario.workload, scenario.episode_s, mml)
    if not rate:
        raise ValueError(f"scenario {scenario.name}: its workload asks for no output, so goodput has nothing to be "
                         "measured against")
    return rate


def make_env(scenario: Scenario | str | Path = "burst", **kwargs) -> OvercommitEnv:
    return OvercommitEnv(scenario, **kwargs)
