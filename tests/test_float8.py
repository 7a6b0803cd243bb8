"""FP8 checkpoints: ``quant_method: fp8`` with a scale a block (Qwen3's and DeepSeek-V3's as published),
compressed-tensors' 8-bit floats with a scale a row or a tensor, ModelOpt's FP8. Each 8-bit weight is
multiplied by its scales at load; the engine then generates what transformers generates from the same
directory (which dequantises it the same way on a machine without FP8 kernels), and its weights are each
8-bit value times the scale of the block, row or tensor it lies in, the blocks cut short at the edges."""
from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import assert_generates_as, hf_greedy, hf_tiny
from engine.checkpoint import CheckpointError, float8_weight, load_checkpoint
from test_gpt_oss import generate
from test_moe import hf_moe, prompts

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")  # transformers' FP8 loader needs it

FP8_MAX = 448.0  # E4M3's largest magnitude


def quantised(state: dict[str, torch.Tensor], block: tuple[int, int]) -> tuple[dict, dict]:
    """``state`` with each projection's matrix (``*proj.weight``, Mixtral's and MiniMax-M2's experts' ``w1``,
    ``w2``, ``w3``; the router, embeddings, norms and lm_head
    as they are) in E4M3 beside a float32 scale a block of ``block`` rows and columns (the last ones cut
    short), the block's largest magnitude over 448, as a quantiser writes them; and each such matrix as
    the 8-bit values times their scales, block by block, in float32: what the loader must give back."""
    out, expected = {}, {}
    for key, w in state.items():
        if not key.endswith(("proj.weight", ".w1.weight", ".w2.weight", ".w3.weight", ".experts.gate_up_proj",
                             ".experts.down_proj")):
            out[key] = w
            continue
        parts = [_quantised(m, block) for m in (w if w.dim() == 3 else [w])]  # stacked experts: each its own
        q, scales, back = (torch.stack(x) if w.dim() == 3 else x[0] for x in zip(*parts))
        out[key], out[key + "_scale_inv"], expected[key] = q, scales, back
    return out, expected


def _quantised(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    rows, cols = w.shape
    grid = (math.ceil(rows / block[0]), math.ceil(cols / block[1]))
    q, scales, back = torch.empty(rows, cols, dtype=torch.float8_e4m3fn), torch.empty(grid), torch.empty(rows, cols)
    for i in range(grid[0]):
        for j in range(grid[1]):
            at = (slice(i * block[0], (i + 1) * block[0]), slice(j * block[1], (j + 1) * block[1]))
            scales[i, j] = w[at].float().abs().max().clamp(min=1e-12) / FP8_MAX
            q[at] = (w[at].float() / scales[i, j]).to(torch.float8_e4m3fn)
            back[at] = q[at].float() * scales[i, j]
    return q, scales, back


def save_fp8(directory, block: tuple[int, int], quantization: dict) -> dict[str, torch.Tensor]:
    """Quantise the checkpoint in ``directory`` (``quantised``), declare ``quantization`` in config.json, and
    return each quantised matrix as the loader must give it back."""
    state, expected = quantised(load_file(str(directory / "model.safetensors")), block)
    save_file(state, str(directory / "model.safetensors"))
    cfg = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**cfg, "quantization_config": quantization}))
    return expected


def fp8_block(block: tuple[int, int]) -> dict:
    return {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3", "weight_block_size": list(block),
            "modules_to_not_convert": ["lm_head", "mlp.gate"]}


@pytest.mark.parametrize("name, dtype", [("Qwen3", "float32"), ("Qwen3", "bfloat16"), ("qwen3_moe", "float32")])
def test_an_fp8_checkpoint_generates_what_transformers_generates(tmp_path, name, dtype):
    # blocks of 8 x 8 (the published ones are 128 x 128, wider than this model): transformers' dequantising
    # loader takes only blocks that divide the matrices; the MoE's experts stored one tensor an expert, as published
    if name == "Qwen3":
        hf = hf_tiny("Qwen3", head_dim=8, initializer_range=0.1).to(getattr(torch, dtype))
    else:
        hf = hf_moe(name)
    hf.save_pretrained(tmp_path)
    expected = save_fp8(tmp_path, (8, 8), fp8_block((8, 8)))
    fp8 = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=getattr(torch, dtype)).eval()
    model = load_checkpoint(tmp_path)
    assert model.config.dtype == dtype
    if name == "Qwen3":  # the weights, to the bit
        held = model.state_dict()
        assert all(torch.equal(held[k], t.to(held[k].dtype)) for k, t in expected.items())
        assert all(torch.equal(held[k], t) for k, t in fp8.state_dict().items())
    ps = prompts([13, 30, 21])
    outputs = generate(model, ps)
    assert len({t for o in outputs for t in o}) > 8
    assert_generates_as(fp8, ps, outputs, exact=dtype == "float32")
    if dtype == "float32":  # the 8-bit rounding shows in the tokens: the unquantised model generates others
        assert outputs != [hf_greedy(hf, p, 12) for p in ps]


