"""Clients give up: with ``client_timeout_s`` a request that has had no first token that long
after its arrival leaves the engine, wherever it is (waiting, running its prefill, on the host),
as vLLM aborts the request of a client that disconnected, and a request that has started
streaming is never given up."""
from __future__ import annotations

import math

import pytest

from engine.config import EngineConfig, ModelConfig
from engine.cost_model import CostModel
from engine.engine import Engine
from engine.executor import ProfiledExecutor
from engine.metrics import mark, since, summarize
from engine.request import Request
from engine.sequence import Status


# the real model on real KV tensors, timed by a stated cost model: 50 ms an iteration, whatever the machine
COST = CostModel(fixed_s=0.05, per_token_s=0.0, per_context_token_s=0.0, copy_fixed_s=1e-5, copy_bytes_per_s=2e9)


@pytest.fixture
def make_engine():
    def make(**kw) -> Engine:
        return Engine(ModelConfig(), EngineConfig(**kw), executor=ProfiledExecutor(COST, materialize=True))
    return make


def books_balance(eng) -> None:
    s = eng.scheduler
    held = sum(len(q.block_table) for q in s.running + list(s.waiting) + list(s.swapped))
    held += sum(len(c.block_table) for c in eng.sessions.values())
    assert held == eng.kv.blocks.num_used


def test_a_request_waiting_past_the_timeout_leaves_and_the_rest_are_served(make_engine):
    # room for one request at a time: the second waits behind the first's whole output
    eng = make_engine(num_blocks=8, block_size=4, segment_blocks=4, max_model_len=32, client_timeout_s=0.5)
    eng.submit(Request("first", 0.0, 8, 20, 20))
    eng.submit(Request("second", 0.0, 8, 20, 20))
    eng.run()
    first, second = eng.records["first"], eng.records["second"]
    assert first.finish_s is not None and first.finish_s > 0.9  # served whole, however long it ran
    assert second.first_token_s is None and second.finish_s is None
    assert second.abandoned_s is not None and second.abandoned_s >= second.arrival_s + 0.5
    assert eng.counters.abandoned == 1 and not eng.scheduler.waiting
    assert summarize(eng)["requests_abandoned"] == 1 and summarize(eng)["requests_completed"] == 1
    books_balance(eng)


def test_without_a_timeout_every_request_waits_its_turn(make_engine):
    eng = make_engine(num_blocks=8, block_size=4, segment_blocks=4, max_model_len=32)
    eng.submit(Request("first", 0.0, 8, 20, 20))
    eng.submit(Request("second", 0.0, 8, 20, 20))
    eng.run()
    assert eng.records["second"].finish_s is not None and eng.counters.abandoned == 0


def test_a_preempted_request_that_has_streamed_is_not_given_up(make_engine):
    # overcommitted in preempt mode: the newest is recomputed after its first tokens, and waits long
    eng = make_engine(num_blocks=10, block_size=4, segment_blocks=2, max_model_len=40, oom_mode="preempt",
                      overcommit=3.0, overcommit_max=3.0, client_timeout_s=0.3)
    for i in range(3):
        eng.submit(Request(f"r{i}", 0.0, 4, 30, 30))
    eng.run()
    preempted = [r for r in eng.records.values() if r.preemptions]
    assert preempted and all(r.finish_s is not None and r.abandoned_s is None for r in preempted)
    assert all(r.finish_s is not None for r in eng.records.values() if r.first_token_s is not None)
    books_balance(eng)


def test_a_session_turn_given_up_leaves_its_session_to_the_next_turn(make_engine):
    # a factor that admits anything: the free blocks decide
    eng = make_engine(num_blocks=12, block_size=4, segment_blocks=4, max_model_len=48, overcommit=4.0,
                      overcommit_max=4.0, client_timeout_s=0.1)
    eng.submit(Request("turn-1", 0.0, 8, 4, 4, session_id="S"))
    eng.run()
    assert len(eng.sessions["S"].block_table) == 3  # a 12-token context kept on the device
    eng.submit(Request("long", eng.clock, 4, 30, 30))
    eng.run(max_iterations=26)  # long holds 8 blocks: one is free
    # the next turn takes its context's blocks, cannot get the two more its prompt needs, gives them
    # back and waits holding its session, until its client gives up
    eng.submit(Request("turn-2", eng.clock, 8, 4, 4, session_id="S"))
    eng.step()
    assert eng.sessions["S"].owner == "turn-2" and eng.scheduler.waiting[0].id == "turn-2"
    eng.run()
    turn2 = eng.records["turn-2"]
    assert turn2.abandoned_s is not None and turn2.first_token_s is None
    assert eng.sessions["S"].owner is None
    eng.submit(Request("turn-3", eng.clock, 4, 4, 4, session_id="S"))
    eng.run()
    assert eng.records["turn-3"].finish_s is not None and eng.records["long"].finish_s is not None
    books_balance(eng)


def test_a_request_whose_prefill_outlasts_the_timeout_is_given_up_and_its_blocks_freed(make_engine):
    # a 64-token prompt in chunks of 8: eight 50 ms iterations before its first token
    eng = make_engine(num_blocks=16, block_size=4, segment_blocks=4, max_model_len=64, max_num_batched_tokens=8,
                      client_timeout_s=0.2)
    eng.submit(Request("long-prompt", 0.0, 60, 4, 4))
    eng.run(max_iterations=3)
    assert eng.scheduler.running and eng.kv.blocks.num_used > 0  # admitted, mid-prefill
    eng.run()
    r = eng.records["long-prompt"]
    assert r.abandoned_s is not None and r.first_token_s is None and r.finish_s is None
    assert not eng.scheduler.running and eng.kv.blocks.num_used == 0


