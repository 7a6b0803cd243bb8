"""GLM-4.5 (``glm4_moe``) and GLM-4 (``glm4``) checkpoints and partial RoPE: the engine generates what
transformers generates from the same directory (GLM-4.5: DeepSeek-V3's grouped routing and shared experts around
Llama's attention with biases on q, k and v, Qwen3's q and k norms where ``use_qk_norm``, RoPE over the first half
of each head; GLM-4: norms on each sublayer's output too, gate and up in one tensor, RoPE over half of each head
with its pairs interleaved); Phi-3's partial RoPE too, and the share rotated is read from config.json; a
deployment counts what GLM-4.5-Air holds."""
from __future__ import annotations

import json

import pytest
import torch

from conftest import assert_greedy_up_to_rounding, drawn_apart, hf_greedy, hf_tiny
from engine.checkpoint import CheckpointError, load_checkpoint, read_sizes
from engine.config import ModelConfig
from engine.model import GroupedMoE
from engine.roofline import deployment
from experiments import CHECKPOINTS
from test_gpt_oss import generate
from test_moe import prompts

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

GLM = dict(head_dim=16, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=24,
           first_k_dense_replace=1, n_group=4, topk_group=2, routed_scaling_factor=2.5, attention_bias=True,
           rope_theta=100.0, rms_norm_eps=1e-5)


def hf_glm(dtype: torch.dtype = torch.float32, **extra):
    """A tiny GLM-4.5 whose routers, correction biases, norms, attention biases and experts are drawn far
    from their initial values, so that a wrong pick, weight, norm or rotation changes the tokens (biases
    kept small: larger ones drive this tiny model to repeat one token, which would hide a difference)."""
    return drawn_apart(hf_tiny("Glm4Moe", **{**GLM, **extra}), mlp_scale=2, bias_std=0.05).to(dtype)


@pytest.mark.parametrize("qk_norm", [False, True])
def test_a_glm4_moe_checkpoint_generates_what_transformers_generates(tmp_path, qk_norm):
    hf = hf_glm(use_qk_norm=qk_norm)
    hf.save_pretrained(tmp_path)
    model = load_checkpoint(tmp_path)
    mc = model.config
    assert (mc.rotary_dim, mc.qkv_bias, mc.o_bias, mc.qk_norm) == (8, True, False, qk_norm)
    assert (mc.router, mc.expert_groups, mc.topk_groups, mc.routed_scaling, mc.dense_layers) == (
        "sigmoid_groups", 4, 2, 2.5, (0,))
    assert mc.param_count() == hf.num_parameters()
    assert isinstance(model.model.layers[1].mlp, GroupedMoE)
    ps = prompts([13, 30, 21])
    outputs = generate(model, ps)
    assert len({t for o in outputs for t in o}) > 8
    assert outputs == [hf_greedy(hf, p, 12) for p in ps]
    assert rotating_whole_heads(tmp_path, ps) != outputs


def rotating_whole_heads(directory, ps: list[list[int]]) -> list[list[int]]:
    """What the checkpoint in ``directory`` generates with its config.json's partial_rotary_factor set to 1."""
    cfg = json.loads((directory / "config.json").read_text())
    cfg.pop("partial_rotary_factor", None)
    cfg["rope_parameters"] = {**cfg["rope_parameters"], "partial_rotary_factor": 1.0}
    (directory / "config.json").write_text(json.dumps(cfg))
    return generate(load_checkpoint(directory), ps)


def test_a_bf16_glm4_moe_checkpoint_generates_what_transformers_generates_up_to_rounding(tmp_path):
    hf = hf_glm(torch.bfloat16, use_qk_norm=True)
    hf.save_pretrained(tmp_path)
    model = load_checkpoint(tmp_path)
    for p, tokens in zip(prompts([13, 30]), generate(model, prompts([13, 30]))):
        assert_greedy_up_to_rounding(hf, p, tokens)


