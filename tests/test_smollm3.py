"""SmolLM3 checkpoints (``smollm3``): Llama's with RoPE left out of some layers; the engine generates what
transformers generates from the same directory, reads which layers from config.json or transformers' rule,
and rotating those layers too changes the tokens."""
from __future__ import annotations

import json

import pytest
import torch

from conftest import assert_generates_as, hf_tiny
from engine.checkpoint import CheckpointError, load_checkpoint
from test_gpt_oss import generate
from test_moe import prompts

transformers = pytest.importorskip("transformers")


def hf_smollm3(dtype: torch.dtype = torch.float32, **extra):
    """A tiny SmolLM3 (4 layers, the last without RoPE by transformers' default rule; embeddings tied, as its
    release ties them), its weights drawn five times wider than transformers' default (at 0.02 this tiny tied
    model repeats three tokens) and its norms apart, so that a rotation added or left out changes the tokens."""
    hf = hf_tiny("SmolLM3", num_hidden_layers=4, rope_theta=100.0, initializer_range=0.1, **extra)
    with torch.no_grad():
        for key, p in hf.named_parameters():
            if key.endswith("norm.weight"):
                p.normal_(1.0, 0.3)
    return hf.to(dtype)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_smollm3_checkpoint_generates_what_transformers_generates(tmp_path, dtype):
    hf = hf_smollm3(getattr(torch, dtype))
    hf.save_pretrained(tmp_path)
    model = load_checkpoint(tmp_path)
    assert model.config.nope_layers == (3,) and model.config.window_layers == ()
    assert model.config.param_count() == hf.num_parameters()
    ps = prompts([13, 30, 21])
    outputs = generate(model, ps)
    assert len({t for o in outputs for t in o}) > 5  # tokens that vary, so that a difference shows
    assert_generates_as(hf, ps, outputs, exact=dtype == "float32")
    if dtype == "float32":
        model.model.layers[3].self_attn.rotates = True  # its NoPE layer rotated as the others
        assert generate(model, ps) != outputs


def test_smollm3_reads_its_nope_layers_from_config_json_or_transformers_rule(tmp_path):
    hf = hf_smollm3(no_rope_layers=[0, 1, 0, 1])
    hf.save_pretrained(tmp_path)
    assert load_checkpoint(tmp_path).config.nope_layers == (0, 2)
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "no_rope_layers": None, "no_rope_layer_interval": 2}))
    assert load_checkpoint(tmp_path).config.nope_layers == (1, 3)
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "no_rope_layers": [1, 1]}))
    with pytest.raises(CheckpointError, match="no_rope_layers must list 1 .* for each of the 4 layers"):
        load_checkpoint(tmp_path)
