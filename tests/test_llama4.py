"""Llama 4's text model (``llama4_text``): chunked attention on its RoPE layers, NoPE layers whose queries
are tempered by position, q and k normed after RoPE without a weight, RoPE over interleaved pairs, and a
mixture of experts whose router weighs each expert's input beside a shared expert, on every
``interleave_moe_layer_step``-th layer. The engine generates what transformers generates from the same
directory, and each of those rules, broken, changes the tokens."""
from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

import engine.model

from conftest import assert_greedy_up_to_rounding, hf_greedy
from engine.checkpoint import CheckpointError, load_checkpoint, read_config, read_sizes
from engine.model import InputWeighedMoE, Rotary, routed
from rlctl.bench.engine import hf_twin
from test_gpt_oss import generate
from test_moe import prompts

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()


def hf_llama4(dtype: torch.dtype = torch.float32, **extra):
    """A tiny Llama 4: 4 layers (the last NoPE, the others attending in chunks of 16 tokens, which the prompts
    and their decodes cross), experts on every other layer, temperature rising every 4 positions; its routers,
    norms and experts drawn far from their initial values, so that a wrong pick, weight or norm shows."""
    torch.manual_seed(0)
    cfg = transformers.Llama4TextConfig(**{
        **dict(vocab_size=300, hidden_size=48, intermediate_size=32, intermediate_size_mlp=96, num_hidden_layers=4,
               num_attention_heads=6, num_key_value_heads=2, head_dim=8, max_position_embeddings=512,
               rms_norm_eps=1e-6, num_local_experts=4, num_experts_per_tok=1, interleave_moe_layer_step=2,
               attention_chunk_size=16, floor_scale=4, attn_scale=0.5,
               rope_parameters={"rope_type": "default", "rope_theta": 100.0},
               bos_token_id=None, eos_token_id=None, pad_token_id=None, initializer_range=0.1), **extra})
    hf = transformers.Llama4ForCausalLM(cfg).eval()
    with torch.no_grad():
        for key, p in hf.named_parameters():
            if "router" in key:
                p.normal_(0.0, 1.0)
            elif key.endswith("norm.weight"):
                p.normal_(1.0, 0.3)
            elif ".experts." in key:
                p.normal_(0.0, 0.1)
    return hf.to(dtype)


SCOUT_ROPE = {"rope_type": "llama3", "rope_theta": 100.0, "factor": 16.0, "low_freq_factor": 1.0,
              "high_freq_factor": 1.0, "original_max_position_embeddings": 64}  # Scout's, its context shrunk


@pytest.mark.parametrize("top_k, rope", [(1, None), (2, None), (1, SCOUT_ROPE)])
def test_a_llama4_checkpoint_generates_what_transformers_generates(tmp_path, top_k, rope):
    # Scout's RoPE scaling (Llama 3's with equal factors: wavelengths past the original context divided by the
    # factor, no band blended) and Maverick's (none)
    hf = hf_llama4(num_experts_per_tok=top_k, **({"rope_parameters": rope} if rope else {}))
    hf.save_pretrained(tmp_path)
    model = load_checkpoint(tmp_path)
    mc = model.config
    assert (mc.window_layers, mc.sliding_window, mc.window_chunked, mc.nope_layers) == ((0, 1, 2), 16, True, (3,))
    assert (mc.dense_layers, mc.intermediate_size, mc.moe_intermediate_size, mc.router) == ((0, 2), 96, 32, "sigmoid_input")
    assert mc.attn_temperature == (4.0, 0.5) and mc.qk_l2_norm and mc.rope_interleaved
    assert mc.param_count() == hf.num_parameters()
    assert isinstance(model.model.layers[1].mlp, InputWeighedMoE)
    with pytest.raises(ValueError, match="no transformers twin is built here of .* chunked attention .*Llama 4's"):
        hf_twin(model)  # the bench's twin builds none: transformers' own class is the reference here
    ps = prompts([13, 30, 21])
    outputs = generate(model, ps)
    assert len({t for o in outputs for t in o}) > 8  # tokens that vary, so that a difference shows
    assert outputs == [hf_greedy(hf, p, 12) for p in ps]


