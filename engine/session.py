"""A multi-turn session's context, kept between turns so the next turn prefills only new tokens."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class SessionContext:
    """The tokens of a session so far and where their KV is: device blocks, host copy, or nowhere
    (dropped: the next turn recomputes it). ``owner`` is the turn that holds the session from
    its admission until it finishes; later turns wait for it."""

    session_id: str
    token_ids: list[int] = field(default_factory=list)
    num_computed: int = 0
    block_table: list[int] = field(default_factory=list)
    host_kv: torch.Tensor | None = None
    last_used_s: float = 0.0
    owner: str | None = None

    @property
    def where(self) -> str:
        if self.block_table:
            return "device"
        return "host" if self.host_kv is not None else "dropped"
