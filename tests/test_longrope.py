"""LongRoPE (Phi-3's 128k contexts, Phi-3.5, Phi-4-mini): each frequency divided by its own factor, the long
ones where the engine serves contexts past the original one and the short ones otherwise, as vLLM picks them
once by its max_model_len, cos and sin scaled by sqrt(1 + ln(factor) / ln(original context)). transformers
picks by each forward pass's longest position instead, so the two agree where a sequence stays within the
original context in an engine that serves no more, and where a prompt is already past it; the engine
generates transformers' tokens in both."""
from __future__ import annotations

import json

import pytest
import torch

from conftest import hf_greedy, hf_tiny
from engine.checkpoint import load_checkpoint, read_config
from engine.config import EngineConfig
from engine.engine import Engine
from engine.request import Request
from rlctl.bench.engine import hf_twin
from test_moe import prompts

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()


def hf_phi3_longrope(partial: float):
    """A tiny Phi-3 pre-trained on 16 tokens and declared for 64 (a factor of 4), with LongRoPE's factors drawn
    apart; with ``partial`` < 1 RoPE over that share of each head, as Phi-4-mini's three quarters."""
    g = torch.Generator().manual_seed(3)
    n = int(8 * partial) // 2
    short, long = (1 + 2 * torch.rand(n, generator=g)).tolist(), (2 + 6 * torch.rand(n, generator=g)).tolist()
    return hf_tiny("Phi3", head_dim=8, max_position_embeddings=64, original_max_position_embeddings=16,
                   partial_rotary_factor=partial, initializer_range=0.1, pad_token_id=None,
                   rope_parameters={"rope_type": "longrope", "rope_theta": 100.0, "short_factor": short,
                                    "long_factor": long})


def generate(model, ps: list[list[int]], max_model_len: int) -> list[list[int]]:
    eng = Engine(model.config, EngineConfig(num_blocks=64, block_size=4, max_model_len=max_model_len,
                                            max_num_batched_tokens=24), model=model, keep_outputs=True)
    for i, p in enumerate(ps):
        eng.submit(Request(f"c{i}", 0.0, len(p), 12, 12, prompt_ids=tuple(p)))
    eng.run()
    return [eng.outputs[f"c{i}"] for i in range(len(ps))]


@pytest.mark.parametrize("partial", [1.0, 0.75])
def test_a_longrope_checkpoint_generates_what_transformers_generates(tmp_path, partial):
    hf = hf_phi3_longrope(partial)
    hf.save_pretrained(tmp_path)
    model = load_checkpoint(tmp_path)
    scaling = model.config.rope_scaling
    assert (scaling.kind, scaling.original_max_position, scaling.factor) == ("longrope", 16, 4.0)
    assert scaling.cos_scale == pytest.approx((1 + torch.log(torch.tensor(4.0)).item() / torch.log(torch.tensor(16.0)).item()) ** 0.5)
    past = prompts([20, 30, 25])  # past the original context from the prompt on: transformers' long factors throughout
    outputs = generate(model, past, 64)
    assert len({t for o in outputs for t in o}) > 5
    assert outputs == [hf_greedy(hf, p, 12) for p in past]
    within = prompts([3, 4])  # 16 tokens at most: transformers' short factors, and an engine serving 16 picks them
    assert generate(model, within, 16) == [hf_greedy(hf, p, 12) for p in within]
    assert torch.equal(model.rotary.inv_freq, model.rotary.longrope[0])
    # an engine serving 64 tokens rotates by the long factors from the first token, as vLLM does
    assert generate(model, within, 64) != [hf_greedy(hf, p, 12) for p in within]
    assert torch.equal(model.rotary.inv_freq, model.rotary.longrope[1])
    model.rotary.longrope_scales = (1.0, 1.0)  # without the attention factor the tokens change
    assert generate(model, past, 64) != outputs
    with pytest.raises(ValueError, match="no transformers twin is built here of " + ("LongRoPE" if partial == 1 else
                                                                                   "latent attention, .*partial")):
        hf_twin(model)  # a twin would pick its factors by another rule


def test_the_factors_are_picked_by_the_context_the_engine_is_configured_for_not_its_kv():
    # vLLM refuses a max_model_len its KV cannot hold rather than shortening it: an engine configured for 64
    # tokens with KV for 16 still rotates by the long factors
    model = load_checkpoint_of(hf_phi3_longrope(1.0))
    Engine(model.config, EngineConfig(num_blocks=4, block_size=4, max_model_len=64), model=model)
    assert torch.equal(model.rotary.inv_freq, model.rotary.longrope[1])
    Engine(model.config, EngineConfig(num_blocks=64, block_size=4, max_model_len=16), model=model)
    assert torch.equal(model.rotary.inv_freq, model.rotary.longrope[0])


def load_checkpoint_of(hf, directory=None):
    import tempfile

    directory = directory or tempfile.mkdtemp()
    hf.save_pretrained(directory)
    return load_checkpoint(directory)


def test_longrope_is_read_as_vllm_reads_it_under_either_name(tmp_path):
    # su (its first name), vLLM's short_mscale and long_mscale scaling cos and sin with each set of factors, a
    # factor or attention_factor read past as vLLM reads past them (transformers scales by them), Phi-3's original
    # context at config.json's top level, 4,096 where it gives none (its configuration class's default)
    hf_phi3_longrope(1.0).save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    params = cfg.pop("rope_parameters")
    cfg["rope_theta"] = params.pop("rope_theta")
    del params["rope_type"]
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "rope_scaling": {
        **params, "type": "su", "short_mscale": 1.5, "long_mscale": 1.25, "factor": 8.0, "attention_factor": 9.0}}))
    model = load_checkpoint(tmp_path)
    scaling = model.config.rope_scaling
    assert (scaling.kind, scaling.factor, scaling.cos_scale, scaling.long_cos_scale) == ("longrope", 4.0, 1.5, 1.25)
    Engine(model.config, EngineConfig(num_blocks=64, block_size=4, max_model_len=64), model=model)
    assert model.rotary.cos_scale == 1.25
    Engine(model.config, EngineConfig(num_blocks=64, block_size=4, max_model_len=16), model=model)
    assert model.rotary.cos_scale == 1.5
    del cfg["original_max_position_embeddings"]
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "rope_scaling": {**params, "type": "longrope"}}))
    assert read_config(tmp_path).rope_scaling.original_max_position == 4096
