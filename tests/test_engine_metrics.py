"""The engine's Prometheus metrics carry the engine's own figures under vLLM's names (and rlctl_
ones for the rest), scraped as Prometheus would; counters never go down."""
from __future__ import annotations

from dataclasses import replace

import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine.config import EngineConfig
from engine.cost_model import CostModel
from engine.executor import ProfiledExecutor
from env.workloads import ReplaySpec
from rlctl.online.engine_metrics import ITL_BUCKETS, TTFT_BUCKETS, EngineMetrics, buckets_1_2_5
from env.workloads import bundled_trace
from rlctl.replay import build_engine, load_requests
from tests.sidecar_process import scrape_text

DEPLOYMENT = EngineConfig(num_blocks=128, max_model_len=2048, restart_downtime_s=1.0)
COST = CostModel(fixed_s=1.5e-3, per_token_s=2e-5, per_context_token_s=2e-7, copy_fixed_s=1e-5, copy_bytes_per_s=2e9)
LABELS = {"model_name": "tiny", "engine": "0"}
COUNTERS = ("vllm:num_preemptions_total", "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
            "rlctl_oom_events_total", "rlctl_swap_out_bytes_total", "rlctl_swap_in_bytes_total",
            "rlctl_compactions_total", "rlctl_compaction_bytes_total", "vllm:prefix_cache_queries_total",
            "vllm:prefix_cache_hits_total")


def scrape(text: str) -> dict:
    """{(sample name, frozenset of labels other than model_name and engine): value}"""
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            assert {k: s.labels[k] for k in LABELS} == LABELS, s
            rest = frozenset((k, v) for k, v in s.labels.items() if k not in LABELS)
            out[(s.name, rest)] = s.value
    return out


def value(samples: dict, name: str, **labels) -> float:
    return samples[(name, frozenset(labels.items()))]


def burst_engine(factor: float = 3.0, oom: str = "crash", deployment: EngineConfig = DEPLOYMENT):
    spec = ReplaySpec(max_tokens="fixed:1024", time_scale=1000.0, duration_s=30.0, max_model_len=2048)
    requests = load_requests(bundled_trace("azure2023_conv.csv"), spec)
    engine = build_engine(deployment, factor, oom, executor=ProfiledExecutor(COST, materialize=False))
    for r in requests:
        engine.submit(r)
    return engine, requests


@pytest.fixture(scope="module")
def replay():
    """A burst at factor 3.0 (OOM crashes), with a compaction and an eviction along the way,
    scraped after every 2 s decision interval."""
    engine, requests = burst_engine()
    metrics = EngineMetrics(model_name="tiny", max_model_len=engine.max_model_len)
    scrapes, acted = [], False
    while engine.has_work():
        engine.run(until=engine.clock + 2.0)
        if not acted and len(engine.scheduler.running) >= 4:
            engine.evict(0.5)
            engine.compact()
            acted = True
        metrics.update(engine)
        scrapes.append(scrape(metrics.exposition().decode()))
    return engine, requests, metrics, scrapes


def test_metrics_carry_the_engines_figures(replay):
    engine, requests, _, scrapes = replay
    last, c = scrapes[-1], engine.counters
    assert c.oom_events > 0 and engine.kv.traffic.out_blocks > 0 and c.compactions == 1 and c.compaction_bytes > 0
    block = engine.pool.block_bytes
    assert value(last, "rlctl_oom_events_total") == c.oom_events
    assert value(last, "vllm:num_preemptions_total") == c.preemptions
    assert value(last, "vllm:prompt_tokens_total") == c.prefill_tokens
    assert value(last, "vllm:generation_tokens_total") == c.tokens_generated
    assert value(last, "rlctl_swap_out_bytes_total") == engine.kv.traffic.out_blocks * block
    assert value(last, "rlctl_swap_in_bytes_total") == engine.kv.traffic.in_blocks * block
    assert value(last, "rlctl_compactions_total") == 1
    assert value(last, "rlctl_compaction_bytes_total") == c.compaction_bytes
    assert value(last, "rlctl_kv_blocks_capacity") == 128
    assert value(last, "rlctl_kv_blocks_used") == engine.kv.blocks.num_used
    assert value(last, "vllm:kv_cache_usage_perc") == engine.kv.blocks.usage()
    assert value(last, "rlctl_kv_pool_footprint_bytes") == engine.pool.footprint_bytes()
    assert value(last, "rlctl_overcommit_factor") == 3.0
    assert value(last, "rlctl_device_free_bytes") == engine.device.free
    assert value(last, "vllm:num_requests_running") == value(last, "vllm:num_requests_waiting") == 0
    assert value(last, "rlctl_requests_swapped") == 0


