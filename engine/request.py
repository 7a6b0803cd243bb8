"""A request as a client sends it, and the engine's refusal of a bad one.

Every workload (a trace replay, a generator, a live client) produces these and the engine
consumes them; the engine checks each at submission and refuses a bad one by name.
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field

from engine.config import is_whole


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
    # prompt tokens each hash id covers (Mooncake's 512): hash id k names the prompt's k-th run of this many
    # tokens (the last, its rest), so that requests sharing one share those tokens (``EngineConfig.prefix_caching``)
    hash_block_tokens: int | None = None


class RequestError(ValueError):
    """A request the engine refuses; nothing else is affected."""


def check_request(req: Request, max_model_len: int, vocab_size: int) -> None:
    """Raise ``RequestError`` naming what is wrong with ``req`` for an engine of this context length
    and vocabulary."""
    rid = req.request_id
    if not isinstance(rid, str) or not rid:
        raise RequestError(f"request {rid!r}: request_id must be a non-empty string")
    for name in ("prompt_len", "output_len", "max_tokens"):  # a float or NaN here failed later, in the engine's loop
        value = getattr(req, name)
        if not is_whole(value):
            raise RequestError(f"request {rid!r}: {name} must be a whole number of tokens, got {value!r}")
    if isinstance(req.arrival_s, bool) or not isinstance(req.arrival_s, numbers.Real):
        raise RequestError(f"request {rid!r}: arrival_s must be a finite time >= 0, got {req.arrival_s!r}")
    if req.prompt_len <= 0:
        raise RequestError(f"request {rid!r}: the prompt is empty")
    if req.prompt_len >= max_model_len:
        raise RequestError(f"request {rid!r}: prompt of {req.prompt_len} tokens does not fit the "
                           f"context of {max_model_len} tokens (it needs room for one output token)")
    if req.max_tokens <= 0:
        raise RequestError(f"request {rid!r}: max_tokens must be > 0, got {req.max_tokens}")
    if req.output_len <= 0:
        raise RequestError(f"request {rid!r}: output_len must be > 0, got {req.output_len}")
    if not math.isfinite(req.arrival_s) or req.arrival_s < 0:
        raise RequestError(f"request {rid!r}: arrival_s must be a finite time >= 0, got {req.arrival_s}")
    if req.hash_ids:
        if not is_whole(req.hash_block_tokens) or req.hash_block_tokens <= 0:
            raise RequestError(f"request {rid!r}: hash_ids need hash_block_tokens, the prompt tokens each covers "
                               f"(a whole number > 0), got {req.hash_block_tokens!r}")
        bad = [h for h in req.hash_ids if not is_whole(h)]
        if bad:
            raise RequestError(f"request {rid!r}: hash id {bad[0]!r} is not a whole number")
    if req.prompt_ids is not None:
        if len(req.prompt_ids) != req.prompt_len:
            raise RequestError(f"request {rid!r}: {len(req.prompt_ids)} prompt ids but prompt_len {req.prompt_len}")
        kind = [t for t in req.prompt_ids if not is_whole(t)]
        if kind:
            raise RequestError(f"request {rid!r}: token id {kind[0]!r} is not a whole number")
        bad = [t for t in req.prompt_ids if not (0 <= t < vocab_size)]
        if bad:
            raise RequestError(f"request {rid!r}: token id {bad[0]} is outside the vocabulary [0, {vocab_size})")
