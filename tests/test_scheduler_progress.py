"""The scheduler never stalls: with nothing running, the head of the queue gets its blocks."""
from __future__ import annotations

from engine.request import Request


def test_idle_session_contexts_give_way_to_a_new_request_when_nothing_runs(make_engine):
    eng = make_engine(num_blocks=16, block_size=4, segment_blocks=4)
    eng.submit(Request("turn-1", 0.0, 40, 10, 10, session_id="S"))  # leaves a 13-block idle context
    eng.run()
    assert eng.sessions["S"].where == "device" and eng.kv.blocks.num_free == 3
    eng.submit(Request("big", eng.clock, 30, 4, 4))  # needs 8 blocks now: only dropping S frees them
    eng.run(max_iterations=1000)
    assert eng.records["big"].finish_s is not None
    assert eng.sessions["S"].where == "dropped" and eng.counters.contexts_dropped == 1


def test_a_factor_below_one_still_admits_the_head_when_nothing_is_held(make_engine):
    eng = make_engine(num_blocks=16, block_size=4, segment_blocks=4, overcommit=0.5, overcommit_min=0.5)
    eng.submit(Request("a", 0.0, 20, 8, 20))  # peak 10 blocks > 0.5 x 16
    eng.submit(Request("b", 0.0, 4, 4, 4))
    eng.step()
    assert [s.id for s in eng.scheduler.running] == ["a"]  # b waits: a's peak already fills the quota
    eng.run(max_iterations=1000)
    assert eng.records["a"].finish_s is not None and eng.records["b"].finish_s is not None
    assert eng.records["b"].first_token_s >= eng.records["a"].finish_s
