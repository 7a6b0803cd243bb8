"""The request record every workload produces and the engine consumes."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Request:
    """One inference request as a client sends it.

    Times are engine-clock seconds. ``output_len`` is how many tokens the client really generates
    before it stops (what a trace records: the engine stops the request there, as on EOS), while
    ``max_tokens`` is the limit it declared, which is what a conservative engine must reserve for.
    For a turn of a multi-turn session, ``prompt_len`` counts only the turn's new tokens: the
    engine holds the session's earlier context itself.
    """

    request_id: str
    arrival_s: float
    prompt_len: int
    output_len: int
    max_tokens: int
    session_id: str | None = None
    prompt_ids: tuple[int, ...] | None = None  # None: the engine draws ids from its seed
    hash_ids: tuple[int, ...] = field(default=(), repr=False)  # prefix-block hashes, where a trace has them
