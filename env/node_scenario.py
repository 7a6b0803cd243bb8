"""Node scenarios: several engines on one GPU, each with its deployment, its workload and its
memory, as a YAML file (``experiments/scenarios/node_*.yaml``) read into these records.

```yaml
name: node_chat_pair
tenants:                                  # two or more engines on one GPU
  - name: a
    deployment: llama7b-fp16-h100         # engine/roofline.py deployment(); every tenant on the same GPU
    share: 0.5                            # its static partition: a share of the device's memory
    limit: 0.7                            # its MPS pinned-memory limit at the start (limits may sum past 1)
    compute_share: 0.5                    # its share of the GPU's compute and bandwidth (roofline derated)
    phase_offset: 0                       # with a cycle: in phase (k + offset) while the node is in phase k
    engine: {ttft_slo_s: 5.0, overcommit_min: 0.25}    # EngineConfig overrides
    workload: {phases: [...], max_tokens: fixed:2048}  # any scenario workload
cycle: {mean_dwell_s: [60, 60]}           # the node's phase clock, one dwell time per phase
decision_interval_s: 2.0
max_steps: 150
slice_s: 0.5                              # the engines' lockstep slice (engine/node.py)
best_overcommit: 1.5                      # the overcommit:K baseline's K, tuned on training seeds
```

Every key is checked at load, as a single engine's scenario is (env/scenario_yaml.py), and a bad
one names the field.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from engine.config import EngineConfig, kv_blocks_within
from engine.roofline import GPU, RooflineCostModel, deployment
from env.scenario import Observation, PhasedWorkload, Reward, ScenarioError, Workload
from env.scenario_yaml import _fail, check_workload_fields, from_mapping, is_node_file, read_yaml
from experiments import SCENARIOS, find

_SHARES = ("share", "limit", "compute_share")


@dataclass(frozen=True)
class Tenant:
    name: str
    deployment: str
    workload: Workload
    share: float
    limit: float
    compute_share: float = 1.0
    phase_offset: int = 0
    engine: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Cycle:
    """The node's phase clock: phase k lasts an exponential time of mean ``mean_dwell_s[k]``, then
    the next follows; a tenant with a phased workload is in its phase ``(k + phase_offset)``."""

    mean_dwell_s: tuple[float, ...]


@dataclass(frozen=True)
class NodeScenario:
    name: str
    tenants: tuple[Tenant, ...]
    cycle: Cycle | None = None
    decision_interval_s: float = 2.0
    max_steps: int = 150
    slice_s: float = 0.5
    terminate_on_oom: bool = False
    evict_free_share: float = 0.2
    reward: Reward = field(default_factory=Reward)
    observation: Observation = field(default_factory=Observation)
    description: str = ""
    best_overcommit: float = 1.0  # overcommit:K's K (limits K x share), tuned on training seeds
    best_static: float = 1.0      # static:K's K (every engine's factor, within the scenario's limits)

    @property
    def episode_s(self) -> float:
        return self.decision_interval_s * self.max_steps

    @property
    def gpu(self) -> GPU:
        return deployment(self.tenants[0].deployment).gpu

    @property
    def names(self) -> list[str]:
        return [t.name for t in self.tenants]

    def engine_config(self, tenant: Tenant, **overrides) -> EngineConfig:
        return deployment(tenant.deployment).engine_config(**{**tenant.engine, **overrides})

    def cost_model(self, tenant: Tenant) -> RooflineCostModel:
        """The tenant's roofline clock, derated by its share of the GPU's compute and bandwidth."""
        base = deployment(tenant.deployment).cost_model()
        c = tenant.compute_share
        return deployment(tenant.deployment).cost_model(flops_efficiency=base.flops_efficiency * c,
                                                         memory_efficiency=base.memory_efficiency * c)

    def limit_bytes(self, tenant: Tenant, rule: str | float = "scenario") -> int:
        """A tenant's MPS limit: the scenario's (``scenario``), its partition share (``partition``),
        or K times its share (a number K), within the device."""
        cap = self.gpu.memory_bytes
        if rule == "scenario":
            share = tenant.limit
        elif rule == "partition":
            share = tenant.share
        elif isinstance(rule, (int, float)) and not isinstance(rule, bool) and rule > 0:
            share = min(rule * tenant.share, 1.0)
        else:
            raise ValueError(f"limits must be 'scenario', 'partition' or a factor K > 0 of each share, got {rule!r}")
        return int(share * cap)

    def phase_spans(self, rng: np.random.Generator) -> list[tuple[float, float, int]]:
        """One draw of the node's phase clock over an episode: (start, length, phase index)."""
        if self.cycle is None:
            return []
        dwell = self.cycle.mean_dwell_s
        t, k, spans = 0.0, int(rng.integers(len(dwell))), []
        while t < self.episode_s:
            span = float(rng.exponential(dwell[k]))
            spans.append((t, span, k))
            t, k = t + span, (k + 1) % len(dwell)
        return spans


