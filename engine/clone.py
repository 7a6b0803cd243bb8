"""A copy of a tensor-free engine that runs on by itself: what a lookahead rolls forward.

Everything that changes as the engine runs is copied (queues, sequences and their records, blocks,
the ledger, sessions, the iteration log); what never changes is shared (configurations, the
executor and its cost model, the requests, finished records). Token lists are copied in one go,
not element by element.
"""
from __future__ import annotations

import copy


def _keep(engine, memo: dict) -> None:
    """Put into ``memo`` what copies of ``engine`` share with it and what they copy in one go."""
    for x in (engine.config, engine.model_config, engine.executor, engine.model, engine.last_snapshot):
        memo[id(x)] = x
    s = engine.scheduler
    sequences = [p[2] for p in s.pending] + s.unfinished()
    for seq in sequences:
        memo[id(seq.request)] = seq.request
        memo[id(seq.token_ids)] = list(seq.token_ids)
        if seq.host_kv is not None:  # a shape without data (a tensor-free pool keeps books only)
            memo[id(seq.host_kv)] = seq.host_kv
    for ctx in engine.sessions.values():
        memo[id(ctx.token_ids)] = list(ctx.token_ids)
        if ctx.host_kv is not None:
            memo[id(ctx.host_kv)] = ctx.host_kv
    for record in engine.completed:  # a finished request's record never changes again
        memo[id(record)] = record


def clone(engine):
    """An independent copy of ``engine`` (tensor-free only: real KV tensors are not copied)."""
    if engine.pool.materialize:
        raise ValueError("only a tensor-free engine (ProfiledExecutor without tensors) can be cloned")
    memo: dict = {}
    _keep(engine, memo)
    return copy.deepcopy(engine, memo)


def clone_node(node):
    """An independent copy of a node (engine/node.py): its engines and the device they share,
    copied once, so the copies share it as the originals do."""
    memo: dict = {}
    for engine in node.engines.values():
        if engine.pool.materialize:
            raise ValueError("only a node of tensor-free engines can be cloned")
        _keep(engine, memo)
    return copy.deepcopy(node, memo)
