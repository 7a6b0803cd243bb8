"""Policies by name: a baseline spec (``static:K``, ``watermark``, ``vllm``, ``sglang``, ``random``),
a reference (``oracle``, ``lookahead``) or a policy file, and the lists of baselines ``rlctl eval`` and training compare against."""
from __future__ import annotations

import math
from pathlib import Path

from agents.baselines import (VLLM, Random, SGLang, SGLangCached, SGLangCode, Static, VLLMCached, VLLMChunked,
                              VLLMV1, Watermark)
from agents.oracle import Lookahead, Oracle
from agents.export import POLICY_SUFFIX, ExportedPolicy, PolicyFileError, load_policy
from agents.policy import Policy
from agents.unpark import Unpark
from env.scenario import Observation
from experiments import POLICIES, bundled, find


def static_spec(factor: float) -> str:
    """``static:K`` written as its row is labelled (``static:1``, ``static:1.5``), so that the
    conservative reservation and a tuned factor of 1 are one spec, not two with one label."""
    return f"static:{factor:g}"


def canonical(spec: str) -> str:
    """``spec`` as its row is labelled where it is a fixed factor (``static:2.0`` is ``static:2``),
    so that the same policy given twice, once by a user and once by ``--baselines``, runs once."""
    if isinstance(spec, str) and spec.startswith("static:"):
        try:
            return static_spec(float(spec.split(":", 1)[1]))
        except ValueError:
            pass  # make_policy names what is wrong with it
    return spec


def baselines(best_static: float = 1.0) -> list[str]:
    """Every baseline's spec; ``best_static`` is the scenario's tuned fixed factor."""
    return list(dict.fromkeys([static_spec(1.0), static_spec(best_static), "watermark", "vllm", "sglang", "random"]))


SWEEP_FACTORS = (1.0, 1.25, 1.5, 2.0, 2.5, 3.0, 4.0, 6.0, 8.0, 12.0, 16.0)


def static_sweep(max_factor: float) -> list[str]:
    """``static:K`` for every factor of a multiplicative grid from 1 up to ``max_factor``."""
    return [static_spec(k) for k in SWEEP_FACTORS if k <= max_factor]


_SIMPLE = {"watermark": Watermark, "vllm": VLLM, "vllm_chunked": VLLMChunked, "vllm_cached": VLLMCached,
           "vllm_v1": VLLMV1, "sglang": SGLang, "sglang_code": SGLangCode, "sglang_cached": SGLangCached,
           "random": Random}
REFERENCES = {"oracle": Oracle, "lookahead": Lookahead}  # evaluation references that look inside their environment; never served


def is_baseline(spec: str) -> bool:
    """Whether ``spec`` names a baseline (``static:K`` or one of the simple ones) rather than a policy file."""
    return isinstance(spec, str) and (spec.startswith("static:") or spec in _SIMPLE)


def is_trained(spec: str) -> bool:
    """Whether ``spec`` names a trained policy (a policy file), which acts behind the safety shield,
    as it is served; a baseline or a lookahead reference does not."""
    return not is_baseline(spec) and not is_reference(spec)


def is_reference(spec: str) -> bool:
    """Whether ``spec`` names an evaluation reference: ``oracle``, ``lookahead`` or ``lookahead:N``
    (the lookahead scoring each plan on N draws of the output lengths, 2 by default), or
    ``lookahead:N:warm`` (its estimate also knows an earlier episode's output lengths)."""
    return isinstance(spec, str) and (spec in REFERENCES or spec.startswith("lookahead:"))


def is_unpark(spec: str) -> bool:
    """Whether ``spec`` names the fallback against the parking around a trained policy (agents/unpark.py)."""
    return isinstance(spec, str) and spec.startswith("unpark:")


def unpark_spec(spec: str) -> tuple[float, bool, str]:
    """``unpark:F:POLICY`` or ``unpark:F:ontime:POLICY`` as (F, on time, the trained policy's spec);
    a ``ValueError`` says what is wrong with it."""
    factor, _, inner = spec.removeprefix("unpark:").partition(":")
    mode, _, rest = inner.partition(":")
    on_time = mode == "ontime"  # a file named ontime:X: give its path as ./ontime:X
    if on_time:
        inner = rest
    try:
        f = float(factor)
    except ValueError:
        f = math.nan
    if not math.isfinite(f) or not inner or is_baseline(inner) or is_reference(inner) or is_unpark(inner):
        raise ValueError(f"policy {spec!r}: unpark:F:POLICY needs a finite fallback factor F and a trained policy (a "
                         "policy file or a shipped name), e.g. unpark:4:default (unpark:F:ontime:POLICY: only "
                         "while the queue can still be served on time)")
    return f, on_time, inner


