"""Bad input gets a clear error that names what is wrong, and harms nothing already accepted."""
from __future__ import annotations

import json
import math

import pytest
import torch

from engine.checkpoint import CheckpointError, load_checkpoint
from engine.config import RopeScaling
from engine.request import RequestError
from engine.request import Request
from rlctl.cli import main


@pytest.fixture
def busy_engine(make_engine):
    """An engine part-way through serving two accepted requests."""
    eng = make_engine(num_blocks=64, max_model_len=256)
    eng.submit(Request("ok-1", 0.0, 40, 8, 8))
    eng.submit(Request("ok-2", 0.0, 12, 6, 6))
    eng.step()
    return eng


@pytest.mark.parametrize("bad, message", [
    (Request("long", 0.0, 256, 4, 4), "does not fit the context of 256"),
    (Request("empty", 0.0, 0, 4, 4, prompt_ids=()), "prompt is empty"),
    (Request("vocab", 0.0, 3, 4, 4, prompt_ids=(1, 512, 2)), "token id 512 is outside the vocabulary"),
    (Request("neg", 0.0, 3, 4, 4, prompt_ids=(1, -1, 2)), "token id -1 is outside the vocabulary"),
    (Request("zero", 0.0, 5, 4, 0), "max_tokens must be > 0"),
    (Request("minus", 0.0, 5, 4, -3), "max_tokens must be > 0"),
    (Request("ids", 0.0, 5, 4, 4, prompt_ids=(1, 2)), "2 prompt ids but prompt_len 5"),
    (Request("ok-1", 0.0, 5, 4, 4), "already in use"),
    # a length or token id of the wrong type was accepted and stopped the engine's loop for every request
    # (2.5 output tokens), or failed half-way through submit, leaving a record the engine never finished
    (Request("half", 0.0, 5, 2.5, 4), "output_len must be a whole number of tokens, got 2.5"),
    (Request("float", 0.0, 12.0, 6, 6), "prompt_len must be a whole number of tokens, got 12.0"),
    (Request("nan", 0.0, 12, 6, float("nan")), "max_tokens must be a whole number of tokens, got nan"),
    (Request("text", 0.0, 3, 4, 4, prompt_ids=("1", "2", "x")), "token id '1' is not a whole number"),
    (Request("frac", 0.0, 3, 4, 4, prompt_ids=(1.7, 2, 3)), "token id 1.7 is not a whole number"),
    (Request(7, 0.0, 3, 4, 4), "request_id must be a non-empty string"),
])
def test_a_bad_request_is_refused_by_name_and_the_rest_are_served(busy_engine, bad, message):
    eng = busy_engine
    before = (len(eng.records), eng.kv.blocks.num_used, list(eng.scheduler.waiting), list(eng.scheduler.running))
    with pytest.raises(RequestError, match=message) as err:
        eng.submit(bad)
    assert repr(bad.request_id) in str(err.value)
    assert (len(eng.records), eng.kv.blocks.num_used, list(eng.scheduler.waiting), list(eng.scheduler.running)) == before
    eng.submit(Request("after", eng.clock, 10, 5, 5))  # the engine still takes good requests
    eng.run()
    assert [eng.records[r].output_len for r in ("ok-1", "ok-2", "after")] == [8, 6, 5]


def test_a_malformed_trace_line_is_named_by_file_and_line(tmp_path, capsys):
    trace = tmp_path / "azure.csv"
    trace.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n"
                     "2023-11-16 18:15:46.6805900,374,44\n"
                     "2023-11-16 18:15:50.9951690,three,109\n")
    assert main(["replay", "--trace", str(trace)]) == 2
    err = capsys.readouterr().err
    assert f"{trace}:3:" in err and "three" in err


def test_a_missing_trace_file_is_a_clear_error(tmp_path, capsys):
    assert main(["replay", "--trace", str(tmp_path / "nope.csv")]) == 2
    assert "nope.csv" in capsys.readouterr().err


@pytest.fixture
def checkpoint(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128)
    LlamaForCausalLM(cfg).save_pretrained(tmp_path / "ck")
    return tmp_path / "ck"


def test_a_checkpoint_without_config_is_refused(checkpoint):
    (checkpoint / "config.json").unlink()
    with pytest.raises(CheckpointError, match="config.json: missing"):
        load_checkpoint(checkpoint)


def test_a_checkpoint_without_weights_is_refused(checkpoint):
    for f in checkpoint.glob("*.safetensors"):
        f.unlink()
    with pytest.raises(CheckpointError, match=r"no \*\.safetensors"):
        load_checkpoint(checkpoint)


