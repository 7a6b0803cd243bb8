"""Loading a local Hugging Face Llama, Mistral, Mistral 3, Qwen2, Qwen3, Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Phi-3, Gemma, Gemma 2,
Gemma 3, Granite, OLMo 2, OLMo 3, GLM-4, SmolLM3, Mixtral, Qwen2-MoE, Qwen3-MoE, gpt-oss, DeepSeek-V2, DeepSeek-V3,
GLM-4.5, Llama 4, Ministral, Ministral 3 or Seed-OSS checkpoint directory (``config.json`` +
``*.safetensors``).

Nothing is fetched from a hub: the directory must hold everything. FP8 weights are multiplied by their
scales as they are read. Every refusal names the file or tensor at fault.
"""
from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import torch
from safetensors.torch import load_file

from engine.config import (MXFP4_BITS, NVFP4_BITS, WEIGHT_BITS, ModelConfig, RopeScaling, is_positive, is_whole,
                           torch_dtype)
from engine.model import LlamaModel


# Mistral is Llama's architecture under its own name; without a sliding window it is Llama's attention
# too; Mistral 3 (``mistral3``: Mistral Small 3.1 and 3.2) holds a Mistral decoder beside a Pixtral
# vision tower. Qwen2 (Qwen2.5, QwQ, DeepSeek-R1's Qwen distillations) is Llama's with biases on q, k and v;
# Qwen3 (dense) is Llama's with an RMSNorm over each q and k head and its own head_dim; Qwen2-VL, Qwen2.5-VL
# and Qwen3-VL hold a Qwen2 or Qwen3 (or Qwen3-MoE) decoder beside a vision tower. Phi-3 (and
# Phi-4) is Llama's with q/k/v and gate/up each stored as one tensor, as this engine computes them.
# Mixtral is Mistral's with a mixture of eight experts for each MLP (two a token); Qwen3-MoE is
# Qwen3's with one (e.g. 8 of 128 experts a token), some layers optionally kept dense; Qwen2-MoE
# (Qwen1.5-MoE, Qwen2-57B-A14B) is Qwen2's with one and a gated shared expert beside it. Gemma is
# Llama's with scaled embeddings, norms by 1 + weight and a GeGLU MLP; Gemma 2 adds norms around
# attention and the MLP, soft caps on attention scores and logits, and a window on every other layer;
# Gemma 3 drops the caps, norms each q and k head, and its windowed layers (five of six) rotate by a
# RoPE of their own. Its multimodal checkpoints (``gemma3``) hold the text model beside a vision tower.
# gpt-oss is a mixture of experts of its own: attention with biases and a sink logit per head, a
# 128-token window on every other layer, YaRN, a router with a bias, clamped SwiGLU experts with
# biases, stored in MXFP4 (4-bit floats, a power-of-two scale for each 32). DeepSeek-V2 (and V2-Lite,
# DeepSeek-Coder-V2) and DeepSeek-V3 (V3, R1, Moonlight) attend through multi-head latent attention (a
# latent a token cached in place of each head's K and V) and route each token to experts in groups,
# beside shared experts every token takes, after a first few dense layers. GLM-4.5 (and 4.5-Air, 4.6) routes
# as DeepSeek-V3 does, with Llama's attention around it: biases on q, k and v, optionally Qwen3's RMSNorm
# over each q and k head, and RoPE over half of each head's features. Granite (3.x) is Llama's with four
# scalars: on the embeddings, the attention scores, each sublayer's output and the logits. OLMo 2 is Llama's
# with one RMSNorm over all of q's heads' features and one over k's, and its layers' norms after attention
# and the MLP, on their outputs, in place of the norms on their inputs; OLMo 3 is OLMo 2's with a sliding
# window on three layers of four, which rotate by an unscaled RoPE of their own. GLM-4 (dense: GLM-4-0414,
# GLM-Z1) is Llama's with biases on q, k and v, a norm on each sublayer's output as well as its input, gate
# and up stored as one tensor (as Phi-3's), and RoPE over half of each head's features, its pairs
# interleaved. Ministral (8B) is Mistral's with each layer's kind in layer_types; Ministral 3 (alone, or as
# Mistral 3's text model) is Mistral's with YaRN and every layer's queries scaled by position (Llama 4's
# rule); Seed-OSS is Llama's with biases on q, k and v (``attention_bias``) and on o only where
# ``attention_out_bias`` says. SmolLM3 is Llama's with RoPE left out of some layers (``no_rope_layers``:
# every fourth by default). Llama 4 (Scout, Maverick: its text model beside a vision tower) leaves RoPE out
# of every fourth layer too, tempering those layers' queries by position; its other layers attend within
# chunks of 8,192 tokens and norm q and k after RoPE; its experts (16 on every layer, or 128 on every
# other) weigh their inputs, beside a shared expert. MiniMax-M2 (M2, M2.1) is Mixtral's with OLMo 2's q and k
# norms (one RMSNorm over all of q's heads' features, one over k's), RoPE over the first ``rotary_dim`` of each
# head's features, and experts picked by their sigmoid scores plus a learned bias, weighed by those scores
# renormalised (DeepSeek-V3's router in one group). ERNIE 4.5 is Llama's with RoPE over interleaved pairs; its
# mixtures of experts (21B-A3B, 300B-A47B) pick experts by their softmax scores plus a learned bias, weighed by
# those scores renormalised, beside ungated shared experts, on the layers from ``moe_layer_start_index`` to
# ``moe_layer_end_index`` every ``moe_layer_interval``-th. OLMoE is Mixtral's with OLMo 2's q and k norms (in
# Llama's pre-norm layers) and its experts weighed by their softmax scores unrenormalised, as vLLM runs it.
# Cohere's (Command R, R+, Aya) is Llama's with LayerNorms (no bias) in place of RMSNorms, attention and the MLP
# side by side on one norm of each layer's input, RoPE over interleaved pairs, its logits times ``logit_scale``,
# and (R+) each q and k head normed with a weight of its own; Cohere 2's (Command R7B, Command A) attends through
# a window on three layers of four, which alone rotate: its full-attention layers attend without positions.
# EXAONE 4 is OLMo 2's layers (norms on each sublayer's output) with Qwen3's q and k norms (each head's), and
# where it attends through a window on some layers (32B: three of four), only those rotate. Granite's mixtures of
# experts (Granite 3.x MoE: ``granitemoe``, ``granitemoeshared`` with an ungated shared expert) are Granite's
# scalars around Mixtral's experts, each layer's stored stacked (``input_linear``: gate and up; ``output_linear``).
# dots.llm1 (``dots1``) is Qwen3's attention (each q and k head normed) around DeepSeek-V3's mixture of experts.
# Mistral 4 (``mistral4``, alone or as Mistral 3's text model) is DeepSeek-V3's latent attention and experts, its
# router's softmax scores picking within groups (no bias), every layer's queries scaled by position as Ministral
# 3's are. GLM-4.5's lite mixtures (``glm4_moe_lite``: GLM-4.7-Flash) attend through DeepSeek-V3's latent attention,
# each layer dense or sparse as ``mlp_layer_types`` says. Kimi K2.5 (``kimi_k25``) holds Kimi K2's text model (DeepSeek-V3's)
# beside a MoonViT tower and a projector. Hunyuan's dense models (``hunyuan_v1_dense``) are Llama's with each q and k
# head normed after RoPE (``use_qk_norm``) and RoPE's base stretched by an NTK ``alpha``.
MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma", "gemma2", "gemma3_text", "gemma3", "mixtral",
               "qwen2_moe", "qwen3_moe", "gpt_oss", "mistral3", "qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe",
               "deepseek_v2", "deepseek_v3", "glm4_moe", "granite", "olmo2", "glm4", "smollm3", "llama4_text", "llama4",
               "olmo3", "ministral", "seed_oss", "ministral3", "minimax_m2", "ernie4_5", "ernie4_5_moe", "olmoe",
               "cohere", "cohere2", "exaone4", "granitemoe", "granitemoeshared", "dots1",
               "mistral4", "glm4_moe_lite", "kimi_k25", "hunyuan_v1_dense")
# the model classes vLLM picks by config.json's ``architectures`` (it runs a model by its class, not its
# model_type), read where the model_type is not one of the above: Kimi K2's (``kimi_k2``, transformers has
# no such type) is DeepSeek-V3's architecture. Its fields are then read as that family's are, its defaults too
ARCHITECTURES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2",
                 "Qwen3ForCausalLM": "qwen3", "Phi3ForCausalLM": "phi3", "GemmaForCausalLM": "gemma",
                 "Gemma2ForCausalLM": "gemma2", "Gemma3ForCausalLM": "gemma3_text", "MixtralForCausalLM": "mixtral",
                 "Qwen2MoeForCausalLM": "qwen2_moe", "Qwen3MoeForCausalLM": "qwen3_moe", "GptOssForCausalLM": "gpt_oss",
                 "DeepseekV2ForCausalLM": "deepseek_v2", "DeepseekV3ForCausalLM": "deepseek_v3",
                 "Glm4MoeForCausalLM": "glm4_moe", "GraniteForCausalLM": "granite", "Olmo2ForCausalLM": "olmo2",
                 "Olmo3ForCausalLM": "olmo3",
                 "MinistralForCausalLM": "ministral", "SeedOssForCausalLM": "seed_oss",
                 "Ministral3ForCausalLM": "ministral3",
                 "Glm4ForCausalLM": "glm4", "SmolLM3ForCausalLM": "smollm3", "Llama4ForCausalLM": "llama4_text",
                 "Llama4ForConditionalGeneration": "llama4", "MiniMaxM2ForCausalLM": "minimax_m2",
                 "Ernie4_5ForCausalLM": "ernie4_5", "Ernie4_5_MoeForCausalLM": "ernie4_5_moe", "OlmoeForCausalLM": "olmoe",
                 "CohereForCausalLM": "cohere", "Cohere2ForCausalLM": "cohere2", "Exaone4ForCausalLM": "exaone4",
                 "GraniteMoeForCausalLM": "granitemoe", "GraniteMoeSharedForCausalLM": "granitemoeshared",
                 "Dots1ForCausalLM": "dots1", "Mistral4ForCausalLM": "mistral4",
                 "Glm4MoeLiteForCausalLM": "glm4_moe_lite", "KimiK25ForConditionalGeneration": "kimi_k25",
                 "Kimi_K25ForConditionalGeneration": "kimi_k25", "HunYuanDenseV1ForCausalLM": "hunyuan_v1_dense"}
# model types transformers and vLLM know that this engine neither runs nor sizes, and why: a paged cache of keys
# and values a token is not all they hold
_STATEFUL = ("its linear-attention or state-space layers hold a recurrent state for each request beside the paged "
             "KV cache, which this engine does not model")
_INDEXED = ("its sparse attention caches an indexer's keys beside the latent and attends to the tokens the indexer "
            "picks, which this engine does not model")
NOT_MODELLED = {**{t: _STATEFUL for t in ("qwen3_next", "qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text",
                                          "nemotron_h", "granitemoehybrid", "falcon_h1", "jamba", "bamba", "zamba",
                                          "zamba2", "lfm2", "lfm2_moe", "lfm3", "kimi_linear", "minimax", "olmo_hybrid",
                                          "bailing_hybrid", "mamba", "mamba2", "falcon_mamba", "recurrent_gemma")},
                **{t: _INDEXED for t in ("deepseek_v32", "deepseek_v4", "glm_moe_dsa", "mistral_large4",
                                         "mistral_large4_text")}}
DEEPSEEK_TYPES = ("deepseek_v2", "deepseek_v3", "mistral4", "glm4_moe_lite")  # multi-head latent attention
GROUPED_TYPES = (*DEEPSEEK_TYPES, "glm4_moe", "dots1")  # DeepSeek's mixture of experts, routed in groups
# the model types whose transformers implementation rotates only the first partial_rotary_factor of each head
PARTIAL_ROTARY_TYPES = ("phi3", "glm4_moe", "glm4", "minimax_m2")
GEMMA_TYPES = ("gemma", "gemma2", "gemma3_text")
# the model types vLLM refuses to run in float16 (numerically unstable): bfloat16 in its place
NO_FLOAT16 = ("gemma2", "gemma3_text")
# transformers' defaults where config.json leaves a field out and they differ from what this module
# assumes of Llama's: the sliding window (Phi-3's and Mixtral's: none), Gemma's head size and context,
# and Gemma 3's text model's every size (a multimodal checkpoint's text_config leaves most out)
GEMMA3_TEXT = {"vocab_size": 262_208, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
               "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "max_position_embeddings": 131_072,
               "rms_norm_eps": 1e-6, "query_pre_attn_scalar": 256, "sliding_window": 4096, "sliding_window_pattern": 6}