def unpark(policy: ExportedPolicy, factor: float, on_time: bool) -> Unpark:
    """The fallback around a trained ``policy``, reading observations at the scales it was trained at."""
    scales = policy.header["observation"]["scales"]
    try:
        return Unpark(policy, factor, Observation(**scales), on_time=on_time)
    except TypeError as exc:
        raise PolicyFileError(f"policy file {policy.path}: observation.scales {scales} do not fit this build's "
                              f"scales ({exc})") from None


def label_policies(policies: dict) -> dict:
    """``policies`` (spec -> policy, in order) with a label each of their own, since a results table
    and its JSON are keyed by label: a trained policy labelled as another policy is (every training
    run writes a ``policy.rlpolicy``) is relabelled with its spec, the path as given, less the suffix.
    Two specs that still share a label (the same file by two paths) are an error naming both."""
    names = [p.name for p in policies.values()]
    for spec, policy in policies.items():
        if names.count(policy.name) > 1 and is_trained(str(spec)):
            policy.name = str(spec).removesuffix(POLICY_SUFFIX)
    by_label: dict[str, list[str]] = {}
    for spec, policy in policies.items():
        by_label.setdefault(policy.name, []).append(str(spec))
    clashes = [f"{' and '.join(specs)} (both {name!r})" for name, specs in by_label.items() if len(specs) > 1]
    if clashes:
        raise ValueError(f"policies: two specs would get the same label in the results: {'; '.join(clashes)}; "
                         "give each policy once")
    return policies


def make_policy(spec: str) -> Policy:
    """A policy from its spec: ``static:K``, ``watermark``, ``vllm``, ``random``, the path of a
    policy file (``*.rlpolicy``, agents/export.py) for a trained one, or the name of one shipped in
    experiments/policies/."""
    if isinstance(spec, Path):
        spec = str(spec)
    if not isinstance(spec, str) or not spec:
        raise ValueError(f"policy: expected a spec such as static:1.0, watermark, vllm, sglang, random, oracle, lookahead or a policy file; "
                         f"got {spec!r}")
    if spec.startswith("static:"):
        try:
            factor = float(spec.split(":", 1)[1])
        except ValueError:
            raise ValueError(f"policy {spec!r}: static:K needs a number K, e.g. static:1.5") from None
        return Static(factor)
    if spec in _SIMPLE:
        return _SIMPLE[spec]()
    if spec in REFERENCES:
        return REFERENCES[spec]()
    if spec.startswith("lookahead:"):
        n, _, warm = spec.split(":", 1)[1].partition(":")
        if not n.isdigit() or int(n) < 1 or warm not in ("", "warm"):
            raise ValueError(f"policy {spec!r}: lookahead:N needs a whole number N >= 1 of draws, e.g. lookahead:8, "
                             "and lookahead:N:warm one whose estimate knows an earlier episode's output lengths")
        return Lookahead(samples=int(n), warm=bool(warm))
    if is_unpark(spec):
        factor, on_time, inner = unpark_spec(spec)
        return unpark(make_policy(inner), factor, on_time)
    path = find(spec, POLICIES, POLICY_SUFFIX)
    if path.is_dir():
        raise ValueError(f"policy {spec!r} is a folder; a policy is a file (*{POLICY_SUFFIX}), e.g. the "
                         f"policy{POLICY_SUFFIX} rlctl train writes into its run folder")
    if path.is_file() or spec.endswith(POLICY_SUFFIX):
        policy = load_policy(path)  # a missing file: PolicyFileError naming the path
        if policy.header.get("node"):
            raise ValueError(f"policy file {path}: trained for a node of engines {policy.header['node']['engines']}: "
                             "evaluate it on a node scenario")
        return policy
    shipped = bundled(POLICIES, POLICY_SUFFIX)
    raise ValueError(f"policy {spec!r} does not exist: use static:K, watermark, vllm, sglang, random, oracle, lookahead or a "
                     f"policy file (*{POLICY_SUFFIX})" + (f", or a shipped policy: {', '.join(shipped)}" if shipped else ""))
