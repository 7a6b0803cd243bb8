"""``rlctl/Overcommit-v0``: the engine, a workload and a decision interval as a Gymnasium env.

Each step applies one of DESIGN.md's five actions, runs the engine for ``decision_interval_s``
of engine time (the tensor-free ``ProfiledExecutor`` on the deployment's roofline clock, or a
given cost model) and returns the observation of the snapshot taken then.

Reward, each term over the interval just ended, weights from the scenario's ``reward``:

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

from pathlib import Path

import gymnasium as gym
import numpy as np
from gymnasium import spaces

from engine.engine import Engine
from engine.executor import ProfiledExecutor
from engine.metrics import meets_slo, summarize
from engine.roofline import DEPLOYMENTS
from engine.scheduler import BatchShape
from env.observation import FEATURES, HIGH, LOW, observe
from env.scenario import Scenario, load_scenario
from env.workload_builder import episode_requests

ACTIONS = ("hold", "scale_up", "back_off", "defrag", "evict")
HOLD, SCALE_UP, BACK_OFF, DEFRAG, EVICT = range(len(ACTIONS))


def apply_action(engine: Engine, action: int, evict_free_share: float) -> dict:
    """Apply one of ``ACTIONS`` to ``engine`` now (between iterations); what it did."""
    if action == SCALE_UP:
        engine.set_overcommit(engine.overcommit + engine.config.overcommit_step)
    elif action == BACK_OFF:
        engine.set_overcommit(engine.overcommit - engine.config.overcommit_step)
    elif action == DEFRAG:
        r = engine.compact()
        return {"compacted_blocks": r.blocks, "copy_s": r.seconds}
    elif action == EVICT:
        r = engine.evict(evict_free_share)
        return {"evicted_blocks": r.blocks, "copy_s": r.seconds}
    elif action != HOLD:
        raise ValueError(f"action must be one of 0..{len(ACTIONS) - 1} ({', '.join(ACTIONS)}), got {action!r}")
    return {}


def pinned(config_overrides: dict) -> dict:
    """Engine overrides with the overcommit range widened to admit a pinned factor."""
    o = dict(config_overrides)
    if "overcommit" in o:
        k = float(o["overcommit"])
        o.setdefault("overcommit_min", min(1.0, k))
        o["overcommit_max"] = max(o.get("overcommit_max", 2.0), k)
    return o


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
        overrides = pinned({**self.engine_overrides, **((options or {}).get("engine") or {})})
        cfg = sc.engine_config(seed=int(rng.integers(2**31)), **overrides)
        self.engine = Engine(self.deployment.model, cfg, executor=ProfiledExecutor(self.cost))
        requests, self.workload_line = episode_requests(sc.workload, sc.episode_s, self.engine.max_model_len, rng)
        for req in requests:
            self.engine.submit(req)
        self._tenant_changes = self._draw_cotenant(rng)
        self._steps, self._done_seen, self._its_seen = 0, 0, 0
        self._tokens_seen, self._ooms_seen = 0, 0
        self.shield_overrides = 0
        self.actions_taken = [0] * len(ACTIONS)
        self._apply_tenants()
        snap = self.engine.snapshot()
        return observe(snap, sc.observation, self.engine.max_model_len), {
            "time_s": 0.0, "workload": self.workload_line, "requests": len(requests), "overcommit": self.engine.overcommit}

    def _draw_cotenant(self, rng: np.random.Generator) -> list[tuple[float, float]]:
        c = self.scenario.cotenant
        if c is None:
            return []
        changes, t = [], 0.0
        while t < self.scenario.episode_s:
            changes.append((t, float(rng.choice(c.levels))))
            t += float(rng.exponential(c.mean_hold_s))
        return changes

    def _apply_tenants(self) -> None:
        e = self.engine
        while self._tenant_changes and self._tenant_changes[0][0] <= e.clock:
            _, share = self._tenant_changes.pop(0)
            e.device.set_tenants(int(share * e.device.capacity))

    def _advance(self, until: float) -> None:
        e = self.engine
        while e.clock < until:
            stop = min(until, self._tenant_changes[0][0]) if self._tenant_changes else until
            e.run(until=stop)
            self._apply_tenants()
            if not e.has_work() and e.clock < stop:
                break

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
        start = e.clock
        effect = apply_action(e, applied, sc.evict_free_share)
        self._steps += 1
        self._advance(self._steps * sc.decision_interval_s)
        snap = e.snapshot()
        obs = observe(snap, sc.observation, e.max_model_len)
        info = self._interval_info(start, requested, applied, effect)
        terms = info["reward_terms"]
        w = sc.reward
        reward = w.alpha * terms["throughput"] + w.beta * terms["alloc"] - w.gamma * terms["slo_violation"] - w.omega * terms["ooms"]
        terminated = not e.has_work() or (sc.terminate_on_oom and terms["ooms"] > 0)
        truncated = not terminated and self._steps >= sc.max_steps
        if terminated or truncated:
            info["summary"] = self.summary()
        return obs, float(reward), terminated, truncated, info

    def _interval_info(self, start: float, requested: int, applied: int, effect: dict) -> dict:
        e, cfg = self.engine, self.engine.config
        now = e.clock
        span = max(now - start, 1e-9)
        done = e.completed[self._done_seen:]
        self._done_seen = len(e.completed)
        its = e.iterations[self._its_seen:]
        self._its_seen = len(e.iterations)
        good = [r for r in done if meets_slo(r, cfg.ttft_slo_s, cfg.tpot_slo_s)]
        if its:
            durations = np.array([it.duration_s for it in its])
            util = float(np.average([it.alloc_ratio for it in its], weights=durations)) if durations.sum() > 0 else its[-1].alloc_ratio
        else:
            util = e.kv.blocks.usage()
        slo_set = cfg.ttft_slo_s is not None or cfg.tpot_slo_s is not None
        late = 0
        if cfg.ttft_slo_s is not None:
            late = sum(1 for q in e.scheduler.waiting if q.record.first_token_s is None and now - q.record.arrival_s > cfg.ttft_slo_s)
        judged = len(done) + len(e.scheduler.waiting)
        violation = (len(done) - len(good) + late) / judged if slo_set and judged else 0.0
        ooms = e.counters.oom_events - self._ooms_seen
        self._ooms_seen = e.counters.oom_events
        tokens = e.counters.tokens_generated - self._tokens_seen
        self._tokens_seen = e.counters.tokens_generated
        goodput = sum(r.output_len for r in good) / span
        ttft = [r.ttft_s for r in done]
        return {
            "time_s": now, "step": self._steps, "action": ACTIONS[requested], "applied_action": ACTIONS[applied],
            "overcommit": e.overcommit, "tokens_per_s": tokens / span, "goodput_tokens_per_s": goodput,
            "kv_util": util, "requests_completed": len(done), "queue_len": len(e.scheduler.waiting),
            "running": len(e.scheduler.running), "swapped": len(e.scheduler.swapped), "oom_events": ooms,
            "oom_total": e.counters.oom_events, "preemptions": e.counters.preemptions,
            "restarting": e.down_until is not None, "ttft_p50_s": float(np.median(ttft)) if ttft else None,
            "shield_overrides": self.shield_overrides, **effect,
            "reward_terms": {"throughput": goodput / self.tokens_per_s_scale, "alloc": util,
                             "slo_violation": violation, "ooms": ooms},
        }

    def summary(self) -> dict:
        """The episode so far: ``summarize`` of the engine plus what the controller did."""
        e = self.engine
        return {**summarize(e), "shield_overrides": self.shield_overrides, "steps": self._steps,
                "actions": dict(zip(ACTIONS, self.actions_taken)), "final_overcommit": e.overcommit,
                "workload": self.workload_line, "scenario": self.scenario.name,
                "clock": "cost model: " + self.cost.describe()}


def make_env(scenario: Scenario | str | Path = "burst", **kwargs) -> OvercommitEnv:
    return OvercommitEnv(scenario, **kwargs)