def test_a_bf16_llama4_checkpoint_generates_what_transformers_generates_up_to_rounding(tmp_path, monkeypatch):
    # transformers rotates Llama 4's queries and keys in float32 (complex arithmetic) and rounds once; the
    # engine rotates in bf16 with bf16 cos and sin, as vLLM's rotary embedding does: its tokens are within 4
    # units in the last place of transformers' top logit. Rotated in float32 as transformers does, within 1
    hf = hf_llama4(torch.bfloat16)
    hf.save_pretrained(tmp_path)
    model = load_checkpoint(tmp_path)
    assert model.config.dtype == "bfloat16"
    ps = prompts([13, 30])
    for p, tokens in zip(ps, generate(model, ps)):
        assert_greedy_up_to_rounding(hf, p, tokens, ulps=4)
    cos_sin, rotate = Rotary.forward, engine.model.rotate
    monkeypatch.setattr(Rotary, "forward", lambda self, positions, dtype: cos_sin(self, positions, torch.float32))
    monkeypatch.setattr(engine.model, "rotate", lambda x, cos, sin: rotate(x.float(), cos, sin).to(x.dtype))
    for p, tokens in zip(ps, generate(load_checkpoint(tmp_path), ps)):
        assert_greedy_up_to_rounding(hf, p, tokens, ulps=1)


def _output_weighed(self, x):  # the routers' weights on what comes out of each expert, as Mixtral's
    top, picked = torch.topk(self.gate(x), self.top_k, dim=-1)
    return self.shared_expert(x) + routed(x, picked, torch.sigmoid(top.float()).to(x.dtype), self.experts.one)


def test_each_of_llama4s_rules_changes_what_it_generates(tmp_path, monkeypatch):
    hf = hf_llama4()
    hf.save_pretrained(tmp_path)
    ps = prompts([13, 30, 21])
    expected = [hf_greedy(hf, p, 12) for p in ps]
    assert generate(load_checkpoint(tmp_path), ps) == expected

    def broken(change) -> list[list[int]]:
        model = load_checkpoint(tmp_path)
        change(model)
        return generate(model, ps)

    def attention(**attrs):
        def change(model):
            for layer in model.model.layers:
                for name, value in attrs.items():
                    if hasattr(layer.self_attn, name) and getattr(layer.self_attn, name) not in (None, False):
                        setattr(layer.self_attn, name, value)
        return change

    def config(**fields):
        def change(model):
            model.config = replace(model.config, **fields)
        return change

    assert broken(config(window_chunked=False)) != expected  # a sliding window of 16 in place of chunks
    assert broken(attention(tempered=False)) != expected
    assert broken(attention(l2_norm=None)) != expected
    assert broken(attention(interleaved=False)) != expected
    monkeypatch.setattr(InputWeighedMoE, "forward", _output_weighed)
    assert broken(lambda model: None) != expected


def test_llama4_reads_its_layers_from_config_json_or_transformers_rules(tmp_path):
    hf = hf_llama4()
    hf.save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())

    def read(**fields):
        (tmp_path / "config.json").write_text(json.dumps({**cfg, **fields}))
        return read_config(tmp_path)

    # layer_types and no_rope_layers as transformers 5 writes them, or left to its rules
    mc = read(layer_types=None, no_rope_layers=[], moe_layers=None, interleave_moe_layer_step=1)
    assert (mc.window_layers, mc.nope_layers, mc.dense_layers) == ((0, 1, 2), (3,), ())
    mc = read(layer_types=["full_attention", "chunked_attention", "full_attention", "full_attention"],
              no_rope_layers=[0, 1, 1, 1], moe_layers=[0])
    assert (mc.window_layers, mc.nope_layers, mc.dense_layers) == ((1,), (0,), (1, 2, 3))
    mc = read(attention_chunk_size=None, layer_types=None)  # no chunks: every layer attends fully
    assert (mc.window_layers, mc.window_chunked) == ((), False)
    mc = read(attention_chunk_size=4096)  # as long as the context: nothing masked
    assert mc.window_layers == ()
    assert read(attn_temperature_tuning=False).attn_temperature is None
    assert not read(use_qk_norm=False).qk_l2_norm
    for fields, match in (({"moe_layers": [7]}, "moe_layers must list layers of the 4"),
                          ({"layer_types": ["sliding_attention"] * 4}, "layer_types must give each of the 4 layers"),
                          ({"attention_chunk_size": 0}, "attention_chunk_size must be a whole number of tokens >= 1"),
                          ({"moe_layers": None, "interleave_moe_layer_step": 0}, "interleave_moe_layer_step must be > 0"),
                          ({"floor_scale": 0}, "floor_scale must be a number > 0")):
        with pytest.raises(CheckpointError, match=match):
            read(**fields)


