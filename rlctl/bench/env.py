"""``rlctl bench env``: the Gymnasium environment's speed on the bursty scenario (70B-4bit on an
H100, the roofline clock): steps/s and simulated engine-seconds per wall-second on one core and
with one environment per core, what bounds it (one episode under cProfile), and the ratio to
the target steps/s on one core. A benchmark, not a test: it measures and reports.
"""
from __future__ import annotations

import cProfile
import math
import multiprocessing as mp
import os
import pstats
import queue as queues
import time
from dataclasses import dataclass, replace
from pathlib import Path

import gymnasium

from agents.spec import make_policy
from env.overcommit_env import OvercommitEnv
from env.scenario import Scenario
from env.scenario_yaml import load_scenario
from rlctl.bench.machine import machine, sig
from rlctl.evaluate import run_episode

# ---- the environment ---------------------------------------------------------------------------
ENV_TARGET_STEPS_PER_S = 1000  # environment steps per second on one CPU core: fast enough to train and to run the oracle


@dataclass(frozen=True)
class EnvBenchSizes:
    """What ``rlctl bench env`` runs. Each measurement runs whole episodes until ``seconds`` of
    wall time are spent (at least one episode); the defaults take about half a minute in all."""

    scenario: str | Path | Scenario = "burst"  # a bundled name, a YAML path, or a Scenario
    max_steps: int | None = None  # override the scenario's episode length (steps)
    policy: str = "random"        # agents/baselines.py ``make_policy`` spec: the fixed action mix
    seconds: float = 10.0         # wall budget of the single-core and of the parallel measurement
    processes: int | None = None  # parallel environments, one per process (default: os.cpu_count())
    seed: int = 0                 # episode k uses seed + k, in every process
    top: int = 5                  # profile entries reported

    def __post_init__(self) -> None:
        if self.max_steps is not None and self.max_steps <= 0:
            raise ValueError(f"max_steps must be > 0, got {self.max_steps}")
        if not self.seconds >= 0 or math.isinf(self.seconds):
            raise ValueError(f"seconds must be a finite number >= 0, got {self.seconds}")
        if self.processes is not None and self.processes <= 0:
            raise ValueError(f"processes must be > 0, got {self.processes}")
        if self.top <= 0:
            raise ValueError(f"top must be > 0, got {self.top}")


def _env_scenario(sizes: EnvBenchSizes):


    sc = sizes.scenario if isinstance(sizes.scenario, Scenario) else load_scenario(sizes.scenario)
    return replace(sc, max_steps=sizes.max_steps) if sizes.max_steps is not None else sc


def _env_run(scenario, policy_spec: str, seconds: float, seed: int, barrier=None) -> dict:
    """Whole episodes on one environment until ``seconds`` of wall time are spent; what they did.
    The wall time includes ``reset`` (drawing the episode's workload), as a trainer pays it, and
    the bench's own tallies, which read the iteration log's columns (one numpy sum, not a Python
    object per iteration: that cost 30 % of the wall and is not the environment's)."""

    env, policy = OvercommitEnv(scenario), make_policy(policy_spec)
    env.reset(seed=seed)  # warm-up: imports, the trace's lengths read and cached
    if barrier is not None:
        barrier.wait()
    episodes = steps = iterations = decode_seqs = 0
    engine_s = 0.0
    t0 = time.perf_counter()
    while True:
        steps += run_episode(env, policy, seed + episodes)[0]["steps"]
        episodes += 1
        e = env.engine
        iterations += e.counters.iterations
        decode_seqs += int(e.iterations.column("decode_tokens").sum())
        engine_s += e.clock
        wall = time.perf_counter() - t0
        if wall >= seconds:
            break
    return {"episodes": episodes, "steps": steps, "iterations": iterations, "decode_seqs": decode_seqs,
            "engine_s": engine_s, "wall_s": wall}


