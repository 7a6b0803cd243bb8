"""The policy a sidecar serves: loaded and checked once, then used exactly as it was trained.

A decision builds the observation the policy was trained on (a policy file's own scales; for a
baseline the default scales), hands the policy the snapshot (``Policy.see``), acts, and runs the
safety shield on the snapshot (agents/shield.py). A stateful policy (the fallback against the
parking, ``unpark:F:[ontime:]FILE``, agents/unpark.py) keeps one copy of its state an engine, by the
snapshot's ``engine_id``, and starts it afresh when the engine numbers its snapshots from lower
than the last (``seq``: a new run), as an evaluation resets it every episode.

Loaded from the operator's ``--policy`` (``load_served_policy``) or from a client's
``ReloadPolicy`` (``reload_served_policy``), each within what rlctl/online/confine.py allows.
"""
from __future__ import annotations

import copy
import dataclasses
import hashlib
import math
import numbers
import threading
from collections import OrderedDict
from dataclasses import dataclass, field

from agents.export import POLICY_SUFFIX, ExportedPolicy, PolicyFileError, load_policy
from agents.node_spec import is_node_baseline, make_node_policy
from agents.policy import Policy
from agents.shield import NodeShield, Shield
from agents.spec import is_baseline, is_unpark, make_policy, unpark, unpark_spec
from agents.unpark import Unpark
from engine.control import ACTIONS
from engine.node_control import action_names
from engine.snapshot import HIST_EDGES, Snapshot
from env.node_observation import node_features, observe_node_state
from env.observation import FEATURES, observe
from env.scenario import Observation
from experiments import POLICIES, find
from rlctl.online.confine import BaselineRefused, Confinement, ReloadOff, open_policy
from rlctl.online.node_messages import NodeState
from rlctl.online.proto import controller_pb2 as pb


class PolicyError(RuntimeError):
    """The policy failed on a valid snapshot (it raised, or returned an action id outside ACTIONS)."""


class NodeMismatch(ValueError):
    """A node's engines are not the ones its node policy was trained on."""


class WrongScope(ValueError):
    """A policy served for one engine that was trained for a node (``node_policy``), or the reverse."""

    def __init__(self, message: str, node_policy: bool) -> None:
        super().__init__(message)
        self.node_policy = node_policy


MAX_ENGINES = 1024  # engines a stateful policy keeps state for; the one asked least recently is forgotten past it


class EngineCopy:
    """One engine's copy of a stateful policy; ``lock`` serialises that engine's decisions."""

    def __init__(self, policy: Policy) -> None:
        self.policy, self.lock, self.last_seq = copy.copy(policy), threading.Lock(), 0
        self.policy.reset()

    def decide(self, snapshot: Snapshot, obs, seq: int) -> int:
        with self.lock:
            if seq < self.last_seq:  # the engine numbers its snapshots afresh: a new run
                self.policy.reset()
            self.last_seq = seq
            self.policy.see(snapshot)
            return self.policy.act(obs)


class EngineStates:
    """A stateful policy's copy an engine (``engine_id``; "" is an engine too), made on its first
    decision; past ``MAX_ENGINES`` engines the one asked least recently is forgotten (it starts
    afresh if it asks again). Engines decide in parallel, each engine's decisions one at a time."""

    def __init__(self, policy: Policy) -> None:
        self.policy, self.lock = policy, threading.Lock()  # the lock guards ``copies``
        self.copies: OrderedDict[str, EngineCopy] = OrderedDict()

    def get(self, engine_id: str) -> EngineCopy:
        with self.lock:
            c = self.copies.get(engine_id)
            if c is None:
                c = self.copies[engine_id] = EngineCopy(self.policy)
                if len(self.copies) > MAX_ENGINES:
                    self.copies.popitem(last=False)
            else:
                self.copies.move_to_end(engine_id)
            return c

    def forget_all(self) -> None:
        with self.lock:
            self.copies.clear()


