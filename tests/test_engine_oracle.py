"""The engine generates exactly what Hugging Face transformers generates for the same weights."""
from __future__ import annotations

import pytest
import torch

from conftest import hf_greedy, hf_tiny
from rlctl.bench.engine import hf_twin
import json
from dataclasses import replace

from engine.checkpoint import load_checkpoint, read_sizes
from engine.model import LlamaModel
from engine.config import EngineConfig
from engine.engine import Engine
from engine.sequence import Status
from engine.request import Request


def _prompts(vocab: int, lengths: list[int], seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


def _generate(model, prompts: list[list[int]], new_tokens: int, **engine) -> list[list[int]]:
    """What an engine over ``model`` (``engine``: its EngineConfig's fields beside a 512-token context)
    generates greedily for ``prompts``, all submitted at once."""
    eng = Engine(model.config, EngineConfig(max_model_len=512, **engine), model=model, keep_outputs=True)
    assert eng.max_model_len == 512
    for i, p in enumerate(prompts):
        eng.submit(Request(f"p{i}", 0.0, len(p), new_tokens, new_tokens, prompt_ids=tuple(p)))
    eng.run()
    return [eng.outputs[f"p{i}"] for i in range(len(prompts))]


def test_staggered_batch_with_chunked_prefill_compaction_and_swap_matches_transformers(make_engine):
    # small chunks and segments, so prefills are chunked and the pool spans several segments
    eng = make_engine(num_blocks=64, block_size=4, segment_blocks=8, max_num_batched_tokens=24)
    vocab = eng.model_config.vocab_size
    lengths, outputs = [7, 70, 19, 41, 3, 28], [12, 14, 9, 12, 16, 10]
    prompts = _prompts(vocab, lengths)

    def submit(i: int) -> None:
        eng.submit(Request(f"r{i}", eng.clock, lengths[i], outputs[i], outputs[i], prompt_ids=tuple(prompts[i])))

    submit(0), submit(1)  # r1's prompt needs three chunks
    for _ in range(2):
        eng.step()
    submit(2), submit(3)
    for _ in range(3):
        eng.step()
    submit(4), submit(5)
    while eng.records["r0"].finish_s is None:  # r0 finishes first and leaves holes low in the pool
        eng.step()
    assert eng.kv.blocks.holes() > 0
    report = eng.compact()
    assert report.blocks > 0 and eng.kv.blocks.holes() == 0

    eng.step()
    victim = max(eng.scheduler.running, key=lambda s: s.admit_order)
    assert 0 < victim.num_generated < victim.request.output_len
    eng.evict((eng.kv.blocks.num_free + len(victim.block_table)) / eng.kv.num_blocks)  # just the newest
    assert victim.status is Status.SWAPPED and victim.host_kv is not None
    assert eng.kv.traffic.out_blocks > 0
    eng.run()
    assert eng.kv.traffic.in_blocks == eng.kv.traffic.out_blocks

    hf = hf_twin(eng.model)
    for i, p in enumerate(prompts):
        assert eng.outputs[f"r{i}"] == hf_greedy(hf, p, outputs[i]), f"r{i} differs"


def test_recompute_after_preemption_matches_transformers(make_engine):
    # a pool too small for all four: preempt semantics recompute the newest sequences
    eng = make_engine(num_blocks=12, block_size=4, segment_blocks=4, oom_mode="preempt",
                      overcommit=float("inf"), overcommit_max=float("inf"))
    prompts = _prompts(eng.model_config.vocab_size, [9, 11, 6, 10], seed=3)
    for i, p in enumerate(prompts):
        eng.submit(Request(f"r{i}", 0.0, len(p), 12, 12, prompt_ids=tuple(p)))
    eng.run()
    assert eng.counters.preemptions > 0
    hf = hf_twin(eng.model)
    for i, p in enumerate(prompts):
        assert eng.outputs[f"r{i}"] == hf_greedy(hf, p, 12)


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "llama_attention_bias", "qwen3", "phi3"])
def test_local_checkpoint_loads_and_matches_transformers(tmp_path, arch):
    # Mistral without a sliding window (v0.2 on) is Llama's architecture under its own name; Qwen2
    # is Llama's with biases on q, k and v; Llama's attention_bias puts one on o as well; Qwen3 norms
    # each q and k head, and its heads here are wider than hidden_size / heads (12, not 8), as Qwen3's are;
    # Phi-3 (and Phi-4) stores q/k/v and gate/up each as one tensor
    name, extra = {"llama": ("Llama", {"tie_word_embeddings": True}),
                   "mistral": ("Mistral", {"sliding_window": None}),
                   "qwen2": ("Qwen2", {"tie_word_embeddings": True}),
                   "llama_attention_bias": ("Llama", {"attention_bias": True}),
                   "qwen3": ("Qwen3", {"head_dim": 12, "tie_word_embeddings": True}),
                   "phi3": ("Phi3", {"sliding_window": None})}[arch]
    hf = hf_tiny(name, **extra)
    with torch.no_grad():  # transformers starts biases at 0 and norms at 1: a dropped one must change the
        for key, p in hf.named_parameters():  # tokens, and attention must weigh enough in them to tell
            if key.endswith(".bias"):
                p.normal_(0.0, 1.0)
            elif key.endswith(("q_norm.weight", "k_norm.weight")):
                p.uniform_(0.2, 3.0)
            elif key.endswith(("v_proj.weight", "o_proj.weight", "qkv_proj.weight")):
                p.mul_(16)
            elif ".mlp." in key:  # so that gate and up swapped would show
                p.mul_(8)
    hf.save_pretrained(tmp_path)
    model = load_checkpoint(tmp_path)
    assert model.config.num_kv_heads == 2 and model.config.tie_word_embeddings == extra.get("tie_word_embeddings", False)
    assert model.config.head_dim == extra.get("head_dim", 8) and model.config.qk_norm == (arch == "qwen3")
    biases = {k for k in model.state_dict() if k.endswith(".bias")}
    assert biases == {k for k, _ in hf.named_parameters() if k.endswith(".bias")}
    assert bool(biases) == (arch in ("qwen2", "llama_attention_bias"))
    eng = Engine(model.config, EngineConfig(num_blocks=32, max_model_len=512), model=model, keep_outputs=True)
    prompts = _prompts(300, [13, 30], seed=5)
    for i, p in enumerate(prompts):
        eng.submit(Request(f"c{i}", 0.0, len(p), 10, 10, prompt_ids=tuple(p)))
    eng.run()
    for i, p in enumerate(prompts):
        assert eng.outputs[f"c{i}"] == hf_greedy(hf, p, 10)
    # the twin the benchmarks and the other oracle tests compare with is the same model again
    assert hf_greedy(hf_twin(model), prompts[1], 10) == eng.outputs["c1"]


