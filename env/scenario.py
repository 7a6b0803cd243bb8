"""Scenarios: what an environment episode replays, on which deployment, and how it is scored.

A scenario is a YAML file (see ``experiments/scenarios/``) read into these frozen records by
``env/scenario_yaml.py``, which checks every key at load.

```yaml
name: burst
deployment: llama70b-4bit-h100      # engine/roofline.py DEPLOYMENTS
engine: {ttft_slo_s: 5.0, tpot_slo_s: 0.2, overcommit_max: 2.0}   # EngineConfig overrides
workload:                           # a trace window ...
  trace: azure2023_conv.csv         # bundled name (env/workloads/data) or a path
  time_scale: 20
  max_tokens: fixed:2048
  starts: [0, 2400]                 # window starts drawn from this span of trace time
# ... or a generator: arrivals / prompt / output (/ sessions)
cotenant: {levels: [0.0, 0.1], mean_hold_s: 60}
decision_interval_s: 2.0
max_steps: 150
terminate_on_oom: false
evict_free_share: 0.2
reward: {alpha: 1.0, beta: 0.5, gamma: 1.0, omega: 10.0}
```
"""
from __future__ import annotations

from dataclasses import dataclass, field

from engine.config import EngineConfig
from engine.roofline import DEPLOYMENTS


class ScenarioError(ValueError):
    """A scenario file or mapping that cannot be used; the message names the field."""


@dataclass(frozen=True)
class Distribution:
    """A length distribution or arrival process by ``kind`` and its parameters.

    Arrivals: ``poisson`` (rate), ``gamma`` (rate, cv), ``mmpp`` (rates, mean_dwell_s).
    Lengths: ``lognormal`` (mean, sigma, low, high), ``pareto`` (alpha, low, high),
    ``trace`` (trace, column: prompt|output): resampled from a trace's recorded lengths.
    """

    kind: str
    params: dict = field(default_factory=dict)


@dataclass(frozen=True)
class TraceWorkload:
    trace: str
    time_scale: float = 1.0
    max_tokens: str = "fixed:2048"
    rate_rps: float | None = None                  # arrivals for a length-only trace
    starts: tuple[float, float] | None = None      # span of trace time window starts are drawn from


@dataclass(frozen=True)
class GeneratorWorkload:
    arrivals: Distribution
    prompt: Distribution
    output: Distribution
    max_tokens: str = "fixed:2048"
    sessions: dict | None = None  # {mean_turns, mean_think_s[, first_prompt]}: multi-turn sessions


@dataclass(frozen=True)
class Cotenant:
    """Another process on the device: its share of device memory, redrawn from ``levels`` after
    an exponential hold of mean ``mean_hold_s``."""

    levels: tuple[float, ...] = (0.0,)
    mean_hold_s: float = 60.0


@dataclass(frozen=True)
class Reward:
    """r = alpha*throughput + beta*alloc_ratio - gamma*slo_violation - omega*oom (see env/overcommit_env.py)."""

    alpha: float = 1.0
    beta: float = 0.5
    gamma: float = 1.0
    omega: float = 10.0
    tokens_per_s_scale: float | None = None  # throughput normaliser; None: the deployment's full-batch decode rate


@dataclass(frozen=True)
class Observation:
    """Scales that bound the unbounded features (see env/observation.py)."""

    queue_scale: int = 1024
    swapped_scale: int = 256
    decode_ms_scale: float = 500.0
    slope_scale: float = 0.05
    overcommit_scale: float = 4.0


@dataclass(frozen=True)
class Scenario:
    name: str
    workload: TraceWorkload | GeneratorWorkload
    deployment: str = "llama70b-4bit-h100"
    engine: dict = field(default_factory=dict)
    cotenant: Cotenant | None = None
    decision_interval_s: float = 2.0
    max_steps: int = 150
    terminate_on_oom: bool = False
    evict_free_share: float = 0.2
    reward: Reward = field(default_factory=Reward)
    observation: Observation = field(default_factory=Observation)
    description: str = ""
    best_static: float = 1.0  # the static:K baseline's K, tuned on training seeds (rlctl eval --static-sweep)

    @property
    def episode_s(self) -> float:
        return self.decision_interval_s * self.max_steps

    def engine_config(self, **overrides) -> EngineConfig:
        return DEPLOYMENTS[self.deployment].engine_config(**{**self.engine, **overrides})
