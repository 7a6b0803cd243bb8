"""Kimi K2.5 checkpoints (``kimi_k25``): the engine runs the text model (Kimi K2's, DeepSeek-V3's) beside the MoonViT
tower and projector, which it counts; it generates what transformers generates from the same directory, read
from the published layout (``language_model.model.layers``) or transformers 5's (``language_model.model.blocks``),
its text model named kimi_k2 or deepseek_v3; the published sizes are counted as transformers builds them."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import drawn_apart, hf_greedy
from engine.checkpoint import CheckpointError, load_checkpoint, read_sizes
from engine.model import LatentAttention
from test_gpt_oss import generate
from test_moe import prompts

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

TEXT = dict(vocab_size=300, hidden_size=48, intermediate_size=96, num_hidden_layers=3, num_attention_heads=6,
            num_key_value_heads=6, kv_lora_rank=16, q_lora_rank=24, qk_nope_head_dim=8, qk_rope_head_dim=8,
            v_head_dim=8, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=24,
            first_k_dense_replace=1, n_group=4, topk_group=2, routed_scaling_factor=2.5, max_position_embeddings=512,
            bos_token_id=None, eos_token_id=None, pad_token_id=None, tie_word_embeddings=False, model_type="deepseek_v3")
VISION = dict(hidden_size=32, intermediate_size=40, num_hidden_layers=2, num_attention_heads=2, patch_size=4,
              pos_emb_height=8, pos_emb_width=8)


def test_a_kimi_k25_checkpoint_runs_its_text_model_and_counts_its_tower(tmp_path):
    torch.manual_seed(0)
    hf = transformers.Kimi_K25ForConditionalGeneration(transformers.Kimi_K25Config(
        text_config=TEXT, vision_config=VISION, projection_hidden_size=32, tie_word_embeddings=False)).eval()
    hf = drawn_apart(hf, mlp_scale=2)
    hf.save_pretrained(tmp_path)
    ps = prompts([13, 30])
    expected = [hf_greedy(hf, p, 12) for p in ps]
    assert len({t for o in expected for t in o}) > 8
    model = load_checkpoint(tmp_path)
    assert isinstance(model.model.layers[0].self_attn, LatentAttention) and model.config.router == "sigmoid_groups"
    assert generate(model, ps) == expected
    m, _ = read_sizes(tmp_path)
    vision = sum(p.numel() for name, p in hf.named_parameters() if "vision_tower" in name or "mm_projector" in name)
    assert m.param_count() == hf.num_parameters() and m.encoder_params == vision
    # the published layout: its text model's layers under language_model.model.layers, the text model named kimi_k2
    state = load_file(str(tmp_path / "model.safetensors"))
    assert any(k.startswith("language_model.model.blocks.") for k in state)  # as transformers 5 saves it
    save_file({k.replace("language_model.model.blocks.", "language_model.model.layers."): v for k, v in state.items()},
              str(tmp_path / "model.safetensors"))
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "text_config": {**cfg["text_config"], "model_type": "kimi_k2"}}))
    assert generate(load_checkpoint(tmp_path), ps) == expected
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "text_config": {**cfg["text_config"], "model_type": "qwen3"}}))
    with pytest.raises(CheckpointError, match="text_config.model_type 'qwen3' is not supported"):
        read_sizes(tmp_path)


def test_kimi_k25_is_sized_as_transformers_builds_it(tmp_path):
    # transformers' defaults: DeepSeek-V3's text model beside Kimi K2.5's MoonViT tower
    cfg = transformers.Kimi_K25Config(tie_word_embeddings=False)
    (tmp_path / "config.json").write_text(json.dumps({**cfg.to_dict(), "torch_dtype": "bfloat16"}))
    m, _ = read_sizes(tmp_path)
    with torch.device("meta"):
        built = transformers.Kimi_K25ForConditionalGeneration(cfg)
    assert m.param_count() == built.num_parameters()
    assert m.encoder_params == sum(p.numel() for name, p in built.named_parameters()
                                   if "vision_tower" in name or "mm_projector" in name)


def test_kimi_k25_reads_its_published_fields_its_quantisation_under_text_config(tmp_path):
    # Kimi K2.5's release writes its tower's sizes under Moonshot's names (vt_*, init_pos_emb_*, mm_hidden_size) and
    # its INT4 quantisation (compressed-tensors, groups of 32) under text_config, where transformers and vLLM read it
    cfg = {k: v for k, v in transformers.Kimi_K25Config(tie_word_embeddings=False).to_dict().items()
           if k != "projection_hidden_size"}  # the release gives it as vision_config's mm_hidden_size
    names = {"hidden_size": "vt_hidden_size", "intermediate_size": "vt_intermediate_size",
             "num_hidden_layers": "vt_num_hidden_layers", "pos_emb_height": "init_pos_emb_height",
             "pos_emb_width": "init_pos_emb_width"}
    vision = {names.get(k, k): v for k, v in cfg["vision_config"].items()}
    vision = {**vision, "vt_hidden_size": 768, "mm_hidden_size": 768}
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "vision_config": vision, "torch_dtype": "bfloat16"}))
    m, _ = read_sizes(tmp_path)
    with torch.device("meta"):
        built = transformers.Kimi_K25ForConditionalGeneration(transformers.Kimi_K25Config(
            tie_word_embeddings=False, projection_hidden_size=768,
            vision_config={**cfg["vision_config"], "hidden_size": 768}))
    assert m.param_count() == built.num_parameters() and m.weight_bits is None
    int4 = {"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"group_0": {
        "targets": ["Linear"], "weights": {"num_bits": 4, "type": "int", "group_size": 32, "strategy": "group"}}}}
    text = {**cfg["text_config"], "quantization_config": int4}
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "text_config": text, "torch_dtype": "bfloat16"}))
    assert deployment_bits(tmp_path) == 4


def deployment_bits(directory) -> int | None:
    from engine.checkpoint import weight_bits

    return weight_bits(directory)