GEMMA_PARTS = {"activation": "silu", "embed_scale": False, "norm_offset": False, "query_scale": None,
               "attn_softcap": None, "logit_softcap": None}


@pytest.mark.parametrize("name", ["Gemma", "Gemma2"])
def test_a_gemma_checkpoint_loads_and_matches_transformers(tmp_path, name):
    # Gemma: scaled embeddings, norms by 1 + weight, a tanh-GELU MLP, tied embeddings; Gemma 2 adds norms
    # on attention's output and around the MLP, its own attention scale and soft caps (here tight enough
    # to bite: 1.5 on the scores, 3 on the logits), with a window no context here reaches
    extra = {"head_dim": 12}
    if name == "Gemma2":
        extra |= {"query_pre_attn_scalar": 20, "attn_logit_softcapping": 1.5, "final_logit_softcapping": 3.0,
                  "sliding_window": 512}
    hf = hf_tiny(name, **extra)
    with torch.no_grad():  # norms start at 0 (a scale of 1): away from it a Llama norm shows; scores
        for key, p in hf.named_parameters():  # large enough for their scale and cap to bite
            if key.endswith("norm.weight"):
                p.uniform_(-0.8, 2.0)
            elif key.endswith(("v_proj.weight", "o_proj.weight")):
                p.mul_(16)
            elif key.endswith(("q_proj.weight", "k_proj.weight")):
                p.mul_(8)
            elif key.endswith("embed_tokens.weight"):
                p.mul_(3)
            elif ".mlp." in key:
                p.mul_(8)
    hf.save_pretrained(tmp_path)
    model = load_checkpoint(tmp_path)
    mc = model.config
    assert (mc.tie_word_embeddings, mc.norm_offset, mc.embed_scale, mc.activation) == (True, True, True, "gelu_tanh")
    assert mc.sandwich_norms == (name == "Gemma2") and mc.max_position == 512
    prompts = _prompts(300, [13, 30], seed=5)

    def generate(m) -> list[list[int]]:
        return _generate(m, prompts, 10, num_blocks=32)

    tokens = generate(model)
    assert tokens == [hf_greedy(hf, p, 10) for p in prompts]
    assert hf_greedy(hf_twin(model), prompts[1], 10) == tokens[1]

    def first_logits(m) -> torch.Tensor:  # the prompts' last logits (greedy tokens cannot tell a soft cap)
        seen = []
        hook = m.register_forward_hook(lambda module, args, out: seen.append(out))
        generate(m)
        hook.remove()
        return seen[0]

    logits = first_logits(model)
    with torch.no_grad():
        torch.testing.assert_close(logits, torch.stack([hf(torch.tensor([p])).logits[0, -1] for p in prompts]))
    # each of Gemma's differences from Llama that this checkpoint has changes them when dropped
    for field, llama in GEMMA_PARTS.items():
        if getattr(mc, field) == llama:
            continue
        other = LlamaModel(replace(mc, **{field: llama}))
        other.load_state_dict(model.state_dict())
        assert not torch.allclose(first_logits(other.eval()), logits, atol=1e-3), field


