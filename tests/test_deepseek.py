"""DeepSeek-V2 and V3 checkpoints: the engine generates what transformers generates from the same directory,
through multi-head latent attention on the paged pool (each token's latent and shared rotated key cached
in place of its heads' K and V, as vLLM caches them) and DeepSeek's grouped routing and shared experts;
each of their rules changes the tokens; KV moved by preemption, host eviction and compaction comes back
the same; and a deployment counts and caches what the published checkpoints hold."""
from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest
import torch

from conftest import assert_greedy_up_to_rounding, hf_greedy, hf_tiny
from engine.checkpoint import CheckpointError, load_checkpoint, read_sizes
from engine.config import EngineConfig, ModelConfig
from engine.engine import Engine
from engine.model import GroupedMoE, LatentAttention
from engine.request import Request
from engine.roofline import deployment
from experiments import CHECKPOINTS
from rlctl.bench.engine import hf_twin
from test_gpt_oss import generate, generate_broken
from test_kv_invariants import check_engine_books, noise_in_fresh_segments
from test_moe import prompts

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

LATENT = dict(kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=12, num_key_value_heads=6,
              n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=2, moe_intermediate_size=24,
              first_k_dense_replace=1, rope_theta=100.0)
# DeepSeek-V2-Lite's layout (no low-rank query, greedy routing); DeepSeek-V2's (a low-rank query, routing
# limited to 2 of 4 groups, scaled weights) with YaRN and its mscale folded into the scores' scale, and biases
# on its projections from the hidden state and on o;
# DeepSeek-V3's (sigmoid scores and a learned bias picking within 2 of 4 groups, renormalised and scaled),
# its RoPE's pairs interleaved or, with rope_interleave false, not
ARCHS = {
    "v2_lite": ("DeepseekV2", dict(LATENT, q_lora_rank=None)),
    "v2_groups_yarn": ("DeepseekV2", dict(LATENT, q_lora_rank=20, topk_method="group_limited_greedy", n_group=4,
                                          topk_group=2, routed_scaling_factor=3.0, attention_bias=True,
                                          rope_parameters={"rope_type": "yarn", "rope_theta": 50000.0, "factor": 40.0,
                                                           "mscale": 0.707, "mscale_all_dim": 0.707,
                                                           "original_max_position_embeddings": 64})),
    "v3": ("DeepseekV3", dict(LATENT, q_lora_rank=20, n_group=4, topk_group=2, routed_scaling_factor=2.5)),
    "v3_not_interleaved": ("DeepseekV3", dict(LATENT, q_lora_rank=20, n_group=4, topk_group=2, rope_interleave=False,
                                              norm_topk_prob=False)),
}


def hf_deepseek(arch: str, dtype: torch.dtype = torch.float32):
    """A tiny DeepSeek whose routers, correction biases, norms and experts are drawn far from their initial
    values, so that a wrong pick, weight, norm or expert changes the tokens."""
    name, extra = ARCHS[arch]
    hf = hf_tiny(name, **extra)
    with torch.no_grad():
        for key, p in hf.named_parameters():
            if key.endswith("mlp.gate.weight"):
                p.normal_(0.0, 1.0)
            elif key.endswith(".bias"):  # attention_bias's (transformers starts them at zero)
                p.normal_(0.0, 0.02)
            elif key.endswith("norm.weight"):
                p.normal_(1.0, 0.3)
            elif ".mlp." in key:
                p.mul_(8)
            elif key.endswith(("self_attn.kv_b_proj.weight", "self_attn.o_proj.weight")):
                p.mul_(8)  # attention that weighs beside the experts, so that a wrong rotation shows
        for key, b in hf.named_buffers():
            if key.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.3)
    return hf.to(dtype)


@pytest.mark.parametrize("arch", list(ARCHS))
def test_a_deepseek_checkpoint_generates_what_transformers_generates(tmp_path, arch):
    hf = hf_deepseek(arch)
    hf.save_pretrained(tmp_path)
    model = load_checkpoint(tmp_path)
    mc = model.config
    assert (mc.kv_lora_rank, mc.head_dim, mc.value_dim, mc.num_experts, mc.dense_layers) == (16, 16, 12, 8, (0,))
    assert mc.kv_layout == (1, 1, 24)  # one entry a token and layer: its latent and its rotated key
    assert mc.param_count() == hf.num_parameters()
    assert isinstance(model.model.layers[0].self_attn, LatentAttention)
    assert isinstance(model.model.layers[1].mlp, GroupedMoE)
    ps = prompts([13, 30, 21])
    outputs = generate(model, ps)
    assert len({t for o in outputs for t in o}) > 8  # tokens that vary, so that a difference shows
    assert outputs == [hf_greedy(hf, p, 12) for p in ps]


