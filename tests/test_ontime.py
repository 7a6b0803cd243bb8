"""On-time tokens: goodput's tokens, and the tokens streamed so far by the requests still under way
that are on track for their SLO, which goodput (counting a request when it finishes) leaves out."""
from __future__ import annotations

import pytest

from engine.metrics import summarize
from engine.request import Request


def tokens(figures: dict, key: str) -> float:
    return figures[key] * figures["duration_s"]


def test_on_time_tokens_count_the_work_under_way_that_goodput_leaves_out(make_engine):
    eng = make_engine(num_blocks=64, block_size=4, segment_blocks=8, max_num_seqs=2, ttft_slo_s=5.0, tpot_slo_s=1.0)
    eng.submit(Request("short", 0.0, 8, 3, 3))
    eng.submit(Request("long", 0.0, 8, 40, 40))
    while not eng.completed:
        eng.step()
    long = next(q for q in eng.scheduler.running if q.id == "long")
    assert eng.completed[0].request_id == "short" and 1 <= long.num_generated < 40
    f = summarize(eng)
    assert tokens(f, "goodput_tokens_per_s") == pytest.approx(3)
    assert tokens(f, "ontime_tokens_per_s") == pytest.approx(3 + long.num_generated)

    eng.clock = long.record.first_token_s + 2.0 * long.num_generated  # its tokens now came at > 1 s each
    f = summarize(eng)
    assert tokens(f, "ontime_tokens_per_s") == pytest.approx(3) == tokens(f, "goodput_tokens_per_s")


def test_a_request_late_for_its_first_token_counts_nothing_and_a_finished_run_counts_goodput(make_engine):
    eng = make_engine(num_blocks=64, block_size=4, segment_blocks=8, max_num_seqs=1, ttft_slo_s=5.0, tpot_slo_s=1.0)
    eng.submit(Request("first", 0.0, 8, 4, 4))
    eng.submit(Request("late", 0.0, 8, 30, 30))  # waits behind the first: one sequence at a time
    while not eng.completed:
        eng.step()
    eng.clock += 10.0  # the second's first token comes past its 5 s target
    eng.step()
    eng.step()
    late = next(q for q in eng.scheduler.running if q.id == "late")
    assert late.num_generated >= 1 and late.record.ttft_s > 5.0
    f = summarize(eng)
    assert tokens(f, "ontime_tokens_per_s") == pytest.approx(4) == tokens(f, "goodput_tokens_per_s")
    eng.run()  # to the end: nothing under way, the two figures agree
    f = summarize(eng)
    assert len(eng.completed) == 2 and f["ontime_tokens_per_s"] == f["goodput_tokens_per_s"]
