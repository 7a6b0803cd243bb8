"""``rlctl/SharedGPU-v0``: several engines on one GPU (engine/node.py) as a Gymnasium env.

Each step is one decision interval of the node (``engine.node_control.run_node_interval``): apply
one flat action over (engine, action) (0 holds every engine; then, per engine, scale up, back off,
defrag, evict, resize), run every engine in lockstep for ``decision_interval_s`` of engine time,
and observe (env/node_observation.py). Each engine runs its tenant's deployment on its roofline
clock derated by the tenant's share of the GPU's compute, its KV sized from its MPS limit.

Reward over the interval, the node's sums of each engine's figures (``engine.metrics.since``):

    r = alpha * goodput + kappa * late - gamma * slo_violation - omega * ooms - rho * recompute

goodput is the output tokens that finished within their tenant's SLO over what the node's
workloads ask for in an interval (their offered output tokens per second, on one draw, or where
that asks for nothing each tenant's ``asked_output_rate``), so an
episode's rewards add up to its node goodput; late is those that finished past it, on the same
scale (kappa 0 by default); slo_violation is the worst tenant's; an OOM of any engine costs omega.
A graceful restart (``resize``) costs what it costs: the engine's downtime and the recomputation
of what it held.

``reset(options={"engine": {...}})`` pins engine settings on every engine, as a baseline does;
``limits`` among them sets the MPS limits: ``scenario`` (the scenario's, the default),
``partition`` (each tenant its share) or a number K (K x each share, within the device).
Episodes end when every workload is served (terminated), at an OOM if ``terminate_on_oom``, or
after ``max_steps`` (truncated); ``info["summary"]`` then holds the node's figures and each
tenant's (``<name>/<figure>``).
"""
from __future__ import annotations

import gymnasium as gym
import numpy as np
from gymnasium import spaces

from engine import metrics
from engine.device import Device
from engine.executor import ProfiledExecutor
from engine.metrics import summarize
from engine.node import Node
from engine.node_control import action_names, run_node_interval
from engine.roofline import deployment
from engine.config import max_model_len
from env.node_observation import node_bounds, node_features, observe_node
from env.node_scenario import NodeScenario, load_node_scenario
from env.workload_builder import asked_output_rate, episode_requests

TENANT_FIGURES = ("goodput_tokens_per_s", "slo_attainment", "requests_completed", "requests_unfinished", "oom_events",
                  "preemptions", "ttft_p99_s", "kv_util_mean", "restarts", "requests_abandoned")