@dataclass(frozen=True)
class ServedPolicy:
    """A loaded policy with what a decision needs to use it as it was trained."""

    spec: str
    policy: Policy
    scales: Observation
    file_sha256: str             # "" for a baseline
    pinned_overcommit: float | None
    shield: Shield = Shield()
    states: EngineStates | None = field(default=None, compare=False, repr=False)  # a stateful policy's

    def __post_init__(self) -> None:
        if self.policy.stateful and self.states is None:
            object.__setattr__(self, "states", EngineStates(self.policy))

    @property
    def base(self) -> Policy:
        return _base(self.policy)

    @property
    def reads_waiting_late(self) -> bool:
        """Whether the policy reads the snapshot's ``waiting_late`` (the on-time fallback)."""
        return isinstance(self.policy, Unpark) and self.policy.on_time

    @property
    def kind(self) -> str:
        return "file" if self.file_sha256 else "baseline"

    @property
    def inline(self) -> bool:
        """Whether a decision is cheap enough to run on the sidecar's event loop: a baseline's, or a
        network small enough for the numpy forward (agents/export.py NUMPY_MAX_PARAMETERS, tens of
        microseconds at most), since handing it to a thread costs more than it does."""
        return not isinstance(self.base, ExportedPolicy) or self.base.forward is not None

    @property
    def policy_hash(self) -> str:
        """The file's SHA-256 (a fallback around it: of the fallback's settings and the file's), or a
        baseline spec's."""
        if not self.file_sha256:
            return hashlib.sha256(f"baseline:{self.spec}".encode()).hexdigest()
        if self.base is self.policy:
            return self.file_sha256
        return hashlib.sha256(f"{self.policy.settings()}:{self.file_sha256}".encode()).hexdigest()

    def decide(self, snapshot: Snapshot, engine_id: str = "", seq: int = 0) -> tuple[int, int]:
        """(the policy's action, the action after the shield) on a checked snapshot from ``engine_id``,
        its ``seq``-th."""
        obs = observe(self.shield.view(snapshot), self.scales)
        try:
            if self.states is None:
                self.policy.see(snapshot)
                chosen = self.policy.act(obs)
            else:
                chosen = self.states.get(engine_id).decide(snapshot, obs, seq)
        except Exception as exc:  # a policy bug must not take the server down with it
            raise PolicyError(f"policy {self.policy.name} failed: {type(exc).__name__}: {exc}") from exc
        if not isinstance(chosen, numbers.Integral) or not 0 <= chosen < len(ACTIONS):
            raise PolicyError(f"policy {self.policy.name} returned action {chosen!r}, not one of 0..{len(ACTIONS) - 1}")
        return int(chosen), self.shield.filter(int(chosen), snapshot)

    def expected_overcommit(self, snapshot: Snapshot) -> float:
        """The factor the engine is to run at: the one the policy pins, else the engine's own. A pinned
        factor above the engine's (after a fallback, or where the engine started lower) waits while the
        shield lets no factor rise (``Shield.may_rise``: the device nearly full, an OOM restart)."""
        pinned = self.pinned_overcommit
        if pinned is None or (pinned > snapshot.overcommit and not self.shield.may_rise(snapshot)):
            return snapshot.overcommit
        return pinned

    def info(self) -> pb.PolicyInfo:
        header = getattr(self.base, "header", {})
        return pb.PolicyInfo(spec=self.spec, name=self.policy.name, kind=self.kind, file_sha256=self.file_sha256,
                             policy_hash=self.policy_hash, features=list(FEATURES), actions=list(ACTIONS),
                             scales={k: float(v) for k, v in dataclasses.asdict(self.scales).items()},
                             max_model_len=0, pinned_overcommit=self.pinned_overcommit or 0.0,
                             source_commit=str(header.get("source_commit", "")),
                             blind_to=list(getattr(self.base, "blind_to", [])))


