"""Executors run one iteration's work and say how long it took on the engine clock.

``TorchExecutor`` runs the real model on the real KV tensors and reports the measured time.
``ProfiledExecutor`` runs the same scheduler, block manager and ledger but takes each duration
from a ``CostModel``; it runs the model too (real tokens, deterministic clock) or skips the
tensors altogether (bookkeeping only, for engines far larger than the machine).
An engine binds its executor to its model and pool when it is built.
"""
from __future__ import annotations

import time
from typing import Callable

import torch

from engine.attention import AttentionBatch
from engine.kv_pool import KVPool
from engine.model import LlamaModel
from engine.scheduler import Work, batch_tokens


def synced(device: torch.device) -> None:
    """Wait until ``device`` has run everything queued (a no-op off CUDA)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_call(fn: Callable[[], object], device: torch.device) -> tuple[float, object]:
    """Seconds one call of ``fn`` takes, ``device``'s queue drained on both sides, and its result."""
    synced(device)
    t0 = time.perf_counter()
    result = fn()
    synced(device)
    return time.perf_counter() - t0, result


class TorchExecutor:
    """Runs the decoder; greedy sampling. Duration = measured wall time of the forward pass."""

    materialize = True

    def bind(self, model: LlamaModel, pool: KVPool) -> None:
        self.model, self.pool = model, pool
        self.device = pool.device.torch_device

    def prepare(self, work: list[Work]) -> tuple[torch.Tensor, torch.Tensor, AttentionBatch, list[Work]]:
        """Flat input ids and positions plus the attention metadata; the work reordered, decodes first."""
        order = sorted(work, key=lambda w: w.num_tokens != 1)
        ids, pos, blocks, offsets, qlens, clens, rows = [], [], [], [], [], [], []
        bs = self.pool.block_size
        for w in order:
            s, start, n = w.seq, w.seq.num_computed, w.num_tokens
            ids += s.token_ids[start:start + n]
            p = list(range(start, start + n))
            pos += p
            blocks += [s.block_table[i // bs] for i in p]
            offsets += [i % bs for i in p]
            qlens.append(n)
            clens.append(start + n)
            if w.produces_token:
                rows.append(len(ids) - 1)
        width = max(len(w.seq.block_table) for w in order)
        tables = [w.seq.block_table + [0] * (width - len(w.seq.block_table)) for w in order]
        num_decodes = sum(1 for w in order if w.num_tokens == 1)
        dev = self.device
        batch = AttentionBatch(
            slot_blocks=torch.tensor(blocks, device=dev), slot_offsets=torch.tensor(offsets, device=dev),
            query_lens=qlens, context_lens=clens, block_tables=torch.tensor(tables, device=dev),
            decode_lens=torch.tensor(clens[:num_decodes], device=dev), num_decodes=num_decodes,
            logit_rows=torch.tensor(rows, dtype=torch.long, device=dev))
        return torch.tensor(ids, device=dev), torch.tensor(pos, device=dev), batch, order

    def execute(self, work: list[Work]) -> tuple[dict[str, int], float]:
        """Run the iteration; returns the next token of each sequence whose chunk reached its end."""
        def forward() -> tuple[list[int], list[Work]]:
            input_ids, positions, batch, order = self.prepare(work)
            return self.model(input_ids, positions, batch, self.pool).argmax(dim=-1).tolist(), order

        duration, (next_tokens, order) = timed_call(forward, self.device)
        producers = [w.seq.id for w in order if w.produces_token]
        return dict(zip(producers, next_tokens)), duration

    def timed(self, fn: Callable[[], int], link: str) -> float:
        """Run a KV copy (``fn`` returns the bytes it moved) within the device (``link`` "device":
        compaction) or over the host link ("host": swap) and return its duration on the engine
        clock; 0 when nothing moved."""
        seconds, moved = timed_call(fn, self.device)
        return seconds if moved else 0.0


class ProfiledExecutor:
    """The engine's iterations timed by ``cost`` (a ``CostModel`` or ``RooflineCostModel``); the
    model runs only if ``materialize``.

    Without tensors every sequence generates token 0: token ids do not change what memory a
    request uses, and its length is set by the request (``output_len``), as in a trace replay.
    """

    def __init__(self, cost, materialize: bool = False) -> None:
        self.cost, self.materialize = cost, materialize
        self.runner = TorchExecutor() if materialize else None

    def bind(self, model: LlamaModel | None, pool: KVPool) -> None:
        if self.runner is not None:
            self.runner.bind(model, pool)

    def execute(self, work: list[Work]) -> tuple[dict[str, int], float]:
        if self.runner is not None:
            tokens, _ = self.runner.execute(work)
        else:
            tokens = {w.seq.id: 0 for w in work if w.produces_token}
        return tokens, self.cost.iteration_s(batch_tokens(work))

    def timed(self, fn: Callable[[], int], link: str) -> float:
        return self.cost.copy_s(fn(), link)