@pytest.fixture
def llama(tmp_path):
    """A tiny Llama (48 wide, 96 in its MLP, K and V 16 rows) saved by transformers."""
    hf_tiny("Llama", num_key_value_heads=2).save_pretrained(tmp_path)
    return tmp_path


def _restored(directory, scale_as, quantization=None, modelopt=None) -> None:
    """The checkpoint in ``directory`` with each quantised matrix's scales reshaped by ``scale_as`` and renamed
    ``weight_scale``; ``quantization`` in config.json, or ``modelopt`` in hf_quant_config.json beside it."""
    state = load_file(str(directory / "model.safetensors"))
    state = {k.removesuffix("_inv") if k.endswith("_scale_inv") else k: scale_as(t) if k.endswith("_scale_inv") else t
             for k, t in state.items()}
    save_file(state, str(directory / "model.safetensors"))
    cfg = json.loads((directory / "config.json").read_text())
    cfg.pop("quantization_config")
    if quantization is not None:
        cfg["quantization_config"] = quantization
    (directory / "config.json").write_text(json.dumps(cfg))
    if modelopt is not None:
        (directory / "hf_quant_config.json").write_text(json.dumps(modelopt))


def compressed(strategy: str, **extra) -> dict:
    weights = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": strategy, **extra}
    return {"quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                          "input_activations": {"num_bits": 8, "type": "float", "dynamic": True}}}}


@pytest.mark.parametrize("layout", ["blocks cut short", "a row (compressed-tensors)", "a tensor (compressed-tensors)",
                                    "a tensor (ModelOpt)", "a row (ModelOpt, in config.json)",
                                    "blocks (compressed-tensors)"])
def test_fp8_weights_are_their_values_times_the_scale_of_their_block_row_or_tensor(llama, layout):
    # 5 x 7 blocks divide none of the matrices (48, 96 and 16 rows; 48 and 96 columns): the last ones are cut
    # short, as vLLM reads them; a static activation scale and a quantised KV cache's scales are left out
    block = {"blocks cut short": (5, 7), "blocks (compressed-tensors)": (16, 32)}.get(
        layout, (10**6, 10**6) if "a tensor" in layout else (1, 10**6))
    expected = save_fp8(llama, block, fp8_block(block))
    if layout == "a row (compressed-tensors)":
        _restored(llama, lambda s: s.reshape(-1, 1), compressed("channel"))
    elif layout == "a tensor (compressed-tensors)":
        _restored(llama, lambda s: s.reshape(1), compressed("tensor"))
    elif layout == "blocks (compressed-tensors)":
        _restored(llama, lambda s: s, compressed("block", block_structure=list(block)))
    elif layout == "a row (ModelOpt, in config.json)":
        _restored(llama, lambda s: s.reshape(-1), {"quant_method": "modelopt", "quant_algo": "FP8_PER_CHANNEL_PER_TOKEN"})
    elif layout == "a tensor (ModelOpt)":
        _restored(llama, lambda s: s.reshape(()), modelopt={"producer": {"name": "modelopt"},
                                                            "quantization": {"quant_algo": "FP8", "kv_cache_quant_algo": "FP8"}})
    state = load_file(str(llama / "model.safetensors"))
    extra = {"model.layers.0.self_attn.q_proj.input_scale": torch.tensor(0.5),
             "model.layers.0.self_attn.k_scale": torch.tensor(1.0), "model.layers.0.self_attn.v_scale": torch.tensor(1.0)}
    save_file({**state, **extra}, str(llama / "model.safetensors"))
    held = load_checkpoint(llama).state_dict()
    assert len(expected) == 7 * 3  # every projection of the 3 layers was quantised
    for key, t in expected.items():
        assert torch.equal(held[key], t), key


def test_fp8_scales_may_be_floats_or_powers_of_two_stored_as_bytes():
    # E8M0 (MXFP8's): 2 ** (byte - 127), as transformers reads a byte scale, or torch's float8_e8m0fnu
    torch.manual_seed(0)
    w = torch.randn(8, 6).to(torch.float8_e4m3fn)
    exponents = torch.randint(120, 135, (8, 2), dtype=torch.uint8)
    powers = torch.tensor(2.0) ** (exponents.float() - 127)
    assert torch.equal(float8_weight(w, exponents, (1, 3)), w.float() * powers.repeat_interleave(3, dim=1))
    assert torch.equal(float8_weight(w, powers.to(torch.float8_e8m0fnu), (1, 3)), w.float() * powers.repeat_interleave(3, 1))
    half = torch.rand(8, 1).to(torch.bfloat16)
    assert torch.equal(float8_weight(w, half, None), w.float() * half.float())
    with pytest.raises(ValueError, match="scales of dtype torch.int32 are neither floats nor powers of two"):
        float8_weight(w, exponents.to(torch.int32), (1, 3))


def test_llama4s_stacked_experts_in_fp8_are_their_values_times_their_scales(tmp_path):
    # experts stacked in one tensor a layer, as Llama 4 stores them, beside a scale a block of each expert
    # (NAME_scale_inv, as transformers names a stacked tensor's), then transposed as the model holds them
    from test_llama4 import hf_llama4

    hf_llama4().save_pretrained(tmp_path)
    expected = save_fp8(tmp_path, (8, 8), fp8_block((8, 8)))
    assert expected["model.layers.1.feed_forward.experts.gate_up_proj"].shape == (4, 48, 64)
    held = load_checkpoint(tmp_path).state_dict()
    for layer in (1, 3):
        for name in ("gate_up_proj", "down_proj"):
            stored = expected[f"model.layers.{layer}.feed_forward.experts.{name}"]
            assert torch.equal(held[f"model.layers.{layer}.mlp.experts.{name}"], stored.transpose(1, 2))
    assert torch.equal(held["model.layers.1.mlp.shared_expert.gate_proj.weight"],
                       expected["model.layers.1.feed_forward.shared_expert.gate_proj.weight"])


def test_a_broken_fp8_checkpoint_is_refused_by_name(llama):
    expected = save_fp8(llama, (16, 16), fp8_block((16, 16)))
    good = load_file(str(llama / "model.safetensors"))
    q = "model.layers.0.self_attn.q_proj.weight"
    cases = [
        ({k: t for k, t in good.items() if k != q + "_scale_inv"},
         rf"tensor '{q}' is torch.float8_e4m3fn with no scale beside it \(weight_scale or weight_scale_inv\)"),
        ({**good, q + "_scale": good[q + "_scale_inv"].clone()}, rf"tensor '{q}' is torch.float8_e4m3fn with two scales"),
        ({**good, q: expected[q]}, rf"tensor '{q}_scale_inv' scales '{q}', which is torch.float32"),
        ({**good, q + "_scale_inv": torch.ones(2, 2)},
         rf"tensor '{q}_scale_inv': scales of shape \(2, 2\) are neither one a tensor nor one a row of its \(48, 48\), "
         r"nor one a block of 16 x 16"),
    ]
    for state, match in cases:
        save_file(state, str(llama / "model.safetensors"))
        with pytest.raises(CheckpointError, match=match):
            load_checkpoint(llama)
    save_file(good, str(llama / "model.safetensors"))
    cfg = json.loads((llama / "config.json").read_text())
    for block in ([16], [16, 0], [16.0, 16], "16"):
        (llama / "config.json").write_text(json.dumps({**cfg, "quantization_config": fp8_block(block)}))
        with pytest.raises(CheckpointError, match="weight_block_size must be two whole numbers >= 1"):
            load_checkpoint(llama)
    groups = compressed("block", block_structure=[16, 16])
    groups["config_groups"]["group_1"] = {**groups["config_groups"]["group_0"],
                                          "weights": {**groups["config_groups"]["group_0"]["weights"],
                                                      "block_structure": [32, 32]}}
    (llama / "config.json").write_text(json.dumps({**cfg, "quantization_config": groups}))
    with pytest.raises(CheckpointError, match=r"blocks of different shapes \(\[\(16, 16\), \(32, 32\)\]\)"):
        load_checkpoint(llama)