@pytest.mark.parametrize("arch", ["v2_lite", "v3"])
def test_a_bf16_deepseek_checkpoint_generates_what_transformers_generates_up_to_rounding(tmp_path, arch):
    hf = hf_deepseek(arch, torch.bfloat16)
    hf.save_pretrained(tmp_path)
    model = load_checkpoint(tmp_path)
    assert model.config.dtype == "bfloat16"
    # the router scores in float32 and V3's correction bias stays float32, as transformers and vLLM hold it
    if arch == "v3":
        assert model.model.layers[1].mlp.gate.e_score_correction_bias.dtype == torch.float32
    for p, tokens in zip(prompts([13, 30]), generate(model, prompts([13, 30]))):
        assert_greedy_up_to_rounding(hf, p, tokens)


def test_a_checkpoint_whose_model_type_transformers_lacks_runs_as_its_architecture_names(tmp_path):
    # Kimi K2's config.json names model_type kimi_k2 (its own configuration code) and DeepSeek-V3's class,
    # which vLLM runs it as: read as deepseek_v3, it generates what DeepSeek-V3's does; a model_type of
    # one's own beside Llama's class reads as Llama's
    hf = hf_deepseek("v3")
    hf.save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["architectures"] == ["DeepseekV3ForCausalLM"]
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "model_type": "kimi_k2"}))
    ps = prompts([13, 30])
    assert generate(load_checkpoint(tmp_path), ps) == [hf_greedy(hf, p, 12) for p in ps]
    assert read_sizes(tmp_path)[0].param_count() == hf.num_parameters()
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "model_type": "kimi_k2", "architectures": ["KimiK2"]}))
    with pytest.raises(CheckpointError, match=r"model_type 'kimi_k2' is not one of .*, nor is its architectures "
                                              r"\['KimiK2'\] one of"):
        load_checkpoint(tmp_path)


def test_each_of_deepseeks_rules_changes_what_it_generates(tmp_path):
    hf = hf_deepseek("v3")
    hf.save_pretrained(tmp_path)
    ps = prompts([13, 30, 21])
    expected = [hf_greedy(hf, p, 12) for p in ps]
    assert generate(load_checkpoint(tmp_path), ps) == expected

    def no_correction_bias(layer):
        if isinstance(layer.mlp, GroupedMoE):
            layer.mlp.gate.e_score_correction_bias.zero_()

    def no_groups(layer):
        if isinstance(layer.mlp, GroupedMoE):
            layer.mlp.gate.topk_groups = 4

    def unscaled(layer):
        if isinstance(layer.mlp, GroupedMoE):
            layer.mlp.gate.scaling = 1.0

    def no_shared_experts(layer):
        if isinstance(layer.mlp, GroupedMoE):
            layer.mlp.shared_experts = None

    def not_interleaved(layer):
        layer.self_attn.interleaved = False

    for change in (no_correction_bias, no_groups, unscaled, no_shared_experts, not_interleaved):
        assert generate_broken(tmp_path, ps, change) != expected, change.__name__


def test_yarns_mscale_scales_the_scores_as_transformers_folds_it_in(tmp_path):
    hf = hf_deepseek("v2_groups_yarn")
    hf.save_pretrained(tmp_path)
    mc = load_checkpoint(tmp_path).config
    # (nope + rope) ** -0.5 times mscale(40, 0.707) squared: transformers' scaling, to the last bit
    assert mc.query_scale == hf.model.layers[0].self_attn.scaling
    assert mc.query_scale == pytest.approx(16 ** -0.5 * (0.1 * 0.707 * math.log(40) + 1) ** 2, rel=1e-12)
    assert mc.rope_scaling.cos_scale == 1.0  # mscale / mscale_all_dim: the rotated features are not scaled


def test_latent_kv_moved_by_preemption_eviction_and_compaction_comes_back_the_same():
    mc = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4, num_kv_heads=4,
                     kv_lora_rank=8, q_lora_rank=12, qk_nope_head_dim=6, qk_rope_head_dim=4, v_head_dim=10,
                     rope_interleaved=True, num_experts=4, experts_per_token=2, moe_intermediate_size=16,
                     shared_expert_intermediate_size=16, shared_expert_gate=False, router="sigmoid_groups",
                     expert_groups=2, topk_groups=1, routed_scaling=2.0, moe_float32_weights=True)
    # the pool holds one entry of 8 + 4 features a token and layer, not K and V for each of 4 heads
    assert mc.kv_bytes_per_token() == 2 * 12 * 4
    requests = [Request(f"r{i}", 0.0, 14 + 3 * i, 20, 24) for i in range(4)]

    def run(eng: Engine, perturbed: bool, seed: int) -> Engine:
        with noise_in_fresh_segments(seed):  # a slot read before it is written would show
            for r in requests:
                eng.submit(r)
            step = 0
            while eng.step():
                step += 1
                if perturbed and step % 7 == 0:
                    eng.evict(1.0)  # every block it can to the host
                elif perturbed and step % 7 == 3:
                    eng.compact()
                check_engine_books(eng)
        return eng

    roomy = run(Engine(mc, EngineConfig(block_size=4, segment_blocks=4, num_blocks=64), keep_outputs=True), False, 2)
    tight = run(Engine(mc, EngineConfig(block_size=4, segment_blocks=4, num_blocks=16, oom_mode="preempt",
                                        overcommit=2.0, host_bytes=16 * 4 * mc.kv_bytes_per_token()),
                       keep_outputs=True), True, 1)
    assert tight.counters.preemptions and tight.kv.traffic.out_blocks and tight.kv.traffic.in_blocks
    assert all(len(roomy.outputs[r.request_id]) == 20 for r in requests)
    assert tight.outputs == roomy.outputs