def test_vllm_style_preemptions_are_counted():
    engine, _ = burst_engine(float("inf"), "preempt")
    metrics = EngineMetrics(model_name="tiny")
    while engine.has_work():
        engine.run(until=engine.clock + 2.0)
        metrics.update(engine)
    last = scrape(metrics.exposition().decode())
    assert value(last, "vllm:num_preemptions_total") == engine.counters.preemptions > 0
    assert value(last, "rlctl_oom_events_total") == 0
    assert value(last, "rlctl_overcommit_factor") == float("inf")
    assert value(last, "vllm:prefix_cache_queries_total") == value(last, "vllm:prefix_cache_hits_total") == 0


def test_a_prefix_caches_queries_and_hits_are_counted_in_tokens():
    # preempted requests take back the blocks the cache still holds of their own KV when readmitted
    engine, requests = burst_engine(float("inf"), "preempt", replace(DEPLOYMENT, prefix_caching=True))
    metrics = EngineMetrics(model_name="tiny")
    while engine.has_work():
        engine.run(until=engine.clock + 2.0)
        metrics.update(engine)
    last = scrape(metrics.exposition().decode())
    assert engine.counters.preemptions > 0
    assert value(last, "vllm:prefix_cache_hits_total") == engine.kv.prefix_hit_tokens > 0
    assert value(last, "vllm:prefix_cache_queries_total") == engine.kv.prefix_query_tokens
    assert engine.kv.prefix_query_tokens >= sum(r.prompt_len for r in requests)  # readmissions look up again


def test_every_finished_request_is_observed_once(replay):
    engine, requests, _, scrapes = replay
    last, done = scrapes[-1], engine.completed
    assert len(done) == len(requests)
    assert value(last, "vllm:time_to_first_token_seconds_count") == len(done)
    assert value(last, "vllm:time_to_first_token_seconds_sum") == pytest.approx(sum(r.ttft_s for r in done))
    assert value(last, "vllm:e2e_request_latency_seconds_count") == len(done)
    assert value(last, "vllm:request_time_per_output_token_seconds_count") == sum(1 for r in done if r.output_len >= 2)
    assert value(last, "vllm:request_time_per_output_token_seconds_sum") == pytest.approx(
        sum(r.tpot_s for r in done if r.tpot_s is not None))
    assert value(last, "vllm:inter_token_latency_seconds_count") == sum(it.decode_tokens for it in engine.iterations)
    assert value(last, "vllm:request_params_max_tokens_count") == len(done)
    assert value(last, "vllm:request_params_max_tokens_sum") == sum(r.max_tokens for r in done)
    for le in (500, 1000, 2000):  # declared 1024, less where the prompt leaves less room in 2048
        assert value(last, "vllm:request_params_max_tokens_bucket", le=f"{le}.0") == sum(r.max_tokens <= le for r in done)
    assert value(last, "vllm:time_to_first_token_seconds_bucket", le="+Inf") == len(done)
    assert value(last, "vllm:time_to_first_token_seconds_bucket", le="1.0") == sum(1 for r in done if r.ttft_s <= 1.0)
    assert {float(le) for (name, labels) in last if name == "vllm:time_to_first_token_seconds_bucket"
            for k, le in labels if le != "+Inf"} == set(TTFT_BUCKETS)
    by_reason = {dict(labels)["finished_reason"]: v for (name, labels), v in last.items()
                 if name == "vllm:request_success_total"}
    assert sum(by_reason.values()) == len(done)
    assert by_reason["length"] == sum(1 for r in done if r.output_len >= r.max_tokens)


