"""A local checkpoint on a named GPU is a deployment (``CHECKPOINT_DIR@GPU``): sized from its
``config.json`` alone as vLLM sizes it, so that a policy can be judged on a user's own model."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from engine.checkpoint import CheckpointError, read_sizes
from engine.roofline import GB, RooflineCostModel, deployment
from engine.scheduler import BatchShape
from env.scenario_yaml import ScenarioError, load_scenario
from experiments import CHECKPOINTS, SCENARIOS
from rlctl.cli import main

# config.json as the published checkpoints ship it (transformers 4's layout), without weights
QWEN25_7B = json.loads((CHECKPOINTS / "Qwen2.5-7B-Instruct" / "config.json").read_text())


def checkpoint(tmp_path: Path, name: str, config: dict) -> Path:
    directory = tmp_path / name
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def test_a_checkpoint_on_a_gpu_is_sized_from_its_config_as_vllm_sizes_it(tmp_path):
    d = deployment("Qwen2.5-7B-Instruct@l40s")  # shipped (experiments/checkpoints), found by name
    m = d.model
    # the ledger counts what the checkpoint holds: Qwen2.5-7B's published 7,615,616,512 parameters
    # (its q/k/v biases included) in bf16, and 28 layers x 4 KV heads x 128 x K and V x 2 bytes a token
    assert m.param_count() == 7_615_616_512 and m.qkv_bias and m.dtype == "bfloat16" and m.weight_bits is None
    assert m.weight_bytes() == 2 * 7_615_616_512 and m.kv_bytes_per_token() == 57_344
    assert d.max_model_len == 32768 and d.gpu.memory_bytes == 48 * GB
    kv = d.num_blocks() * d.block_size * m.kv_bytes_per_token()
    assert 0 < kv <= 0.9 * 48 * GB - m.weight_bytes()  # 90 % of the GPU, less weights and the workspace
    assert "7.6B params at 16 bits on NVIDIA L40S 48GB" in d.describe()
    # its own head_dim (128, where 2560 / 32 heads is 80), per-head norms, tied embeddings: 4,022,468,096
    q3 = deployment(f"{CHECKPOINTS / 'Qwen3-4B'}@h100")
    assert q3.model.param_count() == 4_022_468_096 and q3.model.head_dim == 128 and q3.model.qk_norm
    assert q3.max_model_len == 32768  # 40,960 capped
    # Qwen3-8B's 8,190,735,360 and the AWQ Qwen2.5-32B's 32,763,876,352, counted at 4 bits
    assert deployment("Qwen3-8B@h100").model.param_count() == 8_190_735_360
    awq = deployment("Qwen2.5-32B-Instruct-AWQ@h100").model
    assert awq.param_count() == 32_763_876_352 and awq.weight_bits == 4


def test_a_gemma_2_checkpoint_is_sized_with_its_own_norms_and_window(tmp_path):
    # google/gemma-2-9b-it's config.json: 42 layers of 16 query heads over 8 KV heads of 256, four norms a
    # layer, tied embeddings over 256,000 tokens: the 9,241,705,984 parameters (9.24B) its card gives; float32 on disk,
    # served at 16 bits; every other layer attends through a 4,096-token window, sized as full attention
    gemma2 = {"architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2", "attention_bias": False,
              "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0, "head_dim": 256,
              "hidden_act": "gelu_pytorch_tanh", "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 3584,
              "intermediate_size": 14336, "max_position_embeddings": 8192, "num_attention_heads": 16,
              "num_hidden_layers": 42, "num_key_value_heads": 8, "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06,
              "rope_theta": 10000.0, "sliding_window": 4096, "torch_dtype": "float32", "vocab_size": 256000}
    d = deployment(f"{checkpoint(tmp_path, 'gemma-2-9b-it', gemma2)}@l40s")
    m = d.model
    assert m.param_count() == 9_241_705_984 and m.tie_word_embeddings and m.sandwich_norms and m.dtype_bytes == 2
    assert m.kv_bytes_per_token() == 2 * 42 * 8 * 256 * 2 and d.max_model_len == 8192
    assert "sliding window (4096 tokens) frees no KV here: the KV is sized as full attention" in d.describe()
    # head_dim and the context default to Gemma's 256 and 8,192 where config.json leaves them out, as
    # transformers defaults them; Gemma 1 attends fully whatever a sliding_window field says
    bare = {k: v for k, v in gemma2.items() if k not in ("head_dim", "max_position_embeddings")}
    assert deployment(f"{checkpoint(tmp_path, 'bare', bare)}@l40s").model == m
    gemma = deployment(f"{checkpoint(tmp_path, 'gemma', {**bare, 'model_type': 'gemma'})}@l40s")
    assert gemma.model.window_layers == () and not gemma.notes


def test_mistral_3_checkpoints_are_sized_with_their_vision_tower(tmp_path):
    # Mistral-Small-3.1-24B-Instruct-2503's config.json: 23,572,403,200 parameters in the decoder (its
    # lm_head its own) and 438,958,080 in its Pixtral tower and projector, the 24,011,361,280 its
    # weights hold; transformers builds the same, the lm_head untied as the checkpoint holds it
    import torch
    import transformers

    small = {"architectures": ["Mistral3ForConditionalGeneration"], "image_token_index": 10, "model_type": "mistral3",
             "multimodal_projector_bias": False, "projector_hidden_act": "gelu", "spatial_merge_size": 2,
             "text_config": {"head_dim": 128, "hidden_act": "silu", "hidden_size": 5120, "intermediate_size": 32768,
                             "max_position_embeddings": 131072, "model_type": "mistral", "num_attention_heads": 32,
                             "num_hidden_layers": 40, "num_key_value_heads": 8, "rms_norm_eps": 1e-05,
                             "rope_theta": 1000000000.0, "sliding_window": None, "vocab_size": 131072},
             "torch_dtype": "bfloat16",
             "vision_config": {"head_dim": 64, "hidden_act": "silu", "hidden_size": 1024, "image_size": 1540,
                               "intermediate_size": 4096, "model_type": "pixtral", "num_attention_heads": 16,
                               "num_hidden_layers": 24, "patch_size": 14, "rope_theta": 10000.0},
             "vision_feature_layer": -1}
    directory = checkpoint(tmp_path, "Mistral-Small-3.1-24B-Instruct-2503", small)
    d = deployment(f"{directory}@h100")
    m = d.model
    assert m.param_count() == 24_011_361_280 and m.encoder_params == 438_958_080 and m.dtype == "bfloat16"
    assert not m.tie_word_embeddings and m.kv_bytes_per_token() == 2 * 40 * 8 * 128 * 2 and not m.window_layers
    with torch.device("meta"):
        built = transformers.Mistral3ForConditionalGeneration(transformers.AutoConfig.for_model(
            **{**small, "tie_word_embeddings": False}))
    assert built.num_parameters() == m.param_count()
    # with neither sub-config, transformers' Mistral 3 defaults are Mistral Small 3.1's; an empty one takes
    # MistralConfig's and PixtralVisionConfig's; the projector's biases and several feature layers counted
    bare = {k: v for k, v in small.items() if k not in ("text_config", "vision_config")}
    assert deployment(f"{checkpoint(tmp_path, 'bare3', bare)}@h100").model == m
    for name, fields in (("empty", {**small, "text_config": {}, "vision_config": {}}),
                         ("wide", {**small, "multimodal_projector_bias": True, "vision_feature_layer": [-1, -3],
                                   "vision_config": {k: v for k, v in small["vision_config"].items() if k != "patch_size"}})):
        with torch.device("meta"):
            built = transformers.Mistral3ForConditionalGeneration(transformers.AutoConfig.for_model(
                **{**fields, "tie_word_embeddings": False}))
        assert deployment(f"{checkpoint(tmp_path, name, fields)}@h200").model.param_count() == built.num_parameters()
    # the top level's dtype before text_config's, as vLLM reads it
    mixed = {**small, "text_config": {**small["text_config"], "torch_dtype": "float32"}}
    assert deployment(f"{checkpoint(tmp_path, 'mixed3', mixed)}@h100").model.dtype == "bfloat16"
    # a text model this engine does not run is refused, naming the field
    other = {**small, "text_config": {**small["text_config"], "model_type": "mistral_large4_text"}}
    with pytest.raises(ValueError, match="text_config.model_type 'mistral_large4_text' is not supported"):
        deployment(f"{checkpoint(tmp_path, 'other3', other)}@h100")


QWEN25_VL_7B = {  # Qwen/Qwen2.5-VL-7B-Instruct's config.json: the text model's fields at the top level
    "architectures": ["Qwen2_5_VLForConditionalGeneration"], "attention_dropout": 0.0, "bos_token_id": 151643,
    "eos_token_id": 151645, "vision_start_token_id": 151652, "vision_end_token_id": 151653, "vision_token_id": 151654,
    "image_token_id": 151655, "video_token_id": 151656, "hidden_act": "silu", "hidden_size": 3584,
    "initializer_range": 0.02, "intermediate_size": 18944, "max_position_embeddings": 128000, "max_window_layers": 28,
    "model_type": "qwen2_5_vl", "num_attention_heads": 28, "num_hidden_layers": 28, "num_key_value_heads": 4,
    "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "sliding_window": 32768, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "use_cache": True, "use_sliding_window": False,
    "vision_config": {"depth": 32, "hidden_act": "silu", "hidden_size": 1280, "intermediate_size": 3420, "num_heads": 16,
                      "in_chans": 3, "out_hidden_size": 3584, "patch_size": 14, "spatial_merge_size": 2,
                      "spatial_patch_size": 14, "window_size": 112, "fullatt_block_indexes": [7, 15, 23, 31],
                      "tokens_per_second": 2, "temporal_patch_size": 2},
    "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]}, "vocab_size": 152064}
QWEN3_VL_8B = {  # Qwen/Qwen3-VL-8B-Instruct's
    "architectures": ["Qwen3VLForConditionalGeneration"], "image_token_id": 151655, "model_type": "qwen3_vl",
    "text_config": {"attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 151643, "dtype": "bfloat16",
                    "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu", "hidden_size": 4096,
                    "initializer_range": 0.02, "intermediate_size": 12288, "max_position_embeddings": 262144,
                    "model_type": "qwen3_vl_text", "num_attention_heads": 32, "num_hidden_layers": 36,
                    "num_key_value_heads": 8, "rms_norm_eps": 1e-06,
                    "rope_scaling": {"mrope_interleaved": True, "mrope_section": [24, 20, 20], "rope_type": "default"},
                    "rope_theta": 5000000, "use_cache": True, "vocab_size": 151936},
    "tie_word_embeddings": False, "transformers_version": "4.57.0.dev0", "video_token_id": 151656,
    "vision_config": {"deepstack_visual_indexes": [8, 16, 24], "depth": 27, "hidden_act": "gelu_pytorch_tanh",
                      "hidden_size": 1152, "in_channels": 3, "initializer_range": 0.02, "intermediate_size": 4304,
                      "model_type": "qwen3_vl", "num_heads": 16, "num_position_embeddings": 2304, "out_hidden_size": 4096,
                      "patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2},
    "vision_end_token_id": 151653, "vision_start_token_id": 151652}


# Qwen2.5-VL-3B-Instruct's: its embeddings tied, as Qwen3-VL-2B's and 4B's
QWEN25_VL_3B = {**QWEN25_VL_7B, "hidden_size": 2048, "intermediate_size": 11008, "num_hidden_layers": 36,
                "num_attention_heads": 16, "num_key_value_heads": 2, "max_window_layers": 70, "tie_word_embeddings": True,
                "vocab_size": 151936, "vision_config": {**QWEN25_VL_7B["vision_config"], "out_hidden_size": 2048}}


QWEN3_VL_4B = {**QWEN3_VL_8B, "tie_word_embeddings": True,  # Qwen3-VL-4B-Instruct's: tied, a smaller tower
               "text_config": {**QWEN3_VL_8B["text_config"], "hidden_size": 2560, "intermediate_size": 9728,
                               "tie_word_embeddings": True},
               "vision_config": {**QWEN3_VL_8B["vision_config"], "depth": 24, "hidden_size": 1024, "intermediate_size": 4096,
                                 "deepstack_visual_indexes": [5, 11, 17], "out_hidden_size": 2560}}


QWEN2_VL_7B = {**{k: v for k, v in QWEN25_VL_7B.items() if k != "vision_config"}, "model_type": "qwen2_vl",
               "architectures": ["Qwen2VLForConditionalGeneration"],  # Qwen/Qwen2-VL-7B-Instruct's
               "vision_config": {"depth": 32, "embed_dim": 1280, "mlp_ratio": 4, "num_heads": 16, "in_chans": 3,
                                 "hidden_size": 3584, "patch_size": 14, "spatial_merge_size": 2, "spatial_patch_size": 14,
                                 "temporal_patch_size": 2}}


QWEN3_VL_30B_A3B = {**QWEN3_VL_8B, "architectures": ["Qwen3VLMoeForConditionalGeneration"], "model_type": "qwen3_vl_moe",
                    "text_config": {**QWEN3_VL_8B["text_config"], "model_type": "qwen3_vl_moe_text", "hidden_size": 2048,
                                    "intermediate_size": 6144, "num_hidden_layers": 48, "num_key_value_heads": 4,
                                    "moe_intermediate_size": 768, "num_experts": 128, "num_experts_per_tok": 8,
                                    "decoder_sparse_step": 1, "mlp_only_layers": []},
                    "vision_config": {**QWEN3_VL_8B["vision_config"], "out_hidden_size": 2048, "model_type": "qwen3_vl_moe"}}


@pytest.mark.parametrize("name, config, params, tower", [
    ("Qwen2-VL-7B-Instruct", QWEN2_VL_7B, 8_291_375_616, 675_759_104),
    ("Qwen2.5-VL-7B-Instruct", QWEN25_VL_7B, 8_292_166_656, 676_550_144),
    ("Qwen2.5-VL-3B-Instruct", QWEN25_VL_3B, 3_754_622_976, 668_684_288),
    ("Qwen3-VL-8B-Instruct", QWEN3_VL_8B, 8_767_123_696, 576_388_336),
    ("Qwen3-VL-4B-Instruct", QWEN3_VL_4B, 4_437_815_808, 415_347_712),
    ("Qwen3-VL-30B-A3B-Instruct", QWEN3_VL_30B_A3B, 31_070_754_032, 538_631_408)])
def test_qwen_vl_checkpoints_are_sized_with_their_vision_tower(tmp_path, name, config, params, tower):
    # the published parameter counts (8.29B and 8.77B), as transformers builds them; the decoder is Qwen2's
    # or Qwen3's, its KV sized as theirs, its multimodal RoPE the plain one on text
    import torch
    import transformers

    d = deployment(f"{checkpoint(tmp_path, name, config)}@h200")  # the 30B-A3B's 62 GB of weights need it
    m = d.model
    assert m.param_count() == params and m.encoder_params == tower and m.dtype == "bfloat16"
    qwen3 = config["model_type"].startswith("qwen3")
    assert m.tie_word_embeddings == config["tie_word_embeddings"] and m.qkv_bias == (not qwen3)
    assert m.qk_norm == qwen3 and not d.notes and m.num_experts == (128 if "moe" in config["model_type"] else 0)

    def built(fields: dict) -> int:
        with torch.device("meta"):
            return transformers.AutoModelForImageTextToText.from_config(transformers.AutoConfig.for_model(**fields)).num_parameters()

    assert built(config) == params
    # fields a text_config or vision_config leaves out take transformers' defaults
    text = config.get("text_config")
    sparse = {**config, "vision_config": {}, **({"text_config": {k: v for k, v in text.items() if k not in (
        "head_dim", "rope_theta", "max_position_embeddings", "rms_norm_eps", "num_experts", "num_experts_per_tok",
        "moe_intermediate_size")}} if text else {})}
    sparse_model = deployment(f"{checkpoint(tmp_path, 'sparse', sparse)}@h200").model
    assert sparse_model.param_count() == built(sparse)
    if text:
        ref = transformers.AutoConfig.for_model(**sparse).text_config
        assert (sparse_model.head_dim, sparse_model.max_position, sparse_model.rope_theta, sparse_model.rms_norm_eps) == (
            ref.head_dim, ref.max_position_embeddings, ref.rope_parameters["rope_theta"], ref.rms_norm_eps)
        # a text model of another kind is refused, naming it; so is a Qwen3-VL's written at the top level
        flat = {**{k: v for k, v in config.items() if k != "text_config"}, **text, "model_type": config["model_type"]}
        with pytest.raises(ValueError, match="holds its text model under text_config: there is none"):
            deployment(f"{checkpoint(tmp_path, 'flat', flat)}@h200")
        other = {**config, "text_config": {**text, "model_type": "qwen3_next"}}
        with pytest.raises(ValueError, match="text_config.model_type 'qwen3_next' is not supported"):
            deployment(f"{checkpoint(tmp_path, 'other', other)}@h200")


def test_a_qwen_vl_config_that_cannot_be_read_as_transformers_reads_it_is_refused_by_name(tmp_path):
    # a size of 0 or below would be counted (transformers builds none); the tie follows transformers: the
    # top level's, where Qwen3-VL-MoE's re-saved text_config says true beside an untied model
    for key, value in (("depth", -1), ("spatial_merge_size", 0), ("mlp_ratio", 0)):
        bad = {**QWEN2_VL_7B, "vision_config": {**QWEN2_VL_7B["vision_config"], key: value}}
        with pytest.raises(ValueError, match=f"vision_config.{key} must be > 0, got {value}"):
            deployment(f"{checkpoint(tmp_path, key, bad)}@h200")
    resaved = {**QWEN3_VL_30B_A3B, "text_config": {**QWEN3_VL_30B_A3B["text_config"], "tie_word_embeddings": True}}
    assert not deployment(f"{checkpoint(tmp_path, 'resaved', resaved)}@h200").model.tie_word_embeddings


def test_gemma_3_checkpoints_are_sized_with_their_vision_tower(tmp_path):
    # google/gemma-3-4b-it's config.json, the text model's fields left to Gemma3TextConfig's defaults where
    # it leaves them out: 3,880,263,168 parameters in the decoder and 419,816,304 in its SigLIP tower and
    # projector, the 4,300,079,472 its card gives; the context is max_position_embeddings' 131,072 (already
    # the scaled one, as vLLM reads it), five layers of six windowed to 1,024 tokens
    gemma3 = {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3", "boi_token_index": 255999,
              "eoi_token_index": 256000, "image_token_index": 262144, "mm_tokens_per_image": 256,
              "text_config": {"hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
                              "num_hidden_layers": 34, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                              "sliding_window": 1024},
              "torch_dtype": "bfloat16",
              "vision_config": {"hidden_size": 1152, "image_size": 896, "intermediate_size": 4304,
                                "model_type": "siglip_vision_model", "num_attention_heads": 16, "num_hidden_layers": 27,
                                "patch_size": 14, "vision_use_head": False}}
    d = deployment(f"{checkpoint(tmp_path, 'gemma-3-4b-it', gemma3)}@l40s:131072")
    m = d.model
    assert m.param_count() == 4_300_079_472 and m.encoder_params == 419_816_304 and m.dtype == "bfloat16"
    assert m.param_count(active=True) == 3_880_263_168 and m.kv_bytes_per_token() == 2 * 34 * 4 * 256 * 2
    assert m.max_position == 131072 and len(m.window_layers) == 34 - 34 // 6 and m.local_rope_theta == 10000.0
    # gemma-3-1b-it: text alone, 999,885,952 parameters
    text = {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "head_dim": 256, "hidden_size": 1152,
            "intermediate_size": 6912, "max_position_embeddings": 32768, "num_attention_heads": 4,
            "num_hidden_layers": 26, "num_key_value_heads": 1, "query_pre_attn_scalar": 256, "rope_local_base_freq": 10000,
            "rope_scaling": None, "rope_theta": 1000000, "sliding_window": 512, "sliding_window_pattern": 6,
            "torch_dtype": "bfloat16", "vocab_size": 262144}
    assert deployment(f"{checkpoint(tmp_path, 'gemma-3-1b-it', text)}@a10").model.param_count() == 999_885_952
    # the tower is held at 16 bits and never read for text: a decode step reads the decoder's weights
    assert m.weight_bytes() == 2 * 4_300_079_472 and m.encoder_bytes() == 2 * 419_816_304
    one = RooflineCostModel(d.gpu, m).iterations_s(1, 0, 1)
    assert one == pytest.approx(2e-3 + (2 * 3_880_263_168 + m.kv_bytes_per_token()) / (0.8 * d.gpu.memory_bytes_per_s))
    # a decode at 32,768 tokens reads the whole context on the 5 full layers and the window's 1,024
    # keys on the 29 windowed ones, as vLLM's kernels read them (1/5.8 of the KV bytes a full read takes)
    cost, layer = d.cost_model(), m.kv_bytes_per_token() // 34
    assert cost.window == 1024
    decode = cost.iteration_s(BatchShape(1, 32768, 32768), BatchShape(1, 1024, 1024))
    read = 2 * 3_880_263_168 + layer * (5 * 32768 + 29 * 1024) + m.kv_bytes_per_token()
    assert decode == pytest.approx(2e-3 + read / (0.8 * d.gpu.memory_bytes_per_s), rel=1e-12)
    # the top level's dtype before text_config's, as vLLM reads it; float32 is served in bfloat16, as
    # vLLM serves Gemma 2 and 3 (it refuses them float16)
    mixed = {**gemma3, "text_config": {**gemma3["text_config"], "torch_dtype": "float32"}}
    assert deployment(f"{checkpoint(tmp_path, 'mixed', mixed)}@l40s").model.dtype == "bfloat16"
    wide = {**gemma3, "torch_dtype": "float32"}
    assert deployment(f"{checkpoint(tmp_path, 'wide', wide)}@l40s").model.dtype == "bfloat16"
    # a context past its own is refused saying only that: Gemma 3's 131,072 is not extended by its scaling
    with pytest.raises(ValueError, match=r"past the model's own \(131072: max_position_embeddings\)$"):
        deployment(f"{tmp_path / 'gemma-3-4b-it'}@h200:200000")
    # with no windowed layer (every layer full) it has no local RoPE either
    full = {**text, "sliding_window_pattern": 1}
    m1 = deployment(f"{checkpoint(tmp_path, 'full', full)}@a10").model
    assert m1.window_layers == () and m1.local_rope_theta is None


def test_quantised_weights_leave_the_kv_more_room(tmp_path):
    bf16 = deployment(f"{checkpoint(tmp_path, 'bf16', QWEN25_7B)}@a10")
    awq = deployment(f"{checkpoint(tmp_path, 'awq', {**QWEN25_7B, 'quantization_config': {'quant_method': 'awq', 'bits': 4, 'group_size': 128}})}@a10")
    fp8 = deployment(f"{checkpoint(tmp_path, 'fp8', {**QWEN25_7B, 'quantization_config': {'quant_method': 'fp8'}})}@a10")
    assert (awq.model.weight_bits, fp8.model.weight_bits, bf16.model.weight_bits) == (4, 8, None)
    assert awq.num_blocks() > fp8.num_blocks() > bf16.num_blocks() > 0


@pytest.mark.parametrize("config, gpu, match", [
    (QWEN25_7B, "b200", "GPU 'b200' is not one of h100, h200, a10, l40s"),
    ({**QWEN25_7B, "num_hidden_layers": 80, "hidden_size": 8192, "num_attention_heads": 64}, "a10",
     r"the weights take 102\.3 GB and the workspace \(a full batch's activations, a sequence's KV for one layer\) 4\.0 GB of the 21\.6 GB usable \(0\.9 of NVIDIA A10 24GB\), so nothing is left for KV, "
     r"where one 32768-token sequence needs"),  # a 72B-sized model on a 24 GB GPU
    ({**QWEN25_7B, "quantization_config": {"quant_method": "hqq"}}, "h100", "quant_method 'hqq' and no 'bits'"),
    ({**QWEN25_7B, "model_type": "hunyuan_v1_moe", "architectures": ["HunYuanMoEV1ForCausalLM"]}, "h100",
     "model_type 'hunyuan_v1_moe' is not one of"),
    # a field's type or value the config.json holds wrongly is named, never cut to a whole number or
    # taken for absent, and never a traceback (a review found each)
    ({**QWEN25_7B, "quantization_config": "awq"}, "h100", "quantization_config must be an object, got 'awq'"),
    ({**QWEN25_7B, "quantization_config": {"quant_method": "gptq", "bits": 5}}, "h100",
     "config.json: quantization_config.bits must be one of 2, 3, 4, 8, 16, 32, got 5"),
    ({**QWEN25_7B, "num_attention_heads": 28.5}, "h100", "config.json: num_attention_heads must be a whole number, got 28.5"),
    ({**QWEN25_7B, "num_hidden_layers": "28"}, "h100", "num_hidden_layers must be a whole number, got '28'"),
    ({**QWEN25_7B, "head_dim": 0}, "h100", "config.json: head_dim must be > 0, got 0"),
    ({**QWEN25_7B, "use_sliding_window": True, "max_window_layers": "abc"}, "h100",
     "config.json: max_window_layers must be a whole number, got 'abc'"),
    ({**QWEN25_7B, "layer_types": "full_attention"}, "h100", "config.json: layer_types must be a list"),
    ({**QWEN25_7B, "layer_types": ["full_attention"] * 27}, "h100", "layer_types must be a list of the 28 layers' kinds"),
    ({**QWEN25_7B, "layer_types": ["chunked_attention"] * 28}, "h100",
     "layer_types: 'chunked_attention' is not supported"),
])
def test_a_checkpoint_deployment_that_cannot_be_served_is_refused_by_name(tmp_path, config, gpu, match):
    name = f"{checkpoint(tmp_path, 'ck', config)}@{gpu}"
    with pytest.raises(ValueError, match=match) as err:
        deployment(name)
    assert name in str(err.value)  # the deployment the message is about


def test_a_context_is_given_as_vllm_max_model_len_is(tmp_path):
    # Qwen2.5-7B with twice its KV heads, in bf16 on an A10: 32,768 tokens of context do not fit beside
    # its weights, 8,192 do (vLLM refuses the first and serves with --max-model-len 8192); a context is a
    # whole number of tokens within the model's own, and any other is refused by name
    directory = checkpoint(tmp_path, "q", {**QWEN25_7B, "num_key_value_heads": 14})
    with pytest.raises(ValueError, match="where one 32768-token sequence needs"):
        deployment(f"{directory}@a10")
    short = deployment(f"{directory}@a10:8192")
    assert short.max_model_len == 8192 and short.num_blocks() * short.block_size >= 8192
    assert short.engine_config().max_model_len == 8192
    assert deployment(f"{directory}@h100:8192").num_blocks() > deployment(f"{directory}@h100").num_blocks()
    for bad, match in ((":0", "must be a whole number of tokens >= 2, got '0'"), (":8k", "got '8k'"), (":", "got ''"),
                       (":65536", "past the model's own \\(32768: max_position_embeddings")):
        with pytest.raises(ValueError, match=match):
            deployment(f"{directory}@a10{bad}")
    # YaRN extends the context as vLLM derives it: original_max_position_embeddings x factor
    yarn = checkpoint(tmp_path, "yarn", {**QWEN25_7B, "rope_scaling": {"type": "yarn", "factor": 4.0,
                                                                       "original_max_position_embeddings": 32768}})
    assert deployment(f"{yarn}@h200:65536").max_model_len == 65536
    with pytest.raises(ValueError, match="past the model's own \\(131072"):
        deployment(f"{yarn}@h200:262144")


def test_a_checkpoint_path_may_start_at_home(tmp_path, monkeypatch):
    # a scenario's deployment: is not seen by a shell, so ~ is expanded here, as for a trace's path
    monkeypatch.setenv("HOME", str(tmp_path))
    checkpoint(tmp_path, "home", QWEN25_7B)
    assert deployment("~/home@l40s").num_blocks() == deployment(f"{tmp_path / 'home'}@l40s").num_blocks()
    # a context past a max_position_embeddings no RoPE scaling extends says only that
    with pytest.raises(ValueError, match=r"past the model's own \(32768: max_position_embeddings\)$"):
        deployment("~/home@h100:65536")


def test_sizing_reads_past_what_only_running_the_weights_needs(tmp_path):
    # a LongRoPE whose factors do not fit the heads, a GELU or MLP biases change the arithmetic, not the memory
    # or the cost model's time: a deployment is sized from them, where loading the weights refuses them
    from engine.checkpoint import CheckpointError, read_config

    longrope = {**QWEN25_7B, "rope_scaling": {"type": "longrope", "short_factor": [1.0], "long_factor": [2.0],
                                              "original_max_position_embeddings": 4096}}
    directory = checkpoint(tmp_path, "longrope", longrope)
    assert deployment(f"{directory}@h100").model.param_count() == 7_615_616_512
    with pytest.raises(CheckpointError, match="longrope needs a factor for each of the 64 frequencies RoPE turns by, got 1"):
        read_config(directory)
    # Qwen's YaRN block is run as well as sized, and extends the context as vLLM extends it
    yarn = {**QWEN25_7B, "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}}
    directory = checkpoint(tmp_path, "yarn", yarn)
    assert read_config(directory).rope_scaling.kind == "yarn"
    assert deployment(f"{directory}@h100").model.max_position == 131_072
    # YaRN's context is its original one times its factor, as vLLM derives it, in place of the declared
    # one (shorter too), the original read as the RoPE reads it (config.json's own first)
    for name, fields, context in (
            ("short", {**QWEN25_7B, "max_position_embeddings": 131072, "rope_scaling": {
                "rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 32768}}, 65536),
            ("top", {**QWEN25_7B, "original_max_position_embeddings": 4096, "rope_scaling": {
                "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}}, 16384)):
        assert deployment(f"{checkpoint(tmp_path, name, fields)}@h100").model.max_position == context
    with pytest.raises(ValueError, match=r"past the model's own \(65536: its YaRN scaling's original_max_position_"
                                         r"embeddings x factor, as vLLM derives it\)"):
        deployment(f"{tmp_path / 'short'}@h100:100000")
    # a sliding window changes the KV a sequence needs: sized as full attention (the most it may
    # need), and the deployment says so
    windowed = deployment(f"{checkpoint(tmp_path, 'win', {**QWEN25_7B, 'use_sliding_window': True, 'max_window_layers': 0, 'sliding_window': 4096})}@h100")
    assert windowed.num_blocks() == deployment(f"{tmp_path / 'yarn'}@h100").num_blocks()
    assert "sliding window (4096 tokens) frees no KV here: the KV is sized as full attention" in windowed.describe()


def test_compressed_tensors_and_modelopt_weights_are_counted_at_their_bits(tmp_path):
    fp8 = {"quant_method": "compressed-tensors", "format": "float-quantized",
           "config_groups": {"group_0": {"targets": ["Linear"], "weights": {"num_bits": 8, "type": "float"}}}}
    w4 = {**fp8, "config_groups": {"group_0": {"weights": {"num_bits": 4, "type": "int", "group_size": 128}}}}
    assert deployment(f"{checkpoint(tmp_path, 'ct8', {**QWEN25_7B, 'quantization_config': fp8})}@a10").model.weight_bits == 8
    assert deployment(f"{checkpoint(tmp_path, 'ct4', {**QWEN25_7B, 'quantization_config': w4})}@a10").model.weight_bits == 4
    bad = {**fp8, "config_groups": {"group_0": {"weights": {"num_bits": 5}}}}
    with pytest.raises(ValueError, match="compressed-tensors quantization_config needs config_groups whose weights' num_bits"):
        deployment(f"{checkpoint(tmp_path, 'ct5', {**QWEN25_7B, 'quantization_config': bad})}@a10")
    # ModelOpt: the block in config.json, or its own hf_quant_config.json beside a config.json without one
    inline = {"quant_method": "modelopt", "quant_algo": "NVFP4"}
    nvfp4 = deployment(f"{checkpoint(tmp_path, 'mo', {**QWEN25_7B, 'quantization_config': inline})}@a10")
    # 4-bit floats are counted with their block scales (found by review: NVFP4 at a flat 4 bits left out its
    # 8-bit scale for every 16 weights, 12 % of them): 4.5 bits, rounded up to whole bytes
    params = nvfp4.model.param_count()
    assert nvfp4.model.weight_bits == 4.5 and nvfp4.model.weight_bytes() == math.ceil(params * 4.5 / 8)
    assert "at 4.5 bits" in nvfp4.describe()
    ct_fp4 = {**fp8, "config_groups": {"group_0": {"weights": {"num_bits": 4, "type": "float", "group_size": 16}}}}
    assert deployment(f"{checkpoint(tmp_path, 'ctfp4', {**QWEN25_7B, 'quantization_config': ct_fp4})}@a10").model.weight_bits == 4.5
    mx = {"quant_method": "modelopt", "quant_algo": "MXFP4"}
    assert deployment(f"{checkpoint(tmp_path, 'mx', {**QWEN25_7B, 'quantization_config': mx})}@a10").model.weight_bits == 4.25
    assert deployment(f"{tmp_path / 'ct4'}@a10").model.weight_bytes() == params * 4 // 8  # whole bits as ever
    beside = checkpoint(tmp_path, "mo8", QWEN25_7B)
    (beside / "hf_quant_config.json").write_text(json.dumps({"producer": {"name": "modelopt"},
                                                             "quantization": {"quant_algo": "FP8", "kv_cache_quant_algo": None}}))
    assert deployment(f"{beside}@a10").model.weight_bits == 8
    (beside / "hf_quant_config.json").write_text(json.dumps({"quantization": {"quant_algo": "INT3"}}))
    with pytest.raises(ValueError, match="hf_quant_config.json: quant_algo 'INT3' is not one of FP8"):
        deployment(f"{beside}@h100")
    (beside / "hf_quant_config.json").write_text(json.dumps({"quantization": ["FP8"]}))
    with pytest.raises(ValueError, match="hf_quant_config.json: quantization must be an object"):
        deployment(f"{beside}@l40s")
    # only the KV cache quantised (ModelOpt's quant_algo null, compressed-tensors' groups empty): the
    # weights keep their dtype, as does a checkpoint that quantises nothing
    kv_only = checkpoint(tmp_path, "kvfp8", QWEN25_7B)
    (kv_only / "hf_quant_config.json").write_text(json.dumps({"quantization": {"quant_algo": None,
                                                                               "kv_cache_quant_algo": "FP8"}}))
    ct_kv = {"quant_method": "compressed-tensors", "config_groups": {}, "kv_cache_scheme": {"num_bits": 8}}
    inline = {"quant_method": "modelopt", "quantization": {"quant_algo": "FP8"}}
    assert deployment(f"{kv_only}@a10").model.weight_bits is None
    assert deployment(f"{checkpoint(tmp_path, 'ctkv', {**QWEN25_7B, 'quantization_config': ct_kv})}@a10").model.weight_bits is None
    assert deployment(f"{checkpoint(tmp_path, 'moin', {**QWEN25_7B, 'quantization_config': inline})}@a10").model.weight_bits == 8
    junk = {**ct_kv, "config_groups": {"g0": {"weights": {"num_bits": 4}}, "g1": "junk"}}
    with pytest.raises(ValueError, match="config_groups must map names to groups"):
        deployment(f"{checkpoint(tmp_path, 'ctj', {**QWEN25_7B, 'quantization_config': junk})}@a10")


def test_a_checkpoint_declaring_an_fp8_kv_cache_is_sized_with_it_as_vllm_holds_it(tmp_path):
    # found by review: vLLM holds the KV in FP8 where the checkpoint declares it calibrated (ModelOpt's
    # kv_cache_quant_algo, compressed-tensors' kv_cache_scheme) unless told otherwise; sized here in bf16 it had half
    plain = deployment(f"{checkpoint(tmp_path, 'plain', QWEN25_7B)}@h100")
    modelopt = checkpoint(tmp_path, "mo", QWEN25_7B)
    (modelopt / "hf_quant_config.json").write_text(json.dumps({"producer": {"name": "modelopt"}, "quantization": {
        "quant_algo": "FP8", "kv_cache_quant_algo": "FP8"}}))
    ct = checkpoint(tmp_path, "ct", {**QWEN25_7B, "quantization_config": {
        "quant_method": "compressed-tensors", "config_groups": {},
        "kv_cache_scheme": {"num_bits": 8, "type": "float", "strategy": "tensor"}}})
    current = checkpoint(tmp_path, "mocur", {**QWEN25_7B, "quantization_config": {  # ModelOpt's current config.json
        "quant_method": "modelopt", "quant_algo": "NVFP4", "kv_cache_scheme": {"dynamic": False, "num_bits": 8,
                                                                              "type": "float"}}})
    for directory in (modelopt, ct, current):
        d = deployment(f"{directory}@h100")
        assert d.model.kv_cache_dtype == "fp8" and "its KV in fp8, as the checkpoint declares it" in d.describe()
        assert d.model.kv_bytes_per_token() == plain.model.kv_bytes_per_token() // 2
        assert deployment(f"{directory}@h100:auto").model.kv_cache_dtype == "auto"  # the model's dtype, on request
        assert deployment(f"{directory}@h100:fp8_e5m2").model.kv_cache_dtype == "fp8_e5m2"
    assert deployment(f"{directory}@h100:8192").model.kv_cache_dtype == "fp8"
    assert plain.model.kv_cache_dtype == "auto" and "declares" not in plain.describe()
    # latent attention's cache stays in the model's dtype here, said (found by review: dropped without a word)
    mla = checkpoint(tmp_path, "mla", json.loads((CHECKPOINTS / "DeepSeek-V2-Lite-Chat" / "config.json").read_text()))
    (mla / "hf_quant_config.json").write_text(json.dumps({"quantization": {"kv_cache_quant_algo": "FP8"}}))
    d = deployment(f"{mla}@h100")
    assert d.model.kv_cache_dtype == "auto" and "declares its KV calibrated for fp8, which vLLM holds it in" in d.describe()


def test_a_quantize_config_json_beside_an_unquantised_config_is_named_not_read(tmp_path):
    # found by review: a GPTQ checkpoint whose bits live only in quantize_config.json was sized at 16 bits silently
    sidecar = checkpoint(tmp_path, "gptq", QWEN25_7B)
    (sidecar / "quantize_config.json").write_text(json.dumps({"bits": 4, "group_size": 128, "desc_act": False}))
    d = deployment(f"{sidecar}@h100")
    assert d.model.weight_bits is None and "its quantize_config.json (AutoGPTQ's and AutoAWQ's own file) is not read" \
        in d.describe()


def test_fbgemm_fp8_and_compressed_tensors_older_key_are_read(tmp_path):
    # found by review: Meta's own FP8 releases (quant_method fbgemm_fp8) were refused, and a compressed-tensors
    # checkpoint under its older key (compression_config, which vLLM reads) was sized at 16 bits
    fbgemm = {"quant_method": "fbgemm_fp8", "activation_scale_ub": 1200.0, "modules_to_not_convert": ["lm_head"]}
    assert deployment(f"{checkpoint(tmp_path, 'fb', {**QWEN25_7B, 'quantization_config': fbgemm})}@a10").model.weight_bits == 8
    w4 = {"quant_method": "compressed-tensors", "config_groups": {"group_0": {"weights": {"num_bits": 4}}}}
    old = checkpoint(tmp_path, "old", {**QWEN25_7B, "compression_config": w4})
    assert deployment(f"{old}@a10").model.weight_bits == 4


def test_a_config_json_that_is_not_an_object_is_refused_by_name(tmp_path):
    directory = tmp_path / "list"
    directory.mkdir()
    (directory / "config.json").write_text("[1, 2, 3]")
    with pytest.raises(ValueError, match="config.json: must hold a JSON object .*, got list"):
        deployment(f"{directory}@h100")
    (directory / "config.json").write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(ValueError, match="config.json: cannot be read"):
        deployment(f"{directory}@l40s")


def test_a_deployment_not_found_names_the_shipped_checkpoints():
    shipped = sorted(p.parent.name for p in CHECKPOINTS.glob("*/config.json"))
    assert {"Mixtral-8x7B-Instruct-v0.1", "Qwen3-30B-A3B", "Qwen3-8B"} <= set(shipped)
    for name in ("qwen3-30b", "Qwen3-30B@h100"):  # neither a known name nor a checkpoint directory
        with pytest.raises(ValueError, match=f"shipped checkpoints: {', '.join(shipped)}"):
            deployment(name)


def test_a_scenario_names_a_checkpoint_deployment_and_a_bad_one_names_the_field(tmp_path):
    import yaml

    data = yaml.safe_load((SCENARIOS / "long_outputs.yaml").read_text())
    good = tmp_path / "qwen.yaml"
    good.write_text(yaml.safe_dump({**data, "deployment": f"{checkpoint(tmp_path, 'qwen', QWEN25_7B)}@h100"}))
    assert load_scenario(good).engine_config().num_blocks == deployment(f"{tmp_path / 'qwen'}@h100").num_blocks()
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({**data, "deployment": f"{tmp_path / 'absent'}@h100"}))
    with pytest.raises(ScenarioError, match=r"deployment.*no such checkpoint directory"):
        load_scenario(bad)


def test_the_shipped_policy_replays_a_trace_on_a_users_checkpoint(tmp_path, capsys):
    name = f"{CHECKPOINTS / 'Qwen2.5-7B-Instruct'}@l40s"
    out = tmp_path / "eval.json"
    assert main(["eval", "--policy", "default", "--policy", "vllm", "--trace", "azure2023_conv.csv", "--load", "1.2",
                 "--deployment", name, "--steps", "5", "--episodes", "1", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "Qwen2.5-7B-Instruct@l40s" in printed and "puts it at 1.2x" in printed
    results = json.loads(out.read_text())["results"]
    assert results["default"]["steps"] == 5 and results["vllm"]["requests_submitted"] > 0


@pytest.mark.parametrize("kind, config", [("deepseek_v2", "DeepseekV2Config"), ("deepseek_v3", "DeepseekV3Config"),
                                          ("glm4_moe", "Glm4MoeConfig"), ("glm4", "Glm4Config"),
                                          ("granite", "GraniteConfig"), ("olmo2", "Olmo2Config"),
                                          ("smollm3", "SmolLM3Config")])
def test_a_field_config_json_leaves_out_takes_transformers_default_or_is_refused_by_name(tmp_path, kind, config):
    # each field transformers writes, left out one at a time: read as transformers' default, or refused as missing
    transformers = pytest.importorskip("transformers")
    extra = {"num_experts_per_tok": 8} if kind == "deepseek_v2" else {"head_dim": 128} if kind == "glm4_moe" else {}
    full = {**getattr(transformers, config)(**extra).to_dict(), "model_type": kind}
    (tmp_path / "config.json").write_text(json.dumps(full))
    whole = read_sizes(tmp_path)[0]
    for field in [k for k in full if k != "model_type" and k not in extra]:
        (tmp_path / "config.json").write_text(json.dumps({k: v for k, v in full.items() if k != field}))
        try:
            assert read_sizes(tmp_path)[0] == whole, field
        except CheckpointError as exc:
            assert f"missing field {field!r}" in str(exc)


@pytest.mark.parametrize("kind, why", [("qwen3_next", "recurrent state for each request"),
                                       ("qwen3_5", "recurrent state for each request"),
                                       ("nemotron_h", "recurrent state for each request"),
                                       ("deepseek_v32", "caches an indexer's keys")])
def test_a_model_this_engine_does_not_model_is_refused_saying_why(tmp_path, kind, why):
    # a hybrid of linear attention or state-space layers, or DeepSeek's indexed sparse attention: run and sized alike
    (tmp_path / "config.json").write_text(json.dumps({"model_type": kind, "hidden_size": 64}))
    with pytest.raises(ValueError, match=f"model_type '{kind}' is not supported: .*{why}"):
        deployment(f"{tmp_path}@h100")


def test_granite_4s_dense_models_are_not_refused_as_hybrids(tmp_path):
    # granitemoehybrid names Granite 4's hybrids and its dense models (every layer attention) alike: only a model
    # with mamba layers is refused for its recurrent state; a dense one is refused as a type this engine does not know
    base = {"model_type": "granitemoehybrid", "hidden_size": 64}
    for layers, match in ((["mamba", "attention"], "recurrent state for each request"),
                          (["attention", "attention"], "model_type 'granitemoehybrid' is not one of")):
        (tmp_path / "config.json").write_text(json.dumps({**base, "layer_types": layers}))
        with pytest.raises(ValueError, match=match):
            deployment(f"{tmp_path}@h100")
