"""Prometheus metrics of an engine, with vLLM's names where vLLM has one.

``EngineMetrics(registry).update(engine)``, called each decision interval, reads the engine's state
and cumulative counters into a ``CollectorRegistry`` of its own:

* vLLM v1's names (labels ``model_name`` and ``engine``): ``vllm:num_requests_running``,
  ``vllm:num_requests_waiting``, ``vllm:kv_cache_usage_perc`` (0 to 1), ``vllm:num_preemptions_total``,
  ``vllm:prompt_tokens_total`` (prefill tokens processed, recomputation included),
  ``vllm:generation_tokens_total``, ``vllm:request_success_total`` (``finished_reason``: "length" when
  a request reached ``max_tokens`` or the model length, "abort" when its client gave up before its
  first token (``client_timeout_s``), else "stop"), ``vllm:prefix_cache_queries_total`` and
  ``vllm:prefix_cache_hits_total`` (prompt tokens looked up in the prefix cache at admission, and
  found: ``EngineConfig.prefix_caching``; both stay 0 without it), and the histograms, with
  vLLM's buckets:
  - ``vllm:time_to_first_token_seconds``, ``vllm:e2e_request_latency_seconds``, and
    ``vllm:request_time_per_output_token_seconds`` (each request's mean time per output token),
    observed once per request when it finishes;
  - ``vllm:request_params_max_tokens``: each finished request's declared ``max_tokens``, the
    quantity overcommit bets on (buckets 1, 2, 5, 10, ... up to the model length);
  - ``vllm:inter_token_latency_seconds``: one observation per decode token, the time since that
    sequence's previous token. The engine logs every iteration (``engine.iterations``), and every
    running sequence decodes in every iteration, so a decode token's latency is the time from the
    end of the previous iteration to the end of its own: the iteration's duration plus any wait
    between the two (a device wait). Two cases read shorter than the sequence saw, because the
    engine keeps no per-sequence token times: the first token after a sequence returns from host
    memory (its time there is not counted), and a token made by recomputing a preempted or crashed
    sequence, a prefill, which is not observed at all; both pauses show in the request's TPOT and
    e2e latency.
* ``rlctl_`` names, sizes in bytes, for what vLLM v1 does not report: OOM events, requests swapped
  to host memory (``rlctl_requests_swapped``; vLLM v0's ``vllm:num_requests_swapped``, gone in v1,
  which does not swap), the KV pool's footprint, blocks, the overcommit factor and reserved demand,
  free device memory, swap and compaction traffic, fragmentation, and the live loop's fallbacks
  (``fallback(reason)``). Gauges carry no ``_total`` suffix, which Prometheus keeps for counters.

Counters only go up: each update adds the difference to the engine's cumulative values. A new
engine (the live loop restarted it) starts its differences from zero, so the counters keep counting.
Times are engine-clock seconds, the clock every figure of the engine is in.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest, start_http_server

# vLLM v1's buckets (vllm/v1/metrics/loggers.py)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0)
LABELS = ("model_name", "engine")
DEFAULT_MAX_MODEL_LEN = 1_000_000  # max_tokens buckets when the model length is not given
FINISHED_REASONS = ("stop", "length", "abort")
# why the live loop (rlctl/online/live.py, which imports this list) took a decision from its safe static
# policy: a deadline miss, a lost connection, another RPC error, a decision that failed its check
FALLBACK_REASONS = ("deadline", "connection", "error", "invalid")


def buckets_1_2_5(max_value: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to ``max_value``: vLLM's buckets for token counts."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_value:
                return tuple(out)
            out.append(m * scale)
        scale *= 10


def _counters(engine) -> dict[str, int]:
    """The engine's cumulative values, by the counter that reports each."""
    c, traffic, block = engine.counters, engine.traffic, engine.pool_block_bytes
    return {
        "preemptions": c.preemptions, "prompt_tokens": c.prefill_tokens, "generation_tokens": c.tokens_generated,
        "oom_events": c.oom_events, "swap_out_bytes": traffic.out_blocks * block,
        "swap_in_bytes": traffic.in_blocks * block, "compactions": c.compactions,
        "compaction_bytes": c.compaction_bytes, "prefix_cache_queries": engine.kv.prefix_query_tokens,
        "prefix_cache_hits": engine.kv.prefix_hit_tokens,
    }


