"""Ministral (``ministral``: Mistral's, each layer's kind in layer_types) and Seed-OSS (``seed_oss``: Llama's with
biases on q, k and v, and on o only where ``attention_out_bias``): the engine generates what transformers
generates from the same directory, and the windows and the biases each matter."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from conftest import hf_greedy, hf_tiny
from engine.checkpoint import load_checkpoint
from test_gpt_oss import generate
from test_moe import prompts

transformers = pytest.importorskip("transformers")


def drawn(hf):
    """``hf`` with its biases (transformers starts them at zero) and norms drawn apart, so that they show."""
    with torch.no_grad():
        for key, p in hf.named_parameters():
            if key.endswith(".bias"):  # small: larger ones make this tiny model repeat a few tokens
                p.normal_(0.0, 0.02)
            elif key.endswith("norm.weight"):
                p.normal_(1.0, 0.3)
    return hf


def test_a_ministral_checkpoint_attends_through_the_windows_its_layer_types_name(tmp_path):
    hf = drawn(hf_tiny("Ministral", num_hidden_layers=4, head_dim=8, sliding_window=16, initializer_range=0.1,
                       layer_types=["sliding_attention", "full_attention"] * 2))
    hf.save_pretrained(tmp_path)
    model = load_checkpoint(tmp_path)
    assert (model.config.window_layers, model.config.sliding_window) == ((0, 2), 16)
    ps = prompts([13, 30, 21])
    outputs = generate(model, ps)
    assert len({t for o in outputs for t in o}) > 8
    assert outputs == [hf_greedy(hf, p, 12) for p in ps]
    model.config = replace(model.config, window_layers=(), sliding_window=None)
    assert generate(model, ps) != outputs


@pytest.mark.parametrize("out_bias", [False, True])
def test_a_seed_oss_checkpoint_generates_what_transformers_generates(tmp_path, out_bias):
    hf = drawn(hf_tiny("SeedOss", head_dim=8, attention_bias=True, attention_out_bias=out_bias, initializer_range=0.1))
    hf.save_pretrained(tmp_path)
    model = load_checkpoint(tmp_path)
    assert (model.config.qkv_bias, model.config.o_bias) == (True, out_bias)
    assert model.config.param_count() == hf.num_parameters()
    ps = prompts([13, 30, 21])
    outputs = generate(model, ps)
    assert len({t for o in outputs for t in o}) > 8
    assert outputs == [hf_greedy(hf, p, 12) for p in ps]
    with torch.no_grad():
        model.model.layers[0].self_attn.qkv_proj.bias.zero_()
    assert generate(model, ps) != outputs
