"""Running policies on scenario episodes: the figures ``rlctl eval`` prints and plots.

Every figure comes from the environment's ``info``: the per-step raw figures for the time
series, and ``summary`` (``engine.metrics.summarize``) at the end of each episode. Episode k of
every policy uses seed ``seed + k``, so all policies see the same workloads.
"""
from __future__ import annotations

import numpy as np

from agents.baselines import Policy
from env.overcommit_env import OvercommitEnv

SERIES = ("time_s", "kv_util", "overcommit", "queue_len", "oom_events", "preemptions", "tokens_per_s")


def run_episode(env: OvercommitEnv, policy: Policy, seed: int) -> tuple[dict, dict[str, list]]:
    """One episode of ``policy``; its summary and its time series."""
    obs, info = env.reset(seed=seed, options={"engine": policy.engine_overrides})
    policy.reset(seed)
    series = {k: [] for k in SERIES}
    rewards = []
    while True:
        obs, reward, terminated, truncated, info = env.step(policy.act(obs))
        rewards.append(reward)
        for k in SERIES:
            series[k].append(info[k])
        if terminated or truncated:
            return {**info["summary"], "episode_reward": float(np.sum(rewards))}, series


def evaluate(env: OvercommitEnv, policy: Policy, episodes: int = 1, seed: int = 0) -> dict:
    """Mean figures over ``episodes`` (and each episode's), plus the first episode's time series."""
    runs = [run_episode(env, policy, seed + k) for k in range(episodes)]
    summaries = [s for s, _ in runs]
    mean = {}
    for key, value in summaries[0].items():
        values = [s[key] for s in summaries]
        if isinstance(value, (int, float)) and not isinstance(value, bool) and all(v is not None for v in values):
            mean[key] = float(np.mean(values))
        else:
            mean[key] = value
    return {**mean, "policy": policy.name, "episodes": summaries, "series": runs[0][1]}
