"""``rlctl profile``: fit a ``CostModel`` to the torch executor on this machine.

What it measures, all through the engine's own code on real KV tensors:

* iterations: ``TorchExecutor.execute`` on batches built over a grid of pure decodes (batch size x
  mean context length, the contexts spread around the mean as a real batch's are), pure prefill
  chunks (chunk size x tokens already computed) and mixes of the two. Each batch's sequences get
  their blocks from the engine's KV cache, so attention gathers through real block tables from a
  real segmented pool; a point's time is the median of ``repeats`` runs after one warm-up run,
  and its shape is ``batch_tokens(work)``, what the cost model sees in a replay.
* compaction: ``KVCache.compact`` moving k blocks into k holes, for several k;
* swap: ``KVCache.swap_out`` and ``swap_in`` of k blocks, for several k;
  both timed by ``TorchExecutor.timed``, as the engine times them.

How it fits: an iteration costs ``fixed + per_token * num_tokens + per_context_token *
context_tokens + per_attended * attended``, a copy ``fixed + bytes / bandwidth``. The
coefficients are non-negative least squares with every row divided by its measured time, so that
the fit minimises relative error (MAPE is what is reported); with at most four unknowns the NNLS
solution is found exactly by solving plain least squares on every subset of the columns and
keeping the best one with no negative coefficient. Every fourth point of each grid is held out of
the fit; the report gives the MAPE on the points fitted and on the held-out ones, and the load
average before and after: another process on the machine slows points unevenly and spoils the fit.
"""
from __future__ import annotations

import datetime
import itertools
import os
import platform
import time
from dataclasses import asdict, dataclass

import numpy as np
import torch

from engine.config import EngineConfig, ModelConfig
from engine.cost_model import CostModel
from engine.engine import Engine
from engine.executor import TorchExecutor
from engine.model import LlamaModel
from engine.profiling import Point, measure_copies, measure_iterations

HOLD_OUT_EVERY = 4  # points i with i % 4 == 3 are held out of the fit
SECTIONS = ("iterations", "compaction", "swap")  # the report's three fits
POOR_FIT_PCT = 25  # a held-out MAPE above this makes the summary warn (a busy machine, most likely)


@dataclass(frozen=True)
class Grid:
    """What is measured. The default takes well under a minute on two CPU cores with the tiny model."""

    decode_batches: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128)
    decode_contexts: tuple[int, ...] = (32, 128, 512, 2048, 4096)
    max_decode_tokens: int = 1 << 17  # batch x context above this is left out (the pool's size)
    prefill_chunks: tuple[int, ...] = (16, 64, 256, 512, 1024, 2048)
    prefill_starts: tuple[int, ...] = (0, 512, 2048)
    mixed: tuple[tuple[int, int, int], ...] = ((4, 256, 128), (4, 1024, 512), (8, 2048, 1024), (16, 512, 1024),
                                               (32, 256, 512), (32, 1024, 128), (64, 128, 256), (64, 512, 1024),
                                               (128, 256, 64))  # (decodes, mean context, chunk)
    copy_blocks: tuple[int, ...] = (4, 16, 32, 64, 128, 256, 512, 1024)  # blocks per copy

    def __post_init__(self) -> None:
        sizes = (*self.decode_batches, *self.decode_contexts, *self.prefill_chunks, *self.copy_blocks,
                 *(x for m in self.mixed for x in m))
        if any(n <= 0 for n in sizes) or any(s < 0 for s in self.prefill_starts):
            raise ValueError("grid: every batch, context, chunk and copy size must be > 0")
        if len(self.copy_blocks) < HOLD_OUT_EVERY:
            raise ValueError(f"grid: copy_blocks needs at least {HOLD_OUT_EVERY} sizes to hold one out")

    def points(self) -> list[Point]:
        pts = [Point(b, c) for b in self.decode_batches for c in self.decode_contexts
               if b * c <= self.max_decode_tokens]
        pts += [Point(0, 0, n, s) for s in self.prefill_starts for n in self.prefill_chunks]
        pts += [Point(b, c, n) for b, c, n in self.mixed]
        return pts


