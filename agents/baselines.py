"""The policies every result is compared with (DESIGN.md, "Baselines"), as ``Policy`` objects.

A policy sees what the DQN will see, the observation vector (env/observation.py), and returns
an action id (env/overcommit_env.py ``ACTIONS``). ``engine_overrides`` are engine settings the
policy pins for its episodes: a fixed factor, or vLLM's scheduling.

- ``static:K``: overcommit factor K all the time (``static:1.0`` is the conservative reservation;
  each scenario names its best K, tuned on training seeds with ``rlctl eval --static-sweep``).
- ``watermark``: threshold rules on KV usage, mapped onto the five actions: at 99 % back off
  (stop admitting), at 95 % evict to host, at 92 % back off (smaller batches), and scale up again
  only once usage is below 75 % (hysteresis).
- ``vllm``: no reservation of max_tokens (factor inf), preempt the newest sequence for
  recomputation when blocks run out.
- ``random``: a uniformly random action, from the seed given at ``reset``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from env.observation import FEATURES
from env.overcommit_env import BACK_OFF, EVICT, HOLD, SCALE_UP, ACTIONS

ALLOC = FEATURES.index("alloc_ratio")


class Policy:
    """What every policy, baseline or learned, offers to ``rlctl eval`` and the sidecar."""

    name: str = "policy"
    engine_overrides: dict = {}

    def reset(self, seed: int | None = None) -> None:
        """A new episode starts."""

    def act(self, obs: np.ndarray) -> int:
        raise NotImplementedError


@dataclass
class Static(Policy):
    factor: float
    name: str = ""

    def __post_init__(self) -> None:
        if math.isnan(self.factor) or self.factor <= 0:
            raise ValueError(f"policy static:K: K must be > 0, got {self.factor}")
        self.name = self.name or f"static:{self.factor:g}"
        self.engine_overrides = {"overcommit": self.factor}

    def act(self, obs: np.ndarray) -> int:
        return HOLD


@dataclass
class Watermark(Policy):
    high: float = 0.92
    evict: float = 0.95
    stop: float = 0.99
    resume: float = 0.75
    name: str = "watermark"
    engine_overrides: dict = field(default_factory=dict)
    _stopped: bool = False

    def reset(self, seed: int | None = None) -> None:
        self._stopped = False

    def act(self, obs: np.ndarray) -> int:
        u = float(obs[ALLOC])
        if u >= self.stop:
            self._stopped = True
            return BACK_OFF
        if u >= self.evict:
            return EVICT
        if u >= self.high:
            self._stopped = True
            return BACK_OFF
        if u < self.resume:
            self._stopped = False
            return SCALE_UP
        return HOLD


@dataclass
class VLLM(Policy):
    name: str = "vllm"
    engine_overrides: dict = field(default_factory=lambda: {"overcommit": math.inf, "oom_mode": "preempt"})

    def act(self, obs: np.ndarray) -> int:
        return HOLD


@dataclass
class Random(Policy):
    name: str = "random"
    engine_overrides: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._rng = np.random.default_rng(0)

    def reset(self, seed: int | None = None) -> None:
        self._rng = np.random.default_rng(seed)

    def act(self, obs: np.ndarray) -> int:
        return int(self._rng.integers(len(ACTIONS)))


def baselines(best_static: float = 1.0) -> list[str]:
    """Every baseline's spec; ``best_static`` is the scenario's tuned fixed factor."""
    return list(dict.fromkeys(["static:1.0", f"static:{best_static:g}", "watermark", "vllm", "random"]))


STATIC_SWEEP = [f"static:{k / 10:g}" for k in range(10, 26)]  # 1.0 to 2.5 in steps of 0.1


def make_policy(spec: str) -> Policy:
    """A policy from its spec: ``static:K``, ``watermark``, ``vllm``, ``random``, or the path of a
    policy file (``*.rlpolicy``, agents/export.py) for a trained one."""
    from pathlib import Path

    if isinstance(spec, Path):
        spec = str(spec)
    if not isinstance(spec, str) or not spec:
        raise ValueError(f"policy: expected a spec such as static:1.0, watermark, vllm, random or a policy file; "
                         f"got {spec!r}")
    if spec.startswith("static:"):
        try:
            factor = float(spec.split(":", 1)[1])
        except ValueError:
            raise ValueError(f"policy {spec!r}: static:K needs a number K, e.g. static:1.5") from None
        return Static(factor)
    simple = {"watermark": Watermark, "vllm": VLLM, "random": Random}
    if spec in simple:
        return simple[spec]()
    from agents.export import POLICY_SUFFIX, load_policy  # here: agents/export.py imports this module

    if Path(spec).is_file() or spec.endswith(POLICY_SUFFIX):
        return load_policy(spec)  # a missing file: PolicyFileError naming the path
    raise ValueError(f"policy {spec!r} does not exist: use static:K, watermark, vllm, random "
                     f"or a policy file (*{POLICY_SUFFIX})")
