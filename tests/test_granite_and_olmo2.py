"""Granite and OLMo 2 checkpoints: the engine generates what transformers generates from the same directory,
Granite with its four scalars (each of which changes the tokens), OLMo 2 with its q and k norms over all of
their heads at once and its norms on each sublayer's output in place of its input."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from conftest import assert_generates_as, assert_greedy_up_to_rounding, hf_tiny
from engine.checkpoint import load_checkpoint
from engine.model import LlamaModel
from test_gpt_oss import generate
from test_moe import prompts

transformers = pytest.importorskip("transformers")

# Granite-3's scalars at about this size (none a power of two: multiplying by 1 / logits_scaling, or rounding
# a scalar to bf16 first, would show), and an epsilon other than the engine's fallback
GRANITE = dict(embedding_multiplier=12.3, attention_multiplier=0.13, residual_multiplier=0.22, logits_scaling=7.7,
               rms_norm_eps=1e-5)


def drawn(hf, dtype: torch.dtype):
    """``hf`` with its norms drawn far from their initial ones and its MLPs weighing more, in ``dtype`` (its
    biases left at zero: at this size any bias on o ahead of OLMo 2's norm makes every layer's output one
    vector, and the model repeats one token)."""
    with torch.no_grad():
        for key, p in hf.named_parameters():
            if key.endswith("norm.weight"):
                p.normal_(1.0, 0.3)
            elif ".mlp." in key:
                p.mul_(2)
    return hf.to(dtype)


@pytest.mark.parametrize("name, extra", [("Granite", GRANITE), ("Olmo2", dict(rms_norm_eps=1e-5)),
                                          ("Olmo2", dict(rms_norm_eps=1e-5, attention_bias=True))])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_granite_or_olmo2_checkpoint_generates_what_transformers_generates(tmp_path, name, extra, dtype):
    hf = drawn(hf_tiny(name, **extra), getattr(torch, dtype))
    hf.save_pretrained(tmp_path)
    model = load_checkpoint(tmp_path)
    mc = model.config
    assert mc.param_count() == hf.num_parameters()
    if name == "Olmo2":  # q's norm over its 6 heads' 8 features, k's over its 2 heads'
        assert (mc.qk_norm_across_heads, mc.pre_norms, model.model.layers[0].self_attn.q_norm.weight.shape) == (
            True, False, (48,))
    else:
        assert (mc.embedding_multiplier, mc.query_scale, mc.residual_multiplier, mc.logits_scaling) == (12.3, 0.13, 0.22, 7.7)
    ps = prompts([13, 30, 21])
    outputs = generate(model, ps)
    assert len({t for o in outputs for t in o}) > 3  # tokens that vary (this tiny OLMo 2 repeats few)
    assert_generates_as(hf, ps, outputs, exact=dtype == "float32")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_granites_logits_are_transformers_and_each_of_its_scalars_changes_them(tmp_path, dtype):
    hf = drawn(hf_tiny("Granite", **GRANITE), getattr(torch, dtype))
    with torch.no_grad():  # scores far from uniform, so that their scale shows
        hf.model.layers.apply(lambda m: (m.q_proj.weight.mul_(8), m.k_proj.weight.mul_(8)) if hasattr(m, "q_proj") else None)
    hf.save_pretrained(tmp_path)
    model = load_checkpoint(tmp_path)
    ps = prompts([13, 30])

    def first_logits(m) -> torch.Tensor:  # the first prompt's last logits (greedy tokens cannot tell logits_scaling)
        seen = []
        hook = m.register_forward_hook(lambda module, args, out: seen.append(out))
        generate(m, ps)
        hook.remove()
        return seen[0][0]

    logits = first_logits(model)
    with torch.no_grad():
        expected = hf(torch.tensor([ps[0]])).logits[0, -1]
    if dtype == "float32":
        torch.testing.assert_close(logits, expected)
    else:  # bf16 attention is not transformers' SDPA to the last bit: within a few bf16 steps of the largest logit
        torch.testing.assert_close(logits, expected, rtol=0, atol=4 * 2 ** -8 * expected.abs().max().item())
    for field in ("embedding_multiplier", "residual_multiplier", "logits_scaling", "query_scale"):
        other = LlamaModel(replace(model.config, **{field: 1.0})).to(getattr(torch, dtype))
        other.load_state_dict(model.state_dict())
        assert not torch.allclose(first_logits(other.eval()).float(), logits.float(), atol=1e-3), field


def test_olmo2_runs_in_float16_where_gemma_2_is_refused(tmp_path):
    hf = drawn(hf_tiny("Olmo2"), torch.float16)
    hf.save_pretrained(tmp_path)
    model = load_checkpoint(tmp_path)
    assert model.config.dtype == "float16"
    for p, tokens in zip(prompts([13, 30]), generate(model, prompts([13, 30]))):
        assert_greedy_up_to_rounding(hf, p, tokens)