QUICK_GRID = Grid(decode_batches=(1, 8, 32), decode_contexts=(64, 512), prefill_chunks=(32, 128, 512),
                  prefill_starts=(0,), mixed=((8, 256, 128), (4, 512, 256)), copy_blocks=(4, 16, 64, 256, 1024))


# ---- fitting -----------------------------------------------------------------------------------
def nnls(a: np.ndarray, y: np.ndarray) -> np.ndarray:
    """``x >= 0`` minimising ``|a x - y|``: plain least squares on every subset of the (few)
    columns, the best solution without a negative coefficient. Columns are scaled to unit maximum
    first, so that seconds-per-token and seconds-per-pair sit side by side."""
    scale = np.abs(a).max(axis=0)
    scale[scale == 0] = 1.0
    a = a / scale
    cols = a.shape[1]
    best, best_err = np.zeros(cols), float(np.linalg.norm(y))
    for k in range(1, cols + 1):
        for support in itertools.combinations(range(cols), k):
            x, *_ = np.linalg.lstsq(a[:, support], y, rcond=None)
            if (x < 0).any():
                continue
            err = float(np.linalg.norm(a[:, support] @ x - y))
            if err < best_err:
                best, best_err = np.zeros(cols), err
                best[list(support)] = x
    return best / scale


def mape_pct(predicted: np.ndarray, measured: np.ndarray) -> float:
    """Mean absolute percentage error, in percent."""
    return float(100 * np.mean(np.abs(predicted - measured) / measured)) if len(measured) else float("nan")


def _fit(features: np.ndarray, seconds: np.ndarray) -> tuple[np.ndarray, dict]:
    """Relative-error NNLS on the points not held out; the coefficients and the error report."""
    held = np.arange(len(seconds)) % HOLD_OUT_EVERY == HOLD_OUT_EVERY - 1
    train = ~held
    coef = nnls(features[train] / seconds[train, None], np.ones(train.sum()))
    pred = features @ coef
    return coef, {"train_points": int(train.sum()), "held_out_points": int(held.sum()),
                  "train_mape_pct": mape_pct(pred[train], seconds[train]),
                  "held_out_mape_pct": mape_pct(pred[held], seconds[held]),
                  "predicted_s": pred.tolist(), "held_out": held.tolist()}


# ---- the whole profile -------------------------------------------------------------------------
def _device_name(device: str) -> str:
    if torch.device(device).type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{platform.machine() or 'cpu'} CPU, {torch.get_num_threads()} threads"