def _tiny_gemma3(multimodal: bool):
    """transformers' Gemma 3 at a tiny size, as its text model alone or inside the multimodal model
    (a two-layer SigLIP tower beside it): a 24-token window on three of its four layers, which rotate
    by a RoPE of their own (base 1,000), the full layer's scaled linearly by 4 (base 200,000)."""
    import transformers

    torch.manual_seed(0)
    text = dict(vocab_size=300, hidden_size=48, intermediate_size=96, num_hidden_layers=4, num_attention_heads=6,
                num_key_value_heads=2, head_dim=12, max_position_embeddings=512, rms_norm_eps=1e-6, sliding_window=24,
                layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
                rope_parameters={"full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 200000.0},
                                 "sliding_attention": {"rope_type": "default", "rope_theta": 1000.0}},
                query_pre_attn_scalar=20, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    if not multimodal:
        return transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(**text)).eval()
    vision = dict(hidden_size=32, intermediate_size=40, num_hidden_layers=2, num_attention_heads=2, image_size=56,
                  patch_size=14, vision_use_head=False)
    cfg = transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4,
                                    image_token_index=299, boi_token_index=297, eoi_token_index=298)
    return transformers.Gemma3ForConditionalGeneration(cfg).eval()


def _as_transformers_4_wrote(config: dict) -> dict:
    """A Gemma 3 text config as transformers 4 wrote it: its layers' kinds by ``sliding_window_pattern``
    (every third layer full: _tiny_gemma3's), its RoPEs by ``rope_theta``, ``rope_local_base_freq``
    and ``rope_scaling``."""
    rope = config.pop("rope_parameters")
    config.pop("layer_types")
    full = rope["full_attention"]
    return {**config, "sliding_window_pattern": 3, "rope_theta": full["rope_theta"],
            "rope_local_base_freq": rope["sliding_attention"]["rope_theta"],
            "rope_scaling": {"rope_type": full["rope_type"], "factor": full["factor"]}}


