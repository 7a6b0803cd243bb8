"""What every policy, baseline or learned, offers to ``rlctl eval``, training and the sidecar."""
from __future__ import annotations

import numpy as np


class Policy:
    """A policy sees the observation vector (env/observation.py) and returns an action id
    (engine/control.py ``ACTIONS``). ``engine_overrides`` are engine settings it pins for its
    episodes: a fixed factor, or vLLM's scheduling."""

    name: str = "policy"
    engine_overrides: dict = {}

    def reset(self, seed: int | None = None, env=None) -> None:
        """A new episode starts (``env``: the environment it runs in, for a policy that looks
        inside it, such as the oracle, the lookahead and the on-time fallback (agents/unpark.py);
        every other policy sees only observations)."""

    def act(self, obs: np.ndarray) -> int:
        raise NotImplementedError
