"""The admission headroom (``Engine.set_admit_headroom``, the served shield's engine setting): while
anything is held, a new request is admitted only if that share of the KV stays free after its
prompt, with blocks that reclaiming would free (idle session contexts) counted as free. The served
shield sizes it at each decision to hold the running batch's growth until the next one."""
from __future__ import annotations

import dataclasses

import pytest

from agents.shield import MAX_HEADROOM, TRAINING, Shield, growth_blocks
from engine.config import EngineConfig, ModelConfig
from engine.control import HOLD, run_interval
from engine.cost_model import CostModel
from engine.engine import Engine
from engine.executor import ProfiledExecutor
from engine.request import Request

COST = CostModel(fixed_s=1e-3, per_token_s=1e-5, per_context_token_s=1e-7, copy_fixed_s=1e-5, copy_bytes_per_s=1e9)


def engine(headroom: float) -> Engine:
    # 64 blocks of 16 tokens; a factor of 4 so that only the headroom can hold a request back
    cfg = EngineConfig(num_blocks=64, max_num_seqs=32, max_num_batched_tokens=1024, max_model_len=1024,
                       overcommit=4.0)
    eng = Engine(ModelConfig(), cfg, executor=ProfiledExecutor(COST))
    eng.set_admit_headroom(headroom)
    return eng


@pytest.mark.parametrize("headroom, admitted", [(0.0, {"a", "b"}), (0.2, {"a"})])
def test_a_prompt_that_would_leave_less_than_the_headroom_free_waits(headroom, admitted):
    eng = engine(headroom)
    eng.submit(Request("a", 0.0, 480, 300, 300))  # 30 blocks: 34 stay free
    eng.submit(Request("b", 0.0, 400, 300, 300))  # 25 more would leave 9, under 0.2 x 64 = 13
    eng.step()
    assert {s.request.request_id for s in eng.scheduler.running} == admitted
    while eng.step():
        pass
    assert len(eng.completed) == 2  # held back, never lost: it runs once "a" is done


def test_idle_session_contexts_count_as_free():
    eng = engine(0.2)
    eng.submit(Request("long", 0.0, 320, 600, 600))               # 20 blocks, decoding throughout
    eng.submit(Request("turn1", 0.0, 400, 1, 1, session_id="S"))  # leaves an idle context of 25 blocks
    while not eng.completed:
        eng.step()
    assert eng.sessions["S"].where == "device" and eng.sessions["S"].owner is None
    assert eng.kv.blocks.num_free == 64 - 20 - 25
    eng.submit(Request("new", eng.clock, 160, 10, 10))  # 10 blocks: 9 free after it (< 13), 34 with the context
    eng.step()
    assert "new" in {s.request.request_id for s in eng.scheduler.running}


def test_nothing_held_admits_the_head_whatever_the_headroom():
    eng = engine(0.9)
    eng.submit(Request("a", 0.0, 480, 5, 5))
    eng.step()
    assert [s.request.request_id for s in eng.scheduler.running] == ["a"]


@pytest.mark.parametrize("share", [-0.1, 1.0, float("nan")])
def test_a_headroom_outside_0_to_1_is_refused(share):
    with pytest.raises(ValueError, match="admission headroom"):
        engine(0.0).set_admit_headroom(share)


def test_growth_blocks_are_each_running_sequences_tokens_until_the_next_decision_in_whole_blocks():
    eng = engine(0.0)
    snap = dataclasses.replace(eng.snapshot(), running=10, decode_ms=25.0)  # 64 blocks of 16 tokens
    assert growth_blocks(snap, 2.0) == 10 * 5  # 80 tokens each: 5 blocks
    assert growth_blocks(snap, 0.39) == 10 * 1  # 15.6 tokens: a block
    for empty in ({"running": 0}, {"decode_ms": 0.0}):
        assert growth_blocks(dataclasses.replace(snap, **empty), 2.0) == 0
    assert growth_blocks(snap, 0.0) == 0
    # a decode time too small to mean anything (a sender's bug) bounds the growth by the whole KV, not by overflow
    assert growth_blocks(dataclasses.replace(snap, decode_ms=1e-310), 2.0) == 10 * 64
    shield = Shield()
    assert shield.headroom(snap) == MAX_HEADROOM  # 50 of 64 blocks: capped
    small = dataclasses.replace(snap, running=1)
    assert shield.headroom(small) == pytest.approx(shield.admit_headroom + 5 / 64)
    assert Shield(growth_interval_s=0.0).headroom(small) == shield.admit_headroom
    assert TRAINING.headroom(small) == 0.0
    assert shield.headroom(dataclasses.replace(small, preempt_mode=True)) == shield.headroom(small)  # steered as crash
    assert Shield(preempt_as_crash=False).headroom(dataclasses.replace(small, preempt_mode=True)) == 0.0


def crash_after_a_burst(shield: Shield, interval_s: float = 0.05) -> tuple[int, list[float]]:
    """60 long decodes run; one interval in, 60 chat prompts of 30 blocks each arrive; every
    interval the shield sets the headroom and filters a hold, as the environment does. The OOMs
    and the headroom of each interval."""
    cfg = EngineConfig(num_blocks=1024, max_num_seqs=256, max_num_batched_tokens=2048, max_model_len=4096,
                       overcommit=8.0, overcommit_max=8.0)
    eng = Engine(ModelConfig(), cfg, executor=ProfiledExecutor(COST))
    for i in range(60):
        eng.submit(Request(f"long{i}", 0.0, 16, 1000, 1000))
    snap, headrooms = eng.snapshot(), []
    for k in range(1, 12):
        if k == 2:
            for i in range(60):
                eng.submit(Request(f"chat{i}", eng.clock, 480, 16, 16))
        headrooms.append(eng.set_admit_headroom(shield.headroom(snap)))
        snap = run_interval(eng, shield.filter(HOLD, snap), k * interval_s).snapshot
    return eng.counters.oom_events, headrooms


def test_a_headroom_that_holds_the_batchs_growth_keeps_a_burst_from_crashing_the_engine():
    # a fixed 2 %: the queue fills the KV to 93 %, under the eviction's 95 %, and 80 decodes
    # outgrow the rest before the next decision
    ooms, headrooms = crash_after_a_burst(Shield(growth_interval_s=0.0))
    assert ooms == 1 and set(headrooms) == {0.02}
    ooms, headrooms = crash_after_a_burst(Shield(growth_interval_s=0.05))
    assert ooms == 0 and min(headrooms[1:]) > 0.08  # 60 to 80 sequences, a block or two each
