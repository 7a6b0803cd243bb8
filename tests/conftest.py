"""Shared fixtures: a tiny engine and its Hugging Face twin."""
from __future__ import annotations

import pytest
import torch

from engine.config import EngineConfig, ModelConfig
from engine.engine import Engine


def hf_twin(model):
    """Hugging Face's LlamaForCausalLM with exactly the weights of our ``model``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    mc = model.config
    hfc = LlamaConfig(vocab_size=mc.vocab_size, hidden_size=mc.hidden_size, intermediate_size=mc.intermediate_size,
                      num_hidden_layers=mc.num_layers, num_attention_heads=mc.num_heads,
                      num_key_value_heads=mc.num_kv_heads, max_position_embeddings=mc.max_position,
                      rope_theta=mc.rope_theta, rms_norm_eps=mc.rms_norm_eps,
                      tie_word_embeddings=mc.tie_word_embeddings, bos_token_id=None, eos_token_id=None,
                      pad_token_id=None)
    hf = LlamaForCausalLM(hfc).eval()
    hf.load_state_dict(model.state_dict(), strict=True)
    return hf


def hf_greedy(hf, prompt: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None)
    return out[0, len(prompt):].tolist()


@pytest.fixture
def make_engine():
    def make(**kw) -> Engine:
        model_kw = kw.pop("model", {})
        keep = kw.pop("keep_outputs", True)
        return Engine(ModelConfig(**model_kw), EngineConfig(**kw), keep_outputs=keep)
    return make
