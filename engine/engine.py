"""The engine: requests in, tokens out, on an engine clock, with every byte of KV accounted for.

One ``step`` is one iteration: arrivals join the queue, the scheduler picks the work, the
executor runs it and the clock advances by its duration. Running out of KV blocks or device
memory is an OOM event, recorded with where it came from: ``crash`` restarts after a downtime
and requeues everything held with its tokens so far; ``preempt`` recomputes the newest sequences,
as vLLM does. The controller's three levers are plain methods: ``set_overcommit``, ``compact``
and ``evict``; the shield's is ``set_admit_headroom``; outside code reads the engine through the
methods under "reading".

The engine composes its parts and edits none of their state: the scheduler owns the queues and
every move between them, the session store the kept contexts, the KV cache the blocks.

It runs past 350 lines because it is the one place where those parts meet: each method is an
engine-level event (a step, an OOM, a restart, a lever) that touches several of them at once.
"""
from __future__ import annotations

import math
import numbers
import zlib
from collections import deque
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from engine.config import EngineConfig, MemoryPlan, ModelConfig, is_whole, max_model_len, memory_plan
from engine.decode_run import decode_run
from engine.device import Device, DeviceOOM
from engine.executor import ProfiledExecutor, TorchExecutor
from engine.kv_cache import CopyReport, KVCache, NeedBlocks, SwapTraffic
from engine.kv_pool import KVPool
from engine.model import LlamaModel
from engine.records import Counters, IterationLog, OOMEvent, RequestRecord
from engine.request import Request, RequestError, check_request
from engine.scheduler import NewTokenRatio, Scheduler, Work
from engine.sequence import Sequence
from engine.sessions import Sessions
from engine.snapshot import LENGTH_WINDOW_S, OUT_RATIO_WINDOW, OUTPUT_LENGTH_WINDOW, Snapshot, take_snapshot

IDLE_TICK_S = 0.01  # how far the clock moves when work waits but nothing can run
HASHED_TOKENS = 0x68617368  # the seed stream of the tokens a trace's hash id covers ("hash")


