"""The GPU check (``scripts/gpu_check``): what only a real GPU can show, as one JSON report.

Checks, each in a process of its own with its own time budget (a check past its budget is
stopped and reported failed), all within 8 minutes:

* ``cuda``: is CUDA there; the device, its memory, torch's CUDA version.
* ``torch_executor``: the torch executor on the GPU: a small replay with the tiny model and with a
  bigger one (bf16), every request served.
* ``oom_crash``: a real ``torch.OutOfMemoryError`` through the engine's crash path: an engine on
  the GPU, a co-tenant tensor allocated here that leaves less free memory than the pool's next
  segment; the OOM event is counted, the co-tenant freed, and the replay completes with no
  request lost.
* ``workspace``: the workspace the engine charges for an iteration covers what its forward pass
  really allocates (``torch.cuda.max_memory_allocated``; on the CPU dry run, every tensor created,
  with SDPA's math kernel, the one CUDA takes for the engine's masked grouped-query attention):
  decodes of unequal lengths padded to the longest, and long prefill chunks with their score
  matrices.
* ``copy_bandwidth``: ``compact`` and swap out / in, in bytes/s, against the device's own copy
  bandwidth (a plain ``copy_``) and host <-> device copies of pinned memory.
* ``nvml``: NVML's telemetry ("no GPU: ..." where there is none).
* ``mps``: when an MPS control daemon runs, two clients at once, each started with its own
  pinned-memory limit (``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT`` in its environment, as a node's engine
  processes are), each allocating under its limit while the other holds memory and refused over
  it; the daemon's default limit is read before and after, never changed (it binds every client on
  the host); each server's limit is read. Else skipped, saying why.

Every check reports ``ok``, ``skipped`` (with the reason) or ``failed`` (with the error). Without
CUDA the GPU checks are skipped with "CUDA is not available", and the exit status is 0; it is 1
only if a check failed. ``--cpu-dry-run`` runs the GPU checks' code on the CPU at small sizes
(timings meaningless; the OOM comes from the device ledger, not from torch), to keep that code
working on machines without a GPU.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TOTAL_BUDGET_S = 470.0  # under the 8 minutes the whole check may take
BUDGETS_S = {"cuda": 60, "torch_executor": 100, "oom_crash": 100, "workspace": 60, "copy_bandwidth": 80,
             "nvml": 30, "mps": 30}
GPU_CHECKS = ("torch_executor", "oom_crash", "workspace", "copy_bandwidth")
CHECKS = ("cuda",) + GPU_CHECKS + ("nvml", "mps")
NO_CUDA = "CUDA is not available"


def _model(**kw):
    from engine.config import ModelConfig

    return ModelConfig(**kw)


@dataclass(frozen=True)
class Sizes:
    """How big each check runs; ``gpu()`` for a GPU, ``cpu()`` for the dry run."""

    device: str
    big_model: dict  # ModelConfig fields
    requests: int = 8          # torch_executor: requests per model
    prompt_len: int = 256
    output_len: int = 128
    oom_requests: int = 8      # oom_crash: prompts fill most of the pool's first segment
    oom_prompt_len: int = 400
    oom_output_len: int = 800
    oom_segment_blocks: int = 512
    oom_num_blocks: int = 2048
    workspace_chunk: int = 2048  # workspace: prefill chunk (max_num_batched_tokens); contexts up to 4x
    workspace_blocks: int = 2048
    kv_model: dict = field(default_factory=dict)  # copy_bandwidth
    kv_blocks: int = 1024
    kv_segment_blocks: int = 256
    seq_blocks: int = 4
    repeats: int = 3

    @classmethod
    def gpu(cls) -> "Sizes":
        # ~0.5 B parameters; KV 32 KiB per token, 512 KiB per block, 256 MiB per OOM-check segment
        big = dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_layers=8, num_heads=16,
                   num_kv_heads=8, dtype="bfloat16")
        # 128 KiB of KV per token (a Llama-3-8B shape), 2 MiB per block: a 2 GiB pool
        kv = dict(vocab_size=1000, hidden_size=4096, intermediate_size=1024, num_layers=32, num_heads=32,
                  num_kv_heads=8, dtype="bfloat16")
        return cls("cuda", big, kv_model=kv)

    @classmethod
    def cpu(cls) -> "Sizes":
        # 4 layers: an iteration's gathered KV (one layer's) stays well under half a segment
        small = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_layers=4, num_heads=4, num_kv_heads=2)
        return cls("cpu", small, requests=4, prompt_len=64, output_len=16, oom_requests=4, oom_prompt_len=60,
                   oom_output_len=100, oom_segment_blocks=32, oom_num_blocks=128, workspace_chunk=256,
                   workspace_blocks=256, kv_model=small, kv_blocks=128,
                   kv_segment_blocks=32, repeats=1)


class Deadline:
    def __init__(self, seconds: float) -> None:
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        return self.end - time.monotonic()

    def check(self, what: str) -> None:
        if self.left() <= 0:
            raise TimeoutError(f"out of time budget during {what}")


def skipped(reason: str, **extra) -> dict:
    return {"status": "skipped", "reason": reason, **extra}


def _timed(fn, device) -> tuple[float, object]:
    import torch

    from engine.executor import timed_call

    return timed_call(fn, torch.device(device))


def _rate(nbytes: int, seconds: float) -> float | None:
    return round(nbytes / seconds / 1e9, 3) if seconds > 0 else None  # GB/s


# ---- checks -------------------------------------------------------------------------------------
def check_cuda(sizes: Sizes, deadline: Deadline) -> dict:
    import torch

    info = {"torch_version": torch.__version__, "torch_cuda_version": torch.version.cuda}
    if sizes.device == "cpu":
        return {"status": "ok", "device": "cpu (dry run)", **info}
    if not torch.cuda.is_available():
        return skipped(NO_CUDA, **info)
    dev = torch.device("cuda", 0)
    props = torch.cuda.get_device_properties(dev)
    free, total = torch.cuda.mem_get_info(dev)
    x = torch.ones(1 << 20, device=dev)
    assert int(x.sum().item()) == 1 << 20, "a sum on the device came back wrong"
    return {"status": "ok", "device": props.name, "device_count": torch.cuda.device_count(),
            "capability": f"{props.major}.{props.minor}", "total_bytes": total, "free_bytes": free, **info}


def _requests(n: int, prompt_len: int, output_len: int, prefix: str):
    from engine.request import Request

    return [Request(f"{prefix}{i}", 0.0, prompt_len + 7 * i, output_len, output_len) for i in range(n)]


def _serve(engine, deadline: Deadline, what: str) -> None:
    while engine.step():
        deadline.check(what)


def check_torch_executor(sizes: Sizes, deadline: Deadline) -> dict:
    import torch

    from engine.config import EngineConfig, ModelConfig
    from engine.engine import Engine

    out = {}
    # the bigger model again as a mixture of experts (8 experts of a quarter its MLP's width, 2 a token)
    moe = _model(**sizes.big_model, num_experts=8, experts_per_token=2,
                 moe_intermediate_size=sizes.big_model["intermediate_size"] // 4)
    for name, mc in (("tiny", ModelConfig()), ("bigger", _model(**sizes.big_model)), ("moe", moe)):
        cfg = EngineConfig(num_blocks=512, max_model_len=2048)
        t0 = time.perf_counter()
        eng = Engine(mc, cfg, torch_device=sizes.device, keep_outputs=True)
        build_s = time.perf_counter() - t0
        reqs = _requests(sizes.requests, sizes.prompt_len, sizes.output_len, name)
        for r in reqs:
            eng.submit(r)
        t0 = time.perf_counter()
        _serve(eng, deadline, f"the {name} replay")
        wall = time.perf_counter() - t0
        served = all(len(eng.outputs.get(r.request_id, ())) == r.output_len for r in reqs)
        in_vocab = all(0 <= t < mc.vocab_size for toks in eng.outputs.values() for t in toks)
        decode = [it for it in eng.iterations if it.prefill_tokens == 0]
        out[name] = {
            "model": {k: getattr(mc, k) for k in ("hidden_size", "num_layers", "num_heads", "num_kv_heads",
                                                   "vocab_size", "dtype", "num_experts")},
            "weight_bytes": eng.model.weight_bytes(), "build_s": round(build_s, 2),
            "requests": len(reqs), "all_served": served, "tokens_in_vocabulary": in_vocab,
            "tokens_generated": eng.counters.tokens_generated, "iterations": eng.counters.iterations,
            "wall_s": round(wall, 3), "tokens_per_s": round(eng.counters.tokens_generated / wall, 1),
            "decode_iteration_ms_mean": round(1e3 * sum(i.duration_s for i in decode) / len(decode), 3)
            if decode else None,
        }
        if name == "tiny" and sizes.device != "cpu":  # the same requests on the CPU: same tokens? (told, not judged)
            ref = Engine(mc, cfg, torch_device="cpu", keep_outputs=True)
            for r in reqs:
                ref.submit(r)
            _serve(ref, deadline, "the tiny replay on the CPU")
            out[name]["tokens_equal_cpu_run"] = ref.outputs == eng.outputs
        del eng
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    ok = all(v["all_served"] and v["tokens_in_vocabulary"] for v in out.values())
    return {"status": "ok" if ok else "failed", **out,
            **({} if ok else {"error": "a replay on the GPU did not serve every request with in-vocabulary tokens"})}


def check_oom_crash(sizes: Sizes, deadline: Deadline) -> dict:
    import torch

    from engine.config import EngineConfig
    from engine.engine import Engine

    mc = _model(**sizes.big_model)
    cfg = EngineConfig(num_blocks=sizes.oom_num_blocks, segment_blocks=sizes.oom_segment_blocks,
                       max_num_seqs=sizes.oom_requests, max_model_len=4096, restart_downtime_s=1.0)
    eng = Engine(mc, cfg, torch_device=sizes.device, keep_outputs=True)
    segment_bytes = cfg.segment_blocks * eng.pool.block_bytes
    reqs = _requests(sizes.oom_requests, sizes.oom_prompt_len, sizes.oom_output_len, "oom")
    for r in reqs:
        eng.submit(r)
    # every prompt admitted and prefilled, within the pool's first segment
    while eng.next_arrival() is not None or eng.scheduler.waiting or any(s.in_prefill for s in eng.scheduler.running):
        eng.step()
        deadline.check("the prefills")
    held = eng.pool.footprint_bytes()
    if sizes.device == "cuda":
        torch.cuda.empty_cache()  # what the allocator caches would serve the next segment
        free, total = torch.cuda.mem_get_info()
        margin = segment_bytes // 2  # room for decode activations, not for another segment
        cotenant = torch.empty(max(free - margin, 0), dtype=torch.uint8, device="cuda")
        cotenant_bytes = cotenant.numel()
    else:  # the dry run: a co-tenant in the device ledger
        cotenant, margin = None, segment_bytes // 2
        cotenant_bytes = max(eng.device.free - margin, 0)
        eng.device.set_tenants(cotenant_bytes)
    before, logged = eng.counters.oom_events, len(eng.ooms)
    while eng.counters.oom_events == before and eng.step():
        deadline.check("waiting for the OOM")
    oom_events = eng.counters.oom_events - before
    # where the OOM came from, as the engine records it: the pool's growth or an iteration
    sources = [str(o) for o in eng.ooms[logged:]]
    footprint_after_crash = eng.pool.footprint_bytes()
    del cotenant  # the co-tenant goes away; the engine restarts and serves everything
    if sizes.device == "cuda":
        torch.cuda.empty_cache()
    else:
        eng.device.set_tenants(0)
    _serve(eng, deadline, "the replay after the OOM")
    records = [eng.records[r.request_id] for r in reqs]
    lost = [r.request_id for r in reqs if len(eng.outputs.get(r.request_id, ())) != r.output_len]
    torch_oom = any(o.cause == "OutOfMemoryError" for o in eng.ooms[logged:])
    report = {
        "segment_bytes": segment_bytes, "pool_bytes_before_cotenant": held, "cotenant_bytes": cotenant_bytes,
        "margin_bytes": margin, "oom_events": oom_events, "oom_sources": sources,
        "pool_bytes_after_crash": footprint_after_crash, "restarts": sum(r.restarts for r in records),
        "requests": len(reqs), "requests_lost": lost, "total_oom_events": eng.counters.oom_events,
    }
    problems = []
    if oom_events != 1:
        problems.append(f"expected one OOM event while the co-tenant held the memory, counted {oom_events}")
    if sizes.device == "cuda" and not torch_oom:
        problems.append(f"the OOM did not come from torch.OutOfMemoryError (sources: {sources})")
    if footprint_after_crash != 0:
        problems.append(f"the crash left {footprint_after_crash} B in the pool")
    if lost:
        problems.append(f"requests not served after the OOM: {lost}")
    return {"status": "failed", "error": "; ".join(problems), **report} if problems else {"status": "ok", **report}


class _LiveBytes:
    """Bytes of the tensors created while it is active and still alive, and their peak: every
    aten op's new outputs are counted until their storage is freed (outputs that share an input's
    storage, in-place results and views, are not new)."""

    def __init__(self) -> None:
        import weakref

        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils._pytree import tree_leaves

        import torch

        counter = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                if func is torch.ops.aten.scaled_dot_product_attention.default:
                    with self:  # its kernel's own ops (inference mode hands it over whole)
                        return func.decompose(*args, **kwargs)
                out = func(*args, **kwargs)
                inputs = {id(t.untyped_storage()) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
                for t in tree_leaves(out):
                    if not isinstance(t, torch.Tensor):
                        continue
                    st = t.untyped_storage()
                    key, n = id(st), st.nbytes()
                    if key in inputs or key in counter.seen or n == 0:
                        continue
                    counter.seen.add(key)
                    counter.now += n
                    counter.peak = max(counter.peak, counter.now)
                    weakref.finalize(st, counter._free, key, n)
                return out

        self.mode, self.seen, self.now, self.peak = Mode(), set(), 0, 0

    def _free(self, key: int, n: int) -> None:
        self.seen.discard(key)
        self.now -= n


def peak_bytes(fn, device: str) -> tuple[int, object]:
    """Peak bytes ``fn`` allocates on ``device`` beyond what was allocated before it, and its result."""
    import torch

    if device == "cuda":
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        result = fn()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base, result
    from torch.nn.attention import SDPBackend, sdpa_kernel

    live = _LiveBytes()
    with live.mode, sdpa_kernel(SDPBackend.MATH):
        result = fn()
    return live.peak, result


def check_workspace(sizes: Sizes, deadline: Deadline) -> dict:
    """Each iteration's measured peak against the workspace the engine charged for it."""
    from engine.config import EngineConfig
    from engine.engine import Engine
    from engine.request import Request

    mc = _model(**sizes.big_model)
    chunk = sizes.workspace_chunk
    cfg = EngineConfig(num_blocks=sizes.workspace_blocks, max_model_len=4 * chunk, max_num_batched_tokens=chunk)
    eng = Engine(mc, cfg, torch_device=sizes.device)
    executor, rows = eng.executor, []
    execute = executor.execute

    def measured(work):
        charged = executor.workspace_bytes(mc, work)
        shape = [w.num_tokens for w in work]
        context = sum(w.seq.num_computed + w.num_tokens for w in work)
        peak, result = peak_bytes(lambda: execute(work), sizes.device)
        rows.append({"tokens": sum(shape), "decodes": shape.count(1), "context_tokens": context,
                     "peak_bytes": peak, "charged_bytes": charged,
                     "fused_estimate_bytes": mc.workspace_bytes(sum(shape), context)})
        return result

    executor.execute = measured
    # decodes of very different lengths (padding), beside a prompt long enough for full chunks late in
    # a long context (score matrices of chunk x context)
    for i, n in enumerate((8, 40, 3 * chunk // 4)):
        eng.submit(Request(f"d{i}", 0.0, n, 24, 24))
    eng.submit(Request("long", 0.0, 3 * chunk + chunk // 2, 4, 4))
    _serve(eng, deadline, "the workspace replay")
    over = [r for r in rows if r["peak_bytes"] > r["charged_bytes"]]
    worst = max(rows, key=lambda r: r["peak_bytes"] / r["charged_bytes"])
    report = {"iterations": len(rows), "worst": worst,
              "max_peak_over_charged": round(worst["peak_bytes"] / worst["charged_bytes"], 3),
              "min_peak_over_charged": round(min(r["peak_bytes"] / r["charged_bytes"] for r in rows), 3),
              "iterations_over_fused_estimate": sum(r["peak_bytes"] > r["fused_estimate_bytes"] for r in rows),
              "iterations_over_charged": len(over)}
    if over:
        return {"status": "failed", "error": f"{len(over)} of {len(rows)} iterations allocated more than "
                f"the workspace charged for them, e.g. {over[0]}", **report}
    return {"status": "ok", **report}


def _fragmented(sizes: Sizes, host_bytes: int):
    """rlctl bench's fragmented pool (every block stamped with its id) at the check's sizes."""
    from rlctl.bench.engine import fragmented_cache

    return fragmented_cache(_model(**sizes.kv_model), 16, sizes.kv_blocks, sizes.kv_segment_blocks,
                            sizes.seq_blocks, sizes.device, host_bytes)


def check_copy_bandwidth(sizes: Sizes, deadline: Deadline) -> dict:
    import torch

    from rlctl.bench.engine import block_stamp

    dev, pin = torch.device(sizes.device), sizes.device == "cuda"
    # compaction: best of ``repeats``, each on a freshly fragmented pool
    best, intact, moves = float("inf"), True, {}
    for _ in range(sizes.repeats + 1):  # the first is a warm-up
        deadline.check("compaction")
        kv, live = _fragmented(sizes, host_bytes=0)
        values = {b: block_stamp(kv, b) for b in live}
        t, moves = _timed(kv.compact, dev)
        best = min(best, t)
        intact = intact and all(block_stamp(kv, moves.get(b, b)) == v for b, v in values.items())
        kv = None  # frees the pool
    moved = len(moves) * kv_block_bytes(sizes)
    compaction = {"blocks_moved": len(moves), "bytes_moved": moved,
                  "seconds": round(best, 6), "gb_per_s": _rate(moved, best), "kept_data": intact}
    # the device's own copy bandwidth: a plain copy_ of as many bytes
    src = torch.ones(moved, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    dst.copy_(src)
    copy_s = min(_timed(lambda: dst.copy_(src), dev)[0] for _ in range(10))
    src = dst = None  # frees the tensors
    # swap: out to the host pool (pinned on CUDA) and back, the engine's path
    kv, live = _fragmented(sizes, host_bytes=sizes.kv_blocks * kv_block_bytes(sizes))
    ids = live[: len(live) // 2]  # a quarter of the pool, in runs of seq_blocks, as sequences hold it
    nbytes = len(ids) * kv.pool.block_bytes
    out_s = in_s = float("inf")
    kept = True
    for _ in range(sizes.repeats):
        deadline.check("swap")
        values = [block_stamp(kv, b) for b in ids]
        t_out, host = _timed(lambda: kv.swap_out(ids), dev)
        t_in, ids = _timed(lambda: kv.swap_in(host), dev)
        out_s, in_s = min(out_s, t_out), min(in_s, t_in)
        kept = kept and [block_stamp(kv, b) for b in ids] == values
    kv = None  # frees the pool
    # plain pinned host <-> device copies of as many bytes
    dev_t = torch.ones(nbytes, dtype=torch.uint8, device=dev)
    host_t = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
    d2h = min(_timed(lambda: host_t.copy_(dev_t, non_blocking=pin), dev)[0] for _ in range(5))
    h2d = min(_timed(lambda: dev_t.copy_(host_t, non_blocking=pin), dev)[0] for _ in range(5))
    dev_t = host_t = None  # frees the tensors
    report = {
        "kv_model": {k: v for k, v in sizes.kv_model.items() if k in ("hidden_size", "num_layers", "num_kv_heads",
                                                                      "dtype")},
        "block_bytes": kv_block_bytes(sizes), "pinned_host": pin,
        "compaction": compaction,
        "device_copy": {"bytes": moved, "seconds": round(copy_s, 6), "gb_per_s": _rate(moved, copy_s)},
        "compaction_over_device_copy": round(copy_s / best, 3) if best > 0 else None,
        "swap_out": {"bytes": nbytes, "seconds": round(out_s, 6), "gb_per_s": _rate(nbytes, out_s)},
        "swap_in": {"bytes": nbytes, "seconds": round(in_s, 6), "gb_per_s": _rate(nbytes, in_s)},
        "swap_kept_data": kept,
        "swap_note": ("swap out = the engine's path: gathering the blocks, allocating a host buffer "
                      "(HostPool.store pins a new one per swap on CUDA) and the copy; swap in = allocating "
                      "blocks, the copy and the scatter into the pool"),
        "pinned_d2h": {"bytes": nbytes, "seconds": round(d2h, 6), "gb_per_s": _rate(nbytes, d2h)},
        "pinned_h2d": {"bytes": nbytes, "seconds": round(h2d, 6), "gb_per_s": _rate(nbytes, h2d)},
        "swap_out_over_pinned_d2h": round(d2h / out_s, 3) if out_s > 0 else None,
        "swap_in_over_pinned_h2d": round(h2d / in_s, 3) if in_s > 0 else None,
    }
    if not (intact and kept):
        return {"status": "failed", "error": "a compaction or a swap round trip changed the KV data", **report}
    return {"status": "ok", **report}


def kv_block_bytes(sizes: Sizes) -> int:
    return _model(**sizes.kv_model).kv_bytes_per_token() * 16


def check_nvml(sizes: Sizes, deadline: Deadline) -> dict:
    from rlctl.online.nvml import NVMLTelemetry

    report = NVMLTelemetry().read()
    if not report.applied:
        return skipped(report.detail, report=report.to_dict())
    return {"status": "ok", "report": report.to_dict()}


MPS_LIMIT_ENV = "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"
# an MPS client (a child of the check, with its own limit in its environment): what CUDA shows it,
# an allocation well under the limit, and one over it, which MPS must refuse
MPS_CLIENT = r"""
import json, os, sys
limit = int(sys.argv[1])
out = {"limit_env": os.environ.get("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT")}
import torch
out["cuda"] = torch.cuda.is_available()
if out["cuda"]:
    out["free_bytes"], out["total_bytes"] = torch.cuda.mem_get_info(0)
    under = torch.empty(limit // 4, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    out["under_limit_allocated"] = True
    import time
    time.sleep(float(sys.argv[2]))  # the other client allocates while this one holds its memory
    try:
        over = torch.empty(2 * limit, dtype=torch.uint8, device="cuda")
        out["over_limit_refused"] = False
    except torch.OutOfMemoryError:
        out["over_limit_refused"] = True
print(json.dumps(out))
"""


def check_mps(sizes: Sizes, deadline: Deadline, limit_bytes: int = 2 << 30) -> dict:
    """Two MPS clients at once, each started with its own pinned-memory limit
    (``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT`` in its own environment, as rlctl/online/process_node.py
    starts a node's engines: ``limit_bytes`` and half of it): each allocates under its limit while
    the other holds its memory, and each is refused over its own limit. The daemon's defaults are
    read before and after, never set: they bind every client on the host, not just this check's.
    Each running server's limit is read."""
    from rlctl.online.mps import MPSLimit, client_limit_value

    mps = MPSLimit(timeout_s=min(5.0, max(deadline.left() / 6, 1.0)))
    reason = mps.available()
    if reason:
        return skipped(reason)
    before = mps.get_default(0)
    limits = {"a": limit_bytes, "b": limit_bytes // 2}
    procs = {name: subprocess.Popen([sys.executable, "-c", MPS_CLIENT, str(limit), "2.0"], stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True,
                                    env=dict(os.environ, **{MPS_LIMIT_ENV: client_limit_value({0: limit})}))
             for name, limit in limits.items()}
    clients = {}
    for name, proc in procs.items():
        try:
            out, err = proc.communicate(timeout=max(deadline.left() - 5, 1.0))
            lines = out.strip().splitlines()
            clients[name] = json.loads(lines[-1]) if proc.returncode == 0 and lines else {
                "error": f"exited with status {proc.returncode}: {err.strip()[-500:]}"}
        except subprocess.TimeoutExpired:
            proc.kill()
            clients[name] = {"error": "did not finish within the check's budget"}
    after = mps.get_default(0)
    servers = {pid: mps.get_server(pid, 0).to_dict() for pid in mps.server_pids()}
    report = {"daemon_default_before": before.to_dict(), "daemon_default_after": after.to_dict(),
              "clients": clients, "servers": servers}
    if before.value != after.value:
        return {"status": "failed", **report, "error": "the daemon's default limit changed during the check"}
    for name, client in clients.items():
        if "error" in client:
            return {"status": "failed", **report, "error": f"MPS client {name} {client['error']}"}
        if client["limit_env"] != client_limit_value({0: limits[name]}):
            return {"status": "failed", **report, "error": f"MPS client {name} saw {MPS_LIMIT_ENV}="
                                                           f"{client['limit_env']!r}"}
    if not all(c["cuda"] for c in clients.values()):
        return skipped(NO_CUDA, **report)
    wrong = [f"client {n}: an allocation of {2 * limits[n]} B passed its {client_limit_value({0: limits[n]})} limit"
             for n, c in clients.items() if not (c["under_limit_allocated"] and c["over_limit_refused"])]
    return {"status": "failed" if wrong else "ok", **report, **({"error": "; ".join(wrong)} if wrong else {})}


RUNNERS = {"cuda": check_cuda, "torch_executor": check_torch_executor, "oom_crash": check_oom_crash,
           "workspace": check_workspace,
           "copy_bandwidth": check_copy_bandwidth, "nvml": check_nvml, "mps": check_mps}


def run_one(name: str, budget_s: float, dry_run: bool) -> dict:
    """One check in this process, its exceptions reported as a failure."""
    sizes = Sizes.cpu() if dry_run else Sizes.gpu()
    t0 = time.monotonic()
    try:
        result = RUNNERS[name](sizes, Deadline(budget_s * 0.9))
    except Exception as exc:  # a check reports its failure, it does not end the report
        result = {"status": "failed", "error": f"{type(exc).__name__}: {exc}",
                  "traceback": traceback.format_exc(limit=6).splitlines()[-8:]}
    result["elapsed_s"] = round(time.monotonic() - t0, 2)
    return result


def _child(name: str, budget_s: float, dry_run: bool) -> dict:
    """Run one check in a child process, stopped at its budget."""
    cmd = [sys.executable, "-m", "tests.gpu.checks", "--check", name, "--budget", str(budget_s)]
    if dry_run:
        cmd.append("--cpu-dry-run")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    t0 = time.monotonic()
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=budget_s, cwd=ROOT, env=env)
    except subprocess.TimeoutExpired:
        return {"status": "failed", "error": f"exceeded its time budget of {budget_s:g} s and was stopped",
                "elapsed_s": round(time.monotonic() - t0, 2)}
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
    if lines:
        try:
            return json.loads(lines[-1])
        except json.JSONDecodeError:
            pass
    tail = (done.stderr or done.stdout).strip().splitlines()[-5:]
    return {"status": "failed", "error": f"the check's process exited with status {done.returncode} without a report",
            "output_tail": tail, "elapsed_s": round(time.monotonic() - t0, 2)}


def run_all(total_budget_s: float = TOTAL_BUDGET_S, dry_run: bool = False) -> dict:
    t0 = time.monotonic()
    checks: dict[str, dict] = {}
    for name in CHECKS:
        left = total_budget_s - (time.monotonic() - t0)
        if name in GPU_CHECKS and checks["cuda"]["status"] != "ok":
            reason = checks["cuda"].get("reason") or f"the cuda check failed: {checks['cuda'].get('error')}"
            checks[name] = skipped(reason)
            continue
        budget = min(BUDGETS_S[name], left)
        if budget < 5:
            checks[name] = skipped(f"the report's time budget of {total_budget_s:g} s is spent")
            continue
        checks[name] = _child(name, budget, dry_run)
        checks[name]["budget_s"] = round(budget, 1)
    failed = [n for n, c in checks.items() if c["status"] == "failed"]
    return {"gpu_check": "rlctl", "dry_run_on_cpu": dry_run, "ok": not failed, "failed": failed,
            "elapsed_s": round(time.monotonic() - t0, 1), "budget_s": total_budget_s, "checks": checks}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="gpu_check", description=__doc__.split("\n\n")[0])
    p.add_argument("--budget", type=float, default=None, help=f"seconds in all (default {TOTAL_BUDGET_S:g})")
    p.add_argument("--cpu-dry-run", action="store_true", help="run the GPU checks' code on the CPU, small")
    p.add_argument("--check", choices=CHECKS, help=argparse.SUPPRESS)  # one check, in this process
    args = p.parse_args(argv)
    if args.check:
        print(json.dumps(run_one(args.check, args.budget or BUDGETS_S[args.check], args.cpu_dry_run)), flush=True)
        return 0
    report = run_all(args.budget or TOTAL_BUDGET_S, args.cpu_dry_run)
    print(json.dumps(report, indent=2), flush=True)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