def profile(model_config: ModelConfig | None = None, device: str = "cpu", grid: Grid | None = None,
            repeats: int = 7, seed: int = 0, model: LlamaModel | None = None) -> tuple[CostModel, dict]:
    """Measure the torch executor on ``device`` over ``grid`` and fit a ``CostModel``; returns it
    and a report (every point measured and predicted, the fit errors, what ran where).

    ``model`` (e.g. a loaded checkpoint) replaces the seeded model of ``model_config``."""
    if repeats <= 0:
        raise ValueError(f"repeats must be > 0, got {repeats}")
    grid = grid or Grid()
    model_config = model.config if model is not None else model_config or ModelConfig()
    t0, load_before = time.perf_counter(), os.getloadavg()[0]
    points = [p for p in grid.points()  # what the model's positions allow
              if max(p.context * 3 // 2 + 1, p.chunk_start + p.chunk) < model_config.max_position]
    if len(points) < HOLD_OUT_EVERY:
        raise ValueError(f"only {len(points)} grid points fit the model's {model_config.max_position} positions")
    defaults = EngineConfig()
    block_bytes = model_config.kv_bytes_per_token() * defaults.block_size
    num_blocks = max(max(p.max_tokens // defaults.block_size + p.decodes + 2 for p in points),  # + rounding
                     2 * max(grid.copy_blocks))
    cfg = EngineConfig(num_blocks=num_blocks, max_num_seqs=max(p.decodes for p in points) + 1,
                       max_num_batched_tokens=max(p.decodes + p.chunk for p in points),
                       max_model_len=model_config.max_position, host_bytes=2 * max(grid.copy_blocks) * block_bytes,
                       seed=seed)
    engine = Engine(model_config, cfg, model=model, torch_device=device, executor=TorchExecutor())

    iterations = measure_iterations(engine, points, repeats, seed)
    features = np.array([[1.0, r["num_tokens"], r["context_tokens"], r["attended"]] for r in iterations])
    coef, it_fit = _fit(features, np.array([r["measured_s"] for r in iterations]))

    compaction, swaps = measure_copies(engine, grid.copy_blocks, repeats)
    copy_fits = []
    for rows in (compaction, swaps):
        c, fit = _fit(np.array([[1.0, r["bytes"]] for r in rows]), np.array([r["measured_s"] for r in rows]))
        copy_fits.append((c[0], 1.0 / max(c[1], 1e-18), fit))  # a zero slope would be infinite bandwidth
    (copy_fixed, copy_bw, copy_fit), (swap_fixed, swap_bw, swap_fit) = copy_fits

    date = datetime.date.today().isoformat()
    name = _device_name(device)
    cost = CostModel(fixed_s=float(coef[0]), per_token_s=float(coef[1]), per_context_token_s=float(coef[2]),
                     per_attended_s=float(coef[3]), copy_fixed_s=float(copy_fixed), copy_bytes_per_s=float(copy_bw),
                     swap_fixed_s=float(swap_fixed), swap_bytes_per_s=float(swap_bw),
                     source=f"fitted by rlctl profile on {device}: {name} (torch {torch.__version__}, {date})")

    def section(rows: list[dict], fit: dict) -> dict:
        for r, pred, held in zip(rows, fit.pop("predicted_s"), fit.pop("held_out")):
            r.update(predicted_s=pred, held_out=held)
        return {**fit, "points": rows}

    report = {
        "device": device, "device_name": name, "torch_version": torch.__version__,
        "torch_threads": torch.get_num_threads(), "cpu_count": os.cpu_count(), "date": date,
        "model": asdict(model_config), "block_size": cfg.block_size, "segment_blocks": cfg.segment_blocks,
        "block_bytes": block_bytes, "repeats": repeats, "statistic": "median after one warm-up run",
        "seed": seed, "hold_out": f"every {HOLD_OUT_EVERY}th point (index % {HOLD_OUT_EVERY} == {HOLD_OUT_EVERY - 1})",
        "iterations": section(iterations, it_fit),
        "compaction": section(compaction, copy_fit),
        "swap": section(swaps, swap_fit),
        "profile_s": round(time.perf_counter() - t0, 2),
        "load_average_1min": [load_before, os.getloadavg()[0]],  # before and after: was anything else running?
    }
    return cost, report


def summary(cost: CostModel, report: dict) -> str:
    """A few lines for a person: the coefficients and how well they fit."""
    def err(section: str) -> str:
        s = report[section]
        return (f"held-out MAPE {s['held_out_mape_pct']:.1f}% ({s['held_out_points']} points), "
                f"train {s['train_mape_pct']:.1f}% ({s['train_points']} points)")

    load = report["load_average_1min"]
    poor = any(report[s]["held_out_mape_pct"] > POOR_FIT_PCT for s in SECTIONS)
    return "\n".join([
        f"profile: {report['device_name']} ({report['device']}), torch {report['torch_version']}, "
        f"{report['repeats']} repeats, {report['profile_s']:.1f} s",
        f"iteration: {1e3 * cost.fixed_s:.4g} ms + {1e6 * cost.per_token_s:.4g} us/token "
        f"+ {1e9 * cost.per_context_token_s:.4g} ns/context token + {1e9 * cost.per_attended_s:.4g} ns/attended pair",
        f"  {err('iterations')}",
        f"compaction: {1e6 * cost.copy_fixed_s:.4g} us + bytes / {cost.copy_bytes_per_s / 1e9:.4g} GB/s",
        f"  {err('compaction')}",
        f"swap: {1e6 * cost.swap_fixed_s:.4g} us + bytes / {cost.swap_bytes_per_s / 1e9:.4g} GB/s",
        f"  {err('swap')}",
        *([f"warning: a held-out MAPE is over {POOR_FIT_PCT}%; the load average was {load[0]:.1f} before and "
           f"{load[1]:.1f} after: profile on an otherwise idle machine"] if poor else []),
    ])
