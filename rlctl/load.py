"""Putting any trace at a chosen load of a deployment: ``rlctl eval --trace FILE --load X``.

A trace records its own arrival rate, which says nothing about the GPU it is replayed on. The
time scale that puts it at ``X`` times what the deployment sustains is computed, not guessed:

- the trace's demand: its arrival rate (requests per trace second; a length-only trace is given
  Poisson arrivals at 1 request per trace second) and its mean prompt and output lengths (each
  output up to the declared ``max_tokens``);
- what the deployment sustains, from its cost model: B requests decode together, B the smaller of
  ``max_num_seqs`` and how many requests of mean length fit its KV cache, at the mean context
  (prompt plus half the output); each request also needs its prompt's prefill. The engine serves
  ``1 / (prefill time + output x decode iteration time / B)`` requests per second at most;
- the time scale = X x that rate / the trace's rate.

The line it prints states each of these, so a result names the load it was measured at.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from engine.config import EngineConfig, max_model_len
from engine.roofline import Deployment
from engine.scheduler import BatchShape, windowed
from env.workload_builder import load_trace
from env.workloads import MaxTokensRule, clip_length_arrays


@dataclass(frozen=True)
class Load:
    trace_rps: float
    mean_prompt: float
    mean_output: float
    batch: int
    sustainable_rps: float
    load: float

    @property
    def time_scale(self) -> float:
        return self.load * self.sustainable_rps / self.trace_rps

    def describe(self, trace: str, deployment: str) -> str:
        return (f"load: {trace} asks {self.trace_rps:.3g} req/s of trace time (prompt {self.mean_prompt:.0f}, "
                f"output {self.mean_output:.0f} tokens on average); {deployment} sustains {self.sustainable_rps:.3g} "
                f"req/s ({self.batch} decoding together); time scale {self.time_scale:.4g} puts it at "
                f"{self.load:g}x that")


def decode_keys(prompt: float, output: float, window: int, chunked: bool) -> float:
    """The keys a windowed layer's decode reads for a request of mean length: at the mean context (prompt plus
    half the output), min(context, window); in a chunked layer, whose keys follow a sawtooth over the
    positions, their mean over the request's decodes."""
    if not chunked:
        return windowed(1, int(prompt + output / 2), window)[0]
    n = max(int(output), 1)
    return windowed(n, int(prompt) + n, window, chunked=True)[1] / n