def test_shipped_deepseek_v2_lite_counts_and_caches_what_the_published_checkpoint_holds():
    d = deployment("DeepSeek-V2-Lite-Chat@h100")
    m = d.model
    # DeepSeek's 15.7B parameters, as transformers builds them; 2.4B activated besides the embeddings
    assert m.param_count() == 15_706_484_224
    assert m.param_count(active=True) - m.vocab_size * m.hidden_size == 2_451_435_008
    with torch.device("meta"):
        built = transformers.AutoModelForCausalLM.from_config(
            transformers.AutoConfig.from_pretrained(CHECKPOINTS / "DeepSeek-V2-Lite-Chat"))
    assert built.num_parameters() == m.param_count()
    # vLLM caches 512 + 64 features a token and layer, 31,104 bytes a token over 27 layers in bf16, where
    # its 16 heads' keys (192 features) and values (128) would take 8.9 times as much
    assert m.kv_bytes_per_token() == 27 * 576 * 2
    assert (m.router, m.expert_groups, m.shared_expert_intermediate_size, m.dense_layers) == ("softmax_groups", 1, 2816, (0,))
    assert d.max_model_len == 32768 and "15.7B params (2.7B active) at 16 bits" in d.describe()
    # the roofline's attention reads the latent and computes as vLLM's MLA decode does
    assert m.pair_flops() == 2 * 16 * (2 * 512 + 64)
    with pytest.raises(ValueError, match="weights take 31.4 GB"):
        deployment("DeepSeek-V2-Lite-Chat@a10")


def test_deepseek_v3_is_sized_as_transformers_builds_it_and_refused_on_one_gpu(tmp_path):
    cfg = transformers.DeepseekV3Config().to_dict()  # DeepSeek-V3's own sizes
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "quantization_config": {
        "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}}))
    m, _ = read_sizes(tmp_path)
    with torch.device("meta"):
        built = transformers.AutoModelForCausalLM.from_config(transformers.DeepseekV3Config())
    assert m.param_count() == built.num_parameters() == 671_026_404_352
    assert (m.router, m.expert_groups, m.topk_groups, m.routed_scaling) == ("sigmoid_groups", 8, 4, 2.5)
    with pytest.raises(ValueError, match="weights take 671.0 GB"):  # FP8: a byte a weight
        deployment(f"{tmp_path}@h200")


@pytest.mark.parametrize("change, match", [
    ({"scoring_func": "sigmoid"}, "scoring_func 'sigmoid' is not supported"),
    ({"topk_method": "noaux_tc"}, "topk_method 'noaux_tc' is not supported"),
    ({"kv_lora_rank": 0}, "kv_lora_rank must be > 0, got 0"),
    ({"topk_method": "group_limited_greedy", "n_group": 3, "topk_group": 2}, "n_group must divide n_routed_experts"),
    ({"topk_method": "group_limited_greedy", "n_group": 0, "topk_group": 0}, "n_group must divide n_routed_experts"),
    ({"model_type": "deepseek_v3", "n_group": 8, "topk_group": 4}, "n_group 8 leaves one of the 8 experts a group"),
    ({"routed_scaling_factor": "2"}, "routed_scaling_factor must be a number > 0"),
    ({"moe_layer_freq": 0}, "moe_layer_freq must be > 0, got 0"),
    ({"n_shared_experts": -1}, "n_shared_experts must be >= 0, got -1"),
    ({"qk_rope_head_dim": 5}, "an even qk_rope_head_dim"),
])
def test_a_deepseek_config_that_cannot_be_run_is_refused_by_name(tmp_path, change, match):
    hf = hf_deepseek("v2_lite")
    hf.save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, **change}))
    with pytest.raises(CheckpointError, match=match):
        load_checkpoint(tmp_path)