DEFAULTS = {**{t: {"sliding_window": 4096} for t in ("mistral", "ministral", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe")},
            # transformers' Ministral3Config's (Ministral 3's text model): YaRN with Llama 4's query scaling
            "ministral3": {"vocab_size": 131_072, "hidden_size": 4096, "intermediate_size": 14_336,
                           "num_hidden_layers": 34, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
                           "max_position_embeddings": 262_144, "rms_norm_eps": 1e-5, "sliding_window": None},
            # Seed-OSS's: biases on q, k and v, not on o (attention_out_bias)
            "seed_oss": {"attention_bias": True, "head_dim": 128, "rms_norm_eps": 1e-6, "max_position_embeddings": 524_288},
            "gemma": {"head_dim": 256, "max_position_embeddings": 8192},
            "gemma2": {"head_dim": 256, "max_position_embeddings": 8192, "sliding_window": 4096},
            "gemma3_text": GEMMA3_TEXT,
            # DeepSeek's latent attention and experts: transformers' DeepseekV2Config's and DeepseekV3Config's
            "deepseek_v2": {"kv_lora_rank": 512, "q_lora_rank": 1536, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
                            "v_head_dim": 128, "moe_intermediate_size": 1407, "n_routed_experts": 64,
                            "n_shared_experts": 2, "routed_scaling_factor": 1.0, "topk_method": "greedy",
                            "first_k_dense_replace": 0, "norm_topk_prob": False},
            "deepseek_v3": {"kv_lora_rank": 512, "q_lora_rank": 1536, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
                            "v_head_dim": 128, "moe_intermediate_size": 2048, "n_routed_experts": 256,
                            "n_shared_experts": 1, "routed_scaling_factor": 2.5, "n_group": 8, "topk_group": 4,
                            "num_experts_per_tok": 8, "first_k_dense_replace": 3, "norm_topk_prob": True,
                            "rope_interleave": True, "max_position_embeddings": 4096},
            # transformers' Dots1Config's (its experts' count and top-k it leaves to config.json)
            "dots1": {"vocab_size": 152_064, "hidden_size": 4608, "intermediate_size": 10_944,
                      "moe_intermediate_size": 1408, "num_hidden_layers": 62, "num_attention_heads": 32,
                      "num_key_value_heads": 32, "n_group": 1, "topk_group": 1, "first_k_dense_replace": 0,
                      "norm_topk_prob": False, "routed_scaling_factor": 1.0, "max_position_embeddings": 2048,
                      "rms_norm_eps": 1e-6},
            # transformers' Glm4MoeLiteConfig's (GLM-4.7-Flash's sizes)
            "glm4_moe_lite": {"vocab_size": 154_880, "hidden_size": 2048, "intermediate_size": 10_240,
                              "moe_intermediate_size": 1536, "num_hidden_layers": 47, "num_attention_heads": 20,
                              "num_key_value_heads": 20, "n_shared_experts": 1, "n_routed_experts": 64,
                              "routed_scaling_factor": 1.8, "kv_lora_rank": 512, "q_lora_rank": 768,
                              "qk_rope_head_dim": 64, "v_head_dim": 256, "qk_nope_head_dim": 192, "n_group": 1,
                              "topk_group": 1, "num_experts_per_tok": 4, "norm_topk_prob": True,
                              "max_position_embeddings": 202_752, "rms_norm_eps": 1e-5, "rope_interleave": True},
            # transformers' Mistral4Config's
            "mistral4": {"vocab_size": 131_072, "hidden_size": 4096, "intermediate_size": 12_288, "num_hidden_layers": 36,
                         "num_attention_heads": 32, "num_key_value_heads": 32, "max_position_embeddings": 1_048_576,
                         "rms_norm_eps": 1e-6, "kv_lora_rank": 256, "q_lora_rank": 1024, "qk_nope_head_dim": 64,
                         "qk_rope_head_dim": 64, "v_head_dim": 128, "moe_intermediate_size": 2048,
                         "n_routed_experts": 128, "n_shared_experts": 1, "routed_scaling_factor": 1.0, "n_group": 1,
                         "topk_group": 1, "num_experts_per_tok": 4, "first_k_dense_replace": 0, "norm_topk_prob": True,
                         "rope_interleave": True},
            "glm4_moe": {"moe_intermediate_size": 1408, "n_routed_experts": 128, "n_shared_experts": 1,
                         "routed_scaling_factor": 1.0, "n_group": 1, "topk_group": 1, "num_experts_per_tok": 8,
                         "first_k_dense_replace": 1, "norm_topk_prob": True, "partial_rotary_factor": 0.5,
                         "num_key_value_heads": 8, "max_position_embeddings": 131_072, "rms_norm_eps": 1e-5},
            "glm4": {"head_dim": 128, "attention_bias": True, "partial_rotary_factor": 0.5, "num_key_value_heads": 2,
                     "max_position_embeddings": 131_072, "rms_norm_eps": 1.5625e-07},
            "olmo2": {"rms_norm_eps": 1e-5},
            "olmo3": {"rms_norm_eps": 1e-5, "sliding_window": 4096, "rope_theta": 500_000.0},
            "phi3": {"original_max_position_embeddings": 4096},
            # transformers' Llama4TextConfig's (Llama-4-Scout's sizes)
            "llama4_text": {"vocab_size": 202_048, "hidden_size": 5120, "intermediate_size": 8192,
                            "intermediate_size_mlp": 16_384, "num_hidden_layers": 48, "num_attention_heads": 40,
                            "num_key_value_heads": 8, "head_dim": 128, "max_position_embeddings": 131_072,
                            "rms_norm_eps": 1e-5, "rope_theta": 500_000.0, "num_experts_per_tok": 1,
                            "num_local_experts": 16, "interleave_moe_layer_step": 1, "use_qk_norm": True,
                            "attention_chunk_size": 8192, "attn_temperature_tuning": True, "floor_scale": 8192,
                            "attn_scale": 0.1},
            # transformers' MiniMaxM2Config's (MiniMax-M2's sizes)
            "minimax_m2": {"vocab_size": 200_064, "hidden_size": 3072, "intermediate_size": 1536, "num_hidden_layers": 62,
                           "num_attention_heads": 48, "num_key_value_heads": 8, "head_dim": 128,
                           "max_position_embeddings": 196_608, "rms_norm_eps": 1e-6, "rope_theta": 5_000_000.0,
                           "num_local_experts": 256, "num_experts_per_tok": 8},
            # transformers' Ernie4_5Config's and Ernie4_5_MoeConfig's (ERNIE-4.5-0.3B's and -21B-A3B's sizes)
            "ernie4_5": {"vocab_size": 103_424, "hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 18,
                         "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 128,
                         "max_position_embeddings": 131_072, "rms_norm_eps": 1e-5, "rope_theta": 500_000.0,
                         "tie_word_embeddings": True},
            "ernie4_5_moe": {"vocab_size": 103_424, "hidden_size": 2560, "intermediate_size": 12_288,
                             "num_hidden_layers": 28, "num_attention_heads": 20, "num_key_value_heads": 4,
                             "max_position_embeddings": 131_072, "rms_norm_eps": 1e-5, "rope_theta": 500_000.0,
                             "tie_word_embeddings": True, "moe_intermediate_size": 1536, "moe_k": 6,
                             "moe_num_experts": 64, "moe_num_shared_experts": 2, "moe_layer_start_index": 1,
                             "moe_layer_end_index": -1, "moe_layer_interval": 1},
            # transformers' CohereConfig's and Cohere2Config's (Command R's sizes)
            **{t: {"vocab_size": 256_000, "hidden_size": 8192, "intermediate_size": 22_528, "num_hidden_layers": 40,
                   "num_attention_heads": 64, "max_position_embeddings": 8192, "layer_norm_eps": 1e-5,
                   "logit_scale": 0.0625, "tie_word_embeddings": True,
                   # Cohere's RoPE base 500,000 (CohereConfig's default_theta), Cohere 2's 10,000
                   **({"sliding_window": 4096} if t == "cohere2" else {"rope_theta": 500_000.0})}
               for t in ("cohere", "cohere2")},
            # transformers' Exaone4Config's
            "exaone4": {"vocab_size": 102_400, "hidden_size": 4096, "intermediate_size": 16_384, "num_hidden_layers": 32,
                        "num_attention_heads": 32, "num_key_value_heads": 32, "max_position_embeddings": 2048,
                        "rms_norm_eps": 1e-5, "sliding_window": 4096, "sliding_window_pattern": 4},
            # transformers' HunYuanDenseV1Config's
            "hunyuan_v1_dense": {"vocab_size": 290_943, "hidden_size": 4096, "intermediate_size": 11_008,
                                 "num_hidden_layers": 32, "num_attention_heads": 32, "max_position_embeddings": 2048,
                                 "rms_norm_eps": 1e-5},
            # transformers' OlmoeConfig's
            "olmoe": {"vocab_size": 50_304, "hidden_size": 2048, "intermediate_size": 2048, "num_hidden_layers": 16,
                      "num_attention_heads": 16, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
                      "num_experts": 64, "num_experts_per_tok": 8},
            "smollm3": {"num_key_value_heads": 4, "tie_word_embeddings": True, "max_position_embeddings": 32_768,
                        "rope_theta": 2_000_000.0},
            # gpt-oss's config.json names no dtype: its release's tensors are bfloat16, as vLLM serves it
            "gpt_oss": {"torch_dtype": "bfloat16", "head_dim": 64, "sliding_window": 128, "attention_bias": True,
                        "rope_theta": 150_000.0, "max_position_embeddings": 131_072, "rms_norm_eps": 1e-5,
                        "swiglu_limit": 7.0, "swiglu_alpha": 1.702}}
# the RoPE scaling transformers gives a family where config.json gives neither rope_parameters nor rope_scaling
# (or gives them null): gpt-oss's YaRN, Mistral 4's and Ministral 3's YaRN with Llama 4's query scaling
ROPE_DEFAULTS = {"gpt_oss": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                             "original_max_position_embeddings": 4096},
                 "mistral4": {"rope_type": "yarn", "rope_theta": 10_000.0, "factor": 128.0,
                              "original_max_position_embeddings": 8192, "beta_fast": 32.0, "beta_slow": 1.0,
                              "mscale_all_dim": 1.0, "mscale": 1.0, "llama_4_scaling_beta": 0.1},
                 "ministral3": {"rope_type": "yarn", "rope_theta": 1_000_000.0, "factor": 16.0,
                                "original_max_position_embeddings": 16_384, "beta_fast": 32.0, "beta_slow": 1.0,
                                "mscale_all_dim": 1.0, "mscale": 1.0, "llama_4_scaling_beta": 0.1}}
# and SiglipVisionConfig's, which its vision_config leaves out
SIGLIP = {"hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12, "num_channels": 3,
          "image_size": 224, "patch_size": 16, "vision_use_head": True}
# Mistral 3's (Mistral Small 3.1 and 3.2): its text model's and Pixtral vision tower's sizes where its
# config.json gives no text_config or vision_config (Mistral Small 3.1's), the fields a given one leaves
# out taking MistralConfig's and PixtralVisionConfig's defaults, and the projector's
MISTRAL3_TEXT = {"model_type": "mistral", "head_dim": 128, "hidden_size": 5120, "intermediate_size": 32768,
                 "max_position_embeddings": 131_072, "num_attention_heads": 32, "num_hidden_layers": 40,
                 "num_key_value_heads": 8, "rms_norm_eps": 1e-5, "rope_theta": 1e9, "sliding_window": None,
                 "vocab_size": 131_072}
MISTRAL_TEXT = {"model_type": "mistral", "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336,
                "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
                "max_position_embeddings": 131_072, "rms_norm_eps": 1e-6, "rope_theta": 10000.0}
PIXTRAL = {"hidden_size": 1024, "intermediate_size": 4096, "num_hidden_layers": 24, "num_channels": 3,
           "patch_size": 16}
MISTRAL3_VISION = {**PIXTRAL, "patch_size": 14}
MISTRAL3 = {"spatial_merge_size": 2, "multimodal_projector_bias": False, "vision_feature_layer": -1}
# Qwen2.5-VL's and Qwen3-VL's vision towers' sizes where their vision_config leaves them out (transformers')
QWEN_VISION = {"in_channels": 3, "temporal_patch_size": 2, "spatial_merge_size": 2, "out_hidden_size": 3584}
QWEN25_VL_VISION = {**QWEN_VISION, "depth": 32, "hidden_size": 3584, "intermediate_size": 3420, "patch_size": 14}
# Qwen2-VL's: LayerNorms, a plain MLP mlp_ratio times as wide, its width embed_dim and its output hidden_size
QWEN2_VL_VISION = {**QWEN_VISION, "depth": 32, "embed_dim": 1280, "hidden_size": 3584, "mlp_ratio": 4, "patch_size": 14}
QWEN3_VL_VISION = {**QWEN_VISION, "depth": 27, "hidden_size": 1152, "intermediate_size": 4304, "patch_size": 16,
                   "num_position_embeddings": 2304, "deepstack_visual_indexes": [8, 16, 24]}
# a vision-language checkpoint's model_type -> its text model's, as this engine runs it, the model_type its
# text_config names, and transformers' defaults for the fields a text_config leaves out
QWEN_VL_TEXT = {"qwen2_vl": "qwen2", "qwen2_5_vl": "qwen2", "qwen3_vl": "qwen3", "qwen3_vl_moe": "qwen3_moe"}
QWEN_VL_TEXT_TYPE = {"qwen2_vl": "qwen2_vl_text", "qwen2_5_vl": "qwen2_5_vl_text", "qwen3_vl": "qwen3_vl_text",
                     "qwen3_vl_moe": "qwen3_vl_moe_text"}
QWEN2_VL_TEXT_DEFAULTS = {"vocab_size": 152_064, "hidden_size": 8192, "intermediate_size": 29568, "num_hidden_layers": 80,
                          "num_attention_heads": 64, "num_key_value_heads": 8, "max_position_embeddings": 32768,
                          "rms_norm_eps": 1e-5, "rope_theta": 1_000_000.0}
QWEN_VL_TEXT_DEFAULTS = {
    "qwen2_vl": QWEN2_VL_TEXT_DEFAULTS, "qwen2_5_vl": QWEN2_VL_TEXT_DEFAULTS,
    "qwen3_vl": {"vocab_size": 151_936, "hidden_size": 4096, "intermediate_size": 22016, "num_hidden_layers": 32,
                 "num_attention_heads": 32, "num_key_value_heads": 32, "head_dim": 128,
                 "max_position_embeddings": 128_000, "rms_norm_eps": 1e-6, "rope_theta": 500_000.0},
    # Qwen3-VL's mixture of experts: Qwen3-MoE's, its routing weights always renormalised
    "qwen3_vl_moe": {"vocab_size": 151_936, "hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 24,
                     "num_attention_heads": 16, "num_key_value_heads": 16,  # head_dim: hidden / heads
                     "max_position_embeddings": 128_000, "rms_norm_eps": 1e-6, "rope_theta": 500_000.0,
                     "moe_intermediate_size": 1408, "num_experts": 60, "num_experts_per_tok": 4, "decoder_sparse_step": 1}}
FUSED = {"self_attn.qkv_proj.weight": ("q_proj", "k_proj", "v_proj"), "mlp.gate_up_proj.weight": ("gate_proj", "up_proj")}
MOE_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe", "gpt_oss", "minimax_m2", "ernie4_5_moe", "olmoe", "granitemoe",
             "granitemoeshared", *GROUPED_TYPES)
# where a layer's experts are stored, and one expert's (gate, up, down) projections there: Mixtral's
# names, or Qwen-MoE's
EXPERT_LAYOUTS = {"block_sparse_moe": ("w1", "w3", "w2"), "mlp": ("gate_proj", "up_proj", "down_proj")}


class CheckpointError(ValueError):
    """A checkpoint directory that cannot be loaded; the message says which file and why."""


def _rope_kind(params: dict) -> str | None:
    """The RoPE scaling's kind: ``rope_type`` (transformers 5), else ``type`` (earlier releases), where a null
    ``rope_type`` names none."""
    return params.get("rope_type") or params.get("type")


def _rope(cfg: dict, path: Path) -> tuple[float, RopeScaling | None]:
    """RoPE's base and scaling, from ``rope_parameters`` (transformers 5) or ``rope_scaling`` and
    ``rope_theta`` (earlier releases)."""
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if not isinstance(params, dict):
        raise CheckpointError(f"{path}: rope parameters must be an object, got {params!r}")
    kind = _rope_kind(params) or "default"
    if kind == "mrope":  # Qwen2.5-VL's multimodal RoPE: on text, whose three position indices are equal, the plain one
        kind = "default"
    if kind == "su":  # LongRoPE's first name, which early Phi-3 configs and vLLM still take
        kind = "longrope"
    # Hunyuan's NTK-aware alpha: a fixed, stretched base (for other families transformers and vLLM read it apart)
    if kind == "dynamic" and params.get("alpha") is not None and cfg.get("model_type") == "hunyuan_v1_dense":
        return _ntk_alpha_theta(params, cfg, path), None
    if kind not in ("default", None, *RopeScaling.KINDS):
        raise CheckpointError(f"{path}: rope type {kind!r} is not supported "
                              f"(the default rotary embedding, {', '.join(RopeScaling.KINDS)})")
    try:
        theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
        if kind in ("default", None):
            return theta, None
        if kind == "linear":
            return theta, RopeScaling("linear", float(params["factor"]))
        if kind == "yarn":
            return theta, _yarn(params, cfg)
        if kind == "longrope":
            return theta, _longrope(params, cfg)
        return theta, RopeScaling("llama3", float(params["factor"]), float(params["low_freq_factor"]),
                                  float(params["high_freq_factor"]), int(params["original_max_position_embeddings"]))
    except KeyError as exc:
        raise CheckpointError(f"{path}: rope type {kind!r} needs {exc.args[0]!r}") from exc
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"{path}: {exc}") from exc


def _hunyuan_dense(cfg: dict, path: Path) -> None:
    """Refuse what a Hunyuan config describes beyond its dense models, as vLLM reads it: cross-layer attention
    (``use_cla`` with a ``cla_share_factor`` > 1: one layer's KV read by the next ones, a cache this engine does not
    hold) and experts (``num_experts`` > 1, or a list of them with one > 1)."""
    try:
        share = _int(cfg, "cla_share_factor", 1) if cfg.get("use_cla") else 1
        experts = cfg.get("num_experts", 1)
        most = max((_int({"num_experts": e}, "num_experts") for e in experts), default=1) if isinstance(experts, list) \
            else _int(cfg, "num_experts", 1)
    except ValueError as exc:
        raise CheckpointError(f"{path}: {exc}") from None
    if share > 1:
        raise CheckpointError(f"{path}: use_cla is not supported (cross-layer attention: every {share} layers share one "
                              "layer's KV, a cache this engine does not hold)")
    if most > 1:
        raise CheckpointError(f"{path}: num_experts {experts!r} is not supported (Hunyuan's dense models: one expert)")


