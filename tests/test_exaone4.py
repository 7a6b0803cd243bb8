"""EXAONE 4 checkpoints (``exaone4``: EXAONE-4.0-32B, 1.2B): the engine generates what transformers generates from
the same directory (OLMo 2's layers, their norms on each sublayer's output; each q and k head normed; where some
layers attend through a window, those alone rotate and the full-attention layers attend without positions; where
none does, every layer rotates), its window pattern is read as transformers reads it, and the 32B's sizes are
counted as transformers builds them."""
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

CASES = {"hybrid": {"sliding_window": 16},  # the 32B's: three windowed layers of four, those alone rotating
         "full": {"sliding_window": None, "layer_types": ["full_attention"] * 4}}  # the 1.2B's: every layer rotates


def variant(model: LlamaModel, **fields) -> LlamaModel:
    other = LlamaModel(replace(model.config, **fields))
    other.load_state_dict(model.state_dict())
    return other.eval()


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_an_exaone4_checkpoint_generates_what_transformers_generates(tmp_path, case, dtype):
    hf = drawn_apart(hf_tiny("Exaone4", head_dim=8, initializer_range=0.1, num_hidden_layers=4, **CASES[case]))
    hf = hf.to(getattr(torch, dtype))
    hf.save_pretrained(tmp_path)
    model = load_checkpoint(tmp_path)
    mc = model.config
    assert (mc.qk_norm, mc.qk_norm_across_heads, mc.sandwich_norms, mc.pre_norms) == (True, False, True, False)
    assert (mc.window_layers, mc.nope_layers) == (((0, 1, 2), (3,)) if case == "hybrid" else ((), ()))
    assert mc.param_count() == hf.num_parameters()
    ps = prompts([13, 30, 21])
    outputs = generate(model, ps)
    assert len({t for o in outputs for t in o}) > 8
    assert_generates_as(hf, ps, outputs, exact=dtype == "float32")
    if dtype == "float32" and case == "hybrid":  # the full layer's missing RoPE and the windows change the tokens
        assert generate(variant(model, nope_layers=()), ps) != outputs
        assert generate(variant(model, window_layers=(), sliding_window=None), ps) != outputs


def test_exaone4_reads_its_window_pattern_as_transformers_does(tmp_path):
    cfg = transformers.Exaone4Config(num_hidden_layers=8, sliding_window_pattern=2, max_position_embeddings=8192).to_dict()
    del cfg["layer_types"]  # an int pattern without layer_types: every pattern-th layer full
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    mc = read_config(tmp_path)
    assert mc.nope_layers == (1, 3, 5, 7) and mc.window_layers == (0, 2, 4, 6)
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "sliding_window_pattern": "LLLG"}))
    with pytest.raises(CheckpointError, match="sliding_window_pattern 'LLLG' needs layer_types beside it"):
        read_config(tmp_path)


def test_exaone_4_32b_is_sized_as_transformers_builds_it(tmp_path):
    cfg = transformers.Exaone4Config(hidden_size=5120, intermediate_size=27_392, num_hidden_layers=64,
                                     num_attention_heads=40, num_key_value_heads=8, head_dim=128,
                                     max_position_embeddings=131_072, sliding_window=4096, sliding_window_pattern=4)
    (tmp_path / "config.json").write_text(json.dumps({**cfg.to_dict(), "torch_dtype": "bfloat16"}))
    m, notes = read_sizes(tmp_path)
    with torch.device("meta"):
        built = transformers.Exaone4ForCausalLM(cfg)
    assert m.param_count() == built.num_parameters() == 32_003_216_384
    assert m.nope_layers == tuple(range(3, 64, 4)) and any("sliding window (4096 tokens) frees no KV" in n for n in notes)
