"""Node policies by name (env/shared_gpu_env.py): a baseline spec (``partition``, ``overcommit:K``,
``static:K``, ``watermark``, ``vllm``, ``sglang``, ``random``, ``oracle``) or a node policy file,
and the list of baselines a node policy is compared with."""
from __future__ import annotations

from agents.baselines import Random, Static
from agents.export import POLICY_SUFFIX, load_policy
from agents.node_baselines import NodeWatermark, Overcommit, Partition, PartitionSGLang, PartitionVLLM
from agents.node_oracle import NodeOracle
from agents.policy import Policy
from experiments import POLICIES, find

_SIMPLE = {"partition": Partition, "watermark": NodeWatermark, "vllm": PartitionVLLM, "sglang": PartitionSGLang,
           "random": Random}


def node_baselines(scenario) -> list[str]:
    """Every node baseline's spec, with the scenario's tuned K for ``overcommit:K`` and ``static:K``."""
    return list(dict.fromkeys(["partition", f"overcommit:{scenario.best_overcommit:g}",
                               f"static:{scenario.best_static:g}", "watermark", "vllm", "sglang", "random"]))


def _number(spec: str) -> float:
    try:
        return float(spec.split(":", 1)[1])
    except ValueError:
        raise ValueError(f"policy {spec!r}: needs a number K, e.g. {spec.split(':')[0]}:1.5") from None


def is_node_baseline(spec: str) -> bool:
    """Whether ``spec`` names a node baseline (not a policy file)."""
    return spec in _SIMPLE or spec == "oracle" or spec.startswith(("overcommit:", "static:"))


def make_node_policy(spec: str, engines: list[str] | None = None) -> Policy:
    """A node policy from its spec (see the module docstring) or a node policy file; with
    ``engines``, a policy file must have been trained on a node of those engines, in that order."""
    spec = str(spec)
    if spec.startswith("overcommit:"):
        return Overcommit(_number(spec))
    if spec.startswith("static:"):
        return Static(_number(spec))
    if spec in _SIMPLE:
        return _SIMPLE[spec]()
    if spec == "oracle":
        return NodeOracle()
    path = find(spec, POLICIES, POLICY_SUFFIX)
    if path.is_file() or spec.endswith(POLICY_SUFFIX):
        policy = load_policy(path)
        trained = (policy.header.get("node") or {}).get("engines")
        if trained is None:
            raise ValueError(f"policy file {path}: trained for one engine, not for a node: evaluate it on an "
                             "engine scenario")
        if engines is not None and list(trained) != list(engines):
            raise ValueError(f"policy file {path}: trained on a node of engines {trained}, this node has {list(engines)}")
        return policy
    raise ValueError(f"node policy {spec!r} does not exist: use partition, overcommit:K, static:K, watermark, vllm, "
                     f"sglang, random, oracle or a node policy file (*{POLICY_SUFFIX})")