def test_no_twin_is_built_of_latent_attention():
    mc = ModelConfig(num_heads=4, num_kv_heads=4, kv_lora_rank=8, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8)
    with pytest.raises(ValueError, match="no transformers twin is built here of latent attention"):
        hf_twin(Engine(mc, EngineConfig(num_blocks=8)).model)
    with pytest.raises(ValueError, match="latent attention .* does not take window_layers"):
        replace(mc, sliding_window=4, window_layers=(0,))


def test_deepseek_fields_are_read_as_transformers_reads_them(tmp_path):
    # a sliding_window its attention ignores; rope_interleave null (not interleaved, as transformers tests it);
    # hidden_size not a multiple of the heads (its heads are nope + rope wide); the low-rank norms' epsilon
    # 1e-6 whatever rms_norm_eps says; moe_layer_freq (vLLM's rule: every published one is 1)
    cfg = {**transformers.DeepseekV3Config(**{**ARCHS["v3"][1], "num_key_value_heads": 5}, vocab_size=300,
                                           hidden_size=50, intermediate_size=96, num_hidden_layers=6,
                                           num_attention_heads=5, rms_norm_eps=1e-5).to_dict(),
           "sliding_window": 8, "rope_interleave": None, "moe_layer_freq": 2}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    mc = read_sizes(tmp_path)[0]
    assert (mc.window_layers, mc.rope_interleaved, mc.head_dim, mc.dense_layers) == ((), False, 16, (0, 1, 3, 5))
    with torch.device("meta"):
        built = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(tmp_path))
    # transformers ignores moe_layer_freq: layers 1, 3 and 5 are mixtures there, dense MLPs here
    assert built.num_parameters() - mc.param_count() == 3 * ((8 + 2) * 3 * 50 * 24 + 8 * 50 - 3 * 50 * 96)
    model = __import__("engine.model", fromlist=["LlamaModel"]).LlamaModel(mc)
    assert model.model.layers[0].self_attn.kv_a_layernorm.eps == model.model.layers[0].self_attn.q_a_layernorm.eps == 1e-6


def test_deepseek_v3s_router_is_transformers_to_the_bit_in_bf16(tmp_path):
    # correction biases far below zero, so that the groups left out (filled with -inf) would otherwise win
    hf = hf_deepseek("v3", torch.bfloat16)
    with torch.no_grad():
        hf.model.layers[1].mlp.gate.e_score_correction_bias.normal_(-5.0, 0.3)
    hf.save_pretrained(tmp_path)
    ours = load_checkpoint(tmp_path).model.layers[1].mlp.gate
    x = (torch.randn(64, 48, generator=torch.Generator().manual_seed(3)) * 4).to(torch.bfloat16)
    with torch.no_grad():
        _, weights, picked = hf.model.layers[1].mlp.gate(x)
        mine, my_weights = ours(x)
    order, my_order = picked.argsort(dim=-1), mine.argsort(dim=-1)
    assert torch.equal(picked.gather(1, order), mine.gather(1, my_order))
    assert torch.equal(weights.gather(1, order), my_weights.gather(1, my_order))
    assert my_weights.dtype == torch.float32


def test_the_roofline_prefills_latent_attention_on_its_heads_and_decodes_it_on_the_latent():
    from engine.scheduler import BatchShape

    d = deployment("DeepSeek-V2-Lite-Chat@h100")
    cost, m = d.cost_model(), d.model
    matmul = 2 * (m.param_count(active=True) - m.vocab_size * m.hidden_size)
    n = 8192  # a fresh 8,192-token prefill: its last query's pairs on the latent, the rest on 16 heads' 192 + 128
    pairs = n * (n + 1) // 2
    flops = matmul * n + 27 * 2 * 16 * (2 * 512 + 64) * n + 27 * 2 * 16 * (192 + 128) * (pairs - n)
    assert cost.iteration_s(BatchShape(n, n, pairs)) == pytest.approx(2e-3 + flops / (989e12 * 0.6), rel=1e-9)
    # 256 decodes at 4,096 tokens each read their latents: memory-bound, every pair on the latent
    assert cost.iteration_s(BatchShape(256, 256 * 4096, 256 * 4096)) == pytest.approx(
        2e-3 + (m.weight_bytes() + m.kv_bytes_per_token() * 256 * 4097) / (3.35e12 * 0.8), rel=1e-9)
    # a 2,048-token chunk beside 64 decodes at 4,096: compute-bound, the decodes' pairs and the chunk's last
    # query's on the latent, the chunk's other queries' on the heads
    chunk = 2048 * 2049 // 2
    flops = (matmul * (2048 + 64) + 27 * 2 * 16 * (2 * 512 + 64) * (2048 + 64 * 4096)
             + 27 * 2 * 16 * (192 + 128) * (chunk - 2048))
    assert cost.iteration_s(BatchShape(2048 + 64, 2048 + 64 * 4096, chunk + 64 * 4096)) == pytest.approx(
        2e-3 + flops / (989e12 * 0.6), rel=1e-9)
