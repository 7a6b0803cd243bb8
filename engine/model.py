"""A Llama-architecture decoder (RMSNorm, RoPE, grouped-query attention, SwiGLU) on a paged KV pool.

Parameter names follow Hugging Face's ``LlamaForCausalLM`` so that a local checkpoint loads as a
plain state dict. The forward pass takes a flat batch of tokens from many sequences (prefill
chunks and decodes mixed) and an ``AttentionBatch`` that says where each token's K and V go in
the pool and which blocks each sequence reads.
"""
from __future__ import annotations

import torch
from torch import nn
import torch.nn.functional as F

from engine.attention import AttentionBatch, paged_attention
from engine.config import ModelConfig, torch_dtype
from engine.kv_pool import KVPool


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32 like the reference implementation, then cast back.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class Rotary(nn.Module):
    """Rotary position embedding, rotate-half convention, computed once per forward pass.

    As in the reference implementation the frequencies, the angles and their cos/sin are float32
    whatever the model's dtype, and only cos/sin are cast to it: a bf16 ``inv_freq`` would put
    positions ~2000 a third of a radian off.
    """

    def __init__(self, head_dim: int, theta: float) -> None:
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def _apply(self, fn, recurse=True):
        # Module.to(dtype) (and .half(), .bfloat16()) casts floating buffers too: keep the float32
        # values and follow only the device the buffer went to
        exact = self.inv_freq
        super()._apply(fn, recurse)
        self.inv_freq = exact.to(self.inv_freq.device)
        return self

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin for ``rotate``, [tokens, 1, head_dim] in ``dtype``."""
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
        half = sin.shape[-1] // 2
        # rotate_half(x) * sin == roll(x, half) * [-sin_lo, sin_hi], bit for bit (negation is exact)
        return cos[:, None, :], torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)[:, None, :]


def rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """RoPE on x [tokens, heads, head_dim] with what ``Rotary`` computed for the step."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.num_heads * cfg.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                batch: AttentionBatch, pool: KVPool) -> torch.Tensor:
        n = x.shape[0]
        q = rotate(self.q_proj(x).view(n, self.num_heads, self.head_dim), *rope)
        k = rotate(self.k_proj(x).view(n, self.num_kv_heads, self.head_dim), *rope)
        v = self.v_proj(x).view(n, self.num_kv_heads, self.head_dim)
        pool.write_slots(self.layer, batch.slots, k, v)
        out = paged_attention(q, self.layer, batch, pool)
        return self.o_proj(out.reshape(n, self.num_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, rope, batch, pool):
        x = x + self.self_attn(self.input_layernorm(x), rope, batch, pool)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaBody(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class LlamaModel(nn.Module):
    """The decoder. ``forward`` returns logits for the tokens ``batch.logit_rows`` selects."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = LlamaBody(cfg)
        self.rotary = Rotary(cfg.head_dim, cfg.rope_theta)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @classmethod
    def from_seed(cls, cfg: ModelConfig, seed: int, device: str | torch.device = "cpu") -> "LlamaModel":
        """Random weights drawn from ``seed`` (normal, std 0.02, as Llama's initialiser), reproducible."""
        gen = torch.Generator().manual_seed(seed)
        model = cls(cfg)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("norm.weight"):
                    p.fill_(1.0)
                else:
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
        return model.to(device=device, dtype=torch_dtype(cfg.dtype)).eval()

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: AttentionBatch,
                pool: KVPool) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids)
        rope = self.rotary(positions, x.dtype)
        for layer in self.model.layers:
            x = layer(x, rope, batch, pool)
        if batch.logit_rows is not None:
            x = x[batch.logit_rows]
        return self.lm_head(self.model.norm(x))

    def weight_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.parameters())
