"""Mixture-of-experts checkpoints (Mixtral, Qwen2-MoE, Qwen3-MoE): the engine generates what transformers
generates from the same checkpoint directory, its expert block is transformers' to the bit in
bf16, and the ledger and the roofline clock count experts as a served MoE model holds and reads
them."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from conftest import assert_generates_as, hf_greedy, hf_tiny
from engine.checkpoint import CheckpointError, load_checkpoint
from engine.config import EngineConfig, ModelConfig
from engine.engine import Engine
from engine.model import SparseMoE
from engine.request import Request
from engine.roofline import H100_SXM_80GB, deployment
from experiments import CHECKPOINTS
from rlctl.bench.engine import hf_twin

transformers = pytest.importorskip("transformers")

# Qwen3-MoE with a dense layer among sparse ones and heads wider than hidden / heads; Qwen3-MoE
# with every other layer dense and the routing weights not renormalised; Mixtral (every layer
# sparse, routing weights renormalised and kept float32)
ARCHS = {
    "qwen3_moe": ("Qwen3Moe", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                   mlp_only_layers=[1], norm_topk_prob=True, head_dim=12)),
    "qwen3_moe_sparse_step": ("Qwen3Moe", dict(num_experts=6, num_experts_per_tok=3, moe_intermediate_size=32,
                                               decoder_sparse_step=2, norm_topk_prob=False)),
    "mixtral": ("Mixtral", dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=None)),
    # Qwen2-MoE: q/k/v biases, and a gated shared expert beside the routed ones
    "qwen2_moe": ("Qwen2Moe", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                   shared_expert_intermediate_size=40, mlp_only_layers=[2], norm_topk_prob=False)),
}


def hf_moe(arch: str, dtype: torch.dtype = torch.float32):
    name, extra = ARCHS[arch]
    hf = hf_tiny(name, **extra)
    with torch.no_grad():  # routers far from uniform and experts that weigh in the tokens, so that a
        for key, p in hf.named_parameters():  # wrong pick, weight or expert order changes them
            if key.endswith(("mlp.gate.weight", "shared_expert_gate.weight")):
                p.normal_(0.0, 1.0)
            elif key.endswith(".bias"):  # attention in bf16 is not transformers' to the last bit (its SDPA
                p.normal_(0.0, 1.0 if dtype == torch.float32 else 0.05)  # sums differently): large biases
                # would let those bits pick tokens, so bf16 keeps them small, as test_bf16_numerics does
            elif ".mlp." in key:
                p.mul_(8)
    return hf.to(dtype)


def prompts(lengths: list[int], seed: int = 5) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 300, (n,), generator=g).tolist() for n in lengths]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("arch", list(ARCHS))
def test_a_moe_checkpoint_loads_and_generates_what_transformers_generates(tmp_path, arch, dtype):
    hf = hf_moe(arch, getattr(torch, dtype))
    hf.save_pretrained(tmp_path)  # the hub's layout: one tensor per expert and projection
    model = load_checkpoint(tmp_path)
    mc = model.config
    assert mc.dtype == dtype and mc.num_experts == {"qwen3_moe_sparse_step": 6}.get(arch, 4)
    assert mc.dense_layers == {"qwen3_moe": (1,), "qwen3_moe_sparse_step": (0, 2), "qwen2_moe": (2,)}.get(arch, ())
    assert mc.shared_expert_intermediate_size == (40 if arch == "qwen2_moe" else 0) and mc.qkv_bias == (arch == "qwen2_moe")
    assert mc.param_count() == hf.num_parameters()  # the ledger counts every expert
    # small batches and chunked prefill, so that tokens of several sequences share the experts
    eng = Engine(mc, EngineConfig(num_blocks=64, block_size=4, max_model_len=512, max_num_batched_tokens=24),
                 model=model, keep_outputs=True)
    ps = prompts([13, 30, 21])
    for i, p in enumerate(ps):
        eng.submit(Request(f"c{i}", 0.0, len(p), 12, 12, prompt_ids=tuple(p)))
    eng.run()
    assert_generates_as(hf, ps, [eng.outputs[f"c{i}"] for i in range(len(ps))], exact=dtype == "float32")
    # the twin the benchmarks build from the engine's own weights is the same model again
    assert_generates_as(hf, [ps[1]], [hf_greedy(hf_twin(model), ps[1], 12)], exact=dtype == "float32")


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral", "qwen2_moe"])
def test_the_expert_block_is_transformers_to_the_bit_in_bf16_and_its_routing_rules_matter(tmp_path, arch):
    hf = hf_moe(arch, torch.bfloat16)
    hf.save_pretrained(tmp_path)
    ours = load_checkpoint(tmp_path).model.layers[0].mlp
    ref = hf.model.layers[0].mlp
    assert isinstance(ours, SparseMoE)
    x = torch.randn(1, 37, 48, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    with torch.no_grad():
        expected = ref(x)[0]
        assert torch.equal(ours(x[0]), expected)
        # each rule the block keeps changes its output when broken: the routing weights' dtype
        # (Mixtral's stay float32) and their renormalisation over the experts picked
        ours.float32_weights = not ours.float32_weights
        assert not torch.equal(ours(x[0]), expected)
        ours.float32_weights = not ours.float32_weights
        ours.normalise = not ours.normalise
        assert not torch.equal(ours(x[0]), expected)
        ours.normalise = not ours.normalise
        if arch == "qwen2_moe":  # the shared expert counts, gated
            gate = ours.shared_expert_gate.weight.data.clone()
            ours.shared_expert_gate.weight.data.zero_()
            assert not torch.equal(ours(x[0]), expected)
            ours.shared_expert_gate.weight.data.copy_(gate)
            assert torch.equal(ours(x[0]), expected)


def test_a_moe_checkpoint_that_does_not_match_its_config_is_refused_by_name(tmp_path):
    import json

    hf = hf_moe("mixtral")
    hf.save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "num_local_experts": 5}))
    with pytest.raises(CheckpointError, match=r"'model.layers.0.block_sparse_moe.experts.4.w1.weight' is missing"):
        load_checkpoint(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "num_experts_per_tok": 9}))
    with pytest.raises(CheckpointError, match=r"experts_per_token must be in \[1, num_experts=4\], got 9"):
        load_checkpoint(tmp_path)
    # fewer experts declared than stored: those past the count would be left out of the model, as vLLM refuses them
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "num_local_experts": 3, "num_experts_per_tok": 2}))
    with pytest.raises(CheckpointError, match=r"tensor 'model.layers.0.block_sparse_moe.experts.3.w1.weight' has no "
                                              r"place in the model config.json describes \(9 such in all\)"):
        load_checkpoint(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "model_type": "qwen3_moe", "num_local_experts": None,
                                                      "num_experts": 4, "decoder_sparse_step": 0}))
    with pytest.raises(CheckpointError, match="decoder_sparse_step must be > 0, got 0"):
        load_checkpoint(tmp_path)


def test_shipped_moe_configs_count_what_the_published_checkpoints_hold():
    # Mixtral-8x7B's published 46,702,792,704 parameters, 12.9B of them active (2 of 8 experts a
    # token); Qwen3-30B-A3B's 30.5B, 3.35B active (8 of 128); both count as transformers builds them
    mixtral = deployment("Mixtral-8x7B-Instruct-v0.1@h200")
    qwen = deployment("Qwen3-30B-A3B@h100")
    assert mixtral.model.param_count() == 46_702_792_704
    assert mixtral.model.param_count(active=True) == 12_879_925_248
    assert qwen.model.param_count() == 30_532_122_624 and qwen.model.qk_norm and qwen.model.norm_topk_prob
    assert 3.3e9 < qwen.model.param_count(active=True) < 3.4e9
    assert "46.7B params (12.9B active) at 16 bits on NVIDIA H200" in mixtral.describe()
    for name, d in (("Mixtral-8x7B-Instruct-v0.1", mixtral), ("Qwen3-30B-A3B", qwen)):
        with torch.device("meta"):
            built = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(CHECKPOINTS / name))
        assert built.num_parameters() == d.model.param_count()
    # 93 GB of bf16 weights do not fit an 80 GB H100: refused, by name
    with pytest.raises(ValueError, match="Mixtral-8x7B-Instruct-v0.1@h100: the weights take 93.4 GB .* so nothing is left for KV"):
        deployment("Mixtral-8x7B-Instruct-v0.1@h100")


def test_the_roofline_reads_the_experts_a_batch_picks_and_computes_with_the_active_ones():
    d = deployment("Qwen3-30B-A3B@h100")
    m, cost = d.model, d.cost_model()
    e, k = m.num_experts, m.experts_per_token
    expert_bytes = m.sparse_layers * e * m.expert_params() * 2  # bf16
    other_bytes = m.weight_bytes() - expert_bytes
    bandwidth = H100_SXM_80GB.memory_bytes_per_s * cost.memory_efficiency

    def expected(tokens: int, context: int) -> float:
        picked = e * (1 - (1 - k / e) ** tokens)  # distinct experts n evenly routed tokens pick
        nbytes = other_bytes + expert_bytes * picked / e + m.kv_bytes_per_token() * (context + tokens)
        flops = 2 * (m.param_count(active=True) - m.vocab_size * m.hidden_size) * tokens
        return cost.overhead_s + max(nbytes / bandwidth, flops / (H100_SXM_80GB.peak_flops * cost.flops_efficiency))

    # one sequence decoding reads 8 of 128 experts a layer: far less than the weights
    assert cost.iterations_s(1, 1000, 1000) == pytest.approx(expected(1, 1000), rel=1e-12)
    assert cost.iterations_s(1, 1000, 1000) < cost.overhead_s + m.weight_bytes() / bandwidth / 4
    # a batch of 256 reads nearly all of them
    assert cost.iterations_s(256, 10**5, 10**5) == pytest.approx(expected(256, 10**5), rel=1e-12)
    assert expected(256, 0) > cost.overhead_s + 0.99 * (m.weight_bytes() + 256 * m.kv_bytes_per_token()) / bandwidth
    # elementwise over a run of decode iterations, with the same figures one by one
    tokens = torch.tensor([1, 4, 64, 256]).numpy()
    run = cost.iterations_s(tokens, tokens * 500, tokens * 500)
    assert [float(x) for x in run] == [cost.iterations_s(int(n), int(n) * 500, int(n) * 500) for n in tokens]
    # a dense model's clock is untouched: the same arithmetic as before experts existed
    dense = replace(m, num_experts=0, experts_per_token=0, moe_intermediate_size=0)
    assert dense.param_count(active=True) == dense.param_count()


def test_a_moe_model_from_a_seed_runs_in_the_engine_with_its_experts_in_the_ledger():
    mc = ModelConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                     num_experts=4, experts_per_token=2, moe_intermediate_size=16, dense_layers=(1,))
    eng = Engine(mc, EngineConfig(num_blocks=32, max_model_len=256), keep_outputs=True)
    assert eng.model.weight_bytes() == mc.weight_bytes() == 4 * mc.param_count()
    eng.submit(Request("r", 0.0, 9, 5, 5, prompt_ids=tuple(range(9))))
    eng.run()
    assert len(eng.outputs["r"]) == 5
