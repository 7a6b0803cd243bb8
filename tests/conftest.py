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