def test_a_checkpoint_missing_a_tensor_is_refused_by_tensor_name(checkpoint):
    from safetensors.torch import load_file, save_file

    weights = checkpoint / "model.safetensors"
    state = load_file(str(weights))
    del state["model.layers.0.mlp.up_proj.weight"]
    save_file(state, str(weights))
    with pytest.raises(CheckpointError, match="model.layers.0.mlp.up_proj.weight"):
        load_checkpoint(checkpoint)


def test_a_checkpoint_with_a_tensor_the_model_has_no_place_for_is_refused_by_name(checkpoint):
    # loaded, the model would run without it (a bias config.json does not declare, a layer past its count):
    # refused, as vLLM's loaders refuse a layer past the count (they skip an undeclared bias, which GPTQ
    # exports carry, and transformers warns and runs without it); RoPE's tables older transformers saved, and
    # the multi-token-prediction layers config.json declares after the decoder's, skipped as vLLM skips them
    from safetensors.torch import load_file, save_file

    weights = checkpoint / "model.safetensors"
    state = load_file(str(weights))
    expected = load_checkpoint(checkpoint).state_dict()
    def extra():
        return torch.ones(16)

    for key in ("model.layers.0.self_attn.q_proj.bias", "model.layers.1.mlp.up_proj.weight", "visual.blocks.0.w",
                "model.layers.x.mlp.up_proj.weight"):
        save_file({**state, key: extra(), "model.layers.0.self_attn.v_proj.bias": extra()}, str(weights))
        first = min(key, "model.layers.0.self_attn.v_proj.bias")
        with pytest.raises(CheckpointError, match=rf"tensor '{first}' has no place in the model config.json "
                                                  rf"describes \(2 such in all\)"):
            load_checkpoint(checkpoint)
    mtp = {"model.layers.1.eh_proj.weight": extra(), "model.layers.1.mlp.up_proj.weight": extra()}
    save_file({**state, "model.layers.0.self_attn.rotary_emb.inv_freq": extra(), **mtp}, str(weights))
    with pytest.raises(CheckpointError, match="tensor 'model.layers.1.eh_proj.weight' has no place"):
        load_checkpoint(checkpoint)  # layer 1 is past the decoder's one, and config.json declares no MTP layer
    cfg = json.loads((checkpoint / "config.json").read_text())
    (checkpoint / "config.json").write_text(json.dumps({**cfg, "num_nextn_predict_layers": 1}))
    assert all(torch.equal(t, expected[k]) for k, t in load_checkpoint(checkpoint).state_dict().items())
    save_file({**state, "model.layers.2.eh_proj.weight": extra()}, str(weights))
    with pytest.raises(CheckpointError, match="tensor 'model.layers.2.eh_proj.weight' has no place"):
        load_checkpoint(checkpoint)  # one MTP layer declared, the second is not
    (checkpoint / "config.json").write_text(json.dumps({**cfg, "num_nextn_predict_layers": "1"}))
    with pytest.raises(CheckpointError, match="config.json: num_nextn_predict_layers must be a whole number, got '1'"):
        load_checkpoint(checkpoint)


def test_a_tied_checkpoint_that_stores_an_lm_head_too_reads_its_embeddings(checkpoint):
    # vLLM skips the lm_head a tied checkpoint stores and transformers ties it to the embeddings again:
    # read last into the shared tensor, it overwrote the embeddings
    from safetensors.torch import load_file

    state = load_file(str(checkpoint / "model.safetensors"))
    assert not torch.equal(state["lm_head.weight"], state["model.embed_tokens.weight"])
    cfg = json.loads((checkpoint / "config.json").read_text())
    (checkpoint / "config.json").write_text(json.dumps({**cfg, "tie_word_embeddings": True}))
    model = load_checkpoint(checkpoint)
    assert torch.equal(model.model.embed_tokens.weight, state["model.embed_tokens.weight"])
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_a_checkpoint_whose_config_disagrees_with_its_tensors_is_refused(checkpoint):
    cfg = json.loads((checkpoint / "config.json").read_text())
    cfg["intermediate_size"] = 48
    (checkpoint / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="has shape"):
        load_checkpoint(checkpoint)