def test_a_phi3_checkpoint_rotates_the_share_of_each_head_its_config_says(tmp_path):
    # Phi-4-mini rotates three quarters of each head; its checkpoints' config.json writes the share
    hf = hf_tiny("Phi3", partial_rotary_factor=0.5, head_dim=8, rope_theta=100.0)
    with torch.no_grad():
        hf.model.layers.apply(lambda m: m.qkv_proj.weight.mul_(2) if hasattr(m, "qkv_proj") else None)
    hf.save_pretrained(tmp_path)
    model = load_checkpoint(tmp_path)
    assert model.config.rotary_dim == 4
    ps = prompts([13, 30, 21])
    expected = [hf_greedy(hf, p, 12) for p in ps]
    assert generate(model, ps) == expected
    assert len({t for o in expected for t in o}) > 8
    # the same weights rotating whole heads generate something else: the share is read, not assumed
    assert rotating_whole_heads(tmp_path, ps) != expected


def test_partial_rope_rotates_the_share_transformers_rounds_down_to():
    # 0.4 of a 16-feature head: 6.4, of which transformers (and this engine) rotate 6
    assert ModelConfig(hidden_size=64, num_heads=4, num_kv_heads=2, explicit_head_dim=16, partial_rotary=0.4).rotary_dim == 6


def test_partial_rope_is_refused_where_transformers_rotates_whole_heads_and_a_bad_share_by_name(tmp_path):
    hf = hf_tiny("Llama")
    hf.save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "partial_rotary_factor": 0.5}))
    with pytest.raises(CheckpointError, match="partial_rotary_factor 0.5 is not supported for llama"):
        load_checkpoint(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "model_type": "phi3", "partial_rotary_factor": 1.5}))
    with pytest.raises(CheckpointError, match=r"partial_rotary_factor must be a number in \(0, 1\], got 1.5"):
        load_checkpoint(tmp_path)


def test_shipped_glm_4_5_air_counts_what_the_published_checkpoint_holds(tmp_path):
    m = read_sizes(CHECKPOINTS / "GLM-4.5-Air")[0]
    with torch.device("meta"):
        built = transformers.AutoModelForCausalLM.from_config(
            transformers.AutoConfig.from_pretrained(CHECKPOINTS / "GLM-4.5-Air"))
    # Zhipu's 106B, 12B of them active besides the embeddings and the head, as transformers builds them
    assert m.param_count() == built.num_parameters() == 106_852_245_504
    assert 12.1e9 < m.param_count(active=True) - 2 * m.vocab_size * m.hidden_size < 12.3e9
    assert m.kv_bytes_per_token() == 2 * 46 * 8 * 128 * 2  # K and V of its 8 KV heads, every layer, bf16
    # 214 GB of bf16 weights fit no one GPU here; its FP8 release fits an H200 with 80,432 tokens of KV
    with pytest.raises(ValueError, match="GLM-4.5-Air@h200: the weights take 213.7 GB"):
        deployment("GLM-4.5-Air@h200")
    cfg = json.loads((CHECKPOINTS / "GLM-4.5-Air" / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "quantization_config": {
        "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}}))
    fp8 = deployment(f"{tmp_path}@h200")
    assert fp8.num_blocks() * fp8.block_size == 80_432 and "106.9B params (13.4B active) at 8 bits" in fp8.describe()


def test_a_glm4_checkpoint_generates_what_transformers_generates(tmp_path):
    hf = hf_tiny("Glm4", head_dim=16, rope_theta=100.0)
    with torch.no_grad():
        for key, p in hf.named_parameters():
            if key.endswith("norm.weight"):  # its four norms a layer, each drawn apart
                p.normal_(1.0, 0.3)
            elif key.endswith(("q_proj.weight", "k_proj.weight")):
                p.mul_(2)  # scores far from uniform, so that a wrong rotation shows
    hf.save_pretrained(tmp_path)
    model = load_checkpoint(tmp_path)
    mc = model.config
    assert (mc.rotary_dim, mc.rope_interleaved, mc.sandwich_norms, mc.qkv_bias, mc.o_bias) == (8, True, True, True, False)
    assert mc.param_count() == hf.num_parameters()
    ps = prompts([13, 30, 21])
    outputs = generate(model, ps)
    assert len({t for o in outputs for t in o}) > 8
    assert outputs == [hf_greedy(hf, p, 12) for p in ps]
    for layer in model.model.layers:  # its pairs rotated as rotate-half's would be: other tokens
        layer.self_attn.interleaved = False
    assert generate(model, ps) != outputs