@dataclass(frozen=True)
class ServedNodePolicy(ServedPolicy):
    """A node policy (env/shared_gpu_env.py) with what a decision needs: ``engines``, the node a
    policy file was trained on (in order; None for a baseline, which serves any node)."""

    engines: tuple[str, ...] | None = None
    node_shield: NodeShield = NodeShield()

    def decide(self, state: NodeState, engine_id: str = "", seq: int = 0) -> tuple[int, int]:  # type: ignore[override]
        """(the policy's flat node action, the action after the node shield) on a checked node state."""
        if self.engines is not None and tuple(state.names) != self.engines:
            raise NodeMismatch(f"the node reports engines {state.names}; policy {self.spec} was trained on a node of "
                               f"engines {list(self.engines)}, in that order")
        obs = observe_node_state(state.snapshots, state.limits, state.held, state.shares, state.capacity, state.free,
                                 self.scales)
        count = len(action_names(state.names))
        try:
            chosen = self.policy.act(obs)
        except Exception as exc:  # a policy bug must not take the server down with it
            raise PolicyError(f"policy {self.policy.name} failed: {type(exc).__name__}: {exc}") from exc
        if not isinstance(chosen, numbers.Integral) or not 0 <= chosen < count:
            raise PolicyError(f"policy {self.policy.name} returned node action {chosen!r}, not one of 0..{count - 1}")
        return int(chosen), self.node_shield.filter(int(chosen), state.snapshots)

    def info(self) -> pb.PolicyInfo:
        info = super().info()
        del info.features[:], info.actions[:]
        if self.engines is not None:
            info.features.extend(node_features(list(self.engines)))
            info.actions.extend(action_names(list(self.engines)))
        return info


def _trial_snapshot() -> Snapshot:
    bins = (0.0,) * (len(HIST_EDGES) - 1)
    return Snapshot(time_s=0.0, alloc_ratio=0.0, alloc_slope=0.0, frag_entropy=0.0, queue_len=0, prefill_frac=0.0,
                    len_mean=0.0, len_std=0.0, swapped=0, decode_ms=0.0, overcommit=1.0, reserved_ratio=0.0,
                    device_free=1.0, queue_hist=bins, running_hist=bins, kv_tokens_total=1024, kv_blocks_total=64,
                    max_num_seqs=8)


def _is_baseline(spec: str, node: bool) -> bool:
    return is_node_baseline(spec) if node else is_baseline(spec)


def _baseline(spec: str, node: bool) -> Policy:
    return make_node_policy(spec) if node else make_policy(spec)


def load_served_policy(spec: str, confinement: Confinement, node: bool = False,
                       shield: Shield = Shield()) -> ServedPolicy:
    """The operator's ``--policy``: a policy file's path (trusted: it comes from the command line) or
    a shipped policy's name (``default``: experiments/policies/), or a baseline spec if
    ``confinement`` allows baselines; with ``node``, a node policy (a node's
    baseline, or a file trained on a node), behind ``shield`` (one engine's). A ``ValueError``
    (``PolicyFileError`` for a file) says why it cannot serve. ``unpark:F:[ontime:]FILE`` serves the
    fallback against the parking around that file (agents/unpark.py)."""
    spec = str(spec)
    if is_unpark(spec):
        factor, on_time, inner = _served_unpark_spec(spec, "PATH", "a policy file's path or a shipped policy's name")
        policy = load_policy(find(inner, POLICIES, POLICY_SUFFIX), confinement.max_bytes)
        return _checked(spec, unpark(policy, factor, on_time), node, shield)
    if _is_baseline(spec, node):
        if not confinement.allow_baselines:
            raise ValueError(f"--policy {spec} is a baseline spec: serve one only with --allow-baselines")
        return _checked(spec, _baseline(spec, node), node, shield)
    return _checked(spec, load_policy(find(spec, POLICIES, POLICY_SUFFIX), confinement.max_bytes), node, shield)


def reload_served_policy(name: str, confinement: Confinement, node: bool = False,
                         shield: Shield = Shield()) -> ServedPolicy:
    """A client's ``ReloadPolicy``: a policy name inside the policy directory (rlctl/online/confine.py),
    or a baseline spec if allowed (a node's with ``node``). ``ReloadOff``, ``BaselineRefused``,
    ``NoSuchPolicy`` (the same words whatever the reason), or a ``ValueError`` about a file inside
    the directory."""
    if confinement.policy_dir is None:
        raise ReloadOff("ReloadPolicy is off: rlctl serve was started without --policy-dir")
    if _is_baseline(name, node):
        if not confinement.allow_baselines:
            raise BaselineRefused(f"{name} is a baseline spec, and rlctl serve was started without --allow-baselines")
        return _checked(name, _baseline(name, node), node, shield)
    factor, on_time, inner = (_served_unpark_spec(name, "NAME", "a policy in the policy directory") if is_unpark(name)
                              else (None, False, name))
    f, file_name = open_policy(confinement.policy_dir, inner)
    with f:  # the file's name, not its path, in messages and in GetPolicy: the directory is the operator's
        policy = load_policy(file_name, confinement.max_bytes, opened=f)
    if factor is None:
        return _checked(file_name, policy, node, shield)
    return _checked(name.removesuffix(inner) + file_name, unpark(policy, factor, on_time), node, shield)