def _env_figures(run: dict) -> dict:
    wall, steps, its = run["wall_s"], run["steps"], run["iterations"]
    return {
        "episodes": run["episodes"], "steps": steps, "engine_iterations": its, "wall_s": sig(wall),
        "steps_per_s": sig(steps / wall),
        "engine_s_per_wall_s": sig(run["engine_s"] / wall),
        "iterations_per_s": sig(its / wall),
        "iterations_per_step": sig(its / steps),
        "us_per_iteration": sig(1e6 * wall / its) if its else None,  # all-in: the env's own work included
        "decode_seqs_per_iteration": sig(run["decode_seqs"] / its) if its else None,
    }


def _env_worker(scenario, policy_spec: str, seconds: float, seed: int, barrier, queue) -> None:
    try:
        queue.put(("ok", _env_run(scenario, policy_spec, seconds, seed, barrier)))
    except BaseException as exc:  # reported to the parent, which raises it
        if barrier is not None:
            barrier.abort()
        queue.put(("error", f"{type(exc).__name__}: {exc}"))


def _env_parallel(scenario, sizes: EnvBenchSizes, processes: int) -> dict:
    """One environment per process, ``processes`` of them started together (a barrier after
    their warm-up), each running for the same wall budget."""

    ctx = mp.get_context("spawn")
    barrier, results = ctx.Barrier(processes), ctx.Queue()
    procs = [ctx.Process(target=_env_worker, args=(scenario, sizes.policy, sizes.seconds, sizes.seed, barrier, results),
                         daemon=True) for _ in range(processes)]
    for p in procs:
        p.start()
    runs, errors = [], []
    try:
        deadline = time.monotonic() + sizes.seconds + 300  # start-up (imports) and the last episode
        while len(runs) + len(errors) < processes:
            try:
                status, value = results.get(timeout=0.5)
            except queues.Empty:
                dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
                if dead or time.monotonic() > deadline:
                    raise RuntimeError(
                        f"bench env: {len(dead)} of {processes} parallel workers died without a report (exit codes "
                        f"{dead}; with the spawn start method the calling script needs an "
                        f"`if __name__ == '__main__':` guard)" if dead else
                        "bench env: parallel workers did not report in time") from None
                continue
            (runs if status == "ok" else errors).append(value)
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.terminate()
    if errors:
        raise RuntimeError(f"bench env: a parallel worker failed: {errors[0]}")
    per = [r["steps"] / r["wall_s"] for r in runs]
    return {
        "processes": processes, "start_method": "spawn",
        "aggregate_steps_per_s": sig(sum(per)),
        "per_process_steps_per_s": [sig(x) for x in per],
        "mean_per_process_steps_per_s": sig(sum(per) / len(per)),
        "aggregate_engine_s_per_wall_s": sig(sum(r["engine_s"] / r["wall_s"] for r in runs)),
        "aggregate_iterations_per_s": sig(sum(r["iterations"] / r["wall_s"] for r in runs)),
        "episodes": sum(r["episodes"] for r in runs), "steps": sum(r["steps"] for r in runs),
    }


def _where(key: tuple, root: str) -> str:
    """``file:function`` of a pstats key, the file relative to the project (or its base name)."""
    file, _, func = key
    if file == "~":  # a built-in
        return func.strip("<>")
    rel = os.path.relpath(file, root) if os.path.isabs(file) else file
    return f"{rel if not rel.startswith('..') else os.path.basename(file)}:{func}"


