"""RoPE stays exact in bf16 and fp16: frequencies, angles and cos/sin in float32, as transformers
computes them, so that the engine generates what transformers generates at long positions; and
scaled RoPE (linear, Llama 3.1's) is transformers' to the bit, from a checkpoint's config.json."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from conftest import hf_greedy
from engine.checkpoint import load_checkpoint
from engine.config import EngineConfig, ModelConfig, RopeScaling, torch_dtype
from engine.engine import Engine
from engine.model import LlamaModel
from engine.request import Request
from rlctl.bench.engine import hf_rope_scaling, hf_twin

pytest.importorskip("transformers")

DTYPES = ["bfloat16", "float16"]


def small(dtype: str, **fields) -> ModelConfig:
    return ModelConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                       num_kv_heads=2, max_position=4096, dtype=dtype, **fields)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_frequencies_and_cos_sin_are_transformers_float32_values(dtype):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    cfg = small(dtype)
    model = LlamaModel.from_seed(cfg, seed=0)
    ref = LlamaRotaryEmbedding(LlamaConfig(hidden_size=cfg.hidden_size, num_attention_heads=cfg.num_heads,
                                           rope_theta=cfg.rope_theta, max_position_embeddings=cfg.max_position))
    assert ref.inv_freq.dtype == torch.float32
    assert model.rotary.inv_freq.dtype == torch.float32
    assert torch.equal(model.rotary.inv_freq, ref.inv_freq)

    positions = torch.arange(0, 4096, 7)
    x = torch.zeros(1, dtype=torch_dtype(dtype))
    cos, signed_sin = model.rotary(positions, x.dtype)
    ref_cos, ref_sin = ref(x, positions[None])
    half = cfg.head_dim // 2
    assert cos.dtype == ref_cos.dtype == x.dtype
    assert torch.equal(cos[:, 0], ref_cos[0])
    assert torch.equal(torch.cat((-signed_sin[:, 0, :half], signed_sin[:, 0, half:]), dim=-1), ref_sin[0])


def test_dtype_casts_keep_rope_frequencies_float32_and_device_moves_take_them_along():
    model = LlamaModel.from_seed(small("float32"), seed=0)
    exact = model.rotary.inv_freq.clone()
    for cast in (lambda m: m.to(torch.bfloat16), lambda m: m.half(), lambda m: m.to(device="cpu", dtype=torch.float16)):
        assert torch.equal(cast(model).rotary.inv_freq, exact)
    assert model.to("meta").rotary.inv_freq.device.type == "meta"


def test_gemma_2_logits_in_bf16_are_transformers_to_the_bit():
    # the embedding scale rounded to bf16 before it multiplies, the norms' 1 + weight taken in float32
    # before the cast, the soft caps: each done in Llama's order instead moves bf16 logits by ~0.06
    cfg = replace(small("bfloat16", **GEMMA2), hidden_size=48)  # sqrt(48) is not a bf16 number, as sqrt(64) is
    model = sharpened(cfg, seed=0)
    with torch.no_grad():
        for name, weight in model.state_dict().items():
            if name.endswith("norm.weight"):
                weight.uniform_(-0.8, 2.0)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist() for n in (37, 61)]
    seen = []
    model.register_forward_hook(lambda module, args, out: seen.append(out))
    hf = hf_twin(model)
    for p in prompts:  # each alone, in chunks of 16 tokens; its last chunk's last row is the first logits
        seen.clear()
        eng = Engine(cfg, EngineConfig(num_blocks=64, block_size=4, max_model_len=512, max_num_batched_tokens=16),
                     model=model, keep_outputs=True)
        eng.submit(Request("r", 0.0, len(p), 4, 4, prompt_ids=tuple(p)))
        eng.run()
        with torch.no_grad():
            assert torch.equal(next(out for out in seen if len(out))[0], hf(torch.tensor([p])).logits[0, -1])


def sharpened(cfg: ModelConfig, seed: int) -> LlamaModel:
    """A random model whose attention depends on position. With Llama's initialiser (std 0.02)
    scores are ~0 and attention is near uniform, so even a rounded inv_freq left the tokens alone;
    with q and k 32x larger it changes most of them (seed 0: 10-11 of 12 in bf16, 7-11 in fp16)
    while the exact engine matches transformers at seeds 0-2 in both dtypes. Powers of two scale
    exactly in every dtype."""
    model = LlamaModel.from_seed(cfg, seed)
    with torch.no_grad():
        for name, weight in model.state_dict().items():  # views of the parameters
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                weight.mul_(32)
            elif name == "lm_head.weight":
                weight.mul_(16)  # logits far apart: argmax decided by the model, not by rounding
    return model


GEMMA = {"activation": "gelu_tanh", "norm_offset": True, "embed_scale": True, "explicit_head_dim": 24}
GEMMA2 = {**GEMMA, "sandwich_norms": True, "query_scale": 20 ** -0.5, "attn_softcap": 50.0, "logit_softcap": 30.0,
          "sliding_window": 600, "window_layers": (0,)}
ARCHS = {"llama": {}, "qwen2": {"qkv_bias": True}, "qwen3": {"qk_norm": True, "explicit_head_dim": 24},
         "gemma": GEMMA, "gemma2": GEMMA2,
         "gemma3": {**GEMMA2, "attn_softcap": None, "logit_softcap": None, "qk_norm": True, "local_rope_theta": 1000.0}}


@pytest.mark.parametrize("dtype, arch", [(d, "llama") for d in DTYPES]
                         + [("bfloat16", a) for a in ("qwen2", "qwen3", "gemma", "gemma2", "gemma3")])
def test_long_prompts_in_low_precision_generate_what_transformers_generates(dtype, arch):
    # Qwen2's q, k and v biases go into the stacked projection's GEMM, Qwen3's per-head norms
    # between it and RoPE; Gemma's scaled embeddings and norms by 1 + weight, Gemma 2's soft caps and
    # window (a layer of two), Gemma 3's windowed layer's own RoPE: rounded as transformers rounds them
    cfg, new_tokens = small(dtype, **ARCHS[arch]), 12
    model = sharpened(cfg, seed=0)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist() for n in (1100, 1337)]
    # chunked prefill: each prompt goes in chunks of at most 512 tokens
    eng = Engine(cfg, EngineConfig(num_blocks=256, max_model_len=2048, max_num_batched_tokens=512),
                 model=model, keep_outputs=True)
    for i, p in enumerate(prompts):
        eng.submit(Request(f"r{i}", 0.0, len(p), new_tokens, new_tokens, prompt_ids=tuple(p)))
    eng.run()

    hf = hf_twin(model)
    rope = hf.model.rotary_emb  # a twin with the same bug would agree
    assert getattr(rope, "inv_freq", getattr(rope, "full_attention_inv_freq", None)).dtype == torch.float32
    assert next(hf.parameters()).dtype == torch_dtype(dtype)
    for i, p in enumerate(prompts):
        assert eng.outputs[f"r{i}"] == hf_greedy(hf, p, new_tokens), f"r{i} differs"


# YaRN's ramp with both ends at dimension 0 (both rounded and clipped there): transformers moves one by
# 0.001, where 0 / 0 would make that frequency NaN
ENDS_MEET = RopeScaling("yarn", 2.0, original_max_position=64, beta_fast=32.0, beta_slow=20.0)
SCALINGS = [RopeScaling("linear", 4.0),
            # wavelengths 2*pi*50000**(k/16): below 64/4, between 64/4 and 64/1 and above it, so that
            # every branch of Llama 3.1's rule is taken
            RopeScaling("llama3", 8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position=64),
            # YaRN as Qwen's checkpoints write it (the range's ends rounded out, the attention factor
            # derived from the factor) and as gpt-oss's (not rounded, betas and an attention factor given)
            RopeScaling("yarn", 4.0, original_max_position=64),
            RopeScaling("yarn", 8.0, original_max_position=512, beta_fast=16.0, beta_slow=2.0, truncate=False,
                        attention_factor=1.3),
            ENDS_MEET]


@pytest.mark.parametrize("scaling", SCALINGS, ids=lambda s: s.kind)
def test_scaled_rope_frequencies_are_transformers_values(scaling):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    cfg = replace(small("float32"), rope_theta=50000.0, rope_scaling=scaling)
    model = LlamaModel.from_seed(cfg, seed=0)
    ref = LlamaRotaryEmbedding(LlamaConfig(hidden_size=cfg.hidden_size, num_attention_heads=cfg.num_heads,
                                           rope_theta=cfg.rope_theta, max_position_embeddings=cfg.max_position,
                                           rope_scaling=hf_rope_scaling(scaling)))
    plain = LlamaModel.from_seed(replace(cfg, rope_scaling=None), seed=0).rotary.inv_freq
    assert torch.equal(model.rotary.inv_freq, ref.inv_freq)
    assert model.rotary.cos_scale == ref.attention_scaling  # YaRN's scale on cos and sin; 1 for the others
    kept, divided = model.rotary.inv_freq == plain, torch.isclose(model.rotary.inv_freq, plain / scaling.factor,
                                                                   rtol=1e-6, atol=0)
    if scaling.kind == "linear":
        assert divided.all()
    elif scaling == ENDS_MEET:  # no middle: the first kept, the others divided
        assert kept[0] and divided[1:].all()
    else:  # the short wavelengths kept, the long ones divided, the middle blended
        assert kept.any() and divided.any() and (~kept & ~divided).any()


@pytest.mark.parametrize("scaling", SCALINGS, ids=lambda s: s.kind)
def test_a_scaled_rope_checkpoint_generates_what_transformers_generates(tmp_path, scaling):
    cfg = replace(small("float32"), rope_theta=50000.0, rope_scaling=scaling)
    model = sharpened(cfg, seed=0)
    hf_twin(model).save_pretrained(tmp_path)  # a checkpoint as transformers writes it, rope_parameters and all
    loaded = load_checkpoint(tmp_path)
    assert loaded.config.rope_scaling == scaling
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist() for n in (150, 300)]
    outputs = {}
    for name, m in (("scaled", loaded), ("unscaled", sharpened(replace(cfg, rope_scaling=None), seed=0))):
        eng = Engine(m.config, EngineConfig(num_blocks=64, max_model_len=512, max_num_batched_tokens=128),
                     model=m, keep_outputs=True)
        for i, p in enumerate(prompts):
            eng.submit(Request(f"r{i}", 0.0, len(p), 12, 12, prompt_ids=tuple(p)))
        eng.run()
        outputs[name] = [eng.outputs[f"r{i}"] for i in range(len(prompts))]
    hf = hf_twin(loaded)
    assert outputs["scaled"] == [hf_greedy(hf, p, 12) for p in prompts]
    assert outputs["unscaled"] != outputs["scaled"]  # the scaling changes what is generated: the test can fail
