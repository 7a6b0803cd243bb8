"""A Llama-architecture decoder (RMSNorm, RoPE, grouped-query attention, SwiGLU) on a paged KV pool,
with what some checkpoints of that architecture add: biases on the attention projections
(Qwen2's on q, k and v), an RMSNorm over each q and k head (Qwen3's), a mixture of SwiGLU
experts in place of the MLP (Mixtral's, Qwen3-MoE's), and Gemma's and Gemma 2's differences
(scaled embeddings, norms by 1 + weight, GeGLU, norms around attention and the MLP, soft caps),
Gemma 3's (a RoPE of their own for its windowed layers), DeepSeek-V2's and V3's (multi-head latent
attention, and a mixture of experts with grouped routing and shared experts, as GLM-4.5's), RoPE over a
share of each head (GLM's, Phi-4-mini's) with its pairs interleaved (DeepSeek's, GLM-4's) or on no layer
at all (SmolLM3's NoPE layers), OLMo 2's norms, Granite's scalars, and Llama 4's (chunked attention, NoPE
layers with tempered queries, q and k normed after RoPE, experts weighing their inputs).

Parameter names follow Hugging Face's ``LlamaForCausalLM`` so that a local checkpoint loads as a
plain state dict. The forward pass takes a flat batch of tokens from many sequences (prefill
chunks and decodes mixed) and an ``AttentionBatch`` that says where each token's K and V go in
the pool and which blocks each sequence reads.
"""
from __future__ import annotations

import math
from functools import partial
from typing import Callable

import torch
from torch import nn
import torch.nn.functional as F

from engine.attention import AttentionBatch, paged_attention, softcap
from engine.config import ModelConfig, RopeScaling, torch_dtype
from engine.kv_pool import KVPool


class RMSNorm(nn.Module):
    """Llama's RMSNorm: normalised in float32, cast back, then scaled by the weight; with ``offset``
    Gemma's: scaled by 1 + weight in float32, then cast back (its weights start at 0); with
    ``float32_weight`` gpt-oss's: scaled by the weight in float32, then cast back."""

    def __init__(self, size: int, eps: float, offset: bool = False, float32_weight: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(size) if offset else torch.ones(size))
        self.eps, self.offset, self.float32_weight = eps, offset, float32_weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.offset:
            return (xf * (1.0 + self.weight.float())).to(x.dtype)
        if self.float32_weight:
            return (self.weight.float() * xf).to(x.dtype)
        return self.weight * xf.to(x.dtype)


class LayerNorm(nn.Module):
    """Cohere's LayerNorm: the mean subtracted and the variance normalised in float32, scaled by the weight in
    float32 (no bias), then cast back. A weight of [heads, head_dim] norms each head with its own (Command R+'s
    q and k norms)."""

    def __init__(self, size: int | tuple[int, int], eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf - xf.mean(-1, keepdim=True)
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * xf).to(x.dtype)


def norm(cfg: ModelConfig, size: int | tuple[int, int] | None = None) -> RMSNorm | LayerNorm:
    """The norm ``cfg``'s family uses, over ``size`` (default: hidden_size) features."""
    if cfg.layer_norm:
        return LayerNorm(size or cfg.hidden_size, cfg.rms_norm_eps)
    return RMSNorm(size or cfg.hidden_size, cfg.rms_norm_eps, offset=cfg.norm_offset,
                   float32_weight=cfg.norm_float32_weight)


