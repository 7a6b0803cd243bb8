"""Paged attention over block tables, in plain PyTorch so that it runs unchanged on CPU and CUDA.

K and V stay in the pool's blocks. Each layer copies the blocks a step reads into one scratch
tensor (one ``index_select`` per segment touched; where they live was worked out once for the
step) and ``scaled_dot_product_attention`` does the arithmetic. Decodes (one query each) are
batched together, with a mask only when their contexts differ in length; each prefill chunk
attends causally to its whole context.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.kv_pool import KVPool, Located


@dataclass
class PrefillChunk:
    """One sequence's prefill chunk: rows ``start .. start + num_tokens`` of the flat batch."""

    start: int
    num_tokens: int
    context_len: int     # KV length after this chunk
    blocks: Located      # its first ceil(context_len / block_size) blocks, located in the pool
    num_blocks: int
    mask: torch.Tensor   # [1, 1, num_tokens, context_len] additive causal mask


@dataclass
class AttentionBatch:
    """Where a flat batch of tokens writes and reads KV, the same for every layer.

    Tokens are laid out sequence by sequence: first ``num_decodes`` sequences with one token each,
    then the prefill chunks.
    """

    slots: Located                   # each new token's slot (block * block_size + offset), located
    num_decodes: int
    prefills: list[PrefillChunk]
    logit_rows: torch.Tensor | None  # rows of the flat batch whose logits are wanted; None: all
    # what the decodes read: their block tables, [num_decodes, decode_width] flattened and located,
    # as far as the longest context (decode_len); an additive mask [num_decodes, 1, 1, decode_len]
    # for the padding of the shorter ones, None when all are as long
    decode_blocks: Located | None = None
    decode_width: int = 0
    decode_len: int = 0
    decode_mask: torch.Tensor | None = None


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    # q: [B, H, Q, D]; k, v: [B, KVH, T, D]; mask: additive [B, 1, Q, T] or None
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=q.shape[1] != k.shape[1])


def paged_attention(q: torch.Tensor, layer: int, batch: AttentionBatch, pool: KVPool) -> torch.Tensor:
    """Attention output [tokens, heads, head_dim] for queries [tokens, heads, head_dim]."""
    nd, bs = batch.num_decodes, pool.block_size
    parts = []
    if nd:
        w = batch.decode_width
        kv = pool.gather_blocks(layer, batch.decode_blocks, nd * w)  # [2, nd * w, bs, kvh, d]
        kv = kv.view(2, nd, w * bs, pool.num_kv_heads, pool.head_dim)[:, :, :batch.decode_len]
        o = _attend(q[:nd, :, None], kv[0].transpose(1, 2), kv[1].transpose(1, 2), batch.decode_mask)
        parts.append(o.squeeze(2))
    for c in batch.prefills:
        kv = pool.gather_blocks(layer, c.blocks, c.num_blocks)
        kv = kv.view(2, c.num_blocks * bs, pool.num_kv_heads, pool.head_dim)[:, :c.context_len]
        o = _attend(q[c.start:c.start + c.num_tokens].transpose(0, 1)[None], kv[0].transpose(0, 1)[None],
                    kv[1].transpose(0, 1)[None], c.mask)
        parts.append(o[0].transpose(0, 1))
    return parts[0] if len(parts) == 1 else torch.cat(parts)