@pytest.mark.parametrize("layout", ["transformers 5", "transformers 4"])
@pytest.mark.parametrize("multimodal", [False, True])
def test_a_gemma_3_checkpoint_loads_and_matches_transformers(tmp_path, multimodal, layout):
    # Gemma 3: Gemma 2's layer without the soft caps, with a norm over each q and k head, five of six
    # layers windowed and rotating by a RoPE of their own; its larger checkpoints are multimodal, the
    # text model's weights beside a vision tower, which the engine leaves out (counted when sized)
    hf = _tiny_gemma3(multimodal)
    with torch.no_grad():
        for key, p in hf.named_parameters():
            if key.endswith("norm.weight"):
                p.uniform_(-0.8, 2.0)
            elif key.endswith(("v_proj.weight", "o_proj.weight", "q_proj.weight", "k_proj.weight")) or ".mlp." in key:
                p.mul_(8)
    hf.save_pretrained(tmp_path)
    if layout == "transformers 4":  # as every published Gemma 3 checkpoint's config.json has it
        config = json.loads((tmp_path / "config.json").read_text())
        if multimodal:
            config["text_config"] = _as_transformers_4_wrote(config["text_config"])
        else:
            config = _as_transformers_4_wrote(config)
        (tmp_path / "config.json").write_text(json.dumps(config))
    model = load_checkpoint(tmp_path)
    mc = model.config
    assert (mc.qk_norm, mc.sandwich_norms, mc.attn_softcap, mc.logit_softcap) == (True, True, None, None)
    assert (mc.window_layers, mc.local_rope_theta, mc.rope_theta, mc.rope_scaling.factor) == ((0, 1, 3), 1000.0, 200000.0, 4.0)
    assert read_sizes(tmp_path)[0].param_count() == sum(p.numel() for p in hf.parameters())  # the tower counted
    prompts = _prompts(290, [13, 44, 70], seed=5)  # past the window, in chunks, decoded in one batch past it

    tokens = _generate(model, prompts, 30, num_blocks=64, max_num_batched_tokens=32)
    assert tokens == [hf_greedy(hf, p, 30) for p in prompts]
    if not multimodal:
        assert hf_greedy(hf_twin(model), prompts[2], 30) == tokens[2]
    one_rope = LlamaModel(replace(mc, local_rope_theta=None))  # the windowed layers' own RoPE matters
    one_rope.load_state_dict(model.state_dict())
    assert _generate(one_rope.eval(), prompts, 30, num_blocks=64, max_num_batched_tokens=32) != tokens