def stacked(module: nn.Module, fused: str, in_features: int, parts: dict[str, int], bias: bool = False) -> nn.Linear:
    """``module.<fused>``: a Linear whose weight (and bias, with ``bias``) stacks projections of the
    same input, ``parts`` (name -> output features), so that they cost one GEMM: a decode batch's
    GEMMs are small and each call has its own overhead. ``module``'s state dict still holds them
    apart, under transformers' names and in its order, so that checkpoints load and ``state_dict``
    loads into transformers as they are."""
    sizes = list(parts.values())
    kinds = ("weight", "bias") if bias else ("weight",)

    def split(mod, state: dict, prefix: str, _metadata) -> None:
        # this module's keys are the dict's last (its children were just saved): re-add them in order
        own = [(k, state.pop(k)) for k in [k for k in state if k.startswith(prefix)]]
        for key, value in own:
            kind = key.removeprefix(f"{prefix}{fused}.")
            if key.startswith(f"{prefix}{fused}.") and kind in kinds:
                state.update(zip([f"{prefix}{n}.{kind}" for n in parts], value.split(sizes)))
            else:
                state[key] = value

    def join(mod, state: dict, prefix: str, *_) -> None:
        for kind in kinds:
            names = [f"{prefix}{n}.{kind}" for n in parts]
            if all(n in state for n in names):  # otherwise load_state_dict reports what is missing
                state[f"{prefix}{fused}.{kind}"] = torch.cat([state.pop(n) for n in names])

    module.register_state_dict_post_hook(split)
    module.register_load_state_dict_pre_hook(join)
    return nn.Linear(in_features, sum(sizes), bias=bias)


def scaled(inv_freq: torch.Tensor, scaling: RopeScaling) -> torch.Tensor:
    """``inv_freq`` stretched as ``scaling`` says (engine/config.py), in float32 and in the
    reference implementation's order of operations, so that the angles match it bit for bit."""
    if scaling.kind == "linear":
        return inv_freq / scaling.factor
    wavelength = 2 * math.pi / inv_freq
    long_wave = scaling.original_max_position / scaling.low_freq_factor   # longer: divided by factor
    short_wave = scaling.original_max_position / scaling.high_freq_factor  # shorter: kept
    stretched = torch.where(wavelength > long_wave, inv_freq / scaling.factor, inv_freq)
    if scaling.high_freq_factor == scaling.low_freq_factor:  # no band between (Llama 4 Scout's): vLLM's 0, not 0 / 0
        blend = torch.zeros_like(wavelength)
    else:
        blend = ((scaling.original_max_position / wavelength - scaling.low_freq_factor)
                 / (scaling.high_freq_factor - scaling.low_freq_factor))
    blended = (1 - blend) * stretched / scaling.factor + blend * stretched
    between = (wavelength >= short_wave) & (wavelength <= long_wave)
    return torch.where(between, blended, stretched)


