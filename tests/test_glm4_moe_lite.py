"""GLM-4.5's lite mixtures of experts (``glm4_moe_lite``: GLM-4.7-Flash): the engine generates what transformers
generates from the same directory (DeepSeek-V3's latent attention and grouped, biased sigmoid routing, each layer
dense or sparse as ``mlp_layer_types`` says), and its sizes are counted as transformers builds them."""
from __future__ import annotations

import json

import pytest
import torch

from conftest import assert_generates_as, drawn_apart, hf_tiny
from engine.checkpoint import CheckpointError, load_checkpoint, read_config, read_sizes
from engine.model import LatentAttention
from test_gpt_oss import generate
from test_moe import prompts

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

LITE = dict(num_key_value_heads=6, kv_lora_rank=16, q_lora_rank=24, qk_nope_head_dim=8, qk_rope_head_dim=8,
            v_head_dim=8, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=24,
            routed_scaling_factor=1.8, n_group=4, topk_group=2)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_glm4_moe_lite_checkpoint_generates_what_transformers_generates(tmp_path, dtype):
    hf = drawn_apart(hf_tiny("Glm4MoeLite", **LITE), mlp_scale=2).to(getattr(torch, dtype))
    hf.save_pretrained(tmp_path)
    model = load_checkpoint(tmp_path)
    mc = model.config
    assert (mc.kv_lora_rank, mc.router, mc.expert_groups, mc.topk_groups, mc.routed_scaling, mc.dense_layers) == (
        16, "sigmoid_groups", 4, 2, 1.8, (0,))
    assert isinstance(model.model.layers[0].self_attn, LatentAttention)
    assert mc.param_count() == hf.num_parameters()
    ps = prompts([13, 30, 21])
    outputs = generate(model, ps)
    assert len({t for o in outputs for t in o}) > 8
    assert_generates_as(hf, ps, outputs, exact=dtype == "float32")


def test_glm4_moe_lite_places_its_dense_layers_as_transformers_does(tmp_path):
    # mlp_layer_types where config.json gives them; else transformers' default, the first layer dense; or, as
    # DeepSeek's, first_k_dense_replace where only that is given
    base = {k: v for k, v in transformers.Glm4MoeLiteConfig(num_hidden_layers=4).to_dict().items()
            if k != "mlp_layer_types"}
    for fields, dense in (({"mlp_layer_types": ["sparse", "dense", "sparse", "dense"]}, (1, 3)), ({}, (0,)),
                          ({"first_k_dense_replace": 2}, (0, 1))):
        (tmp_path / "config.json").write_text(json.dumps({**base, **fields}))
        assert read_config(tmp_path).dense_layers == dense, fields
    cfg = transformers.Glm4MoeLiteConfig(mlp_layer_types=["sparse", "dense", "sparse", "dense"], num_hidden_layers=4)
    (tmp_path / "config.json").write_text(json.dumps(cfg.to_dict()))
    with torch.device("meta"):
        built = transformers.Glm4MoeLiteForCausalLM(cfg)
    assert read_sizes(tmp_path)[0].param_count() == built.num_parameters()
    (tmp_path / "config.json").write_text(json.dumps({**base, "mlp_layer_types": ["dense", "moe", "sparse", "dense"]}))
    with pytest.raises(CheckpointError, match="mlp_layer_types must list each of the 4 layers as dense or sparse"):
        read_config(tmp_path)


def test_glm_4_7_flash_is_sized_as_transformers_builds_it(tmp_path):
    # transformers' defaults are GLM-4.7-Flash's sizes: 29.9B, its latent KV 512 + 64 features a token and layer
    cfg = transformers.Glm4MoeLiteConfig()
    (tmp_path / "config.json").write_text(json.dumps({**cfg.to_dict(), "torch_dtype": "bfloat16"}))
    m, _ = read_sizes(tmp_path)
    with torch.device("meta"):
        built = transformers.Glm4MoeLiteForCausalLM(cfg)
    assert m.param_count() == built.num_parameters() == 29_943_390_976
    assert m.kv_bytes_per_token() == 47 * (512 + 64) * 2
