"""Ministral 3 (``ministral3``, and as ``mistral3``'s text model beside a Pixtral tower): Mistral's attention with
YaRN, every layer's queries scaled after RoPE by 1 + beta x ln(1 + floor(p / original context)) (its rope
parameters' ``llama_4_scaling_beta``). The engine generates what transformers generates from the same
directory, and the scaling changes the tokens."""
from __future__ import annotations

import json

import pytest
import torch

from conftest import assert_generates_as, hf_greedy, hf_tiny
from engine.checkpoint import load_checkpoint, read_config, read_sizes
from test_gpt_oss import generate
from test_moe import prompts

transformers = pytest.importorskip("transformers")

# YaRN over an original context of 8 tokens, so that the scaling steps up within the prompts
ROPE = {"rope_type": "yarn", "rope_theta": 100.0, "factor": 4.0, "original_max_position_embeddings": 8,
        "beta_fast": 32.0, "beta_slow": 1.0, "mscale_all_dim": 1.0, "mscale": 1.0, "llama_4_scaling_beta": 0.5}
TEXT = dict(head_dim=8, max_position_embeddings=512, rope_parameters=ROPE, initializer_range=0.1)


def drawn(hf):
    with torch.no_grad():
        for key, p in hf.named_parameters():
            if key.endswith("norm.weight"):
                p.normal_(1.0, 0.3)
    return hf


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_ministral3_checkpoint_generates_what_transformers_generates(tmp_path, dtype):
    hf = drawn(hf_tiny("Ministral3", **TEXT)).to(getattr(torch, dtype))
    hf.save_pretrained(tmp_path)
    model = load_checkpoint(tmp_path)
    mc = model.config
    assert (mc.attn_temperature, mc.attn_temperature_every_layer, mc.rope_scaling.kind) == ((8.0, 0.5), True, "yarn")
    ps = prompts([13, 30, 21])
    outputs = generate(model, ps)
    assert len({t for o in outputs for t in o}) > 8
    assert_generates_as(hf, ps, outputs, exact=dtype == "float32")
    if dtype == "float32":
        for layer in model.model.layers:
            layer.self_attn.tempered = False
        assert generate(model, ps) != outputs  # the query scaling matters


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_query_scale_is_transformers_at_each_step_of_its_floor(tmp_path, dtype):
    # tokens alone would not tell floor(p / 8) from Llama 4's floor((p + 1) / 8): they differ at 7, 15, ...
    from transformers.models.ministral3.modeling_ministral3 import get_llama_4_attn_scale

    hf_tiny("Ministral3", **TEXT).save_pretrained(tmp_path)
    model = load_checkpoint(tmp_path)
    positions = torch.tensor([0, 7, 8, 15, 16, 63, 64, 1000])
    theirs = get_llama_4_attn_scale(positions[None], 0.5, 8).to(dtype).reshape(-1)
    assert torch.equal(model.query_scales(positions, dtype).reshape(-1), theirs)


def test_a_mistral3_checkpoint_with_a_ministral3_text_model_runs_it(tmp_path):
    text = hf_tiny("Ministral3", **TEXT).config.to_dict()
    vision = dict(hidden_size=32, intermediate_size=40, num_hidden_layers=2, num_attention_heads=2, head_dim=16,
                  image_size=32, patch_size=8)
    torch.manual_seed(0)
    hf = transformers.Mistral3ForConditionalGeneration(transformers.Mistral3Config(
        text_config=text, vision_config=vision, image_token_index=299, tie_word_embeddings=False)).eval()
    drawn(hf).save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["text_config"]["model_type"] == "ministral3"
    model = load_checkpoint(tmp_path)
    assert model.config.attn_temperature == (8.0, 0.5)
    assert read_sizes(tmp_path)[0].param_count() == hf.num_parameters()
    ps = prompts([13, 30])
    assert generate(model, ps) == [hf_greedy(hf, p, 12) for p in ps]


def test_ministral3_reads_its_rope_from_rope_scaling_or_takes_transformers_default(tmp_path):
    # a top-level rope_scaling is the checkpoint's own (transformers reads it before its default); none, or null,
    # takes Ministral3Config's YaRN (factor 16 over 16,384 tokens, beta 0.1)
    hf_tiny("Ministral3", **TEXT).save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    del cfg["rope_parameters"]
    own = {**ROPE, "factor": 2.0, "original_max_position_embeddings": 32, "llama_4_scaling_beta": 0.2}
    for fields, expected in (({"rope_scaling": own}, (2.0, 32, (32.0, 0.2))), ({}, (16.0, 16_384, (16_384.0, 0.1))),
                             ({"rope_parameters": None}, (16.0, 16_384, (16_384.0, 0.1)))):
        (tmp_path / "config.json").write_text(json.dumps({**cfg, **fields}))
        mc = read_config(tmp_path)
        assert (mc.rope_scaling.factor, mc.rope_scaling.original_max_position, mc.attn_temperature) == expected