def _yarn(powers: torch.Tensor, scaling: RopeScaling, theta: float) -> torch.Tensor:
    """YaRN's frequencies from ``powers`` (``theta ** (2i / dim)``): each kept, divided by the factor,
    or blended by its dimension's place between the dimensions that turn ``beta_fast`` and
    ``beta_slow`` times over the original context, in transformers' order of operations."""
    half = powers.shape[0]
    dim = 2 * half

    def turning(rotations: float) -> float:  # the dimension whose wavelength fits ``rotations`` times
        return dim * math.log(scaling.original_max_position / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = turning(scaling.beta_fast), turning(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers: no division by zero
    kept = 1 - torch.clamp((torch.arange(half, dtype=torch.float32) - low) / (high - low), 0, 1)
    return 1.0 / (scaling.factor * powers) * (1 - kept) + 1.0 / powers * kept


class Rotary(nn.Module):
    """Rotary position embedding, rotate-half convention, computed once per forward pass.

    As in the reference implementation the frequencies, the angles and their cos/sin are float32
    whatever the model's dtype, and only cos/sin are cast to it: a bf16 ``inv_freq`` would put
    positions ~2000 a third of a radian off.
    """

    def __init__(self, head_dim: int, theta: float, scaling: RopeScaling | None = None) -> None:
        super().__init__()
        powers = theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)
        inv_freq = 1.0 / powers
        self.longrope: tuple[torch.Tensor, torch.Tensor] | None = None  # LongRoPE's short and long frequencies
        if scaling is not None and scaling.kind == "longrope":  # each frequency divided by its own factor
            self.longrope = tuple(1.0 / (torch.tensor(f, dtype=torch.float32) * powers)
                                  for f in (scaling.short_factor, scaling.long_factor))
            self.longrope_scales = (scaling.cos_scale, scaling.long_cos_scale)
            inv_freq = self.longrope[0]
        elif scaling is not None:
            inv_freq = _yarn(powers, scaling, theta) if scaling.kind == "yarn" else scaled(inv_freq, scaling)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.cos_scale = 1.0 if scaling is None else scaling.cos_scale

    def use_long_factors(self, long: bool) -> None:
        """Rotate by LongRoPE's long factors (``long``) or its short ones; vLLM picks them once, long where
        its max_model_len passes the original context (the engine calls this as it starts)."""
        if self.longrope is not None:
            self.inv_freq = self.longrope[long].to(self.inv_freq.device)
            self.cos_scale = self.longrope_scales[long]

    def _apply(self, fn, recurse=True):
        # Module.to(dtype) (and .half(), .bfloat16()) casts floating buffers too: keep the float32
        # values and follow only the device the buffer went to
        exact = self.inv_freq
        super()._apply(fn, recurse)
        self.inv_freq = exact.to(self.inv_freq.device)
        if self.longrope is not None:
            self.longrope = tuple(t.to(self.inv_freq.device) for t in self.longrope)
        return self

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin for ``rotate``, [tokens, 1, head_dim] in ``dtype``."""
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = (emb.cos() * self.cos_scale).to(dtype), (emb.sin() * self.cos_scale).to(dtype)
        half = sin.shape[-1] // 2
        # rotate_half(x) * sin == roll(x, half) * [-sin_lo, sin_hi], bit for bit (negation is exact)
        return cos[:, None, :], torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)[:, None, :]


def rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """RoPE on x [tokens, heads, head_dim] with what ``Rotary`` computed for the step."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin


def paired(x: torch.Tensor) -> torch.Tensor:
    """RoPE's interleaved pairs (x0, x1), (x2, x3), ... read apart into rotate-half's layout (x0, x2, ...,
    x1, x3, ...), as transformers reads DeepSeek's: queries and keys permuted alike score alike."""
    return torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = stacked(self, "qkv_proj", cfg.hidden_size, {"q_proj": q, "k_proj": kv, "v_proj": kv},
                                bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=cfg.o_bias)
        across = cfg.qk_norm_across_heads  # OLMo 2's: one norm over every head's features
        own = cfg.qk_norm_head_weights  # Command R+'s: each head normed over its features, with a weight of its own
        self.q_norm = norm(cfg, q if across else (cfg.num_heads, cfg.head_dim) if own else cfg.head_dim) if cfg.qk_norm else None
        self.k_norm = norm(cfg, kv if across else (cfg.num_kv_heads, cfg.head_dim) if own else cfg.head_dim) if cfg.qk_norm else None
        self.across, self.norm_after_rope = across, cfg.qk_norm_after_rope
        self.scale, self.softcap = cfg.query_scale, cfg.attn_softcap
        self.windowed = layer in cfg.window_layers
        self.sinks = nn.Parameter(torch.zeros(cfg.num_heads)) if cfg.attn_sinks else None
        self.rotary_dim, self.interleaved = cfg.rotary_dim, cfg.rope_interleaved
        self.rotates = layer not in cfg.nope_layers  # SmolLM3's and Llama 4's NoPE layers attend without positions
        self.l2_norm = cfg.rms_norm_eps if cfg.qk_l2_norm and self.rotates else None  # Llama 4's, after RoPE
        # queries scaled by position: Llama 4's NoPE layers', Ministral 3's every layer's (batch.query_scale)
        self.tempered = cfg.attn_temperature is not None and (cfg.attn_temperature_every_layer or not self.rotates)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                batch: AttentionBatch, pool: KVPool) -> torch.Tensor:
        n, h, kvh = x.shape[0], self.num_heads, self.num_kv_heads
        qkv = self.qkv_proj(x).view(n, h + 2 * kvh, self.head_dim)
        qk = qkv[:, :h + kvh]
        if self.q_norm is not None and self.across:
            qk = torch.cat((self.q_norm(qk[:, :h].reshape(n, -1)), self.k_norm(qk[:, h:].reshape(n, -1))),
                           dim=1).view(n, h + kvh, self.head_dim)
        elif self.q_norm is not None and not self.norm_after_rope:
            qk = self._per_head_norms(qk, h)
        if self.rotates and self.rotary_dim == self.head_dim and not self.interleaved:
            qk = rotate(qk, *rope)  # q and k heads in one go
        elif self.rotates:  # the first rotary_dim features of each head rotated (pairs read apart), the rest passed through
            rotated = paired(qk[..., :self.rotary_dim]) if self.interleaved else qk[..., :self.rotary_dim]
            qk = torch.cat((rotate(rotated, *rope), qk[..., self.rotary_dim:]), dim=-1)
        if self.q_norm is not None and self.norm_after_rope:  # Hunyuan's: each head normed after RoPE
            qk = self._per_head_norms(qk, h)
        if self.l2_norm is not None:  # each q and k head normed in float32, no weight
            qf = qk.float()
            qk = (qf * torch.rsqrt(qf.pow(2).mean(-1, keepdim=True) + self.l2_norm)).to(qk.dtype)
        if self.tempered:  # the queries scaled (in float32 where the scale is: Llama 4's) and rounded once
            qk = torch.cat(((qk[:, :h] * batch.query_scale).to(qk.dtype), qk[:, h:]), dim=1)
        q, k, v = qk[:, :h], qk[:, h:], qkv[:, h + kvh:]
        pool.write_slots(self.layer, batch.slots, k, v)
        out = paged_attention(q, self.layer, batch, pool, scale=self.scale, cap=self.softcap, windowed=self.windowed,
                              sinks=self.sinks)
        return self.o_proj(out.reshape(n, self.num_heads * self.head_dim))


    def _per_head_norms(self, qk: torch.Tensor, h: int) -> torch.Tensor:
        """Each of the ``h`` query heads and the key heads after them normed by their own norm."""
        return torch.cat((self.q_norm(qk[:, :h]), self.k_norm(qk[:, h:])), dim=1)


