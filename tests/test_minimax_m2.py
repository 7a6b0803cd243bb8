"""MiniMax-M2 (``minimax_m2``: M2, M2.1) checkpoints: the engine generates what transformers generates from the
same directory (Mixtral's layers with one RMSNorm over all of q's heads' features and one over k's, RoPE over the
first ``rotary_dim`` features of each head, experts picked by sigmoid scores plus a learned bias and weighed by
those scores renormalised); its FP8 release's layout (experts stored one tensor each in 8-bit floats, the router
not) loads as its values times their scales; its multi-token-prediction layers are skipped as vLLM skips them; and
its published configuration is read and counted as transformers builds it."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import assert_generates_as, drawn_apart, hf_greedy, hf_tiny
from engine.checkpoint import CheckpointError, load_checkpoint, read_config, read_sizes
from engine.model import GroupedMoE
from engine.roofline import deployment
from test_float8 import fp8_block, quantised
from test_glm import rotating_whole_heads
from test_gpt_oss import generate
from test_moe import prompts

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

MINIMAX = dict(head_dim=16, num_local_experts=8, num_experts_per_tok=2, intermediate_size=24, rotary_dim=8)


def hf_minimax(dtype: torch.dtype = torch.float32):
    """A tiny MiniMax-M2 whose routers, correction biases and norms are drawn far from their initial values, so
    that a wrong pick, weight, norm or rotation changes the tokens."""
    return drawn_apart(hf_tiny("MiniMaxM2", **MINIMAX), mlp_scale=2).to(dtype)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_minimax_m2_checkpoint_generates_what_transformers_generates(tmp_path, dtype):
    hf = hf_minimax(getattr(torch, dtype))
    hf.save_pretrained(tmp_path)
    saved = load_file(str(tmp_path / "model.safetensors"))
    assert "model.layers.0.block_sparse_moe.e_score_correction_bias" in saved  # the release's names, as saved
    assert "model.layers.0.block_sparse_moe.experts.7.w3.weight" in saved
    model = load_checkpoint(tmp_path)
    mc = model.config
    assert (mc.rotary_dim, mc.qk_norm, mc.qk_norm_across_heads, mc.pre_norms, mc.sandwich_norms) == (8, True, True,
                                                                                                     True, False)
    assert (mc.router, mc.expert_groups, mc.topk_groups, mc.routed_scaling, mc.norm_topk_prob) == (
        "sigmoid_groups", 1, 1, 1.0, True)
    assert (mc.num_experts, mc.experts_per_token, mc.moe_intermediate_size, mc.dense_layers) == (8, 2, 24, ())
    assert mc.param_count() == hf.num_parameters()
    assert all(isinstance(layer.mlp, GroupedMoE) for layer in model.model.layers)
    ps = prompts([13, 30, 21])
    outputs = generate(model, ps)
    assert len({t for o in outputs for t in o}) > 8
    assert_generates_as(hf, ps, outputs, exact=dtype == "float32")
    if dtype == "float32":  # the bias picks experts, and only the first rotary_dim features rotate
        unbiased = load_checkpoint(tmp_path)
        for layer in unbiased.model.layers:
            layer.mlp.gate.e_score_correction_bias.zero_()
        assert generate(unbiased, ps) != outputs
        assert rotating_whole_heads(tmp_path, ps) != outputs


def test_its_multi_token_prediction_layers_are_skipped_and_a_layer_past_them_is_refused(tmp_path):
    # the release holds num_mtp_modules layers after the decoder's, which vLLM skips; one past them has no place
    hf = hf_minimax()
    hf.save_pretrained(tmp_path)
    ps = prompts([13, 30])
    outputs = generate(load_checkpoint(tmp_path), ps)
    state = load_file(str(tmp_path / "model.safetensors"))
    extra = {k.replace("layers.2.", "layers.3."): v.clone() for k, v in state.items() if ".layers.2." in k}
    save_file({**state, **extra}, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"'model\.layers\.3\..*' has no place in the model"):
        load_checkpoint(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "num_mtp_modules": 1, "use_mtp": True}))
    assert generate(load_checkpoint(tmp_path), ps) == outputs
    save_file({**state, **extra, **{k.replace("layers.3.", "layers.4."): v.clone() for k, v in extra.items()}},
              str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"'model\.layers\.4\..*' has no place in the model"):
        load_checkpoint(tmp_path)


def test_its_fp8_release_layout_loads_as_its_values_times_their_scales(tmp_path):
    # MiniMax-M2 is published in FP8 with a scale each 128 x 128 block, each expert's w1, w2 and w3 on its own, the
    # router and its bias unquantised (modules_to_not_convert): here in blocks of 8 x 8
    hf = hf_minimax()
    hf.save_pretrained(tmp_path)
    state, expected = quantised(load_file(str(tmp_path / "model.safetensors")), (8, 8))
    assert any(".experts.3.w2.weight" in k for k in expected) and not any(".gate." in k for k in expected)
    save_file(state, str(tmp_path / "model.safetensors"))
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "quantization_config": {
        **fp8_block((8, 8)), "modules_to_not_convert": ["gate", "e_score_correction_bias", "lm_head"]}}))
    model = load_checkpoint(tmp_path)
    experts = model.model.layers[1].mlp.experts
    block = "model.layers.1.block_sparse_moe.experts"
    for e in range(8):
        assert torch.equal(experts.gate_up_proj[e], torch.cat((expected[f"{block}.{e}.w1.weight"],
                                                               expected[f"{block}.{e}.w3.weight"])))
        assert torch.equal(experts.down_proj[e], expected[f"{block}.{e}.w2.weight"])
    # and it generates what transformers generates from those values
    held = hf.state_dict()
    with torch.no_grad():
        for key, w in expected.items():
            name = key.replace("block_sparse_moe", "mlp")
            if name in held:
                held[name].copy_(w)
        for e in range(8):  # transformers 5 holds each layer's experts stacked, gate and up as one
            for layer in range(3):
                at = f"model.layers.{layer}.block_sparse_moe.experts.{e}"
                held[f"model.layers.{layer}.mlp.experts.gate_up_proj"][e] = torch.cat(
                    (expected[f"{at}.w1.weight"], expected[f"{at}.w3.weight"]))
                held[f"model.layers.{layer}.mlp.experts.down_proj"][e] = expected[f"{at}.w2.weight"]
    ps = prompts([13, 30])
    assert generate(model, ps) == [hf_greedy(hf, p, 12) for p in ps]


# MiniMax-M2's config.json as published (its FP8 release), where it differs from transformers' defaults or names
# a field of its own
PUBLISHED = {"architectures": ["MiniMaxM2ForCausalLM"], "model_type": "minimax_m2", "attn_type_list": [1] * 62,
             "head_dim": 128, "hidden_act": "silu", "hidden_size": 3072, "intermediate_size": 1536,
             "max_position_embeddings": 196_608, "mtp_transformer_layers": 1, "num_attention_heads": 48,
             "num_experts_per_tok": 8, "num_hidden_layers": 62, "num_key_value_heads": 8, "num_local_experts": 256,
             "num_mtp_modules": 3, "qk_norm_type": "per_layer", "rms_norm_eps": 1e-06, "rope_theta": 5_000_000,
             "rotary_dim": 64, "scoring_func": "sigmoid", "shared_intermediate_size": 0, "tie_word_embeddings": False,
             "use_mtp": True, "use_qk_norm": True, "use_routing_bias": True, "vocab_size": 200_064,
             "torch_dtype": "bfloat16",
             "quantization_config": {"activation_scheme": "dynamic", "fmt": "float8_e4m3fn", "quant_method": "fp8",
                                     "weight_block_size": [128, 128],
                                     "modules_to_not_convert": ["gate", "e_score_correction_bias", "lm_head"]}}


def test_the_published_configuration_is_read_and_counted_as_transformers_builds_it(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(PUBLISHED))
    mc = read_config(tmp_path)
    assert (mc.rotary_dim, mc.rope_theta, mc.window_layers, mc.num_experts, mc.router) == (
        64, 5_000_000.0, (), 256, "sigmoid_groups")
    m, notes = read_sizes(tmp_path)
    with torch.device("meta"):
        built = transformers.MiniMaxM2ForCausalLM(transformers.MiniMaxM2Config(
            **{k: v for k, v in PUBLISHED.items() if k not in ("quantization_config", "torch_dtype")}))
    # 228.7B, 9.8B of them active besides the embeddings and the head (MiniMax's "230B, 10B active")
    assert m.param_count() == built.num_parameters() == 228_689_748_992
    assert 9.7e9 < m.param_count(active=True) - 2 * m.vocab_size * m.hidden_size < 9.9e9
    assert m.kv_bytes_per_token() == 2 * 62 * 8 * 128 * 2  # K and V of its 8 KV heads, every layer, bf16
    with pytest.raises(ValueError, match="the weights take 228.7 GB"):  # its FP8 weights fit no one GPU here
        deployment(f"{tmp_path}@h200")
