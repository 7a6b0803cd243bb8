"""What every policy, baseline or learned, offers to ``rlctl eval``, training and the sidecar."""
from __future__ import annotations

import numpy as np


class Policy:
    """A policy sees the observation vector (env/observation.py) and returns an action id
    (engine/control.py ``ACTIONS``). ``engine_overrides`` are engine settings it pins for its
    episodes: a fixed factor, or vLLM's scheduling."""

    name: str = "policy"
    engine_overrides: dict = {}
    stateful: bool = False  # it keeps state between decisions: a sidecar keeps a copy of it an engine

    def reset(self, seed: int | None = None, env=None) -> None:
        """A new episode starts (``env``: the environment it runs in, for a policy that looks
        inside it, such as the oracle, the lookahead and the on-time fallback (agents/unpark.py);
        every other policy sees only observations)."""

    def see(self, snapshot) -> None:
        """The snapshot (engine/snapshot.py) the next observation was made from, just before ``act``,
        for a policy that reads what the observation does not carry (the on-time fallback reads
        ``waiting_late``, agents/unpark.py); the evaluation loop (rlctl/evaluate.py) and the sidecar
        (rlctl/online/served.py) both hand it over. Every other policy ignores it."""

    def act(self, obs: np.ndarray) -> int:
        raise NotImplementedError