def test_a_request_evicted_to_the_host_before_its_first_token_is_given_up_and_its_host_copy_dropped(make_engine):
    eng = make_engine(num_blocks=32, block_size=4, segment_blocks=4, max_model_len=64, max_num_batched_tokens=8,
                      client_timeout_s=0.2)
    eng.submit(Request("other", 0.0, 4, 40, 40))
    eng.submit(Request("long-prompt", 0.0, 60, 4, 4))
    eng.run(max_iterations=2)
    assert len(eng.scheduler.running) == 2 and eng.records["long-prompt"].first_token_s is None
    # the newest goes to the host mid-prefill, and stays there while "other" runs: the eviction's free
    # share leaves no room to bring it back
    eng.evict(0.85)
    assert [q.id for q in eng.scheduler.swapped] == ["long-prompt"] and eng.kv.host.used > 0
    eng.run()
    assert eng.records["long-prompt"].abandoned_s is not None and eng.records["other"].finish_s is not None
    assert not eng.scheduler.swapped and eng.kv.host.used == 0 and eng.kv.blocks.num_used == 0


def test_a_request_given_up_counts_against_the_slo_in_the_interval_it_left(make_engine):
    # a TTFT target longer than the timeout: nobody waits late, yet the client that left was not served
    eng = make_engine(num_blocks=8, block_size=4, segment_blocks=4, max_model_len=32, client_timeout_s=0.5,
                      ttft_slo_s=10.0)
    eng.submit(Request("first", 0.0, 8, 20, 20))
    eng.submit(Request("second", 0.0, 8, 20, 20))
    start = mark(eng)
    eng.run(until=0.3)
    assert since(eng, start)["slo_violation"] == 0.0
    start = mark(eng)
    eng.run()
    assert eng.counters.abandoned == 1
    figures = since(eng, start)
    assert figures["slo_violation"] == pytest.approx(0.5)  # of the first, served on time, and the second, given up


@pytest.mark.parametrize("bad", [0.0, -1.0, math.inf, math.nan])
def test_a_timeout_that_is_not_a_positive_number_of_seconds_is_refused(bad):
    with pytest.raises(ValueError, match="client_timeout_s"):
        EngineConfig(client_timeout_s=bad)


def test_an_abandoned_sequence_is_marked_so(make_engine):
    eng = make_engine(num_blocks=8, block_size=4, segment_blocks=4, max_model_len=32, client_timeout_s=0.2)
    eng.submit(Request("first", 0.0, 8, 20, 20))
    eng.submit(Request("second", 0.0, 8, 20, 20))
    eng.step()
    seq = eng.scheduler.waiting[0]
    eng.run()
    assert seq.status is Status.ABANDONED and not seq.block_table


def test_a_replay_with_clients_that_give_up_counts_them(tmp_path, capsys):
    import json

    from env.workloads import bundled_trace
    from rlctl.cli import main

    trace = str(bundled_trace("azure2023_conv.csv"))

    figures = {}
    for timeout in (None, 0.05):
        js = tmp_path / f"{timeout}.json"
        assert main(["replay", "--trace", trace, "--time-scale", "40", "--duration", "15",
                     "--blocks", "64", "--max-tokens", "fixed:512", "--json", str(js)]
                    + (["--client-timeout", str(timeout)] if timeout else [])) == 0
        table = capsys.readouterr().out
        assert ("given up by clients" in table) == (timeout is not None)
        figures[timeout] = json.loads(js.read_text())
    assert figures[None]["requests_abandoned"] == 0 and figures[0.05]["requests_abandoned"] > 0
    assert figures[0.05]["engine"]["client_timeout_s"] == 0.05
    assert main(["replay", "--trace", trace, "--client-timeout", "0"]) == 2
    assert "--client-timeout must be a finite number of seconds > 0" in capsys.readouterr().err
    assert main(["replay", "--node", "node_chat_pair", "--controller", f"unix://{tmp_path}/none.sock",
                 "--client-timeout", "5"]) == 2
    assert "--client-timeout applies to one engine's replay" in capsys.readouterr().err


def test_a_copy_a_lookahead_rolls_forward_gives_up_the_same_requests():
    from engine.clone import clone

    eng = Engine(ModelConfig(), EngineConfig(num_blocks=8, block_size=4, segment_blocks=4, max_model_len=32,
                                             client_timeout_s=0.5), executor=ProfiledExecutor(COST))
    for i in range(4):
        eng.submit(Request(f"r{i}", 0.1 * i, 8, 20, 20))
    eng.run(until=0.3)
    copy = clone(eng)
    eng.run()
    copy.run()
    given_up = lambda e: sorted(r.request_id for r in e.records.values() if r.abandoned_s is not None)  # noqa: E731
    assert given_up(eng) == given_up(copy) and len(given_up(eng)) >= 2
    assert copy.counters == eng.counters and copy.clock == eng.clock


def test_the_engine_metrics_count_requests_given_up_as_vllm_counts_aborted_ones(make_engine):
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from rlctl.online.engine_metrics import EngineMetrics

    eng = make_engine(num_blocks=8, block_size=4, segment_blocks=4, max_model_len=32, client_timeout_s=0.5)
    for i in range(3):
        eng.submit(Request(f"r{i}", 0.0, 8, 20, 20))
    metrics = EngineMetrics(model_name="tiny")
    while eng.has_work():
        eng.run(until=eng.clock + 0.3)
        metrics.update(eng)

    def success(reason: str) -> float:
        return next(s.value for f in text_string_to_metric_families(generate_latest(metrics.registry).decode())
                    for s in f.samples if s.name == "vllm:request_success_total"
                    and s.labels["finished_reason"] == reason)

    assert eng.counters.abandoned == 2 and success("abort") == 2
    assert success("length") + success("stop") == len(eng.completed) == 1
