"""Paged attention over block tables, in plain PyTorch so that it runs unchanged on CPU and CUDA.

Each sequence's K and V are gathered from the pool through its block table, then
``scaled_dot_product_attention`` does the arithmetic. Decodes (one query each) are batched
together with a padding mask; each prefill chunk attends causally to its whole context.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.kv_pool import KVPool


@dataclass
class AttentionBatch:
    """Where a flat batch of tokens reads and writes KV; the same for every layer.

    Tokens are laid out sequence by sequence: first ``num_decodes`` sequences with one token each,
    then the prefill chunks. ``context_lens`` is each sequence's length after this step.
    """

    slot_blocks: torch.Tensor    # [tokens] physical block of each new token
    slot_offsets: torch.Tensor   # [tokens] offset within that block
    query_lens: list[int]        # new tokens per sequence
    context_lens: list[int]      # KV length per sequence, new tokens included
    block_tables: torch.Tensor   # [sequences, max blocks], padded with block 0
    decode_lens: torch.Tensor    # [num_decodes] context lengths of the decodes, on the device
    num_decodes: int
    logit_rows: torch.Tensor     # rows of the flat batch whose logits are wanted


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    # q: [B, H, Q, D]; k, v: [B, KVH, T, D]; mask: bool [B, 1, Q, T] (True = attend)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=q.shape[1] != k.shape[1])


def paged_attention(q: torch.Tensor, layer: int, batch: AttentionBatch, pool: KVPool) -> torch.Tensor:
    """Attention output [tokens, heads, head_dim] for queries [tokens, heads, head_dim]."""
    out = torch.empty_like(q)
    nd = batch.num_decodes
    if nd:
        tables = batch.block_tables[:nd, : (max(batch.context_lens[:nd]) + pool.block_size - 1) // pool.block_size]
        kv = pool.gather(layer, tables)  # [2, nd, T, kvh, d]
        T = kv.shape[2]
        mask = torch.arange(T, device=q.device)[None, :] < batch.decode_lens[:, None]
        o = _attend(q[:nd].unsqueeze(2), kv[0].transpose(1, 2), kv[1].transpose(1, 2), mask[:, None, None, :])
        out[:nd] = o.squeeze(2)
    row = nd
    for i in range(nd, len(batch.query_lens)):
        n, ctx = batch.query_lens[i], batch.context_lens[i]
        nblocks = (ctx + pool.block_size - 1) // pool.block_size
        kv = pool.gather(layer, batch.block_tables[i, :nblocks])[:, :ctx]  # [2, ctx, kvh, d]
        # query j sits at position ctx - n + j and sees keys 0 .. ctx - n + j
        qpos = torch.arange(ctx - n, ctx, device=q.device)
        mask = torch.arange(ctx, device=q.device)[None, :] <= qpos[:, None]
        o = _attend(q[row:row + n].transpose(0, 1)[None], kv[0].transpose(0, 1)[None],
                    kv[1].transpose(0, 1)[None], mask[None, None])
        out[row:row + n] = o[0].transpose(0, 1)
        row += n
    return out