def test_a_checkpoint_reads_the_files_that_hold_its_model_and_no_others(checkpoint):
    # Mistral's repositories ship consolidated.safetensors (its own names) beside Hugging Face's shards:
    # not read, as vLLM and transformers do not read it; an index names the files to read
    import shutil

    expected = load_checkpoint(checkpoint).state_dict()
    (checkpoint / "consolidated.safetensors").write_bytes(b"not read")  # read, it would fail
    assert all(torch.equal(t, expected[k]) for k, t in load_checkpoint(checkpoint).state_dict().items())
    (checkpoint / "consolidated.safetensors").unlink()
    (checkpoint / "extra.safetensors").write_bytes(b"not listed")
    index = {"metadata": {}, "weight_map": {k: "model.safetensors" for k in expected}}
    (checkpoint / "model.safetensors.index.json").write_text(json.dumps(index))
    assert all(torch.equal(t, expected[k]) for k, t in load_checkpoint(checkpoint).state_dict().items())
    index["weight_map"]["lm_head.weight"] = "model-00002-of-00002.safetensors"
    (checkpoint / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="lists model-00002-of-00002.safetensors, which is missing"):
        load_checkpoint(checkpoint)
    for broken, match in (([], "cannot be read as a weight map"), ({"weight_map": {"x": 3}}, "weight_map must map each tensor to")):
        (checkpoint / "model.safetensors.index.json").write_text(json.dumps(broken))
        with pytest.raises(CheckpointError, match=f"model.safetensors.index.json: {match}"):
            load_checkpoint(checkpoint)
    for f in ("model.safetensors.index.json", "extra.safetensors"):
        (checkpoint / f).unlink()
    shutil.move(checkpoint / "model.safetensors", checkpoint / "consolidated.safetensors")
    with pytest.raises(CheckpointError, match="only Mistral's own format"):
        load_checkpoint(checkpoint)


def test_a_checkpoint_with_quantised_weights_is_sized_not_run(checkpoint):
    # GPTQ's packed integers, or compressed-tensors' 8-bit integers, run as they are stored, would generate
    # garbage: refused by its quantization_config. A float8 tensor where the configuration declares no FP8
    # (whose scales the loader would not know to read) is refused too (FP8 checkpoints run: test_float8.py)
    from safetensors.torch import load_file, save_file

    cfg = json.loads((checkpoint / "config.json").read_text())
    advice = (r"this engine runs 16-bit weights and FP8 ones \(it sizes another quantised checkpoint as a deployment, "
              r"CHECKPOINT_DIR@GPU\)")
    int8 = {"quant_method": "compressed-tensors", "config_groups": {"g": {"weights": {"num_bits": 8, "type": "int"}}}}
    for q, bits in (({"quant_method": "gptq", "bits": 4}, 4), (int8, 8)):
        (checkpoint / "config.json").write_text(json.dumps({**cfg, "quantization_config": q}))
        with pytest.raises(CheckpointError, match=rf"quantised to {bits} bits \(config.json's quantization_config\); " + advice):
            load_checkpoint(checkpoint)
    (checkpoint / "config.json").write_text(json.dumps({**cfg, "quantization_config": {"quant_method": "torchao"}}))
    with pytest.raises(CheckpointError, match="quant_method 'torchao' and no 'bits' is not supported; " + advice):
        load_checkpoint(checkpoint)
    # bitsandbytes with neither flag quantises nothing: run
    (checkpoint / "config.json").write_text(json.dumps({**cfg, "quantization_config": {"quant_method": "bitsandbytes"}}))
    assert load_checkpoint(checkpoint)
    (checkpoint / "config.json").write_text(json.dumps(cfg))
    state = load_file(str(checkpoint / "model.safetensors"))
    key = "model.layers.0.self_attn.q_proj.weight"
    for dtype in (torch.float8_e4m3fn, torch.float8_e5m2fnuz):
        save_file({**state, key: state[key].to(dtype)}, str(checkpoint / "model.safetensors"))
        with pytest.raises(CheckpointError, match=f"model.safetensors: tensor '{key}' is {dtype} \\(quantised\\); " + advice):
            load_checkpoint(checkpoint)


