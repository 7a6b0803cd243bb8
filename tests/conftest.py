"""Shared fixtures: a tiny engine, and greedy generation through transformers."""
from __future__ import annotations

import pytest
import torch

from engine.config import EngineConfig, ModelConfig
from engine.engine import Engine
from tests.sidecar_process import Sidecar


def hf_greedy(hf, prompt: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None)
    return out[0, len(prompt):].tolist()


def assert_greedy_up_to_rounding(hf, prompt: list[int], tokens: list[int], ulps: int = 2) -> None:
    """``tokens`` continue ``prompt`` as transformers' greedy decoding does, up to rounding: after
    each prefix of them, the token's logit in ``hf`` is within ``ulps`` units in the last place (of
    the logits' dtype, at the largest logit's magnitude) of the largest. Two bf16 implementations
    round a near-tie either way, and greedy decoding then goes on from a different token; this
    checks every step from the engine's own prefix instead of stopping at the first such tie."""
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1]
    eps = torch.finfo(logits.dtype).eps
    logits = logits.float()
    tol = ulps * eps * 2.0 ** torch.floor(torch.log2(logits.abs().max())).item()
    gaps = logits.max(-1).values - logits[torch.arange(len(tokens)), torch.tensor(tokens)]
    far = [(j, tokens[j], round(g, 5)) for j, g in enumerate(gaps.tolist()) if g > tol]
    assert not far, f"(step, token, logit below the top) beyond {tol:.5f}: {far}"


def assert_generates_as(hf, prompts: list[list[int]], outputs: list[list[int]], exact: bool) -> None:
    """``outputs`` continue ``prompts`` as transformers' ``hf`` decodes them greedily: token for token where
    ``exact`` (float32), else up to rounding (bf16: ``assert_greedy_up_to_rounding``, every step checked)."""
    for tokens, p in zip(outputs, prompts):
        if exact:
            assert tokens == hf_greedy(hf, p, len(tokens))
        else:
            assert_greedy_up_to_rounding(hf, p, tokens)


def drawn_apart(hf, mlp_scale: float = 1.0, bias_std: float = 0.0):
    """``hf`` with its routers' weights drawn from N(0, 1), its norms' from N(1, 0.3), its routers' correction
    biases (parameters or buffers) from N(0, 0.3), its other biases from N(0, ``bias_std``) where > 0, and its
    other MLP and expert weights times ``mlp_scale``: far from their initial values, so that a wrong pick,
    weight or norm changes a tiny mixture of experts' tokens."""
    with torch.no_grad():
        for key, t in [*hf.named_parameters(), *hf.named_buffers()]:
            if key.endswith(("gate.weight", ".router.weight")):
                t.normal_(0.0, 1.0)
            elif key.endswith("norm.weight"):
                t.normal_(1.0, 0.3)
            elif key.endswith("e_score_correction_bias"):
                t.normal_(0.0, 0.3)
            elif key.endswith(".bias") and bias_std:
                t.normal_(0.0, bias_std)
            elif (".mlp." in key or ".experts." in key) and mlp_scale != 1:
                t.mul_(mlp_scale)
    return hf


def hf_tiny(name: str, **extra):
    """transformers' ``<name>ForCausalLM`` at a tiny size (3 layers, 6 heads over 2 KV heads, a
    300-token vocabulary), its weights drawn from seed 0; ``extra`` adds to its configuration or overrides it."""
    import transformers

    torch.manual_seed(0)
    cfg = getattr(transformers, f"{name}Config")(**{
        **dict(vocab_size=300, hidden_size=48, intermediate_size=96, num_hidden_layers=3, num_attention_heads=6,
               num_key_value_heads=2, max_position_embeddings=512, rope_theta=50000.0, rms_norm_eps=1e-6,
               bos_token_id=None, eos_token_id=None, pad_token_id=None), **extra})
    return getattr(transformers, f"{name}ForCausalLM")(cfg).eval()


@pytest.fixture
def make_engine():
    def make(**kw) -> Engine:
        model_kw = kw.pop("model", {})
        keep = kw.pop("keep_outputs", True)
        return Engine(ModelConfig(**model_kw), EngineConfig(**kw), keep_outputs=keep)
    return make


@pytest.fixture
def sidecars():
    """Start sidecars with ``sidecars(address, policy, *options)``; all are killed at teardown."""
    started: list[Sidecar] = []

    def start(*args, **kw) -> Sidecar:
        started.append(Sidecar(*args, **kw))
        return started[-1]

    yield start
    for s in started:
        s.stop()
