"""Configuration records for the model and the engine."""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, replace
from typing import Callable

import torch

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def torch_dtype(name: str) -> torch.dtype:
    if name not in _DTYPES:
        raise ValueError(f"dtype: {name!r} is not one of {sorted(_DTYPES)}")
    return _DTYPES[name]


ROUTERS = ("softmax", "softmax_groups", "sigmoid_groups", "softmax_biased", "sigmoid_input")  # how a mixture of experts' router picks (ModelConfig)
ACTIVATIONS = ("silu", "gelu_tanh")  # the MLP's gate: SwiGLU's, or GeGLU's with GELU's tanh approximation
WEIGHT_BITS = (2, 3, 4, 8, 16, 32)  # the bits a weight may be stored in: quantised, or a float dtype's
# 4-bit floats with a scale for each block, counted with their scales: NVFP4 (an 8-bit float for every 16),
# MXFP4 (an 8-bit power of two for every 32)
NVFP4_BITS, MXFP4_BITS = 4.5, 4.25
# the KV cache's dtype, as vLLM's --kv-cache-dtype names it: the model's ("auto"), or 8-bit floats over the
# checkpoint's KV scales (1 where it gives none, vLLM's default), "fp8" being E4M3
KV_CACHE_DTYPES = {"auto": None, "fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn,
                   "fp8_e5m2": torch.float8_e5m2}


def is_whole(value) -> bool:
    """Whether ``value`` is a whole number: an int, numpy's too; not a bool, a float or NaN, which a size,
    a count or a token could not be, and which would fail later without a name."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def is_positive(value) -> bool:
    """Whether ``value`` is a finite number > 0: an int or a float, not a bool, NaN or infinity."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0


def _count(name: str, value, minimum: int = 1) -> None:
    """Refuse ``value`` unless it is a whole number (``is_whole``) >= ``minimum``."""
    if not is_whole(value):
        raise ValueError(f"{name} must be a whole number >= {minimum}, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be {'> 0' if minimum == 1 else f'>= {minimum}'}, got {value}")


@dataclass(frozen=True)
class RopeScaling:
    """How a checkpoint stretches RoPE past the context it was pre-trained on (``rope_scaling``, or
    ``rope_parameters``, in its config.json), as Hugging Face's Llama applies it.

    ``linear`` (position interpolation): every frequency divided by ``factor``. ``llama3`` (Llama
    3.1 and later): frequencies whose wavelength is shorter than ``original_max_position /
    high_freq_factor`` are kept, those longer than ``original_max_position / low_freq_factor`` are
    divided by ``factor``, and those between are blended linearly in ``original_max_position /
    wavelength``. Neither scales the attention logits. ``yarn`` (YaRN: Qwen2.5 and Qwen3 past 32k,
    gpt-oss): frequencies that turn more than ``beta_fast`` times over ``original_max_position`` are
    kept, those that turn less than ``beta_slow`` times are divided by ``factor``, and those between
    are blended linearly in their dimension (the range's ends rounded outwards unless ``truncate`` is
    false); cos and sin are then scaled by ``attention_factor`` (0.1 ln(factor) + 1 unless the
    checkpoint gives one), which scales the logits by its square. ``longrope`` (Phi-3's 128k contexts,
    Phi-3.5, Phi-4-mini): each frequency divided by its own factor, ``long_factor``'s where the engine serves
    contexts longer than ``original_max_position``, ``short_factor``'s otherwise (as vLLM decides it, by its
    max_model_len, once), cos and sin scaled by ``attention_factor`` with the short factors and
    ``long_attention_factor`` with the long ones (vLLM's short_mscale and long_mscale; where the checkpoint
    gives none, sqrt(1 + ln(factor) / ln(original context)), ``factor`` the declared context over the original).
    """

    kind: str
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    attention_factor: float | None = None
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()
    long_attention_factor: float | None = None

    KINDS = ("linear", "llama3", "yarn", "longrope")

    def __post_init__(self) -> None:
        if self.kind not in self.KINDS:
            raise ValueError(f"rope scaling: kind {self.kind!r} is not one of {', '.join(self.KINDS)}")
        if not self.factor > 0:
            raise ValueError(f"rope scaling: factor must be > 0, got {self.factor}")
        if self.kind == "llama3":  # equal factors (Llama 4 Scout's 1 and 1): no band blended, as transformers reads them
            if not 0 < self.low_freq_factor <= self.high_freq_factor:
                raise ValueError(f"rope scaling: needs 0 < low_freq_factor <= high_freq_factor, got "
                                 f"{self.low_freq_factor} and {self.high_freq_factor}")
        if self.kind == "longrope" and not (self.short_factor and len(self.short_factor) == len(self.long_factor)
                                            and all(is_positive(f) for f in self.short_factor + self.long_factor)):
            raise ValueError(f"rope scaling: longrope needs short_factor and long_factor, as many numbers > 0 each, "
                             f"got {self.short_factor!r:.100} and {self.long_factor!r:.100}")
        for name in ("attention_factor", "long_attention_factor") if self.kind == "longrope" else ():
            if getattr(self, name) is not None and not is_positive(getattr(self, name)):
                raise ValueError(f"rope scaling: longrope's {name} must be a number > 0, got {getattr(self, name)!r}")
        if self.kind in ("llama3", "yarn", "longrope") and self.original_max_position <= 0:
            raise ValueError(f"rope scaling: original_max_position must be > 0, got {self.original_max_position}")
        if self.kind == "yarn":
            for name in ("beta_fast", "beta_slow", "attention_factor"):
                value = getattr(self, name)
                if value is None and name == "attention_factor":
                    continue
                if not is_positive(value):
                    raise ValueError(f"rope scaling: {name} must be a number > 0, got {value!r}")

    @property
    def cos_scale(self) -> float:
        """What cos and sin are multiplied by: YaRN's attention factor (0.1 ln(factor) + 1 where the
        checkpoint gives none, as transformers and vLLM compute it), 1 for the others."""
        if self.kind not in ("yarn", "longrope"):
            return 1.0
        if self.attention_factor is not None:
            return float(self.attention_factor)
        if self.kind == "longrope":
            return self._longrope_scale()
        return 0.1 * math.log(self.factor) + 1.0 if self.factor > 1 else 1.0

    @property
    def long_cos_scale(self) -> float:
        """LongRoPE's scale with its long factors (``cos_scale`` is the short factors')."""
        return float(self.long_attention_factor) if self.long_attention_factor is not None else self._longrope_scale()

    def _longrope_scale(self) -> float:
        return math.sqrt(1 + math.log(self.factor) / math.log(self.original_max_position)) if self.factor > 1 else 1.0


