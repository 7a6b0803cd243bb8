"""OLMoE checkpoints (``olmoe``: OLMoE-1B-7B): the engine generates what transformers generates from the same
directory (Mixtral's layers with one RMSNorm over all of q's heads' features and one over k's, experts weighed by
their softmax scores as picked, not renormalised, as vLLM runs them); clip_qkv is refused; OLMoE-1B-7B's sizes are
counted as transformers builds them."""
from __future__ import annotations

import json

import pytest
import torch

from conftest import assert_generates_as, drawn_apart, hf_tiny
from engine.checkpoint import CheckpointError, load_checkpoint, read_config, read_sizes
from engine.model import SparseMoE
from test_gpt_oss import generate
from test_moe import prompts

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_an_olmoe_checkpoint_generates_what_transformers_generates(tmp_path, dtype):
    hf = drawn_apart(hf_tiny("Olmoe", num_experts=8, num_experts_per_tok=2, intermediate_size=24), mlp_scale=2)
    hf = hf.to(getattr(torch, dtype))
    hf.save_pretrained(tmp_path)
    model = load_checkpoint(tmp_path)
    mc = model.config
    assert (mc.qk_norm, mc.qk_norm_across_heads, mc.router, mc.norm_topk_prob, mc.num_experts,
            mc.moe_intermediate_size, mc.dense_layers) == (True, True, "softmax", False, 8, 24, ())
    assert mc.param_count() == hf.num_parameters()
    ps = prompts([13, 30, 21])
    outputs = generate(model, ps)
    assert len({t for o in outputs for t in o}) > 8
    assert_generates_as(hf, ps, outputs, exact=dtype == "float32")
    if dtype == "float32":  # the weights are the softmax scores as picked: renormalised, the tokens differ
        for layer in model.model.layers:
            assert isinstance(layer.mlp, SparseMoE)
            layer.mlp.normalise = True
        assert generate(model, ps) != outputs


def test_olmoe_clip_qkv_is_refused_to_run_and_read_past_to_size(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(transformers.OlmoeConfig(clip_qkv=8.0).to_dict()))
    with pytest.raises(CheckpointError, match="clip_qkv 8.0 is not supported"):
        read_config(tmp_path)
    assert read_sizes(tmp_path)[0].num_experts == 64  # clipping changes no size


def test_olmoe_1b_7b_is_sized_as_transformers_builds_it(tmp_path):
    # OLMoE-1B-7B's config.json: transformers' defaults but for its experts' width; 6.9B, 1.3B of them active
    cfg = transformers.OlmoeConfig(intermediate_size=1024)
    (tmp_path / "config.json").write_text(json.dumps({**cfg.to_dict(), "torch_dtype": "bfloat16"}))
    m, notes = read_sizes(tmp_path)
    with torch.device("meta"):
        built = transformers.OlmoeForCausalLM(cfg)
    assert m.param_count() == built.num_parameters() == 6_919_161_856 and not notes
    assert 1.27e9 < m.param_count(active=True) < 1.29e9
    assert m.kv_bytes_per_token() == 2 * 16 * 16 * 128 * 2  # its 16 heads' K and V (no grouping), every layer, bf16
