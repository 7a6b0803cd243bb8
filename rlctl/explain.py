"""``rlctl explain``: which observation features a trained policy's decisions turn on.

The policy runs one episode of a scenario and one of a reference scenario, on the same seed,
behind the served shield (as ``rlctl eval`` runs it). Then, one feature at a time, that feature
of every observation of the first episode is set to its mean over the reference episode, and the
decisions the policy would take on the changed observations are counted where they differ from
the ones it took, and by what they became. A feature that changes many decisions is one the
policy reads differently on the two scenarios: on a deployment it never saw, the first place to
look (README, "Results": the Qwen2.5-7B A10, where one feature turns the back-offs that starve
the engine into scale-ups).

It is open-loop: the changed observations are the recorded ones with one entry replaced, not a
new episode, so it says what the policy reads, not what the episode would then have become.
Decisions are the policy's own, before the shield.
"""
from __future__ import annotations

import numpy as np

from agents.policy import Policy
from engine.control import ACTIONS
from env.observation import FEATURES
from rlctl.evaluate import make_env, run_episode


class _Recorder(Policy):
    """``policy`` as it acts, keeping every observation it saw and every decision it took."""

    def __init__(self, policy: Policy) -> None:
        self.policy, self.name, self.engine_overrides = policy, policy.name, policy.engine_overrides
        self.observations: list[np.ndarray] = []
        self.decisions: list[int] = []

    def reset(self, seed: int | None = None, env=None) -> None:
        self.policy.reset(seed, env)

    def see(self, snapshot) -> None:
        self.policy.see(snapshot)

    def act(self, obs: np.ndarray) -> int:
        action = self.policy.act(obs)
        self.observations.append(np.array(obs, dtype=np.float32))
        self.decisions.append(int(action))
        return action


def record(policy: Policy, scenario, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """One episode of ``policy`` on ``scenario`` behind the served shield: the observations it
    saw (decisions x features) and the decisions it took."""
    recorder = _Recorder(policy)
    run_episode(make_env(scenario, shield=True), recorder, seed)
    return np.stack(recorder.observations), np.array(recorder.decisions)


def action_index(name: str) -> int:
    if name not in ACTIONS:
        raise ValueError(f"--action must be one of {', '.join(ACTIONS)}, got {name!r}")
    return ACTIONS.index(name)


def attribute(policy: Policy, observations: np.ndarray, decisions: np.ndarray, reference: np.ndarray,
              action: int | None = None) -> list[dict]:
    """For each feature, the decisions of ``decisions`` (those that are ``action``, if given) that
    change when that feature of their observation is set to its mean over ``reference``, most
    first (module docstring)."""
    chosen = decisions == action if action is not None else np.ones(len(decisions), dtype=bool)
    seen, taken = observations[chosen], decisions[chosen]
    rows = []
    for i, feature in enumerate(FEATURES):
        changed_obs = seen.copy()
        changed_obs[:, i] = reference[:, i].mean()
        now = np.array([policy.act(o) for o in changed_obs], dtype=int)
        moved = now != taken
        rows.append({"feature": feature, "mean": float(observations[:, i].mean()),
                     "reference_mean": float(reference[:, i].mean()), "changed": int(moved.sum()),
                     "to": {ACTIONS[a]: int(n) for a, n in enumerate(np.bincount(now[moved], minlength=len(ACTIONS)))
                            if n}})
    return sorted(rows, key=lambda r: -r["changed"])


def explain(policy: Policy, scenario, reference, seed: int, action: int | None = None) -> dict:
    """``rlctl explain``'s figures: the two episodes' decisions and ``attribute``'s rows."""
    observations, decisions = record(policy, scenario, seed)
    reference_obs, reference_decisions = record(policy, reference, seed)
    taken = _counts(decisions)
    return {"policy": policy.name, "scenario": scenario.name, "reference": reference.name, "seed": seed,
            "action": ACTIONS[action] if action is not None else None,
            "decisions": taken, "reference_decisions": _counts(reference_decisions),
            "explained": len(decisions) if action is None else taken[ACTIONS[action]],
            "features": attribute(policy, observations, decisions, reference_obs, action)}


def _counts(decisions: np.ndarray) -> dict[str, int]:
    return dict(zip(ACTIONS, np.bincount(decisions, minlength=len(ACTIONS)).tolist()))


def format_explain(out: dict, top: int) -> str:
    what = f"its {out['action']} decisions" if out["action"] else "its decisions"
    lines = [f"explain: {out['policy']} on {out['scenario']} (seed {out['seed']}): decisions {out['decisions']}",
             f"reference: {out['reference']}: decisions {out['reference_decisions']}",
             f"{what} ({out['explained']}) that change when one feature is set to its mean on {out['reference']}:",
             f"{'feature':26s} {'mean':>7s} {'reference':>9s} {'changed':>8s}  to"]
    if not out["explained"]:
        return "\n".join(lines[:2] + [f"{what}: none in this episode, so nothing to explain (another --seed, or "
                                       "another --action)"])
    for row in out["features"][:top]:
        to = ", ".join(f"{n} {a}" for a, n in row["to"].items()) or "-"
        lines.append(f"{row['feature']:26s} {row['mean']:7.3f} {row['reference_mean']:9.3f} {row['changed']:8d}  {to}")
    return "\n".join(lines)
