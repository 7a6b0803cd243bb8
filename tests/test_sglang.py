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
                       max_model_len=kw.pop("max_model_len", 1024), oom_mode="preempt", admission="sglang", **kw)
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
    held, future, full = eng.scheduler.sglang_books()
    assert (held, future, full) == (101, 599, 0)  # the prefill produced the first token


def test_sglangs_code_charges_the_request_it_admits_in_full():
    # 128 blocks x 16 = 2,048 tokens. Each request: 100 prompt tokens, max_tokens 600. At the ratio
    # (issue 9's rule) each counts 100 + 0.7 x 600 = 520: three fit (1,560), four (2,080) do not.
    # SGLang's code charges each one admitted in this iteration 100 + 600 in full: two (1,400)
    # fit, three (2,100) do not.
    counts = {}
    for rule in ("spec", "code"):
        eng = sglang_engine(num_blocks=128, sglang_rule=rule)
        for i in range(5):
            eng.submit(Request(f"r{i}", 0.0, 100, 600, 600))
        eng.step()
        counts[rule] = len(eng.scheduler.running)
        if rule == "code":  # once running, they are weighed at the ratio: the next iteration admits more
            held, future, full = eng.scheduler.sglang_books()
            assert full == 0 and held + 0.7 * future + 700 <= 2048
            eng.step()
            assert len(eng.scheduler.running) == 3
    assert counts == {"spec": 3, "code": 2}


@pytest.mark.parametrize("rule", ["spec", "code"])
def test_sglangs_code_tries_again_only_once_the_running_batch_shrinks(rule):
    # 128 blocks x 16 = 2,048 tokens. "a" runs (declared 1,500, it stops at 30); "b" (100 + 1,000)
    # arrives and is refused: 101 + 0.7 x 1,499 + 1,100 reaches 2,048. As the ratio falls the rule
    # alone would let b in within a few iterations; SGLang's code marked its running batch full at
    # the refusal (``batch_is_full``) and tries again only when the batch shrinks: when a finishes
    eng = sglang_engine(num_blocks=128, max_model_len=2048, sglang_rule=rule, sglang_new_token_ratio_decay_steps=10)
    eng.submit(Request("a", 0.0, 100, 30, 1500))
    eng.step()
    eng.submit(Request("b", eng.clock, 100, 20, 1000))
    admitted_at = None
    for i in range(40):
        eng.step()
        if admitted_at is None and any(q.request.request_id == "b" for q in eng.scheduler.running):
            admitted_at = i
        if i == 20 and rule == "code":  # the rule alone admits b now; the mark holds it
            s = eng.scheduler
            assert not s.sglang_over(s.sglang_books(), s.waiting[0], s.ratio.value) and s.ratio.batch_full
    a_done = eng.records["a"].finish_s is not None
    assert a_done
    if rule == "code":
        assert admitted_at is not None and eng.records["b"].first_token_s >= eng.records["a"].finish_s
    else:
        assert admitted_at is not None and admitted_at < 10 and eng.records["b"].first_token_s < eng.records["a"].finish_s


def test_sglangs_code_refuses_a_request_that_reaches_the_capacity_and_books_its_declared_tokens():
    # 128 blocks x 16 = 2,048 tokens. The head is admitted whatever the rule and booked 100 + 600;
    # a second of 148 + 1,200 reaches 2,048 exactly: SGLang refuses it (``>=``), one token less fits.
    for max_tokens, admitted in ((1200, 1), (1199, 2)):
        eng = sglang_engine(num_blocks=128, max_model_len=2048, sglang_rule="code")
        eng.submit(Request("a", 0.0, 100, 600, 600))
        eng.submit(Request("b", 0.0, 148, max_tokens, max_tokens))
        eng.step()
        assert len(eng.scheduler.running) == admitted
    # a request admitted in the iteration is booked its declared max_tokens (clipped), not what
    # it has left, as SGLang's _select_prefill_admission books it; issue 9's rule books what is left
    seq = eng.scheduler.running[0]
    for _ in range(5):
        eng.step()
    assert seq.num_generated == 6
    assert eng.scheduler.sglang_with((0, 0, 0), seq) == (0, 0, len(seq) + 600)
    spec = sglang_engine(num_blocks=128, max_model_len=2048)
    assert spec.scheduler.sglang_with((0, 0, 0), seq) == (len(seq), 594, 0)


