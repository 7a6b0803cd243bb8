"""A fallback against the parking: a trained policy that holds its factor at the floor while
requests wait over a mostly idle KV is overridden by a fixed factor until the queue drains.

The shipped weights park on short and mixed outputs over a small KV (README, "Where it stands"):
backing off grows the queue, and a queue large against the KV reads to them as reason to back off
(docs/experiments.md). ``Unpark`` wraps a policy and watches what it sees:

- parked: the factor at its floor (``overcommit_min``), requests waiting, less than ``below`` of
  the KV in use, the engine not restarting;
- after ``after`` parked decisions in a row it engages: it scales the factor up to ``factor`` and
  holds it there, whatever the policy asks, until no request waits or the engine restarts;
- the first restart it sees (an OOM: the engine crashed) disarms it for the rest of the episode:
  a fallback that pushes memory use up does not push again where memory has run out once.

The shield still filters every action it takes. It reads only the observation (env/observation.py),
so it needs the scales the policy was trained at. An evaluation spec for now
(``unpark:F:POLICY``, agents/spec.py), not served.
"""
from __future__ import annotations

import numpy as np

from agents.policy import Policy
from engine.config import EngineConfig
from engine.control import HOLD, SCALE_UP
from env.observation import FEATURES
from env.scenario import Observation

_OVERCOMMIT, _QUEUE, _ALLOC, _RESTARTING = (FEATURES.index(f) for f in ("overcommit", "queue_len", "alloc_ratio",
                                                                         "restarting"))


class Unpark(Policy):
    def __init__(self, inner: Policy, factor: float, scales: Observation = Observation(),
                 floor: float = EngineConfig.overcommit_min, after: int = 3, below: float = 0.5,
                 step: float = EngineConfig.overcommit_step) -> None:
        if not factor > floor:
            raise ValueError(f"unpark: the fallback factor must be above the floor {floor:g}, got {factor:g}")
        self.inner, self.factor, self.scales, self.floor = inner, factor, scales, floor
        self.after, self.below, self.step = after, below, step
        self.name = f"unpark:{factor:g}:{inner.name}"
        self.engine_overrides = inner.engine_overrides
        self.reset()

    def reset(self, seed: int | None = None, env=None) -> None:
        self.inner.reset(seed, env)
        self.parked, self.engaged, self.armed = 0, False, True
        self.engagements = 0  # decisions taken over this episode

    def act(self, obs: np.ndarray) -> int:
        action = self.inner.act(obs)
        factor = float(obs[_OVERCOMMIT]) * self.scales.overcommit_scale
        waiting, restarting = obs[_QUEUE] > 0, obs[_RESTARTING] > 0
        if restarting:
            self.armed, self.engaged = False, False
        if self.engaged and not waiting:
            self.engaged = False
        parked = self.armed and waiting and factor <= self.floor * 1.001 and obs[_ALLOC] < self.below
        self.parked = self.parked + 1 if parked else 0
        if self.parked >= self.after:
            self.engaged = True
        if not self.engaged:
            return action
        self.engagements += 1
        return SCALE_UP if factor * self.step <= self.factor * 1.001 else HOLD