def trace_load(trace: str, deployment: Deployment, max_tokens: str, load: float, num_blocks: int | None = None) -> Load:
    """The demand of ``trace`` and what ``deployment`` sustains of it (see the module docstring), its KV
    ``num_blocks`` where given (``rlctl eval --kv-tokens``), else the deployment's."""
    if not (load > 0 and math.isfinite(load)):
        raise ValueError(f"--load must be a finite number > 0 (a multiple of what the deployment sustains), got {load}")
    t = load_trace(trace)
    cfg = deployment.engine_config(**({} if num_blocks is None else {"num_blocks": num_blocks}))
    mml = max_model_len(deployment.model, cfg)
    MaxTokensRule.parse(max_tokens, name="--max-tokens")  # a declared limit is at least the real output, so
    # it never lowers an output here: the lengths are fitted to the context as a replay fits them
    prompts, outputs = clip_length_arrays(t.prompt_lens, t.output_lens, mml)
    rps = t.mean_rate_rps if t.has_arrivals else 1.0
    if rps is None:
        raise ValueError(f"--load needs a trace whose arrivals span some time to read its rate from: {trace}'s "
                         f"{len(t)} request(s) all arrive at {float(t.arrivals.min()):g} s; give --time-scale instead")
    p, o = float(prompts.mean()), float(outputs.mean())
    cost = deployment.cost_model()
    kv_tokens = cfg.num_blocks * cfg.block_size
    batch = int(max(1, min(cfg.max_num_seqs, kv_tokens // max(p + o, 1))))
    context = int(p + o / 2)
    chunk = int(min(p, cfg.max_num_batched_tokens))
    decode, prefill = BatchShape(batch, batch * context, batch * context), BatchShape(chunk, chunk, chunk * (chunk + 1) // 2)
    w = cost.window  # the deployment's roofline clock
    if w is None:
        decode, prefill = cost.iteration_s(decode), cost.iteration_s(prefill)
    else:
        chunked = getattr(cost, "window_chunked", False)
        keys = decode_keys(p, o, w, chunked)
        decode = cost.iteration_s(decode, BatchShape(batch, batch * keys, batch * keys))
        prefill = cost.iteration_s(prefill, BatchShape(chunk, *windowed(chunk, chunk, w, chunked)))
    prefill = prefill * p / max(chunk, 1)
    sustainable = 1.0 / (prefill + o * decode / batch)
    return Load(rps, p, o, batch, sustainable, load)


def lengths_note(trace: str, deployment: Deployment, cfg: EngineConfig | None = None) -> str:
    """What a replay of ``trace`` on ``deployment`` (with engine settings ``cfg``, a scenario's; default
    the deployment's) changes in its lengths (``clip_lengths``): prompts that leave no room for an
    output in the context, outputs cut to fit it, and zero lengths (a BurstGPT failed request's 0
    response tokens) served as one token; empty where it changes none."""
    t = load_trace(trace)
    mml = max_model_len(deployment.model, cfg or deployment.engine_config())
    prompts, outputs = clip_length_arrays(t.prompt_lens, t.output_lens, mml)
    parts = []
    if n := int((t.prompt_lens > mml - 1).sum()):
        parts.append(f"{n} of the trace's {len(t)} prompts {_verb(n, 'leaves', 'leave')} no room for an output in "
                     f"{deployment.name}'s context ({mml} tokens) and {_verb(n, 'is', 'are')} cut to {mml - 1}, where "
                     f"an engine would refuse {_verb(n, 'it', 'them')}")
    if n := int(((t.prompt_lens <= mml - 1) & (outputs < t.output_lens)).sum()):
        parts.append(f"{n} of the others' outputs {_verb(n, 'is', 'are')} cut to end at the context")
    if zero := _zero_lengths(t):
        parts.append(zero)
    return f"lengths: {'; '.join(parts)}" if parts else ""


def zeros_note(trace: str) -> str:
    """The records of ``trace`` with zero lengths, which every replay serves as one token (``lengths_note``'s
    part that no deployment changes: what ``rlctl replay`` says); empty where there are none."""
    zero = _zero_lengths(load_trace(trace))
    return f"lengths: {zero}" if zero else ""


def _zero_lengths(t) -> str:
    failed = " (BurstGPT's failed requests)" if t.format == "burstgpt" else ""
    zero = [f"{n} {_verb(n, 'record', 'records')} with 0 {what} tokens{note}" for n, what, note in
            ((int((t.output_lens == 0).sum()), "output", failed), (int((t.prompt_lens == 0).sum()), "prompt", "")) if n]
    return " and ".join(zero) + ", replayed as 1 token" if zero else ""


def prefix_note(trace: str, deployment: Deployment, cfg: EngineConfig | None = None) -> str:
    """With a prefix cache (``cfg.prefix_caching``) and a trace that gives its prompts' hash ids
    (Mooncake's, Qwen Bailian's), the share of its prompt tokens (cut to the context) that open with hash ids an
    earlier prompt had, in file order: what a cache that kept everything would serve, a bound on
    what one engine's KV serves; empty otherwise."""
    cfg = cfg or deployment.engine_config()
    t = load_trace(trace)
    if not cfg.prefix_caching or t.hash_ids is None:
        return ""
    prompts, _ = clip_length_arrays(t.prompt_lens, t.output_lens, max_model_len(deployment.model, cfg))
    size, seen, shared = t.hash_block_tokens, set(), 0
    for ids, n in zip(t.hash_ids, prompts.tolist()):
        ids = ids[:-(-n // size)]
        k = next((k for k, h in enumerate(ids) if h not in seen), len(ids))
        shared += min(k * size, n)
        seen.update(ids)
    return (f"prefix cache: {shared / max(int(prompts.sum()), 1):.1%} of {Path(trace).name}'s prompt tokens open with "
            f"hash ids an earlier prompt had, what a cache keeping everything would serve (one engine's KV keeps less)")


def _verb(n: int, one: str, many: str) -> str:
    return one if n == 1 else many
