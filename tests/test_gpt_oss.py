"""gpt-oss checkpoints: the engine generates what transformers generates from the same directory, in
float32 and bf16, with its attention sinks and window shown to matter; its expert block is transformers' to the
bit in bf16, and its clamp, gain and router bias matter; MXFP4 tensors are read as transformers' own dequantiser reads them; and a deployment
counts what the published checkpoints hold, at MXFP4's bits for the experts alone."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import assert_generates_as, hf_greedy, hf_tiny
from engine.checkpoint import CheckpointError, expert_bits, load_checkpoint, mxfp4_weights
from engine.config import EngineConfig
from engine.engine import Engine
from engine.model import ClampedMoE
from engine.request import Request
from engine.roofline import deployment
from experiments import CHECKPOINTS
from rlctl.bench.engine import hf_twin
from test_moe import prompts

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()  # a tiny YaRN model's factor is not its contexts' ratio: said, and meant


def hf_gpt_oss(dtype: torch.dtype = torch.float32, **extra):
    """A tiny gpt-oss with a window of 8 on layers 0 and 2, its sinks, router, norms, experts and their
    biases drawn far from their initial values, so that a wrong sink, pick, clamp, bias, norm or window
    changes the tokens."""
    hf = hf_tiny("GptOss", num_local_experts=4, num_experts_per_tok=2, head_dim=8, sliding_window=8, **extra)
    with torch.no_grad():
        for key, p in hf.named_parameters():
            if key.endswith("sinks"):
                p.normal_(0.0, 2.0)
            elif key.endswith("router.weight"):
                p.normal_(0.0, 1.0)
            elif key.endswith("norm.weight"):
                p.normal_(1.0, 0.3)
            elif key.endswith("_bias"):  # the experts' (transformers starts them at zero)
                p.normal_(0.0, 0.5)
            elif key.endswith(".bias"):
                p.normal_(0.0, 0.05)
            elif ".mlp.experts." in key:
                p.mul_(8)
    return hf.to(dtype)


def generate(model, ps: list[list[int]], new_tokens: int = 12) -> list[list[int]]:
    # blocks of 4 and chunks of 24 tokens: prompts past the window, in chunks, decoded in one batch
    eng = Engine(model.config, EngineConfig(num_blocks=64, block_size=4, max_model_len=512, max_num_batched_tokens=24),
                 model=model, keep_outputs=True)
    for i, p in enumerate(ps):
        eng.submit(Request(f"c{i}", 0.0, len(p), new_tokens, new_tokens, prompt_ids=tuple(p)))
    eng.run()
    return [eng.outputs[f"c{i}"] for i in range(len(ps))]


def generate_broken(directory, ps: list[list[int]], change) -> list[list[int]]:
    """What the checkpoint in ``directory`` generates for ``ps`` with ``change(layer)`` done to each of its layers."""
    model = load_checkpoint(directory)
    with torch.no_grad():
        for layer in model.model.layers:
            change(layer)
    return generate(model, ps)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_gpt_oss_checkpoint_generates_what_transformers_generates(tmp_path, dtype):
    hf = hf_gpt_oss(getattr(torch, dtype))
    hf.save_pretrained(tmp_path)
    model = load_checkpoint(tmp_path)
    mc = model.config
    assert (mc.dtype, mc.num_experts, mc.experts_per_token, mc.moe_intermediate_size) == (dtype, 4, 2, 96)
    assert (mc.window_layers, mc.sliding_window, mc.rope_scaling.kind, mc.rope_scaling.factor) == ((0, 2), 8, "yarn", 32.0)
    assert mc.attn_sinks and mc.qkv_bias and mc.o_bias and mc.swiglu_limit == 7.0
    assert mc.param_count() == hf.num_parameters()  # sinks, biases and the router's bias counted
    ps = prompts([13, 30, 21])
    outputs = generate(model, ps)
    assert len({t for o in outputs for t in o}) > 8  # tokens that vary, so that a difference shows
    assert_generates_as(hf, ps, outputs, exact=dtype == "float32")
    # the twin the benchmarks build from the engine's own weights is the same model again
    assert hf_greedy(hf_twin(model), ps[1], 12) == hf_greedy(hf, ps[1], 12)


def test_each_of_gpt_oss_rules_changes_what_it_generates(tmp_path):
    hf = hf_gpt_oss()
    hf.save_pretrained(tmp_path)
    ps = prompts([13, 30, 21])
    expected = [hf_greedy(hf, p, 12) for p in ps]
    assert generate(load_checkpoint(tmp_path), ps) == expected

    def no_sinks(layer):
        layer.self_attn.sinks.fill_(-1e4)  # a sink no query's softmax gives a share to

    def unwindowed(layer):
        layer.self_attn.windowed = False

    for change in (no_sinks, unwindowed):  # the clamp: in the expert block's test
        assert generate_broken(tmp_path, ps, change) != expected, change.__name__


def test_the_expert_block_is_transformers_to_the_bit_in_bf16_and_its_rules_matter(tmp_path):
    hf = hf_gpt_oss(torch.bfloat16)
    hf.save_pretrained(tmp_path)
    layer = load_checkpoint(tmp_path).model.layers[0]
    ours = layer.mlp
    assert isinstance(ours, ClampedMoE)
    x = (torch.randn(1, 37, 48, generator=torch.Generator().manual_seed(2)) * 4).to(torch.bfloat16)
    with torch.no_grad():
        # the norms before it scale by their weight in float32, then round (not Llama's round, then scale)
        for name in ("input_layernorm", "post_attention_layernorm"):
            assert torch.equal(getattr(layer, name)(x[0]), getattr(hf.model.layers[0], name)(x)[0])
        expected = hf.model.layers[0].mlp(x)[0][0]
        assert torch.equal(ours(x[0]), expected)
        ours.limit = 1.0  # the clamp
        assert not torch.equal(ours(x[0]), expected)
        ours.limit, ours.alpha = 7.0, 1.0  # the sigmoid's gain
        assert not torch.equal(ours(x[0]), expected)
        ours.alpha = 1.702
        bias = ours.router.bias.clone()  # the router's bias
        ours.router.bias.zero_()
        assert not torch.equal(ours(x[0]), expected)
        ours.router.bias.copy_(bias)
        assert torch.equal(ours(x[0]), expected)


@pytest.mark.parametrize("queries", [1, 9])
def test_attention_with_sinks_is_transformers_to_the_bit_in_bf16(queries):
    # transformers' eager attention with sinks: the scores and the sink in bf16, the max taken off,
    # the softmax in bf16, the sink's share dropped; a decode (one query, padded keys masked) and a chunk
    from types import SimpleNamespace

    from engine.attention import _attend
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    g = torch.Generator().manual_seed(6)
    q = (torch.randn(2, 6, queries, 8, generator=g) * 3).to(torch.bfloat16)
    k, v = [(torch.randn(2, 2, 20, 8, generator=g) * 3).to(torch.bfloat16) for _ in range(2)]
    sinks = (torch.randn(6, generator=g) * 2).to(torch.bfloat16)
    mask = torch.zeros(2, 1, queries, 20, dtype=torch.bfloat16)
    mask[0, ..., 15:] = torch.finfo(torch.bfloat16).min  # the first's last keys: padding
    mask[..., :3] = torch.finfo(torch.bfloat16).min  # before a window
    module = SimpleNamespace(num_key_value_groups=3, sinks=sinks, training=False)
    expected, _ = eager_attention_forward(module, q, k, v, mask, scaling=8 ** -0.5)
    ours = _attend(q, k, v, mask, None, None, sinks)
    assert torch.equal(ours, expected.transpose(1, 2))
    assert not torch.equal(_attend(q, k, v, mask, None, None, None), ours)  # the sink takes its share


def test_a_gpt_oss_config_leaving_fields_out_takes_transformers_defaults(tmp_path):
    # gpt-oss's YaRN (a null rope_scaling too), its RoPE base, window, alternating windowed layers and
    # SwiGLU gain, as transformers' GptOssConfig fills them in
    from engine.checkpoint import read_config
    from engine.model import Rotary
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRotaryEmbedding

    bare = {"model_type": "gpt_oss", "vocab_size": 300, "hidden_size": 48, "intermediate_size": 32,
            "num_hidden_layers": 4, "num_attention_heads": 6, "num_key_value_heads": 2, "num_local_experts": 4,
            "num_experts_per_tok": 2}
    for name, fields in (("bare", bare), ("null", {**bare, "rope_scaling": None})):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(fields))
        mc = read_config(tmp_path / name)
        ref = transformers.GptOssConfig(**fields)
        assert mc.window_layers == tuple(i for i, t in enumerate(ref.layer_types) if t == "sliding_attention")
        assert (mc.sliding_window, mc.head_dim, mc.swiglu_alpha, mc.swiglu_limit, mc.dtype) == (
            ref.sliding_window, ref.head_dim, ref.swiglu_alpha, ref.swiglu_limit, "bfloat16")
        rope, theirs = Rotary(mc.head_dim, mc.rope_theta, mc.rope_scaling), GptOssRotaryEmbedding(ref)
        assert torch.equal(rope.inv_freq, theirs.inv_freq) and rope.cos_scale == theirs.attention_scaling


def test_mxfp4_tensors_read_as_transformers_dequantiser_reads_them():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    g = torch.Generator().manual_seed(3)
    blocks = torch.randint(0, 256, (3, 10, 2, 16), generator=g, dtype=torch.uint8)
    scales = torch.randint(110, 140, (3, 10, 2), generator=g, dtype=torch.uint8)
    for dtype in (torch.bfloat16, torch.float32):
        ours = mxfp4_weights(blocks, scales, dtype)
        assert ours.shape == (3, 64, 10) and ours.dtype == dtype
        assert torch.equal(ours, convert_moe_packed_tensors(blocks, scales, dtype=dtype))
    # the low half of a byte first, each code a 4-bit float, scaled by its group's power of two
    one = torch.zeros(1, 1, 1, 16, dtype=torch.uint8)
    one[0, 0, 0, 0] = 0x9F  # codes 15 (-6.0) then 9 (-0.5)
    w = mxfp4_weights(one, torch.full((1, 1, 1), 128, dtype=torch.uint8), torch.float32)[0, :, 0]
    assert w[:3].tolist() == [-12.0, -1.0, 0.0]
    with pytest.raises(ValueError, match=r"blocks must be uint8 \[experts, rows, groups, 16\]"):
        mxfp4_weights(blocks[..., :8], scales, torch.float32)


def test_a_gpt_oss_checkpoint_in_mxfp4_generates_what_transformers_generates_from_it(tmp_path):
    # experts as the release stores them (NAME_blocks and NAME_scales beside config.json's
    # quantization_config), the reference built on what transformers' dequantiser makes of them
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    torch.manual_seed(0)  # widths of whole 32-weight groups
    hf = transformers.GptOssForCausalLM(transformers.GptOssConfig(
        vocab_size=300, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=512, rope_theta=50000.0, num_local_experts=4,
        num_experts_per_tok=2, sliding_window=8, bos_token_id=None, eos_token_id=None, pad_token_id=None)).eval()
    g = torch.Generator().manual_seed(4)
    packed = {}
    with torch.no_grad():
        for key, p in hf.named_parameters():
            if key.endswith(("gate_up_proj", "down_proj")):  # [experts, in, out]: stored [experts, out, in / 32, 16]
                e, n_in, n_out = p.shape
                blocks = torch.randint(0, 256, (e, n_out, n_in // 32, 16), generator=g, dtype=torch.uint8)
                scales = torch.randint(124, 128, (e, n_out, n_in // 32), generator=g, dtype=torch.uint8)
                p.copy_(convert_moe_packed_tensors(blocks, scales, dtype=torch.float32))
                packed[f"{key}_blocks"], packed[f"{key}_scales"] = blocks, scales
            elif key.endswith("sinks"):
                p.normal_(0.0, 2.0, generator=g)
            elif key.endswith(("router.weight", "_bias")):
                p.normal_(0.0, 1.0, generator=g)
    hf.save_pretrained(tmp_path)
    state = load_file(str(tmp_path / "model.safetensors"))
    state = {k: v for k, v in state.items() if not k.endswith(("gate_up_proj", "down_proj"))}
    (tmp_path / "model.safetensors").unlink()
    save_file({**state, **packed}, str(tmp_path / "model.safetensors"))
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "quantization_config": {"quant_method": "mxfp4"}}))

    model = load_checkpoint(tmp_path)
    assert torch.equal(model.model.layers[1].mlp.experts.down_proj, hf.model.layers[1].mlp.experts.down_proj)
    ps = prompts([13, 30])
    outputs = generate(model, ps)
    assert len({t for o in outputs for t in o}) > 4
    assert outputs == [hf_greedy(hf, p, 12) for p in ps]
    assert expert_bits(tmp_path) == 4.25
    # a block without its scales, scales without their block, a tensor stored twice: refused by name
    name = "model.layers.0.mlp.experts.down_proj"
    for tensors, match in (({k: v for k, v in packed.items() if k != f"{name}_scales"}, f"'{name}_scales' is missing"),
                           ({k: v for k, v in packed.items() if k != f"{name}_blocks"},
                            f"'{name}_scales' has no '{name}_blocks' beside it"),
                           ({**packed, name: hf.model.layers[0].mlp.experts.down_proj.detach().clone()},
                            f"'{name}' is stored twice")):
        save_file({**state, **tensors}, str(tmp_path / "model.safetensors"))
        with pytest.raises(CheckpointError, match=match):
            load_checkpoint(tmp_path)


def test_shipped_gpt_oss_configs_count_what_the_published_checkpoints_hold():
    # OpenAI's model card: 20.91B and 116.83B parameters; the release's MXFP4 files take about 13.8 and
    # 65 GB. Both count as transformers builds them, and vLLM's sizing serves the 120B on an H200
    small, large = deployment("gpt-oss-20b@h100"), deployment("gpt-oss-120b@h200")
    assert small.model.param_count() == 20_914_757_184 and large.model.param_count() == 116_829_156_672
    assert small.model.expert_weight_bits == 4.25 and small.model.weight_bits is None
    # the clock reads the experts' matrices at 4.25 bits and their biases at 16: 24 layers of 32 experts
    matrices, biases = 24 * 32 * 3 * 2880 * 2880, 24 * 32 * (2 * 2880 + 2880)
    assert small.model.routed_expert_bytes() == matrices * 17 // 32 + 2 * biases
    assert 13.7e9 < small.model.weight_bytes() < 13.8e9 and 65.2e9 < large.model.weight_bytes() < 65.3e9
    assert small.model.dtype == "bfloat16" and small.model.max_position == 131_072  # YaRN's 4,096 x 32
    assert "20.9B params (4.2B active) at 16 bits (its experts at 4.25) on NVIDIA H100" in small.describe()
    assert "sliding window (128 tokens) frees no KV here" in small.describe()
    for name, d in (("gpt-oss-20b", small), ("gpt-oss-120b", large)):
        with torch.device("meta"):
            cfg = transformers.AutoConfig.from_pretrained(CHECKPOINTS / name)
            cfg.quantization_config = None  # built unquantised: the count, not the storage
            built = transformers.AutoModelForCausalLM.from_config(cfg)
        assert built.num_parameters() == d.model.param_count()
    # at the 32,768-token context a deployment takes by default, the 120B's 65 GB leave an 80 GB H100
    # too little KV for one sequence: refused, by name, with what would fit
    with pytest.raises(ValueError, match=r"gpt-oss-120b@h100: the weights take 65.2 GB .* one 32768-token sequence"
                                         r".*; 18 of its 36 layers attend through a 128-token window, their KV counted "
                                         r"whole here where vLLM v1 keeps only the window's: vLLM may serve this context$"):
        deployment("gpt-oss-120b@h100")
    assert deployment("gpt-oss-120b@h100:16384").max_model_len == 16384


def test_a_gpt_oss_config_that_cannot_be_served_as_written_is_refused_by_name(tmp_path):
    cfg = json.loads((CHECKPOINTS / "gpt-oss-20b" / "config.json").read_text())
    dense = json.loads((CHECKPOINTS / "Qwen3-8B" / "config.json").read_text())
    for name, fields, match in (
            ("nullalpha", {**cfg, "swiglu_alpha": None}, "swiglu_alpha must be a number > 0, got None"),
            ("nulllimit", {**cfg, "swiglu_limit": None}, "swiglu_limit must be a number > 0, got None"),
            ("dense", {**dense, "quantization_config": {"quant_method": "mxfp4"}},
             "quant_method 'mxfp4' quantises a mixture of experts' experts")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(fields))
        with pytest.raises(ValueError, match=match):
            deployment(f"{tmp_path / name}@h100")
