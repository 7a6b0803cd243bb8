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

from engine import attention
from engine.attention import AttentionBatch, PrefillChunk
from engine.config import EngineConfig, ModelConfig
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


def _additive(masked: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """An attention mask to add to the scores: -inf where ``masked``, 0 elsewhere. Built once per
    step, so that no layer converts a boolean mask again."""
    return torch.zeros(masked.shape, dtype=dtype, device=masked.device).masked_fill_(masked, float("-inf"))


class TorchExecutor:
    """Runs the decoder; greedy sampling. Duration = measured wall time of the forward pass."""

    materialize = True

    def bind(self, model: LlamaModel, pool: KVPool) -> None:
        self.model, self.pool = model, pool
        self.device = pool.device.torch_device

    def prepare(self, work: list[Work]) -> tuple[torch.Tensor, torch.Tensor, AttentionBatch, list[Work]]:
        """Flat input ids and positions plus the attention metadata; the work reordered, decodes first.

        Python touches each sequence once; per-token indices are tensor arithmetic.
        """
        order = sorted(work, key=lambda w: w.num_tokens != 1)
        pool, bs, dev = self.pool, self.pool.block_size, self.device
        ids, starts, qlens, rows = [], [], [], []
        for w in order:
            s, start, n = w.seq, w.seq.num_computed, w.num_tokens
            ids += s.token_ids[start:start + n]
            starts.append(start)
            qlens.append(n)
            if w.produces_token:
                rows.append(len(ids) - 1)
        ctx = [st + n for st, n in zip(starts, qlens)]
        nd = qlens.count(1)
        width = max(len(w.seq.block_table) for w in order)
        tables = torch.tensor([w.seq.block_table + [0] * (width - len(w.seq.block_table)) for w in order])
        # each token's position and the block its K and V go to: one lookup for all the decodes, one
        # per prefill chunk (repeat_interleave would do it in one, but starts a thread pool job)
        parts = []
        if nd:
            pos = torch.tensor(starts[:nd])
            parts.append((pos, tables[torch.arange(nd), pos // bs]))
        for i in range(nd, len(order)):
            pos = torch.arange(starts[i], ctx[i])
            parts.append((pos, tables[i, pos // bs]))
        positions = torch.cat([pos for pos, _ in parts])
        slots = torch.cat([blocks for _, blocks in parts]) * bs + positions % bs

        logit_rows = None if len(rows) == len(ids) else torch.tensor(rows, dtype=torch.long, device=dev)
        batch = AttentionBatch(slots=pool.locate(slots.to(dev), bs), num_decodes=nd, prefills=[],
                               logit_rows=logit_rows)
        if nd:
            self._decode_reads(batch, tables[:nd], ctx[:nd])
        row = nd
        for i in range(nd, len(order)):
            batch.prefills.append(self._prefill_chunk(row, qlens[i], ctx[i], tables[i]))
            row += qlens[i]
        return torch.tensor(ids, device=dev), positions.to(dev), batch, order

    def _decode_reads(self, batch: AttentionBatch, tables: torch.Tensor, ctx: list[int]) -> None:
        """The blocks the decodes read, as far as the longest context, and a mask for the padding
        of the shorter ones (none when all are as long)."""
        bs, dev = self.pool.block_size, self.device
        batch.decode_len = max(ctx)
        batch.decode_width = -(-batch.decode_len // bs)
        batch.decode_blocks = self.pool.locate(tables[:, :batch.decode_width].reshape(-1).to(dev))
        keys, ends = torch.arange(batch.decode_len, device=dev)[None, :], torch.tensor(ctx, device=dev)[:, None]
        padding = keys >= ends
        if min(ctx) < batch.decode_len:
            batch.decode_mask = _additive(padding, self.pool.compute_dtype)[:, None, None, :]
        window = self._window()
        if window is not None and batch.decode_len > window:  # the query at ctx - 1 sees keys ctx - window on
            # (in a chunked layer, Llama 4's, those of its chunk: ctx - 1 - (ctx - 1) % window on)
            first = (ends - 1) // window * window if self.model.config.window_chunked else ends - window
            batch.decode_window_mask = _additive(padding | (keys < first), self.pool.compute_dtype)[:, None, None, :]

    def _prefill_chunk(self, start: int, n: int, ctx: int, table: torch.Tensor) -> PrefillChunk:
        """A chunk of ``n`` tokens, rows ``start`` on of the flat batch, that ends a context of ``ctx`` tokens."""
        dev, nblocks = self.device, -(-ctx // self.pool.block_size)
        # query j sits at position ctx - n + j and sees keys 0 .. ctx - n + j (in a windowed layer, the
        # window's last keys up to it: ctx - n + j - window + 1 on)
        keys, queries = torch.arange(ctx, device=dev)[None, :], torch.arange(ctx - n, ctx, device=dev)[:, None]
        window, future, outside = self._window(), keys > queries, None
        if window is not None and ctx > window:  # (in a chunked layer, its chunk's: queries - queries % window on)
            first = queries // window * window if self.model.config.window_chunked else queries - window + 1
            outside = future | (keys < first)
        return PrefillChunk(start, n, ctx, self.pool.locate(table[:nblocks].to(dev)), nblocks,
                            _additive(future, self.pool.compute_dtype)[None, None],
                            None if outside is None else _additive(outside, self.pool.compute_dtype)[None, None])

    def _window(self) -> int | None:
        """The model's sliding window where any of its layers attends through one; None otherwise."""
        mc = self.model.config
        return mc.sliding_window if mc.window_layers else None

    def workspace_bytes(self, model: ModelConfig, work: list[Work]) -> int:
        """What the forward pass of ``work`` allocates beyond weights and pool: every batched
        token's activations, and what this plain-PyTorch attention materialises
        (``attention.workspace_bytes``: padding, masks, the math kernel's score matrices)."""
        decodes = [w.seq.num_computed + 1 for w in work if w.num_tokens == 1]
        chunks = [(w.num_tokens, w.seq.num_computed + w.num_tokens) for w in work if w.num_tokens != 1]
        num_tokens = len(decodes) + sum(n for n, _ in chunks)
        return (num_tokens * model.workspace_bytes_per_token()
                + attention.workspace_bytes(model, self.pool.block_size, decodes, chunks))

    @staticmethod
    def max_workspace_bytes(model: ModelConfig, cfg: EngineConfig, max_len: int) -> int:
        """The most ``workspace_bytes`` can be for an engine of ``cfg`` with contexts up to
        ``max_len``: a full batch of decodes at that length, or a full prefill chunk at its end."""
        chunk = min(cfg.max_num_batched_tokens, max_len)
        decodes = min(cfg.max_num_seqs, cfg.max_num_batched_tokens)
        attn = max(attention.workspace_bytes(model, cfg.block_size, [max_len] * decodes, []),
                   attention.workspace_bytes(model, cfg.block_size, [], [(chunk, max_len)]))
        return cfg.max_num_batched_tokens * model.workspace_bytes_per_token() + attn

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

    def workspace_bytes(self, model: ModelConfig, work: list[Work]) -> int:
        """The deployment's: a fused attention kernel's (``ModelConfig.workspace_bytes``); the
        runner's own when the model runs."""
        if self.runner is not None:
            return self.runner.workspace_bytes(model, work)
        shape = batch_tokens(work)
        return model.workspace_bytes(shape.num_tokens, shape.context_tokens)

    def max_workspace_bytes(self, model: ModelConfig, cfg: EngineConfig, max_len: int) -> int:
        if self.runner is not None:
            return self.runner.max_workspace_bytes(model, cfg, max_len)
        return model.workspace_bytes(cfg.max_num_batched_tokens, cfg.num_blocks * cfg.block_size)

    def execute(self, work: list[Work]) -> tuple[dict[str, int], float]:
        if self.runner is not None:
            tokens, _ = self.runner.execute(work)
        else:
            tokens = {w.seq.id: 0 for w in work if w.produces_token}
        window = getattr(self.cost, "window", None)  # a cost model of one's own may have none
        if window is None:
            return tokens, self.cost.iteration_s(batch_tokens(work))
        chunked = getattr(self.cost, "window_chunked", False)
        return tokens, self.cost.iteration_s(batch_tokens(work), batch_tokens(work, window, chunked))

    def timed(self, fn: Callable[[], int], link: str) -> float:
        return self.cost.copy_s(fn(), link)
