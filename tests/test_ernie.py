"""ERNIE 4.5 checkpoints (``ernie4_5``: 0.3B; ``ernie4_5_moe``: 21B-A3B, 300B-A47B): the engine generates what
transformers generates from the same directory (Llama's with RoPE over interleaved pairs; the mixtures of experts
pick by their softmax scores plus a learned bias and weigh by those scores renormalised, beside ungated shared
experts, on the layers their three fields place them); their multi-token-prediction modules are skipped as
vLLM and transformers skip them; their sizes are counted as transformers builds them."""
from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import assert_generates_as, assert_greedy_up_to_rounding, drawn_apart, hf_tiny
from engine.checkpoint import CheckpointError, load_checkpoint, read_config, read_sizes
from engine.model import GroupedMoE, LlamaModel
from test_gpt_oss import generate
from test_moe import prompts

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

MOE = dict(moe_num_experts=8, moe_k=2, moe_intermediate_size=24, moe_num_shared_experts=1, moe_layer_start_index=1)


def hf_ernie(moe: bool, dtype: torch.dtype = torch.float32):
    """A tiny ERNIE 4.5 (tied, as published), its weights drawn wide and its routers, correction biases and norms
    far from their initial values, so that its tokens vary and a wrong pick, weight or rotation changes them."""
    hf = hf_tiny("Ernie4_5_Moe" if moe else "Ernie4_5", head_dim=16, initializer_range=0.3 if moe else 0.2,
                 **(MOE if moe else {}))
    return drawn_apart(hf).to(dtype)


def rotating_rotate_half(model: LlamaModel, ps: list[list[int]]) -> list[list[int]]:
    """What ``model`` generates with its RoPE over rotate-half's pairs in place of interleaved ones."""
    other = LlamaModel(replace(model.config, rope_interleaved=False))
    other.load_state_dict(model.state_dict())
    return generate(other.to(model.model.embed_tokens.weight.dtype).eval(), ps)


@pytest.mark.parametrize("moe, dtype", [(False, "float32"), (False, "bfloat16"), (True, "float32"), (True, "bfloat16")])
def test_an_ernie_4_5_checkpoint_generates_what_transformers_generates(tmp_path, moe, dtype):
    hf = hf_ernie(moe, getattr(torch, dtype))
    hf.save_pretrained(tmp_path)
    model = load_checkpoint(tmp_path)
    mc = model.config
    assert (mc.rope_interleaved, mc.tie_word_embeddings, mc.qkv_bias, mc.o_bias) == (True, True, False, False)
    if moe:
        saved = load_file(str(tmp_path / "model.safetensors"))
        assert tuple(saved["model.layers.1.mlp.moe_statics.e_score_correction_bias"].shape) == (1, 8)  # one row
        assert (mc.router, mc.num_experts, mc.experts_per_token, mc.shared_expert_intermediate_size,
                mc.shared_expert_gate, mc.dense_layers) == ("softmax_biased", 8, 2, 24, False, (0,))
        assert isinstance(model.model.layers[1].mlp, GroupedMoE) and not isinstance(model.model.layers[0].mlp, GroupedMoE)
        # transformers holds each layer's correction bias as a parameter; the engine, as DeepSeek-V3's, as a buffer
        assert mc.param_count() == hf.num_parameters() - 2 * 8
    else:
        assert mc.param_count() == hf.num_parameters()
    ps = prompts([13, 30, 21])
    outputs = generate(model, ps)
    assert len({t for o in outputs for t in o}) > 8
    assert_generates_as(hf, ps, outputs, exact=dtype == "float32")
    if dtype == "float32":
        assert rotating_rotate_half(model, ps) != outputs
        if moe:  # the bias picks the experts
            for layer in model.model.layers[1:]:
                layer.mlp.gate.e_score_correction_bias.zero_()
            assert generate(model, ps) != outputs