def _env_profile(scenario, sizes: EnvBenchSizes) -> dict:
    """One episode under cProfile: where its time goes."""
    env, policy = OvercommitEnv(scenario), make_policy(sizes.policy)
    env.reset(seed=sizes.seed)  # warm-up, as in the timed runs
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    steps = run_episode(env, policy, sizes.seed)[0]["steps"]
    prof.disable()
    wall = time.perf_counter() - t0
    stats = pstats.Stats(prof).stats  # (file, line, function) -> (prim. calls, calls, internal, cumulative, callers)
    total = sum(v[2] for v in stats.values()) or 1e-12
    root = str(Path(__file__).resolve().parents[2])
    driver = run_episode.__code__  # the episode loop itself, like this file, is not what is measured
    ours = [k for k in stats if os.path.isabs(k[0]) and not os.path.relpath(k[0], root).startswith("..")
            and not os.path.relpath(k[0], root).startswith(os.path.join("rlctl", "bench"))
            and (k[0], k[1], k[2]) != (driver.co_filename, driver.co_firstlineno, driver.co_name)]

    def entry(k: tuple, col: int) -> dict:
        return {"function": _where(k, root), "share": round(stats[k][col] / total, 3), "calls": stats[k][1]}

    by_internal = sorted(stats, key=lambda k: stats[k][2], reverse=True)[:sizes.top]
    by_cumulative = sorted(ours, key=lambda k: stats[k][3], reverse=True)[:sizes.top]
    files: dict[str, float] = {}
    for k, v in stats.items():
        f = _where(k, root).rsplit(":", 1)[0] if k[0] != "~" else "built-ins"
        files[f] = files.get(f, 0.0) + v[2]
    run = [k for k in stats if k[0].endswith(os.path.join("engine", "engine.py")) and k[2] == "run"]
    e = env.engine
    return {
        "episode_steps": steps, "engine_iterations": e.counters.iterations, "profiled_wall_s": sig(wall),
        "engine_run_share": round(stats[run[0]][3] / total, 3) if run else None,
        "top_internal": [entry(k, 2) for k in by_internal],
        "top_cumulative": [entry(k, 3) for k in by_cumulative],
        "top_files_internal": [{"file": f, "share": round(t / total, 3)}
                               for f, t in sorted(files.items(), key=lambda x: x[1], reverse=True)[:sizes.top]],
    }


def _bound_by(single: dict, prof: dict) -> str:
    """One line: what a step's wall time is made of, from the timed run and the profile."""
    hot = ", ".join(f"{e['function']} {e['share']:.0%}" for e in prof["top_internal"][:3])
    share = prof["engine_run_share"]
    per_it = (f"{single['iterations_per_step']:.3g} iterations per step x {single['us_per_iteration']:.3g} us "
              f"per iteration (~{single['decode_seqs_per_iteration']:.3g} decoding sequences each)")
    if share is not None and share >= 0.5:
        what = "Python per-sequence scheduling work per engine iteration: " + per_it
        what += f"; engine iterations take {share:.0%} of a step"
    else:
        what = "the environment's own per-step work (observation, reward, reset), not the engine: " + per_it
        if share is not None:
            what += f"; engine iterations take only {share:.0%} of a step"
    return what + f"; hottest (internal time): {hot}"


def bench_env(sizes: EnvBenchSizes | None = None) -> dict:
    """Steps/s of the environment (tensor-free ``ProfiledExecutor`` on the scenario's roofline
    clock) on one core, on every core in parallel, and where one episode's time goes."""

    sizes = sizes or EnvBenchSizes()
    scenario = _env_scenario(sizes)
    processes = sizes.processes or os.cpu_count() or 1
    load_at_start = machine()
    t0 = time.perf_counter()
    single = _env_figures(_env_run(scenario, sizes.policy, sizes.seconds, sizes.seed))
    prof = _env_profile(scenario, sizes)
    parallel = _env_parallel(scenario, sizes, processes)
    parallel["ratio_to_single"] = sig(parallel["aggregate_steps_per_s"] / single["steps_per_s"])
    # cProfile slows many small calls most: shares are of the profiled run
    prof["profiler_slowdown"] = sig(prof["profiled_wall_s"] * single["steps_per_s"] / prof["episode_steps"], 3)

    cost = OvercommitEnv(scenario).cost

    return {
        "scenario": scenario.name, "deployment": scenario.deployment, "clock": cost.describe(),
        "policy": sizes.policy, "max_steps": scenario.max_steps, "decision_interval_s": scenario.decision_interval_s,
        "seconds_per_measurement": sizes.seconds,
        "single": single,
        "parallel": parallel,
        "profile": prof,
        "bound_by": _bound_by(single, prof),
        "target_steps_per_s": ENV_TARGET_STEPS_PER_S,
        "ratio_to_target": sig(single["steps_per_s"] / ENV_TARGET_STEPS_PER_S),
        "machine": load_at_start | {"gymnasium_version": gymnasium.__version__},
        "bench_s": round(time.perf_counter() - t0, 1),
    }
