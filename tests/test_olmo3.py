"""OLMo 3 (``olmo3``): OLMo 2's norms, with three layers of four attending through a sliding window, which rotate
by an unscaled RoPE of their own while the full-attention layers' is scaled (YaRN, in OLMo 3's long-context
releases). The engine generates what transformers generates from the same directory; the windows and the
windowed layers' own RoPE each change the tokens; the older config layout reads the same."""
from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from conftest import hf_greedy, hf_tiny
from engine.checkpoint import load_checkpoint, read_config
from test_gpt_oss import generate
from test_moe import prompts

transformers = pytest.importorskip("transformers")

YARN = {"rope_type": "yarn", "rope_theta": 100.0, "factor": 4.0, "original_max_position_embeddings": 32,
        "beta_fast": 32.0, "beta_slow": 1.0}


def hf_olmo3(sliding_theta: float = 50.0):
    """A tiny OLMo 3: 4 layers, the first three windowed at 16 tokens (the prompts pass it) and rotating by a
    base of their own (``sliding_theta``), YaRN on the last; its weights drawn five times wider and its norms
    apart, so that a window or a rotation shows."""
    hf = hf_tiny("Olmo3", num_hidden_layers=4, sliding_window=16, initializer_range=0.1, pad_token_id=None,
                 rope_parameters={"full_attention": YARN,
                                  "sliding_attention": {"rope_type": "default", "rope_theta": sliding_theta}})
    with torch.no_grad():
        for key, p in hf.named_parameters():
            if key.endswith("norm.weight"):
                p.normal_(1.0, 0.3)
    return hf


def test_an_olmo3_checkpoint_generates_what_transformers_generates(tmp_path):
    hf = hf_olmo3()
    hf.save_pretrained(tmp_path)
    model = load_checkpoint(tmp_path)
    mc = model.config
    assert (mc.window_layers, mc.sliding_window, mc.rope_theta, mc.local_rope_theta) == ((0, 1, 2), 16, 100.0, 50.0)
    assert mc.rope_scaling.kind == "yarn"
    assert mc.qk_norm_across_heads and not mc.pre_norms and mc.param_count() == hf.num_parameters()
    ps = prompts([13, 30, 21])
    outputs = generate(model, ps)
    assert len({t for o in outputs for t in o}) > 8
    assert outputs == [hf_greedy(hf, p, 12) for p in ps]
    unwindowed = load_checkpoint(tmp_path)
    unwindowed.config = replace(mc, sliding_window=None, window_layers=(), local_rope_theta=None)
    assert generate(unwindowed, ps) != outputs  # the windows matter
    scaled = load_checkpoint(tmp_path)
    scaled.local_rotary = scaled.rotary  # the windowed layers rotated by the full layers' YaRN
    assert generate(scaled, ps) != outputs


def test_olmo3s_older_config_layout_reads_the_same(tmp_path):
    # rope_scaling and rope_theta at the top level (one base for both kinds of layer, as vLLM and transformers 4 read
    # it), no layer_types (every fourth layer full, as transformers decides); without a window, the windowed
    # layers still rotate by their own RoPE, as transformers rotates each sliding_attention layer
    hf_olmo3(sliding_theta=100.0).save_pretrained(tmp_path)
    new = read_config(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    del cfg["rope_parameters"], cfg["layer_types"]
    old = {**cfg, "rope_scaling": {k: v for k, v in YARN.items() if k != "rope_theta"}, "rope_theta": 100.0}
    (tmp_path / "config.json").write_text(json.dumps(old))
    assert read_config(tmp_path) == new
    (tmp_path / "config.json").write_text(json.dumps({**old, "sliding_window": None}))
    unwindowed = read_config(tmp_path)
    assert (unwindowed.window_layers, unwindowed.local_rope_theta) == ((0, 1, 2), 100.0)
    assert unwindowed.sliding_window == unwindowed.max_position  # masks nothing