def _ntk_alpha_theta(params: dict, cfg: dict, path: Path) -> float:
    """RoPE's base stretched by an NTK ``alpha``, base x alpha ** (d / (d - 2)) over a head's d features, as
    transformers' and vLLM's Hunyuan compute it (fixed: it does not follow the sequence's length)."""
    theta, alpha = params.get("rope_theta", cfg.get("rope_theta", 10000.0)), params["alpha"]
    if not is_positive(theta) or not is_positive(alpha):
        raise CheckpointError(f"{path}: rope_theta and alpha must be numbers > 0, got {theta!r} and {alpha!r}")
    try:
        dim = _int(cfg, "head_dim") if cfg.get("head_dim") else _int(cfg, "hidden_size") // _int(cfg, "num_attention_heads")
    except (KeyError, ValueError, ZeroDivisionError) as exc:
        raise CheckpointError(f"{path}: a RoPE alpha needs each head's width ({exc})") from None
    if dim <= 2:
        raise CheckpointError(f"{path}: a RoPE alpha needs heads wider than 2 features, got {dim}")
    return float(theta) * float(alpha) ** (dim / (dim - 2))


def _longrope(params: dict, cfg: dict) -> RopeScaling:
    """LongRoPE's factors as vLLM reads them: the original context from config.json's top level (Phi-3's, 4,096
    where it gives none, as its configuration class does), else the rope parameters'; the scales from
    ``short_mscale`` and ``long_mscale`` where given, else from the declared context over the original one.
    A ``factor`` or ``attention_factor`` there is read past, as vLLM reads past it (transformers scales by them)."""
    original = _int(cfg if cfg.get("original_max_position_embeddings") is not None else params,
                    "original_max_position_embeddings")
    factors = {}
    for key in ("short_factor", "long_factor"):
        value = params[key]
        if not isinstance(value, list) or not all(isinstance(f, (int, float)) and not isinstance(f, bool) for f in value):
            raise ValueError(f"rope parameters' {key} must be a list of numbers, got {value!r:.100}")
        factors[key] = tuple(float(f) for f in value)
    factor = _int(cfg, "max_position_embeddings", 2048) / original if original > 0 else 1.0
    return RopeScaling("longrope", factor, original_max_position=original, attention_factor=_float(params, "short_mscale"),
                       long_attention_factor=_float(params, "long_mscale"), **factors)


def _yarn_context(params: dict, cfg: dict) -> tuple[int, float]:
    """YaRN's original context and factor as transformers reads them: the context from
    ``original_max_position_embeddings`` (config.json's top level first, then the rope parameters';
    ``max_position_embeddings`` where neither has the field), the factor from ``factor`` (where null,
    the ratio of the two contexts, as DeepSeek's)."""
    key, declared = "original_max_position_embeddings", _int(cfg, "max_position_embeddings", 2048)
    where = cfg if key in cfg else params if key in params else None
    original = declared if where is None else _int(where, key)
    if original <= 0:
        raise ValueError(f"{key} must be > 0, got {original}")
    return original, declared / original if params["factor"] is None else _float(params, "factor")


def _yarn(params: dict, cfg: dict) -> RopeScaling:
    """YaRN's scaling as transformers reads it: its context and factor (``_yarn_context``), the attention
    factor from ``attention_factor`` or else ``mscale`` and ``mscale_all_dim``, beta_fast and beta_slow
    32 and 1 where null or left out, ``truncate`` true where left out (false where null)."""
    original, factor = _yarn_context(params, cfg)
    attention = _float(params, "attention_factor")
    mscale, mscale_all = _float(params, "mscale"), _float(params, "mscale_all_dim")
    if attention is None and mscale and mscale_all:
        def get(m: float) -> float:
            return 0.1 * m * math.log(factor) + 1.0 if factor > 1 else 1.0
        attention = get(mscale) / get(mscale_all)
    truncate = params.get("truncate", True)
    if truncate is not None and not isinstance(truncate, bool):
        raise ValueError(f"rope parameters' truncate must be true or false, got {truncate!r}")
    return RopeScaling("yarn", factor, original_max_position=original, beta_fast=_float(params, "beta_fast") or 32.0,
                       beta_slow=_float(params, "beta_slow") or 1.0, truncate=bool(truncate), attention_factor=attention)


def _float(params: dict, key: str) -> float | None:
    """``params[key]`` as a number, None where it is null or absent: "4" or true are refused naming the
    field, rather than read as one."""
    value = params.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"rope parameters' {key} must be a number, got {value!r}")
    return float(value)


def _int(cfg: dict, key: str, default: int | None = None) -> int:
    """``cfg[key]`` as a whole number (``default`` where absent): 32.0 reads as 32, and 32.5, "32" or
    true are refused naming the field, rather than cut to a whole number or read as one."""
    value = cfg[key] if default is None else cfg.get(key, default)
    if value is None and default is not None:
        value = default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not float(value).is_integer():
        raise ValueError(f"{key} must be a whole number, got {value!r}")
    return int(value)


def read_config(directory: str | Path) -> ModelConfig:
    """The model a checkpoint's ``config.json`` describes, refusing what the engine cannot run as its
    author meant (another RoPE scaling, another activation, MLP biases); the layers a sliding window
    shorter than the context applies to attend through it (``sliding_window``, ``window_layers``)."""
    mc, ignored = _read_config(directory, run=True)
    return mc


def read_sizes(directory: str | Path) -> tuple[ModelConfig, list[str]]:
    """The model's sizes from ``config.json`` alone, for a deployment sized on a cost model: what only
    the weights' arithmetic needs to be run is read past (its RoPE scaling, activation, biases), and
    what changes memory but is not modelled (a sliding window: the KV is sized as full attention, the
    most it may need) is returned as notes."""
    return _read_config(directory, run=False)


def declared_context(directory: str | Path) -> int:
    """The context ``config.json`` declares for the decoder (``max_position_embeddings``, a multimodal
    checkpoint's text model's, its family's default where left out), before any RoPE scaling extends it."""
    _, cfg, _ = _config(directory, run=False)
    return _int(cfg, "max_position_embeddings", 2048)


def _config(directory: str | Path, run: bool) -> tuple[Path, dict, int]:
    """``config.json``'s path, the decoder's fields (a multimodal checkpoint's text model's, with its
    family's defaults where transformers' differ from Llama's) and the parameters held beside it."""
    directory = Path(directory).expanduser()
    path = directory / "config.json"
    if not directory.is_dir():
        raise CheckpointError(f"{directory}: no such checkpoint directory")
    if not path.is_file():
        needs = "config.json and *.safetensors" if run else "its config.json"
        raise CheckpointError(f"{path}: missing (a checkpoint needs {needs})")
    try:
        cfg = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path}: not valid JSON ({exc})") from exc
    except (OSError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path}: cannot be read ({exc})") from exc
    if not isinstance(cfg, dict):
        raise CheckpointError(f"{path}: must hold a JSON object (a model's configuration), got {type(cfg).__name__}")
    cfg = {**cfg, "model_type": _model_type(cfg, path)}
    try:
        cfg, vision = _text_config(cfg)
        cfg = {**DEFAULTS.get(cfg["model_type"], {}), **cfg}
        if cfg["model_type"] in ROPE_DEFAULTS and not cfg.get("rope_parameters") and not cfg.get("rope_scaling"):
            cfg["rope_parameters"] = ROPE_DEFAULTS[cfg["model_type"]]
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"{path}: {exc}") from exc
    return path, cfg, vision


def _model_type(cfg: dict, path: Path) -> str:
    """``cfg``'s model_type where it is one of ``MODEL_TYPES``, else the one its architecture's class runs as
    (``ARCHITECTURES``), as vLLM picks the class; refused saying why where it is one of ``NOT_MODELLED``, and naming
    both where neither is known."""
    kind = cfg.get("model_type")
    if kind in MODEL_TYPES:
        return kind
    # Granite 4's hybrids (its dense models share the type with every layer attention: refused as unknown)
    hybrid = kind != "granitemoehybrid" or "mamba" in (cfg.get("layer_types") or cfg.get("layers_block_type") or [])
    if isinstance(kind, str) and kind in NOT_MODELLED and hybrid:
        raise CheckpointError(f"{path}: model_type {kind!r} is not supported: {NOT_MODELLED[kind]}")
    named = cfg.get("architectures")
    named = named[0] if isinstance(named, list) and len(named) == 1 else None
    if isinstance(named, str) and named in ARCHITECTURES:
        return ARCHITECTURES[named]
    raise CheckpointError(f"{path}: model_type {kind!r} is not one of {', '.join(MODEL_TYPES)}, nor is its "
                          f"architectures {cfg.get('architectures')!r} one of {', '.join(ARCHITECTURES)}")


def _read_config(directory: str | Path, run: bool) -> tuple[ModelConfig, list[str]]:
    path, cfg, vision = _config(directory, run)
    try:
        theta, scaling = _rope(cfg, path)
    except CheckpointError:
        if run:
            raise
        theta, scaling = 10000.0, None  # sizes and the cost model read no rotary embedding
    if not run and scaling is not None and scaling.kind == "longrope":
        scaling = None  # nor LongRoPE's factors, whose count only the rotation checks
    try:
        heads, hidden = _int(cfg, "num_attention_heads"), _int(cfg, "hidden_size")
        if heads <= 0:
            raise ValueError(f"num_attention_heads must be > 0, got {heads}")
        # latent attention's heads are as wide as its fields say (transformers writes its RoPE's width as head_dim)
        latent = _latent(cfg) if cfg["model_type"] in DEEPSEEK_TYPES else {}
        head_dim = hidden // heads if cfg.get("head_dim") is None else _int(cfg, "head_dim")
        if latent:  # its heads' width is qk_nope_head_dim + qk_rope_head_dim, whatever hidden_size / heads is
            head_dim = hidden // heads if hidden % heads == 0 and hidden >= heads else 0
        elif head_dim <= 0:
            raise ValueError(f"head_dim must be > 0, got {head_dim}")
        partial = _partial_rotary(cfg)
        mc = ModelConfig(**latent, partial_rotary=partial if cfg["model_type"] in PARTIAL_ROTARY_TYPES else 1.0,
            vocab_size=_int(cfg, "vocab_size"), hidden_size=hidden,
            intermediate_size=_int(cfg, "intermediate_size"), num_layers=_int(cfg, "num_hidden_layers"),
            num_heads=heads, num_kv_heads=heads if cfg.get("num_key_value_heads") is None
            else _int(cfg, "num_key_value_heads"),
            max_position=_int(cfg, "max_position_embeddings", 2048), rope_theta=theta,
            rope_scaling=scaling,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", cfg["model_type"] in GEMMA_TYPES)),
            qkv_bias=(cfg["model_type"] == "qwen2" or bool(cfg.get("attention_bias")) and not latent
                      or (cfg["model_type"] == "qwen2_moe" and bool(cfg.get("qkv_bias", True)))),
            o_bias=bool(cfg.get("attention_out_bias")) if cfg["model_type"] == "seed_oss"
            else bool(cfg.get("attention_bias")) and cfg["model_type"] not in ("glm4_moe", "glm4"),
            qk_norm=cfg["model_type"] in ("qwen3", "qwen3_moe", "dots1")
            or cfg["model_type"] == "glm4_moe" and bool(cfg.get("use_qk_norm")),
            explicit_head_dim=None if head_dim * heads == hidden or latent else head_dim,
            dtype=str(cfg.get("dtype") or cfg.get("torch_dtype") or "float32"))
        if cfg["model_type"] in GEMMA_TYPES:
            mc = _gemma(cfg, mc)
        if cfg["model_type"] in ("granite", "granitemoe", "granitemoeshared"):
            mc = _granite(cfg, mc)
        if cfg["model_type"] in ("cohere", "cohere2"):
            mc = _cohere(cfg, mc)
        if cfg["model_type"] == "exaone4":
            mc = replace(mc, qk_norm=True, sandwich_norms=True, pre_norms=False, nope_layers=_global_nope(cfg, mc))
        if cfg["model_type"] in ("olmo2", "olmo3"):
            mc = replace(mc, qk_norm=True, qk_norm_across_heads=True, sandwich_norms=True, pre_norms=False)
        if cfg["model_type"] in ("minimax_m2", "olmoe"):  # OLMo 2's q and k norms in Llama's layers (always)
            mc = replace(mc, qk_norm=True, qk_norm_across_heads=True)
        if cfg["model_type"] in ("ernie4_5", "ernie4_5_moe"):
            mc = replace(mc, rope_interleaved=True)
        if cfg["model_type"] == "hunyuan_v1_dense" and cfg.get("use_qk_norm", True):  # transformers' always norms
            mc = replace(mc, qk_norm=True, qk_norm_after_rope=True)
        if cfg["model_type"] == "glm4":
            mc = replace(mc, sandwich_norms=True, rope_interleaved=True)
        if cfg["model_type"] == "smollm3":
            mc = replace(mc, nope_layers=_nope_layers(cfg, mc.num_layers))
        if cfg["model_type"] == "llama4_text":
            mc = _llama4(cfg, mc)
        if cfg["model_type"] in ("ministral3", "mistral4"):
            mc = _ministral3(cfg, mc)
        if vision:
            mc = replace(mc, encoder_params=vision)
    except KeyError as exc:
        raise CheckpointError(f"{path}: missing field {exc.args[0]!r}") from exc
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"{path}: {exc}") from exc
    if cfg["model_type"] in MOE_TYPES:
        mc = _experts(cfg, mc, path)
    try:
        layers = _window_layers(cfg, mc.num_layers)
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"{path}: {exc}") from exc
    ignored = []
    if mc.window_chunked:
        ignored.append(f"its chunked attention ({mc.sliding_window} tokens) frees no KV here: the KV is sized as full "
                       "attention, the most it may need")
    window = cfg.get("sliding_window") if layers else None
    if window is None and layers and cfg["model_type"] in LAYER_TYPE_ROPE:  # no window, but their own RoPE
        mc = replace(mc, sliding_window=mc.max_position, window_layers=layers)
    if window is not None:
        if isinstance(window, bool) or not isinstance(window, (int, float)) or not float(window).is_integer() or window < 2:
            raise CheckpointError(f"{path}: sliding_window must be a whole number of tokens >= 2, got {window!r}")
        # attended through, past the window too; its KV kept whole, as for full attention: the most it may need.
        # Gemma 3's and OLMo 3's windowed layers keep their own RoPE where no context reaches the window too
        if window < mc.max_position or cfg["model_type"] in LAYER_TYPE_ROPE:
            mc = replace(mc, sliding_window=int(window), window_layers=layers)
        if window < mc.max_position:
            ignored.append(f"its sliding window ({window!r} tokens) frees no KV here: the KV is sized as full "
                           "attention, the most it may need")
    if cfg["model_type"] in LAYER_TYPE_ROPE:
        try:
            mc = _layer_type_rope(cfg, mc, path)
        except CheckpointError:
            if run:
                raise
    if cfg["model_type"] in NO_FLOAT16 and mc.dtype == "float16":  # vLLM's fallback where float16 is refused
        mc = replace(mc, dtype="bfloat16")
    if not run:  # served as vLLM serves it by default: float16 for float32 (bfloat16 where float16 is refused)
        dtype = "bfloat16" if cfg["model_type"] in NO_FLOAT16 else "float16"
        return replace(mc, max_position=_longest_context(cfg, mc.max_position),
                       dtype=dtype if mc.dtype == "float32" else mc.dtype), ignored
    if cfg["model_type"] in GEMMA_TYPES:
        field, act = _gemma_activation(cfg)
        if act != "gelu_pytorch_tanh":
            raise CheckpointError(f"{path}: {field} {act!r} is not supported (Gemma's MLP is 'gelu_pytorch_tanh')")
        if cfg.get("use_bidirectional_attention"):
            raise CheckpointError(f"{path}: use_bidirectional_attention is not supported (a decoder attends causally)")
    elif cfg.get("hidden_act", "silu") != "silu":
        raise CheckpointError(f"{path}: hidden_act {cfg['hidden_act']!r} is not supported (Llama's MLP is 'silu')")
    if cfg.get("mlp_bias"):
        raise CheckpointError(f"{path}: MLP biases are not supported")
    if cfg["model_type"] in ("ernie4_5", "ernie4_5_moe") and cfg.get("use_bias"):  # every projection's, the MLPs' too
        raise CheckpointError(f"{path}: use_bias is not supported (biases on the MLPs)")
    if cfg["model_type"] == "hunyuan_v1_dense":
        _hunyuan_dense(cfg, path)
    if cfg["model_type"] == "olmoe" and cfg.get("clip_qkv") is not None:
        raise CheckpointError(f"{path}: clip_qkv {cfg['clip_qkv']!r} is not supported (q, k and v unclipped)")
    # transformers' own rotates the whole head (latent attention: its qk_rope_head_dim, whatever the share says)
    if partial != 1 and cfg["model_type"] not in PARTIAL_ROTARY_TYPES and not mc.kv_lora_rank:
        raise CheckpointError(f"{path}: partial_rotary_factor {partial!r} is not supported for {cfg['model_type']} "
                              f"(RoPE over the whole head; a part of it for {', '.join(PARTIAL_ROTARY_TYPES)})")
    return mc, ignored