def _edit_config(checkpoint, **fields):
    cfg = json.loads((checkpoint / "config.json").read_text())
    cfg.pop("rope_parameters", None)
    cfg.update(fields)
    (checkpoint / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize("rope, match", [
    ({"rope_type": "longrope", "factor": 4.0}, "rope type 'longrope' needs 'original_max_position_embeddings'"),
    ({"rope_type": "longrope", "original_max_position_embeddings": 64}, "rope type 'longrope' needs 'short_factor'"),
    ({"rope_type": "longrope", "short_factor": [1.0, "2"], "long_factor": [1.0, 2.0],
      "original_max_position_embeddings": 64}, "rope parameters' short_factor must be a list of numbers"),
    ({"rope_type": "longrope", "short_factor": [1.0, 0.0], "long_factor": [1.0, 2.0],
      "original_max_position_embeddings": 64}, "longrope needs short_factor and long_factor, as many numbers > 0 each"),
    ({"rope_type": "longrope", "short_factor": [1.0] * 3, "long_factor": [2.0] * 3,
      "original_max_position_embeddings": 64}, "longrope needs a factor for each of the 4 frequencies RoPE turns by, got 3"),
    ({"rope_type": "yarn"}, "rope type 'yarn' needs 'factor'"),
    ({"rope_type": "yarn", "factor": 4.0, "beta_fast": -1.0}, "beta_fast must be a number > 0, got -1.0"),
    ({"rope_type": "yarn", "factor": 4.0, "truncate": "no"}, "truncate must be true or false, got 'no'"),
    ({"rope_type": "yarn", "factor": True}, "rope parameters' factor must be a number, got True"),
    ({"rope_type": "yarn", "factor": "4"}, "rope parameters' factor must be a number, got '4'"),
    ({"rope_type": "yarn", "factor": 4.0, "mscale": "x", "mscale_all_dim": 1.0}, "rope parameters' mscale must be a number"),
    ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": None},
     "original_max_position_embeddings must be a whole number, got None"),
    ({"type": "dynamic", "factor": 2.0}, "rope type 'dynamic' is not supported"),
    ({"rope_type": "llama3", "factor": 8.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
     "rope type 'llama3' needs 'low_freq_factor'"),
    ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 1.0,
      "original_max_position_embeddings": 64}, "low_freq_factor <= high_freq_factor"),
    ({"rope_type": "linear", "factor": 0}, "factor must be > 0"),
])
def test_a_checkpoint_with_a_rope_scaling_it_cannot_apply_is_refused_by_name(checkpoint, rope, match):
    _edit_config(checkpoint, rope_scaling=rope, rope_theta=10000.0)
    with pytest.raises(CheckpointError, match=match):
        load_checkpoint(checkpoint)


