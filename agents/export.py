"""A trained policy as one self-describing, pickle-free file, and the loader that refuses a bad one.

A policy file (``*.rlpolicy``) is a safetensors file: the online Q-network's weights (the
``nn.Sequential`` of ``agents/networks.py:q_network``, float32, on the CPU) and, in the
safetensors ``__metadata__`` under the key ``"rlctl"``, one JSON header:

```
format, version       "rlctl-policy", 2
observation           features (env/observation.py FEATURES), low, high, scales (the scenario's
                      ``observation:``); version 2's features are deployment-free (shares of the
                      KV capacity), so a policy is not bound to the deployment it trained on
actions               engine/control.py ACTIONS
node                  a node's policy only (rlctl/SharedGPU-v0): engines (their names, in order)
                      and deployments; its features and actions are then env/node_observation.py's
                      and engine/node_control.py's for those engines
network               obs_dim, n_actions, net_arch, dueling: enough to rebuild the network; in
                      version 3, members: how many such networks the file holds (an ensemble,
                      which acts on the mean of its members' Q-values), its weights named
                      ``members.<k>.<name>``
members               version 3 only: each member's training seed, source_commit and sha256 (of
                      the member's own policy file)
training              the training configuration, as given
selection             (optional) which evaluation point's network this is, chosen on validation
                      episodes (rlctl/train.py ``select_seed``): seeds, timesteps, validation_reward,
                      and every candidate's
scenario              name, deployment (none for a node)
source_commit         git commit of the code that trained it ("unknown" outside a checkout)
weights               dtype, sha256 of each tensor's bytes
```

SB3's ``model.save`` zip holds pickles, and unpickling runs code; this file holds tensors and
JSON only, so a policy from elsewhere (the sidecar's, a colleague's) is safe to open. The loader
checks the file against this build (feature names and bounds, action names, the network the
header describes, the checksums) and names the first thing that differs. A file trained before
some of this build's features existed (env/observation.py) still loads: its features must appear
in this build's layout in the same order, and it reads only those (``ExportedPolicy.inputs``), so
it computes exactly what it did (``ExportedPolicy.blind_to`` names the others; ``blind_network`` widens its network, with
zero weights on them, for fine-tuning).

A file of one network is written as version 2, which every build since version 2 reads; an
ensemble (``export_ensemble``) as version 3, which an older build refuses by its version.
"""
from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import math
import os
import struct
import subprocess
from pathlib import Path
from typing import BinaryIO

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_tensors
from safetensors.torch import save_file

from agents.policy import Policy
from agents.networks import NumpyQNetwork, q_network
from env.node_observation import node_bounds, node_features
from env.observation import FEATURES, HIGH, LOW, seen
from env.scenario import Observation
from engine.control import ACTIONS
from engine.node_control import action_names

FORMAT = "rlctl-policy"
VERSION = 2  # one network
ENSEMBLE_VERSION = 3  # several networks of one shape (network.members), acting on the mean of their Q-values
READ_VERSIONS = (VERSION, ENSEMBLE_VERSION)
POLICY_SUFFIX = ".rlpolicy"
# A network of at most this many weights acts through the numpy forward (agents/networks.py): a
# few microseconds where torch spends ~70 us a call. A bigger one acts through torch, whose
# threads its caller sets (rlctl serve: one): numpy's OpenBLAS would spread a product of more
# than 2^18 multiply-adds over every core, and on a busy 2-core machine a 512x512 network then
# took ~0.8 ms instead of ~60 us single-threaded.
NUMPY_MAX_PARAMETERS = 1 << 18
# a policy file is a small MLP (the default 128x128 dueling network: ~160 kB); the cap only keeps a
# wrong or hostile file from being read into memory whole
MAX_POLICY_BYTES = 64 << 20
HEADER_KEY = "rlctl"  # the key of the JSON header in the safetensors __metadata__
_REPO = Path(__file__).resolve().parent.parent


class PolicyFileError(ValueError):
    """A policy file that cannot be used; the message names the file and the problem."""


def layout(engines: list[str] | None = None) -> tuple[list[str], np.ndarray, np.ndarray, list[str]]:
    """(features, low, high, actions) of this build: one engine's (env/observation.py,
    engine/control.py), or a node's of ``engines`` (env/node_observation.py, engine/node_control.py)."""
    if engines is None:
        return list(FEATURES), LOW, HIGH, list(ACTIONS)
    low, high = node_bounds(engines)
    return node_features(engines), low, high, list(action_names(engines))