@pytest.mark.parametrize("layout", ["transformers 5", "as saved"])
def test_a_mistral_3_checkpoint_loads_its_text_model_and_matches_transformers(tmp_path, layout):
    # Mistral Small 3.1 and 3.2 (``mistral3``): a Mistral decoder beside a Pixtral vision tower and its
    # projector; the engine runs the text model and leaves the rest out (counted when sized). Its lm_head
    # is its own, as its text_config says (transformers ties them only where the top level says so and
    # the checkpoint holds no lm_head)
    import transformers
    from safetensors.torch import load_file, save_file

    torch.manual_seed(0)
    text = dict(model_type="mistral", vocab_size=300, hidden_size=48, intermediate_size=96, num_hidden_layers=3,
                num_attention_heads=6, num_key_value_heads=2, head_dim=8, max_position_embeddings=512,
                rms_norm_eps=1e-5, rope_theta=50000.0, sliding_window=None, tie_word_embeddings=False,
                bos_token_id=None, eos_token_id=None, pad_token_id=None)
    vision = dict(hidden_size=32, intermediate_size=40, num_hidden_layers=2, num_attention_heads=2, head_dim=16,
                  image_size=32, patch_size=8)
    hf = transformers.Mistral3ForConditionalGeneration(transformers.Mistral3Config(
        text_config=text, vision_config=vision, image_token_index=299, tie_word_embeddings=False)).eval()
    with torch.no_grad():
        for key, p in hf.named_parameters():
            if ".mlp." in key or key.endswith(("v_proj.weight", "o_proj.weight")):
                p.mul_(8)
    hf.save_pretrained(tmp_path)  # as the published checkpoints name them: language_model.model.*, vision_tower.*
    state = load_file(str(tmp_path / "model.safetensors"))
    assert "language_model.lm_head.weight" in state and "vision_tower.transformer.layers.0.ffn_norm.weight" in state
    if layout == "transformers 5":  # its modules' own names: model.language_model.*, lm_head, model.vision_tower.*

        def named(key: str) -> str:
            if key.startswith("language_model.lm_head."):
                return key.removeprefix("language_model.")
            if key.startswith("language_model.model."):
                return "model.language_model." + key.removeprefix("language_model.model.")
            return "model." + key  # the tower and the projector

        renamed = {named(k): v for k, v in state.items()}
        assert "lm_head.weight" in renamed and "model.vision_tower.transformer.layers.0.ffn_norm.weight" in renamed
        save_file(renamed, str(tmp_path / "model.safetensors"))
    model = load_checkpoint(tmp_path)
    assert not model.config.tie_word_embeddings and model.config.sliding_window is None
    assert read_sizes(tmp_path)[0].param_count() == hf.num_parameters()  # tower and projector counted
    prompts = _prompts(299, [13, 44, 70], seed=5)
    tokens = _generate(model, prompts, 20, num_blocks=64, max_num_batched_tokens=32)
    assert len({t for o in tokens for t in o}) > 8
    assert tokens == [hf_greedy(hf, p, 20) for p in prompts]


def _tiny_qwen_vl(name: str, tied: bool = False, expert_width: int = 32):
    """transformers' Qwen2-VL, Qwen2.5-VL or Qwen3-VL (dense or MoE) at a tiny size: a two-block vision tower
    beside the text model; tied (a Qwen3-VL's at its top level only, as transformers reads it: its text
    config keeps its own default, which for the MoE's is true)."""
    import transformers

    torch.manual_seed(0)
    text = dict(vocab_size=300, hidden_size=48, intermediate_size=96, num_hidden_layers=3, num_attention_heads=6,
                num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6,
                bos_token_id=None, eos_token_id=None, pad_token_id=None)
    if not name.startswith("Qwen3"):
        text["tie_word_embeddings"] = tied
    vision = dict(depth=2, hidden_size=32, intermediate_size=40, num_heads=2, patch_size=4, out_hidden_size=48)
    if name == "Qwen2_VL":  # its tower's width is embed_dim, its output hidden_size
        text["rope_parameters"] = {"rope_type": "default", "rope_theta": 50000.0, "mrope_section": [1, 1, 2]}
        cfg = transformers.Qwen2VLConfig(text_config=text, vision_config=dict(depth=2, embed_dim=32, hidden_size=48,
                                                                              num_heads=2, patch_size=4, mlp_ratio=2),
                                         image_token_id=299, video_token_id=298, vision_start_token_id=297)
        return transformers.Qwen2VLForConditionalGeneration(cfg).eval()
    if name == "Qwen2_5_VL":
        text["rope_parameters"] = {"rope_type": "default", "rope_theta": 50000.0, "mrope_section": [1, 1, 2]}
        cfg = transformers.Qwen2_5_VLConfig(text_config=text, vision_config={**vision, "fullatt_block_indexes": [1]},
                                            image_token_id=299, video_token_id=298, vision_start_token_id=297)
        return transformers.Qwen2_5_VLForConditionalGeneration(cfg).eval()
    text.update(head_dim=8, rope_parameters={"rope_type": "default", "rope_theta": 50000.0, "mrope_section": [2, 1, 1],
                                             "mrope_interleaved": True})
    if name == "Qwen3_VL_MOE":  # Qwen3-MoE's text model: 4 experts, 2 a token, their matrices stored transposed
        text.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=expert_width, decoder_sparse_step=1)
        cfg = transformers.Qwen3VLMoeConfig(text_config=text, vision_config={**vision, "num_position_embeddings": 16,
                                                                             "deepstack_visual_indexes": [0, 1]},
                                            image_token_id=299, video_token_id=298, vision_start_token_id=297,
                                            tie_word_embeddings=tied)
        return transformers.Qwen3VLMoeForConditionalGeneration(cfg).eval()
    cfg = transformers.Qwen3VLConfig(text_config=text, vision_config={**vision, "num_position_embeddings": 16,
                                                                      "deepstack_visual_indexes": [0, 1]},
                                     image_token_id=299, video_token_id=298, vision_start_token_id=297,
                                     tie_word_embeddings=tied)
    return transformers.Qwen3VLForConditionalGeneration(cfg).eval()