def test_its_multi_token_prediction_modules_are_skipped(tmp_path):
    # ERNIE 4.5's MoE releases hold an MTP module under names with "mtp", which vLLM and transformers skip
    hf = hf_ernie(moe=True)
    hf.save_pretrained(tmp_path)
    ps = prompts([13, 30])
    outputs = generate(load_checkpoint(tmp_path), ps)
    state = load_file(str(tmp_path / "model.safetensors"))
    mtp = {"model.mtp_block.0.self_attn.q_proj.weight": torch.randn(96, 48), "model.mtp_linear_proj.0.weight":
           torch.randn(48, 96), "model.mtp_emb_norm.0.weight": torch.ones(48)}
    save_file({**state, **mtp}, str(tmp_path / "model.safetensors"))
    assert generate(load_checkpoint(tmp_path), ps) == outputs
    save_file({**state, "model.layers.3.self_attn.q_proj.weight": torch.randn(96, 48)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"'model\.layers\.3\.self_attn\.q_proj\.weight' has no place"):
        load_checkpoint(tmp_path)


@pytest.mark.parametrize("fields, sparse", [({}, (1, 2, 3, 4, 5)), ({"moe_layer_start_index": 0}, (0, 1, 2, 3, 4, 5)),
                                            ({"moe_layer_interval": 2}, (1, 3, 5)),
                                            ({"moe_layer_end_index": 3, "moe_layer_interval": 2}, (1, 3))])
def test_its_expert_layers_are_placed_as_transformers_places_them(tmp_path, fields, sparse):
    cfg = transformers.Ernie4_5_MoeConfig(**{**dict(vocab_size=300, hidden_size=48, intermediate_size=96,
                                                    num_hidden_layers=6, num_attention_heads=6, num_key_value_heads=2,
                                                    head_dim=16), **MOE, **fields})
    (tmp_path / "config.json").write_text(json.dumps(cfg.to_dict()))
    mc = read_config(tmp_path)
    assert tuple(i for i in range(6) if mc.is_sparse(i)) == sparse
    with torch.device("meta"):
        built = transformers.Ernie4_5_MoeForCausalLM(cfg)
    assert tuple(i for i, layer in enumerate(built.model.layers) if hasattr(layer.mlp, "experts")) == sparse
    assert mc.param_count() == built.num_parameters() - 8 * len(sparse)  # less its correction biases (parameters there)


def test_a_bf16_ernie_keeps_its_float32_router_as_released(tmp_path):
    # ERNIE 4.5's releases store the router's weight in float32 beside bf16 experts (transformers keeps it so,
    # vLLM holds it so): the engine holds it as stored, and generates transformers' tokens up to rounding
    hf_ernie(moe=True).save_pretrained(tmp_path / "f32")
    bf16 = transformers.Ernie4_5_MoeForCausalLM.from_pretrained(tmp_path / "f32", dtype=torch.bfloat16).eval()
    bf16.save_pretrained(tmp_path / "bf16")
    saved = load_file(str(tmp_path / "bf16" / "model.safetensors"))
    gate, expert = saved["model.layers.1.mlp.gate.weight"], saved["model.layers.1.mlp.experts.0.gate_proj.weight"]
    assert (gate.dtype, expert.dtype) == (torch.float32, torch.bfloat16)
    model = load_checkpoint(tmp_path / "bf16")
    assert model.model.layers[1].mlp.gate.weight.dtype == torch.float32
    assert torch.equal(model.model.layers[1].mlp.gate.weight, gate)
    assert model.model.layers[1].mlp.experts.gate_up_proj.dtype == torch.bfloat16
    ps = prompts([13, 30])
    # transformers rotates ERNIE's queries and keys in float32, the engine in bf16 as vLLM does: within 4 units
    # in the last place of transformers' top logit (as Llama 4's, which transformers rotates so too)
    for p, tokens in zip(ps, generate(model, ps)):
        assert_greedy_up_to_rounding(bf16, p, tokens, ulps=4)


def test_bad_ernie_fields_are_refused_by_name(tmp_path):
    base = transformers.Ernie4_5_MoeConfig(num_hidden_layers=4).to_dict()
    for fields, match in (({"use_bias": True}, "use_bias is not supported"),
                          ({"moe_layer_interval": 0}, "moe_layer_interval must be > 0"),
                          ({"moe_layer_start_index": 5}, "leave none of the 4 layers sparse"),
                          ({"moe_num_experts": 0}, "moe_num_experts must be > 0")):
        (tmp_path / "config.json").write_text(json.dumps({**base, **fields}))
        with pytest.raises(CheckpointError, match=match):
            read_config(tmp_path)
        if "use_bias" in fields:  # sized all the same (its biases left out of the count)
            assert read_sizes(tmp_path)[0].num_experts == 64


def test_ernie_4_5_is_sized_as_transformers_builds_it(tmp_path):
    # transformers' defaults are ERNIE-4.5-0.3B's and ERNIE-4.5-21B-A3B's sizes: 0.36B; 21.8B with 3.35B active
    for config, model, params, active in ((transformers.Ernie4_5Config, transformers.Ernie4_5ForCausalLM,
                                           360_748_032, 360_748_032),
                                          (transformers.Ernie4_5_MoeConfig, transformers.Ernie4_5_MoeForCausalLM,
                                           21_825_436_160, 3_352_148_480)):
        (tmp_path / "config.json").write_text(json.dumps({**config().to_dict(), "torch_dtype": "bfloat16"}))
        m, notes = read_sizes(tmp_path)
        with torch.device("meta"):
            built = model(config())
        biases = sum(p.numel() for key, p in built.named_parameters() if key.endswith("e_score_correction_bias"))
        assert m.param_count() == built.num_parameters() - biases == params and not notes
        assert m.param_count(active=True) == active