def _base(policy: Policy) -> Policy:
    """The trained or baseline policy itself: inside the fallback, the one it wraps."""
    return policy.inner if isinstance(policy, Unpark) else policy


def _served_unpark_spec(spec: str, what: str, means: str) -> tuple[float, bool, str]:
    """``unpark_spec`` in a sidecar's words, naming what ``what`` stands for (``means``)."""
    try:
        return unpark_spec(spec)
    except ValueError:
        raise ValueError(f"{spec}: serve the fallback against the parking as unpark:F:{what} or unpark:F:ontime:{what}, "
                         f"F a finite factor above the floor and {what} {means}") from None


def _trial_node(engines: tuple[str, ...]) -> NodeState:
    snap = _trial_snapshot()
    return NodeState({n: snap for n in engines}, dict.fromkeys(engines, 1 << 30), dict.fromkeys(engines, 0),
                     dict.fromkeys(engines, 1 / len(engines)), len(engines) << 30, len(engines) << 30)


def _checked(spec: str, policy: Policy, node: bool = False, shield: Shield = Shield()) -> ServedPolicy:
    """``policy`` ready to serve: one engine's or a node's as asked, it pins nothing a running engine
    cannot take, and a trial decision works."""
    base = _base(policy)
    if node and base is not policy:
        raise ValueError(f"policy {spec}: the fallback against the parking (unpark:) serves one engine's policy, "
                         "not a node's: serve it without --node")
    trained = (base.header.get("node") or {}).get("engines") if isinstance(base, ExportedPolicy) else None
    if isinstance(base, ExportedPolicy) and node != (trained is not None):
        raise WrongScope(f"policy {spec}: trained for a node of engines {trained}: serve it with --node" if trained else
                         f"policy {spec}: trained for one engine, not for a node: serve it without --node",
                         node_policy=trained is not None)
    if node:
        if policy.engine_overrides:
            raise ValueError(f"policy {spec}: it pins engine settings a running node cannot take from a sidecar "
                             f"({policy.engine_overrides}); serve a node policy that pins none")
        engines = tuple(trained) if trained is not None else None
        scales = Observation(**policy.header["observation"]["scales"]) if trained is not None else Observation()
        served = ServedNodePolicy(spec, policy, scales, getattr(policy, "file_sha256", ""), None, engines=engines)
        try:
            served.decide(_trial_node(engines or ("a", "b")))
        except PolicyError as exc:
            raise ValueError(f"policy {spec}: a trial decision failed: {exc}") from None
        return served
    overrides = dict(policy.engine_overrides)
    pinned = overrides.pop("overcommit", None)
    if overrides or (pinned is not None and not math.isfinite(pinned)):
        raise ValueError(f"policy {spec}: it pins engine settings a running engine cannot take from a sidecar "
                         f"({policy.engine_overrides}); serve a policy that pins at most a finite overcommit factor")
    if isinstance(base, ExportedPolicy):
        trained = base.header["observation"]
        try:
            scales = Observation(**trained["scales"])
        except TypeError as exc:
            raise PolicyFileError(f"policy file {spec}: observation.scales {trained['scales']} do not fit this "
                                  f"build's scales ({exc})") from None
        served = ServedPolicy(spec, policy, scales, base.file_sha256, pinned, shield)
    else:
        served = ServedPolicy(spec, policy, Observation(), "", pinned, shield)
    try:
        served.decide(_trial_snapshot())
    except PolicyError as exc:
        raise ValueError(f"policy {spec}: a trial decision failed: {exc}") from None
    if served.states is not None:
        served.states.forget_all()  # the trial's state is no engine's
    return served