@pytest.mark.parametrize("name, layout", [("Qwen2_VL", "published"), ("Qwen2_VL", "transformers 5"),
                                          ("Qwen2_5_VL", "transformers 5"), ("Qwen2_5_VL", "published"),
                                          ("Qwen3_VL", "transformers 5"), ("Qwen3_VL", "tied"),
                                          ("Qwen3_VL_MOE", "transformers 5"), ("Qwen3_VL_MOE", "tied"),
                                          ("Qwen3_VL_MOE", "experts transposed"),
                                          ("Qwen3_VL_MOE", "square experts transposed")])
def test_a_qwen_vl_checkpoint_loads_its_text_model_and_matches_transformers(tmp_path, name, layout):
    # Qwen2.5-VL and Qwen3-VL: Qwen2's and Qwen3's decoders beside a vision tower, rotating by a
    # multimodal RoPE that is the plain one on text; the engine runs the text model (the tower counted
    # when sized). The published Qwen2.5-VL checkpoints write the text model's fields at config.json's top
    # level and its weights as model.* and visual.*
    from safetensors.torch import load_file, save_file

    # tied: the 2B's and 4B's, no lm_head saved; square: gate and up together as wide as the model (24 x 2 = 48),
    # so that only down_proj's shape tells the published layout
    hf = _tiny_qwen_vl(name, tied=layout == "tied", expert_width=24 if layout.startswith("square") else 32)
    with torch.no_grad():
        for key, p in hf.named_parameters():
            if ".mlp." in key or key.endswith(("v_proj.weight", "o_proj.weight")):
                p.mul_(8)
            elif key.endswith(".bias") and "language_model" in key:
                p.normal_(0.0, 0.1)
    hf.save_pretrained(tmp_path)
    if layout.endswith("experts transposed"):  # as the published checkpoints store them: each matrix transposed
        state = load_file(str(tmp_path / "model.safetensors"))
        save_file({k: t.transpose(1, 2).contiguous() if k.endswith(("experts.gate_up_proj", "experts.down_proj")) else t
                   for k, t in state.items()}, str(tmp_path / "model.safetensors"))
    if layout == "published":
        state = load_file(str(tmp_path / "model.safetensors"))
        save_file({k.replace("model.language_model.", "model.").replace("model.visual.", "visual."): v
                   for k, v in state.items()}, str(tmp_path / "model.safetensors"))
        config = json.loads((tmp_path / "config.json").read_text())
        text = config.pop("text_config")
        rope = text.pop("rope_parameters")
        (tmp_path / "config.json").write_text(json.dumps({**text, **config, "rope_theta": rope["rope_theta"],
                                                           "rope_scaling": {"type": "mrope", "mrope_section": [1, 1, 2]}}))
    model = load_checkpoint(tmp_path)
    qwen3 = name.startswith("Qwen3")
    assert model.config.qkv_bias == (not qwen3) and model.config.qk_norm == qwen3
    assert model.config.num_experts == (4 if name == "Qwen3_VL_MOE" else 0) and not model.config.moe_float32_weights
    assert model.config.tie_word_embeddings == (layout == "tied")
    assert read_sizes(tmp_path)[0].param_count() == hf.num_parameters()  # tower and mergers counted
    prompts = _prompts(297, [13, 44, 70], seed=5)
    tokens = _generate(model, prompts, 20, num_blocks=64, max_num_batched_tokens=32)
    assert len({t for o in tokens for t in o}) > 5  # tokens that vary, so that a difference shows
    assert tokens == [hf_greedy(hf, p, 20) for p in prompts]


