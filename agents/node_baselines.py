"""The policies a node controller is compared with (env/shared_gpu_env.py), as ``Policy`` objects.

Each sees the node's observation and returns one flat action (engine/node_control.py); its
``engine_overrides`` pin every engine's settings and, under ``limits``, the MPS limits.

- ``partition``: each engine its share of the device as its MPS limit and the conservative
  reservation within it (factor 1): no overcommit at all, what operators run today.
- ``overcommit:K``: each engine's MPS limit K x its share (within the device; the limits sum to K
  x the partition), the conservative reservation within it: overcommit across tenants only.
- ``static:K`` (agents/baselines.py ``Static``): every engine at factor K within the scenario's
  limits.
- ``watermark``: agents/baselines.py's rules on each engine's KV usage, within the scenario's
  limits; one decision moves one engine, the most urgent (stop > evict > back off > scale up,
  ties to the engine acted on least recently).
- ``vllm``, ``sglang``: each engine runs vLLM's or SGLang's own rule inside the static partition.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from agents.baselines import Watermark
from agents.policy import Policy
from engine.node_control import NODE_HOLD, encode_action
from env.node_observation import DEVICE_FEATURES, ENGINE_EXTRAS
from env.observation import FEATURES

ALLOC = FEATURES.index("alloc_ratio")
BLOCK = len(FEATURES) + len(ENGINE_EXTRAS)  # one engine's features in the node observation


def engines_in(obs: np.ndarray) -> int:
    """How many engines a node observation describes."""
    n, rest = divmod(len(obs) - len(DEVICE_FEATURES), BLOCK)
    if rest or n < 1:
        raise ValueError(f"a node observation has {BLOCK} features per engine and {len(DEVICE_FEATURES)} for the "
                         f"device, got {len(obs)}")
    return n


@dataclass
class Partition(Policy):
    name: str = "partition"
    engine_overrides: dict = field(default_factory=lambda: {"limits": "partition", "overcommit": 1.0})

    def act(self, obs: np.ndarray) -> int:
        return NODE_HOLD


@dataclass
class Overcommit(Policy):
    factor: float = 1.5
    name: str = ""

    def __post_init__(self) -> None:
        if math.isnan(self.factor) or self.factor <= 0:
            raise ValueError(f"policy overcommit:K: K must be > 0, got {self.factor}")
        self.name = self.name or f"overcommit:{self.factor:g}"
        self.engine_overrides = {"limits": self.factor, "overcommit": 1.0}

    def act(self, obs: np.ndarray) -> int:
        return NODE_HOLD


@dataclass
class PartitionVLLM(Policy):
    name: str = "vllm"
    engine_overrides: dict = field(default_factory=lambda: {"limits": "partition", "overcommit": math.inf,
                                                            "oom_mode": "preempt"})

    def act(self, obs: np.ndarray) -> int:
        return NODE_HOLD


@dataclass
class PartitionSGLang(Policy):
    name: str = "sglang"
    engine_overrides: dict = field(default_factory=lambda: {"limits": "partition", "admission": "sglang",
                                                            "oom_mode": "preempt"})

    def act(self, obs: np.ndarray) -> int:
        return NODE_HOLD


# watermark rules, most urgent first: (threshold test, engine action)
_RULES = ((lambda u, w: u >= w.stop, "back_off"), (lambda u, w: u >= w.evict, "evict"),
          (lambda u, w: u >= w.high, "back_off"), (lambda u, w: u < w.resume, "scale_up"))


@dataclass
class NodeWatermark(Watermark):
    """The one-engine watermark's thresholds, per engine; of the engines a rule hits, the one
    moved longest ago moves (one engine per decision)."""

    def __post_init__(self) -> None:
        self.reset()

    def reset(self, seed: int | None = None, env=None) -> None:
        self._last: list[int] = []  # per engine, the decision that last moved it (0: never)
        self._step = 0

    def act(self, obs: np.ndarray) -> int:
        n = engines_in(obs)
        if len(self._last) != n:
            self._last = [0] * n
        self._step += 1
        for rule, what in _RULES:
            hits = [i for i in range(n) if rule(float(obs[i * BLOCK + ALLOC]), self)]
            if hits:
                i = min(hits, key=lambda k: self._last[k])
                self._last[i] = self._step
                return encode_action(i, what)
        return NODE_HOLD