def _bytes(params: int, bits: float) -> int:
    """Bytes of ``params`` weights at ``bits`` each: whole bits floored, as ever; a block-scaled format's
    fractional bits rounded up."""
    return params * bits // 8 if isinstance(bits, int) else math.ceil(params * bits / 8)


@dataclass(frozen=True)
class ModelConfig:
    """A Llama-architecture decoder. The default is tiny so that it runs fast on a CPU.

    With ``num_experts`` > 0 the MLP of every layer not in ``dense_layers`` is a mixture of
    experts (Mixtral, Qwen3-MoE): a router picks ``experts_per_token`` of ``num_experts`` SwiGLU
    experts of width ``moe_intermediate_size`` for each token and weighs their outputs by its
    softmax, renormalised over the ones picked where ``norm_topk_prob``; ``dense_layers`` keep a
    dense MLP of width ``intermediate_size``; ``shared_expert_intermediate_size`` > 0 adds Qwen2-MoE's
    shared expert, which every token takes, gated by a sigmoid. ``moe_float32_weights``: the routing weights stay
    float32 when they scale an expert's output (Mixtral) instead of taking the model's dtype first
    (Qwen3-MoE), which tells the two apart in bf16.

    Gemma's decoder is Llama's with its embeddings scaled by sqrt(hidden_size) (``embed_scale``), its
    RMSNorms scaling by 1 + weight in float32 before the cast (``norm_offset``) and a tanh-approximated
    GELU gating its MLP (``activation``); Gemma 2 adds a norm after attention and on both sides of the
    MLP (``sandwich_norms``), its own attention scale (``query_scale``) and tanh soft-caps on the
    attention scores and the final logits (``attn_softcap``, ``logit_softcap``); Gemma 3 drops the soft
    caps, norms each q and k head (``qk_norm``) and gives its windowed layers a RoPE of their own
    (``local_rope_theta``).
    """

    vocab_size: int = 512
    hidden_size: int = 64
    intermediate_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    max_position: int = 8192
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # biases on the q, k and v projections (Qwen2; Llama's attention_bias)
    o_bias: bool = False  # a bias on the output projection (Llama's attention_bias)
    qk_norm: bool = False  # RMSNorm over each q and k head before RoPE (Qwen3)
    qk_norm_after_rope: bool = False  # qk_norm's after RoPE instead (Hunyuan's): the KV holds the normed keys
    explicit_head_dim: int | None = None  # config.json's head_dim where it is not hidden_size / num_heads (Qwen3)
    dtype: str = "float32"  # activations, and KV where kv_cache_dtype is "auto"
    # the KV cache's dtype (KV_CACHE_DTYPES): "auto", the model's; "fp8" (E4M3) or "fp8_e5m2", each K and V value
    # stored in 8 bits over its layer's scale (saturated at the format's largest) and read back into the model's
    # dtype to attend (KVPool)
    kv_cache_dtype: str = "auto"
    weight_bits: float | None = None  # quantised weights (4, 8; 4.5 NVFP4's, 4.25 MXFP4's with their block scales);
    # None: ``dtype``. Only the ledger and cost models read it
    num_experts: int = 0  # 0: a dense model
    experts_per_token: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    moe_float32_weights: bool = False
    dense_layers: tuple[int, ...] = ()  # layers whose MLP stays dense in a mixture-of-experts model
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE's shared expert beside the routed ones; 0: none
    activation: str = "silu"  # what gates the MLP: "silu" (SwiGLU) or "gelu_tanh" (Gemma's GeGLU)
    norm_offset: bool = False  # RMSNorm scales by 1 + weight (Gemma)
    embed_scale: bool = False  # embeddings times sqrt(hidden_size), in the model's dtype (Gemma)
    sandwich_norms: bool = False  # a norm on attention's output and after the MLP too (Gemma 2)
    query_scale: float | None = None  # attention's scale; None: head_dim ** -0.5
    attn_softcap: float | None = None  # attention scores soft-capped: cap * tanh(score / cap) (Gemma 2)
    logit_softcap: float | None = None  # the final logits soft-capped the same way (Gemma 2)
    sliding_window: int | None = None  # the tokens a windowed layer attends to, its own included
    window_layers: tuple[int, ...] = ()  # the layers that attend through it (their KV is kept whole all the same)
    local_rope_theta: float | None = None  # the windowed layers' own RoPE base, unscaled (Gemma 3); None: as the others
    encoder_params: int = 0  # parameters held beside the decoder and not run for text (Gemma 3's vision tower)
    # gpt-oss: a learned logit per head beside each query's scores, taking a share of the softmax
    # and giving back no value ("attention sinks")
    attn_sinks: bool = False
    norm_float32_weight: bool = False  # the RMSNorm's weight applied in float32, before the cast (gpt-oss)
    # gpt-oss's experts (None: SwiGLU's): the gate clamped above and the up projection both ways at this
    # limit, gate x sigmoid(swiglu_alpha x gate) x (up + 1), with biases and gate and up interleaved;
    # their router has a bias and softmaxes the logits it picks
    swiglu_limit: float | None = None
    swiglu_alpha: float = 1.702
    # the routed experts' matrices' bits where only they are quantised (gpt-oss's MXFP4: 4 bits and an
    # 8-bit scale for each 32 weights, 4.25); None: as the other weights. Only the ledger and cost models read it
    expert_weight_bits: float | None = None
    # Multi-head latent attention (MLA: DeepSeek-V2 and V3): a token's KV is one latent of ``kv_lora_rank``
    # features and one rotated key of ``qk_rope_head_dim`` features that every head shares, held in place of
    # each head's K and V (vLLM's cache); each head's key (``qk_nope_head_dim`` features from the latent, then
    # the shared rotated ones) and value (``v_head_dim``) are projected from it; queries come through a
    # low-rank projection of ``q_lora_rank`` features where > 0. 0: attention as the others'.
    kv_lora_rank: int = 0
    q_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    rope_interleaved: bool = False  # RoPE rotates interleaved pairs (x0, x1), (x2, x3), ... (DeepSeek's MLA, GLM-4's)
    # how a mixture's router picks and weighs (ROUTERS): ``softmax`` the highest softmax scores (Mixtral's,
    # Qwen-MoE's); ``softmax_groups`` (DeepSeek-V2's) the highest within the ``topk_groups`` of
    # ``expert_groups`` groups whose best score is highest; ``sigmoid_groups`` (DeepSeek-V3's) sigmoid scores
    # plus a learned bias pick within the groups whose two best sum highest, the unbiased scores weigh;
    # ``softmax_biased`` (ERNIE 4.5's) softmax scores plus a learned bias pick, the unbiased scores weigh; the
    # weights are then multiplied by ``routed_scaling``; ``sigmoid_input`` (Llama 4's) the highest logits pick,
    # and their sigmoids weigh each expert's input, not its output
    router: str = "softmax"
    expert_groups: int = 1
    topk_groups: int = 1
    routed_scaling: float = 1.0
    shared_expert_gate: bool = True  # the shared expert's output gated by a sigmoid (Qwen2-MoE's), or not (DeepSeek's)
    # the share of each query and key head's features RoPE rotates, its first int(head_dim x this) (GLM-4.5's
    # half, Phi-4-mini's three quarters); the rest pass through unrotated
    partial_rotary: float = 1.0
    # OLMo 2's differences: its q and k norms each over all of their heads' features at once (``qk_norm`` with
    # ``qk_norm_across_heads``), and only the norms after attention and the MLP (``sandwich_norms`` without
    # ``pre_norms``)
    qk_norm_across_heads: bool = False
    pre_norms: bool = True
    nope_layers: tuple[int, ...] = ()  # layers that apply no RoPE ("NoPE": SmolLM3's every fourth)
    # Llama 4's: its window_layers attend within aligned chunks of sliding_window tokens (a query at position p
    # sees the keys from p - p % sliding_window to p) rather than the last sliding_window; its rotating layers'
    # q and k heads normed after RoPE, without a weight (``qk_l2_norm``); its NoPE layers' queries times
    # log1p(floor((p + 1) / floor_scale)) x attn_scale + 1, in float32 (``attn_temperature``: (floor_scale,
    # attn_scale)). With ``attn_temperature_every_layer`` (Ministral 3's llama_4_scaling)
    # every layer's queries, after RoPE, times 1 + attn_scale x ln(1 + floor(p / floor_scale)), the scale rounded to
    # the model's dtype first: each as transformers computes it
    window_chunked: bool = False
    qk_l2_norm: bool = False
    attn_temperature: tuple[float, float] | None = None
    attn_temperature_every_layer: bool = False
    # Granite's scalars: embeddings times ``embedding_multiplier``, each sublayer's output times
    # ``residual_multiplier`` before it joins the residual stream, the final logits divided by ``logits_scaling``
    # (its attention_multiplier is ``query_scale``)
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    logits_scaling: float = 1.0
    # Cohere's differences: its norms subtract the mean (a LayerNorm without a bias, its weight applied in
    # float32: ``layer_norm``); attention and the MLP each read one norm of the layer's input, and both outputs
    # join the residual stream (``parallel_block``); Command R+'s q and k norms keep a weight for each head
    # (``qk_norm_head_weights``, with ``qk_norm``)
    layer_norm: bool = False
    parallel_block: bool = False
    qk_norm_head_weights: bool = False

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "max_position"):
            _count(name, getattr(self, name))
        if self.explicit_head_dim is not None and self.explicit_head_dim <= 0:
            raise ValueError(f"explicit_head_dim must be > 0, got {self.explicit_head_dim}")
        if self.explicit_head_dim is None and not self.kv_lora_rank and self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size {self.hidden_size} is not a multiple of num_heads {self.num_heads}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")
        torch_dtype(self.dtype)
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, RopeScaling):
            raise ValueError(f"rope_scaling must be a RopeScaling or None, got {self.rope_scaling!r}")
        if self.weight_bits is not None and (isinstance(self.weight_bits, bool)
                                             or self.weight_bits not in (*WEIGHT_BITS, NVFP4_BITS, MXFP4_BITS)):
            allowed = ", ".join(map(str, (*WEIGHT_BITS, NVFP4_BITS, MXFP4_BITS)))
            raise ValueError(f"weight_bits must be one of {allowed}, got {self.weight_bits}")
        if self.num_experts < 0:
            raise ValueError(f"num_experts must be >= 0, got {self.num_experts}")
        _count("shared_expert_intermediate_size", self.shared_expert_intermediate_size, minimum=0)
        if self.num_experts:
            if not 0 < self.experts_per_token <= self.num_experts:
                raise ValueError(f"experts_per_token must be in [1, num_experts={self.num_experts}], "
                                 f"got {self.experts_per_token}")
            if self.moe_intermediate_size <= 0:
                raise ValueError(f"moe_intermediate_size must be > 0, got {self.moe_intermediate_size}")
        bad = [i for i in self.dense_layers if not 0 <= i < self.num_layers]
        if bad:
            raise ValueError(f"dense_layers: layer {bad[0]} is not one of the {self.num_layers} layers")
        bad = [i for i in self.window_layers if not 0 <= i < self.num_layers]
        if bad:
            raise ValueError(f"window_layers: layer {bad[0]} is not one of the {self.num_layers} layers")
        bad = [i for i in self.nope_layers if not (is_whole(i) and 0 <= i < self.num_layers)]
        if bad:
            raise ValueError(f"nope_layers: layer {bad[0]!r} is not one of the {self.num_layers} layers")
        if self.window_layers and not (is_whole(self.sliding_window) and self.sliding_window >= 1):
            raise ValueError(f"sliding_window must be a whole number of tokens >= 1 where window_layers are "
                             f"given, got {self.sliding_window!r}")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {', '.join(ACTIVATIONS)}, got {self.activation!r}")
        if self.activation != "silu" and self.num_experts:
            raise ValueError(f"a mixture of experts' MLPs are SwiGLU: activation must be 'silu', got {self.activation!r}")
        if not is_whole(self.encoder_params) or self.encoder_params < 0:
            raise ValueError(f"encoder_params must be a whole number >= 0, got {self.encoder_params!r}")
        if self.window_chunked and not self.window_layers:
            raise ValueError("window_chunked says how window_layers attend: it needs window_layers")
        if self.attn_temperature is not None and not (
                isinstance(self.attn_temperature, tuple) and len(self.attn_temperature) == 2
                and all(is_positive(v) for v in self.attn_temperature)):
            raise ValueError(f"attn_temperature must be (floor_scale, attn_scale), two numbers > 0, or None, "
                             f"got {self.attn_temperature!r}")
        if self.attn_temperature_every_layer and self.attn_temperature is None:
            raise ValueError("attn_temperature_every_layer says where attn_temperature applies: it needs attn_temperature")
        if self.local_rope_theta is not None and not self.window_layers:
            raise ValueError("local_rope_theta needs window_layers, the layers it applies to")
        if self.swiglu_limit is not None and not self.num_experts:
            raise ValueError("swiglu_limit is gpt-oss's experts': it needs num_experts > 0")
        if self.expert_weight_bits is not None and not (self.num_experts and isinstance(self.expert_weight_bits, (int, float))
                                                        and not isinstance(self.expert_weight_bits, bool)
                                                        and 0 < self.expert_weight_bits <= 32):
            raise ValueError(f"expert_weight_bits must be a number of bits in (0, 32] for a mixture of experts, "
                             f"got {self.expert_weight_bits!r}")
        self._check_latent_attention()
        if isinstance(self.partial_rotary, bool) or not isinstance(self.partial_rotary, (int, float)) \
                or not 0 < self.partial_rotary <= 1 or (self.kv_lora_rank and self.partial_rotary != 1):
            raise ValueError(f"partial_rotary must be a share in (0, 1] (1 with latent attention), got {self.partial_rotary!r}")
        if self.rotary_dim < 2 or self.rotary_dim % 2:
            raise ValueError(f"RoPE rotates pairs: {self.partial_rotary} of a {self.head_dim}-feature head is "
                             f"{self.rotary_dim} features")
        if self.rope_scaling is not None and self.rope_scaling.kind == "longrope" \
                and len(self.rope_scaling.short_factor) != self.rotary_dim // 2:
            raise ValueError(f"rope scaling: longrope needs a factor for each of the {self.rotary_dim // 2} frequencies "
                             f"RoPE turns by, got {len(self.rope_scaling.short_factor)}")
        self._check_router()
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        if self.kv_cache_dtype != "auto" and self.kv_lora_rank:
            raise ValueError(f"kv_cache_dtype {self.kv_cache_dtype!r} with latent attention is not supported (vLLM's "
                             "8-bit latent caches take a layout of their own for each attention backend)")
        if self.qk_norm_across_heads and not self.qk_norm:
            raise ValueError("qk_norm_across_heads says how qk_norm norms: it needs qk_norm")
        if self.residual_multiplier != 1 and self.sandwich_norms:
            raise ValueError("residual_multiplier is Granite's, whose layers norm only each sublayer's input: it does "
                             "not take sandwich_norms")
        if self.parallel_block and (self.sandwich_norms or not self.pre_norms):
            raise ValueError("parallel_block reads one norm of each layer's input: it excludes sandwich_norms and "
                             "needs pre_norms")
        if self.qk_norm_after_rope and (not self.qk_norm or self.qk_norm_across_heads):
            raise ValueError("qk_norm_after_rope says when qk_norm norms each head: it needs qk_norm, not "
                             "qk_norm_across_heads")
        if self.qk_norm_head_weights and (not self.qk_norm or self.qk_norm_across_heads):
            raise ValueError("qk_norm_head_weights says how qk_norm weighs each head: it needs qk_norm, not "
                             "qk_norm_across_heads")
        if not self.pre_norms and not self.sandwich_norms:
            raise ValueError("pre_norms=False leaves only the norms after attention and the MLP: it needs sandwich_norms")
        for name in ("swiglu_alpha", "routed_scaling", "embedding_multiplier", "residual_multiplier", "logits_scaling"):
            if not is_positive(getattr(self, name)):
                raise ValueError(f"{name} must be a number > 0, got {getattr(self, name)!r}")
        for name in ("query_scale", "attn_softcap", "logit_softcap", "local_rope_theta", "swiglu_limit"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, (int, float)) and not isinstance(value, bool)
                                          and math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a number > 0 or None, got {value!r}")

    def _check_latent_attention(self) -> None:
        for name in ("kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            _count(name, getattr(self, name), minimum=0)
        if not self.kv_lora_rank:
            return
        if not self.qk_rope_head_dim or self.qk_rope_head_dim % 2 or not self.v_head_dim:
            raise ValueError(f"latent attention needs an even qk_rope_head_dim > 0 and v_head_dim > 0, got "
                             f"{self.qk_rope_head_dim} and {self.v_head_dim}")
        other = next((name for name in ("qk_norm", "attn_sinks", "attn_softcap", "window_layers", "explicit_head_dim")
                      if getattr(self, name)), None)
        if other is not None:
            raise ValueError(f"latent attention (kv_lora_rank > 0) does not take {other}")

    def _check_router(self) -> None:
        if self.router not in ROUTERS:
            raise ValueError(f"router must be one of {', '.join(ROUTERS)}, got {self.router!r}")
        _count("expert_groups", self.expert_groups)
        _count("topk_groups", self.topk_groups)
        if self.router == "softmax" or not self.num_experts:
            return
        if self.num_experts % self.expert_groups or self.topk_groups > self.expert_groups:
            raise ValueError(f"expert_groups must divide num_experts ({self.num_experts}) and topk_groups be at most "
                             f"expert_groups, got {self.expert_groups} and {self.topk_groups}")
        if self.router == "sigmoid_groups" and self.num_experts // self.expert_groups < 2:
            raise ValueError(f"sigmoid_groups scores each group by its two best experts: {self.expert_groups} groups of "
                             f"{self.num_experts} experts leave one a group")
        if self.topk_groups * (self.num_experts // self.expert_groups) < self.experts_per_token:
            raise ValueError(f"the {self.topk_groups} of {self.expert_groups} expert groups a token picks hold fewer "
                             f"experts than experts_per_token ({self.experts_per_token})")

    @property
    def head_dim(self) -> int:
        """The width of a head's query and key (latent attention's: its own features and the rotated ones)."""
        if self.kv_lora_rank:
            return self.qk_nope_head_dim + self.qk_rope_head_dim
        return self.explicit_head_dim or self.hidden_size // self.num_heads

    @property
    def rotary_dim(self) -> int:
        """The features of a query or key head RoPE rotates: latent attention's rotated ones, else the first
        ``partial_rotary`` of them, as transformers counts them (rounded down)."""
        return self.qk_rope_head_dim if self.kv_lora_rank else int(self.head_dim * self.partial_rotary)

    @property
    def value_dim(self) -> int:
        """The width of a head's value, and of its attention output."""
        return self.v_head_dim if self.kv_lora_rank else self.head_dim

    @property
    def kv_layout(self) -> tuple[int, int, int]:
        """What a token's KV cache holds in each layer, as (entries, heads, features): K and V per KV head, or
        latent attention's one entry, its latent and shared rotated key side by side, as vLLM caches it."""
        if self.kv_lora_rank:
            return 1, 1, self.kv_lora_rank + self.qk_rope_head_dim
        return 2, self.num_kv_heads, self.head_dim

    def pair_flops(self) -> int:
        """FLOPs of one layer for one attended (query, key) pair: scores and values over every head; latent
        attention's as vLLM decodes it, on the latent (each head's scores over the latent and the rotated key,
        its values over the latent)."""
        if self.kv_lora_rank:
            return 2 * self.num_heads * (2 * self.kv_lora_rank + self.qk_rope_head_dim)
        return 4 * self.num_heads * self.head_dim

    def prefill_pair_flops(self) -> int:
        """``pair_flops`` for a prefill's queries: latent attention's as vLLM prefills, on each head's keys
        and values projected from the latent (scores over head_dim features, values over value_dim); the
        others' as ``pair_flops``."""
        if self.kv_lora_rank:
            return 2 * self.num_heads * (self.head_dim + self.value_dim)
        return self.pair_flops()

    @property
    def dtype_bytes(self) -> int:
        return torch_dtype(self.dtype).itemsize

    @property
    def kv_dtype(self) -> torch.dtype:
        """What the KV cache holds each value in (``kv_cache_dtype``)."""
        return KV_CACHE_DTYPES[self.kv_cache_dtype] or torch_dtype(self.dtype)

    def is_sparse(self, layer: int) -> bool:
        """Whether ``layer``'s MLP is a mixture of experts."""
        return self.num_experts > 0 and layer not in self.dense_layers

    @property
    def sparse_layers(self) -> int:
        """How many layers' MLPs are mixtures of experts (read on every iteration's workspace)."""
        return self.num_layers - len(set(self.dense_layers)) if self.num_experts else 0

    def expert_params(self) -> int:
        """Parameters of one routed expert (gate, up and down projections, and their biases: gpt-oss's)."""
        return 3 * self.hidden_size * self.moe_intermediate_size + self._expert_biases

    @property
    def _expert_biases(self) -> int:
        return 2 * self.moe_intermediate_size + self.hidden_size if self.swiglu_limit is not None else 0

    def shared_expert_params(self) -> int:
        """Parameters of a sparse layer's shared experts and their gate (Qwen2-MoE's; DeepSeek's have none),
        0 without them."""
        s = self.shared_expert_intermediate_size
        return 3 * self.hidden_size * s + self.hidden_size * self.shared_expert_gate if s else 0

    def attention_params(self) -> int:
        """Parameters of one layer's attention: its projections, their biases, its norms and sinks."""
        h, heads = self.hidden_size, self.num_heads
        if self.kv_lora_rank:  # latent attention: attention_bias on the projections from the hidden state and o
            ql, r, rope, b = self.q_lora_rank, self.kv_lora_rank, self.qk_rope_head_dim, self.o_bias
            q = (h + b + 1) * ql + ql * heads * self.head_dim if ql else h * heads * self.head_dim
            kv = (h + b) * (r + rope) + r + r * heads * (self.qk_nope_head_dim + self.v_head_dim)
            return q + kv + heads * self.v_head_dim * h + b * h
        q, kv = heads * self.head_dim, self.num_kv_heads * self.head_dim
        whole = self.qk_norm_across_heads or self.qk_norm_head_weights  # a weight for every head's features
        qk_norms = (q + kv if whole else 2 * self.head_dim) * self.qk_norm
        return h * q * 2 + h * kv * 2 + (q + 2 * kv) * self.qkv_bias + h * self.o_bias + qk_norms + heads * self.attn_sinks

    def param_count(self, active: bool = False) -> int:
        """Every parameter; with ``active``, those one token passes through (a mixture of experts'
        ``experts_per_token`` of its experts per layer, and its router)."""
        h, i = self.hidden_size, self.intermediate_size
        norms = 1 if self.parallel_block else 4 if self.sandwich_norms and self.pre_norms else 2
        per_layer = self.attention_params() + norms * h
        experts = self.experts_per_token if active else self.num_experts
        sparse = self.sparse_layers
        router = (h + (self.swiglu_limit is not None)) * self.num_experts  # gpt-oss's has a bias
        mlp = (self.num_layers - sparse) * h * i * 3 + sparse * (experts * self.expert_params() + router
                                                                 + self.shared_expert_params())
        embed = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * per_layer + mlp + embed + h + (0 if active else self.encoder_params)

    def weight_bytes(self) -> int:
        """Bytes of the weights on the device (quantised when ``weight_bits`` is set; an encoder beside
        the decoder is held in ``dtype``, as quantised multimodal checkpoints leave their vision tower)."""
        if self.expert_weight_bits is None:
            return _bytes(self.param_count() - self.encoder_params, self._weight_bits) + self.encoder_bytes()
        matrices = self._expert_matrices()
        return (_bytes(self.param_count() - self.encoder_params - matrices, self._weight_bits)
                + math.ceil(matrices * self.expert_weight_bits / 8) + self.encoder_bytes())

    def _expert_matrices(self) -> int:
        """Every routed expert's matrices' parameters (their biases not counted)."""
        return self.sparse_layers * self.num_experts * 3 * self.hidden_size * self.moe_intermediate_size

    def encoder_bytes(self) -> int:
        """Bytes of the encoder held beside the decoder (of ``weight_bytes``): no text token reads them."""
        return self.encoder_params * self.dtype_bytes

    def routed_expert_bytes(self) -> int:
        """Bytes of every layer's routed experts, of ``weight_bytes`` (0 for a dense model)."""
        if self.expert_weight_bits is None:
            return _bytes(self.sparse_layers * self.num_experts * self.expert_params(), self._weight_bits)
        biases = self.sparse_layers * self.num_experts * self._expert_biases
        return math.ceil(self._expert_matrices() * self.expert_weight_bits / 8) + _bytes(biases, self._weight_bits)

    @property
    def _weight_bits(self) -> float:
        return self.weight_bits or 8 * self.dtype_bytes

    def kv_bytes_per_token(self) -> int:
        entries, heads, features = self.kv_layout
        return entries * self.num_layers * heads * features * self.kv_dtype.itemsize

    def workspace_bytes_per_token(self) -> int:
        """Peak activation bytes one batched token needs in a forward pass (residual, qkv, MLP, logits)."""
        h, i = self.hidden_size, self.intermediate_size
        if self.kv_lora_rank:  # the low-rank query, the queries, the latent and rotated key, the attention output
            attention = (self.q_lora_rank + self.num_heads * self.head_dim + self.kv_lora_rank + self.qk_rope_head_dim
                         + self.num_heads * self.v_head_dim)
        else:
            attention = (self.num_heads + 2 * self.num_kv_heads) * self.head_dim
        mlp = 3 * i if self.sparse_layers < self.num_layers else 0
        if self.num_experts:  # the router's logits and softmax; each pick's gate-up, product and
            # weighted output (at float32 in a 16-bit model), as vLLM's fused MoE holds them
            mlp = max(mlp, 3 * self.num_experts + self.experts_per_token * (3 * self.moe_intermediate_size + 2 * h)
                      + (3 * self.shared_expert_intermediate_size + 2 * h if self.shared_expert_intermediate_size else 0))
        return (3 * h + attention + mlp + self.vocab_size) * self.dtype_bytes

    def workspace_bytes(self, num_tokens: int, context_tokens: int) -> int:
        """Activation workspace of an iteration: per-token activations plus one layer's gathered KV."""
        return num_tokens * self.workspace_bytes_per_token() + context_tokens * (self.kv_bytes_per_token() // self.num_layers)


@dataclass(frozen=True)
class EngineConfig:
    """How the engine schedules and what memory it may use.

    ``num_blocks`` is the KV capacity: the blocks the engine may hold. ``device_bytes`` is the
    device's capacity on a CPU budget device (None: weights + workspace + full KV pool, so the
    engine alone never exhausts it); on CUDA the real device decides.
    """

    block_size: int = 16
    num_blocks: int = 1024
    segment_blocks: int = 64
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    max_model_len: int = 8192
    oom_mode: str = "crash"  # "crash" | "preempt"
    restart_downtime_s: float = 10.0
    overcommit: float = 1.0
    overcommit_step: float = 1.25  # scale up multiplies the factor by this, back off divides by it
    overcommit_min: float = 1.0
    overcommit_max: float = 4.0
    device_bytes: int | None = None
    host_bytes: int = 1 << 30
    seed: int = 0
    ttft_slo_s: float | None = None
    tpot_slo_s: float | None = None
    # a request still without its first token this long after it arrived is given up by its
    # client, and the engine drops it wherever it is (waiting, in its prefill, on the host), as vLLM
    # aborts a request whose client disconnected (None: clients wait for ever)
    client_timeout_s: float | None = None
    # admission: "overcommit" (peak demand within the factor x capacity) or "sglang" (SGLang's
    # adaptive reservation, below; the factor is not used). SGLang's documented defaults, by name:
    admission: str = "overcommit"
    sglang_init_new_token_ratio: float = 0.7         # SGLANG_INIT_NEW_TOKEN_RATIO
    sglang_min_new_token_ratio_factor: float = 0.14  # SGLANG_MIN_NEW_TOKEN_RATIO_FACTOR (of the initial ratio)
    sglang_new_token_ratio_decay_steps: int = 600    # SGLANG_NEW_TOKEN_RATIO_DECAY_STEPS
    sglang_clip_max_new_tokens: int = 4096           # SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION
    # which SGLang: "spec" (issue 9's rule: every request, new or running, charged the ratio of
    # what it may still generate; a retract takes the newest, requeued at the front, and puts the
    # ratio back to its initial value) or "code" (SGLang's PrefillAdder and retract_decode: the
    # request being admitted, and those admitted before it in the same iteration, charged their
    # clipped future in full, and a sum that reaches the capacity refused; a retract takes the
    # fewest output tokens, then the longest prompt, requeued at the back, with the ratio
    # re-estimated from those still running as min(1, (generated + steps x running) /
    # (max_tokens + 1)) and not decayed in that iteration; the ratio back to its initial value
    # whenever the engine falls idle)
    sglang_rule: str = "spec"
    sglang_retract_decode_steps: int = 20            # SGLANG_RETRACT_DECODE_STEPS
    # when a request's prompt takes its blocks: "whole" (at admission, all of them: the prompt's blocks
    # must be free now) or "chunk" (as each chunk is scheduled, as vLLM v1's ``allocate_slots`` takes
    # them: a request is admitted when its first chunk's blocks are free, and a later chunk that finds
    # none is a running sequence that cannot grow, an OOM event: a crash or a preemption)
    prompt_blocks: str = "whole"
    # a preempted (or retracted) request's KV at its readmission: "recomputed" (every token computed
    # again) or "cached" (kept: it takes its blocks again and computes only its last token, as if a
    # prefix cache had kept all of it: more than vLLM's prefix cache or SGLang's radix cache can keep,
    # which keep a block only while no other request takes it) or "lru" (as vLLM's prefix cache keeps
    # it: a preempted request's full blocks freed last first, free blocks handed out oldest first, and
    # readmitted it computes from the end of the prefix still cached: engine/kv_cache.py ``FreeOrder``);
    # both tensor-free only, and a crash loses it all
    preempted_kv: str = "recomputed"
    # a prefix cache, as vLLM's (on by default there) and SGLang's radix cache: a new request takes the full
    # blocks another request (or itself, before a preemption) computed of the same first tokens, shared
    # while both run and kept while free until the memory is needed (engine/block_manager.py)
    prefix_caching: bool = False

    def __post_init__(self) -> None:
        for name in ("block_size", "num_blocks", "segment_blocks", "max_num_seqs",
                     "max_num_batched_tokens", "max_model_len"):
            _count(name, getattr(self, name))
        _count("seed", self.seed, minimum=0)
        if self.device_bytes is not None:
            _count("device_bytes", self.device_bytes)
        if self.oom_mode not in ("crash", "preempt"):
            raise ValueError(f"oom_mode must be 'crash' or 'preempt', got {self.oom_mode!r}")
        if not (math.isfinite(self.restart_downtime_s) and self.restart_downtime_s >= 0):
            raise ValueError(f"restart_downtime_s must be a finite number of seconds >= 0, got {self.restart_downtime_s}")
        for name in ("ttft_slo_s", "tpot_slo_s"):
            value = getattr(self, name)
            if value is not None and not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a finite number of seconds > 0 (None: no target), got {value}")
        if not (0 < self.overcommit_min <= self.overcommit_max):
            raise ValueError(f"overcommit range [{self.overcommit_min}, {self.overcommit_max}] is empty or not positive")
        if not (self.overcommit_min <= self.overcommit <= self.overcommit_max or math.isinf(self.overcommit)):
            raise ValueError(f"overcommit {self.overcommit} is outside [{self.overcommit_min}, {self.overcommit_max}]")
        if not self.overcommit_step > 1:
            raise ValueError(f"overcommit_step must be a multiplier > 1, got {self.overcommit_step}")
        if self.client_timeout_s is not None and not (self.client_timeout_s > 0 and math.isfinite(self.client_timeout_s)):
            raise ValueError(f"client_timeout_s must be a finite number of seconds > 0 (None: clients wait for ever), "
                             f"got {self.client_timeout_s}")
        _count("host_bytes", self.host_bytes, minimum=0)
        if self.admission not in ("overcommit", "sglang"):
            raise ValueError(f"admission must be 'overcommit' or 'sglang', got {self.admission!r}")
        if not 0 < self.sglang_init_new_token_ratio <= 1 or not 0 < self.sglang_min_new_token_ratio_factor <= 1:
            raise ValueError("sglang_init_new_token_ratio and sglang_min_new_token_ratio_factor must be in (0, 1]")
        if self.sglang_new_token_ratio_decay_steps <= 0 or self.sglang_clip_max_new_tokens <= 0:
            raise ValueError("sglang_new_token_ratio_decay_steps and sglang_clip_max_new_tokens must be > 0")
        if self.sglang_rule not in ("spec", "code"):
            raise ValueError(f"sglang_rule must be 'spec' or 'code', got {self.sglang_rule!r}")
        if self.prompt_blocks not in ("whole", "chunk"):
            raise ValueError(f"prompt_blocks must be 'whole' or 'chunk', got {self.prompt_blocks!r}")
        if self.preempted_kv not in ("recomputed", "cached", "lru"):
            raise ValueError(f"preempted_kv must be 'recomputed', 'cached' or 'lru', got {self.preempted_kv!r}")
        if not isinstance(self.prefix_caching, bool):
            raise ValueError(f"prefix_caching must be true or false, got {self.prefix_caching!r}")
        if self.prefix_caching and self.preempted_kv != "recomputed":
            raise ValueError(f"preempted_kv {self.preempted_kv!r} models what a prefix cache keeps of a preempted "
                             f"request; with prefix_caching the cache keeps it itself: leave preempted_kv 'recomputed'")
        if self.sglang_retract_decode_steps < 0:
            raise ValueError(f"sglang_retract_decode_steps must be >= 0, got {self.sglang_retract_decode_steps}")

    def pinned(self, factor: float) -> "EngineConfig":
        """This configuration at a fixed ``factor``, its range widened to admit it (a static policy)."""
        return replace(self, overcommit=factor, overcommit_min=min(self.overcommit_min, factor),
                       overcommit_max=max(self.overcommit_max, factor))


def max_model_len(model: ModelConfig, cfg: EngineConfig) -> int:
    """The longest sequence the engine serves: as in vLLM, no sequence may outgrow the KV cache, so
    every request can run alone."""
    return min(cfg.max_model_len, model.max_position, cfg.num_blocks * cfg.block_size)


@dataclass(frozen=True)
class MemoryPlan:
    """What an engine needs on its device at most: weights, a full batch's activation workspace and
    its whole KV capacity (every block it may hold)."""

    weights: int
    workspace: int
    kv: int

    @property
    def total(self) -> int:
        return self.weights + self.workspace + self.kv


def memory_plan(model: ModelConfig, cfg: EngineConfig, weight_bytes: int | None = None,
                workspace: int | None = None) -> MemoryPlan:
    """The engine's memory; ``weight_bytes`` the loaded model's own (default: the config's count),
    ``workspace`` its executor's largest (default: a fused attention kernel's, for a full batch
    reading the whole pool)."""
    if workspace is None:
        workspace = model.workspace_bytes(cfg.max_num_batched_tokens, cfg.num_blocks * cfg.block_size)
    weights = model.weight_bytes() if weight_bytes is None else weight_bytes
    return MemoryPlan(weights, workspace, cfg.num_blocks * cfg.block_size * model.kv_bytes_per_token())


def kv_blocks_within(model: ModelConfig, cfg: EngineConfig, limit_bytes: int, weight_bytes: int | None = None,
                     workspace: Callable[[EngineConfig], int] | None = None) -> int:
    """The most KV blocks an engine can hold within a memory limit of ``limit_bytes`` (an MPS
    client's pinned-memory limit): ``memory_plan`` solved for ``num_blocks``, so that weights, a
    full batch's workspace and every block fit the limit. ``workspace``: the engine's executor's
    largest workspace for a configuration (``max_workspace_bytes``; default: a fused attention
    kernel's, as ``memory_plan``'s). 0 when the weights and workspace alone do not fit."""
    weights = model.weight_bytes() if weight_bytes is None else weight_bytes
    tokens_bytes = model.workspace_bytes(cfg.max_num_batched_tokens, 0)
    per_block = cfg.block_size * (model.kv_bytes_per_token() + model.kv_bytes_per_token() // model.num_layers)
    blocks = max((limit_bytes - weights - tokens_bytes) // per_block, 0)
    if workspace is not None:  # an executor's workspace shrinks with the blocks, if at all: this many is an upper bound
        taken = weights + workspace(replace(cfg, num_blocks=blocks))
        blocks = min(blocks, max((limit_bytes - taken) // (cfg.block_size * model.kv_bytes_per_token()), 0))
    return blocks
