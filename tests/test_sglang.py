"""SGLang's admission rule, as SGLang documents its defaults: a request is admitted while the tokens
held plus new_token_ratio x the tokens that may still be generated (clipped at 4,096) fit the KV
capacity; the ratio starts at 0.7, falls linearly to 0.7 x 0.14 over 600 decode iterations, and
goes back to 0.7 when a decode iteration finds no free block and retracts the newest request."""
from __future__ import annotations

import pytest

from engine.config import EngineConfig, ModelConfig
from engine.cost_model import CostModel
from engine.engine import Engine
from engine.executor import ProfiledExecutor
from engine.request import Request

COST = CostModel(fixed_s=1e-3, per_token_s=1e-5, per_context_token_s=1e-7, copy_fixed_s=1e-5, copy_bytes_per_s=1e9)


def sglang_engine(**kw) -> Engine:
    cfg = EngineConfig(num_blocks=kw.pop("num_blocks", 64), max_num_seqs=32, max_num_batched_tokens=512,
                       max_model_len=1024, oom_mode="preempt", admission="sglang", **kw)
    return Engine(ModelConfig(), cfg, executor=ProfiledExecutor(COST))


def test_the_defaults_are_sglangs():
    ratio = sglang_engine().scheduler.ratio
    assert (ratio.init, ratio.clip) == (0.7, 4096) and ratio.min == pytest.approx(0.7 * 0.14)
    assert ratio.step == pytest.approx((0.7 - 0.098) / 600)


def test_the_ratio_falls_linearly_over_decode_iterations_to_its_floor():
    eng = sglang_engine(sglang_new_token_ratio_decay_steps=50)
    eng.submit(Request("r", 0.0, 8, 400, 400))
    values = []
    while eng.step() and len(values) < 80:
        values.append(eng.scheduler.ratio.value)
    # one decay per iteration that decodes: the first iteration is the prefill, which does not
    assert values[0] == 0.7 and values[1] == pytest.approx(0.7 - 0.602 / 50) and values[2] == pytest.approx(0.7 - 2 * 0.602 / 50)
    assert values[50] == pytest.approx(0.098) and values[-1] == pytest.approx(0.098)


def test_admission_counts_the_ratio_of_what_may_still_be_generated():
    # 64 blocks x 16 = 1,024 tokens. Each request: 100 prompt tokens, max_tokens 600.
    eng = sglang_engine()
    for i in range(4):
        eng.submit(Request(f"r{i}", 0.0, 100, 600, 600))
    eng.step()
    # admitted while held + 0.7 x remaining fits: 100 + 0.7 x 600 = 520 each, so one alone (the
    # head always), and a second would need 1,040 > 1,024
    assert len(eng.scheduler.running) == 1
    held, future = eng.scheduler.sglang_books()
    assert held == 101 and future == 599  # the prefill produced the first token


def test_running_out_of_blocks_retracts_the_newest_and_resets_the_ratio():
    eng = sglang_engine(num_blocks=16, sglang_new_token_ratio_decay_steps=5)
    for i in range(3):
        eng.submit(Request(f"r{i}", 0.0, 40, 200, 200))
    while eng.counters.preemptions == 0:
        assert eng.step()
    ratio = eng.scheduler.ratio  # reset while scheduling the iteration, which then decoded once
    assert ratio.value == pytest.approx(ratio.init - ratio.step)
    while eng.step():
        pass
    assert len(eng.completed) == 3
