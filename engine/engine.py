"""The engine: requests in, tokens out, on an engine clock, with every byte of KV accounted for.

One ``step`` is one iteration: arrivals join the queue, the scheduler picks the work, the
executor runs it and the clock advances by its duration. Running out of KV blocks or device
memory is an OOM event: ``crash`` restarts after a downtime and requeues everything held with its
tokens so far; ``preempt`` recomputes the newest sequences, as vLLM does. The controller's three
actions are plain methods: ``set_overcommit``, ``compact`` and ``evict``.
"""
from __future__ import annotations

import heapq
from collections import deque
import math
import zlib
from dataclasses import dataclass, field

import numpy as np
import torch

from engine.config import EngineConfig, ModelConfig
from engine.device import Device, DeviceOOM
from engine.executor import ProfiledExecutor, TorchExecutor
from engine.kv_cache import HostFull, KVCache, NeedBlocks
from engine.kv_pool import KVPool
from engine.model import LlamaModel
from engine.scheduler import Scheduler, Work, batch_tokens
from engine.sequence import RequestRecord, Sequence, Status
from engine.session import SessionContext
from engine.snapshot import LENGTH_WINDOW_S, Snapshot, take_snapshot
from env.workloads.request import Request

IDLE_TICK_S = 0.01  # how far the clock moves when work waits but nothing can run


class RequestError(ValueError):
    """A request the engine refuses; nothing else is affected."""


@dataclass
class Counters:
    oom_events: int = 0
    preemptions: int = 0
    compactions: int = 0
    compaction_blocks: int = 0
    compaction_bytes: int = 0
    compaction_s: float = 0.0
    contexts_reused: int = 0
    contexts_swapped_in: int = 0
    contexts_dropped: int = 0
    tokens_generated: int = 0
    prefill_tokens: int = 0
    iterations: int = 0


@dataclass
class Iteration:
    end_s: float
    duration_s: float
    decode_tokens: int
    prefill_tokens: int
    alloc_ratio: float


@dataclass
class CopyReport:
    """What a compaction or an eviction moved and what it cost."""

    blocks: int = 0
    bytes: int = 0
    seconds: float = 0.0
    bytes_released: int = 0
    contexts: int = 0
    sequences: int = 0