def _gemma_activation(cfg: dict) -> tuple[str, str]:
    """The field Gemma's MLP activation is read from and its value: ``hidden_activation``, else (Gemma's,
    not Gemma 2's or 3's) ``hidden_act``, where Gemma's first releases wrote "gelu" and meant the tanh
    approximation (transformers and vLLM read it so)."""
    if cfg.get("hidden_activation") or cfg["model_type"] != "gemma" or not cfg.get("hidden_act"):
        return "hidden_activation", cfg.get("hidden_activation") or "gelu_pytorch_tanh"
    return "hidden_act", "gelu_pytorch_tanh" if cfg["hidden_act"] == "gelu" else cfg["hidden_act"]


def _top_dtype(cfg: dict, text: dict) -> str | None:
    """A multimodal checkpoint's dtype: its top level's, as vLLM reads it, else its text model's (its quantisation
    is read from the file: ``_quantization_config``)."""
    return cfg.get("dtype") or cfg.get("torch_dtype") or text.get("dtype") or text.get("torch_dtype")


def _text_config(cfg: dict) -> tuple[dict, int]:
    """The decoder's fields and the parameters held beside it: a multimodal Gemma 3's, Mistral 3's or
    Qwen-VL's text model and its vision tower's and projector's parameters, counted from its
    ``vision_config``; ``cfg`` and 0 for any other checkpoint."""
    if cfg["model_type"] == "gemma3":
        return _gemma3(cfg)
    if cfg["model_type"] == "mistral3":
        return _mistral3(cfg)
    if cfg["model_type"] in QWEN_VL_TEXT:
        return _qwen_vl(cfg)
    if cfg["model_type"] == "llama4":
        return _llama4_multimodal(cfg)
    if cfg["model_type"] == "kimi_k25":
        return _kimi_k25(cfg)
    return cfg, 0


# transformers' Kimi_K25VisionConfig's defaults (Kimi K2.5's MoonViT tower)
KIMI_K25_VISION = {"patch_size": 14, "pos_emb_height": 64, "pos_emb_width": 64, "num_hidden_layers": 27,
                   "hidden_size": 1152, "intermediate_size": 4304, "merge_kernel_size": [2, 2]}
# its published config.json's names for them -> transformers'
KIMI_K25_VISION_NAMES = {"vt_hidden_size": "hidden_size", "vt_intermediate_size": "intermediate_size",
                         "vt_num_hidden_layers": "num_hidden_layers", "init_pos_emb_height": "pos_emb_height",
                         "init_pos_emb_width": "pos_emb_width"}


def _kimi_k25(cfg: dict) -> tuple[dict, int]:
    """Kimi K2.5's text model (Kimi K2's: DeepSeek-V3's, its lm_head untied as its text_config says, as vLLM builds
    it) and the parameters of its MoonViT tower (a patch embedding with a bias, a learned grid of positions,
    encoder layers with biases, a final layer norm) and projector (a layer norm, then two layers over each group of
    ``merge_kernel_size`` patches)."""
    text, vision = cfg.get("text_config") or {}, cfg.get("vision_config") or {}
    if not isinstance(text, dict) or not isinstance(vision, dict):
        raise ValueError("text_config and vision_config must be objects")
    if text.get("model_type", "deepseek_v3") not in ("deepseek_v3", "kimi_k2"):
        raise ValueError(f"text_config.model_type {text['model_type']!r} is not supported (Kimi K2.5's text model is "
                         "'kimi_k2' or 'deepseek_v3')")
    text = {**DEFAULTS["deepseek_v3"], **text, "model_type": "deepseek_v3"}
    # the published config.json's names for the tower's sizes (Moonshot's code), else transformers'
    v = {**KIMI_K25_VISION, **vision, **{ours: vision[theirs] for theirs, ours in KIMI_K25_VISION_NAMES.items()
                                         if theirs in vision}}
    if "mm_hidden_size" in vision and "projection_hidden_size" not in cfg:
        cfg = {**cfg, "projection_hidden_size": vision["mm_hidden_size"]}
    h, i, patch = _int(v, "hidden_size"), _int(v, "intermediate_size"), _int(v, "patch_size")
    merge = v["merge_kernel_size"]
    if not isinstance(merge, list) or len(merge) != 2 or patch <= 0:
        raise ValueError(f"vision_config.merge_kernel_size must be two whole numbers > 0 and patch_size > 0, got "
                         f"{merge!r} and {patch}")
    merge = [_int({"merge_kernel_size": m}, "merge_kernel_size") for m in merge]  # 2.0 reads as 2, as _int reads it
    if min(merge) <= 0:
        raise ValueError(f"vision_config.merge_kernel_size must be two whole numbers > 0, got {merge!r}")
    per_layer = 4 * (h * h + h) + 2 * h * i + i + h + 4 * h  # q/k/v/proj with biases, the MLP's two layers, two norms
    embeddings = 3 * patch * patch * h + h + _int(v, "pos_emb_height") * _int(v, "pos_emb_width") * h
    grouped = h * merge[0] * merge[1]  # each group of merged patches' features
    projector = 2 * _int({"projection_hidden_size": h, **cfg}, "projection_hidden_size") + grouped * grouped + grouped \
        + grouped * _int(text, "hidden_size") + _int(text, "hidden_size")
    tower = _int(v, "num_hidden_layers") * per_layer + embeddings + 2 * h + projector
    dtype = _top_dtype(cfg, text)
    return {**text, "dtype": dtype}, tower


# transformers' Llama4VisionConfig's defaults (Llama 4 Scout's and Maverick's tower)
LLAMA4_VISION = {"hidden_size": 768, "num_hidden_layers": 34, "num_attention_heads": 16, "num_channels": 3,
                 "intermediate_size": 5632, "vision_output_dim": 7680, "image_size": 448, "patch_size": 14,
                 "projector_input_dim": 4096, "projector_output_dim": 4096}


