"""The workspace an iteration is charged covers what its forward pass allocates: the GPU check's
``workspace`` check, run on the CPU with SDPA's math kernel (the one CUDA takes for the engine's
masked grouped-query attention) and every tensor the forward creates counted."""
from __future__ import annotations

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