@dataclass
class Engine:
    model_config: ModelConfig
    config: EngineConfig
    model: LlamaModel | None = None
    torch_device: str = "cpu"
    executor: TorchExecutor | ProfiledExecutor | None = None  # None: a TorchExecutor
    keep_outputs: bool = False  # keep each finished request's generated token ids in ``outputs``
    clock: float = 0.0
    counters: Counters = field(default_factory=Counters)

    def __post_init__(self) -> None:
        cfg, mcfg = self.config, self.model_config
        # as vLLM, a sequence may not outgrow the KV cache, so every request can run alone
        self.max_model_len = min(cfg.max_model_len, mcfg.max_position, cfg.num_blocks * cfg.block_size)
        block_bytes = mcfg.kv_bytes_per_token() * cfg.block_size
        if self.executor is None:
            self.executor = TorchExecutor()
        if self.model is None and self.executor.materialize:
            self.model = LlamaModel.from_seed(mcfg, cfg.seed, self.torch_device)
        weights = self.model.weight_bytes() if self.model is not None else mcfg.weight_bytes()
        workspace = self.workspace_bytes(cfg.max_num_batched_tokens, cfg.num_blocks * cfg.block_size)
        capacity = cfg.device_bytes or weights + workspace + cfg.num_blocks * block_bytes
        self.device = Device.for_torch(self.torch_device, capacity)
        self.device.charge("weights", weights)
        self.pool = KVPool(mcfg, cfg.block_size, cfg.num_blocks, cfg.segment_blocks, self.device,
                           self.executor.materialize)
        self.kv = KVCache(self.pool, cfg.host_bytes)
        self.scheduler = Scheduler(self.kv, cfg.max_num_seqs, cfg.max_num_batched_tokens, self._reclaim)
        self.executor.bind(self.model, self.pool)
        self.overcommit = cfg.overcommit
        self.sessions: dict[str, SessionContext] = {}
        self.records: dict[str, RequestRecord] = {}
        self.completed: list[RequestRecord] = []  # in completion order
        self.outputs: dict[str, list[int]] = {}
        self.finished_lengths: deque[tuple[float, int]] = deque()  # (finish time, context length), last 60 s
        self.last_snapshot: Snapshot | None = None
        self.iterations: list[Iteration] = []
        self.down_until: float | None = None
        self.free_target_blocks = 0  # evicted sequences return only while this many blocks stay free
        self._pending: list[tuple[float, int, Sequence]] = []
        self._submitted = 0

    # ---- requests ------------------------------------------------------------------------------
    def workspace_bytes(self, num_tokens: int, context_tokens: int) -> int:
        """Activation workspace of an iteration: per-token activations plus one layer's gathered KV."""
        per_layer_kv = self.model_config.kv_bytes_per_token() // self.model_config.num_layers
        return num_tokens * self.model_config.workspace_bytes_per_token() + context_tokens * per_layer_kv

    def _prompt_ids(self, req: Request) -> list[int]:
        if req.prompt_ids is not None:
            return list(req.prompt_ids)
        rng = np.random.default_rng([self.config.seed, zlib.crc32(req.request_id.encode())])
        return rng.integers(0, self.model_config.vocab_size, req.prompt_len).tolist()

    def validate(self, req: Request) -> None:
        """Raise ``RequestError`` naming what is wrong with ``req``; changes nothing."""
        rid = req.request_id
        if rid in self.records:
            raise RequestError(f"request {rid!r}: the id is already in use")
        if req.prompt_len <= 0:
            raise RequestError(f"request {rid!r}: the prompt is empty")
        if req.prompt_len >= self.max_model_len:
            raise RequestError(f"request {rid!r}: prompt of {req.prompt_len} tokens does not fit the "
                               f"context of {self.max_model_len} tokens (it needs room for one output token)")
        if req.max_tokens <= 0:
            raise RequestError(f"request {rid!r}: max_tokens must be > 0, got {req.max_tokens}")
        if req.output_len <= 0:
            raise RequestError(f"request {rid!r}: output_len must be > 0, got {req.output_len}")
        if not math.isfinite(req.arrival_s) or req.arrival_s < 0:
            raise RequestError(f"request {rid!r}: arrival_s must be a finite time >= 0, got {req.arrival_s}")
        if req.prompt_ids is not None:
            if len(req.prompt_ids) != req.prompt_len:
                raise RequestError(f"request {rid!r}: {len(req.prompt_ids)} prompt ids but prompt_len {req.prompt_len}")
            bad = [t for t in req.prompt_ids if not (0 <= int(t) < self.model_config.vocab_size)]
            if bad:
                raise RequestError(f"request {rid!r}: token id {bad[0]} is outside the vocabulary "
                                   f"[0, {self.model_config.vocab_size})")

    def submit(self, req: Request) -> None:
        """Queue a request to arrive at ``req.arrival_s`` (or now, if that has passed)."""
        self.validate(req)
        record = RequestRecord(req.request_id, max(req.arrival_s, 0.0), req.prompt_len, req.max_tokens,
                               session_id=req.session_id)
        seq = Sequence(req, self._prompt_ids(req), 0, self.config.block_size, record, self.max_model_len)
        self.records[req.request_id] = record
        heapq.heappush(self._pending, (req.arrival_s, self._submitted, seq))
        self._submitted += 1

    def _arrive(self) -> None:
        while self._pending and self._pending[0][0] <= self.clock:
            self.scheduler.waiting.append(heapq.heappop(self._pending)[2])

    def has_work(self) -> bool:
        s = self.scheduler
        return bool(self._pending or s.waiting or s.running or s.swapped)

    def next_arrival(self) -> float | None:
        return self._pending[0][0] if self._pending else None

    # ---- sessions ------------------------------------------------------------------------------
    def _admissible(self, seq: Sequence) -> bool:
        sid = seq.request.session_id
        if sid is None:
            return True
        ctx = self.sessions.setdefault(sid, SessionContext(sid))
        if ctx.owner not in (None, seq.id):
            return False
        if not seq.contextualized:
            seq.contextualized = True
            if len(ctx.token_ids) + seq.request.prompt_len >= self.max_model_len:
                self._drop_context(ctx, forget=True)  # the history no longer fits: the turn starts afresh
            seq.context_len = len(ctx.token_ids)
            seq.token_ids = ctx.token_ids + seq.token_ids
        return True

    def _attach(self, seq: Sequence) -> None:
        sid = seq.request.session_id
        if sid is None or seq.num_computed or seq.block_table:
            return
        ctx = self.sessions[sid]
        if ctx.host_kv is not None:
            ids = self.kv.swap_in(ctx.host_kv)  # NeedBlocks leaves the context on the host
            self.counters.contexts_swapped_in += 1
            ctx.block_table, ctx.host_kv = ids, None
        if ctx.block_table:
            seq.block_table, seq.num_computed = ctx.block_table, ctx.num_computed
            ctx.block_table = []
            self.counters.contexts_reused += 1
        ctx.owner = seq.id

    def _drop_context(self, ctx: SessionContext, forget: bool = False) -> None:
        if ctx.block_table:
            self.kv.free(ctx.block_table)
        if ctx.host_kv is not None:
            self.kv.host.drop(ctx.host_kv)
        if ctx.block_table or ctx.host_kv is not None:
            self.counters.contexts_dropped += 1
        ctx.block_table, ctx.host_kv = [], None
        if forget:
            ctx.token_ids, ctx.num_computed = [], 0

    def _reclaim(self) -> bool:
        """Free blocks nobody is running on: idle contexts (least recently used first) are dropped
        and will be recomputed, as a prefix cache evicts; waiting turns give back what they took."""
        for seq in self.scheduler.waiting:
            if seq.block_table:
                self.kv.free(seq.block_table)
                seq.block_table, seq.num_computed = [], 0
                return True
        idle = [c for c in self.sessions.values() if c.block_table and c.owner is None]
        if not idle:
            return False
        self._drop_context(min(idle, key=lambda c: c.last_used_s))
        return True

    # ---- the iteration -------------------------------------------------------------------------
    def _schedule(self) -> list[Work] | None:
        while True:
            try:
                return self.scheduler.schedule(self.overcommit, self._admissible, self._attach,
                                               self.free_target_blocks)
            except NeedBlocks:  # a running sequence cannot grow, even after reclaiming
                if self.config.oom_mode == "crash":
                    self._crash()
                    return None
                if not self._preempt_newest():
                    return []

    def _timed_schedule(self) -> list[Work] | None:
        """Schedule; swap-ins the scheduler makes cost their time over the host link."""
        swapped_in, box = self.kv.traffic.in_blocks, []

        def schedule() -> int:
            box.append(self._schedule())
            return (self.kv.traffic.in_blocks - swapped_in) * self.pool.block_bytes

        self.clock += self.executor.timed(schedule, "host")
        return box[0]

    def _preempt_newest(self) -> bool:
        running = self.scheduler.running
        if not running:
            return False
        seq = max(running, key=lambda s: s.admit_order)
        running.remove(seq)
        self.kv.free(seq.block_table)
        self.scheduler.requeue(seq)
        seq.record.preemptions += 1
        self.counters.preemptions += 1
        return True

    def _crash(self) -> None:
        """A real OOM: the process dies, all KV (device and host) is lost, the engine restarts
        after the downtime, and every request it held is queued again, oldest first."""
        self.counters.oom_events += 1
        s = self.scheduler
        held = sorted(s.running + list(s.swapped), key=lambda q: q.admit_order)
        s.running, s.swapped = [], deque()
        for seq in s.waiting:
            seq.block_table, seq.num_computed = [], 0
        for seq in reversed(held):
            s.requeue(seq)
            seq.record.restarts += 1
        for ctx in self.sessions.values():  # a turn that held its session still holds it
            if ctx.block_table or ctx.host_kv is not None:
                self.counters.contexts_dropped += 1
            ctx.block_table, ctx.host_kv = [], None
        self.kv.reset()
        self.down_until = self.clock + self.config.restart_downtime_s

    def _out_of_memory(self) -> None:
        if self.config.oom_mode == "crash":
            self._crash()
        else:
            self._preempt_newest()

    def step(self) -> bool:
        """Run one iteration (or wait for the next event). Returns False when nothing is left."""
        if self.down_until is not None:
            self.clock = max(self.clock, self.down_until)
            self.down_until = None
        self._arrive()
        s = self.scheduler
        if not (s.waiting or s.running or s.swapped):
            if not self._pending:
                return False
            self.clock = max(self.clock, self._pending[0][0])
            self._arrive()
        work = self._timed_schedule()
        if work is None:
            return True
        if not work:  # the device has no room for anything now (a co-tenant holds it): wait
            nxt = self.next_arrival()
            self.clock += IDLE_TICK_S if nxt is None or nxt <= self.clock else min(IDLE_TICK_S, nxt - self.clock)
            return True
        num_tokens, context_tokens, _ = batch_tokens(work)
        try:
            with self.device.transient("workspace", self.workspace_bytes(num_tokens, context_tokens)):
                next_tokens, duration = self.executor.execute(work)
        except (DeviceOOM, torch.OutOfMemoryError):
            self._out_of_memory()
            return True
        self.clock += duration
        self._apply(work, next_tokens)
        decodes = sum(1 for w in work if w.num_tokens == 1 and w.produces_token)
        self.counters.iterations += 1
        self.counters.prefill_tokens += num_tokens - decodes
        self.iterations.append(Iteration(self.clock, duration, decodes, num_tokens - decodes, self.kv.blocks.usage()))
        return True

    def _apply(self, work: list[Work], next_tokens: dict[str, int]) -> None:
        for w in work:
            seq = w.seq
            seq.num_computed += w.num_tokens
            if seq.id not in next_tokens:
                continue
            seq.token_ids.append(int(next_tokens[seq.id]))
            seq.num_generated += 1
            self.counters.tokens_generated += 1
            if seq.record.first_token_s is None:
                seq.record.first_token_s = self.clock
            if seq.done or len(seq) >= self.max_model_len:
                self._finish(seq)

    def _finish(self, seq: Sequence) -> None:
        seq.status = Status.FINISHED
        seq.record.finish_s = self.clock
        seq.record.output_len = seq.num_generated
        self.completed.append(seq.record)
        self.finished_lengths.append((self.clock, len(seq)))
        while self.finished_lengths[0][0] < self.clock - LENGTH_WINDOW_S:
            self.finished_lengths.popleft()
        if self.keep_outputs:
            self.outputs[seq.id] = seq.token_ids[len(seq) - seq.num_generated:]
        self.scheduler.running.remove(seq)
        sid = seq.request.session_id
        if sid is None:
            self.kv.free(seq.block_table)
        else:
            ctx = self.sessions[sid]
            ctx.token_ids, ctx.num_computed = seq.token_ids, seq.num_computed
            ctx.block_table, ctx.owner, ctx.last_used_s = seq.block_table, None, self.clock
        seq.block_table = []

    def run(self, until: float | None = None, max_iterations: int | None = None) -> None:
        """Step until nothing is left, the clock passes ``until``, or ``max_iterations`` ran.
        Time the engine spends idle or restarting ends exactly at ``until``."""
        n = 0
        s = self.scheduler
        while (until is None or self.clock < until) and (max_iterations is None or n < max_iterations):
            if until is not None:
                if self.down_until is not None and self.down_until >= until:
                    self.clock = until
                    break
                if not (s.waiting or s.running or s.swapped) and self._pending and self._pending[0][0] >= until:
                    self.clock = until
                    break
            if not self.step():
                break
            n += 1

    def snapshot(self) -> Snapshot:
        """What the controller sees now; each call starts the next interval."""
        self.last_snapshot = take_snapshot(self, self.last_snapshot)
        return self.last_snapshot

    # ---- the controller's actions ------------------------------------------------------------
    def set_overcommit(self, factor: float) -> float:
        """Set the overcommit factor, clamped to the configured range; returns the factor in force.
        Lowering it stops admission until the held peak demand fits again."""
        if math.isnan(factor) or factor <= 0:
            raise ValueError(f"overcommit factor must be > 0, got {factor}")
        self.overcommit = min(max(factor, self.config.overcommit_min), self.config.overcommit_max)
        return self.overcommit

    def _holders(self):
        """Every block table that points into the pool."""
        s = self.scheduler
        yield from (q for q in s.running + list(s.waiting) if q.block_table)
        yield from (c for c in self.sessions.values() if c.block_table)

    def compact(self) -> CopyReport:
        """Move blocks from the top of the pool into holes, rewrite the block tables, release the tail."""
        before = self.pool.footprint_bytes()
        box: dict[int, int] = {}

        def move() -> int:
            box.update(self.kv.compact())
            return len(box) * self.pool.block_bytes

        seconds = self.executor.timed(move, "device")
        for holder in self._holders():
            holder.block_table = [box.get(b, b) for b in holder.block_table]
        report = CopyReport(len(box), len(box) * self.pool.block_bytes, seconds, before - self.pool.footprint_bytes())
        self.clock += seconds
        c = self.counters
        c.compactions += 1
        c.compaction_blocks += report.blocks
        c.compaction_bytes += report.bytes
        c.compaction_s += seconds
        return report

    def evict(self, target_free_share: float) -> CopyReport:
        """Move idle session contexts (least recently used first), then the newest running
        sequences, to host memory until ``target_free_share`` of the KV blocks is free."""
        if not 0.0 <= target_free_share <= 1.0:
            raise ValueError(f"target_free_share must be in [0, 1], got {target_free_share}")
        target = math.ceil(target_free_share * self.kv.num_blocks)
        self.free_target_blocks = target
        report = CopyReport()
        idle = sorted((c for c in self.sessions.values() if c.block_table and c.owner is None),
                      key=lambda c: c.last_used_s)
        running = [q for q in self.scheduler.running if q.block_table]
        victims = idle + sorted(running, key=lambda q: -q.admit_order)

        def move() -> int:
            for v in victims:
                if self.kv.blocks.num_free >= target:
                    break
                n = len(v.block_table)
                try:
                    host = self.kv.swap_out(v.block_table)
                except HostFull:
                    break
                v.block_table, v.host_kv = [], host
                report.blocks += n
                report.bytes += n * self.pool.block_bytes
                if isinstance(v, Sequence):
                    self.scheduler.running.remove(v)
                    v.status = Status.SWAPPED
                    self.scheduler.swapped.append(v)
                    report.sequences += 1
                else:
                    report.contexts += 1
            return report.bytes

        report.seconds = self.executor.timed(move, "host")
        self.clock += report.seconds
        return report
