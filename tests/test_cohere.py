"""Cohere checkpoints (``cohere``: Command R, R+, Aya; ``cohere2``: Command R7B, Command A): the engine generates
what transformers generates from the same directory (LayerNorms without a bias, attention and the MLP side by side
on one norm of each layer's input, RoPE over interleaved pairs, the logits times ``logit_scale``; Command R+'s q
and k heads normed each with a weight of its own; Cohere 2's windowed layers alone rotate, its full-attention
layers attending without positions), and its sizes are counted as transformers builds them."""
from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from conftest import assert_generates_as, drawn_apart, hf_tiny
from engine.checkpoint import CheckpointError, load_checkpoint, read_config, read_sizes
from engine.model import LayerNorm, LlamaModel
from test_gpt_oss import generate
from test_moe import prompts

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

# four layers, so that Cohere 2's fourth attends fully; a window the prompts pass; weights drawn wide enough
# that the tiny model's tokens vary
COHERE = dict(head_dim=8, initializer_range=0.1, logit_scale=0.25, num_hidden_layers=4)


def hf_cohere(name: str, dtype: torch.dtype = torch.float32, **extra):
    return drawn_apart(hf_tiny(name, **{**COHERE, **extra})).to(dtype)


def variant(model: LlamaModel, **fields) -> LlamaModel:
    """``model``'s weights in a model whose configuration differs by ``fields``."""
    other = LlamaModel(replace(model.config, **fields))
    other.load_state_dict(model.state_dict())
    return other.eval()


CASES = [("Cohere", {}), ("Cohere", {"use_qk_norm": True}), ("Cohere2", {"sliding_window": 16})]


@pytest.mark.parametrize("name, extra", CASES)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_cohere_checkpoint_generates_what_transformers_generates(tmp_path, name, extra, dtype):
    hf = hf_cohere(name, getattr(torch, dtype), **extra)
    hf.save_pretrained(tmp_path)
    model = load_checkpoint(tmp_path)
    mc = model.config
    assert (mc.layer_norm, mc.parallel_block, mc.rope_interleaved, mc.logits_scaling, mc.tie_word_embeddings) == (
        True, True, True, 4.0, True)
    assert isinstance(model.model.norm, LayerNorm) and not hasattr(model.model.layers[0], "post_attention_layernorm")
    if name == "Cohere2":  # three windowed, rotating layers; the fourth attends fully without positions
        assert (mc.window_layers, mc.nope_layers, mc.sliding_window) == ((0, 1, 2), (3,), 16)
    if extra.get("use_qk_norm"):  # a weight for each of q's 6 heads' 8 features, and k's 2
        assert tuple(model.model.layers[0].self_attn.q_norm.weight.shape) == (6, 8)
    assert mc.param_count() == hf.num_parameters()
    ps = prompts([13, 30, 21])
    outputs = generate(model, ps)
    assert len({t for o in outputs for t in o}) > 8
    assert_generates_as(hf, ps, outputs, exact=dtype == "float32")
    if dtype == "float32":  # each of its differences changes the tokens
        changes = [{"rope_interleaved": False}, {"nope_layers": ()} if name == "Cohere2" else {}]
        for fields in filter(None, changes):
            assert generate(variant(model, **fields), ps) != outputs, fields
        rms = variant(model, layer_norm=False)
        assert generate(rms, ps) != outputs


def test_cohere_logits_are_transformers_times_its_logit_scale(tmp_path):
    hf = hf_cohere("Cohere")
    hf.save_pretrained(tmp_path)
    model = load_checkpoint(tmp_path)
    ps = prompts([13])
    seen = []
    hook = model.register_forward_hook(lambda module, args, out: seen.append(out))
    generate(model, ps, new_tokens=1)
    hook.remove()
    with torch.no_grad():
        expected = hf(torch.tensor(ps)).logits[0, -1]
    torch.testing.assert_close(seen[0][0], expected)
    assert not torch.allclose(seen[0][0] * 4.0, expected)  # the scale is applied, not left out


def test_cohere2_reads_its_window_pattern_where_it_writes_no_layer_types(tmp_path):
    # transformers 4's Cohere 2 configs give sliding_window_pattern (4 by default: every fourth layer full)
    cfg = transformers.Cohere2Config(num_hidden_layers=8, sliding_window=4096).to_dict()
    del cfg["layer_types"]
    for pattern, full in ((None, (3, 7)), (2, (1, 3, 5, 7))):
        (tmp_path / "config.json").write_text(json.dumps({**cfg, **({"sliding_window_pattern": pattern} if pattern else {})}))
        mc = read_config(tmp_path)
        assert mc.nope_layers == full and mc.window_layers == tuple(i for i in range(8) if i not in full)
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "sliding_window": None}))
    assert read_config(tmp_path).nope_layers == tuple(range(8))  # no window: no layer rotates, as transformers runs it
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "layer_norm_eps": 0}))
    with pytest.raises(CheckpointError, match="layer_norm_eps must be a number > 0"):
        read_config(tmp_path)


@pytest.mark.parametrize("name", ["Cohere", "Cohere2"])
def test_cohere_takes_transformers_rope_base_where_config_json_gives_none(tmp_path, name):
    # CohereConfig's RoPE base is 500,000, Cohere2Config's 10,000
    fields = {k: v for k, v in getattr(transformers, f"{name}Config")().to_dict().items()
              if k not in ("rope_parameters", "rope_theta", "rope_scaling")}
    (tmp_path / "config.json").write_text(json.dumps(fields))
    expected = transformers.AutoConfig.from_pretrained(tmp_path).rope_parameters["rope_theta"]
    assert read_config(tmp_path).rope_theta == expected == (500_000.0 if name == "Cohere" else 10_000.0)


def test_command_r_and_r_plus_are_sized_as_transformers_builds_them(tmp_path):
    # transformers' defaults are Command R's (c4ai-command-r-v01, 35B); R+'s (104B) adds q and k norms with a
    # weight for each head, and a 4,096-token window would make Cohere 2's layers windowed
    for config, model, fields, params in (
            (transformers.CohereConfig, transformers.CohereForCausalLM, {}, 34_980_831_232),
            (transformers.CohereConfig, transformers.CohereForCausalLM,
             {"hidden_size": 12_288, "intermediate_size": 33_792, "num_hidden_layers": 64, "num_attention_heads": 96,
              "num_key_value_heads": 8, "use_qk_norm": True, "logit_scale": 0.8333333333333334}, 103_810_674_688),
            (transformers.Cohere2Config, transformers.Cohere2ForCausalLM, {}, 34_980_831_232)):
        cfg = config(**fields)
        (tmp_path / "config.json").write_text(json.dumps({**cfg.to_dict(), "torch_dtype": "bfloat16"}))
        m, notes = read_sizes(tmp_path)
        with torch.device("meta"):
            built = model(cfg)
        assert m.param_count() == built.num_parameters() == params
