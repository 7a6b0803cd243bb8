"""A local checkpoint on a named GPU is a deployment (``CHECKPOINT_DIR@GPU``): sized from its
``config.json`` alone as vLLM sizes it, so that a policy can be judged on a user's own model."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine.roofline import GB, deployment
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


def test_quantised_weights_leave_the_kv_more_room(tmp_path):
    bf16 = deployment(f"{checkpoint(tmp_path, 'bf16', QWEN25_7B)}@a10")
    awq = deployment(f"{checkpoint(tmp_path, 'awq', {**QWEN25_7B, 'quantization_config': {'quant_method': 'awq', 'bits': 4, 'group_size': 128}})}@a10")
    fp8 = deployment(f"{checkpoint(tmp_path, 'fp8', {**QWEN25_7B, 'quantization_config': {'quant_method': 'fp8'}})}@a10")
    assert (awq.model.weight_bits, fp8.model.weight_bits, bf16.model.weight_bits) == (4, 8, None)
    assert awq.num_blocks() > fp8.num_blocks() > bf16.num_blocks() > 0


@pytest.mark.parametrize("config, gpu, match", [
    (QWEN25_7B, "b200", "GPU 'b200' is not one of h100, h200, a10, l40s"),
    ({**QWEN25_7B, "num_hidden_layers": 80, "hidden_size": 8192, "num_attention_heads": 64}, "a10",
     "cannot hold one 32768-token sequence"),  # a 72B-sized model on a 24 GB GPU
    ({**QWEN25_7B, "quantization_config": {"quant_method": "hqq"}}, "h100", "quant_method 'hqq' and no 'bits'"),
    ({**QWEN25_7B, "model_type": "gemma"}, "h100", "model_type 'gemma' is not one of"),
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
])
def test_a_checkpoint_deployment_that_cannot_be_served_is_refused_by_name(tmp_path, config, gpu, match):
    name = f"{checkpoint(tmp_path, 'ck', config)}@{gpu}"
    with pytest.raises(ValueError, match=match) as err:
        deployment(name)
    assert name in str(err.value)  # the deployment the message is about


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