def _oom_source(exc: BaseException) -> tuple[str, str]:
    """(source, cause) of an ``OOMEvent`` for the exception that signalled it."""
    if isinstance(exc, NeedBlocks):
        if not isinstance(exc.cause, DeviceOOM):
            return "kv blocks", "every block in use"
        torch_oom = isinstance(exc.cause.__cause__, torch.OutOfMemoryError)
        return "kv pool growth", "OutOfMemoryError" if torch_oom else "device ledger"
    if exc.what == "workspace":
        return "iteration workspace", "device ledger"
    return ("iteration activations" if exc.what == "forward" else exc.what), "OutOfMemoryError"


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
    device: Device | None = None  # None: the torch device's own, or a CPU budget of the memory plan
    fast_forward: bool = True  # a tensor-free engine advances runs of decodes at once (engine/decode_run.py)

    def __post_init__(self) -> None:
        cfg, mcfg = self.config, self.model_config
        self.max_model_len = max_model_len(mcfg, cfg)
        if self.executor is None:
            self.executor = TorchExecutor()
        if cfg.preempted_kv != "recomputed" and self.executor.materialize:
            raise ValueError(f"preempted_kv {cfg.preempted_kv!r} is a model for the tensor-free engine (a cost model's "
                             f"clock): on real KV tensors a preempted request's KV is not kept")
        if self.model is None and self.executor.materialize:
            self.model = LlamaModel.from_seed(mcfg, cfg.seed, self.torch_device)
        scaling = mcfg.rope_scaling
        if self.model is not None and scaling is not None and scaling.kind == "longrope":
            # LongRoPE's long factors where the engine is configured for contexts past the original one, as vLLM
            # picks them by its max_model_len (whatever KV it has: vLLM does not shorten it to fit, it refuses)
            longest = min(cfg.max_model_len, mcfg.max_position)
            self.model.rotary.use_long_factors(longest > scaling.original_max_position)
        self.memory = self.plan_memory(cfg)
        if self.device is None:
            self.device = Device.for_torch(self.torch_device, cfg.device_bytes or self.memory.total)
        self.device.charge("weights", self.memory.weights)
        self.pool = KVPool(mcfg, cfg.block_size, cfg.num_blocks, cfg.segment_blocks, self.device,
                           self.executor.materialize)
        if self.pool.limit is not None and self.model is not None and self.model.kv_scales is not None:
            self.pool.scales = self.model.kv_scales.to(self.pool.device.torch_device)  # an 8-bit KV's, as vLLM
        self.kv = KVCache(self.pool, cfg.host_bytes, lru=cfg.preempted_kv == "lru", prefix=cfg.prefix_caching)
        self.sessions = Sessions(self.kv, self.counters, self.max_model_len)
        ratio = NewTokenRatio(cfg.sglang_init_new_token_ratio, cfg.sglang_min_new_token_ratio_factor,
                              cfg.sglang_new_token_ratio_decay_steps, cfg.sglang_clip_max_new_tokens,
                              full_new=cfg.sglang_rule == "code")
        self.scheduler = Scheduler(self.kv, self.sessions, cfg.max_num_seqs, cfg.max_num_batched_tokens,
                                   ratio if cfg.admission == "sglang" else None,
                                   prompt_chunks=cfg.prompt_blocks == "chunk",
                                   cache_preempted=cfg.preempted_kv != "recomputed")
        self.executor.bind(self.model, self.pool)
        self.overcommit = cfg.overcommit
        self.records: dict[str, RequestRecord] = {}
        self.completed: list[RequestRecord] = []  # in completion order
        self.outputs: dict[str, list[int]] = {}
        # (finish time, context length) of the last 60 s' requests
        self.finished_lengths: deque[tuple[float, int]] = deque()
        # output / declared max_tokens of the last OUT_RATIO_WINDOW finished requests, however old:
        # long outputs may finish less than once a minute, and a time window would then forget them
        self.out_ratios: deque[float] = deque(maxlen=OUT_RATIO_WINDOW)
        # output lengths of the last OUTPUT_LENGTH_WINDOW finished requests (the snapshot's future_expected)
        self.output_lengths: deque[int] = deque(maxlen=OUTPUT_LENGTH_WINDOW)
        self.last_snapshot: Snapshot | None = None
        self.iterations = IterationLog()
        self.ooms: list[OOMEvent] = []
        self.down_until: float | None = None
        self.free_target_blocks = 0  # evicted sequences return only while this many blocks stay free
        self.admit_headroom = 0.0  # new requests are admitted only while this share of the KV stays free

    # ---- requests ------------------------------------------------------------------------------
    def _prompt_ids(self, req: Request) -> list[int]:
        if req.prompt_ids is not None:
            return list(req.prompt_ids)
        if not self.executor.materialize:  # no tensors, no model: only the lengths matter
            return [0] * req.prompt_len
        rng = np.random.default_rng([self.config.seed, zlib.crc32(req.request_id.encode())])
        ids = rng.integers(0, self.model_config.vocab_size, req.prompt_len).tolist()
        # the tokens a trace's hash id covers are drawn from the id, so that requests sharing it share them
        # (a prefix cache keys a block by the ids up to its own, chained: ``Sequence.block_key``)
        size = req.hash_block_tokens
        for k, h in enumerate(req.hash_ids[:math.ceil(req.prompt_len / size)] if req.hash_ids else ()):
            block = np.random.default_rng([self.config.seed, HASHED_TOKENS, h % 2**64])
            end = min((k + 1) * size, req.prompt_len)
            ids[k * size:end] = block.integers(0, self.model_config.vocab_size, end - k * size).tolist()
        return ids

    def validate(self, req: Request) -> None:
        """Raise ``RequestError`` naming what is wrong with ``req``; changes nothing."""
        if req.request_id in self.records:
            raise RequestError(f"request {req.request_id!r}: the id is already in use")
        check_request(req, self.max_model_len, self.model_config.vocab_size)

    def submit(self, req: Request) -> None:
        """Queue a request to arrive at ``req.arrival_s`` (or now, if that has passed)."""
        self.validate(req)
        record = RequestRecord(req.request_id, max(req.arrival_s, 0.0), req.prompt_len, req.max_tokens,
                               session_id=req.session_id)
        seq = Sequence(req, self._prompt_ids(req), 0, self.config.block_size, record, self.max_model_len)
        self.records[req.request_id] = record  # only once the sequence is built: a refusal leaves no trace
        self.scheduler.add(seq)

    def resume(self, req: Request, token_ids: list[int], context_len: int, num_generated: int,
               record: RequestRecord) -> None:
        """Take over a request that another process of this engine held when it stopped (a restart
        under a new MPS limit: rlctl/online/process_node.py): ``token_ids`` (its context, prompt and
        ``num_generated`` outputs) go to the front of the queue to be recomputed, and its record
        runs on. Resume the held requests newest first, as a restart requeues them."""
        self.validate(req)
        if not 0 <= num_generated <= len(token_ids) - context_len - req.prompt_len:
            raise ValueError(f"request {req.request_id!r}: {len(token_ids)} tokens cannot hold a {context_len}-token "
                             f"context, a {req.prompt_len}-token prompt and {num_generated} outputs")
        seq = Sequence(req, list(token_ids), context_len, self.config.block_size, record, self.max_model_len)
        seq.num_generated, seq.contextualized = num_generated, True
        self.records[req.request_id] = record
        self.scheduler.requeue(seq)

    # ---- reading -------------------------------------------------------------------------------
    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def next_arrival(self) -> float | None:
        return self.scheduler.next_arrival()

    def kv_usage(self) -> float:
        """KV blocks in use / capacity."""
        return self.kv.blocks.usage()

    def queue_lengths(self) -> tuple[int, int, int]:
        """Requests (waiting, running, swapped to the host)."""
        s = self.scheduler
        return len(s.waiting), len(s.running), len(s.swapped)

    def reserved_blocks(self) -> int:
        """Admitted peak demand in blocks (what the overcommit factor is compared against)."""
        return self.scheduler.reserved_blocks()

    def headroom_blocks(self) -> int:
        """Blocks a new request must leave free (``set_admit_headroom``)."""
        return math.ceil(self.admit_headroom * self.kv.num_blocks)

    @property
    def num_blocks(self) -> int:
        return self.kv.num_blocks

    @property
    def pool_block_bytes(self) -> int:
        return self.pool.block_bytes

    def blocks_used(self) -> int:
        return self.kv.blocks.num_used

    def frag_entropy(self) -> float:
        return self.kv.blocks.frag_entropy()

    @property
    def traffic(self) -> SwapTraffic:
        return self.kv.traffic

    def footprint_bytes(self) -> int:
        """Device bytes the KV pool holds (its segments, not the blocks in use)."""
        return self.pool.footprint_bytes()

    def host_bytes(self) -> int:
        return self.kv.host.used

    def waiting_since(self) -> list[float]:
        """Arrival times of the requests waiting for their first token (a preempted sequence back in
        the queue has had its)."""
        return [q.record.arrival_s for q in self.scheduler.waiting if q.record.first_token_s is None]

    def waiting_late(self) -> int:
        """Requests waiting for their first token longer than the TTFT target already (0 without one):
        served now, they finish late whatever comes next."""
        slo = self.config.ttft_slo_s
        if slo is None:
            return 0
        return sum(1 for t in self.waiting_since() if self.clock - t > slo)

    # ---- the iteration -------------------------------------------------------------------------
    def _schedule(self, admit: bool) -> list[Work] | None:
        """The iteration's work; None after a crash. Memory running out while scheduling (a running
        sequence cannot grow even after reclaiming, a swap-in cannot be copied) is an OOM event;
        in preempt mode the newest sequence is recomputed and nothing new is admitted."""
        while True:
            try:
                work = self.scheduler.schedule(self.overcommit, self.free_target_blocks, admit, self.headroom_blocks())
                self.counters.recomputed_tokens += self.scheduler.take_recomputed()
                return work
            except (NeedBlocks, DeviceOOM) as exc:
                self._record_oom(exc)
                if self.config.oom_mode == "crash":
                    self._crash()
                    return None
                admit = False
                sglang = self.scheduler.ratio is not None and isinstance(exc, NeedBlocks)
                if not (self._retract() if sglang else self._preempt_newest()):
                    return []

    def _timed_schedule(self, admit: bool = True) -> list[Work] | None:
        """Schedule; swap-ins the scheduler makes cost their time over the host link."""
        swapped_in, box = self.kv.traffic.in_blocks, []

        def schedule() -> int:
            box.append(self._schedule(admit))
            return (self.kv.traffic.in_blocks - swapped_in) * self.pool.block_bytes

        self.clock += self.executor.timed(schedule, "host")
        return box[0]

    def _idle(self) -> None:
        """An iteration with nothing to run: SGLang's scheduler puts its ratio back to its start
        (``EngineConfig.sglang_rule: code``; issue 9's rule does not)."""
        if self.scheduler.ratio is not None and self.config.sglang_rule == "code":
            self.scheduler.ratio.reset()

    def _retract(self) -> bool:
        """SGLang's answer to a decode that finds no free block (``EngineConfig.sglang_rule``):
        issue 9's rule (the ratio back to its start, the newest recomputed) or SGLang's code's (the
        fewest outputs recomputed, the ratio re-estimated from those still running)."""
        ratio = self.scheduler.ratio
        if self.config.sglang_rule == "spec":
            ratio.reset()
            return self._preempt_newest()
        if not self._count_preemption(self.scheduler.retract_fewest_outputs()):
            return False
        ratio.estimate_after_retract(self.scheduler.running, self.config.sglang_retract_decode_steps)
        return True

    def _preempt_newest(self) -> bool:
        return self._count_preemption(self.scheduler.preempt_newest())

    def _count_preemption(self, lost: int | None) -> bool:
        """Count a preemption that left ``lost`` tokens to recompute; False when none was made (None)."""
        if lost is None:
            return False
        self.counters.recomputed_tokens += lost
        self.counters.preemptions += 1
        return True

    def _crash(self) -> None:
        """A real OOM: the process dies, all KV (device and host) is lost, the engine restarts
        after the downtime, and every request it held is queued again, oldest first."""
        self.counters.oom_events += 1
        self._lose_everything()

    def max_workspace_bytes(self, cfg: EngineConfig) -> int:
        """The largest iteration workspace this engine's executor may ask for under ``cfg``."""
        return self.executor.max_workspace_bytes(self.model_config, cfg, max_model_len(self.model_config, cfg))

    def plan_memory(self, cfg: EngineConfig) -> MemoryPlan:
        """This engine's weights, largest workspace and KV under ``cfg`` (its own, or a new KV size)."""
        return memory_plan(self.model_config, cfg, self.model.weight_bytes() if self.model is not None else None,
                           self.max_workspace_bytes(cfg))

    def restart(self, num_blocks: int | None = None) -> None:
        """A graceful restart, not an OOM: what a new MPS memory limit needs, since MPS binds a
        limit only at a client's start. Every request held goes back to the front of the queue
        with its tokens (none is lost; their KV is recomputed), the KV is gone, the engine is down
        for ``restart_downtime_s``, and it comes back with a KV capacity of ``num_blocks`` (the
        blocks its new limit holds; None: as before)."""
        if num_blocks is not None:  # checked in full before anything changes: a refused restart changes nothing
            if not is_whole(num_blocks) or num_blocks <= 0:
                raise ValueError(f"a restart's num_blocks must be a whole number > 0, got {num_blocks!r}")
            if num_blocks * self.config.block_size < self.max_model_len:
                raise ValueError(f"a restart with {num_blocks} KV blocks cannot hold one {self.max_model_len}-token "
                                 f"sequence (block size {self.config.block_size})")
        self.counters.restarts += 1
        self._lose_everything(num_blocks)
        if num_blocks is not None:
            self.config = replace(self.config, num_blocks=num_blocks)
            self.memory = self.plan_memory(self.config)

    def _lose_everything(self, num_blocks: int | None = None) -> None:
        """The process ends: requests held go back to the queue, the KV (device and host) and the
        sessions' kept contexts are lost, and the engine is down for its restart time."""
        s = self.scheduler
        self.counters.recomputed_tokens += (  # a prefix cache's KV goes too
            sum(q.num_computed for q in s.running) + sum(q.num_computed for q in s.swapped)
            + sum(q.cached + q.preempted_tokens for q in s.waiting))
        for seq in self.scheduler.lose_all():
            seq.record.restarts += 1
        self.sessions.lose_all()
        self.kv.reset(num_blocks)
        self.device.give_back()  # the process's memory goes back with it
        self.down_until = self.clock + self.config.restart_downtime_s

    def _record_oom(self, exc: BaseException) -> None:
        self.ooms.append(OOMEvent(self.clock, *_oom_source(exc), self.config.oom_mode))

    def _abandon(self) -> None:
        """Requests still without a first token ``client_timeout_s`` after their arrival leave: their
        clients gave up (``Scheduler.abandon``)."""
        timeout = self.config.client_timeout_s
        if timeout is None or not self.scheduler.busy():
            return
        for seq in self.scheduler.abandon(self.clock, timeout):
            seq.record.abandoned_s = self.clock
            self.counters.abandoned += 1

    def _wait(self) -> None:
        """Nothing can run now (a co-tenant holds the memory, say): move the clock to the next
        arrival or by a tick, so that the engine waits instead of looping."""
        nxt = self.next_arrival()
        self.clock += IDLE_TICK_S if nxt is None or nxt <= self.clock else min(IDLE_TICK_S, nxt - self.clock)

    def step(self) -> bool:
        """Run one iteration (or wait for the next event). Returns False when nothing is left."""
        if self.down_until is not None:
            self.clock = max(self.clock, self.down_until)
            self.down_until = None
        s = self.scheduler
        s.arrive(self.clock)
        if not s.busy():
            self._idle()
            if s.next_arrival() is None:
                return False
            self.clock = max(self.clock, s.next_arrival())
            s.arrive(self.clock)
        self._abandon()
        work = self._timed_schedule()
        while True:  # every pass runs the iteration, waits, crashes, or preempts and runs the rest
            if work is None:
                return True
            if not work:  # the device has no room for anything now (a co-tenant holds it): wait
                self._idle()
                self._wait()
                return True
            try:
                with self.device.transient("workspace", self.executor.workspace_bytes(self.model_config, work)), \
                        self.device.allocating("forward"):
                    next_tokens, duration = self.executor.execute(work)
                break
            except DeviceOOM as exc:  # the batch's activations do not fit the device
                self._record_oom(exc)
                if self.config.oom_mode == "crash":
                    self._crash()
                    return True
                # the newest sequence is recomputed later and the rest runs now, nothing new admitted
                work = self._timed_schedule(admit=False) if self._preempt_newest() else []
        self.clock += duration
        self._apply(work, next_tokens)
        num_tokens = sum(w.num_tokens for w in work)
        decodes = sum(1 for w in work if w.num_tokens == 1 and w.produces_token)
        if decodes and s.ratio is not None:
            s.ratio.decode_batch()
        self.counters.iterations += 1
        self.counters.prefill_tokens += num_tokens - decodes
        self.iterations.append(self.clock, duration, decodes, num_tokens - decodes, self.kv.blocks.usage(),
                               len(next_tokens))
        return True

    def _apply(self, work: list[Work], next_tokens: dict[str, int]) -> None:
        caching = self.kv.blocks.caching
        for w in work:
            seq = w.seq
            seq.num_computed += w.num_tokens
            if caching and seq.keyed < seq.shareable and seq.num_computed >= (seq.keyed + 1) * seq.block_size:
                self.kv.cache(seq)  # a block filled: later requests may take it
            token = next_tokens.get(seq.id)
            if token is None:
                continue
            seq.token_ids.append(int(token))
            seq.num_generated += 1
            self.counters.tokens_generated += 1
            if seq.record.first_token_s is None:
                seq.record.first_token_s = self.clock
            if seq.done or len(seq.token_ids) >= self.max_model_len:
                self._finish(seq)

    def _finish(self, seq: Sequence) -> None:
        seq.record.finish_s = self.clock
        seq.record.output_len = seq.num_generated
        self.completed.append(seq.record)
        self.finished_lengths.append((self.clock, len(seq)))
        self.out_ratios.append(seq.num_generated / seq.request.max_tokens)
        if seq.num_generated > 0:
            self.output_lengths.append(seq.num_generated)
        while self.finished_lengths[0][0] < self.clock - LENGTH_WINDOW_S:
            self.finished_lengths.popleft()
        if self.keep_outputs:
            self.outputs[seq.id] = seq.token_ids[len(seq) - seq.num_generated:]
        self.scheduler.finish(seq, self.clock)

    def run(self, until: float | None = None, max_iterations: int | None = None) -> None:
        """Step until nothing is left, the clock passes ``until``, or ``max_iterations`` ran.
        Time the engine spends idle or restarting ends exactly at ``until``."""
        if until is not None and math.isnan(until):
            raise ValueError("until must be a time (or None: until nothing is left), got nan")
        n = 0
        s = self.scheduler
        while (until is None or self.clock < until) and (max_iterations is None or n < max_iterations):
            if until is not None:
                if self.down_until is not None and self.down_until >= until:
                    self.clock = until
                    break
                nxt = s.next_arrival()
                if not s.busy() and nxt is not None and nxt >= until:
                    self._idle()
                    self.clock = until
                    break
            if self.fast_forward and max_iterations is None:
                ran = decode_run(self, until)
                if ran:
                    n += ran
                    continue
            if not self.step():
                break
            n += 1

    def snapshot(self) -> Snapshot:
        """What the controller sees now; each call starts the next interval."""
        self.last_snapshot = take_snapshot(self, self.last_snapshot)
        return self.last_snapshot

    # ---- the controller's levers -------------------------------------------------------------
    def set_overcommit(self, factor: float) -> float:
        """Set the overcommit factor, clamped to the configured range; returns the factor in force.
        Lowering it stops admission until the held peak demand fits again."""
        if isinstance(factor, bool) or not isinstance(factor, numbers.Real) or math.isnan(factor) or factor <= 0:
            raise ValueError(f"overcommit factor must be a number > 0, got {factor!r}")
        self.overcommit = min(max(factor, self.config.overcommit_min), self.config.overcommit_max)
        return self.overcommit

    def set_admit_headroom(self, share: float) -> float:
        """Admit a new request only while ``share`` of the KV blocks stays free after its prompt,
        blocks that reclaiming would free counted free (vLLM's v0 block-manager watermark, 0.01 there;
        0: no headroom, the default). While nothing is held the head of the queue is admitted anyway."""
        if not 0.0 <= share < 1.0:
            raise ValueError(f"admission headroom must be in [0, 1), got {share}")
        self.admit_headroom = float(share)
        return self.admit_headroom

    def _action_failed(self, exc: DeviceOOM) -> None:
        """A controller action ran out of device memory: an OOM event. A crash-mode engine dies as
        the process would; in preempt mode the action is abandoned, with every book intact."""
        self._record_oom(exc)
        if self.config.oom_mode == "crash":
            self._crash()

    def compact(self) -> CopyReport:
        """Move blocks from the top of the pool into holes, rewrite the block tables, release the tail."""
        before = self.pool.footprint_bytes()
        moved = []

        def move() -> int:
            moved.append(len(self.kv.compact(self.scheduler.holders())))
            return moved[0] * self.pool.block_bytes

        try:
            seconds = self.executor.timed(move, "device")
        except DeviceOOM as exc:
            self._action_failed(exc)
            return CopyReport()
        report = CopyReport(moved[0], moved[0] * self.pool.block_bytes, seconds, before - self.pool.footprint_bytes())
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
        box = [CopyReport()]

        def move() -> int:
            self.scheduler.evict(target, box[0])
            return box[0].bytes

        try:
            seconds = self.executor.timed(move, "host")
        except DeviceOOM as exc:  # what moved before the failure stays moved; it cost no time we can tell
            self._action_failed(exc)
            return box[0]
        report = box[0]
        report.seconds = seconds
        self.clock += seconds
        return report
