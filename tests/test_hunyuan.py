"""Hunyuan's dense checkpoints (``hunyuan_v1_dense``: Hunyuan-0.5B to 7B): the engine generates what transformers
generates from the same directory (Llama's with each q and k head normed after RoPE, the KV holding the normed keys,
and RoPE's base stretched by an NTK ``alpha``, as transformers and vLLM compute it); cross-layer attention and
experts are refused by name; its sizes are counted as transformers builds them."""
from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from conftest import assert_generates_as, drawn_apart, hf_tiny
from engine.checkpoint import CheckpointError, load_checkpoint, read_config, read_sizes
from engine.model import LlamaModel
from test_gpt_oss import generate
from test_moe import prompts

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

ALPHA = {"rope_type": "dynamic", "alpha": 1000.0, "rope_theta": 10000.0, "factor": 1.0}  # Hunyuan-7B's RoPE


def variant(model: LlamaModel, **fields) -> LlamaModel:
    other = LlamaModel(replace(model.config, **fields))
    other.load_state_dict(model.state_dict())
    return other.eval()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_hunyuan_checkpoint_generates_what_transformers_generates(tmp_path, dtype):
    hf = drawn_apart(hf_tiny("HunYuanDenseV1", head_dim=8, initializer_range=0.1, rope_parameters=ALPHA))
    hf = hf.to(getattr(torch, dtype))
    hf.save_pretrained(tmp_path)
    model = load_checkpoint(tmp_path)
    mc = model.config
    # the base stretched by alpha ** (8 / 6): 10,000 x 10,000
    assert (mc.qk_norm, mc.qk_norm_after_rope, mc.rope_scaling) == (True, True, None)
    assert mc.rope_theta == pytest.approx(1e8)
    assert mc.param_count() == hf.num_parameters()
    ps = prompts([13, 30, 21])
    outputs = generate(model, ps)
    assert len({t for o in outputs for t in o}) > 8
    assert_generates_as(hf, ps, outputs, exact=dtype == "float32")
    if dtype == "float32":  # the norms after RoPE and the stretched base each change the tokens
        assert generate(variant(model, qk_norm_after_rope=False), ps) != outputs
        assert generate(variant(model, rope_theta=10000.0), ps) != outputs


def test_hunyuans_cross_layer_attention_and_experts_are_refused(tmp_path):
    base = transformers.HunYuanDenseV1Config(num_hidden_layers=4).to_dict()
    for fields, match in (({"use_cla": True, "cla_share_factor": 2}, "use_cla is not supported"),
                          ({"num_experts": 8}, "num_experts 8 is not supported"),
                          ({"num_experts": [1, 8, 1, 1]}, r"num_experts \[1, 8, 1, 1\] is not supported"),
                          ({"num_experts": "1"}, "config.json: num_experts must be a whole number"),
                          ({"rope_parameters": {**ALPHA, "alpha": 0}}, "rope_theta and alpha must be numbers > 0")):
        (tmp_path / "config.json").write_text(json.dumps({**base, **fields}))
        with pytest.raises(CheckpointError, match=match):
            read_config(tmp_path)
    # as vLLM reads them: cross-layer attention sharing nothing (a factor of 1) and one expert a layer are dense
    for fields in ({"use_cla": True, "cla_share_factor": 1}, {"num_experts": [1, 1, 1, 1]}, {"num_experts": 1}):
        (tmp_path / "config.json").write_text(json.dumps({**base, **fields}))
        assert read_config(tmp_path).num_experts == 0
    # another family's dynamic RoPE with an alpha is refused, as before (transformers and vLLM read it apart)
    llama = transformers.LlamaConfig(num_hidden_layers=2).to_dict()
    (tmp_path / "config.json").write_text(json.dumps({**llama, "rope_parameters": ALPHA}))
    with pytest.raises(CheckpointError, match="rope type 'dynamic' is not supported"):
        read_config(tmp_path)


def test_hunyuan_is_sized_as_transformers_builds_it(tmp_path):
    cfg = transformers.HunYuanDenseV1Config(rope_parameters=ALPHA, head_dim=128)
    (tmp_path / "config.json").write_text(json.dumps({**cfg.to_dict(), "torch_dtype": "bfloat16"}))
    m, notes = read_sizes(tmp_path)
    with torch.device("meta"):
        built = transformers.HunYuanDenseV1ForCausalLM(cfg)
    assert m.param_count() == built.num_parameters() and not notes
