"""The workspace an iteration is charged covers what its forward pass allocates: the GPU check's
``workspace`` check, run on the CPU with SDPA's math kernel (the one CUDA takes for the engine's
masked grouped-query attention) and every tensor the forward creates counted."""
from __future__ import annotations

from dataclasses import replace

import pytest

from engine import attention
from engine.config import ModelConfig
from tests.gpu.checks import Deadline, Sizes, check_workspace

MODEL = ModelConfig(num_heads=4, num_kv_heads=2, hidden_size=128)


def test_every_iteration_allocates_at_most_its_charged_workspace():
    report = check_workspace(Sizes.cpu(), Deadline(600))
    assert report["status"] == "ok", report
    assert report["iterations"] >= 10 and report["iterations_over_charged"] == 0
    # the fused kernel's estimate, charged before, is below what most of these iterations allocate
    assert report["iterations_over_fused_estimate"] >= report["iterations"] // 2
    # an upper bound, not a blanket: every iteration uses over a third of what it is charged
    assert report["min_peak_over_charged"] > 0.3


def test_decodes_are_charged_for_their_padding_and_chunks_for_their_scores():
    even = attention.workspace_bytes(MODEL, 16, [512, 512], [])
    padded = attention.workspace_bytes(MODEL, 16, [24, 1000], [])  # about as many tokens, padded to 1008
    assert padded > 1.5 * even
    # a chunk's score matrices grow with chunk x context
    short = attention.workspace_bytes(MODEL, 16, [], [(256, 256)])
    late = attention.workspace_bytes(MODEL, 16, [], [(256, 4096)])
    assert late > 12 * short


@pytest.mark.parametrize("experts", [dict(num_experts=8, experts_per_token=2, moe_intermediate_size=256),
                                     dict(num_experts=8, experts_per_token=2, moe_intermediate_size=256,
                                          dtype="bfloat16", moe_float32_weights=True),
                                     dict(num_experts=8, experts_per_token=2, moe_intermediate_size=64,
                                          shared_expert_intermediate_size=256),
                                     # DeepSeek-V3's: latent attention (each head's keys and values projected
                                     # from the latents read) and grouped routing beside ungated shared experts
                                     dict(num_experts=8, experts_per_token=2, moe_intermediate_size=64,
                                          shared_expert_intermediate_size=128, shared_expert_gate=False,
                                          router="sigmoid_groups", expert_groups=4, topk_groups=2,
                                          moe_float32_weights=True, dtype="bfloat16", kv_lora_rank=64, q_lora_rank=48,
                                          qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=48,
                                          rope_interleaved=True)])
def test_a_mixture_of_experts_allocates_at_most_its_charged_workspace(experts):
    # the router's scores, each pick's expert rows and its weighted output (float32 beside bf16, as
    # Mixtral's routing weights keep it), and a shared expert's rows (Qwen2-MoE's) are charged per batched token;
    # latent attention's keys and values, projected for every head, per key read
    sizes = Sizes.cpu()
    report = check_workspace(replace(sizes, big_model={**sizes.big_model, **experts}), Deadline(600))
    assert report["status"] == "ok", report
    assert report["iterations"] >= 10 and report["iterations_over_charged"] == 0
    assert report["min_peak_over_charged"] > 0.15