def _check(s: NodeScenario, where: str) -> NodeScenario:
    if len(s.tenants) < 2:
        raise _fail(where, "tenants", f"a node needs two or more tenants, got {len(s.tenants)}")
    names = s.names
    for i, t in enumerate(s.tenants):
        path = f"tenants[{i}]"
        if names.count(t.name) > 1 or "/" in t.name or ":" in t.name:
            raise _fail(where, f"{path}.name", f"{t.name!r} is used twice or holds '/' or ':'")
        try:
            deployment(t.deployment)
        except ValueError as exc:  # an unknown name (the message names the known ones) or a bad checkpoint
            raise _fail(where, f"{path}.deployment", str(exc)) from None
        if deployment(t.deployment).gpu != s.gpu:
            raise _fail(where, f"{path}.deployment", f"{t.deployment} is on a {deployment(t.deployment).gpu.name}, "
                                                     f"tenants[0] on a {s.gpu.name}: a node is one GPU")
    for i, t in enumerate(s.tenants):
        path = f"tenants[{i}]"
        for key in _SHARES:
            if not 0 < getattr(t, key) <= 1:
                raise _fail(where, f"{path}.{key}", f"must be a share of the device in (0, 1], got {getattr(t, key)}")
        try:
            cfg = s.engine_config(t)
        except TypeError as exc:
            raise _fail(where, f"{path}.engine", f"not an engine setting ({exc})") from None
        except ValueError as exc:
            raise _fail(where, f"{path}.engine", str(exc)) from None
        model = deployment(t.deployment).model
        for key in ("share", "limit"):
            blocks = kv_blocks_within(model, cfg, int(getattr(t, key) * s.gpu.memory_bytes))
            if blocks * cfg.block_size < min(cfg.max_model_len, model.max_position):
                raise _fail(where, f"{path}.{key}", f"{getattr(t, key)} of the device holds {blocks} KV blocks after "
                                                    f"the weights: less than one {cfg.max_model_len}-token sequence")
        check_workload_fields(t.workload, where, f"{path}.workload")
        if isinstance(t.workload, PhasedWorkload) and (s.cycle is None or len(s.cycle.mean_dwell_s)
                                                       != len(t.workload.phases)):
            raise _fail(where, f"{path}.workload.phases", "a phased tenant follows the node's cycle: give cycle."
                                                          "mean_dwell_s, one per phase")
    if s.cycle is not None:
        for i, d in enumerate(s.cycle.mean_dwell_s):
            if not d > 0:
                raise _fail(where, f"cycle.mean_dwell_s[{i}]", f"must be > 0, got {d}")
    if sum(t.share for t in s.tenants) > 1 + 1e-9:
        raise _fail(where, "tenants", f"the shares (a static partition) sum to {sum(t.share for t in s.tenants):g} "
                                      "of the device, more than all of it")
    return s


def node_scenario_from_dict(data: dict, where: str = "node scenario") -> NodeScenario:
    return _check(from_mapping(NodeScenario, data, where, ""), where)


def is_node_scenario(name) -> bool:
    """Whether ``name`` (a record, a path or a bundled name) is a node scenario."""
    return isinstance(name, NodeScenario) or (not hasattr(name, "tenants") and isinstance(name, (str, Path))
                                               and is_node_file(find(name, SCENARIOS, ".yaml")))


def load_node_scenario(path) -> NodeScenario:
    """Read a node scenario YAML file; a bundled name (``node_chat_pair``) reads experiments/scenarios/."""
    if isinstance(path, NodeScenario):
        return path
    p = find(path, SCENARIOS, ".yaml")
    data = read_yaml(p, f"node scenario: {path}: no such file")
    if not isinstance(data, dict) or "tenants" not in data:
        raise ScenarioError(f"{p}: not a node scenario (no tenants)")
    if "name" not in data:
        data = {"name": p.stem, **data}
    return node_scenario_from_dict(data, str(p))