QWEN_WINDOW = {"use_sliding_window": True, "max_window_layers": 1}
MOE = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}


@pytest.mark.parametrize("name, window, layers, extra", [
    ("Mistral", 48, (0, 1, 2), {}), ("Phi3", 47, (0, 1, 2), {}), ("Qwen2", 48, (1, 2), QWEN_WINDOW),
    ("Gemma2", 40, (0, 2), {}), ("Mixtral", 33, (0, 1, 2), {"num_local_experts": 4, "num_experts_per_tok": 2}),
    ("Qwen3Moe", 33, (0, 1, 2), {**QWEN_WINDOW, **MOE}), ("Qwen2Moe", 33, (0, 2), {**QWEN_WINDOW, **MOE,
                                                                                 "max_window_layers": 3}),
])
@pytest.mark.parametrize("layout", ["transformers 5", "transformers 4"])
def test_a_sliding_window_checkpoint_attends_through_its_window_as_transformers_runs_it(tmp_path, name, window, layers,
                                                                                        extra, layout):
    # Mistral v0.1's, Phi-3-mini-4k's, Mixtral's, Qwen2's (use_sliding_window, from max_window_layers on),
    # Qwen3-MoE's (every layer), Qwen2-MoE's (every other one below max_window_layers) and Gemma 2's (every
    # other layer) windows: a windowed layer's query sees the window's last keys, its own included;
    # served past the window, prompts taken in chunks and decoded in one batch, the tokens are
    # transformers', read from transformers 5's layer_types or without them, as transformers 4 wrote
    hf = hf_tiny(name, sliding_window=window, **extra)
    with torch.no_grad():
        for key, p in hf.named_parameters():
            if key.endswith(("v_proj.weight", "o_proj.weight", "qkv_proj.weight")):
                p.mul_(16)
    hf.save_pretrained(tmp_path)
    if layout == "transformers 4":
        config = json.loads((tmp_path / "config.json").read_text())
        config.pop("layer_types", None)
        (tmp_path / "config.json").write_text(json.dumps(config))
    model = load_checkpoint(tmp_path)
    assert (model.config.sliding_window, model.config.window_layers, model.config.max_position) == (window, layers, 512)
    prompts = _prompts(300, [13, window + 20, 2 * window + 3], seed=5)

    def generate(m) -> list[list[int]]:
        return _generate(m, prompts, 2 * window, num_blocks=64, max_num_batched_tokens=32)

    tokens = generate(model)
    assert tokens == [hf_greedy(hf, p, 2 * window) for p in prompts]
    if not model.config.num_experts:  # and the twin's, window and all
        assert hf_greedy(hf_twin(model), prompts[2], 2 * window) == tokens[2]
    unwindowed = LlamaModel(replace(model.config, sliding_window=None, window_layers=()))  # the window bites
    unwindowed.load_state_dict(model.state_dict())
    assert generate(unwindowed.eval()) != tokens


def test_a_prompt_alone_in_chunks_that_produce_no_token_matches_transformers(make_engine):
    # only the last chunk of the prompt wants logits: the steps before it select no row at all
    eng = make_engine(num_blocks=32, block_size=4, max_num_batched_tokens=16)
    prompt = _prompts(eng.model_config.vocab_size, [45], seed=7)[0]
    eng.submit(Request("solo", 0.0, len(prompt), 6, 6, prompt_ids=tuple(prompt)))
    eng.run()
    assert eng.outputs["solo"] == hf_greedy(hf_twin(eng.model), prompt, 6)
