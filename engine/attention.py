"""Paged attention over block tables, in plain PyTorch so that it runs unchanged on CPU and CUDA.

K and V stay in the pool's blocks. Each layer copies the blocks a step reads into one scratch
tensor (one ``index_select`` per segment touched; where they live was worked out once for the
step) and ``scaled_dot_product_attention`` does the arithmetic. Decodes (one query each) are
batched together, with a mask only when their contexts differ in length; each prefill chunk
attends causally to its whole context.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from engine.config import ModelConfig
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
    window_mask: torch.Tensor | None = None  # the same, keys past a windowed layer's window masked too; None: as mask


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
    # the decodes' mask for a windowed layer, keys before each one's window masked too; None: as decode_mask
    decode_window_mask: torch.Tensor | None = None
    # each token's queries' scale by its position, [tokens, 1, 1] (``ModelConfig.attn_temperature``: Llama 4's
    # NoPE layers', Ministral 3's every layer's), set by the model for its step; None: none
    query_scale: torch.Tensor | None = None


def softcap(x: torch.Tensor, cap: float | None) -> torch.Tensor:
    """``cap * tanh(x / cap)`` (Gemma 2's soft cap on attention scores and logits); ``x`` without one."""
    return x if cap is None else torch.tanh(x / cap) * cap


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
            scale: float | None, cap: float | None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    # q: [B, H, Q, D]; k, v: [B, KVH, T, D]; mask: additive [B, 1, Q, T] or None; sinks: [H] or None
    if cap is None and sinks is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1])
    # soft-capped scores (Gemma 2) or a sink beside them (gpt-oss), which no SDPA kernel takes: the
    # reference's arithmetic, step by step
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = softcap(q @ k.transpose(2, 3) * (scale or q.shape[-1] ** -0.5), cap)
    if mask is not None:
        scores = scores + mask
    if sinks is None:
        return torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype) @ v
    # each head's sink logit takes its share of the softmax (in the scores' dtype, as transformers
    # computes it) and is then dropped: it adds no value
    b, h, n, _ = scores.shape
    scores = torch.cat((scores, sinks.to(scores.dtype).reshape(1, h, 1, 1).expand(b, h, n, 1)), dim=-1)
    scores = scores - scores.max(dim=-1, keepdim=True).values
    return torch.softmax(scores, dim=-1, dtype=scores.dtype)[..., :-1].to(v.dtype) @ v


# what a layer makes of the KV it gathered, [K/V, sequences, tokens, kv_heads, head_dim]: each sequence's keys and
# values as [sequences, heads, tokens, features]
Expand = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def _as_heads(kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V as the pool holds them, each KV head's."""
    return kv[0].transpose(1, 2), kv[1].transpose(1, 2)


def paged_attention(q: torch.Tensor, layer: int, batch: AttentionBatch, pool: KVPool, scale: float | None = None,
                    cap: float | None = None, windowed: bool = False,
                    sinks: torch.Tensor | None = None, expand: Expand = _as_heads) -> torch.Tensor:
    """Attention output [tokens, heads, value features] for queries [tokens, heads, head_dim]; ``scale``
    multiplies the scores (None: head_dim ** -0.5), ``cap`` soft-caps them (None: not), a
    ``windowed`` layer reads only the keys within the model's sliding window, ``sinks`` (one
    logit a head; None: none) take a share of each query's softmax, and ``expand`` makes the keys and
    values of what the pool holds (``Expand``; latent attention projects them from its latent)."""
    nd, bs = batch.num_decodes, pool.block_size
    entries, heads, width = pool.block_shape[1], pool.num_kv_heads, pool.head_dim
    parts = []
    if nd:
        w = batch.decode_width
        kv = pool.gather_blocks(layer, batch.decode_blocks, nd * w)  # [K/V, nd * w, bs, kvh, d]
        k, v = expand(kv.view(entries, nd, w * bs, heads, width)[:, :, :batch.decode_len])
        mask = batch.decode_window_mask if windowed and batch.decode_window_mask is not None else batch.decode_mask
        o = _attend(q[:nd, :, None], k, v, mask, scale, cap, sinks)
        parts.append(o.squeeze(2))
    for c in batch.prefills:
        kv = pool.gather_blocks(layer, c.blocks, c.num_blocks)
        k, v = expand(kv.view(entries, 1, c.num_blocks * bs, heads, width)[:, :, :c.context_len])
        mask = c.window_mask if windowed and c.window_mask is not None else c.mask
        o = _attend(q[c.start:c.start + c.num_tokens].transpose(0, 1)[None], k, v, mask, scale, cap, sinks)
        parts.append(o[0].transpose(0, 1))
    return parts[0] if len(parts) == 1 else torch.cat(parts)


SCORE_BYTES = 4  # score and probability matrices counted in float32, the widest any kernel keeps them


def _sdpa_bytes(model: ModelConfig, batch: int, queries: int, keys: int, gathered: int) -> int:
    """Bytes one ``_attend`` call allocates when SDPA takes its math kernel, which an additive mask
    with grouped-query heads selects on CUDA (the fused kernels take one or the other): the K/V
    gathered from the pool (``gathered`` token slots, whole blocks; 8-bit KV gathered, then read back into the
    model's dtype), K/V repeated to every query
    head (latent attention's: each head's keys and values projected from the latent, its keys then
    assembled), scaled copies of q and K, the score matrix, the masked scores and their softmax, the output."""
    entries, kvh, width = model.kv_layout
    h, d, dt = model.num_heads, model.head_dim, model.dtype_bytes
    if model.kv_lora_rank:
        expanded = batch * keys * h * (model.qk_nope_head_dim + model.value_dim + d) * dt
    else:
        expanded = 2 * batch * h * keys * d * dt if h != kvh else 0
    gathered_dt = dt + (model.kv_dtype.itemsize if model.kv_cache_dtype != "auto" else 0)
    return (entries * batch * gathered * kvh * width * gathered_dt + expanded + batch * h * (queries + keys) * d * dt
            + 3 * batch * h * queries * keys * SCORE_BYTES + batch * h * queries * model.value_dim * dt)


def workspace_bytes(model: ModelConfig, block_size: int, decode_contexts: list[int],
                    chunks: list[tuple[int, int]]) -> int:
    """Peak bytes ``paged_attention`` and its metadata take in one step beyond the pool: the masks
    ``TorchExecutor.prepare`` builds for the whole step (the decodes' padding mask, each prefill
    chunk's causal mask, each again for a model's windowed layers), the largest of the step's SDPA calls (they run one after another, each
    with its own gathered K/V), and the per-sequence outputs with their concatenation.

    ``decode_contexts``: the context length of each decode after the step; ``chunks``: (new
    tokens, context length after the step) of each prefill chunk. Decodes are padded to the
    longest one's whole blocks, as ``paged_attention`` reads them.
    """
    dt = model.dtype_bytes
    masks, calls, tokens = 0, [0], len(decode_contexts)
    if decode_contexts:
        nd, longest = len(decode_contexts), max(decode_contexts)
        masks += nd * longest * dt
        calls.append(_sdpa_bytes(model, nd, 1, longest, -(-longest // block_size) * block_size))
    for n, ctx in chunks:
        masks += n * ctx * dt
        calls.append(_sdpa_bytes(model, 1, n, ctx, -(-ctx // block_size) * block_size))
        tokens += n
    if model.window_layers:  # a windowed layer's masks beside the others
        masks *= 2
    return masks + max(calls) + 2 * tokens * model.num_heads * model.value_dim * dt