class EngineMetrics:
    def __init__(self, registry: CollectorRegistry | None = None, model_name: str = "rlctl", engine: str = "0",
                 fallback_reasons: tuple[str, ...] = FALLBACK_REASONS, max_model_len: int | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self.labels = (model_name, engine)
        r = self.registry

        def gauge(name: str, doc: str):
            return Gauge(name, doc, LABELS, registry=r).labels(*self.labels)

        def counter(name: str, doc: str):
            return Counter(name, doc, LABELS, registry=r).labels(*self.labels)

        def histogram(name: str, doc: str, buckets):
            return Histogram(name, doc, LABELS, buckets=buckets, registry=r).labels(*self.labels)

        self.running = gauge("vllm:num_requests_running", "Number of requests in model execution batches.")
        self.waiting = gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.")
        self.swapped = gauge("rlctl_requests_swapped", "Requests swapped out to host memory "
                             "(vLLM v0's vllm:num_requests_swapped).")
        self.kv_usage = gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
        self.counters = {
            "preemptions": counter("vllm:num_preemptions_total", "Cumulative number of preemptions from the engine."),
            "prompt_tokens": counter("vllm:prompt_tokens_total", "Number of prefill tokens processed."),
            "generation_tokens": counter("vllm:generation_tokens_total", "Number of generation tokens processed."),
            "oom_events": counter("rlctl_oom_events_total", "Out-of-memory crashes (the engine restarted, KV lost)."),
            "swap_out_bytes": counter("rlctl_swap_out_bytes_total", "KV bytes moved from the device to host memory."),
            "swap_in_bytes": counter("rlctl_swap_in_bytes_total",
                                     "KV bytes moved from host memory back to the device."),
            "compactions": counter("rlctl_compactions_total", "KV pool compactions."),
            "compaction_bytes": counter("rlctl_compaction_bytes_total", "KV bytes moved by compactions."),
            "prefix_cache_queries": counter("vllm:prefix_cache_queries_total",
                                            "Prefix cache queries, in terms of number of queried tokens."),
            "prefix_cache_hits": counter("vllm:prefix_cache_hits_total",
                                         "Prefix cache hits, in terms of number of cached tokens."),
        }
        self.success = Counter("vllm:request_success_total", "Count of successfully processed requests.",
                               LABELS + ("finished_reason",), registry=r)
        self.ttft = histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              TTFT_BUCKETS)
        self.itl = histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                             ITL_BUCKETS)
        self.tpot = histogram("vllm:request_time_per_output_token_seconds",
                              "Histogram of time_per_output_token_seconds per request.", ITL_BUCKETS)
        self.max_tokens = histogram("vllm:request_params_max_tokens", "Histogram of the max_tokens request parameter.",
                                    buckets_1_2_5(max_model_len or DEFAULT_MAX_MODEL_LEN))
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                             E2E_BUCKETS)
        self.footprint = gauge("rlctl_kv_pool_footprint_bytes", "Device bytes the KV pool holds (its segments).")
        self.host_bytes = gauge("rlctl_kv_host_bytes", "Host bytes holding evicted KV blocks.")
        self.blocks_capacity = gauge("rlctl_kv_blocks_capacity", "KV blocks the engine may hold.")
        self.blocks_used = gauge("rlctl_kv_blocks_used", "KV blocks in use.")
        self.overcommit = gauge("rlctl_overcommit_factor", "Overcommit factor in force.")
        self.reserved = gauge("rlctl_reserved_ratio", "Admitted peak demand over KV capacity.")
        self.device_free = gauge("rlctl_device_free_bytes", "Free bytes of the engine's device, by its ledger.")
        self.device_capacity = gauge("rlctl_device_capacity_bytes", "Capacity of the engine's device, by its ledger.")
        self.frag = gauge("rlctl_frag_entropy", "Normalised entropy of the free-run lengths of the block map (0 to 1).")
        self.restarting = gauge("rlctl_restarting", "1 while the engine restarts after an OOM crash.")
        self.fallbacks = Counter("rlctl_controller_fallbacks_total",
                                 "Decisions the live loop took from its safe static policy instead of the controller.",
                                 LABELS + ("reason",), registry=r)
        for reason in FINISHED_REASONS:  # every series there from the first scrape, at 0
            self.success.labels(*self.labels, reason)
        for reason in fallback_reasons:
            self.fallbacks.labels(*self.labels, reason)
        self._engine = None
        self._last: dict[str, int] = {}
        self._completed = 0  # cursors into engine.completed and engine.iterations
        self._iterations = 0

    def update(self, engine) -> None:
        """Read ``engine`` now: gauges set, counters advanced, newly finished requests observed."""
        if engine is not self._engine:  # a new engine: its cumulative values and logs start at zero
            self._engine, self._last, self._completed, self._iterations = engine, {}, 0, 0
        dev = engine.device
        waiting, running, swapped = engine.queue_lengths()
        self.running.set(running)
        self.waiting.set(waiting)
        self.swapped.set(swapped)
        self.kv_usage.set(engine.kv_usage())
        self.footprint.set(engine.footprint_bytes())
        self.host_bytes.set(engine.host_bytes())
        self.blocks_capacity.set(engine.num_blocks)
        self.blocks_used.set(engine.blocks_used())
        self.overcommit.set(engine.overcommit)
        self.reserved.set(engine.reserved_blocks() / engine.num_blocks)
        self.device_free.set(max(dev.free, 0))
        self.device_capacity.set(dev.capacity)
        self.frag.set(engine.frag_entropy())
        self.restarting.set(1 if engine.down_until is not None else 0)
        for key, value in _counters(engine).items():
            delta = value - self._last.get(key, 0)
            if delta > 0:
                self.counters[key].inc(delta)
            self._last[key] = value
        log = engine.iterations
        for k in range(self._iterations, len(log)):
            it = log[k]
            if it.decode_tokens:  # each decode token waited since the previous iteration ended
                since = it.end_s - (log[k - 1].end_s if k else it.end_s - it.duration_s)
                for _ in range(it.decode_tokens):
                    self.itl.observe(since)
        self._iterations = len(log)
        for record in engine.completed[self._completed:]:
            self._observe(record, engine.max_model_len)
        self._completed = len(engine.completed)
        gone = engine.counters.abandoned - self._last.get("abandoned", 0)  # given up: vLLM's aborted requests
        if gone > 0:
            self.success.labels(*self.labels, "abort").inc(gone)
        self._last["abandoned"] = engine.counters.abandoned

    def _observe(self, record, max_model_len: int) -> None:
        self.ttft.observe(record.ttft_s)
        if record.tpot_s is not None:
            self.tpot.observe(record.tpot_s)
        self.e2e.observe(record.finish_s - record.arrival_s)
        self.max_tokens.observe(record.max_tokens)
        length = record.output_len >= record.max_tokens or record.prompt_len + record.output_len >= max_model_len
        self.success.labels(*self.labels, "length" if length else "stop").inc()

    def fallback(self, reason: str) -> None:
        """Count one decision the live loop took from its safe static policy (``reason``: one of
        ``FALLBACK_REASONS``)."""
        self.fallbacks.labels(*self.labels, reason).inc()

    def exposition(self) -> bytes:
        """The registry in Prometheus' text format."""
        return generate_latest(self.registry)

    def start_http(self, port: int, addr: str = "127.0.0.1"):
        """Serve the registry at http://addr:port/metrics in a daemon thread; returns (server, thread)
        so that the caller can ``server.shutdown()``. Port 0 picks a free port (``server.server_port``)."""
        return start_http_server(port, addr=addr, registry=self.registry)
