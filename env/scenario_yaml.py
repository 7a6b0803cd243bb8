"""Loading scenarios: YAML files (``experiments/scenarios/``) into ``env/scenario.py``'s records.

Every key is checked at load: an unknown key, a wrong type or a value out of range fails with the
file and the dotted name of the field, before anything runs. ``from_mapping`` and ``read_yaml``
read the training configurations the same way.
"""
from __future__ import annotations

import math
import re
import types
import typing
from dataclasses import MISSING, fields, is_dataclass
from pathlib import Path

import yaml

from engine.roofline import deployment
from env.scenario import Distribution, GeneratorWorkload, PhasedWorkload, Scenario, ScenarioError, TraceWorkload
from experiments import SCENARIOS, bundled, find
from env.workload_builder import check_distribution, check_workload, trace_span
from env.workloads.sizing import MaxTokensRule

_RANGES = {  # field -> (low, high, low inclusive)
    "time_scale": (0, math.inf, False), "rate_rps": (0, math.inf, False), "mean_hold_s": (0, math.inf, False),
    "decision_interval_s": (0, math.inf, False), "max_steps": (1, math.inf, True), "mean_dwell_s": (0, math.inf, False),
    "evict_free_share": (0, 1, True), "alpha": (0, math.inf, True), "beta": (0, math.inf, True),
    "gamma": (0, math.inf, True), "kappa": (0, math.inf, True), "omega": (0, math.inf, True), "rho": (0, math.inf, True),
    "tokens_per_s_scale": (0, math.inf, False),
    "queue_scale": (1, math.inf, True), "swapped_scale": (1, math.inf, True),
    "slope_scale": (0, math.inf, False), "overcommit_scale": (0, math.inf, False), "best_static": (0, math.inf, False),
    "slice_s": (0, math.inf, False), "best_overcommit": (0, math.inf, False), "phase_offset": (0, math.inf, True),
}
_ARRIVALS = {"poisson": {"rate"}, "gamma": {"rate", "cv"}, "mmpp": {"rates", "mean_dwell_s"}}
_LENGTHS = {"lognormal": {"mean", "sigma", "low", "high"}, "pareto": {"alpha", "low", "high"},
            "trace": {"trace", "column"}}
_REQUIRED = {"poisson": {"rate"}, "gamma": {"rate", "cv"}, "mmpp": {"rates", "mean_dwell_s"},
             "lognormal": {"mean", "sigma"}, "pareto": {"alpha", "low", "high"}, "trace": {"trace", "column"}}


def _fail(where: str, path: str, problem: str) -> ScenarioError:
    """``where: path: problem``; the document itself (``path`` empty) as ``where: the file: problem``."""
    return ScenarioError(f"{where}: {path or 'the file'}: {problem}")


def _number(where: str, path: str, value, integer: bool = False):
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (integer and not isinstance(value, int)):
        hint = ""
        if isinstance(value, str) and re.fullmatch(r"[-+]?\d+(\.\d*)?[eE][-+]?\d+", value.strip()):
            hint = f" (YAML reads {value} as text: write it {_yaml_number(value, integer)})"
        raise _fail(where, path, f"must be {'an integer' if integer else 'a number'}, got {value!r}{hint}")
    if not math.isfinite(value):
        raise _fail(where, path, f"must be finite, got {value!r}")
    name = path.rsplit(".", 1)[-1]
    if name in _RANGES:
        low, high, inclusive = _RANGES[name]
        if value < low or (value == low and not inclusive) or value > high:
            bound = f">= {low}" if inclusive else f"> {low}"
            raise _fail(where, path, f"must be {bound}" + (f" and <= {high}" if high != math.inf else "") + f", got {value!r}")
    return value


def _yaml_number(text: str, integer: bool) -> str:
    """How to write ``text`` (``1e-3``, ``5e4``) for YAML (1.1, PyYAML's) to read it as a number: a float
    needs a point in its mantissa and a sign in its exponent (``1.0e-3``); a whole number its digits."""
    mantissa, exponent = re.split(r"[eE]", text.strip())
    if integer:
        value = float(text)
        return f"as {int(value)}" if value.is_integer() else "as a whole number"
    sign = "" if exponent[0] in "+-" else "+"
    return f"as {mantissa if '.' in mantissa else mantissa + '.0'}e{sign}{exponent}"