def test_a_retract_that_leaves_nothing_running_starts_the_ratio_again():
    # SGLang never retracts its last request; rlctl's engine must when a co-tenant holds the
    # memory it needs, and then there is nothing to re-estimate the ratio from
    ratio = sglang_engine(sglang_rule="code").scheduler.ratio
    ratio.value = 0.2
    ratio.estimate_after_retract([], 20)
    assert ratio.value == ratio.init


def test_sglangs_code_resets_the_ratio_when_idle_and_issue_9s_rule_does_not():
    values = {}
    for rule in ("spec", "code"):
        eng = sglang_engine(sglang_rule=rule, sglang_new_token_ratio_decay_steps=50)
        eng.submit(Request("a", 0.0, 8, 30, 30))
        eng.submit(Request("b", 100.0, 8, 30, 30))
        while not eng.completed:
            eng.step()
        decayed = eng.scheduler.ratio.value
        eng.step()  # idle until b arrives, then b's prefill (which does not decode: no decay)
        values[rule] = (decayed, eng.scheduler.ratio.value)
    step = (0.7 - 0.098) / 50
    assert values["spec"][0] == values["code"][0] == pytest.approx(0.7 - 29 * step)
    assert values["spec"][1] == values["spec"][0] and values["code"][1] == 0.7
    # idle up to a time limit (``run(until=...)``), with nothing to step, is idle too
    for rule, expected in (("spec", 0.7 - 29 * step), ("code", 0.7)):
        eng = sglang_engine(sglang_rule=rule, sglang_new_token_ratio_decay_steps=50)
        eng.submit(Request("a", 0.0, 8, 30, 30))
        eng.submit(Request("b", 100.0, 8, 30, 30))
        eng.run(until=50.0)
        assert eng.completed and eng.clock == 50.0 and eng.scheduler.ratio.value == pytest.approx(expected)


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


def test_sglangs_own_retract_takes_the_fewest_outputs_requeues_at_the_back_and_re_estimates_the_ratio():
    eng = sglang_engine(num_blocks=16, sglang_new_token_ratio_decay_steps=5, sglang_rule="code",
                        sglang_clip_max_new_tokens=16)  # a short clip: the full charge lets all three in
    for i in range(3):
        eng.submit(Request(f"r{i}", 0.0, 40 - 10 * i, 200, 200))  # r2 has the shortest prompt
    before = {}
    while eng.counters.preemptions == 0:
        before = {s.request.request_id: (s.num_generated, -s.request.prompt_len) for s in eng.scheduler.running}
        assert eng.step()
    (victim,) = [s for s in eng.scheduler.waiting if s.record.preemptions]
    # the fewest outputs when the retract was made (of those, the longest prompt), not the newest
    assert victim.request.request_id == min(before, key=before.get)
    assert eng.scheduler.waiting[-1] is victim  # last in the queue
    running = eng.scheduler.running
    ratio = eng.scheduler.ratio  # re-estimated while scheduling; SGLang's code does not decay it in that batch
    estimate = min(1.0, (sum(s.num_generated - 1 for s in running) + 20 * len(running))
                   / (sum(s.request.max_tokens for s in running) + 1))
    assert ratio.value == pytest.approx(estimate)
    assert eng.step() and eng.counters.preemptions == 1
    assert ratio.value == pytest.approx(max(estimate - ratio.step, ratio.min))  # the next decode batch decays it
    while eng.step():
        pass
    assert len(eng.completed) == 3


def test_the_rule_is_checked_and_sglang_code_names_sglangs_own():
    from agents.spec import make_policy

    with pytest.raises(ValueError, match="sglang_rule must be 'spec' or 'code'"):
        EngineConfig(sglang_rule="sglang")
    assert make_policy("sglang_code").engine_overrides == {"admission": "sglang", "oom_mode": "preempt",
                                                           "sglang_rule": "code"}
    assert make_policy("sglang").engine_overrides == {"admission": "sglang", "oom_mode": "preempt"}