# ---- export ------------------------------------------------------------------------------------
def git_commit(repo: Path = _REPO) -> str:
    """``git rev-parse HEAD`` of ``repo``, or "unknown" when it is not a checkout (or git is absent)."""
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return out.stdout.strip() if out.returncode == 0 and out.stdout.strip() else "unknown"


def _sha256(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().numpy().tobytes()).hexdigest()


def export_policy(model, path: str | Path, *, scenario, training_config: dict,
                  source_commit: str | None = None, selection: dict | None = None,
                  blind: tuple[str, ...] = ()) -> dict:
    """Write ``model``'s (an ``OvercommitDQN``) online Q-network to ``path`` as a policy file; the header.

    ``scenario`` is the one it trained on (its observation scales are part of the layout); ``blind``
    the features it trained without (rlctl/train.py), which the file leaves out of its layout.
    The file is written beside ``path`` and renamed into place, so a reader never sees half of it.
    """
    qnet = model.policy.q_net
    engines = list(scenario.names) if hasattr(scenario, "tenants") else None  # a node's policy
    features, low, high, actions = layout(engines)
    if blind:  # a node's layout is never blind (rlctl/train.py refuses it): this build's FEATURES
        keep = seen(blind)
        features, low, high = [features[i] for i in keep], low[keep], high[keep]
    if qnet.features_dim != len(features) or qnet.action_space.n != len(actions):
        raise ValueError(f"export_policy: the model sees {qnet.features_dim} features and {qnet.action_space.n} "
                         f"actions, this build has {len(features)} and {len(actions)}")
    weights = {k: v.detach().to("cpu", torch.float32).contiguous() for k, v in qnet.q_net.state_dict().items()}
    header = {
        "format": FORMAT,
        "version": VERSION,
        "observation": {
            "features": list(features),
            "low": [float(x) for x in low],
            "high": [float(x) for x in high],
            "scales": dataclasses.asdict(scenario.observation),
        },
        "actions": list(actions),
        "network": {"obs_dim": int(qnet.features_dim), "n_actions": int(qnet.action_space.n),
                    "net_arch": [int(w) for w in qnet.net_arch], "dueling": bool(qnet.dueling)},
        "training": training_config,
        "scenario": {"name": scenario.name, "deployment": getattr(scenario, "deployment", None)},
        "source_commit": source_commit or git_commit(),
        "weights": {"dtype": "float32", "sha256": {k: _sha256(v) for k, v in sorted(weights.items())}},
    }
    if selection is not None:
        header["selection"] = selection
    if engines is not None:
        header["node"] = {"engines": engines, "deployments": [t.deployment for t in scenario.tenants]}
    return _write(Path(path), weights, header)


def export_ensemble(members: list[str | Path], path: str | Path, *, training_config: dict,
                    source_commit: str | None = None) -> dict:
    """Write the policy files ``members`` (one network each, of one layout and shape: the runs of one
    training configuration on different seeds) to ``path`` as one ensemble file (version 3), which
    acts on the mean of the members' Q-values; the header.

    Each member is loaded and checked first, so a bad one fails naming its file; members of
    another layout, network shape or observation scales are refused naming the first that differs.
    """
    if len(members) < 2:
        raise ValueError(f"export_ensemble: an ensemble needs at least 2 members, got {len(members)}")
    loaded = [load_policy(m) for m in members]
    first = loaded[0]
    keys = ("observation", "actions", "network", "node", "scenario")
    for m in loaded:
        if len(m.networks) != 1:
            raise ValueError(f"export_ensemble: {m.path} is itself an ensemble of {len(m.networks)} networks")
        for key in keys:
            if m.header.get(key) != first.header.get(key):
                raise ValueError(f"export_ensemble: {m.path} and {first.path} differ in {key!r}: "
                                 f"{m.header.get(key)!r} against {first.header.get(key)!r}")
    weights = {f"members.{k}.{name}": t.detach().to("cpu", torch.float32).contiguous()
               for k, m in enumerate(loaded) for name, t in m.networks[0].state_dict().items()}
    header = {key: first.header[key] for key in keys if key in first.header}
    header |= {
        "format": FORMAT,
        "version": ENSEMBLE_VERSION,
        "network": {**first.header["network"], "members": len(loaded)},
        "members": [_member(m) for m in loaded],
        "training": training_config,
        "source_commit": source_commit or git_commit(),
        "weights": {"dtype": "float32", "sha256": {k: _sha256(v) for k, v in sorted(weights.items())}},
    }
    return _write(Path(path), weights, header)


