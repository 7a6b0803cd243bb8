"""The KV cache in 8-bit floats (``ModelConfig.kv_cache_dtype``, vLLM's ``--kv-cache-dtype fp8``): each K and V
value is stored in E4M3 (or E5M2), saturated at the format's largest, and read back to attend, so that the engine
generates what transformers generates with its keys (after RoPE) and values rounded so; a block takes half the
bytes of a 16-bit one, a deployment holds twice the tokens, and the blocks move between device and host, and are
compacted, byte for byte."""
from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from conftest import hf_greedy, hf_tiny
from engine.checkpoint import load_checkpoint
from engine.config import KV_CACHE_DTYPES, EngineConfig, ModelConfig
from engine.device import Device
from engine.engine import Engine
from engine.kv_pool import KVPool
from engine.request import Request
from engine.roofline import deployment
from test_moe import prompts

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()


def generate(model, kv_cache_dtype: str, ps: list[list[int]], new_tokens: int = 12) -> list[list[int]]:
    """``model``'s tokens with its KV held in ``kv_cache_dtype`` (blocks of 4, chunks of 24: prompts in chunks)."""
    eng = Engine(replace(model.config, kv_cache_dtype=kv_cache_dtype),
                 EngineConfig(num_blocks=64, block_size=4, max_model_len=512, max_num_batched_tokens=24),
                 model=model, keep_outputs=True)
    for i, p in enumerate(ps):
        eng.submit(Request(f"c{i}", 0.0, len(p), new_tokens, new_tokens, prompt_ids=tuple(p)))
    eng.run()
    return [eng.outputs[f"c{i}"] for i in range(len(ps))]


def rounded_kv_greedy(hf, kind: torch.dtype, ps: list[list[int]], monkeypatch) -> list[list[int]]:
    """transformers' greedy tokens with each key (after RoPE) and value rounded through ``kind``, saturated."""
    import transformers.models.llama.modeling_llama as llama

    limit = torch.finfo(kind).max

    def rounded(x: torch.Tensor) -> torch.Tensor:
        return x.clamp(-limit, limit).to(kind).to(x.dtype)

    rotate = llama.apply_rotary_pos_emb
    monkeypatch.setattr(llama, "apply_rotary_pos_emb",
                        lambda q, k, cos, sin, *a, **kw: (lambda qk: (qk[0], rounded(qk[1])))(rotate(q, k, cos, sin, *a, **kw)))
    hooks = [layer.self_attn.v_proj.register_forward_hook(lambda m, i, out: rounded(out)) for layer in hf.model.layers]
    try:
        return [hf_greedy(hf, p, 12) for p in ps]
    finally:
        for h in hooks:
            h.remove()


@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "fp8_e5m2"])
def test_an_fp8_kv_cache_generates_what_transformers_generates_with_its_kv_so_rounded(tmp_path, monkeypatch,
                                                                                      kv_cache_dtype):
    hf = hf_tiny("Llama", head_dim=8, initializer_range=0.2)
    hf.save_pretrained(tmp_path)
    model = load_checkpoint(tmp_path)
    ps = prompts([13, 30, 21])
    outputs = generate(model, kv_cache_dtype, ps)
    assert len({t for o in outputs for t in o}) > 8
    assert outputs == rounded_kv_greedy(hf, KV_CACHE_DTYPES[kv_cache_dtype], ps, monkeypatch)
    assert outputs != generate(model, "auto", ps)  # the rounding shows


def test_an_fp8_pool_saturates_and_moves_its_blocks_byte_for_byte():
    model = ModelConfig(kv_cache_dtype="fp8", dtype="bfloat16")
    pool = KVPool(model, block_size=4, num_blocks=8, segment_blocks=4, device=Device(1 << 30))
    assert pool.dtype == torch.float8_e4m3fn and pool.block_bytes == model.kv_bytes_per_token() * 4
    assert model.kv_bytes_per_token() == replace(model, kv_cache_dtype="auto").kv_bytes_per_token() // 2
    pool.ensure(7)
    g = torch.Generator().manual_seed(0)
    k = torch.randn(8, pool.num_kv_heads, pool.head_dim, generator=g, dtype=torch.bfloat16) * 100
    k[0, 0, 0], k[1, 0, 0] = 1000.0, -1e6  # past E4M3's largest (448): saturated, not NaN
    slots = pool.locate(torch.arange(8) + 12, rows_per_block=4)  # blocks 3 and 4: across the two segments
    pool.write_slots(0, slots, k, -k)
    back = pool.gather_blocks(0, pool.locate(torch.tensor([3, 4])), 2)
    assert back.dtype == torch.bfloat16
    stored = back[0].flatten(0, 1)
    assert stored[0, 0, 0] == 448 and stored[1, 0, 0] == -448 and torch.isfinite(stored).all()
    assert torch.equal(stored[2:], k[2:].to(torch.float8_e4m3fn).to(torch.bfloat16))
    assert torch.equal(back[1].flatten(0, 1), -stored)
    data = pool.read_blocks([3, 4])  # to the host and back into other blocks, byte for byte
    pool.write_blocks([6, 1], data)
    assert torch.equal(pool.gather_blocks(0, pool.locate(torch.tensor([6, 1])), 2), back)
    pool.copy_blocks([(6, 0), (1, 2)])  # compaction's moves
    assert torch.equal(pool.gather_blocks(0, pool.locate(torch.tensor([0, 2])), 2), back)