def test_llama4_scout_and_maverick_are_sized_as_transformers_builds_them(tmp_path):
    # transformers' defaults are Llama-4-Scout's text model (16 experts on every layer); Maverick's has 128,
    # on every other layer, and no q/k norm. Their chunked layers' KV is sized whole, and said so
    for name, fields in (("scout", {}), ("maverick", {"num_local_experts": 128, "interleave_moe_layer_step": 2,
                                                      "use_qk_norm": False})):
        hf_cfg = transformers.Llama4TextConfig(**fields)
        (tmp_path / "config.json").write_text(json.dumps({**hf_cfg.to_dict(), "torch_dtype": "bfloat16"}))
        m, notes = read_sizes(tmp_path)
        with torch.device("meta"):
            built = transformers.Llama4ForCausalLM(hf_cfg)
        assert m.param_count() == built.num_parameters(), name
        assert m.window_layers == tuple(i for i in range(48) if (i + 1) % 4) and m.sliding_window == 8192
        assert any("chunked attention (8192 tokens) frees no KV here" in n for n in notes)


def test_a_multimodal_llama4_checkpoint_loads_its_text_model_and_counts_its_tower(tmp_path):
    # Scout's and Maverick's checkpoints (llama4) hold the text model under language_model beside a vision
    # tower and projector: the engine runs the text model, and counts the rest as transformers builds it
    text = hf_llama4()
    vision = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=40,
                  vision_output_dim=24, image_size=28, patch_size=14, projector_input_dim=40, projector_output_dim=24)
    cfg = transformers.Llama4Config(text_config=text.config.to_dict(), vision_config=vision)
    torch.manual_seed(1)
    hf = transformers.Llama4ForConditionalGeneration(cfg).eval()
    hf.language_model.load_state_dict(text.state_dict())
    hf.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["model_type"] == "llama4" and saved["architectures"] == ["Llama4ForConditionalGeneration"]
    model = load_checkpoint(tmp_path)
    ps = prompts([13, 30])
    assert generate(model, ps) == [hf_greedy(text, p, 12) for p in ps]
    m, _ = read_sizes(tmp_path)
    assert m.param_count() == hf.num_parameters() and m.encoder_params == sum(
        p.numel() for mod in (hf.vision_model, hf.multi_modal_projector) for p in mod.parameters())
    with torch.device("meta"):  # Llama 4 with transformers' defaults (Scout's text model, another tower)
        built = transformers.Llama4ForConditionalGeneration(transformers.Llama4Config())
    (tmp_path / "config.json").write_text(json.dumps(transformers.Llama4Config().to_dict()))
    assert read_sizes(tmp_path)[0].param_count() == built.num_parameters() == 108_225_039_360


# Llama-4-Scout-17B-16E-Instruct's config.json's fields where they differ from transformers' defaults
SCOUT_TEXT = {"attn_temperature_tuning": 4, "no_rope_layers": [], "moe_layers": list(range(48)),
              "max_position_embeddings": 10_485_760, "rope_theta": 500_000.0,
              "rope_scaling": {"rope_type": "llama3", "factor": 16.0,
              "low_freq_factor": 1.0, "high_freq_factor": 1.0, "original_max_position_embeddings": 8192}}
SCOUT_VISION = {"hidden_size": 1408, "vision_output_dim": 4096, "image_size": 336}


def test_scouts_published_fields_are_read_and_counted_as_transformers_builds_them(tmp_path):
    # its attn_temperature_tuning is a number (4: true, as transformers 4 and vLLM read it; transformers 5
    # refuses it, so its build below takes true), its no_rope_layers empty (transformers' every fourth), its
    # RoPE Llama 3's with equal factors (once refused here)
    cfg = {**transformers.Llama4Config(vision_config=SCOUT_VISION).to_dict(), "torch_dtype": "bfloat16"}
    cfg["text_config"] = {**cfg["text_config"], **SCOUT_TEXT}
    cfg["text_config"].pop("rope_parameters", None)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    mc = read_config(tmp_path)
    assert mc.attn_temperature == (8192.0, 0.1) and mc.nope_layers == tuple(range(3, 48, 4))
    assert (mc.rope_scaling.kind, mc.rope_scaling.low_freq_factor, mc.rope_scaling.high_freq_factor) == ("llama3", 1, 1)
    assert mc.dense_layers == () and mc.window_layers == tuple(i for i in range(48) if (i + 1) % 4)
    text = {**SCOUT_TEXT, "attn_temperature_tuning": True, "rope_parameters": {"rope_theta": 500_000.0,
                                                                              **SCOUT_TEXT["rope_scaling"]}}
    del text["rope_scaling"], text["rope_theta"]
    with torch.device("meta"):
        built = transformers.Llama4ForConditionalGeneration(transformers.Llama4Config(
            text_config=text, vision_config=SCOUT_VISION))
    assert read_sizes(tmp_path)[0].param_count() == built.num_parameters() == 108_641_793_536