def _member(m: ExportedPolicy) -> dict:
    """What an ensemble's header records of a member: its training seed, its code, its file's hash."""
    out = {"seed": m.header["training"].get("seed"), "source_commit": m.header["source_commit"],
           "sha256": m.file_sha256}
    return out | ({"selection": m.header["selection"]} if "selection" in m.header else {})


def _write(path: Path, weights: dict[str, torch.Tensor], header: dict) -> dict:
    """Write ``weights`` and ``header`` beside ``path`` and rename the file into place, so that a
    reader never sees half of it; the header as written."""
    # a non-JSON value in the training config (a Path, say) is recorded as its text, not refused
    text = json.dumps(header, default=str, sort_keys=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        save_file(weights, tmp, metadata={HEADER_KEY: text})
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return json.loads(text)


# ---- load --------------------------------------------------------------------------------------
class MeanQ:
    """An ensemble's numpy forward pass: the mean of its members' Q-values. A class, not a closure,
    so that the policy pickles into the worker processes of ``--jobs``."""

    def __init__(self, members: list[NumpyQNetwork]) -> None:
        self.members = members

    def __call__(self, x: np.ndarray) -> np.ndarray:
        return np.mean([f(x) for f in self.members], axis=0, dtype=np.float32)


class ExportedPolicy(Policy):
    """A policy file's greedy policy: the action with the highest Q-value; for an ensemble (several
    networks), the highest mean of the members' Q-values."""

    def __init__(self, path: Path, header: dict, networks: list[torch.nn.Sequential], file_sha256: str) -> None:
        self.path, self.header, self.networks, self.file_sha256 = path, header, list(networks), file_sha256
        self.parameters = sum(p.numel() for network in self.networks for p in network.parameters())
        self.forward = None  # the numpy forward pass, where the networks are small enough (above)
        if self.parameters <= NUMPY_MAX_PARAMETERS:
            numpy_networks = [NumpyQNetwork(network) for network in self.networks]
            self.forward = numpy_networks[0] if len(numpy_networks) == 1 else MeanQ(numpy_networks)
        self.name = path.stem
        self.engine_overrides = {}
        self.obs_dim = header["network"]["obs_dim"]
        # a file trained before some of this build's features (load_policy): which of this build's
        # features its network reads (indices, in order; None: all), and the names of the others
        self.inputs: np.ndarray | None = None
        self.blind_to: list[str] = []

    def q_values(self, obs: np.ndarray) -> np.ndarray:
        """Q-values of one observation (obs_dim,) -> (n_actions,), or of a batch (n, obs_dim) -> (n, n_actions)."""
        x = np.asarray(obs, dtype=np.float32)
        if x.ndim not in (1, 2) or x.shape[-1] != self.obs_dim:
            raise ValueError(f"policy {self.name}: observation must have shape ({self.obs_dim},) "
                             f"or (n, {self.obs_dim}), got {x.shape}")
        if not np.isfinite(x).all():
            raise ValueError(f"policy {self.name}: observation has non-finite entries")
        if self.inputs is not None:
            x = x[..., self.inputs]
        if self.forward is not None:
            q = self.forward(np.atleast_2d(x))
        else:
            with torch.no_grad():
                batch = torch.from_numpy(np.atleast_2d(x))
                q = torch.stack([network(batch) for network in self.networks]).mean(dim=0).numpy()
        if not np.isfinite(q).all():  # finite weights can still overflow: argmax would pick at random
            raise ValueError(f"policy {self.name}: non-finite Q-values {q.tolist()[:4]} on a finite observation")
        return q[0] if x.ndim == 1 else q

    def act(self, obs: np.ndarray) -> int:
        shape = np.shape(obs)
        if shape != (self.obs_dim,):
            raise ValueError(f"policy {self.name}: observation must have shape ({self.obs_dim},), got {shape}")
        return int(np.argmax(self.q_values(obs)))

    def check_scenario(self, scenario) -> None:
        """Refuse a scenario whose observation scales differ from the ones it trained on: the same
        features would then mean other numbers."""
        trained = self.header["observation"]
        scales = dataclasses.asdict(scenario.observation)
        for key in sorted(set(trained["scales"]) | set(scales)):
            if trained["scales"].get(key) != scales.get(key):
                raise PolicyFileError(f"policy file {self.path}: trained with observation.{key} = "
                                      f"{trained['scales'].get(key)}, scenario {scenario.name} has {scales.get(key)}")


def _first_difference(theirs: list, ours: list) -> str | None:
    for i, (a, b) in enumerate(zip(theirs, ours)):
        if a != b:
            return f"entry {i} is {a!r}, this build has {b!r}"
    if len(theirs) != len(ours):
        return f"{len(theirs)} entries, this build has {len(ours)}"
    return None


def _raw_header(path: Path, data: bytes) -> dict:
    """The safetensors JSON header, checked by hand first so that truncation and a foreign file get their own words."""
    fail = lambda problem: PolicyFileError(f"policy file {path}: {problem}")  # noqa: E731
    if len(data) < 8 or data[8:9] != b"{":
        raise fail(f"not an rlctl policy file (not a safetensors file: {len(data)} bytes, no JSON header)")
    (n,) = struct.unpack("<Q", data[:8])
    if 8 + n > len(data):
        raise fail(f"truncated or corrupted: the safetensors header promises {n} bytes of JSON, "
                   f"the file holds {len(data) - 8} after the length")
    try:
        raw = json.loads(data[8:8 + n])
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise fail(f"corrupted: the safetensors header is not valid JSON ({exc})") from None
    if not isinstance(raw, dict):
        raise fail("corrupted: the safetensors header is not a JSON object")
    ends = [e["data_offsets"][1] for k, e in raw.items()
            if k != "__metadata__" and isinstance(e, dict) and isinstance(e.get("data_offsets"), list)
            and len(e["data_offsets"]) == 2 and isinstance(e["data_offsets"][1], int)]
    need = 8 + n + max(ends, default=0)
    if need > len(data):
        raise fail(f"truncated: the header promises {need} bytes, the file holds {len(data)}")
    return raw


def _policy_header(path: Path, raw: dict) -> dict:
    fail = lambda problem: PolicyFileError(f"policy file {path}: {problem}")  # noqa: E731
    meta = raw.get("__metadata__") or {}
    if not isinstance(meta, dict) or HEADER_KEY not in meta:
        raise fail(f"not an rlctl policy file (a safetensors file without an {HEADER_KEY!r} header)")
    try:
        header = json.loads(meta[HEADER_KEY])
    except (TypeError, json.JSONDecodeError) as exc:
        raise fail(f"corrupted: the {HEADER_KEY!r} header is not valid JSON ({exc})") from None
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        got = header.get("format") if isinstance(header, dict) else header
        raise fail(f"not an rlctl policy file (format {got!r}, expected {FORMAT!r})")
    if header.get("version") not in READ_VERSIONS:
        raise fail(f"unsupported format version {header.get('version')!r} (this build reads versions "
                   f"{', '.join(map(str, READ_VERSIONS))})")
    for key, sub in (("observation", ("features", "low", "high", "scales")), ("actions", ()),
                     ("network", ("obs_dim", "n_actions", "net_arch", "dueling")), ("weights", ("dtype", "sha256")),
                     ("training", ()), ("scenario", ()), ("source_commit", ())):
        if key not in header:
            raise fail(f"the header has no {key!r}")
        for s in sub:
            if not isinstance(header[key], dict) or s not in header[key]:
                raise fail(f"the header has no '{key}.{s}'")
    net = header["network"]
    for s in ("obs_dim", "n_actions"):  # "39" would read as 39 and "false" as true: a header says what it means
        if isinstance(net[s], bool) or not isinstance(net[s], int):
            raise fail(f"network.{s} must be a whole number, got {net[s]!r}")
    if not isinstance(net["dueling"], bool):
        raise fail(f"network.dueling must be true or false, got {net['dueling']!r}")
    return header


def _check_layout(path: Path, header: dict) -> list[int]:
    fail = lambda problem: PolicyFileError(f"policy file {path}: {problem}")  # noqa: E731
    node = header.get("node")
    if node is not None and (not isinstance(node, dict) or not isinstance(node.get("engines"), list)
                             or not node["engines"] or not all(isinstance(n, str) and n for n in node["engines"])):
        raise fail(f"node.engines must list the node's engine names, got {node!r}")
    ours_features, ours_low, ours_high, ours_actions = layout(node["engines"] if node else None)
    obs = header["observation"]
    features = obs["features"]
    if not isinstance(features, list):
        raise fail(f"observation.features must be a list, got {features!r}")
    positions = _positions(features, ours_features)
    if isinstance(positions, str):
        raise fail(f"observation layout differs from this build's: {positions}")
    for bound, ours in (("low", ours_low), ("high", ours_high)):
        theirs = obs[bound]
        if not isinstance(theirs, list) or len(theirs) != len(features):
            raise fail(f"observation.{bound} must list {len(features)} bounds, got {theirs!r}")
        for name, a, i in zip(features, theirs, positions):
            if a != float(ours[i]):
                raise fail(f"observation layout differs from this build's: {bound} bound of {name!r} is {a}, "
                           f"this build has {float(ours[i])}")
    actions = header["actions"]
    if not isinstance(actions, list):
        raise fail(f"actions must be a list, got {actions!r}")
    if len(actions) != len(ours_actions):
        raise fail(f"action list differs from this build's: {len(actions)} actions {actions}, "
                   f"this build has {len(ours_actions)} {list(ours_actions)}")
    diff = _first_difference(actions, list(ours_actions))
    if diff:
        raise fail(f"action list differs from this build's: {diff}")
    net = header["network"]
    if net["obs_dim"] != len(features) or net["n_actions"] != len(ours_actions):
        raise fail(f"network shape obs_dim={net['obs_dim']!r} n_actions={net['n_actions']!r} does not match the "
                   f"{len(features)} features and {len(ours_actions)} actions")
    scales, names = obs["scales"], [f.name for f in dataclasses.fields(Observation)]
    if not isinstance(scales, dict) or set(scales) - set(names):
        raise fail(f"observation.scales must map some of {names} to numbers, got {scales!r}")
    for name, value in scales.items():  # each divides a feature: a sign or a zero would turn what the network reads
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
            raise fail(f"observation.scales.{name} must be a finite number > 0, got {value!r}")
    return positions


def _positions(theirs: list, ours: list) -> list[int] | str:
    """Where each of a file's features sits in this build's layout, or what does not fit. This
    build's features must hold the file's in the same order; it may have more (features added since
    the policy trained, which its network is then blind to), never fewer or others."""
    positions, j = [], 0
    for i, name in enumerate(theirs):
        while j < len(ours) and ours[j] != name:
            j += 1
        if j == len(ours):
            where = f"feature {i} is {name!r}, " + (f"which this build does not have" if name not in ours else
                                                    f"out of this build's order")
            return where + f" (this build's features: {len(ours)}, the file's: {len(theirs)})"
        positions.append(j)
        j += 1
    return positions


def blind_network(network: torch.nn.Sequential, inputs: np.ndarray, width: int) -> torch.nn.Sequential:
    """A copy of ``network`` that takes all ``width`` features of this build: its input layer(s)
    widened, the weights it had on the features at ``inputs`` and zeros on the others, so that it
    computes what it did whatever those say (fine-tuning from an older file starts from it)."""
    network = copy.deepcopy(network)
    trunk, head = network
    firsts = [m for m in trunk if isinstance(m, torch.nn.Linear)][:1] or (
        [head.value[0], head.advantage[0]] if hasattr(head, "value") else [head])
    for layer in firsts:
        w = torch.zeros(layer.out_features, width, dtype=layer.weight.dtype)
        w[:, torch.as_tensor(inputs)] = layer.weight.data
        layer.weight, layer.in_features = torch.nn.Parameter(w), width
    return network


def read_capped(f: BinaryIO, path: Path, max_bytes: int) -> bytes:
    """The bytes of the open file ``f``, refused before reading when its size passes ``max_bytes``;
    at most ``max_bytes + 1`` are read, in case it grows meanwhile."""
    size = os.fstat(f.fileno()).st_size
    data = f.read(max_bytes + 1) if size <= max_bytes else b""
    if size > max_bytes or len(data) > max_bytes:
        raise PolicyFileError(f"policy file {path}: {max(size, len(data))} bytes, over the {max_bytes}-byte cap "
                              f"on a policy file")
    return data


def load_policy(path: str | Path, max_bytes: int = MAX_POLICY_BYTES, opened: BinaryIO | None = None) -> ExportedPolicy:
    """Read and check a policy file; never unpickles. Raises ``PolicyFileError`` naming the file and the problem.

    A file over ``max_bytes`` is refused unread. With ``opened``, the file is read from there
    (the sidecar opens a reload's file itself, confined to its directory) and ``path`` only names
    it in messages and in ``ExportedPolicy.path``."""
    path = Path(path)
    if opened is None:
        if not path.exists():
            raise PolicyFileError(f"policy file {path}: no such file")
        if not path.is_file():
            raise PolicyFileError(f"policy file {path}: not a file")
        with path.open("rb") as f:
            data = read_capped(f, path, max_bytes)
    else:
        data = read_capped(opened, path, max_bytes)
    fail = lambda problem: PolicyFileError(f"policy file {path}: {problem}")  # noqa: E731
    header = _policy_header(path, _raw_header(path, data))
    positions = _check_layout(path, header)
    net = header["network"]
    count = _members(path, header)
    build = lambda: q_network(int(net["obs_dim"]), int(net["n_actions"]),  # noqa: E731
                              [int(w) for w in net["net_arch"]], bool(net["dueling"]))
    try:
        with torch.device("meta"):  # shapes only: a header that names a huge network costs no memory
            shapes = [build() for _ in range(count)]
    except (TypeError, ValueError, RuntimeError) as exc:
        raise fail(f"the header's network cannot be built ({exc})") from None
    try:
        tensors = load_tensors(data)
    except (SafetensorError, ValueError, RuntimeError) as exc:
        raise fail(f"corrupted safetensors data ({exc})") from None
    prefix = (lambda k: "") if count == 1 else (lambda k: f"members.{k}.")  # version 2: one network, unprefixed
    expected = {prefix(k) + name: t for k, network in enumerate(shapes) for name, t in network.state_dict().items()}
    what = f"the {'dueling' if net['dueling'] else 'plain'} network of net_arch {net['net_arch']}"
    for name in expected:
        if name not in tensors:
            raise fail(f"weight {name!r} is missing ({what}{'' if count == 1 else f', {count} members'} needs it)")
    for name in tensors:
        if name not in expected:
            raise fail(f"weight {name!r} is not part of the network the header describes")
    for name in expected:  # in the network's order: the first layer that does not fit is named
        t = tensors[name]
        if tuple(t.shape) != tuple(expected[name].shape):
            raise fail(f"weight {name!r} has shape {tuple(t.shape)}, the network the header describes "
                       f"needs {tuple(expected[name].shape)}")
        if t.dtype != expected[name].dtype:
            raise fail(f"weight {name!r} has dtype {t.dtype}, expected {expected[name].dtype}")
        if not torch.isfinite(t).all():
            raise fail(f"weight {name!r} has non-finite entries (NaN or inf): it would decide nothing sound")
    sums = header["weights"]["sha256"]
    if not isinstance(sums, dict) or set(sums) != set(tensors):
        raise fail("the header's checksums do not list the file's weights")
    for name in sorted(tensors):
        if _sha256(tensors[name]) != sums[name]:
            raise fail(f"checksum mismatch for weight {name!r}: the file is corrupted")
    networks = [build() for _ in range(count)]  # every weight checked: now the real ones, as large as the file
    for k, network in enumerate(networks):
        network.load_state_dict({name[len(prefix(k)):]: t for name, t in tensors.items()
                                 if name.startswith(prefix(k))}, strict=True)
        network.eval()
    policy = ExportedPolicy(path, header, networks, hashlib.sha256(data).hexdigest())
    ours = layout(header["node"]["engines"] if header.get("node") else None)[0]
    if len(positions) < len(ours):  # trained before some features existed: it reads the others only
        policy.inputs, policy.obs_dim = np.asarray(positions), len(ours)
        policy.blind_to = [f for f in ours if f not in header["observation"]["features"]]
    return policy


def _members(path: Path, header: dict) -> int:
    """How many networks the file holds: 1 in version 2; ``network.members`` (at least 2, with as
    many entries under ``members``) in version 3."""
    if header["version"] == VERSION:
        return 1
    fail = lambda problem: PolicyFileError(f"policy file {path}: {problem}")  # noqa: E731
    count = header["network"].get("members")
    if not isinstance(count, int) or isinstance(count, bool) or count < 2:
        raise fail(f"network.members must be an integer >= 2 in version {ENSEMBLE_VERSION}, got {count!r}")
    if not isinstance(header.get("members"), list) or len(header["members"]) != count:
        raise fail(f"members must list the {count} members network.members counts, got {header.get('members')!r}")
    return count