def test_a_deployment_with_an_fp8_kv_cache_holds_twice_the_tokens(tmp_path):
    base, fp8 = deployment("Qwen3-8B@h100"), deployment("Qwen3-8B@h100:fp8")
    assert fp8.model.kv_bytes_per_token() * 2 == base.model.kv_bytes_per_token()
    # twice the blocks in about the same bytes (a little more: the profiling pass's KV is smaller too)
    assert 2 * base.num_blocks() <= fp8.num_blocks() <= 2.01 * base.num_blocks()
    assert "GB in fp8)" in fp8.describe() and "in fp8" not in base.describe()
    both = deployment("Qwen3-8B@h100:fp8:16384")
    assert (both.max_model_len, both.model.kv_cache_dtype) == (16384, "fp8")
    assert deployment("Qwen3-8B@h100:16384:fp8_e5m2").model.kv_cache_dtype == "fp8_e5m2"
    for name, match in (("Qwen3-8B@h100:fp8:fp8_e5m2", "at most one context"),
                        ("Qwen3-8B@h100:fp9", "got 'fp9' \\(or a KV cache dtype, one of auto, fp8"),
                        ("DeepSeek-V2-Lite-Chat@h100:fp8", "kv_cache_dtype 'fp8' with latent attention is not supported")):
        with pytest.raises(ValueError, match=match):
            deployment(name)


def test_replay_holds_the_kv_in_fp8_and_says_so(tmp_path, capsys):
    from env.workloads import bundled_trace
    from rlctl.cli import main

    out = tmp_path / "run.json"
    assert main(["replay", "--trace", str(bundled_trace("azure2023_conv.csv")), "--time-scale", "40", "--duration", "5",
                 "--blocks", "64", "--max-tokens", "fixed:128", "--kv-cache-dtype", "fp8", "--json", str(out)]) == 0
    assert "64 KV blocks x 16 tokens in fp8" in capsys.readouterr().out
    figures = json.loads(out.read_text())
    assert figures["model"]["kv_cache_dtype"] == "fp8" and figures["requests_completed"] > 0


def test_an_fp8_kv_cache_applies_the_checkpoints_kv_scales(tmp_path, monkeypatch, capsys):
    # vLLM stores each layer's K and V over the scales a checkpoint gives (k_scale, v_scale, a projection's
    # output_scale, or one kv_scale for both; 1 where a layer has none) and reads them back times them; with the
    # KV in the model's dtype the scales are unused
    import transformers.models.llama.modeling_llama as llama
    from safetensors.torch import load_file, save_file

    hf = hf_tiny("Llama", head_dim=8, initializer_range=0.2)
    hf.save_pretrained(tmp_path)
    ps = prompts([13, 30, 21])
    plain = load_checkpoint(tmp_path)
    unscaled, auto = generate(plain, "fp8", ps), generate(plain, "auto", ps)
    state = load_file(str(tmp_path / "model.safetensors"))
    given = {"model.layers.0.self_attn.k_scale": 0.004, "model.layers.0.self_attn.v_scale": 0.05,
             "model.layers.1.self_attn.kv_scale": 0.03}  # layer 0's keys saturate at 448 x 0.004; layer 2 has none
    save_file({**state, **{k: torch.tensor(v) for k, v in given.items()}}, str(tmp_path / "model.safetensors"))
    # without a quantisation method that reads them vLLM skips the scales, and so does the engine
    assert load_checkpoint(tmp_path).kv_scales is None
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "quantization_config": {
        "quant_method": "modelopt", "kv_cache_quant_algo": "FP8"}}))  # ModelOpt's FP8 KV cache, the weights as they are
    model = load_checkpoint(tmp_path)
    # an engine built on it holds its KV in FP8 unless told otherwise, as vLLM does (rlctl replay --model-dir)
    from rlctl.replay import build_engine

    assert build_engine(EngineConfig(num_blocks=8), 1.0, "crash", str(tmp_path)).model_config.kv_cache_dtype == "fp8"
    assert build_engine(EngineConfig(num_blocks=8), 1.0, "crash", str(tmp_path),
                        kv_cache_dtype="auto").model_config.kv_cache_dtype == "auto"
    scales = [[0.004, 0.05], [0.03, 0.03], [1.0, 1.0]]
    assert torch.equal(model.kv_scales, torch.tensor(scales))
    outputs = generate(model, "fp8", ps)
    assert outputs != unscaled and generate(model, "auto", ps) == auto

    limit, layer = torch.finfo(torch.float8_e4m3fn).max, [0]

    def rounded(x: torch.Tensor, scale: float) -> torch.Tensor:
        return ((x.float() / scale).clamp(-limit, limit).to(torch.float8_e4m3fn).float() * scale).to(x.dtype)

    rotate = llama.apply_rotary_pos_emb
    monkeypatch.setattr(llama, "apply_rotary_pos_emb", lambda q, k, cos, sin, *a, **kw: (
        lambda qk: (qk[0], rounded(qk[1], scales[layer[0]][0])))(rotate(q, k, cos, sin, *a, **kw)))
    for i, block in enumerate(hf.model.layers):
        block.self_attn.register_forward_pre_hook(lambda m, args, i=i: layer.__setitem__(0, i))
        block.self_attn.v_proj.register_forward_hook(lambda m, args, out, i=i: rounded(out, scales[i][1]))
    assert outputs == [hf_greedy(hf, p, 12) for p in ps]
    # a scale that is no scale is refused by name
    save_file({**state, "model.layers.0.self_attn.k_scale": torch.tensor([0.1, 0.2])}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="'model.layers.0.self_attn.k_scale' must be one scale > 0"):
        load_checkpoint(tmp_path)


def test_replay_node_refuses_a_kv_cache_dtype(tmp_path, capsys):
    # a node's engines take their KV dtype from their deployments
    from rlctl.cli import main

    assert main(["replay", "--node", "node_chat_pair", "--controller", f"unix://{tmp_path}/none.sock",
                 "--kv-cache-dtype", "fp8"]) == 2
    assert "--kv-cache-dtype applies to one engine's replay" in capsys.readouterr().err