class SharedGPUEnv(gym.Env):
    """See the module docstring. ``shield`` (agents/shield.py ``NodeShield``) filters every action."""

    metadata = {"render_modes": []}

    def __init__(self, scenario: NodeScenario | str = "node_chat_pair", engine_overrides: dict | None = None,
                 shield=None) -> None:
        self.scenario = load_node_scenario(scenario)
        self.names = self.scenario.names
        self.engine_overrides = dict(engine_overrides or {})
        self.shield = shield
        low, high = node_bounds(self.names)
        self.observation_space = spaces.Box(low, high, dtype=np.float32)
        self.action_names = action_names(self.names)
        self.action_space = spaces.Discrete(len(self.action_names))
        self.feature_names = node_features(self.names)
        self.shares = {t.name: t.share for t in self.scenario.tenants}
        self.tokens_per_s_scale = self.scenario.reward.tokens_per_s_scale or offered_output_rate(self.scenario)
        self.node: Node | None = None

    @property
    def engine(self):
        """The first engine (what a caller written for one engine reads, such as its clock)."""
        return next(iter(self.node.engines.values()))

    # ---- episode -------------------------------------------------------------------------------
    def reset(self, *, seed: int | None = None, options: dict | None = None):
        super().reset(seed=seed)
        sc, rng = self.scenario, self.np_random
        overrides = {**self.engine_overrides, **((options or {}).get("engine") or {})}
        rule = overrides.pop("limits", "scenario")
        factor = overrides.pop("overcommit", None)
        self.node = Node(Device(sc.gpu.memory_bytes), sc.slice_s)
        for t in sc.tenants:
            cfg = sc.engine_config(t, seed=int(rng.integers(2**31)), **overrides)
            if factor is not None:
                cfg = cfg.pinned(float(factor))
            self.node.add(t.name, deployment(t.deployment).model, cfg, sc.limit_bytes(t, rule),
                          executor=ProfiledExecutor(sc.cost_model(t)))
        workloads = node_requests(sc, {n: e.max_model_len for n, e in self.node.engines.items()}, rng)
        self.workload_lines = {}
        for name, (requests, line) in workloads.items():
            for req in requests:
                self.node.engines[name].submit(req)
            self.workload_lines[name] = line
        self._steps = 0
        self.shield_overrides = 0
        self.actions_taken = [0] * len(self.action_names)
        self.snapshots = {n: e.snapshot() for n, e in self.node.engines.items()}
        info = {"time_s": 0.0, "workload": self.workload_lines, "limits": self.node.limits(),
                "requests": sum(len(r) for r, _ in workloads.values())}
        return observe_node(self.node, self.snapshots, self.shares, sc.observation), info

    def step(self, action):
        if self.node is None:
            raise RuntimeError("step() before reset()")
        if not self.action_space.contains(action):
            raise ValueError(f"action must be one of 0..{self.action_space.n - 1} ({', '.join(self.action_names)}), "
                             f"got {action!r}")
        sc, node = self.scenario, self.node
        requested = int(action)
        applied = requested if self.shield is None else self.shield.filter(requested, self.snapshots)
        self.shield_overrides += applied != requested
        self.actions_taken[applied] += 1
        marks = {n: metrics.mark(e) for n, e in node.engines.items()}
        self._steps += 1
        interval = run_node_interval(node, applied, self._steps * sc.decision_interval_s, None, sc.evict_free_share)
        self.snapshots = interval.snapshots
        obs = observe_node(node, self.snapshots, self.shares, sc.observation)
        figures = {n: metrics.since(e, marks[n]) for n, e in node.engines.items()}
        per_interval = self.tokens_per_s_scale * sc.decision_interval_s
        terms = {"goodput": sum(f["goodput_tokens"] for f in figures.values()) / per_interval,
                 "late": sum(f["late_tokens"] for f in figures.values()) / per_interval,
                 "slo_violation": max(f["slo_violation"] for f in figures.values()),
                 "ooms": sum(f["oom_events"] for f in figures.values()),
                 "recompute": sum(f["recomputed_tokens"] for f in figures.values()) / per_interval}
        w = sc.reward
        weighted = {"goodput": w.alpha * terms["goodput"], "late": w.kappa * terms["late"],
                    "slo_violation": -w.gamma * terms["slo_violation"], "ooms": -w.omega * terms["ooms"],
                    "recompute": -w.rho * terms["recompute"]}
        reward = sum(weighted.values())
        engines = node.engines.values()
        span = sc.decision_interval_s
        info = {
            "time_s": node.clock, "step": self._steps, "action": self.action_names[requested],
            "applied_action": self.action_names[applied], "effect": interval.effect,
            "overcommit": float(np.mean([min(e.overcommit, 16.0) for e in engines])),
            "kv_util": float(np.mean([f["kv_util"] for f in figures.values()])),
            "device_used": node.device.used / node.device.capacity,
            "generated_tokens_per_s": sum(f["generated_tokens_per_s"] * f["duration_s"] for f in figures.values()) / span,
            "goodput_tokens_per_s": sum(f["goodput_tokens"] for f in figures.values()) / span,
            "queue_len": sum(e.queue_lengths()[0] for e in engines), "oom_events": terms["ooms"],
            "oom_total": sum(e.counters.oom_events for e in engines), "preemptions": sum(e.counters.preemptions for e in engines),
            "restarts": sum(e.counters.restarts for e in engines), "shield_overrides": self.shield_overrides,
            "engines": {n: {"overcommit": e.overcommit, "kv_util": figures[n]["kv_util"], "queue_len": e.queue_lengths()[0],
                            "limit": e.device.capacity, "held": e.device.used, "restarting": e.down_until is not None}
                        for n, e in node.engines.items()},
            "reward_terms": terms, "weighted_reward_terms": weighted,
        }
        terminated = not node.has_work() or (sc.terminate_on_oom and terms["ooms"] > 0)
        truncated = not terminated and self._steps >= sc.max_steps
        if terminated or truncated:
            info["summary"] = self.summary()
        return obs, float(reward), terminated, truncated, info

    def summary(self) -> dict:
        """The episode so far: the node's figures and each tenant's (``summarize`` of its engine)."""
        return {**node_summary(self.node), "shield_overrides": self.shield_overrides, "steps": self._steps,
                "actions": dict(zip(self.action_names, self.actions_taken)), "workload": self.workload_lines,
                "scenario": self.scenario.name, "limits": self.node.limits(),
                "clock": "; ".join(f"{t.name}: {self.scenario.cost_model(t).describe()} x {t.compute_share:g} of the GPU"
                                   for t in self.scenario.tenants)}