class LatentAttention(nn.Module):
    """DeepSeek's multi-head latent attention (MLA) on the paged pool: the pool holds each token's latent
    (``kv_a_proj_with_mqa``'s first ``kv_lora_rank`` features, normed) beside its rotated key, which every
    head shares (the rest), as vLLM caches them; each step projects every head's keys and values from the
    latents it reads (``kv_b_proj``), as transformers does from its cache. RoPE rotates the last
    ``qk_rope_head_dim`` features of each query and the shared key, their pairs interleaved where
    ``rope_interleaved`` (read apart first, as transformers reads them), and the scale is
    ``query_scale`` (YaRN's mscale folded in) or head_dim ** -0.5."""

    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer, self.num_heads, self.windowed = layer, cfg.num_heads, False
        # every layer's queries scaled by position (Mistral 4's: batch.query_scale)
        self.tempered = cfg.attn_temperature is not None and cfg.attn_temperature_every_layer
        self.nope, self.rope_dim, self.rank, self.v_dim = (cfg.qk_nope_head_dim, cfg.qk_rope_head_dim,
                                                           cfg.kv_lora_rank, cfg.v_head_dim)
        h, q, bias = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.o_bias  # attention_bias
        # the low-rank norms' epsilon is 1e-6 whatever rms_norm_eps says, as DeepSeek's reference code and
        # transformers build them (vLLM reads rms_norm_eps: the same for every DeepSeek release, not for Moonlight's)
        self.low_rank_query = bool(cfg.q_lora_rank)
        if cfg.q_lora_rank:
            self.q_a_proj = nn.Linear(h, cfg.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, 1e-6)
            self.q_b_proj = nn.Linear(cfg.q_lora_rank, q, bias=False)
        else:
            self.q_proj = nn.Linear(h, q, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(h, self.rank + self.rope_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.rank, 1e-6)
        self.kv_b_proj = nn.Linear(self.rank, cfg.num_heads * (self.nope + self.v_dim), bias=False)
        self.o_proj = nn.Linear(cfg.num_heads * self.v_dim, h, bias=bias)
        self.scale, self.interleaved = cfg.query_scale, cfg.rope_interleaved

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                batch: AttentionBatch, pool: KVPool) -> torch.Tensor:
        n, h = x.shape[0], self.num_heads
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))) if self.low_rank_query else self.q_proj(x)
        q = q.view(n, h, self.nope + self.rope_dim)
        latent, key = self.kv_a_proj_with_mqa(x).split([self.rank, self.rope_dim], dim=-1)
        rotated = torch.cat((q[..., self.nope:], key[:, None]), dim=1)  # every head's query, then the shared key
        rotated = rotate(paired(rotated) if self.interleaved else rotated, *rope)
        q = torch.cat((q[..., :self.nope], rotated[:, :h]), dim=-1)
        if self.tempered:  # the scale in the model's dtype, the product rounded once
            q = (q * batch.query_scale).to(q.dtype)
        pool.write_slots(self.layer, batch.slots, torch.cat((self.kv_a_layernorm(latent), rotated[:, h]), dim=-1)[:, None],
                         None)
        out = paged_attention(q, self.layer, batch, pool, scale=self.scale, expand=self._expand)
        return self.o_proj(out.reshape(n, h * self.v_dim))

    def _expand(self, cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each head's keys and values [sequences, heads, tokens, features] from the latents and rotated keys
        gathered ([1, sequences, tokens, 1, kv_lora_rank + qk_rope_head_dim])."""
        latent, key = cache[0, :, :, 0].split([self.rank, self.rope_dim], dim=-1)
        b, t, h = latent.shape[0], latent.shape[1], self.num_heads
        # contiguous, as transformers' cache holds it (a strided bf16 input takes a CPU GEMM path ~40x slower)
        kv = self.kv_b_proj(latent.contiguous()).view(b, t, h, self.nope + self.v_dim)
        k = torch.cat((kv[..., :self.nope], key[:, :, None].expand(b, t, h, self.rope_dim)), dim=-1)
        return k.transpose(1, 2), kv[..., self.nope:].transpose(1, 2)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, width: int | None = None) -> None:
        super().__init__()
        i = width or cfg.intermediate_size
        self.gate_up_proj = stacked(self, "gate_up_proj", cfg.hidden_size, {"gate_proj": i, "up_proj": i})
        self.down_proj = nn.Linear(i, cfg.hidden_size, bias=False)
        self.act = F.silu if cfg.activation == "silu" else partial(F.gelu, approximate="tanh")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(self.act(gate) * up)


class Experts(nn.Module):
    """The experts of one layer as two stacked tensors, as transformers holds them: ``gate_up_proj``
    [experts, 2 x width, hidden] and ``down_proj`` [experts, hidden, width]."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        e, h, i = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * i, h))
        self.down_proj = nn.Parameter(torch.empty(e, h, i))

    def one(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """Expert ``e``'s SwiGLU on the tokens ``x`` routed to it."""
        gate, up = F.linear(x, self.gate_up_proj[e]).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, self.down_proj[e])


def routed(x: torch.Tensor, picked: torch.Tensor, weights: torch.Tensor,
           expert: Callable[[int, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """The tokens ``x`` through the experts ``picked`` for them ([tokens, k]), weighed by ``weights``: each
    expert (``expert(e, its tokens)``) runs once on the tokens routed to it, and a token's weighted outputs
    are summed in one reduction and rounded once to ``x``'s dtype, as transformers' default (grouped GEMM)
    path and vLLM's fused MoE sum them, not rounded after each expert."""
    n, k = picked.shape
    flat = picked.flatten()  # row t * k + j: token t's j-th pick
    order = torch.argsort(flat, stable=True)  # grouped by expert
    experts, counts = torch.unique_consecutive(flat[order], return_counts=True)
    weighted = torch.empty(n * k, x.shape[-1], dtype=torch.promote_types(x.dtype, weights.dtype), device=x.device)
    w = weights.flatten()
    for e, rows in zip(experts.tolist(), order.split(counts.tolist())):
        weighted[rows] = expert(e, x[rows // k]) * w[rows, None]
    return weighted.view(n, k, -1).sum(dim=1).to(x.dtype)


class SparseMoE(nn.Module):
    """A mixture of experts: each token goes through the ``experts_per_token`` experts its router
    scores highest, their outputs weighed by the router's softmax (renormalised over those picked
    where ``norm_topk_prob``), each expert run as ``routed`` runs them. Qwen2-MoE adds a shared expert every token passes through, its output scaled by a
    sigmoid gate of its own (Granite's shared expert: ungated)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.top_k, self.normalise, self.float32_weights = cfg.experts_per_token, cfg.norm_topk_prob, cfg.moe_float32_weights
        self.gate = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        self.experts = Experts(cfg)
        shared = cfg.shared_expert_intermediate_size  # Qwen2-MoE: one more expert every token takes, gated
        self.shared_expert = MLP(cfg, shared) if shared else None  # (Granite's: ungated)
        self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False) if shared and cfg.shared_expert_gate else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.gate(x)
        weights, picked = torch.topk(F.softmax(logits, dim=-1, dtype=torch.float), self.top_k, dim=-1)
        if self.normalise:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if not self.float32_weights:
            weights = weights.to(logits.dtype)
        out = routed(x, picked, weights, self.experts.one)
        if self.shared_expert_gate is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        elif self.shared_expert is not None:
            out = out + self.shared_expert(x)
        return out


class Router(nn.Module):
    """DeepSeek's router: ``weight`` [experts, hidden], held in float32, scores each token in float32, as
    transformers and vLLM score it; with ``sigmoid_groups`` (DeepSeek-V3's) and ``softmax_biased`` (ERNIE 4.5's) a learned
    ``e_score_correction_bias`` is added to the scores that pick (not to those that weigh), held in float32
    whatever the model's dtype, as both hold it.
    ``forward`` gives each token's experts picked and their weights (float32), as ``ModelConfig.router`` says."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.kind, self.top_k, self.normalise, self.scaling = (cfg.router, cfg.experts_per_token, cfg.norm_topk_prob,
                                                              cfg.routed_scaling)
        self.groups, self.topk_groups = cfg.expert_groups, cfg.topk_groups
        self.weight = nn.Parameter(torch.empty(cfg.num_experts, cfg.hidden_size))
        self.biased = cfg.router in ("sigmoid_groups", "softmax_biased")
        if self.biased:
            self.register_buffer("e_score_correction_bias", torch.zeros(cfg.num_experts))

    def _apply(self, fn, recurse=True):
        # the weight and the bias kept in float32, on the device they go to, as vLLM holds ERNIE 4.5's and
        # MiniMax-M2's routers (which their releases store in float32); a 16-bit one loses nothing
        bias, weight = getattr(self, "e_score_correction_bias", None), self.weight.data
        super()._apply(fn, recurse)
        self.weight.data = weight.to(self.weight.device, torch.float32)
        if bias is not None:
            self.e_score_correction_bias = bias.to(self.weight.device)
        return self

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = F.linear(x.float(), self.weight.float())
        n, e = logits.shape
        scores = logits.sigmoid() if self.kind == "sigmoid_groups" else logits.softmax(dim=-1)
        choice = scores + self.e_score_correction_bias if self.biased else scores
        if self.groups > 1:  # the experts outside the topk_groups groups scored best left out
            if self.biased:
                best = choice.view(n, self.groups, e // self.groups).topk(2, dim=-1)[0].sum(dim=-1)
            else:
                best = choice.view(n, self.groups, e // self.groups).max(dim=-1).values
            kept = torch.zeros_like(best).scatter_(1, torch.topk(best, self.topk_groups, dim=-1, sorted=False)[1], 1)
            outside = ~kept.bool()[:, :, None].expand(n, self.groups, e // self.groups).reshape(n, e)
            choice = choice.masked_fill(outside, float("-inf") if self.biased else 0.0)
        picked = torch.topk(choice, self.top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, picked)
        if self.normalise:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return picked, weights * self.scaling


class GroupedMoE(nn.Module):
    """DeepSeek's mixture of experts: its ``Router`` picks and weighs ``experts_per_token`` SwiGLU experts
    (run as ``routed`` runs them), and every token also passes through the shared experts, one MLP
    ``shared_expert_intermediate_size`` wide, ungated."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate = Router(cfg)
        self.experts = Experts(cfg)
        shared = cfg.shared_expert_intermediate_size
        self.shared_experts = MLP(cfg, shared) if shared else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        picked, weights = self.gate(x)
        out = routed(x, picked, weights, self.experts.one)
        return out if self.shared_experts is None else out + self.shared_experts(x)


class InputWeighedMoE(nn.Module):
    """Llama 4's mixture of experts: its router (``gate``, in the model's dtype) picks each token's
    ``experts_per_token`` highest logits, and their sigmoids (in float32, rounded to the model's dtype) weigh
    the token as it goes into each expert, not what comes out; every token also passes through one ungated
    shared expert, whose output the routed ones' sum is added to."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.top_k = cfg.experts_per_token
        self.gate = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        self.experts = Experts(cfg)
        self.shared_expert = MLP(cfg, cfg.shared_expert_intermediate_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        top, picked = torch.topk(self.gate(x), self.top_k, dim=-1)
        n, k = picked.shape
        weighed = (x[:, None, :] * torch.sigmoid(top.float()).to(x.dtype)[:, :, None]).reshape(n * k, -1)
        ones = torch.ones(n * k, 1, dtype=x.dtype, device=x.device)
        out = routed(weighed, picked.reshape(n * k, 1), ones, self.experts.one).view(n, k, -1)
        return self.shared_expert(x) + out.sum(dim=1)


class ClampedExperts(nn.Module):
    """gpt-oss's experts as transformers holds them: ``gate_up_proj`` [experts, hidden, 2 x width], the
    gate's and the up projection's columns interleaved, ``down_proj`` [experts, width, hidden], and a
    bias for each."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        e, h, i = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(e, h, 2 * i))
        self.gate_up_proj_bias = nn.Parameter(torch.empty(e, 2 * i))
        self.down_proj = nn.Parameter(torch.empty(e, i, h))
        self.down_proj_bias = nn.Parameter(torch.empty(e, h))


class ClampedMoE(nn.Module):
    """gpt-oss's mixture of experts: a router with a bias picks the ``experts_per_token`` highest logits and
    weighs those experts by the softmax of the logits picked (in the model's dtype); each expert's
    SwiGLU is clamped (the gate above, the up projection both ways, at ``swiglu_limit``) and computes
    gate x sigmoid(alpha x gate) x (up + 1), its matrix products and bias additions apart, as
    transformers' default (grouped GEMM) path computes them; run as ``routed`` runs them."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.top_k, self.limit, self.alpha = cfg.experts_per_token, cfg.swiglu_limit, cfg.swiglu_alpha
        self.router = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=True)
        self.experts = ClampedExperts(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        top, picked = torch.topk(self.router(x), self.top_k, dim=-1)
        return routed(x, picked, F.softmax(top, dim=1, dtype=top.dtype), self._expert)

    def _expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        ex = self.experts
        gate_up = x @ ex.gate_up_proj[e]
        gate_up.add_(ex.gate_up_proj_bias[e])
        gate, up = gate_up[:, ::2].clamp(max=self.limit), gate_up[:, 1::2].clamp(min=-self.limit, max=self.limit)
        out = ((up + 1) * (gate * torch.sigmoid(gate * self.alpha))) @ ex.down_proj[e]
        return out.add_(ex.down_proj_bias[e])


class DecoderLayer(nn.Module):
    """Attention and the MLP, each after a norm and added to the residual stream. With
    ``sandwich_norms`` (Gemma 2) each output is normed too before it is added: there
    ``post_attention_layernorm`` norms attention's output and ``pre_feedforward_layernorm`` the
    MLP's input, as transformers names them; without ``pre_norms`` (OLMo 2) only the outputs are normed;
    with ``residual_multiplier`` (Granite) each output is scaled before it is added."""

    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        if cfg.pre_norms:
            self.input_layernorm = norm(cfg)
        self.self_attn = LatentAttention(cfg, layer) if cfg.kv_lora_rank else Attention(cfg, layer)
        if not cfg.parallel_block:
            self.post_attention_layernorm = norm(cfg)
        if cfg.sandwich_norms:
            if cfg.pre_norms:
                self.pre_feedforward_layernorm = norm(cfg)
            self.post_feedforward_layernorm = norm(cfg)
        self.sandwich, self.pre_norms, self.residual_multiplier = cfg.sandwich_norms, cfg.pre_norms, cfg.residual_multiplier
        self.parallel = cfg.parallel_block
        sparse = (ClampedMoE if cfg.swiglu_limit is not None else SparseMoE if cfg.router == "softmax"
                  else InputWeighedMoE if cfg.router == "sigmoid_input" else GroupedMoE)
        self.mlp = sparse(cfg) if cfg.is_sparse(layer) else MLP(cfg)

    def forward(self, x, rope, batch, pool):
        if self.parallel:  # Cohere: attention and the MLP read the same norm, both outputs added
            h = self.input_layernorm(x)
            return x + self.self_attn(h, rope, batch, pool) + self.mlp(h)
        if not self.pre_norms:  # OLMo 2: each sublayer's output normed, its input not
            x = x + self.post_attention_layernorm(self.self_attn(x, rope, batch, pool))
            return x + self.post_feedforward_layernorm(self.mlp(x))
        if self.sandwich:
            x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), rope, batch, pool))
            return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))
        if self.residual_multiplier != 1:  # Granite: each sublayer's output scaled before it is added
            x = x + self.self_attn(self.input_layernorm(x), rope, batch, pool) * self.residual_multiplier
            return x + self.mlp(self.post_attention_layernorm(x)) * self.residual_multiplier
        x = x + self.self_attn(self.input_layernorm(x), rope, batch, pool)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaBody(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = norm(cfg)


class LlamaModel(nn.Module):
    """The decoder. ``forward`` returns logits for the tokens ``batch.logit_rows`` selects."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = LlamaBody(cfg)
        self.rotary = Rotary(cfg.rotary_dim, cfg.rope_theta, cfg.rope_scaling)
        # Gemma 3's windowed layers rotate by a RoPE of their own, unscaled
        self.local_rotary = Rotary(cfg.head_dim, cfg.local_rope_theta) if cfg.local_rope_theta else None
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        # each layer's K and V scales, [layers, 2] in float32, where the checkpoint gives them (k_scale, v_scale):
        # what an 8-bit KV cache divides them by to store them and multiplies by to read them, as vLLM applies
        # them; None: 1 (a KV cache in the model's dtype reads none)
        self.kv_scales: torch.Tensor | None = None

    @classmethod
    def from_seed(cls, cfg: ModelConfig, seed: int, device: str | torch.device = "cpu") -> "LlamaModel":
        """Random weights drawn from ``seed`` (normal, std 0.02, as Llama's initialiser), reproducible."""
        gen = torch.Generator().manual_seed(seed)
        model = cls(cfg)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("norm.weight"):
                    p.fill_(0.0 if cfg.norm_offset else 1.0)
                else:
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
        return model.to(device=device, dtype=torch_dtype(cfg.dtype)).eval()

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: AttentionBatch,
                pool: KVPool) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids)
        if self.config.embed_scale:  # the scale rounded to the model's dtype first, as Gemma's reference
            x = x * torch.tensor(self.config.hidden_size ** 0.5, dtype=x.dtype)
        if self.config.embedding_multiplier != 1:  # Granite's, a Python float as its reference multiplies
            x = x * self.config.embedding_multiplier
        rope = self.rotary(positions, x.dtype)
        local = rope if self.local_rotary is None else self.local_rotary(positions, x.dtype)
        batch.query_scale = self.query_scales(positions, x.dtype)
        for layer in self.model.layers:
            x = layer(x, local if layer.self_attn.windowed else rope, batch, pool)
        if batch.logit_rows is not None:
            x = x[batch.logit_rows]
        logits = softcap(self.lm_head(self.model.norm(x)), self.config.logit_softcap)
        return logits if self.config.logits_scaling == 1 else logits / self.config.logits_scaling

    def query_scales(self, positions: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
        """Each token's queries' scale by its position, [tokens, 1, 1], as transformers computes it
        (``ModelConfig.attn_temperature``): Llama 4's NoPE layers' in float32, Ministral 3's every layer's
        rounded to ``dtype`` first; None for a model without one."""
        if self.config.attn_temperature is None:
            return None
        floor_scale, attn_scale = self.config.attn_temperature
        if self.config.attn_temperature_every_layer:
            scale = (1 + attn_scale * torch.log(1 + torch.floor(positions.float() / floor_scale))).to(dtype)
        else:
            scale = torch.log1p(torch.floor((positions.float() + 1.0) / floor_scale)) * attn_scale + 1.0
        return scale[:, None, None]

    def weight_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.parameters())
