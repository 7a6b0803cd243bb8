"""Granite's mixtures of experts (``granitemoe``, ``granitemoeshared``: Granite 3.x MoE): the engine generates
what transformers generates from the same directory (Granite's four scalars around Mixtral's experts, each
layer's stored stacked, gate and up in ``input_linear``; the shared expert, where there is one, ungated), and
their sizes are counted as transformers builds them."""
from __future__ import annotations

import json

import pytest
import torch

from conftest import assert_generates_as, drawn_apart, hf_tiny
from engine.checkpoint import CheckpointError, load_checkpoint, read_sizes
from engine.model import SparseMoE
from test_gpt_oss import generate
from test_granite_and_olmo2 import GRANITE
from test_moe import prompts

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

CASES = [("GraniteMoe", {}), ("GraniteMoeShared", {"shared_intermediate_size": 32})]
# Granite's scalars, its embeddings scaled less (Granite-3's 12 drowns this tiny model's experts in the residual
# stream, so that their weighing would not show in the tokens)
SCALARS = {**GRANITE, "embedding_multiplier": 1.3}


@pytest.mark.parametrize("name, extra", CASES)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_granite_moe_checkpoint_generates_what_transformers_generates(tmp_path, name, extra, dtype):
    hf = drawn_apart(hf_tiny(name, num_local_experts=8, num_experts_per_tok=2, intermediate_size=24, **SCALARS,
                             **extra), mlp_scale=2).to(getattr(torch, dtype))
    hf.save_pretrained(tmp_path)
    model = load_checkpoint(tmp_path)
    mc = model.config
    assert (mc.num_experts, mc.experts_per_token, mc.moe_intermediate_size, mc.norm_topk_prob, mc.dense_layers) == (
        8, 2, 24, True, ())
    assert (mc.embedding_multiplier, mc.query_scale, mc.residual_multiplier, mc.logits_scaling) == (1.3, 0.13, 0.22, 7.7)
    assert (mc.shared_expert_intermediate_size, mc.shared_expert_gate) == (extra.get("shared_intermediate_size", 0), False)
    assert mc.param_count() == hf.num_parameters()
    ps = prompts([13, 30, 21])
    outputs = generate(model, ps)
    assert len({t for o in outputs for t in o}) > 8
    assert_generates_as(hf, ps, outputs, exact=dtype == "float32")
    if dtype == "float32":  # the picked experts' weights renormalised (a softmax over the picked logits) ...
        for layer in model.model.layers:
            assert isinstance(layer.mlp, SparseMoE)
            layer.mlp.normalise = False
        assert generate(model, ps) != outputs
        if extra:  # ... and the shared expert taken by every token
            shared = load_checkpoint(tmp_path)
            with torch.no_grad():
                for layer in shared.model.layers:
                    layer.mlp.shared_expert.down_proj.weight.zero_()
            assert generate(shared, ps) != outputs


def test_a_misshapen_granite_shared_expert_is_refused(tmp_path):
    hf = hf_tiny("GraniteMoeShared", num_local_experts=4, num_experts_per_tok=2, intermediate_size=24,
                 shared_intermediate_size=32)
    hf.save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "shared_intermediate_size": 16}))
    with pytest.raises(CheckpointError, match=r"shared_mlp\.input_linear\.weight' has 64 rows, config.json implies 32"):
        load_checkpoint(tmp_path)


@pytest.mark.parametrize("name, extra", CASES)
def test_granite_moe_is_sized_as_transformers_builds_it(tmp_path, name, extra):
    # Granite-3.1-3B-A800M's shape: 40 experts, 8 a token, 512 wide
    cfg = getattr(transformers, f"{name}Config")(hidden_size=1536, intermediate_size=512, num_hidden_layers=32,
                                                 num_attention_heads=24, num_key_value_heads=8, vocab_size=49_155,
                                                 num_local_experts=40, num_experts_per_tok=8, tie_word_embeddings=True,
                                                 **{k: 1024 for k in extra})
    (tmp_path / "config.json").write_text(json.dumps({**cfg.to_dict(), "torch_dtype": "bfloat16"}))
    m, _ = read_sizes(tmp_path)
    with torch.device("meta"):
        built = getattr(transformers, f"{name}ForCausalLM")(cfg)
    assert m.param_count() == built.num_parameters()