def node_summary(node: Node) -> dict:
    """A node's figures from its engines' ``summarize``: sums of tokens, requests and events over
    the node's span; the worst tenant's latency percentiles and SLO attainment beside the node's;
    and every tenant's own figures as ``<name>/<figure>``."""
    per = {n: {**summarize(e), "restarts": e.counters.restarts} for n, e in node.engines.items()}
    span = max(node.clock, 1e-9)
    total = lambda key: sum(p[key] * p["duration_s"] for p in per.values()) / span  # noqa: E731
    count = lambda key: sum(p[key] for p in per.values())  # noqa: E731
    worst = lambda key: max((p[key] for p in per.values() if p[key] is not None), default=None)  # noqa: E731
    done = count("requests_completed")
    met = sum(p["slo_attainment"] * p["requests_completed"] for p in per.values() if p["slo_attainment"] is not None)
    out = {"duration_s": span, "goodput_tokens_per_s": total("goodput_tokens_per_s"), "tokens_per_s": total("tokens_per_s"),
           "generated_tokens_per_s": total("generated_tokens_per_s"), "ontime_tokens_per_s": total("ontime_tokens_per_s"),
           **{k: count(k) for k in ("requests_submitted", "requests_completed", "requests_unfinished", "oom_events",
                                    "preemptions", "recomputed_tokens", "swap_out_blocks", "swap_in_blocks",
                                    "compactions", "restarts", "requests_abandoned")},
           "slo_attainment": met / done if done else None,
           "slo_attainment_min": min((p["slo_attainment"] for p in per.values() if p["slo_attainment"] is not None),
                                     default=None),
           "kv_util_mean": float(np.mean([p["kv_util_mean"] for p in per.values()])),
           "kv_util_p99": max(p["kv_util_p99"] for p in per.values()),
           **{k: worst(k) for k in ("ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "tpot_p99_s")}}
    for name, p in per.items():
        out.update({f"{name}/{k}": p[k] for k in TENANT_FIGURES})
    return out


def node_requests(sc: NodeScenario, max_model_lens: dict[str, int], rng: np.random.Generator) -> dict:
    """Every tenant's requests of one episode, {name: (requests, line)}: one draw of the node's
    phase clock, each phased tenant in its phase shifted by its offset."""
    spans = sc.phase_spans(rng)
    out = {}
    for t in sc.tenants:
        shifted = [(start, span, k + t.phase_offset) for start, span, k in spans] if spans else None
        out[t.name] = episode_requests(t.workload, sc.episode_s, max_model_lens[t.name], rng, shifted)
    return out


def offered_output_rate(sc: NodeScenario) -> float:
    """Output tokens per second the node's workloads ask for (each request's real output, up to
    its max_tokens), on one reference draw: the goodput normaliser. Where that draw asks for nothing
    (traces' windows in their gaps), the sum of each tenant's ``asked_output_rate``."""
    lens = {t.name: max_model_len(deployment(t.deployment).model, sc.engine_config(t)) for t in sc.tenants}
    requests = node_requests(sc, lens, np.random.default_rng(0))
    total = sum(min(r.output_len, r.max_tokens) for reqs, _ in requests.values() for r in reqs)
    rate = total / sc.episode_s or sum(asked_output_rate(t.workload, sc.episode_s, lens[t.name]) for t in sc.tenants)
    if not rate:
        raise ValueError(f"node scenario {sc.name}: its workloads ask for no output, so goodput has nothing to be "
                         "measured against")
    return rate