def from_mapping(cls, data, where: str, path: str = ""):
    """``cls`` from a mapping, every key known and every value of the declared type."""
    if not isinstance(data, dict):
        raise _fail(where, path, f"must be a mapping, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    known = {f.name: f for f in fields(cls)}
    for key in data:
        if key not in known:
            raise _fail(where, f"{path}.{key}".lstrip("."), f"unknown key (known: {', '.join(known)})")
    values = {}
    for name, f in known.items():
        sub = f"{path}.{name}".lstrip(".")
        if name not in data:
            if f.default is MISSING and f.default_factory is MISSING:
                raise _fail(where, sub, "is required")
            continue
        values[name] = _value(hints[name], data[name], where, sub)
    return cls(**values)


def _value(hint, value, where: str, path: str):
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        options = [a for a in args if a is not type(None)]
        if len(options) > 1:  # the workload: a trace, phases, or a generator
            kind = next((k for k in ("trace", "phases") if isinstance(value, dict) and k in value), None)
            cls = {"trace": TraceWorkload, "phases": PhasedWorkload}.get(kind, GeneratorWorkload)
            return from_mapping(cls, value, where, path)
        return _value(options[0], value, where, path)
    if is_dataclass(hint):
        if hint is Distribution:
            return _distribution(value, where, path)
        return from_mapping(hint, value, where, path)
    if hint is bool:
        if not isinstance(value, bool):
            raise _fail(where, path, f"must be true or false, got {value!r}")
        return value
    if hint is str:
        if not isinstance(value, str) or not value:
            raise _fail(where, path, f"must be a non-empty string, got {value!r}")
        return value
    if hint in (int, float):
        return _number(where, path, value, integer=hint is int)
    if origin is tuple and args[0] is str:  # a list of names (a training config's scenarios)
        if not isinstance(value, list) or not value:
            raise _fail(where, path, f"must be a list of one or more names, got {value!r}")
        return tuple(_value(str, v, where, f"{path}[{i}]") for i, v in enumerate(value))
    if origin is tuple and is_dataclass(args[0]):  # a list of records (a workload's phases)
        if not isinstance(value, list) or not value:
            raise _fail(where, path, f"must be a list of one or more mappings, got {value!r}")
        return tuple(from_mapping(args[0], v, where, f"{path}[{i}]") for i, v in enumerate(value))
    if origin is tuple:
        if not isinstance(value, list) or not value or (args[-1] is not Ellipsis and len(value) != len(args)):
            raise _fail(where, path, f"must be a list of {len(args) if args[-1] is not Ellipsis else 'one or more'} numbers, got {value!r}")
        return tuple(_number(where, f"{path}[{i}]", v) for i, v in enumerate(value))
    if hint is dict:
        if not isinstance(value, dict):
            raise _fail(where, path, f"must be a mapping, got {type(value).__name__}")
        return dict(value)
    raise _fail(where, path, f"unsupported type {hint}")  # pragma: no cover - a bug in this file


def _distribution(value, where: str, path: str) -> Distribution:
    if not isinstance(value, dict) or "kind" not in value:
        raise _fail(where, path, f"must be a mapping with a kind, got {value!r}")
    kind, params = value["kind"], {k: v for k, v in value.items() if k != "kind"}
    table = _ARRIVALS if path.endswith("arrivals") else _LENGTHS
    if kind not in table:
        raise _fail(where, f"{path}.kind", f"unknown kind {kind!r} (known: {', '.join(table)})")
    for key in params:
        if key not in table[kind]:
            raise _fail(where, f"{path}.{key}", f"unknown key for {kind} (known: {', '.join(sorted(table[kind]))})")
    for key in _REQUIRED[kind] - set(params):
        raise _fail(where, f"{path}.{key}", f"is required for {kind}")
    d = Distribution(kind, params)
    try:
        check_distribution(d, arrivals=table is _ARRIVALS)
    except (ValueError, FileNotFoundError) as exc:  # the distribution names the key: "mean must be > 0"
        raise _fail(where, path, str(exc)) from None
    return d


def _check(s: Scenario, where: str) -> Scenario:
    try:
        deployment(s.deployment)
    except ValueError as exc:  # an unknown name (the message names the known ones) or a bad checkpoint
        raise _fail(where, "deployment", str(exc)) from None
    try:
        s.engine_config()
    except TypeError as exc:
        raise _fail(where, "engine", f"not an engine setting ({exc})") from None
    except ValueError as exc:
        raise _fail(where, "engine", str(exc)) from None
    if s.cotenant is not None:
        for i, level in enumerate(s.cotenant.levels):
            if not 0 <= level < 1:
                raise _fail(where, f"cotenant.levels[{i}]", f"must be a share of device memory in [0, 1), got {level}")
    check_workload_fields(s.workload, where)
    return s


def check_workload_fields(w, where: str, path: str = "workload") -> None:
    """A workload's values beyond their types: the max_tokens rule, a window span, session keys,
    and everything it names (traces, distributions) built once."""
    try:
        MaxTokensRule.parse(w.max_tokens, name=f"{path}.max_tokens")
    except ValueError as exc:
        raise _fail(where, f"{path}.max_tokens", str(exc)) from None
    if isinstance(w, TraceWorkload) and w.starts is not None and not 0 <= w.starts[0] <= w.starts[1]:
        raise _fail(where, f"{path}.starts", f"must be [low, high] with 0 <= low <= high, got {list(w.starts)}")
    if isinstance(w, GeneratorWorkload) and w.sessions is not None:
        unknown = set(w.sessions) - {"mean_turns", "mean_think_s", "first_prompt"}
        if unknown:
            raise _fail(where, f"{path}.sessions.{sorted(unknown)[0]}", "unknown key (known: mean_turns, mean_think_s, first_prompt)")
        if w.sessions.get("first_prompt") is not None:  # a length distribution, checked as every other one
            _distribution(w.sessions["first_prompt"], where, f"{path}.sessions.first_prompt")
    try:
        check_workload(w)
    except (ValueError, FileNotFoundError) as exc:
        raise _fail(where, path, str(exc)) from None
    if isinstance(w, TraceWorkload) and w.starts is not None and w.starts[0] >= trace_span(w):
        raise _fail(where, f"{path}.starts", f"its windows start at {w.starts[0]:g} s or later, where {w.trace} has "
                                             f"no request left (it spans {trace_span(w):g} s of trace time)")


def scenario_from_dict(data: dict, where: str = "scenario") -> Scenario:
    return _check(from_mapping(Scenario, data, where, ""), where)


def load_scenario(path: str | Path) -> Scenario:
    """Read a scenario YAML file; a bundled name (``burst``) reads ``experiments/scenarios/burst.yaml``."""
    p = find(path, SCENARIOS, ".yaml")
    if not p.exists():  # naming the bundled ones reads every file: only when the message is needed
        raise ScenarioError(f"scenario: {path}: no such file (bundled: {', '.join(bundled_scenarios())})")
    data = read_yaml(p, f"scenario: {path}: no such file")
    if isinstance(data, dict) and "tenants" in data:
        raise ScenarioError(f"{p}: a node scenario (several engines on one GPU): it runs in rlctl/SharedGPU-v0 "
                            "(env/shared_gpu_env.py)")
    if isinstance(data, dict) and "name" not in data:
        data = {"name": p.stem, **data}
    return scenario_from_dict(data, str(p))


def read_yaml(path: Path, missing: str):
    """The YAML document in ``path``; ``ScenarioError(missing)`` when there is no such file."""
    if not path.exists():
        raise ScenarioError(missing)
    try:
        return yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise ScenarioError(f"{path}: not valid YAML ({exc})") from None
    except IsADirectoryError:
        raise ScenarioError(f"{path}: a directory, not a YAML file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ScenarioError(f"{path}: cannot be read as a YAML file ({exc})") from None


def bundled_scenarios(node: bool = False) -> list[str]:
    """The shipped scenarios of one engine, or (``node``) those of several engines on one GPU
    (a file with ``tenants``: env/node_scenario.py)."""
    return [n for n in bundled(SCENARIOS, ".yaml") if is_node_file(SCENARIOS / f"{n}.yaml") == node]


def is_node_file(path: Path) -> bool:
    """Whether the YAML file at ``path`` is a node scenario (it has ``tenants``)."""
    if not path.is_file():
        return False
    data = read_yaml(path, "")
    return isinstance(data, dict) and "tenants" in data
