"""Episodes from several scenarios in one Gymnasium env: what one policy for many trains on.

Each ``reset`` draws a scenario (from the env's own seeded generator, so a seed gives a sequence
of scenarios and workloads), each alike or by its ``weights``, and runs its episode; ``step`` is
that scenario's. Every scenario
must share the observation's scales, so that a feature means the same number in all of them.
"""
from __future__ import annotations

import gymnasium as gym

from env.overcommit_env import OvercommitEnv
from env.scenario import Scenario


class MixtureEnv(gym.Env):
    metadata = {"render_modes": []}

    def __init__(self, scenarios: list[Scenario], shield=None, shaping_gamma: float | None = None,
                 weights: list[float] | None = None, backlog=None) -> None:
        if not scenarios:
            raise ValueError("a mixture needs at least one scenario")
        if weights is not None and (len(weights) != len(scenarios) or min(weights) <= 0):
            raise ValueError(f"a mixture's weights: one > 0 for each of its {len(scenarios)} scenarios, got {weights}")
        self.shares = None if weights is None else [w / sum(weights) for w in weights]
        scales = {sc.observation for sc in scenarios}
        if len(scales) > 1:
            raise ValueError(f"the scenarios of a mixture must share their observation scales, got {sorted(map(str, scales))}")
        self.envs = [OvercommitEnv(sc, shield=shield, shaping_gamma=shaping_gamma, backlog=backlog) for sc in scenarios]
        self.observation_space = self.envs[0].observation_space
        self.action_space = self.envs[0].action_space
        self.current = self.envs[0]

    @property
    def scenario(self) -> Scenario:
        return self.current.scenario

    @property
    def engine(self):
        return self.current.engine

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        super().reset(seed=seed)
        # without weights, the draw every unweighted run has made (equal weights given draw otherwise)
        k = (self.np_random.integers(len(self.envs)) if self.shares is None
             else self.np_random.choice(len(self.envs), p=self.shares))
        self.current = self.envs[int(k)]
        return self.current.reset(seed=int(self.np_random.integers(2**31)), options=options)

    def step(self, action):
        return self.current.step(action)
