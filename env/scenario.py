"""Scenarios: what an environment episode replays, on which deployment, and how it is scored.

A scenario is a YAML file (see ``experiments/scenarios/``) read into these frozen records by
``env/scenario_yaml.py``, which checks every key at load.

```yaml
name: burst
deployment: llama70b-4bit-h100      # engine/roofline.py DEPLOYMENTS, or CHECKPOINT_DIR@GPU[:LEN]
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

from dataclasses import dataclass, field, replace

from engine.config import EngineConfig
from engine.roofline import deployment


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
class Phase:
    """One phase of a workload whose mix moves: its arrivals and lengths, and its mean dwell time."""

    arrivals: Distribution
    prompt: Distribution
    output: Distribution
    mean_dwell_s: float
    name: str = ""


@dataclass(frozen=True)
class PhasedWorkload:
    """Phases that follow each other in order (from a phase drawn at random), each for an
    exponential dwell time of its mean: chat-like short outputs, then reasoning-like long ones."""

    phases: tuple[Phase, ...]
    max_tokens: str = "fixed:2048"


Workload = TraceWorkload | GeneratorWorkload | PhasedWorkload


@dataclass(frozen=True)
class Cotenant:
    """Another process on the device: its share of device memory, redrawn from ``levels`` after
    an exponential hold of mean ``mean_hold_s``."""

    levels: tuple[float, ...] = (0.0,)
    mean_hold_s: float = 60.0


@dataclass(frozen=True)
class Reward:
    """r = alpha*goodput + kappa*late - gamma*slo_violation - omega*ooms - rho*recompute + beta*alloc
    (env/overcommit_env.py). Goodput is what operators are paid for; an OOM's downtime and lost
    work already cost goodput, and omega makes one OOM cost more than taking the risk could
    earn; KV utilisation is reported, not paid for (beta 0). ``late`` is the output of requests
    that finished past their SLO, on goodput's scale: unpaid by default (kappa 0), it can be worth
    a share of an answer on time."""

    alpha: float = 1.0
    kappa: float = 0.0
    beta: float = 0.0
    gamma: float = 0.0
    omega: float = 20.0
    rho: float = 0.0
    tokens_per_s_scale: float | None = None  # goodput normaliser; None: the scenario's offered output tokens/s


@dataclass(frozen=True)
class Backlog:
    """A training episode that starts behind: on a ``share`` of episodes, the first requests (in
    arrival order; of a session only its opening turn) arrive at once at time 0, until their prompts
    hold a multiple of the KV capacity drawn uniformly from ``kv`` (env/workload_builder.py ``front_loaded``). The
    rest arrive as drawn. It puts the policy where a parked factor leaves it, a long queue over an
    idle KV, on workloads where draining it pays and where it does not (rlctl/train.py)."""

    share: float = 0.5
    kv: tuple[float, float] = (0.5, 2.0)

    def __post_init__(self) -> None:
        if not 0 < self.share <= 1:
            raise ValueError(f"backlog share must be in (0, 1], got {self.share}")
        low, high = self.kv
        if not 0 < low <= high:
            raise ValueError(f"backlog kv must be [low, high] with 0 < low <= high, got {list(self.kv)}")


@dataclass(frozen=True)
class Observation:
    """Scales that bound the unbounded features (see env/observation.py)."""

    queue_scale: int = 1024
    swapped_scale: int = 256
    slope_scale: float = 0.05
    overcommit_scale: float = 16.0


@dataclass(frozen=True)
class Scenario:
    name: str
    workload: Workload
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
        return deployment(self.deployment).engine_config(**{**self.engine, **overrides})

    def at_load(self, load: float) -> "Scenario":
        """This scenario with its arrivals ``load`` times as frequent (a trace replayed faster)."""
        if not load > 0:
            raise ValueError(f"load must be > 0, got {load}")
        return replace(self, workload=_scaled(self.workload, load), name=f"{self.name}@{load:g}")


def _rates(d: Distribution, load: float) -> Distribution:
    p = dict(d.params)
    if "rate" in p:
        p["rate"] = p["rate"] * load
    if "rates" in p:
        p["rates"] = [r * load for r in p["rates"]]
    return Distribution(d.kind, p)


def _scaled(w: Workload, load: float) -> Workload:
    if isinstance(w, TraceWorkload):
        return replace(w, time_scale=w.time_scale * load, rate_rps=None if w.rate_rps is None else w.rate_rps * load)
    if isinstance(w, PhasedWorkload):
        return replace(w, phases=tuple(replace(p, arrivals=_rates(p.arrivals, load)) for p in w.phases))
    return replace(w, arrivals=_rates(w.arrivals, load))