def test_inter_token_latency_is_observed_per_token_as_the_time_since_the_sequences_previous_token():
    """At factor 1.0 nothing is preempted, crashed or swapped, so every token after a request's
    first comes from a decode in the iteration after its previous one: one observation per such
    token, and a request's observations add up to its decode time (finish - first token)."""
    engine, requests = burst_engine(factor=1.0)
    metrics = EngineMetrics(model_name="tiny")
    while engine.has_work():
        engine.run(until=engine.clock + 2.0)
        metrics.update(engine)
    assert engine.counters.oom_events == engine.counters.preemptions == engine.kv.traffic.out_blocks == 0
    done, last = engine.completed, scrape(metrics.exposition().decode())
    assert len(done) == len(requests)
    tokens = sum(r.output_len - 1 for r in done)
    assert value(last, "vllm:inter_token_latency_seconds_count") == tokens > 10 * len(done)  # per token
    assert value(last, "vllm:inter_token_latency_seconds_sum") == pytest.approx(
        sum(r.finish_s - r.first_token_s for r in done), rel=1e-9)
    # each iteration's decode tokens, at the time since the iteration before it ended
    ends = [it.end_s for it in engine.iterations]
    waits = [e - p for p, e, it in zip(ends, ends[1:], engine.iterations[1:]) for _ in range(it.decode_tokens)]
    assert len(waits) == tokens
    for le in ITL_BUCKETS:
        assert value(last, "vllm:inter_token_latency_seconds_bucket", le=str(float(le))) == sum(w <= le for w in waits)
    # the request-level mean is the other histogram, one observation per request
    assert value(last, "vllm:request_time_per_output_token_seconds_count") == sum(r.output_len >= 2 for r in done)


def test_max_tokens_buckets_are_vllms_1_2_5_series_up_to_the_model_length():
    assert buckets_1_2_5(2048) == (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000)
    assert buckets_1_2_5(100) == (1, 2, 5, 10, 20, 50, 100)


def test_gauges_follow_the_engine_during_the_replay(replay):
    _, _, _, scrapes = replay
    assert max(value(s, "vllm:num_requests_running") for s in scrapes) > 0
    assert max(value(s, "vllm:num_requests_waiting") for s in scrapes) > 0
    assert max(value(s, "vllm:kv_cache_usage_perc") for s in scrapes) > 0.5
    assert all(0 <= value(s, "rlctl_frag_entropy") <= 1 for s in scrapes)
    assert all(0 <= value(s, "vllm:kv_cache_usage_perc") <= 1 for s in scrapes)


def test_counters_never_decrease_across_updates(replay):
    _, _, _, scrapes = replay
    assert len(scrapes) > 3
    for name in COUNTERS + ("vllm:time_to_first_token_seconds_count",):
        series = [value(s, name) for s in scrapes]
        assert series == sorted(series), name
    assert value(scrapes[0], "rlctl_oom_events_total") < value(scrapes[-1], "rlctl_oom_events_total")


def test_a_new_engine_adds_to_the_counters_instead_of_resetting_them():
    metrics = EngineMetrics(model_name="tiny")
    first, _ = burst_engine()
    first.run(until=2.0)
    metrics.update(first)
    before = scrape(metrics.exposition().decode())
    second, _ = burst_engine(factor=1.0)  # the live loop restarted the engine: its counters start at 0
    second.run(until=0.5)
    metrics.update(second)
    after = scrape(metrics.exposition().decode())
    assert value(after, "vllm:generation_tokens_total") == (first.counters.tokens_generated
                                                            + second.counters.tokens_generated)
    for name in COUNTERS:
        assert value(after, name) >= value(before, name), name
    assert value(after, "vllm:time_to_first_token_seconds_count") == len(first.completed) + len(second.completed)


def test_fallbacks_are_counted_by_reason_and_served_over_http():
    metrics = EngineMetrics(model_name="tiny")
    engine, _ = burst_engine(factor=1.0)
    metrics.update(engine)
    metrics.fallback("deadline")
    metrics.fallback("deadline")
    metrics.fallback("invalid")
    server, thread = metrics.start_http(0)
    try:
        samples = scrape(scrape_text(server.server_port))
    finally:
        server.shutdown()
        server.server_close()
    assert value(samples, "rlctl_controller_fallbacks_total", reason="deadline") == 2
    assert value(samples, "rlctl_controller_fallbacks_total", reason="invalid") == 1
    assert value(samples, "rlctl_controller_fallbacks_total", reason="connection") == 0  # there before any
    assert value(samples, "vllm:request_success_total", finished_reason="stop") == 0
    assert value(samples, "vllm:num_requests_running") == 0
