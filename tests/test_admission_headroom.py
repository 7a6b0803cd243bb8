"""The admission headroom (``Engine.set_admit_headroom``, the served shield's engine setting): while
anything is held, a new request is admitted only if that share of the KV stays free after its
prompt, with blocks that reclaiming would free (idle session contexts) counted as free."""
from __future__ import annotations

import pytest

from engine.config import EngineConfig, ModelConfig
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
