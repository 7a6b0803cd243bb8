"""Running policies on scenario episodes: the figures ``rlctl eval`` prints and plots.

Every figure comes from the environment's ``info``: the per-step raw figures for the time
series, and ``summary`` (``engine.metrics.summarize``) at the end of each episode. Episode k of
every policy uses seed ``seed + k``, so all policies see the same workloads. An episode depends on
nothing but its policy, scenario, shield and seed, so ``jobs`` > 1 runs them in that many worker
processes (the oracle's and the lookahead's first, the slowest) with the same figures as one after another.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from agents.policy import Policy
from env.overcommit_env import OvercommitEnv

SERIES = ("time_s", "kv_util", "overcommit", "queue_len", "oom_events", "preemptions", "generated_tokens_per_s")


def run_episode(env: OvercommitEnv, policy: Policy, seed: int) -> tuple[dict, dict[str, list]]:
    """One episode of ``policy``; its summary and its time series."""
    obs, info = env.reset(seed=seed, options={"engine": policy.engine_overrides})
    policy.reset(seed, env=env)
    series = {k: [] for k in SERIES}
    rewards = []
    while True:
        policy.see(env.engine.last_snapshot)
        obs, reward, terminated, truncated, info = env.step(policy.act(obs))
        rewards.append(reward)
        for k in SERIES:
            series[k].append(info[k])
        if terminated or truncated:
            return {**info["summary"], "episode_reward": float(np.sum(rewards))}, series


def evaluate(env: OvercommitEnv, policy: Policy, episodes: int = 1, seed: int = 0) -> dict:
    """Mean figures over ``episodes`` (and each episode's), plus the first episode's time series."""
    return _figures(policy.name, [run_episode(env, policy, seed + k) for k in range(episodes)])


def _figures(name: str, runs: list[tuple[dict, dict]]) -> dict:
    """The figures ``evaluate`` returns, from its episodes' (summary, series) in seed order."""
    summaries = [s for s, _ in runs]
    mean = {}
    for key, value in summaries[0].items():
        values = [s[key] for s in summaries]
        if isinstance(value, (int, float)) and not isinstance(value, bool) and all(v is not None for v in values):
            mean[key] = float(np.mean(values))
        else:
            mean[key] = value
    return {**mean, "policy": name, "episodes": summaries, "series": runs[0][1]}




TRACE_BASE = "trace"  # the bundled scenario a bare --trace replays on: its deployment, SLOs and settings


def eval_scenario(scenario: str | None, trace: str | None, time_scale: float | None, max_tokens: str | None,
                  steps: int | None, load: float | None = None, deployment: str | None = None, say=print,
                  rate_scale: float | None = None, client_timeout: float | None = None, prefix_caching: bool = False,
                  kv_tokens: int | None = None):
    """The scenario ``rlctl eval`` runs: a scenario file (or bundled name), or a trace replayed on
    a scenario's deployment and settings (``--scenario``, default the bundled ``trace`` scenario),
    at a time scale given, or computed for ``--load`` (rlctl/load.py) on ``--deployment``; a
    scenario's own workload with its arrivals ``rate_scale`` times as frequent (``Scenario.at_load``,
    as training's ``loads``); with ``client_timeout``, clients that give up a request still without its
    first token that many seconds after its arrival (``EngineConfig.client_timeout_s``); with
    ``prefix_caching``, the engine keeps a prefix cache (``EngineConfig.prefix_caching``); with ``kv_tokens``,
    its KV holds that many tokens (``with_kv_tokens``)."""
    import math

    from engine.roofline import deployment as find_deployment
    from env.scenario import TraceWorkload
    from env.scenario_yaml import load_scenario
    from env.workload_builder import check_workload, load_trace
    from rlctl.load import lengths_note, prefix_note, trace_load

    if rate_scale is not None:
        if trace is not None:
            raise ValueError("--rate-scale applies to a scenario's own workload; a trace takes --load or --time-scale")
        if not (rate_scale > 0 and math.isfinite(rate_scale)):
            raise ValueError(f"--rate-scale must be a finite number > 0, got {rate_scale:g}")
    sc = load_scenario(scenario or (TRACE_BASE if trace is not None else "steady"))
    if deployment is not None:
        if trace is None:
            raise ValueError("--deployment applies to --trace")
        find_deployment(deployment)  # an unknown name is refused, naming the known ones
        sc = dataclasses.replace(sc, deployment=deployment)
    if kv_tokens is not None:
        sc = with_kv_tokens(sc, kv_tokens)
    if trace is not None:
        if load is not None and time_scale is not None:
            raise ValueError("give --load or --time-scale, not both")
        base = sc.workload if isinstance(sc.workload, TraceWorkload) else None
        rule = max_tokens or sc.workload.max_tokens
        if load is not None:
            fit = trace_load(trace, find_deployment(sc.deployment), rule, load,
                             num_blocks=None if kv_tokens is None else sc.engine_config().num_blocks)
            say(fit.describe(trace, sc.deployment))
            time_scale = fit.time_scale
        # a length-only trace gets Poisson arrivals, one per trace second
        rate = None if load_trace(trace).has_arrivals else 1.0
        workload = TraceWorkload(trace=trace, time_scale=time_scale or (base.time_scale if base else 1.0),
                                 max_tokens=rule, rate_rps=rate)
        check_workload(workload)
        sc = dataclasses.replace(sc, workload=workload, name=f"{trace}" + (f" at load {load:g}" if load else ""))
    elif time_scale is not None or max_tokens is not None or load is not None:
        raise ValueError("--time-scale, --max-tokens and --load apply to --trace")
    if rate_scale is not None:
        sc = sc.at_load(rate_scale)
    if client_timeout is not None:
        sc = with_client_timeout(sc, client_timeout)
    if prefix_caching:
        sc = dataclasses.replace(sc, engine={**sc.engine, "prefix_caching": True})
        try:
            sc.engine_config()
        except ValueError as exc:
            raise ValueError(f"--prefix-caching on scenario {sc.name}: {exc}") from None
    if steps is not None:
        if steps <= 0:
            raise ValueError(f"--steps must be > 0, got {steps}")
        sc = dataclasses.replace(sc, max_steps=steps)
    if isinstance(sc.workload, TraceWorkload):  # a trace given or the scenario's own: what its replay changes
        for note in (lengths_note(sc.workload.trace, find_deployment(sc.deployment), sc.engine_config()),
                     prefix_note(sc.workload.trace, find_deployment(sc.deployment), sc.engine_config()),
                     trace_outlasted(sc, sc.workload.trace, load)):
            if note:
                say(note)
    return sc


def with_kv_tokens(sc, tokens: int):
    """``sc`` with its engine's KV sized to ``tokens`` (in whole blocks, as an engine sizes its pool), as an
    engine reports its own: the device holds what the KV needs beside the weights and workspace, the
    margin the deployment leaves (its 10 %) kept."""
    from engine.roofline import deployment as find_deployment

    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1:
        raise ValueError(f"--kv-tokens must be a whole number of tokens > 0, got {tokens!r}")
    d, cfg = find_deployment(sc.deployment), sc.engine_config()
    blocks = tokens // cfg.block_size
    if blocks < 1:
        raise ValueError(f"--kv-tokens {tokens} is less than one block of {cfg.block_size} tokens")
    more = max(0, blocks - d.num_blocks()) * d.model.kv_bytes_per_token() * cfg.block_size
    return dataclasses.replace(sc, engine={**sc.engine, "num_blocks": blocks, "device_bytes": cfg.device_bytes + more})


def deployment_line(sc) -> str:
    """What the scenario's engine runs on: the model, its weights, the GPU and the KV capacity it is
    sized to (``Deployment.describe``), with the context and batch limits, and the scenario's own KV
    size where it sets one."""
    from engine.config import max_model_len
    from engine.roofline import deployment as find_deployment

    d, cfg = find_deployment(sc.deployment), sc.engine_config()
    line = (f"deployment: {d.describe()}; context {max_model_len(d.model, cfg)} tokens, at most {cfg.max_num_seqs} "
            f"sequences and {cfg.max_num_batched_tokens} tokens an iteration")
    if cfg.num_blocks != d.num_blocks():
        line += f"; the scenario sizes its KV to {cfg.num_blocks} blocks ({cfg.num_blocks * cfg.block_size} tokens)"
        if cfg.num_blocks > d.num_blocks():
            line += f", more than the {d.gpu.name} holds beside the weights here"
            if cfg.device_bytes > d.gpu.memory_bytes:  # --kv-tokens: the GPU as the engine that reported it has it
                line += f" (its memory taken as {cfg.device_bytes / 1e9:.1f} GB to hold it)"
    return line


def thin_windows_note(sc, results: dict, seed: int) -> str:
    """A note naming the episodes whose trace window holds under half the requests the trace's mean rate
    gives (a trace's arrivals may have gaps or a daily cycle, and ``--load`` reads the mean): those ran
    below the load asked. Empty where none does, or the workload is no trace with arrival times."""
    from env.scenario import TraceWorkload
    from env.workload_builder import load_trace, trace_span

    w = sc.workload
    if not isinstance(w, TraceWorkload) or w.rate_rps is not None:
        return ""
    rate = load_trace(w.trace).mean_rate_rps
    if rate is None:
        return ""
    # a window past the trace's end holds only what the trace has (trace_outlasted says so)
    expected = rate * min(sc.episode_s * w.time_scale, trace_span(w))
    counts = [e["requests_submitted"] for e in next(iter(results.values()))["episodes"]]
    thin = [(seed + k, n) for k, n in enumerate(counts) if n < expected / 2]
    if expected < 10 or not thin:  # below ten requests a window, chance alone halves one
        return ""
    return (f"note: {len(thin)} of {len(counts)} episode(s) drew a window of {w.trace} holding under half the "
            f"{expected:.0f} requests its mean rate gives ({', '.join(f'seed {k}: {n}' for k, n in thin)}): its "
            f"arrivals are uneven (gaps, a daily cycle), so those episodes ran below the load asked")


def trace_outlasted(sc, trace: str, load: float | None) -> str:
    """A note where the episode runs past the trace's last arrival (none arrives after it, so the
    load it was put at does not hold for the episode), with the ``--steps`` that keeps within it;
    empty where it does not."""
    from env.workload_builder import trace_span

    scale, span = sc.workload.time_scale, trace_span(sc.workload)
    if span >= sc.episode_s * scale:
        return ""
    steps = int(span / scale // sc.decision_interval_s)
    while steps and sc.decision_interval_s * steps * scale > span:
        steps -= 1  # the check's own arithmetic (``Scenario.episode_s``), whatever the rounding
    keep = (f"--steps {steps} keeps the episode within it" if steps else
            f"they end within the first {sc.decision_interval_s:g} s step, so no episode stays within them")
    return (f"note: {trace}'s arrivals span {span:g} s of trace time, the first {span / scale:.4g} s of each "
            f"{sc.episode_s:g} s episode at time scale {scale:.4g}; after that none arrives and the engine only "
            f"drains" + (f", so the episode as a whole runs below {load:g}x" if load else "") + f" ({keep})")


def with_client_timeout(sc, timeout: float):
    """Scenario ``sc`` with clients that give up a request still without its first token ``timeout``
    seconds after its arrival (``--client-timeout``; ``EngineConfig.client_timeout_s``)."""
    sc = dataclasses.replace(sc, engine={**sc.engine, "client_timeout_s": float(timeout)})
    try:  # EngineConfig holds the rule; the scenario's other settings were checked when it loaded
        sc.engine_config()
    except ValueError:
        raise ValueError(f"--client-timeout must be a finite number of seconds > 0, got {timeout:g}") from None
    return sc


def make_env(scenario, shield: bool, training: bool = False):
    """The environment of ``scenario``: ``rlctl/SharedGPU-v0`` for a node scenario (several engines
    on one GPU), else ``rlctl/Overcommit-v0``; with the safety shield if ``shield`` (the one a
    policy trains behind if ``training``, agents/shield.py)."""
    from agents.shield import TRAINING, NodeShield, Shield
    from env.node_scenario import is_node_scenario
    from env.shared_gpu_env import SharedGPUEnv

    if is_node_scenario(scenario):
        return SharedGPUEnv(scenario, shield=NodeShield() if shield else None)
    return OvercommitEnv(scenario, shield=(TRAINING if training else Shield()) if shield else None)


def run_eval(policies: list[Policy], scenario, episodes: int, seed: int, shield: bool, jobs: int = 1) -> dict[str, dict]:
    """Every policy on the same ``episodes`` seeds of ``scenario``."""
    return run_evals([(p, shield) for p in policies], scenario, episodes, seed, jobs)


def run_evals(entries: list[tuple[Policy, bool]], scenario, episodes: int, seed: int, jobs: int = 1) -> dict[str, dict]:
    """Each ``(policy, shield)`` on the same ``episodes`` seeds of ``scenario``, keyed by the
    policy's name in the order given; ``jobs`` > 1 runs the episodes in that many processes. Two
    policies of one name are refused: the second's figures would silently stand for both
    (``agents.spec.label_policies`` gives each its own)."""
    names = [p.name for p, _ in entries]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise ValueError(f"policies: {', '.join(map(repr, repeated))} named more than once; the figures are keyed by "
                         "name (agents.spec.label_policies labels trained policies by their paths)")
    if episodes <= 0:
        raise ValueError(f"--episodes must be > 0, got {episodes}")
    if isinstance(jobs, bool) or not isinstance(jobs, int) or jobs < 1:
        raise ValueError(f"--jobs must be a whole number >= 1 (evaluation processes), got {jobs!r}")
    if jobs == 1:
        envs = {s: make_env(scenario, s) for s in dict.fromkeys(s for _, s in entries)}
        return {p.name: evaluate(envs[s], p, episodes, seed) for p, s in entries}
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    from agents.oracle import Oracle

    tasks = [(i, k) for i in range(len(entries)) for k in range(episodes)]
    tasks.sort(key=lambda t: not isinstance(entries[t[0]][0], Oracle))  # the slowest first, so none is left last
    with ProcessPoolExecutor(min(jobs, len(tasks)), mp_context=multiprocessing.get_context("forkserver"),
                             initializer=_worker_init, initargs=(scenario,)) as pool:
        futures = {t: pool.submit(_worker_episode, entries[t[0]][0], entries[t[0]][1], seed + t[1]) for t in tasks}
        try:
            runs = {t: f.result() for t, f in futures.items()}
        except BaseException:
            pool.shutdown(cancel_futures=True)
            raise
    return {p.name: _figures(p.name, [runs[i, k] for k in range(episodes)]) for i, (p, _) in enumerate(entries)}


_WORKER: dict = {}  # in an evaluation process: its scenario, and one environment per shield setting


def _worker_init(scenario) -> None:
    import torch

    torch.set_num_threads(1)  # one core a process: the processes share the machine
    _WORKER["scenario"] = scenario


def _worker_episode(policy: Policy, shield: bool, seed: int) -> tuple[dict, dict[str, list]]:
    env = _WORKER.get(shield)
    if env is None:
        env = _WORKER[shield] = make_env(_WORKER["scenario"], shield)
    return run_episode(env, policy, seed)