def test_a_checkpoint_in_the_older_config_layout_loads_its_rope_scaling(checkpoint):
    # transformers 4 wrote rope_theta beside rope_scaling, as Llama 3.1's and 3.2's config.json have it
    _edit_config(checkpoint, rope_theta=500000.0, rope_scaling={
        "rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64})
    model = load_checkpoint(checkpoint)
    assert model.config.rope_theta == 500000.0
    assert model.config.rope_scaling == RopeScaling("llama3", 32.0, 1.0, 4.0, 64)


@pytest.mark.parametrize("rope, scaling", [
    # Qwen's long-context block, in transformers 4's layout ("type"), its ends rounded out
    ({"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
     RopeScaling("yarn", 4.0, original_max_position=64)),
    # config.json's own original context first (Phi-3's layout), as transformers reads it; a null
    # truncate is false there
    ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "truncate": None, "top": 32},
     RopeScaling("yarn", 4.0, original_max_position=32, truncate=False)),
    # DeepSeek's: the factor from the two contexts, the attention factor from mscale's ratio, as transformers
    ({"rope_type": "yarn", "factor": None, "original_max_position_embeddings": 32, "mscale": 1.0, "mscale_all_dim": 0.5,
      "beta_fast": None, "truncate": False},
     RopeScaling("yarn", 4.0, original_max_position=32, truncate=False,
                 attention_factor=(0.1 * math.log(4) + 1) / (0.05 * math.log(4) + 1))),
])
def test_a_yarn_checkpoint_loads_its_scaling_as_transformers_reads_it(checkpoint, rope, scaling):
    top = {"original_max_position_embeddings": rope.pop("top")} if "top" in rope else {}
    _edit_config(checkpoint, rope_theta=10000.0, rope_scaling=rope, max_position_embeddings=128, **top)
    model = load_checkpoint(checkpoint)
    assert model.config.rope_scaling == scaling
    assert model.rotary.cos_scale == pytest.approx(scaling.cos_scale)


@pytest.mark.parametrize("fields, match", [
    ({"model_type": "hunyuan_v1_moe", "architectures": ["HunYuanMoEV1ForCausalLM"]},
     r"model_type 'hunyuan_v1_moe' is not one of llama, mistral, qwen2, qwen3, phi3, gemma.*, nor is its architectures "
     r"\['HunYuanMoEV1ForCausalLM'\] one of LlamaForCausalLM, MistralForCausalLM"),
    ({"model_type": "qwen3_next", "architectures": ["Qwen3NextForCausalLM"]},
     r"model_type 'qwen3_next' is not supported: its linear-attention or state-space layers"),
    ({"model_type": "my_llama", "architectures": "LlamaForCausalLM"}, "model_type 'my_llama' is not one of"),
    ({"model_type": "gemma3_text", "attn_logit_softcapping": 50.0}, "attn_logit_softcapping 50.0 is not supported"),
    ({"model_type": "gemma3_text", "rope_parameters": {"full_attention": {"rope_type": "default"},
                                                       "sliding_attention": {"rope_type": "linear", "factor": 2.0}}},
     "a scaled RoPE on the windowed layers is not supported"),
    ({"model_type": "gemma3", "text_config": "small"}, "text_config and vision_config must be objects"),
    ({"model_type": "gemma2", "hidden_activation": "silu"}, "hidden_activation 'silu' is not supported"),
    ({"model_type": "gemma", "hidden_act": "relu"}, "hidden_act 'relu' is not supported"),
    ({"model_type": "gemma2", "use_bidirectional_attention": True}, "use_bidirectional_attention is not supported"),
    ({"model_type": "gemma2", "attn_logit_softcapping": -1}, "attn_logit_softcapping must be a number > 0 or null"),
    ({"model_type": "gemma2"}, r"tensor 'model.layers.0.post_feedforward_layernorm.weight' is missing \(2 missing"),
    ({"model_type": "llama", "partial_rotary_factor": 0.75}, "partial_rotary_factor 0.75 is not supported for llama"),
    ({"model_type": "qwen3"}, r"tensor 'model.layers.0.self_attn.k_norm.weight' is missing \(2 missing"),  # Llama's weights
    ({"model_type": "mistral", "sliding_window": 64.5}, "sliding_window must be a whole number of tokens >= 2, got 64.5"),
    ({"model_type": "qwen2", "use_sliding_window": True, "sliding_window": "64", "max_window_layers": 0},
     "sliding_window must be a whole number of tokens >= 2, got '64'"),
    ({"model_type": "llama", "mlp_bias": True}, "MLP biases are not supported"),
    ({"model_type": "llama", "head_dim": 4}, r"q_proj.weight' has shape \(16, 16\), config.json implies \(8, 16\)"),
    ({"model_type": "qwen2"}, r"tensor 'model.layers.0.self_attn.k_proj.bias' is missing \(3 missing"),  # Llama's weights
])
def test_a_checkpoint_of_another_architecture_is_refused_by_name(checkpoint, fields, match):
    _edit_config(checkpoint, **fields)
    with pytest.raises(CheckpointError, match=match):
        load_checkpoint(checkpoint)


def test_a_checkpoint_with_another_activation_is_refused(checkpoint):
    _edit_config(checkpoint, hidden_act="gelu")
    with pytest.raises(CheckpointError, match="hidden_act 'gelu' is not supported"):
        load_checkpoint(checkpoint)


def test_a_missing_sliding_window_is_transformers_default(checkpoint):
    # Mistral's (and Qwen's, with use_sliding_window) sliding_window defaults to 4,096 in transformers
    config = json.loads((checkpoint / "config.json").read_text())
    config.pop("sliding_window", None)
    (checkpoint / "config.json").write_text(json.dumps({**config, "model_type": "mistral",
                                                        "max_position_embeddings": 8192}))
    assert load_checkpoint(checkpoint).config.sliding_window == 4096


def test_gemma_2_is_not_run_in_float16(tmp_path):
    from transformers import Gemma2Config, Gemma2ForCausalLM

    cfg = Gemma2Config(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                       num_key_value_heads=1, head_dim=8, max_position_embeddings=128, pad_token_id=None)
    Gemma2ForCausalLM(cfg).save_pretrained(tmp_path)
    assert load_checkpoint(tmp_path, dtype="bfloat16").config.dtype == "bfloat16"
    with pytest.raises(CheckpointError, match="do not run in float16"):
        load_checkpoint(tmp_path, dtype="float16")
    _edit_config(tmp_path, dtype="float16")  # a float16 checkpoint runs in bfloat16, as vLLM runs it
    assert load_checkpoint(tmp_path).config.dtype == "bfloat16"


def test_a_missing_checkpoint_directory_is_refused(tmp_path):
    with pytest.raises(CheckpointError, match="no such checkpoint directory"):
        load_checkpoint(tmp_path / "absent")


def test_a_damaged_weight_file_is_refused_by_file_name(checkpoint):
    weights = checkpoint / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    with pytest.raises(CheckpointError, match="model.safetensors: cannot be read"):
        load_checkpoint(checkpoint)


def test_a_stacked_tensor_of_the_wrong_height_is_refused_by_name(tmp_path):
    from transformers import Phi3Config, Phi3ForCausalLM

    cfg = Phi3Config(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                     num_key_value_heads=1, max_position_embeddings=128, sliding_window=None, pad_token_id=None)
    Phi3ForCausalLM(cfg).save_pretrained(tmp_path)
    assert load_checkpoint(tmp_path).config.num_kv_heads == 1
    _edit_config(tmp_path, num_key_value_heads=2)  # the stacked q/k/v holds one KV head, not two
    with pytest.raises(CheckpointError, match=r"'model.layers.0.self_attn.qkv_proj.weight' has 32 rows, "
                                              r"config.json implies 48 \(16 \+ 16 \+ 16\)"):
        load_checkpoint(tmp_path)


# ---- the command line: refused before anything runs, naming the option -------------------------
def _cli_refusal(argv: list[str], capsys) -> tuple[str, str]:
    try:
        rc = main(argv)
    except SystemExit as exc:  # argparse's own refusal
        rc = exc.code
    out, err = capsys.readouterr()
    assert rc == 2, (out, err)
    return out, err


def _cli_cases(tmp: "Path") -> list[tuple[list[str], str]]:
    from env.workloads import bundled_trace

    azure, arxiv = str(bundled_trace("azure2023_conv.csv")), str(bundled_trace("arxiv_summarization_lengths_llama2tok.csv"))
    (tmp / "afile").write_text("not a folder")
    (tmp / "empty.pem").write_text("")
    eval_ = ["eval", "--policy", "static:2", "--scenario", "steady"]
    return [
        (eval_ + ["--seed", "-1"], "argument --seed: a seed is an integer in 0..4294967295, got -1"),
        (eval_ + ["--seed", str(2 ** 70)], "argument --seed: a seed is an integer in 0.."),
        (eval_ + ["--episodes", "0"], "argument --episodes: expected a whole number > 0, got 0"),
        (eval_ + ["--plot", str(tmp / "nowhere" / "x.png")], f"--plot {tmp / 'nowhere' / 'x.png'}: directory"),
        (["eval", "--policy", "static:2", "--trace", arxiv, "--time-scale", "0"],
         "argument --time-scale: expected a number > 0, got 0"),
        (["replay", "--trace", azure, "--ttft-slo", "nan"], "argument --ttft-slo: expected a finite number, got nan"),
        (["replay", "--trace", azure, "--tpot-slo", "-1"], "argument --tpot-slo: expected a number > 0, got -1"),
        (["replay", "--trace", azure, "--downtime", "inf"], "argument --downtime: expected a finite number, got inf"),
        (["replay", "--trace", azure, "--device", "foo"], "argument --device: expected cpu or cuda[:N], got 'foo'"),
        (["replay", "--trace", azure, "--start", "99999999"], "after the trace's last arrival"),
        (["replay", "--trace", azure, "--controller", "garbage"], "--controller garbage: expected unix:///path or HOST:PORT"),
        (["replay", "--trace", azure, "--controller", "127.0.0.1:9", "--controller-ca", str(tmp / "empty.pem")],
         f"--controller-ca {tmp / 'empty.pem'}: not a PEM file"),
        (["serve", "--policy", "default", "--listen", "127.0.0.1:0", "--tls-cert", str(tmp / "nosuch.pem"),
          "--tls-key", str(tmp / "nosuch.key")], f"--tls-cert {tmp / 'nosuch.pem'}: cannot be read"),
        (["serve", "--policy", "default", "--listen", "127.0.0.1:0", "--max-policy-mib", str(10 ** 20)],
         "--max-policy-mib must be in 1..4096"),
        (["results", "--policy", "oracle", "--scenario", "steady", "--no-oracle"],
         "--policy oracle: rlctl results sets trained policies"),
        (["train", "--config", "steady", "--logdir", str(tmp / "afile")], "a file, not a folder"),
        (["train", "--config", "steady", "--seeds", "1", "2", "--resume", str(tmp / "x.zip")],
         "--resume continues one run: give one --config and no --seeds"),
        (["replay", "--trace", azure, "--decision-interval", "0"], "argument --decision-interval: expected a number > 0"),
        (["replay", "--trace", azure, "--controller-ca", str(tmp / "ca.pem")],
         "--controller-ca belongs to the live loop: give --controller ADDR too"),
        # the engine's and the replay's own checks, named by the flag given (they said num_blocks, duration_s)
        (["replay", "--trace", azure, "--blocks", "0"], "--blocks must be > 0, got 0"),
        (["replay", "--trace", azure, "--duration", "-1"], "--duration must be > 0, got -1.0"),
        (["replay", "--trace", azure, "--client-timeout", "-3"], "--client-timeout must be a finite number"),
        (["replay", "--trace", azure, "--limit", "0"], "--limit must be >= 1, got 0"),
        (["replay", "--trace", "sharegpt_8k_lengths_llama2tok.csv", "--duration", "3"],
         "--rate is required: "),  # it said rate_rps
        (["train", "--config", "steady", "--timesteps", "0", "--logdir", str(tmp / "runs")],
         "argument --timesteps: expected a whole number > 0, got 0"),  # it named the config file's field
    ]


@pytest.mark.parametrize("case", range(25))
def test_a_bad_option_is_refused_before_anything_runs_naming_it(case, tmp_path, capsys):
    cases = _cli_cases(tmp_path)
    assert len(cases) == 25
    argv, message = cases[case]
    out, err = _cli_refusal(argv, capsys)
    assert message in err
    assert "Traceback" not in err and not out.strip()  # refused first: no table, no header


def test_the_demo_refuses_its_options_before_its_first_table(tmp_path, capsys):
    out, err = _cli_refusal(["demo", "--timesteps", "-1", "--logdir", str(tmp_path)], capsys)
    assert "timesteps" in err and "demo:" not in out and not list(tmp_path.iterdir())


@pytest.mark.parametrize("field, value", [("ttft_slo_s", float("nan")), ("tpot_slo_s", 0.0), ("ttft_slo_s", -5.0),
                                          ("restart_downtime_s", float("inf")), ("restart_downtime_s", float("nan"))])
def test_an_engine_config_refuses_a_target_or_downtime_that_is_not_a_finite_time(field, value):
    from engine.config import EngineConfig

    with pytest.raises(ValueError, match=f"{field} must be a finite number of seconds"):
        EngineConfig(**{field: value})


@pytest.mark.parametrize("field, value, why", [("block_size", float("nan"), "a whole number >= 1, got nan"),
                                              ("num_blocks", 10.5, "a whole number >= 1, got 10.5"),
                                              ("max_num_seqs", float("nan"), "a whole number >= 1, got nan"),
                                              ("host_bytes", float("nan"), "a whole number >= 0, got nan"),
                                              ("seed", -1, ">= 0, got -1")])
def test_an_engine_config_refuses_a_size_or_count_that_is_not_a_whole_number(field, value, why):
    """NaN passed `<= 0` and failed later without a name; 10.5 blocks failed in the pool."""
    from engine.config import EngineConfig

    with pytest.raises(ValueError, match=f"{field} must be {why}"):
        EngineConfig(**{field: value})


@pytest.mark.parametrize("fields, match", [
    ({"activation": "relu"}, "activation must be one of silu, gelu_tanh, got 'relu'"),
    ({"activation": "gelu_tanh", "num_experts": 4, "experts_per_token": 2, "moe_intermediate_size": 8},
     "a mixture of experts' MLPs are SwiGLU"),
    ({"attn_softcap": 0.0}, "attn_softcap must be a number > 0 or None, got 0.0"),
    ({"query_scale": float("inf")}, "query_scale must be a number > 0 or None"),
    ({"window_layers": (0,)}, "sliding_window must be a whole number of tokens >= 1 where window_layers"),
    ({"window_layers": (5,), "sliding_window": 8}, "window_layers: layer 5 is not one of the 2 layers"),
    ({"local_rope_theta": 1000.0}, "local_rope_theta needs window_layers"),
    ({"encoder_params": -1}, "encoder_params must be a whole number >= 0"),
    ({"swiglu_limit": 7.0}, "swiglu_limit is gpt-oss's experts': it needs num_experts > 0"),
    ({"swiglu_limit": -1.0, "num_experts": 4, "experts_per_token": 2, "moe_intermediate_size": 8},
     "swiglu_limit must be a number > 0 or None, got -1.0"),
    ({"swiglu_alpha": None}, "swiglu_alpha must be a number > 0, got None"),
    ({"expert_weight_bits": 4.25}, r"expert_weight_bits must be a number of bits in \(0, 32\] for a mixture of experts"),
    ({"expert_weight_bits": 0, "num_experts": 4, "experts_per_token": 2, "moe_intermediate_size": 8},
     "expert_weight_bits must be a number of bits"),
])
def test_a_model_config_refuses_an_architecture_it_cannot_run_by_name(fields, match):
    from engine.config import ModelConfig

    with pytest.raises(ValueError, match=match):
        ModelConfig(**fields)


def test_no_transformers_twin_is_claimed_for_a_model_transformers_cannot_build():
    from engine.config import ModelConfig
    from engine.model import LlamaModel
    from rlctl.bench.engine import hf_twin

    # soft caps and an attention scale outside Gemma 2's layer, or a scale no whole query_pre_attn_scalar gives
    for fields in ({"logit_softcap": 0.5}, {"attn_softcap": 0.5, "query_scale": 0.01},
                   {"activation": "gelu_tanh", "norm_offset": True, "embed_scale": True, "sandwich_norms": True,
                    "query_scale": 20.5 ** -0.5},
                   # gpt-oss's sinks without the rest of its layer
                   {"attn_sinks": True}):
        with pytest.raises(ValueError, match="transformers"):
            hf_twin(LlamaModel(ModelConfig(**fields)))


@pytest.mark.parametrize("field", ["vocab_size", "hidden_size", "num_layers", "num_heads", "max_position"])
def test_a_model_config_refuses_a_size_that_is_not_a_whole_number(field):
    import numpy as np

    from engine.config import ModelConfig

    for value in (float("nan"), 64.5, True):
        with pytest.raises(ValueError, match=f"{field} must be a whole number >= 1, got {value!r}"):
            ModelConfig(**{field: value})
    assert ModelConfig(**{field: np.int64(getattr(ModelConfig(), field))})  # numpy's integers are whole numbers


def test_a_factor_that_is_no_number_and_a_nan_deadline_are_refused_by_name(busy_engine):
    eng = busy_engine
    for factor in ("2", None, True, float("nan")):
        with pytest.raises(ValueError, match=f"overcommit factor must be a number > 0, got {factor!r}"):
            eng.set_overcommit(factor)
    with pytest.raises(ValueError, match="until must be a time"):  # it returned at once, doing nothing
        eng.run(until=float("nan"))
    eng.run()
    assert [eng.records[r].output_len for r in ("ok-1", "ok-2")] == [8, 6]


def test_the_env_refuses_a_bool_as_an_action():
    """gymnasium's Discrete takes True for 1: the env does not (True is no action id)."""
    import numpy as np

    from env.overcommit_env import OvercommitEnv
    from env.scenario_yaml import load_scenario

    env = OvercommitEnv(load_scenario("steady"))
    env.reset(seed=0)
    for action in (True, np.bool_(False)):
        with pytest.raises(ValueError, match=r"action must be one of 0..4 .*, got"):
            env.step(action)
    env.step(np.int64(1))  # numpy's integers are action ids


@pytest.mark.parametrize("blocks", [20.5, float("inf"), 0, True])
def test_a_refused_restart_changes_nothing(busy_engine, blocks):
    """It counted a restart, requeued everything and charged the recompute before the pool refused."""
    eng = busy_engine
    before = (eng.counters.restarts, eng.queue_lengths(), eng.counters.recomputed_tokens, eng.down_until)
    with pytest.raises(ValueError, match="a restart's num_blocks must be a whole number > 0"):
        eng.restart(blocks)
    assert (eng.counters.restarts, eng.queue_lengths(), eng.counters.recomputed_tokens, eng.down_until) == before
    eng.run()
    assert [eng.records[r].output_len for r in ("ok-1", "ok-2")] == [8, 6]


def test_a_folder_named_as_a_policy_a_node_policy_benched_and_a_yaml_that_is_no_mapping_are_named(tmp_path, capsys):
    out, err = _cli_refusal(["eval", "--policy", str(tmp_path), "--scenario", "steady"], capsys)
    assert f"policy {str(tmp_path)!r} is a folder; a policy is a file (*.rlpolicy)" in err
    (tmp_path / "list.yaml").write_text("- 1\n- 2\n")
    out, err = _cli_refusal(["eval", "--policy", "static:2", "--scenario", str(tmp_path / "list.yaml")], capsys)
    assert "the file: must be a mapping, got list" in err


def test_a_controller_address_is_checked_as_a_grpc_target():
    from rlctl.online.addresses import check_target

    for ok in ("unix:///tmp/s.sock", "unix:rel.sock", "unix-abstract:rlctl", "127.0.0.1:50051", "[::1]:50051",
               "dns:///sidecar.internal:443", "localhost:1"):
        check_target(ok)
    for bad in ("garbage", "unix:", "127.0.0.1", "127.0.0.1:0", "127.0.0.1:70000", ":50051", "a b:1"):
        with pytest.raises(ValueError, match="--controller"):
            check_target(bad)
