"""dots.llm1 checkpoints (``dots1``): the engine generates what transformers generates from the same directory
(Qwen3's attention, each q and k head normed, around DeepSeek-V3's mixture of experts: sigmoid scores plus a learned
bias pick within groups, shared experts, the first layers dense), and dots.llm1's sizes are counted as transformers
builds them."""
from __future__ import annotations

import json

import pytest
import torch

from conftest import assert_generates_as, drawn_apart, hf_tiny
from engine.checkpoint import load_checkpoint, read_sizes
from engine.model import GroupedMoE
from test_gpt_oss import generate
from test_moe import prompts

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

DOTS = dict(head_dim=16, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=24,
            first_k_dense_replace=1, n_group=4, topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_dots1_checkpoint_generates_what_transformers_generates(tmp_path, dtype):
    hf = drawn_apart(hf_tiny("Dots1", **DOTS), mlp_scale=2).to(getattr(torch, dtype))
    hf.save_pretrained(tmp_path)
    model = load_checkpoint(tmp_path)
    mc = model.config
    assert (mc.qk_norm, mc.qk_norm_across_heads, mc.router, mc.expert_groups, mc.topk_groups, mc.routed_scaling,
            mc.dense_layers, mc.window_layers) == (True, False, "sigmoid_groups", 4, 2, 2.5, (0,), ())
    assert isinstance(model.model.layers[1].mlp, GroupedMoE)
    assert mc.param_count() == hf.num_parameters()
    ps = prompts([13, 30, 21])
    outputs = generate(model, ps)
    assert len({t for o in outputs for t in o}) > 8
    assert_generates_as(hf, ps, outputs, exact=dtype == "float32")
    if dtype == "float32":  # the correction bias picks the experts
        for layer in model.model.layers[1:]:
            layer.mlp.gate.e_score_correction_bias.zero_()
        assert generate(model, ps) != outputs


def test_dots_llm1_is_sized_as_transformers_builds_it(tmp_path):
    # dots.llm1's shape: 128 experts, 6 a token, 2 shared, the first layer dense; 142.8B, 14.0B of them active
    cfg = transformers.Dots1Config(hidden_size=4096, intermediate_size=10_944, moe_intermediate_size=1408,
                                   num_hidden_layers=62, num_attention_heads=32, num_key_value_heads=32,
                                   n_routed_experts=128, num_experts_per_tok=6, n_shared_experts=2,
                                   first_k_dense_replace=1, norm_topk_prob=True)
    (tmp_path / "config.json").write_text(json.dumps({**cfg.to_dict(), "torch_dtype": "bfloat16"}))
    m, notes = read_sizes(tmp_path)
    with torch.device("meta"):
        built = transformers.Dots1ForCausalLM(cfg)
    assert m.param_count() == built.num_parameters() == 142_774_373_888 and not notes
    assert m.param_count(active=True) == 14_016_581_120


def test_dots1_takes_transformers_defaults_for_what_config_json_leaves_out(tmp_path):
    # one group, all of them picked, no scaling, the first layer sparse where config.json names only its experts
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "dots1", "n_routed_experts": 64,
                                                      "num_experts_per_tok": 4, "n_shared_experts": 1}))
    m, _ = read_sizes(tmp_path)
    assert (m.expert_groups, m.topk_groups, m.routed_scaling, m.dense_layers, m.norm_topk_prob) == (1, 1, 1.0, (), False)
    with torch.device("meta"):
        built = transformers.Dots1ForCausalLM(transformers.Dots1Config(n_routed_experts=64, num_experts_per_tok=4,
                                                                       n_shared_experts=1))
    assert m.param_count() == built.num_parameters()
