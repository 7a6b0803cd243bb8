"""Mistral 4 checkpoints (``mistral4``, alone or as Mistral 3's text model beside its Pixtral tower): the engine
generates what transformers generates from the same directory (DeepSeek-V3's latent attention, YaRN folded into
its scores' scale, experts picked by their softmax scores within groups, no bias, beside shared experts; every
layer's queries scaled by position as Ministral 3's are), and its sizes are counted as transformers builds them."""
from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from conftest import assert_generates_as, drawn_apart, hf_greedy, hf_tiny
from engine.checkpoint import load_checkpoint, read_config, read_sizes
from engine.model import GroupedMoE, LatentAttention, LlamaModel
from test_gpt_oss import generate
from test_moe import prompts

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

# latent attention needs as many KV heads as heads in transformers' Mistral 4
MISTRAL4 = dict(num_key_value_heads=6, kv_lora_rank=16, q_lora_rank=24, qk_nope_head_dim=8, qk_rope_head_dim=8,
                v_head_dim=8, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=24,
                first_k_dense_replace=1, routed_scaling_factor=2.5, max_position_embeddings=512)
# YaRN and the query scaling over an original context of 8 tokens, so that the prompts reach both
ROPE = dict(rope_type="yarn", rope_theta=100.0, factor=4.0, original_max_position_embeddings=8, beta_fast=32.0,
            beta_slow=1.0, mscale_all_dim=1.0, mscale=1.0, llama_4_scaling_beta=0.5)


def hf_mistral4(dtype: torch.dtype = torch.float32, **extra):
    """A tiny Mistral 4, its routers and norms drawn apart and its queries' and keys' up-projections weighing
    four times as much: scores far from uniform, so that the queries' scaling shows in the tokens."""
    hf = drawn_apart(hf_tiny("Mistral4", **{**MISTRAL4, "rope_parameters": ROPE, **extra}), mlp_scale=2)
    with torch.no_grad():
        for key, p in hf.named_parameters():
            if key.endswith(("q_b_proj.weight", "kv_b_proj.weight")):
                p.mul_(4)
    return hf.to(dtype)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_mistral4_checkpoint_generates_what_transformers_generates(tmp_path, dtype):
    hf = hf_mistral4(getattr(torch, dtype))
    hf.save_pretrained(tmp_path)
    model = load_checkpoint(tmp_path)
    mc = model.config
    assert (mc.kv_lora_rank, mc.router, mc.expert_groups, mc.routed_scaling, mc.dense_layers) == (
        16, "softmax_groups", 1, 2.5, (0,))
    assert (mc.rope_scaling.kind, mc.attn_temperature, mc.attn_temperature_every_layer) == ("yarn", (8.0, 0.5), True)
    assert isinstance(model.model.layers[0].self_attn, LatentAttention) and isinstance(model.model.layers[1].mlp, GroupedMoE)
    assert mc.param_count() == hf.num_parameters()
    ps = prompts([13, 30, 21])
    outputs = generate(model, ps)
    assert len({t for o in outputs for t in o}) > 8
    assert_generates_as(hf, ps, outputs, exact=dtype == "float32")
    if dtype == "float32":  # without the queries' scaling the tokens differ
        other = LlamaModel(replace(mc, attn_temperature=None, attn_temperature_every_layer=False))
        other.load_state_dict(model.state_dict())
        assert generate(other.eval(), ps) != outputs


def test_a_mistral3_checkpoint_with_a_mistral4_text_model_runs_it(tmp_path):
    text = hf_mistral4().config.to_dict()
    vision = dict(hidden_size=32, intermediate_size=40, num_hidden_layers=2, num_attention_heads=2, head_dim=16,
                  image_size=32, patch_size=8)
    torch.manual_seed(0)
    hf = transformers.Mistral3ForConditionalGeneration(transformers.Mistral3Config(
        text_config=text, vision_config=vision, image_token_index=299, tie_word_embeddings=False)).eval()
    drawn_apart(hf, mlp_scale=2).save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["text_config"]["model_type"] == "mistral4"
    model = load_checkpoint(tmp_path)
    assert model.config.kv_lora_rank == 16 and model.config.attn_temperature == (8.0, 0.5)
    assert read_sizes(tmp_path)[0].param_count() == hf.num_parameters()
    ps = prompts([13, 30])
    assert generate(model, ps) == [hf_greedy(hf, p, 12) for p in ps]


def test_mistral4_takes_transformers_defaults_and_is_sized_as_transformers_builds_it(tmp_path):
    # transformers' Mistral4Config: YaRN (factor 128 over 8,192 tokens) with the queries' scaling where config.json
    # gives no RoPE; its latent KV is 256 + 64 features a token and layer
    cfg = transformers.Mistral4Config()
    fields = {**cfg.to_dict(), "torch_dtype": "bfloat16"}
    del fields["rope_parameters"]
    (tmp_path / "config.json").write_text(json.dumps(fields))
    mc = read_config(tmp_path)
    assert (mc.rope_scaling.factor, mc.rope_scaling.original_max_position, mc.attn_temperature) == (128.0, 8192,
                                                                                                    (8192.0, 0.1))
    m, _ = read_sizes(tmp_path)
    with torch.device("meta"):
        built = transformers.Mistral4ForCausalLM(cfg)
    assert m.param_count() == built.num_parameters()
    assert m.kv_bytes_per_token() == 36 * (256 + 64) * 2


def test_a_mistral3_whose_text_config_leaves_fields_out_takes_mistrals_defaults(tmp_path):
    # a text_config of type mistral takes MistralConfig's defaults, Mistral 4's Mistral4Config's, as transformers fills them
    for text in ({"model_type": "mistral", "head_dim": 128, "sliding_window": None}, {"model_type": "mistral4"}):
        cfg = transformers.Mistral3Config(text_config=text, tie_word_embeddings=False)
        (tmp_path / "config.json").write_text(json.dumps({**cfg.to_dict(), "text_config": text}))
        with torch.device("meta"):
            built = transformers.Mistral3ForConditionalGeneration(cfg)
        assert read_sizes(tmp_path)[0].param_count() == built.num_parameters(), text["model_type"]
