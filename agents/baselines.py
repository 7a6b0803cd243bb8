"""The policies every result is compared with (docs/design.md, "Baselines"), as ``Policy`` objects.

Each is an ``agents/policy.py`` ``Policy``: it sees what the DQN sees, the observation vector,
and returns an action id; ``engine_overrides`` are engine settings it pins for its episodes.

- ``static:K``: overcommit factor K all the time (``static:1.0`` is the conservative reservation;
  each scenario names its best K, tuned on training seeds with ``rlctl eval --static-sweep``).
- ``watermark``: threshold rules on KV usage, mapped onto the five actions: at 99 % back off
  (stop admitting), at 95 % evict to host, at 92 % back off (smaller batches), and scale up again
  only once usage is below 75 % (hysteresis).
- ``vllm``: no reservation of max_tokens (factor inf), preempt the newest sequence for
  recomputation when blocks run out.
- ``sglang``: SGLang's adaptive reservation (engine/scheduler.py ``NewTokenRatio``) with its
  default settings, retracting the newest requests for recomputation when decode runs out of
  blocks.
- ``random``: a uniformly random action of its environment's, from the seed given at ``reset``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from agents.policy import Policy
from engine.control import ACTIONS, BACK_OFF, EVICT, HOLD, SCALE_UP
from env.observation import FEATURES

ALLOC = FEATURES.index("alloc_ratio")


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

    def reset(self, seed: int | None = None, env=None) -> None:
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
class EngineRule(Policy):
    """A peer whose rule lives in the engine (the settings it pins, ``engine_overrides``): it only holds."""

    def act(self, obs: np.ndarray) -> int:
        return HOLD


@dataclass
class VLLM(EngineRule):
    name: str = "vllm"
    engine_overrides: dict = field(default_factory=lambda: {"overcommit": math.inf, "oom_mode": "preempt"})


@dataclass
class VLLMChunked(EngineRule):
    """``vllm`` with vLLM v1's allocation (``EngineConfig.prompt_blocks: chunk``): a new request
    takes its first chunk's blocks and each later chunk its own as it is scheduled
    (``KVCacheManager.allocate_slots``), where ``vllm`` takes the whole prompt's at admission (as
    vLLM v0's block manager did); a chunk that finds no free block preempts the newest request, as a
    decode does. Without vLLM's prefix cache, which keeps a preempted request's computed blocks
    while nothing else takes them, every readmission recomputes from the start: a reference for how
    much the whole-prompt hold spares the peer (README, "How close vllm and sglang are"), not a
    better model of vLLM."""

    name: str = "vllm_chunked"
    engine_overrides: dict = field(default_factory=lambda: {"overcommit": math.inf, "oom_mode": "preempt",
                                                            "prompt_blocks": "chunk"})


@dataclass
class VLLMCached(EngineRule):
    """``vllm`` with its recompute free (``EngineConfig.preempted_kv: cached``): a preempted request is
    readmitted with its KV, as if vLLM's prefix cache had kept all of it, which is more than the cache
    (not modelled by ``vllm``) can keep: an optimistic reference (README, "How close vllm and sglang are")."""

    name: str = "vllm_cached"
    engine_overrides: dict = field(default_factory=lambda: {"overcommit": math.inf, "oom_mode": "preempt",
                                                            "preempted_kv": "cached"})


@dataclass
class VLLMV1(EngineRule):
    """``vllm`` as vLLM v1 allocates and caches: a prompt's blocks taken chunk by chunk as each chunk
    is scheduled (``EngineConfig.prompt_blocks: chunk``), and a preempted request's KV kept as vLLM's
    prefix cache keeps it (``preempted_kv: lru``, engine/kv_cache.py ``FreeOrder``): its full blocks
    stay cached until other requests take them, free blocks handed out freed longest ago first and a
    victim's last blocks before its first; readmitted, it computes from the end of the prefix still
    cached (README, "How close vllm and sglang are")."""

    name: str = "vllm_v1"
    engine_overrides: dict = field(default_factory=lambda: {"overcommit": math.inf, "oom_mode": "preempt",
                                                            "prompt_blocks": "chunk", "preempted_kv": "lru"})


@dataclass
class SGLang(EngineRule):
    name: str = "sglang"
    engine_overrides: dict = field(default_factory=lambda: {"admission": "sglang", "oom_mode": "preempt"})


@dataclass
class SGLangCode(EngineRule):
    """``sglang`` as SGLang's code has it (``EngineConfig.sglang_rule: code``): the request being
    admitted charged its clipped future in full; a retract takes the request with the fewest
    outputs, requeues it at the back and re-estimates the ratio from those still running; the ratio
    reset when the engine falls idle (README, "How close vllm and sglang are")."""

    name: str = "sglang_code"
    engine_overrides: dict = field(default_factory=lambda: {"admission": "sglang", "oom_mode": "preempt",
                                                            "sglang_rule": "code"})


@dataclass
class SGLangCached(EngineRule):
    """``sglang`` with its recompute free (``EngineConfig.preempted_kv: cached``), as if SGLang's radix
    cache had kept all of a retracted request's KV: an optimistic reference."""

    name: str = "sglang_cached"
    engine_overrides: dict = field(default_factory=lambda: {"admission": "sglang", "oom_mode": "preempt",
                                                            "preempted_kv": "cached"})


@dataclass
class Random(Policy):
    name: str = "random"
    engine_overrides: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._rng = np.random.default_rng(0)
        self._n = len(ACTIONS)

    def reset(self, seed: int | None = None, env=None) -> None:
        self._rng = np.random.default_rng(seed)
        self._n = int(env.action_space.n) if env is not None else len(ACTIONS)  # a node has more actions

    def act(self, obs: np.ndarray) -> int:
        return int(self._rng.integers(self._n))