def _llama4_multimodal(cfg: dict) -> tuple[dict, int]:
    """Llama 4's text model (Scout's and Maverick's checkpoints hold one beside a vision tower) and the
    parameters of its tower (a patch embedding without a bias, class and positional embeddings, layer norms
    before and after, encoder layers with biases, a pixel-shuffle MLP of two matrices) and projector (one matrix)."""
    text, vision = cfg.get("text_config") or {}, cfg.get("vision_config") or {}
    if not isinstance(text, dict) or not isinstance(vision, dict):
        raise ValueError("text_config and vision_config must be objects")
    if text.get("model_type", "llama4_text") != "llama4_text":
        raise ValueError(f"text_config.model_type {text['model_type']!r} is not supported (Llama 4's text model is "
                         "'llama4_text')")
    v = {**LLAMA4_VISION, **vision}
    h, i, patch, heads = (_int(v, "hidden_size"), _int(v, "intermediate_size"), _int(v, "patch_size"),
                          _int(v, "num_attention_heads"))
    if patch <= 0 or heads <= 0:
        raise ValueError(f"vision_config.patch_size and num_attention_heads must be > 0, got {patch} and {heads}")
    q = heads * (h // heads)
    per_layer = 3 * (h * q + q) + q * h + h + 2 * h * i + i + h + 4 * h  # q/k/v/o, the MLP, two layer norms
    embeddings = _int(v, "num_channels") * patch * patch * h + h + ((_int(v, "image_size") // patch) ** 2 + 1) * h
    adapter = i * _int(v, "projector_input_dim") + _int(v, "projector_output_dim") ** 2
    projector = _int(v, "vision_output_dim") * _int({**DEFAULTS["llama4_text"], **text}, "hidden_size")
    tower = _int(v, "num_hidden_layers") * per_layer + embeddings + 4 * h + adapter + projector
    dtype = _top_dtype(cfg, text)
    return {**text, "model_type": "llama4_text", "dtype": dtype}, tower


def _gemma3(cfg: dict) -> tuple[dict, int]:
    """Gemma 3's text model and the parameters of its SigLIP tower and projector (a linear layer and its norm)."""
    text, v = cfg.get("text_config") or {}, {**SIGLIP, **(cfg.get("vision_config") or {})}
    if not isinstance(text, dict) or not isinstance(cfg.get("vision_config") or {}, dict):
        raise ValueError("text_config and vision_config must be objects")
    dtype = _top_dtype(cfg, text)
    h, i, patch = _int(v, "hidden_size"), _int(v, "intermediate_size"), _int(v, "patch_size")
    if patch <= 0:
        raise ValueError(f"vision_config.patch_size must be > 0, got {patch}")
    mlp = 2 * h * i + i + h
    per_layer = 4 * h * h + 4 * h + mlp + 4 * h  # q/k/v/o, the MLP, two layer norms, with their biases
    embeddings = _int(v, "num_channels") * patch * patch * h + h + (_int(v, "image_size") // patch) ** 2 * h
    head = h + 4 * h * h + 4 * h + 2 * h + mlp if v["vision_use_head"] else 0  # a probe attending over the patches
    projector = h * _int({**GEMMA3_TEXT, **text}, "hidden_size") + h  # and its norm
    vision = _int(v, "num_hidden_layers") * per_layer + embeddings + 2 * h + head + projector
    return {**text, "model_type": "gemma3_text", "dtype": dtype}, vision


def _mistral3(cfg: dict) -> tuple[dict, int]:
    """Mistral 3's text model (a Mistral decoder, its lm_head untied as its text_config says, as vLLM
    builds it) and the parameters of its Pixtral tower and projector (an RMSNorm, a merger of
    ``spatial_merge_size`` squared patches, two linear layers)."""
    text, vision = cfg.get("text_config"), cfg.get("vision_config")
    if not isinstance(text or {}, dict) or not isinstance(vision or {}, dict):
        raise ValueError("text_config and vision_config must be objects")
    if text is None:
        text = dict(MISTRAL3_TEXT)
    else:  # Ministral 3's text model is ministral3, Mistral 4's mistral4, Mistral Small 3.1's and 3.2's mistral
        text = {**(DEFAULTS[text["model_type"]] if text.get("model_type") in ("ministral3", "mistral4") else MISTRAL_TEXT),
                **text}
    v = dict(MISTRAL3_VISION) if vision is None else {**PIXTRAL, **vision}
    if text.get("model_type") not in ("mistral", "ministral3", "mistral4"):
        raise ValueError(f"text_config.model_type {text.get('model_type')!r} is not supported (Mistral 3's text "
                         "model is 'mistral', 'ministral3' or 'mistral4')")
    top = {**MISTRAL3, **cfg}
    dtype = _top_dtype(cfg, text)
    h, i, patch = _int(v, "hidden_size"), _int(v, "intermediate_size"), _int(v, "patch_size")
    layers = top["vision_feature_layer"]
    feature_layers = len(layers) if isinstance(layers, list) else 1
    t, bias = _int(text, "hidden_size"), bool(top["multimodal_projector_bias"])
    tower = _int(v, "num_channels") * patch * patch * h + h + _int(v, "num_hidden_layers") * (4 * h * h + 3 * h * i + 2 * h)
    projector = h + _int(top, "spatial_merge_size") ** 2 * h * h + h * feature_layers * t + t * t + 2 * t * bias
    return {**text, "dtype": dtype}, tower + projector


def _qwen_vl(cfg: dict) -> tuple[dict, int]:
    """Qwen2-VL's, Qwen2.5-VL's or Qwen3-VL's text model (Qwen2's or Qwen3's decoder; its multimodal RoPE
    is the plain one on text, whose three position indices are equal) and the parameters of its vision
    tower and patch merger (and Qwen3-VL's deepstack mergers). Qwen2-VL's and Qwen2.5-VL's published
    config.json write the text model's fields at the top level, transformers 5 under ``text_config``."""
    text, v = cfg.get("text_config"), cfg.get("vision_config")
    if not isinstance(text or {}, dict) or not isinstance(v or {}, dict):
        raise ValueError("text_config and vision_config must be objects")
    kind = cfg["model_type"]
    qwen3 = kind in ("qwen3_vl", "qwen3_vl_moe")
    if text is None:
        if qwen3:  # transformers would build its defaults, whatever the top level says
            raise ValueError(f"a {kind} config.json holds its text model under text_config: there is none")
        text = {k: val for k, val in cfg.items() if k not in ("vision_config", "model_type")}
    if text.get("model_type", QWEN_VL_TEXT_TYPE[kind]) != QWEN_VL_TEXT_TYPE[kind]:
        raise ValueError(f"text_config.model_type {text['model_type']!r} is not supported (this checkpoint's text "
                         f"model is {QWEN_VL_TEXT_TYPE[kind]!r})")
    text = {**QWEN_VL_TEXT_DEFAULTS[kind], **text}
    v = {**(QWEN3_VL_VISION if qwen3 else QWEN2_VL_VISION if kind == "qwen2_vl" else QWEN25_VL_VISION), **(v or {})}
    dtype = _top_dtype(cfg, text)
    # tied as transformers ties them: by the top level's field, or (Qwen2-VL's and Qwen2.5-VL's) the text
    # model's (transformers 5 writes Qwen3-VL-MoE's text_config's default, true, beside an untied model)
    tie = bool(cfg.get("tie_word_embeddings", False)
               or (not qwen3 and text.get("tie_word_embeddings", False)))
    sizes = ("embed_dim", "hidden_size", "mlp_ratio") if kind == "qwen2_vl" else ("hidden_size", "intermediate_size",
                                                                                    "out_hidden_size")
    for key in (*sizes, "depth", "in_channels", "temporal_patch_size", "patch_size", "spatial_merge_size"):
        if _int(v, key) <= 0:
            raise ValueError(f"vision_config.{key} must be > 0, got {v[key]}")
    if kind == "qwen2_vl":  # its tower's width is embed_dim, its output hidden_size
        h, out = _int(v, "embed_dim"), _int(v, "hidden_size")
        i = h * _int(v, "mlp_ratio")
    else:
        h, i, out = _int(v, "hidden_size"), _int(v, "intermediate_size"), _int(v, "out_hidden_size")
    patch = _int(v, "in_channels") * _int(v, "temporal_patch_size") * _int(v, "patch_size") ** 2 * h
    merged = _int(v, "spatial_merge_size") ** 2 * h  # a merger's input: the patches it merges, side by side
    merger = merged * merged + merged + merged * out + out  # two linear layers, with their biases
    plain = 4 * h + 3 * h * h + 3 * h + h * h + h + 2 * h * i + i + h  # LayerNorms (with biases) and a plain MLP
    if qwen3:  # learned positions; deepstack mergers normed after merging
        block = plain
        tower = patch + h + _int(v, "num_position_embeddings") * h + 2 * h + merger
        tower += len(v["deepstack_visual_indexes"]) * (2 * merged + merger)
    elif kind == "qwen2_vl":  # a patch embedding without a bias; a LayerNorm before the merger
        block, tower = plain, patch + 2 * h + merger
    else:  # RMSNorms and a gated MLP, with biases
        block = 2 * h + 3 * h * h + 3 * h + h * h + h + 3 * h * i + 2 * i + h
        tower = patch + h + merger
    tower += _int(v, "depth") * block
    moe = {"norm_topk_prob": True} if kind == "qwen3_vl_moe" else {}
    return {**text, **moe, "model_type": QWEN_VL_TEXT[kind], "tie_word_embeddings": tie, "dtype": dtype}, tower


def _partial_rotary(cfg: dict) -> float:
    """The share of each head's features RoPE rotates: ``partial_rotary_factor`` in ``rope_parameters``
    (transformers 5) or at config.json's top level, else MiniMax-M2's ``rotary_dim`` over its head_dim (as
    transformers and vLLM read it); 1 where none gives one."""
    params = cfg.get("rope_parameters")
    value = params.get("partial_rotary_factor") if isinstance(params, dict) else None
    if value is None:
        value = cfg.get("partial_rotary_factor")
    if value is None and cfg["model_type"] == "minimax_m2" and cfg.get("rotary_dim") is not None:
        rotary, head = _int(cfg, "rotary_dim"), _int(cfg, "head_dim")
        if not 0 < rotary <= head or rotary % 2:
            raise ValueError(f"rotary_dim must be an even number of features in [2, head_dim {head}], got {rotary}")
        value = rotary / head
    if value is None:
        return 1.0
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
        raise ValueError(f"partial_rotary_factor must be a number in (0, 1], got {value!r}")
    return float(value)


def _latent(cfg: dict) -> dict:
    """DeepSeek's multi-head latent attention, as ``ModelConfig`` fields: its ranks and head widths, its
    RoPE's pairs interleaved (DeepSeek-V2's always; V3's unless ``rope_interleave`` is false, as transformers
    reads them), and where YaRN scales RoPE, the scale of its scores times mscale(factor, mscale_all_dim)
    squared, as transformers' ``yarn_apply_mscale`` and vLLM fold it in."""
    fields = {"kv_lora_rank": _int(cfg, "kv_lora_rank"), "q_lora_rank": _int(cfg, "q_lora_rank", 0),
              "qk_nope_head_dim": _int(cfg, "qk_nope_head_dim"), "qk_rope_head_dim": _int(cfg, "qk_rope_head_dim"),
              "v_head_dim": _int(cfg, "v_head_dim"),
              "rope_interleaved": cfg["model_type"] == "deepseek_v2" or bool(cfg.get("rope_interleave", True))}
    if fields["kv_lora_rank"] <= 0:
        raise ValueError(f"kv_lora_rank must be > 0, got {fields['kv_lora_rank']}")
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    kind = _rope_kind(params) if isinstance(params, dict) else None
    mscale_all = _float(params, "mscale_all_dim") if kind not in (None, "default") else None
    if mscale_all:
        _, factor = _yarn_context(params, cfg) if kind == "yarn" else (None, _float(params, "factor") or 1.0)
        m = 0.1 * mscale_all * math.log(factor) + 1.0 if factor > 1 else 1.0
        fields["query_scale"] = (fields["qk_nope_head_dim"] + fields["qk_rope_head_dim"]) ** -0.5 * m * m
    return fields


def _grouped_experts(cfg: dict, mc: ModelConfig) -> ModelConfig:
    """``mc`` with DeepSeek's mixture of experts: ``n_routed_experts`` experts routed in groups
    (DeepSeek-V2's ``greedy`` or ``group_limited_greedy`` over softmax scores, V3's and GLM-4.5's over sigmoid
    scores and a learned bias), their weights renormalised where ``norm_topk_prob`` (as vLLM reads it for V2 too,
    where transformers ignores it: no published V2 sets it) and times ``routed_scaling_factor``;
    ``n_shared_experts`` shared experts as one ungated MLP; the first
    ``first_k_dense_replace`` layers dense, and from there every ``moe_layer_freq``-th sparse (vLLM's rule;
    every published checkpoint's is 1)."""
    kind = cfg["model_type"]
    softmax = kind in ("deepseek_v2", "mistral4")
    scoring = cfg.get("scoring_func") or ("softmax" if softmax else "sigmoid")
    if scoring != ("softmax" if softmax else "sigmoid"):
        raise ValueError(f"scoring_func {scoring!r} is not supported ({kind}'s router scores by "
                         f"{'softmax' if softmax else 'sigmoid'})")
    if kind == "deepseek_v2":
        method = cfg.get("topk_method") or "greedy"
        if method not in ("greedy", "group_limited_greedy"):
            raise ValueError(f"topk_method {method!r} is not supported (DeepSeek-V2's: greedy, group_limited_greedy)")
        groups = (1, 1) if method == "greedy" else (_int(cfg, "n_group"), _int(cfg, "topk_group"))
        router = "softmax_groups"
    elif kind == "mistral4":  # within groups each scored by its best, as vLLM scores them (transformers: its two best)
        groups, router = (_int(cfg, "n_group", 1), _int(cfg, "topk_group", 1)), "softmax_groups"
    else:  # V3's picks by its biased sigmoid scores within groups (transformers' whatever topk_method says)
        groups, router = (_int(cfg, "n_group"), _int(cfg, "topk_group")), "sigmoid_groups"
    experts = _int(cfg, "n_routed_experts")
    if experts <= 0:
        raise ValueError(f"n_routed_experts must be > 0, got {experts}")
    if not 0 < groups[1] <= groups[0] or experts % groups[0]:
        raise ValueError(f"n_group must divide n_routed_experts ({experts}) and topk_group be in [1, n_group], "
                         f"got {groups[0]} and {groups[1]}")
    if router == "sigmoid_groups" and experts // groups[0] < 2:
        raise ValueError(f"n_group {groups[0]} leaves one of the {experts} experts a group, where each group is "
                         "scored by its two best")
    first, every = _int(cfg, "first_k_dense_replace", 0), _int(cfg, "moe_layer_freq", 1)
    if every <= 0:
        raise ValueError(f"moe_layer_freq must be > 0, got {every}")
    dense = tuple(i for i in range(mc.num_layers) if i < first or i % every)
    kinds = cfg.get("mlp_layer_types") if kind == "glm4_moe_lite" else None
    if kind == "glm4_moe_lite" and kinds is None and "first_k_dense_replace" not in cfg:
        kinds = ["dense"] + ["sparse"] * (mc.num_layers - 1)  # transformers' default: the first layer dense
    if kinds is not None:  # each layer's kind, as transformers places them
        if not isinstance(kinds, list) or len(kinds) != mc.num_layers or not set(kinds) <= {"dense", "sparse"}:
            raise ValueError(f"mlp_layer_types must list each of the {mc.num_layers} layers as dense or sparse, "
                             f"got {kinds!r:.200}")
        dense = tuple(i for i, k in enumerate(kinds) if k == "dense")
    width, shared = _int(cfg, "moe_intermediate_size"), _int(cfg, "n_shared_experts", 0)
    if shared < 0:
        raise ValueError(f"n_shared_experts must be >= 0, got {shared}")
    return replace(mc, num_experts=experts, experts_per_token=_int(cfg, "num_experts_per_tok"),
                   moe_intermediate_size=width, norm_topk_prob=bool(cfg.get("norm_topk_prob")),
                   moe_float32_weights=True,
                   dense_layers=dense,
                   shared_expert_intermediate_size=width * shared, shared_expert_gate=False,
                   router=router, expert_groups=groups[0], topk_groups=groups[1],
                   routed_scaling=_positive(cfg, "routed_scaling_factor"))


def _ernie_experts(cfg: dict, mc: ModelConfig) -> ModelConfig:
    """``mc`` with ERNIE 4.5's mixture of experts: ``moe_num_experts`` experts ``moe_intermediate_size`` wide,
    ``moe_k`` a token picked by their softmax scores plus a learned bias and weighed by those scores renormalised,
    beside ``moe_num_shared_experts`` ungated shared experts as one MLP; sparse on the layers from
    ``moe_layer_start_index`` to ``moe_layer_end_index`` (-1: the last) whose number (from 1) the
    ``moe_layer_interval`` divides, as transformers and vLLM place them."""
    experts, width, shared = _int(cfg, "moe_num_experts"), _int(cfg, "moe_intermediate_size"), _int(cfg, "moe_num_shared_experts", 0)
    if experts <= 0 or shared < 0:
        raise ValueError(f"moe_num_experts must be > 0 and moe_num_shared_experts >= 0, got {experts} and {shared}")
    first, last, every = (_int(cfg, "moe_layer_start_index", 0), _int(cfg, "moe_layer_end_index", -1),
                          _int(cfg, "moe_layer_interval", 1))
    if every <= 0:
        raise ValueError(f"moe_layer_interval must be > 0, got {every}")
    last = mc.num_layers - 1 if last == -1 else last
    dense = tuple(i for i in range(mc.num_layers) if not (first <= i <= last and (i + 1) % every == 0))
    if len(dense) == mc.num_layers:
        raise ValueError(f"moe_layer_start_index {first}, moe_layer_end_index {last} and moe_layer_interval {every} "
                         f"leave none of the {mc.num_layers} layers sparse")
    return replace(mc, num_experts=experts, experts_per_token=_int(cfg, "moe_k"), moe_intermediate_size=width,
                   norm_topk_prob=True, moe_float32_weights=True, dense_layers=dense,
                   shared_expert_intermediate_size=width * shared, shared_expert_gate=False, router="softmax_biased")


def _nope_layers(cfg: dict, num_layers: int) -> tuple[int, ...]:
    """SmolLM3's layers without RoPE: those ``no_rope_layers`` marks 0, else (transformers' rule) every
    ``no_rope_layer_interval``-th (4 by default)."""
    marks = cfg.get("no_rope_layers")
    if marks is None:
        every = _int(cfg, "no_rope_layer_interval", 4)
        if every <= 0:
            raise ValueError(f"no_rope_layer_interval must be > 0, got {every}")
        return tuple(i for i in range(num_layers) if (i + 1) % every == 0)
    if not isinstance(marks, list) or len(marks) < num_layers or any(m not in (0, 1) or isinstance(m, float) for m in marks):
        raise ValueError(f"no_rope_layers must list 1 (RoPE) or 0 (none) for each of the {num_layers} layers, "
                         f"got {marks!r:.200}")
    return tuple(i for i in range(num_layers) if not marks[i])


def _llama4(cfg: dict, mc: ModelConfig) -> ModelConfig:
    """``mc`` with Llama 4's text model, as transformers' Llama4TextConfig reads its fields: experts
    ``intermediate_size`` wide (its dense layers' MLPs ``intermediate_size_mlp``) on the layers ``moe_layers``
    lists, else every ``interleave_moe_layer_step``-th, each beside a shared expert as wide; NoPE layers as
    SmolLM3's (an empty ``no_rope_layers`` read as none given), their queries tempered by position where
    ``attn_temperature_tuning``; the other layers' q and k normed after RoPE where ``use_qk_norm``, attending
    within chunks of ``attention_chunk_size`` tokens (the layers ``layer_types`` names ``chunked_attention``
    where it is given); RoPE over interleaved pairs."""
    layers = mc.num_layers
    nope = _nope_layers({**cfg, "no_rope_layers": cfg.get("no_rope_layers") or None}, layers)
    moe = cfg.get("moe_layers")
    if moe is None:
        step = _int(cfg, "interleave_moe_layer_step", 1)
        if step <= 0:
            raise ValueError(f"interleave_moe_layer_step must be > 0, got {step}")
        moe = range(step - 1, layers, step)
    elif not isinstance(moe, list) or not all(is_whole(i) and 0 <= i < layers for i in moe):
        raise ValueError(f"moe_layers must list layers of the {layers}, got {moe!r:.200}")
    kinds, chunk = cfg.get("layer_types"), cfg.get("attention_chunk_size")
    if kinds is None:
        chunked = [i for i in range(layers) if i not in nope] if chunk is not None else []
    elif not isinstance(kinds, list) or len(kinds) != layers \
            or any(k not in ("full_attention", "chunked_attention") for k in kinds):
        raise ValueError(f"layer_types must give each of the {layers} layers' kind (full_attention, "
                         f"chunked_attention), got {kinds!r:.200}")
    else:
        chunked = [i for i, k in enumerate(kinds) if k == "chunked_attention"]
    if chunked and not (is_whole(chunk) and chunk >= 1):
        raise ValueError(f"attention_chunk_size must be a whole number of tokens >= 1, got {chunk!r}")
    width = _int(cfg, "intermediate_size")
    tempered = None
    if cfg.get("attn_temperature_tuning") and nope:
        tempered = (_positive(cfg, "floor_scale"), _positive(cfg, "attn_scale"))
    mc = replace(mc, intermediate_size=_int(cfg, "intermediate_size_mlp"), num_experts=_int(cfg, "num_local_experts"),
                 experts_per_token=_int(cfg, "num_experts_per_tok"), moe_intermediate_size=width,
                 shared_expert_intermediate_size=width, shared_expert_gate=False, router="sigmoid_input",
                 dense_layers=tuple(sorted(set(range(layers)) - set(moe))), nope_layers=nope,
                 qk_l2_norm=bool(cfg.get("use_qk_norm")), rope_interleaved=True, attn_temperature=tempered)
    if chunked and chunk < mc.max_position:  # a chunk as long as the context masks nothing
        mc = replace(mc, sliding_window=int(chunk), window_layers=tuple(chunked), window_chunked=True)
    return mc


def _ministral3(cfg: dict, mc: ModelConfig) -> ModelConfig:
    """``mc`` with Ministral 3's query scaling (its rope parameters' ``llama_4_scaling_beta``, over their
    ``original_max_position_embeddings``): every layer's queries times 1 + beta x ln(1 + floor(p / that))."""
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    beta = _float(params, "llama_4_scaling_beta") if isinstance(params, dict) else None
    if not beta:
        return mc
    original = _int(params, "original_max_position_embeddings")
    if original <= 0:
        raise ValueError(f"original_max_position_embeddings must be > 0, got {original}")
    return replace(mc, attn_temperature=(float(original), beta), attn_temperature_every_layer=True)


# Llama 4's names -> the model's: its MLPs are feed_forward, its router is the mixture's gate
LLAMA4_NAMES = ((".feed_forward.router.", ".mlp.gate."), (".feed_forward.", ".mlp."))


def _llama4_names(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` with Llama 4's tensors under the model's names (``LLAMA4_NAMES``) and its stacked experts as
    the model holds them: stored with their input dimension first ([experts, hidden, 2 x width] and
    [experts, width, hidden]), transposed."""
    out = {}
    for key, tensor in state.items():
        old, new = next(((o, n) for o, n in LLAMA4_NAMES if o in key), ("", ""))
        key = key.replace(old, new, 1) if old else key
        out[key] = tensor.transpose(1, 2) if key.endswith((".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")) \
            else tensor
    return out


def _granite(cfg: dict, mc: ModelConfig) -> ModelConfig:
    """``mc`` with Granite's scalars (transformers' GraniteConfig's defaults, 1, where config.json leaves one
    out): ``embedding_multiplier``, ``residual_multiplier``, ``logits_scaling``, and ``attention_multiplier``
    as the scores' scale in place of head_dim ** -0.5."""
    return replace(mc, embedding_multiplier=_positive(cfg, "embedding_multiplier"),
                   residual_multiplier=_positive(cfg, "residual_multiplier"),
                   logits_scaling=_positive(cfg, "logits_scaling"), query_scale=_positive(cfg, "attention_multiplier"))


def _cohere(cfg: dict, mc: ModelConfig) -> ModelConfig:
    """``mc`` with Cohere's differences from Llama: LayerNorms (``layer_norm_eps``), attention and the MLP side by
    side, RoPE over interleaved pairs, the logits times ``logit_scale`` (held as the divisor Granite's are), and
    with ``use_qk_norm`` (Command R+) each q and k head normed with a weight of its own; Cohere 2's windowed
    layers alone rotate (where it gives no window, none does), as transformers and vLLM run it."""
    eps = cfg.get("layer_norm_eps", 1e-5)
    if not is_positive(eps):
        raise ValueError(f"layer_norm_eps must be a number > 0, got {eps!r}")
    mc = replace(mc, layer_norm=True, parallel_block=True, rope_interleaved=True, rms_norm_eps=float(eps),
                 logits_scaling=1.0 / _positive(cfg, "logit_scale"))
    if cfg.get("use_qk_norm"):
        mc = replace(mc, qk_norm=True, qk_norm_head_weights=True)
    if cfg["model_type"] == "cohere2":
        mc = replace(mc, nope_layers=_global_nope(cfg, mc))
    return mc


def _global_nope(cfg: dict, mc: ModelConfig) -> tuple[int, ...]:
    """The layers that attend without positions in a model whose windowed layers alone rotate (Cohere 2's,
    EXAONE 4's): those not windowed, where ``sliding_window`` is set; where it is not, Cohere 2's every layer (as
    transformers and vLLM run it) and EXAONE 4's none (vLLM rotates every layer of a model with no windowed one)."""
    windowed = set(_window_layers(cfg, mc.num_layers)) if cfg.get("sliding_window") is not None else set()
    if not windowed and cfg["model_type"] == "exaone4":
        return ()
    return tuple(i for i in range(mc.num_layers) if i not in windowed)


def _positive(cfg: dict, key: str) -> float:
    """``cfg[key]`` (1 where absent, the default of every field read this way) as a number > 0, refused by name
    otherwise."""
    value = cfg.get(key, 1.0)
    if not is_positive(value):
        raise ValueError(f"{key} must be a number > 0, got {value!r}")
    return float(value)


def _gemma(cfg: dict, mc: ModelConfig) -> ModelConfig:
    """``mc`` with Gemma's differences from Llama, and Gemma 2's and 3's (their defaults where config.json
    omits them)."""
    mc = replace(mc, activation="gelu_tanh", norm_offset=True, embed_scale=True)
    if cfg["model_type"] == "gemma":
        return mc

    def positive(key: str, default: float | None) -> float | None:
        value = cfg.get(key, default)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0):
            raise ValueError(f"{key} must be a number > 0 or null, got {value!r}")
        return None if value is None else float(value)

    scalar = positive("query_pre_attn_scalar", 256)
    mc = replace(mc, sandwich_norms=True, query_scale=None if scalar is None else scalar ** -0.5)
    if cfg["model_type"] == "gemma2":
        return replace(mc, attn_softcap=positive("attn_logit_softcapping", 50.0),
                       logit_softcap=positive("final_logit_softcapping", 30.0))
    if cfg.get("attn_logit_softcapping") is not None:  # transformers' Gemma 3 does not apply it
        raise ValueError(f"attn_logit_softcapping {cfg['attn_logit_softcapping']!r} is not supported for Gemma 3")
    return replace(mc, qk_norm=True, logit_softcap=positive("final_logit_softcapping", None))


# the families whose full-attention and windowed layers rotate by RoPEs of their own: model_type -> the full
# layers' RoPE base and the windowed layers' (None: the full layers'), transformers' defaults
LAYER_TYPE_ROPE = {"gemma3_text": (1_000_000.0, 10_000.0), "olmo3": (500_000.0, None)}


def _layer_type_rope(cfg: dict, mc: ModelConfig, path: Path) -> ModelConfig:
    """``mc`` with two RoPEs: its full-attention layers' (``rope_theta``, scaled by ``rope_scaling``) and its
    windowed layers' (unscaled: Gemma 3's ``rope_local_base_freq``, OLMo 3's the same base as the full
    layers'), or transformers 5's ``rope_parameters`` keyed by those layers' kinds (``LAYER_TYPE_ROPE``)."""
    base, local_base = LAYER_TYPE_ROPE[cfg["model_type"]]
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and {"full_attention", "sliding_attention"} & params.keys():
        full, local = params.get("full_attention") or {}, params.get("sliding_attention") or {}
    else:
        theta = cfg.get("rope_theta", base)
        full = {**(cfg.get("rope_scaling") or {}), "rope_theta": theta}
        local = {"rope_type": "default", "rope_theta": cfg.get("rope_local_base_freq", local_base) if local_base else theta}
    if not isinstance(full, dict) or not isinstance(local, dict):
        raise CheckpointError(f"{path}: rope parameters must be objects, got {full!r} and {local!r}")
    context = {"max_position_embeddings": cfg.get("max_position_embeddings")}  # YaRN's original context, where none is given
    theta, scaling = _rope({**context, "rope_parameters": {"rope_theta": base, **full}}, path)
    local_theta, local_scaling = _rope({**context, "rope_parameters": {"rope_theta": local_base or base, **local}}, path)
    if local_scaling is not None:
        raise CheckpointError(f"{path}: a scaled RoPE on the windowed layers is not supported")
    return replace(mc, rope_theta=theta, rope_scaling=scaling, local_rope_theta=local_theta if mc.window_layers else None)


def _experts(cfg: dict, mc: ModelConfig, path: Path) -> ModelConfig:
    """``mc`` with the mixture of experts ``cfg`` describes (Mixtral's or Qwen-MoE's fields)."""
    # experts as wide as intermediate_size, every layer sparse
    mixtral = cfg["model_type"] in ("mixtral", "gpt_oss", "minimax_m2", "olmoe", "granitemoe", "granitemoeshared")
    try:
        if cfg["model_type"] in GROUPED_TYPES:
            return _grouped_experts(cfg, mc)
        if cfg["model_type"] == "ernie4_5_moe":
            return _ernie_experts(cfg, mc)
        experts = _int(cfg, "num_local_experts" if cfg.get("num_local_experts") else "num_experts", 0)
        if experts <= 0:
            raise CheckpointError(f"{path}: a {cfg['model_type']} checkpoint needs num_experts (or num_local_experts) > 0")
        dense = ()
        if not mixtral:  # Qwen-MoE: mlp_only_layers, and only every decoder_sparse_step-th layer sparse
            step = _int(cfg, "decoder_sparse_step", 1)
            if step <= 0:
                raise CheckpointError(f"{path}: decoder_sparse_step must be > 0, got {step}")
            only = {int(i) for i in cfg.get("mlp_only_layers") or []}
            dense = tuple(i for i in range(mc.num_layers) if i in only or (i + 1) % step)
        mc = replace(mc, num_experts=experts, experts_per_token=_int(cfg, "num_experts_per_tok"),
                     moe_intermediate_size=_int(cfg, "intermediate_size" if mixtral else "moe_intermediate_size"),
                     # OLMoE's never renormalised, as vLLM runs it (transformers reads norm_topk_prob: false as published)
                     norm_topk_prob=cfg["model_type"] != "olmoe" if mixtral else bool(cfg.get("norm_topk_prob", False)),
                     moe_float32_weights=cfg["model_type"] == "mixtral", dense_layers=dense,
                     shared_expert_intermediate_size=_int(cfg, "shared_expert_intermediate_size")
                     if cfg["model_type"] == "qwen2_moe" else _int(cfg, "shared_intermediate_size", 0)
                     if cfg["model_type"] == "granitemoeshared" else 0,
                     shared_expert_gate=cfg["model_type"] == "qwen2_moe")  # Granite's shared expert is ungated
        if cfg["model_type"] == "gpt_oss":
            if cfg["swiglu_limit"] is None:
                raise ValueError("swiglu_limit must be a number > 0, got None")
            mc = replace(mc, attn_sinks=True, norm_float32_weight=True, swiglu_limit=cfg["swiglu_limit"],
                         swiglu_alpha=cfg["swiglu_alpha"])
        if cfg["model_type"] == "minimax_m2":  # sigmoid scores plus a learned bias pick, the scores renormalised weigh
            scoring = cfg.get("scoring_func") or "sigmoid"
            if scoring != "sigmoid":
                raise ValueError(f"scoring_func {scoring!r} is not supported (MiniMax-M2's router scores by sigmoid)")
            mc = replace(mc, router="sigmoid_groups")
        return mc
    except CheckpointError:
        raise
    except KeyError as exc:
        raise CheckpointError(f"{path}: missing field {exc.args[0]!r}") from exc
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"{path}: {exc}") from exc


def _stacked_experts(state: dict[str, torch.Tensor], mc: ModelConfig, directory) -> dict[str, torch.Tensor]:
    """``state`` with each layer's experts, stored one tensor per projection and expert (Mixtral's
    ``block_sparse_moe.experts.E.w1``, Qwen3-MoE's ``mlp.experts.E.gate_proj``), stacked under
    the model's names (``mlp.experts.gate_up_proj`` and ``mlp.experts.down_proj``, as transformers
    5 holds them), and Mixtral's router moved to ``mlp.gate``."""
    layout = "block_sparse_moe" if any(".block_sparse_moe." in k for k in state) else "mlp"
    gate, up, down = EXPERT_LAYOUTS[layout]
    # every tensor but those stacked below, which keeps an expert past the layer's count, or on a dense layer,
    # under its own name for the loader to refuse (a multi-token-prediction layer's to skip)
    out = dict(_router_tensor(k, v) for k, v in state.items())
    for layer in range(mc.num_layers):
        if not mc.is_sparse(layer):
            continue
        block = f"model.layers.{layer}.{layout}.experts"
        if f"model.layers.{layer}.mlp.experts.gate_up_proj" in out:
            continue  # already stacked
        parts = {}
        for name in (gate, up, down):
            for e in range(mc.num_experts):
                key = f"{block}.{e}.{name}.weight"
                if key not in state:
                    raise CheckpointError(f"{directory}: tensor {key!r} is missing (config.json has {mc.num_experts} experts)")
                parts[name, e] = out.pop(key)
        out[f"model.layers.{layer}.mlp.experts.gate_up_proj"] = torch.stack(
            [torch.cat((parts[gate, e], parts[up, e])) for e in range(mc.num_experts)])
        out[f"model.layers.{layer}.mlp.experts.down_proj"] = torch.stack([parts[down, e] for e in range(mc.num_experts)])
    return out


# Granite's mixtures of experts' tensors, by their names -> the model's
GRANITE_MOE = {".block_sparse_moe.input_linear.weight": ".mlp.experts.gate_up_proj",
               ".block_sparse_moe.output_linear.weight": ".mlp.experts.down_proj",
               ".block_sparse_moe.router.layer.weight": ".mlp.gate.weight",
               ".shared_mlp.output_linear.weight": ".mlp.shared_expert.down_proj.weight"}


def _granite_moe_names(state: dict[str, torch.Tensor], mc: ModelConfig, directory) -> dict[str, torch.Tensor]:
    """``state`` with Granite's experts, router and shared expert under the model's names (``GRANITE_MOE``), the
    shared expert's ``input_linear`` (gate, then up) split in two."""
    out = {}
    for key, tensor in state.items():
        held = next((h for h in GRANITE_MOE if key.endswith(h)), None)
        if held is not None:
            out[key.removesuffix(held) + GRANITE_MOE[held]] = tensor
        elif key.endswith(".shared_mlp.input_linear.weight"):
            if tensor.shape[0] != 2 * mc.shared_expert_intermediate_size:
                raise CheckpointError(f"{directory}: tensor {key!r} has {tensor.shape[0]} rows, config.json implies "
                                      f"{2 * mc.shared_expert_intermediate_size} (2 x shared_intermediate_size)")
            at = key.removesuffix(".shared_mlp.input_linear.weight") + ".mlp.shared_expert."
            out[at + "gate_proj.weight"], out[at + "up_proj.weight"] = tensor.chunk(2)
        else:
            out[key] = tensor
    return out


def _router_tensor(key: str, tensor: torch.Tensor) -> tuple[str, torch.Tensor]:
    """A router's tensor under the model's name and shape: Mixtral's and MiniMax-M2's ``block_sparse_moe.gate`` as
    ``mlp.gate``; MiniMax-M2's correction bias (``block_sparse_moe.e_score_correction_bias``, transformers 5
    holds it as ``mlp.e_score_correction_bias``) and ERNIE 4.5's (``mlp.moe_statics.e_score_correction_bias``,
    one row of them) in the router, as DeepSeek-V3's."""
    key = key.replace(".block_sparse_moe.gate.", ".mlp.gate.")
    for held in (".block_sparse_moe.e_score_correction_bias", ".mlp.e_score_correction_bias",
                 ".mlp.moe_statics.e_score_correction_bias"):
        if key.endswith(held):
            return key.removesuffix(held) + ".mlp.gate.e_score_correction_bias", tensor.flatten()
    return key, tensor


# where a multimodal checkpoint keeps its text model's weights (transformers 5's names, then 4's)
# (Kimi K2.5's as transformers 5 saves it: its text model's layers as blocks)
TEXT_MODEL = (("model.language_model.", "model."), ("language_model.model.blocks.", "model.layers."),
              ("language_model.model.", "model."), ("language_model.lm_head.", "lm_head."), ("lm_head.", "lm_head."))


def _text_model(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` with a multimodal checkpoint's text model under the decoder's names and the rest (its
    vision tower, its projector) left out; ``state`` itself where it holds a decoder alone."""
    if not any(k.startswith(("model.language_model.", "language_model.")) for k in state):
        return state
    out = {}
    for key, tensor in state.items():
        old, new = next(((o, n) for o, n in TEXT_MODEL if key.startswith(o)), ("", None))
        if new is not None:
            out[new + key[len(old):]] = tensor
    return out


# GLM-4's norms around each sublayer, by transformers' names -> the model's (Gemma 2's)
GLM4_NORMS = {"post_self_attn_layernorm": "post_attention_layernorm", "post_attention_layernorm": "pre_feedforward_layernorm",
              "post_mlp_layernorm": "post_feedforward_layernorm"}


def _glm4_norms(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` with GLM-4's norms under the model's names (``GLM4_NORMS``): its post_attention_layernorm is
    the MLP's input norm, Gemma 2's pre_feedforward_layernorm."""
    out = {}
    for key, tensor in state.items():
        head, _, kind = key.rpartition(".")  # model.layers.N.<norm>, weight
        prefix, _, name = head.rpartition(".")
        out[f"{prefix}.{GLM4_NORMS[name]}.{kind}" if name in GLM4_NORMS else key] = tensor
    return out


def _unfused(state: dict[str, torch.Tensor], mc: ModelConfig, directory) -> dict[str, torch.Tensor]:
    """``state`` with Phi-3's stacked tensors split under Llama's names, as the model's loader takes them."""
    q, kv = mc.num_heads * mc.head_dim, mc.num_kv_heads * mc.head_dim
    sizes = {"self_attn.qkv_proj.weight": [q, kv, kv], "mlp.gate_up_proj.weight": [mc.intermediate_size] * 2}
    out = {}
    for key, tensor in state.items():
        suffix = next((f for f in FUSED if key.endswith(f)), None)
        if suffix is None:
            out[key] = tensor
            continue
        if tensor.shape[0] != sum(sizes[suffix]):
            raise CheckpointError(f"{directory}: tensor {key!r} has {tensor.shape[0]} rows, config.json implies "
                                  f"{sum(sizes[suffix])} ({' + '.join(map(str, sizes[suffix]))})")
        prefix = key[: -len(suffix)] + suffix.split(".")[0] + "."
        out.update({f"{prefix}{name}.weight": part for name, part in zip(FUSED[suffix], tensor.split(sizes[suffix]))})
    return out


# NVIDIA ModelOpt's quantisation algorithms (``quant_algo``), by the bits of the weights they store
MODELOPT_BITS = {"FP8": 8, "FP8_PER_CHANNEL_PER_TOKEN": 8, "FP8_BLOCK_SCALES": 8, "FP8_PB_WO": 8, "MXFP8": 8,
                 "INT8_SQ": 8, "W8A16": 8, "NVFP4": NVFP4_BITS, "MXFP4": MXFP4_BITS, "W4A16_AWQ": 4, "W4A8_AWQ": 4,
                 "W4A8_MXFP4_FP8": MXFP4_BITS}


def _quantization_config(directory: str | Path) -> tuple[dict | None, Path]:
    """A checkpoint's ``quantization_config`` (its text model's, under ``text_config``, where the top level gives
    none, as transformers and vLLM read a multimodal checkpoint's such as Kimi K2.5's; ModelOpt's
    ``hf_quant_config.json`` where config.json has none, as ``quant_method: modelopt``) and the file it was read
    from; None where there is none."""
    path = Path(directory) / "config.json"
    raw = json.loads(path.read_text())
    # compression_config: compressed-tensors' older key, which vLLM reads too
    q = raw.get("quantization_config") or raw.get("compression_config")
    text = raw.get("text_config")
    if not q and isinstance(text, dict):
        q = text.get("quantization_config")
    modelopt = Path(directory) / "hf_quant_config.json"
    if not q and modelopt.is_file():  # ModelOpt's own file, beside a config.json without the block
        try:
            q = json.loads(modelopt.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise CheckpointError(f"{modelopt}: cannot be read ({exc})") from exc
        if not isinstance(q, dict):
            raise CheckpointError(f"{modelopt}: must hold a JSON object, got {type(q).__name__}")
        q, path = {"quant_method": "modelopt", **q}, modelopt
    if q and not isinstance(q, dict):
        raise CheckpointError(f"{path}: quantization_config must be an object, got {q!r}")
    return q or None, path


def weight_bits(directory: str | Path) -> float | None:
    """The bits of a quantised checkpoint's weights, from its ``quantization_config`` (AWQ's and
    GPTQ's ``bits``, FP8, bitsandbytes' 4 or 8 bits, compressed-tensors' ``config_groups``, ModelOpt's
    ``quant_algo``) or ModelOpt's ``hf_quant_config.json``; None where the weights are not quantised
    (a configuration that quantises only the KV cache, or nothing)."""
    q, path = _quantization_config(directory)
    if not q:
        return None
    method = q.get("quant_method")
    if "bits" in q:
        if isinstance(q["bits"], bool) or q["bits"] not in WEIGHT_BITS:
            raise CheckpointError(f"{path}: quantization_config.bits must be one of "
                                  f"{', '.join(map(str, WEIGHT_BITS))}, got {q['bits']!r}")
        return int(q["bits"])
    if method in ("fp8", "fbgemm_fp8"):  # fbgemm_fp8: Meta's FP8 releases (Llama 3.1 405B's)
        return 8
    if method == "mxfp4":  # the experts alone: ``expert_bits``
        return None
    if method == "modelopt" or "quant_algo" in q:
        return _modelopt_bits(q, path)
    if method == "compressed-tensors":
        return _compressed_tensors_bits(q, path)
    if method == "bitsandbytes":  # neither flag: nothing quantised
        return 4 if q.get("load_in_4bit") else 8 if q.get("load_in_8bit") else None
    raise CheckpointError(f"{path}: quantization_config with quant_method {method!r} and no 'bits' is not supported")


def declared_kv_cache_dtype(directory: str | Path) -> str | None:
    """The KV cache dtype a checkpoint declares its KV calibrated for, which vLLM holds its KV in unless
    told otherwise: "fp8" where ModelOpt's ``kv_cache_quant_algo`` is FP8 or a ``kv_cache_scheme`` (compressed-
    tensors', ModelOpt's in config.json) of 8 bits is given; None where it declares none."""
    q, _ = _quantization_config(directory)
    if not q:
        return None
    fields = q.get("quantization", q) if isinstance(q.get("quantization", q), dict) else q
    algo = fields.get("kv_cache_quant_algo", q.get("kv_cache_quant_algo"))
    if isinstance(algo, str) and algo.upper() == "FP8":
        return "fp8"
    # compressed-tensors', and ModelOpt's current config.json form: a scheme of 8-bit floats
    scheme = fields.get("kv_cache_scheme", q.get("kv_cache_scheme"))
    return "fp8" if isinstance(scheme, dict) and scheme.get("num_bits", 8) == 8 else None


def float8_weights(directory: str | Path) -> tuple[bool, tuple[int, int] | None]:
    """Whether a checkpoint's quantised weights are 8-bit floats beside scales the engine multiplies them by
    at load, and the block of (rows, columns) each scale covers where its scales are blockwise (None: one a
    tensor or one an output row, told apart by their shapes): ``quant_method: fp8`` (its
    ``weight_block_size``), compressed-tensors' float groups of 8 bits (``block_structure``, or a
    ``group_size`` along the input), ModelOpt's ``FP8`` and ``FP8_PER_CHANNEL_PER_TOKEN``."""
    q, path = _quantization_config(directory)
    method = q.get("quant_method") if q else None

    def rows_columns(block, what: str) -> tuple[int, int] | None:
        if block is None:
            return None
        if not (isinstance(block, list) and len(block) == 2 and all(is_whole(b) and b >= 1 for b in block)):
            raise CheckpointError(f"{path}: {what} must be two whole numbers >= 1 (rows, columns), got {block!r}")
        return int(block[0]), int(block[1])

    if method == "fp8" and "bits" not in q:
        return True, rows_columns(q.get("weight_block_size"), "weight_block_size")
    if method == "modelopt" or (q and "quant_algo" in q):
        fields = q.get("quantization", q)
        return isinstance(fields, dict) and fields.get("quant_algo") in ("FP8", "FP8_PER_CHANNEL_PER_TOKEN"), None
    if method != "compressed-tensors" or not isinstance(q.get("config_groups"), dict):
        return False, None
    weights = [g.get("weights") for g in q["config_groups"].values() if isinstance(g, dict) and g.get("weights")]
    if not weights or not all(isinstance(w, dict) and w.get("type") == "float" and w.get("num_bits") == 8 for w in weights):
        return False, None
    blocks = {rows_columns(w.get("block_structure"), "a compressed-tensors float group's block_structure")
              if w.get("strategy") == "block" else
              rows_columns([1, w.get("group_size")], "a compressed-tensors float group's [1, group_size]")
              if w.get("strategy") == "group" else None for w in weights}
    blocks.discard(None)
    if len(blocks) > 1:
        raise CheckpointError(f"{path}: compressed-tensors groups with blocks of different shapes ({sorted(blocks)}) "
                              "are not supported")
    return True, next(iter(blocks), None)


FLOAT8 = (torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz)
ACTIVATION_SCALES = (".input_scale", ".activation_scale")  # a static activation scale: the weights run unquantised


def float8_weight(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None) -> torch.Tensor:
    """An 8-bit float matrix [..., rows, columns] times its scales, in float32, as vLLM reads them: one scale
    (a tensor's), one a block of ``block`` rows and columns ([..., ceil(rows / r), ceil(columns / c)], the
    last blocks cut short), or one a row ([..., rows] or [..., rows, 1]). Scales are floats, or powers of two
    stored as bytes (E8M0: 2 ** (byte - 127), MXFP8's), as transformers reads a byte scale."""
    if scale.dtype == torch.uint8:
        s = torch.ldexp(torch.ones(scale.shape, dtype=torch.float32), scale.to(torch.int32) - 127)
    elif scale.is_floating_point():
        s = scale.to(torch.float32)
    else:
        raise ValueError(f"scales of dtype {scale.dtype} are neither floats nor powers of two stored as bytes (uint8)")
    w = weight.to(torch.float32)
    *lead, rows, cols = w.shape
    if s.numel() == 1:
        return w * s.reshape(())
    if block is not None and list(s.shape) == [*lead, -(-rows // block[0]), -(-cols // block[1])]:
        return w * s.repeat_interleave(block[0], -2)[..., :rows, :].repeat_interleave(block[1], -1)[..., :cols]
    if list(s.shape) in ([*lead, rows], [*lead, rows, 1]):
        return w * s.reshape(*lead, rows, 1)
    blocks = f", nor one a block of {block[0]} x {block[1]}" if block is not None else ""
    raise ValueError(f"scales of shape {tuple(s.shape)} are neither one a tensor nor one a row of its "
                     f"{tuple(w.shape)}{blocks}")


def _float8_dequantised(state: dict[str, torch.Tensor], block: tuple[int, int] | None, dtype: torch.dtype,
                        directory) -> dict[str, torch.Tensor]:
    """``state`` with each 8-bit float weight times its scales (``NAME_scale_inv`` or ``NAME_scale`` beside it:
    a matrix's ``weight_scale_inv``, stacked experts' ``gate_up_proj_scale_inv``) in ``dtype``, and its scales
    and static activation scales left out."""
    scales = {k + suffix for k, t in state.items() if t.dtype in FLOAT8 for suffix in ("_scale_inv", "_scale")
              if k + suffix in state}
    for key in sorted(k for k in state if k.endswith((".weight_scale", ".weight_scale_inv")) and k not in scales):
        name = key.removesuffix("_inv").removesuffix("_scale")
        raise CheckpointError(f"{directory}: tensor {key!r} scales {name!r}, which is "
                              f"{'missing' if name not in state else state[name].dtype}")
    out = {}
    for key, tensor in state.items():
        if key in scales or key.endswith(ACTIVATION_SCALES):
            continue
        if tensor.dtype not in FLOAT8:
            out[key] = tensor
            continue
        found = [key + suffix for suffix in ("_scale_inv", "_scale") if key + suffix in state]
        if len(found) != 1:
            raise CheckpointError(f"{directory}: tensor {key!r} is {tensor.dtype} with "
                                  f"{'two scales' if found else 'no scale'} beside it ({key.rpartition('.')[2]}_scale "
                                  f"or {key.rpartition('.')[2]}_scale_inv)")
        try:
            out[key] = float8_weight(tensor, state[found[0]], block).to(dtype)
        except ValueError as exc:
            raise CheckpointError(f"{directory}: tensor {found[0]!r}: {exc}") from None
    return out




def expert_bits(directory: str | Path) -> float | None:
    """The bits of a checkpoint's routed experts' matrices where they alone are quantised: gpt-oss's
    MXFP4 (``quant_method: mxfp4``; its attention, router, embeddings and biases stay in 16 bits);
    None otherwise."""
    q = _quantization_config(directory)[0]
    return MXFP4_BITS if isinstance(q, dict) and q.get("quant_method") == "mxfp4" else None


# MXFP4's 4-bit values (E2M1), by code: the low 4 bits of a byte hold a weight, the high 4 the next one
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def mxfp4_weights(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """An MXFP4 tensor as gpt-oss stores it, in ``dtype``: ``blocks`` [experts, rows, groups, 16] bytes,
    two 4-bit weights a byte (the low half first), and ``scales`` [experts, rows, groups], each group's
    power of two biased by 127; returned [experts, groups x 32, rows], as transformers holds the
    expert's matrix (its input dimension first)."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8 or blocks.dim() != 4 or blocks.shape[-1] != 16 \
            or tuple(blocks.shape[:-1]) != tuple(scales.shape):
        raise ValueError(f"MXFP4 blocks must be uint8 [experts, rows, groups, 16] and scales uint8 [experts, rows, "
                         f"groups], got {tuple(blocks.shape)} {blocks.dtype} and {tuple(scales.shape)} {scales.dtype}")
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32, device=blocks.device)
    experts, rows, groups, _ = blocks.shape
    out = torch.empty(experts, groups * 32, rows, dtype=dtype, device=blocks.device)
    for e in range(experts):  # an expert at a time: the codes' indices and float32 values stay small
        b = blocks[e]
        values = torch.stack((lut[(b & 0x0F).int()], lut[(b >> 4).int()]), dim=-1).flatten(-2)
        values = torch.ldexp(values, (scales[e].to(torch.int32) - 127)[..., None])
        out[e] = values.flatten(-2).T.to(dtype)
    return out


def _dequantised(state: dict[str, torch.Tensor], dtype: torch.dtype, directory) -> dict[str, torch.Tensor]:
    """``state`` with each MXFP4 tensor (``NAME_blocks`` beside ``NAME_scales``) as ``NAME`` in ``dtype``."""
    out = {k: v for k, v in state.items() if not k.endswith(("_blocks", "_scales"))}
    for key in [k for k in state if k.endswith("_scales")]:
        if key.removesuffix("_scales") + "_blocks" not in state:
            raise CheckpointError(f"{directory}: tensor {key!r} has no {key.removesuffix('_scales') + '_blocks'!r} beside it")
    for key in [k for k in state if k.endswith("_blocks")]:
        name = key[: -len("_blocks")]
        if f"{name}_scales" not in state:
            raise CheckpointError(f"{directory}: tensor {name + '_scales'!r} is missing (beside {key!r})")
        if name in state:
            raise CheckpointError(f"{directory}: tensor {name!r} is stored twice, as it is and in MXFP4 ({key!r})")
        try:
            out[name] = mxfp4_weights(state[key], state[f"{name}_scales"], dtype)
        except ValueError as exc:
            raise CheckpointError(f"{directory}: tensor {key!r}: {exc}") from exc
    return out


def _modelopt_bits(q: dict, path: Path) -> float | None:
    """ModelOpt's weights' bits, by ``quant_algo`` (written under ``quantization`` in its own file);
    None where it names none (only the KV cache quantised, ``kv_cache_quant_algo``)."""
    fields = q.get("quantization", q)
    if not isinstance(fields, dict):
        raise CheckpointError(f"{path}: quantization must be an object, got {fields!r}")
    algo = fields.get("quant_algo")
    if algo is None:
        return None
    if algo not in MODELOPT_BITS:
        raise CheckpointError(f"{path}: quant_algo {algo!r} is not one of {', '.join(MODELOPT_BITS)}")
    return MODELOPT_BITS[algo]


def _longest_context(cfg: dict, max_position: int) -> int:
    """The longest context the checkpoint serves, as vLLM derives it: a RoPE scaled by ``linear`` or
    ``dynamic`` extends ``max_position_embeddings`` by its factor, YaRN's is its original context times
    its factor; Llama 3's scaling and LongRoPE leave it as it is."""
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if cfg.get("model_type") in ("gemma3", "gemma3_text"):  # its max_position_embeddings is already the scaled one
        return max_position
    kind = _rope_kind(params) if isinstance(params, dict) else None
    if kind == "yarn":  # vLLM: the original context times the factor, in place of the declared one
        if params.get("factor") is None:  # the ratio of the two contexts: the declared one, unrounded
            return max_position
        try:
            original, factor = _yarn_context(params, cfg)
        except (KeyError, TypeError, ValueError):  # read past for sizing; refused where the weights are run
            return max_position
        return int(original * factor) if factor > 0 else max_position
    factor = params.get("factor") if isinstance(params, dict) else None
    if kind not in ("linear", "dynamic") or isinstance(factor, bool) or not isinstance(factor, (int, float)):
        return max_position
    return max(max_position, int(max_position * factor)) if factor > 0 else max_position


def _compressed_tensors_bits(q: dict, path: Path) -> float | None:
    """The weights' bits of a compressed-tensors checkpoint (``config_groups.*.weights.num_bits``; the
    most of its groups', where they differ); None where no group quantises weights (only the KV cache
    or the activations, or a sparsity-only configuration)."""
    groups = q.get("config_groups") or {}
    if not isinstance(groups, dict) or not all(isinstance(g, dict) and isinstance(g.get("weights") or {}, dict)
                                               for g in groups.values()):
        raise CheckpointError(f"{path}: a compressed-tensors config_groups must map names to groups, each with a "
                              f"weights object or none, got {groups!r}")
    weights = [g["weights"] for g in groups.values() if g.get("weights")]
    bits = [w.get("num_bits") for w in weights]
    if any(isinstance(b, bool) or b not in WEIGHT_BITS for b in bits):
        raise CheckpointError(f"{path}: a compressed-tensors quantization_config needs config_groups whose weights' "
                              f"num_bits are each one of {', '.join(map(str, WEIGHT_BITS))}, got {bits!r}")
    # 4-bit floats in blocks of 16 (NVFP4) or 32 (MXFP4) are counted with their 8-bit scales
    counted = [{16: NVFP4_BITS, 32: MXFP4_BITS}.get(w.get("group_size"), 4) if b == 4 and w.get("type") == "float"
               else int(b) for w, b in zip(weights, bits)]
    return max(counted) if counted else None


def _window_layers(cfg: dict, num_layers: int) -> tuple[int, ...]:
    """The layers that attend through a sliding window where ``sliding_window`` is set, as the installed
    transformers (5) decides them: every layer of Mistral's, Phi-3's and Mixtral's; Qwen's only with
    ``use_sliding_window``, and then Qwen2's and Qwen3's from layer ``max_window_layers`` on, Qwen2-MoE's
    every other one from the first below it, Qwen3-MoE's all; Gemma 2's and gpt-oss's every other one
    from the first; where transformers 5 writes each layer's kind in ``layer_types``, those it names
    ``sliding_attention`` (Qwen3-MoE's attention reads none); SmolLM3's only with ``use_sliding_window``."""
    if cfg["model_type"] == "llama4_text":  # no sliding window: its chunked layers (_llama4)
        return ()
    if cfg["model_type"] == "smollm3":  # only with use_sliding_window; transformers' default: its NoPE layers
        if not cfg.get("use_sliding_window"):
            return ()
        if cfg.get("layer_types") is None:
            return _nope_layers(cfg, num_layers)
    kinds = cfg.get("layer_types") if cfg["model_type"] != "qwen3_moe" else None
    if kinds is not None:
        if not isinstance(kinds, list) or len(kinds) != num_layers:
            raise ValueError(f"layer_types must be a list of the {num_layers} layers' kinds, got {kinds!r}")
        other = next((k for k in kinds if k not in ("full_attention", "sliding_attention")), None)
        if other is not None:
            raise ValueError(f"layer_types: {other!r} is not supported (full_attention, sliding_attention)")
        return tuple(i for i, kind in enumerate(kinds) if kind == "sliding_attention")
    if cfg["model_type"] in ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe"):
        if not cfg.get("use_sliding_window"):
            return ()
        if cfg["model_type"] == "qwen3_moe":
            return tuple(range(num_layers))
        below = _int(cfg, "max_window_layers", 28)  # transformers' default
        if cfg["model_type"] == "qwen2_moe":
            return tuple(i for i in range(min(below, num_layers)) if (i + 1) % 2)
        return tuple(range(below, num_layers))
    if cfg["model_type"] in ("gemma", "minimax_m2", "ernie4_5", "ernie4_5_moe", "olmoe", "cohere", *GROUPED_TYPES):
        # transformers' Gemma, MiniMax-M2, ERNIE 4.5, OLMoE, Cohere, DeepSeek and GLM-4.5 attend fully
        return ()  # whatever sliding_window says
    if cfg["model_type"] in ("gemma2", "gpt_oss"):
        return tuple(range(0, num_layers, 2))
    if cfg["model_type"] == "olmo3":  # transformers' rule where layer_types is absent: every fourth layer full
        return tuple(i for i in range(num_layers) if (i + 1) % 4)
    if cfg["model_type"] in ("gemma3_text", "cohere2", "exaone4"):  # transformers 4's sliding_window_pattern: every n-th layer full
        if isinstance(cfg.get("sliding_window_pattern"), str):  # EXAONE 4's "LLLG", which transformers reads with layer_types
            raise ValueError(f"sliding_window_pattern {cfg['sliding_window_pattern']!r} needs layer_types beside it")
        pattern = _int(cfg, "sliding_window_pattern", 4 if cfg["model_type"] != "gemma3_text" else None)
        if pattern <= 0:
            raise ValueError(f"sliding_window_pattern must be > 0, got {pattern}")
        return tuple(i for i in range(num_layers) if (i + 1) % pattern)
    return tuple(range(num_layers))


def _experts_as_held(state: dict[str, torch.Tensor], mc: ModelConfig) -> dict[str, torch.Tensor]:
    """``state`` with Qwen3-VL-MoE's stacked experts as the model holds them: its published checkpoints store
    each matrix with its input dimension first, transformers 5 saves them as held. Each layer's layout is read
    from whichever of its two tensors is not square (where gate_up is square, down_proj is not), so that a
    square one is not taken as it is (transformers' shape check would)."""
    out = dict(state)
    h, i = mc.hidden_size, mc.moe_intermediate_size
    for key in [k for k in state if k.endswith(".mlp.experts.gate_up_proj")]:
        down = key.removesuffix("gate_up_proj") + "down_proj"
        if down not in state:
            continue  # reported missing by name below
        gate_up = state[key]
        if 2 * i != h:
            transposed = tuple(gate_up.shape[1:]) == (h, 2 * i)
        else:
            transposed = tuple(state[down].shape[1:]) == (i, h)
        if transposed:
            out[key], out[down] = gate_up.transpose(1, 2), state[down].transpose(1, 2)
    return out


# tensors a checkpoint may hold beside its decoder's that vLLM's loaders skip too: RoPE's tables, which older
# transformers saved, and a multimodal checkpoint's vision tower and projector under transformers 4's names
ROPE_TABLES = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")
# a quantised KV cache's scales (compressed-tensors' kv_cache_scheme, ModelOpt's kv_cache_quant_algo): read by
# _kv_scales, applied by an 8-bit KV cache (ModelConfig.kv_cache_dtype, which a checkpoint declaring one defaults
# to: declared_kv_cache_dtype), unused with the model's dtype
KV_SCALES = (".k_scale", ".v_scale", ".q_scale", ".prob_scale", ".kv_scale", "k_proj.output_scale", "v_proj.output_scale")
VISION_PREFIXES = ("visual.", "vision_tower.", "multi_modal_projector.")


def _unexpected(state: dict[str, torch.Tensor], expected, mc: ModelConfig, directory) -> list[str]:
    """The tensors of ``state`` the model has no place for, less those vLLM skips as well: RoPE's tables,
    the multi-token-prediction layers after the decoder's (``num_nextn_predict_layers``: DeepSeek-V3's,
    GLM-4.5's; MiniMax-M2's ``num_mtp_modules``; ERNIE 4.5's, whose names hold ``mtp``) and a multimodal checkpoint's vision tower and projector."""
    path, cfg, vision = _config(directory, run=True)
    try:  # MiniMax-M2 names its own num_mtp_modules (vLLM skips as many layers after the decoder's)
        nextn = _int(cfg, "num_mtp_modules" if cfg["model_type"] == "minimax_m2" else "num_nextn_predict_layers", 0)
    except ValueError as exc:
        raise CheckpointError(f"{path}: {exc}") from None

    ernie = cfg["model_type"] in ("ernie4_5", "ernie4_5_moe")  # its multi-token-prediction modules: names with mtp

    def skipped(key: str) -> bool:
        layer = key.split(".")[2] if key.startswith("model.layers.") else ""
        return (key.endswith(ROPE_TABLES + KV_SCALES) or (bool(vision) and key.startswith(VISION_PREFIXES))
                or (layer.isdigit() and mc.num_layers <= int(layer) < mc.num_layers + nextn) or (ernie and "mtp" in key))
    return sorted(k for k in state if k not in expected and not skipped(k))


def _weight_files(directory: Path) -> list[Path]:
    """The safetensors files that hold the model, as vLLM and transformers pick them: those an index
    (``model.safetensors.index.json``) lists where there is one, else every ``*.safetensors`` but Mistral's
    own ``consolidated*.safetensors`` beside Hugging Face's shards (the same weights again, under other
    names)."""
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        try:
            listed = json.loads(index.read_text())["weight_map"]
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as exc:
            raise CheckpointError(f"{index}: cannot be read as a weight map ({exc!r})") from exc
        if not isinstance(listed, dict) or not all(isinstance(f, str) for f in listed.values()):
            raise CheckpointError(f"{index}: weight_map must map each tensor to a file name, got {listed!r:.200}")
        files = [directory / name for name in sorted(set(listed.values()))]
        missing = next((f for f in files if not f.is_file()), None)
        if missing is not None:
            raise CheckpointError(f"{index}: lists {missing.name}, which is missing")
        return files
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{directory}: no *.safetensors weight files")
    hf = [f for f in files if not f.name.startswith("consolidated")]
    if not hf:
        raise CheckpointError(f"{directory}: only Mistral's own format (consolidated.safetensors), which this engine "
                              "does not read: use the Hugging Face format's files (config.json and model*.safetensors)")
    return hf


def load_checkpoint(directory: str | Path, device: str | torch.device = "cpu",
                    dtype: str | None = None) -> LlamaModel:
    """The model in ``directory``, with its weights; ``dtype`` overrides the checkpoint's."""
    directory = Path(directory).expanduser()
    mc = read_config(directory)
    if dtype is not None:
        if dtype == "float16" and mc.sandwich_norms and mc.norm_offset:
            raise CheckpointError(f"{directory}: Gemma 2 and 3 do not run in float16 (numerically unstable, and vLLM "
                                  "refuses it): bfloat16 or float32")
        mc = ModelConfig(**{**mc.__dict__, "dtype": dtype})
    advice = ("this engine runs 16-bit weights and FP8 ones (it sizes another quantised checkpoint as a deployment, "
              "CHECKPOINT_DIR@GPU)")
    try:
        bits = weight_bits(directory)
    except CheckpointError as exc:
        raise CheckpointError(f"{exc}; {advice}") from None
    raw = json.loads((directory / "config.json").read_text())  # read_config has read it: valid JSON
    float8, block = float8_weights(directory)
    if bits is not None and bits < 16 and not float8:
        source = ("hf_quant_config.json" if (directory / "hf_quant_config.json").is_file()
                  and not raw.get("quantization_config") else "config.json's quantization_config")
        raise CheckpointError(f"{directory}: its weights are quantised to {bits} bits ({source}); {advice}")
    state: dict[str, torch.Tensor] = {}
    for f in _weight_files(directory):
        try:
            tensors = load_file(str(f))
        except Exception as exc:  # safetensors raises its own error types for a damaged file
            raise CheckpointError(f"{f}: cannot be read as safetensors ({exc})") from exc
        byte = next((k for k, t in tensors.items() if t.is_floating_point() and t.element_size() == 1), None)
        if byte is not None and not float8:  # a float8 weight: its scales would be ignored
            raise CheckpointError(f"{f}: tensor {byte!r} is {tensors[byte].dtype} (quantised); {advice}")
        state.update(tensors)
    if float8:  # multiplied by their scales here, as vLLM's weight-only FP8 kernels (Marlin) do as they run
        state = _float8_dequantised(state, block, torch_dtype(mc.dtype), directory)
    state = _unfused(_text_model(state), mc, directory)
    kind = _model_type(raw, directory)
    if kind == "glm4":
        state = _glm4_norms(state)
    if kind in ("llama4_text", "llama4"):
        state = _llama4_names(state)
    if kind in ("granitemoe", "granitemoeshared"):
        state = _granite_moe_names(state, mc, directory)
    if kind == "hunyuan_v1_dense":  # its q and k norms' names
        state = {k.replace(".query_layernorm.", ".q_norm.").replace(".key_layernorm.", ".k_norm."): v
                 for k, v in state.items()}
    if raw.get("model_type") == "qwen3_vl_moe":
        state = _experts_as_held(state, mc)
    if mc.swiglu_limit is not None:  # gpt-oss: its experts stored as transformers holds them, in MXFP4 or not
        state = _dequantised(state, torch_dtype(mc.dtype), directory)
    elif mc.num_experts:
        state = _stacked_experts(state, mc, directory)
    model = LlamaModel(mc)
    expected = model.state_dict()
    if mc.tie_word_embeddings and "model.embed_tokens.weight" in state:  # an lm_head stored beside is not read,
        state["lm_head.weight"] = state["model.embed_tokens.weight"]  # as vLLM skips it and transformers re-ties it
    missing = sorted(k for k in expected if k not in state)
    if missing:
        raise CheckpointError(f"{directory}: tensor {missing[0]!r} is missing ({len(missing)} missing in all)")
    unexpected = _unexpected(state, expected, mc, directory)
    if unexpected:  # loaded as it is, the model would run without them: vLLM refuses such a checkpoint too
        raise CheckpointError(f"{directory}: tensor {unexpected[0]!r} has no place in the model config.json describes "
                              f"({len(unexpected)} such in all)")
    for name, t in expected.items():
        if tuple(state[name].shape) != tuple(t.shape):
            raise CheckpointError(f"{directory}: tensor {name!r} has shape {tuple(state[name].shape)}, "
                                  f"config.json implies {tuple(t.shape)}")
    model.load_state_dict({k: state[k] for k in expected}, strict=True)
    # vLLM reads KV scales through a quantisation method (fp8's, ModelOpt's, compressed-tensors'): without one it
    # skips them
    model.kv_scales = _kv_scales(state, mc, directory) if _quantization_config(directory)[0] else None
    return model.to(device=device, dtype=torch_dtype(mc.dtype)).eval()


# where a checkpoint stores a layer's K and V scales (after its attention's prefix), as vLLM's loaders find them:
# the names themselves, a projection's output scale, or one scale for both (older releases' kv_scale)
KV_SCALE_NAMES = (("k_scale", "k_proj.output_scale", "kv_scale"), ("v_scale", "v_proj.output_scale", "kv_scale"))


def _kv_scales(state: dict[str, torch.Tensor], mc: ModelConfig, directory) -> torch.Tensor | None:
    """Each layer's K and V scales ([layers, 2], float32) where the checkpoint stores any (1 for a layer that has
    none, as vLLM defaults them), which an 8-bit KV cache applies; None where it stores none."""
    scales, found = torch.ones(mc.num_layers, 2), False
    for layer in range(mc.num_layers):
        for entry, names in enumerate(KV_SCALE_NAMES):
            key = next((k for k in (f"model.layers.{layer}.self_attn.{n}" for n in names) if k in state), None)
            if key is None:
                continue
            value = state[key]
            if value.numel() != 1 or not value.is_floating_point() or not float(value) > 0:
                raise CheckpointError(f"{directory}: tensor {key!r} must be one scale > 0 (a tensor's: vLLM's KV "
                                      f"cache scales), got {value.dtype} {tuple(value.shape)}")
            scales[layer, entry], found = float(value), True
    return scales if found else None
