"""``rlctl``: one command line for everything (replay, serve, train, eval, sweep, results, compare, explain, bench,
profile, demo).

This file holds every subcommand's options, their checks and the dispatch, and so runs past 350
lines; the work itself lives in the modules each command calls."""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
from pathlib import Path
from dataclasses import asdict
import sys

from experiments import CASES, bundled
from rlctl import __version__
from env.workloads import ReplaySpec, TraceError
from engine.config import KV_CACHE_DTYPES, EngineConfig
from rlctl.replay import DEFAULT_ENGINE, build_engine, load_requests, replay
from rlctl.report import ABANDONED_ROW, EVAL_ROWS, LIVE_ROWS, PREFIX_ROW, backlog_note, compare, format_actuators, format_table, slo_note


MAX_POLICY_MIB = 4096  # --max-policy-mib's ceiling: the default network's file is ~160 kB
METRICS_ADDR = "127.0.0.1"  # where --metrics-port serves unless --metrics-addr (with --metrics-public) says otherwise


def _factor(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"overcommit factor must be > 0 (or inf), got {text}")
    return value


MAX_SEED = 2 ** 32 - 1  # numpy's and gymnasium's seeds: an episode k of a run uses seed + k


def _integer(text: str, low: int, high: int | None = None, what: str = "expected a whole number") -> int:
    """``text`` as an integer in ``low..high`` (no ``high``: at least ``low``), else argparse's refusal."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{what}, got {text!r}") from None
    if value < low or (high is not None and value > high):
        bound = f"in {low}..{high}" if high is not None else f">= {low}" if low <= 0 else f"> {low - 1}"
        raise argparse.ArgumentTypeError(f"{what} {bound}, got {text}")
    return value


def _seed(text: str) -> int:
    return _integer(text, 0, MAX_SEED, what="a seed is an integer")


def _whole(text: str) -> int:
    return _integer(text, 0)


def _count(text: str) -> int:
    return _integer(text, 1)


def _device(text: str) -> str:
    """``--device``: cpu, or cuda[:N] where CUDA is available."""
    import torch

    try:
        device = torch.device(text)
    except RuntimeError:
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise argparse.ArgumentTypeError(f"expected cpu or cuda[:N], got {text!r}")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise argparse.ArgumentTypeError(f"{text}: CUDA is not available (this torch: {torch.__version__})")
    return text


def _finite(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text}")
    return value


def _positive(text: str) -> float:
    value = _finite(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text}")
    return value


def _non_negative(text: str) -> float:
    value = _finite(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text}")
    return value


def _jobs(text: str) -> int:
    """``--jobs``: a number of evaluation processes, or ``auto`` for one per core."""
    if text == "auto":
        return os.cpu_count() or 1
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1 or auto, got {text!r}")
    return value


def _jobs_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--jobs", type=_jobs, default=1, metavar="N",
                   help="run the episodes in N processes, or auto for one per core (the same figures; default 1)")


def _json_option(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument("--json", default=None, metavar="PATH",
                   help=f"write {what} as JSON to PATH; '-': to standard output, the rest going to standard error")


def _writable(option: str, path: str) -> Path:
    """``path`` if a file can be written there, checked before a command runs, not after."""
    out = Path(path)
    folder = out.parent.resolve()
    if not folder.is_dir():
        raise ValueError(f"{option} {path}: directory {folder} does not exist")
    if out.is_dir() or not os.access(folder, os.W_OK) or (out.exists() and not os.access(out, os.W_OK)):
        raise ValueError(f"{option} {path}: not a writable file")
    return out


def _write_json(a: argparse.Namespace, data) -> None:
    """``data`` to ``--json``'s file, or to standard output for ``-`` (where ``main`` keeps nothing else)."""
    if a.json == "-":
        json.dump(data, a.stdout, indent=2, default=str)
        a.stdout.write("\n")
        return
    with open(a.json, "w") as f:
        json.dump(data, f, indent=2, default=str)


def _add_deployment(p: argparse.ArgumentParser) -> None:
    d = DEFAULT_ENGINE
    g = p.add_argument_group("deployment")
    g.add_argument("--blocks", type=int, default=d.num_blocks, help="KV capacity in blocks (default %(default)s)")
    g.add_argument("--block-size", type=int, default=d.block_size)
    g.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs)
    g.add_argument("--max-batched-tokens", type=int, default=d.max_num_batched_tokens)
    g.add_argument("--max-model-len", type=int, default=d.max_model_len)
    g.add_argument("--downtime", type=_non_negative, default=d.restart_downtime_s, help="restart downtime after an OOM crash (s)")
    g.add_argument("--ttft-slo", type=_positive, default=None, help="TTFT target (s) for goodput")
    g.add_argument("--tpot-slo", type=_positive, default=None, help="TPOT target (s) for goodput")
    g.add_argument("--client-timeout", type=float, default=None, metavar="SECONDS",
                   help="clients give up a request still without its first token this long after it arrived, and "
                        "the engine drops it (default: they wait for ever)")
    g.add_argument("--model-dir", default=None, help='local Hugging Face checkpoint of a family the engine runs (README, "Replaying a trace") (default: tiny seeded model)')
    g.add_argument("--kv-cache-dtype", choices=list(KV_CACHE_DTYPES), default=None,
                   help="what the KV cache holds: the model's dtype (auto), or 8-bit floats read back to attend, as "
                        "vLLM's --kv-cache-dtype (default: fp8 where the checkpoint declares its KV calibrated for it, "
                        "as vLLM holds it, but for a latent-attention cache, else auto)")
    g.add_argument("--prefix-caching", action="store_true",
                   help="keep a prefix cache, as vLLM's (on by default there) and SGLang's radix cache: a request takes "
                        "the KV blocks of its first tokens that another computed (a trace's hash_ids, or the same "
                        "prompt ids) instead of computing them again")
    g.add_argument("--device", type=_device, default="cpu", help="cpu or cuda[:N]")
    g.add_argument("--seed", type=_seed, default=d.seed)


def _add_workload(p: argparse.ArgumentParser, trace_required: bool) -> None:
    g = p.add_argument_group("workload")
    g.add_argument("--trace", required=trace_required, default=None, help="trace file (Azure CSV, BurstGPT CSV, Mooncake or Qwen Bailian JSONL, vidur or length-only CSV), or a bundled trace by name")
    g.add_argument("--time-scale", type=_positive, default=1.0, help="arrival compression factor (default %(default)s)")
    g.add_argument("--start", type=float, default=0.0, help="window start in trace seconds")
    g.add_argument("--duration", type=float, default=60.0, help="window length in trace seconds (default %(default)s)")
    g.add_argument("--max-tokens", default="fixed:2048", help="declared max_tokens rule: fixed:N or scale:X (default %(default)s)")
    g.add_argument("--rate", type=float, default=None, help="Poisson arrival rate (req/s) for length-only traces")
    g.add_argument("--limit", type=int, default=None, help="replay at most this many requests")


# the engine's and the replay's field names, as the deployment and workload flags that set them
FLAGS = {"num_blocks": "--blocks", "block_size": "--block-size", "max_num_seqs": "--max-num-seqs",
         "max_num_batched_tokens": "--max-batched-tokens", "max_model_len": "--max-model-len",
         "restart_downtime_s": "--downtime", "ttft_slo_s": "--ttft-slo", "tpot_slo_s": "--tpot-slo",
         "client_timeout_s": "--client-timeout", "time_scale": "--time-scale", "start_s": "--start",
         "duration_s": "--duration", "rate_rps": "--rate", "limit": "--limit", "max_tokens": "--max-tokens"}


@contextlib.contextmanager
def _flags_named():
    """A refusal that names a field set from a flag names the flag instead (num_blocks -> --blocks)."""
    try:
        yield
    except ValueError as exc:
        field, _, rest = str(exc).partition(" ")
        field = field.rstrip(":")
        if field in FLAGS:
            raise ValueError(f"{FLAGS[field]} {rest}") from None
        raise


def _engine_config(a: argparse.Namespace) -> EngineConfig:
    with _flags_named():
        return EngineConfig(num_blocks=a.blocks, block_size=a.block_size, max_num_seqs=a.max_num_seqs,
                            max_num_batched_tokens=a.max_batched_tokens, max_model_len=a.max_model_len,
                            restart_downtime_s=a.downtime, ttft_slo_s=a.ttft_slo, tpot_slo_s=a.tpot_slo, seed=a.seed,
                            client_timeout_s=a.client_timeout, prefix_caching=a.prefix_caching)


def _spec(a: argparse.Namespace, max_model_len: int) -> ReplaySpec:
    with _flags_named():
        return ReplaySpec(max_tokens=a.max_tokens, time_scale=a.time_scale, start_s=a.start, duration_s=a.duration,
                          max_model_len=max_model_len, rate_rps=a.rate, seed=a.seed, limit=a.limit)


def _kv_dtype(engine) -> str:
    """What the engine line says of the KV cache's dtype (--kv-cache-dtype, or the checkpoint's): nothing for the
    model's dtype."""
    held = engine.model_config.kv_cache_dtype
    return "" if held == "auto" else f" in {held}"


def _prefix(a: argparse.Namespace) -> str:
    """What the engine line says of --prefix-caching."""
    return ", a prefix cache" if a.prefix_caching else ""


def _replay_runs(a: argparse.Namespace, trace, factors: list[float]) -> dict[str, dict]:
    cfg = _engine_config(a)
    engines = [build_engine(cfg, f, a.oom, a.model_dir, a.device, kv_cache_dtype=a.kv_cache_dtype) for f in factors]
    spec = _spec(a, engines[0].max_model_len)  # clip to what the engine can hold
    with _flags_named():
        requests = load_requests(trace, spec)
    print(f"replay: {trace}: {len(requests)} requests; {spec.describe()}")
    _say_zeros(trace)
    print(f"engine: {cfg.num_blocks} KV blocks x {cfg.block_size} tokens{_kv_dtype(engines[0])}{_prefix(a)}, context {engines[0].max_model_len} tokens "
          f"(the least of --max-model-len, the model's max_position_embeddings and the KV), "
          f"oom={a.oom}, device={a.device}")
    runs = {}
    for f, e in zip(factors, engines):
        runs[f"overcommit {f:g}"] = {**replay(requests, e), "overcommit": f, "oom_mode": a.oom,
                                     "trace": str(trace), "workload": spec.describe(), "engine": asdict(e.config),
                                     "model": asdict(e.model_config), "context_tokens": e.max_model_len}
    return runs


def _say_zeros(trace) -> None:
    from rlctl.load import zeros_note

    if note := zeros_note(trace):
        print(note)


def _check_metrics(a: argparse.Namespace) -> str:
    """--metrics-port, --metrics-addr and --metrics-public (replay --controller, serve), checked before
    anything starts; the address the metrics will listen on."""
    from rlctl.online.addresses import check_metrics_addr

    if a.metrics_port is not None and not 0 <= a.metrics_port <= 65535:
        raise ValueError(f"--metrics-port must be a port number (0: any free one), got {a.metrics_port}")
    if a.metrics_port is None and (a.metrics_addr is not None or a.metrics_public):
        raise ValueError("--metrics-addr and --metrics-public say where --metrics-port serves: give --metrics-port too")
    check_metrics_addr(a.metrics_addr or METRICS_ADDR, a.metrics_public)
    return a.metrics_addr or METRICS_ADDR


def _add_metrics(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument("--metrics-port", type=int, default=None, metavar="P",
                   help=f"serve {what} for Prometheus on port P (0: any free one) of --metrics-addr")
    p.add_argument("--metrics-addr", default=None, metavar="HOST",
                   help=f"the address the metrics listen on (default {METRICS_ADDR}; "
                        "another than loopback only with --metrics-public)")
    p.add_argument("--metrics-public", action="store_true",
                   help="allow a --metrics-addr other than loopback: the metrics are then served, unauthenticated, "
                        "to whoever reaches that address")


def _check_controller(a: argparse.Namespace) -> None:
    """``--controller`` and its TLS files, refused before anything runs rather than as fallbacks."""
    from rlctl.online.addresses import check_pem, check_target

    check_target(a.controller)
    for path, option in ((a.controller_ca, "--controller-ca"), (a.controller_cert, "--controller-cert"),
                         (a.controller_key, "--controller-key")):
        check_pem(path, option)


def _live_run(a: argparse.Namespace) -> dict[str, dict]:
    """One replay steered by the sidecar at ``--controller``; ``--overcommit`` is the safe static
    factor the engine starts at and falls back to."""
    from rlctl.online.live import ClientTLS, steer
    from rlctl.online.mps import MPSLimit

    if len(a.overcommit) != 1 or not math.isfinite(a.overcommit[0]):
        raise ValueError("--controller: give one finite --overcommit, the safe factor the engine starts at "
                         "and falls back to when the sidecar fails")
    if (a.controller_cert is None) != (a.controller_key is None) or (a.controller_cert and not a.controller_ca):
        raise ValueError("--controller-cert and --controller-key go together, with --controller-ca")
    _check_controller(a)
    metrics_addr = _check_metrics(a)
    if a.mps_next_limit is not None:
        try:  # an ordinal or a UUID, refused here rather than mid-replay
            MPSLimit._device(a.mps_next_limit)
        except ValueError as exc:
            raise ValueError(f"--mps-next-limit: {exc}") from None
    factor = a.overcommit[0]
    cfg = _engine_config(a)
    engine = build_engine(cfg, factor, a.oom, a.model_dir, a.device, kv_cache_dtype=a.kv_cache_dtype)
    if a.mps_next_limit is not None and engine.pool.materialize and engine.device.torch_device.type != "cuda":
        raise ValueError(f"--mps-next-limit sizes the GPU's MPS limit for the next engine process from this "
                         f"engine's memory, and this engine holds its KV on {engine.device.torch_device}: run it "
                         "with --device cuda")
    spec = _spec(a, engine.max_model_len)
    requests = load_requests(a.trace, spec)
    print(f"replay: {a.trace}: {len(requests)} requests; {spec.describe()}")
    _say_zeros(a.trace)
    print(f"engine: {cfg.num_blocks} KV blocks x {cfg.block_size} tokens{_kv_dtype(engine)}{_prefix(a)}, oom={a.oom}, device={a.device}; "
          f"controller {a.controller} every {a.decision_interval:g} s (deadline {a.deadline_ms:g} ms, "
          f"safe factor {factor:g})")
    tls = ClientTLS(a.controller_ca, a.controller_cert, a.controller_key) if a.controller_ca else None
    figures = steer(requests, engine, a.controller, a.decision_interval, a.deadline_ms / 1000, factor, tls=tls,
                    metrics_port=a.metrics_port, metrics_addr=metrics_addr,
                    model_name=Path(a.model_dir).name if a.model_dir else "rlctl-tiny",
                    mps_device=a.mps_next_limit, say=lambda line: print(line, flush=True))
    return {"controller": {**figures, "overcommit": factor, "oom_mode": a.oom, "trace": str(a.trace),
                           "workload": spec.describe(), "engine": asdict(engine.config),
                           "model": asdict(engine.model_config)}}


def _node_live_run(a: argparse.Namespace) -> int:
    """A node scenario's engines (several on one GPU) steered by the node sidecar at ``--controller``
    through one episode's workloads, every request run to completion; ``--overcommit`` is the safe
    factor every engine falls back to."""
    from env.shared_gpu_env import SharedGPUEnv
    from rlctl.online.live import ClientTLS
    from rlctl.online.mps import CLIENT_LIMIT_ENV
    from rlctl.online.node_live import NodeLiveController, replay_node_live
    from rlctl.online.process_node import EngineProcessError, ProcessNode

    if not a.controller:
        raise ValueError("--node runs a node live, steered by a node sidecar (rlctl serve --node): give --controller ADDR")
    _check_controller(a)
    if a.trace is not None:
        raise ValueError("--node replays the node scenario's own workloads: leave out --trace")
    if a.client_timeout is not None:
        raise ValueError("--client-timeout applies to one engine's replay; a node scenario's engines take theirs from "
                         "its engine: settings (client_timeout_s)")
    if a.kv_cache_dtype is not None:
        raise ValueError("--kv-cache-dtype applies to one engine's replay; a node scenario's engines take theirs from "
                         "their deployments (CHECKPOINT_DIR@GPU:fp8)")
    if a.prefix_caching:
        raise ValueError("--prefix-caching applies to one engine's replay; a node scenario's engines take theirs from "
                         "its engine: settings (prefix_caching)")
    if len(a.overcommit) != 1 or not math.isfinite(a.overcommit[0]):
        raise ValueError("--node: give one finite --overcommit, the safe factor every engine falls back to")
    for given, option in ((a.metrics_port is not None, "--metrics-port"), (a.mps_next_limit is not None,
                                                                           "--mps-next-limit")):
        if given:
            raise ValueError(f"{option} belongs to one engine's live loop, not to --node")
    if a.processes:
        try:
            node = ProcessNode(a.node, seed=a.seed or 0)
        except EngineProcessError as exc:  # one that died or stopped answering, named: no traceback
            print(f"rlctl replay: error: {exc}", file=sys.stderr)
            return 1
        sc, shares = node.scenario, {t.name: t.share for t in node.scenario.tenants}
        print(f"replay: node scenario {sc.name}, seed {a.seed or 0}, every engine its own process: " + "; ".join(
            f"{n}: pid {e.pids[0]}, {CLIENT_LIMIT_ENV}={e.env_limits[0]}, {e.num_blocks} KV blocks"
            for n, e in node.engines.items()))
    else:
        env = SharedGPUEnv(a.node)
        env.reset(seed=a.seed or 0)
        sc, node, shares = env.scenario, env.node, env.shares
        print(f"replay: node scenario {sc.name}, seed {a.seed or 0}: "
              + "; ".join(f"{n}: {e.config.num_blocks} KV blocks under an MPS limit of {e.device.capacity / 1e9:.1f} "
                          f"GB, {env.workload_lines[n]}" for n, e in node.engines.items()))
    print(f"controller {a.controller} every {sc.decision_interval_s:g} s (deadline {a.deadline_ms:g} ms, safe factor "
          f"{a.overcommit[0]:g}); engines on their scenario's cost model")
    tls = ClientTLS(a.controller_ca, a.controller_cert, a.controller_key) if a.controller_ca else None
    controller = NodeLiveController(a.controller, shares, deadline_s=a.deadline_ms / 1000,
                                    safe_factor=a.overcommit[0], evict_free_share=sc.evict_free_share, tls=tls)
    try:
        figures = replay_node_live(node, controller, sc.decision_interval_s)
    except EngineProcessError as exc:
        print(f"rlctl replay: error: {exc}", file=sys.stderr)
        return 1
    finally:
        controller.close()
        if a.processes:
            node.close()
    gives_up = _gives_up(sc)
    if a.processes:
        for n, f in figures["engines"].items():
            given_up = f", {f['requests_abandoned']} {ABANDONED_ROW[0]}" if n in gives_up else ""
            print(f"{n}: {f['requests_completed']}/{f['requests_submitted']} requests completed{given_up}, goodput "
                  f"{f['goodput_tokens_per_s']:.1f} tok/s, {f['oom_events']} OOM events, {f['preemptions']} "
                  f"preemptions, {f['restarts']} restarts; processes {f['pids']} started with "
                  + ", ".join(f"{CLIENT_LIMIT_ENV}={v}" for v in f["env_limits"]))
    else:
        print(format_table(figures["engines"], extra_rows=[("restarts", "restarts", "{:d}")]
                           + ([ABANDONED_ROW] if gives_up else [])))
    print(f"controller: {figures['controller_decisions']} decisions, {figures['fallbacks']} fallbacks "
          f"{figures['fallbacks_by_reason']}, {figures['reconnects']} reconnects, {figures['shield_overrides']} shield "
          f"overrides, {figures['restarts_by_resize']} restarts by resize; node actions {figures['node_actions']}")
    if a.json:
        _write_json(a, {"scenario": sc.name, "seed": a.seed or 0, **figures})
    return 0


def cmd_replay(a: argparse.Namespace) -> int:
    if a.node is not None:
        return _node_live_run(a)
    if a.processes:
        raise ValueError("--processes runs a node's engines as processes: give --node SCENARIO")
    if a.trace is None:
        raise ValueError("--trace is required (or --node SCENARIO with --controller, a node of engines steered live)")
    if not a.controller:
        for given, option in ((a.metrics_port is not None, "--metrics-port"), (a.metrics_addr is not None,
                                                                               "--metrics-addr"),
                              (a.metrics_public, "--metrics-public"), (a.mps_next_limit is not None, "--mps-next-limit"),
                              (a.controller_ca is not None, "--controller-ca"),
                              (a.controller_cert is not None, "--controller-cert"),
                              (a.controller_key is not None, "--controller-key")):
            if given:
                raise ValueError(f"{option} belongs to the live loop: give --controller ADDR too "
                                 "(a replay at fixed factors has no sidecar, metrics endpoint or actuators)")
    runs = _live_run(a) if a.controller else _replay_runs(a, a.trace, a.overcommit)
    print(format_table(runs, extra_rows=(LIVE_ROWS if a.controller else [])
                       + ([ABANDONED_ROW] if a.client_timeout is not None else [])
                       + ([PREFIX_ROW] if a.prefix_caching else [])))
    if a.controller:
        print(format_actuators(runs["controller"]))
    if a.json:
        _write_json(a, next(iter(runs.values())) if len(runs) == 1 else runs)
    return 0


DEMO_CONFIG = "steady"  # experiments/train/steady.yaml, shipped with the package
DEMO_POLICY, DEMO_SCENARIO = "default", "long_outputs"  # experiments/policies/default.rlpolicy, shipped


def cmd_demo(a: argparse.Namespace) -> int:
    """The main job: the shipped policy against every baseline on held-out episodes of a scenario
    it was trained for; then a short training run that shows the controller learning, compared with
    every baseline on held-out trace windows; the tables, a plot and the TensorBoard logs."""
    from agents.spec import baselines, make_policy
    from env.scenario_yaml import load_scenario
    from experiments import POLICIES
    from rlctl.evaluate import run_eval
    from rlctl.plot import draw
    from rlctl.train import load_train_config, train

    cfg = load_train_config(DEMO_CONFIG, timesteps=a.timesteps, seed=a.seed)  # checked before the first table
    _check_logdir(a.logdir)
    if (POLICIES / f"{DEMO_POLICY}.rlpolicy").is_file():
        sc = load_scenario(DEMO_SCENARIO)
        policies = [make_policy(DEMO_POLICY)] + [make_policy(s) for s in baselines(sc.best_static)]
        print(f"demo: the shipped policy ({DEMO_POLICY}) against every baseline on {DEMO_SCENARIO} ({sc.description}), "
              f"held-out seeds 1000..1001, the shield on for it", flush=True)
        results = run_eval(policies[:1], sc, 2, 1000, shield=True)
        results.update(run_eval(policies[1:], sc, 2, 1000, shield=False))
        print(format_table(results, extra_rows=EVAL_ROWS), flush=True)

    print(f"demo: training the DQN on {', '.join(cfg.scenarios)} for {cfg.timesteps} steps in {cfg.n_envs} "
          f"environments (training config {DEMO_CONFIG}, which pins the count: the same table on any machine), then "
          f"evaluating it and every baseline on {cfg.eval_episodes} held-out trace windows (starts {list(cfg.eval_starts)} s)")
    out = train(cfg, a.logdir, progress_bar=not a.no_progress)
    print(format_table(out["results"], extra_rows=EVAL_ROWS))
    plot = Path(out["run"]) / "evaluation.png"
    draw(out["results"], str(plot), title=f"{cfg.scenarios[0]}: held-out episode 1 (seed {cfg.eval_seed})")
    print(f"run: {out['run']} ({out['timesteps']} steps, {out['wall_s']:.0f} s)\npolicy: {out['policy']}\n"
          f"plot: {plot}\nreview: tensorboard --logdir {a.logdir}")
    return 0


def cmd_serve(a: argparse.Namespace) -> int:
    from rlctl.online.addresses import check_pem
    from rlctl.online.confine import Confinement, policy_dir
    from rlctl.online.sidecar import Fault, TLSFiles, check_listen, serve

    if (a.tls_cert is None) != (a.tls_key is None) or (a.tls_client_ca and not a.tls_cert):
        raise ValueError("--tls-cert and --tls-key go together (and --tls-client-ca needs them)")
    metrics_addr = _check_metrics(a)
    tls = TLSFiles(a.tls_cert, a.tls_key, a.tls_client_ca) if a.tls_cert else None
    check_listen(a.listen, tls)  # where it may listen first, then whether its files can be read
    for path, option in ((a.tls_cert, "--tls-cert"), (a.tls_key, "--tls-key"), (a.tls_client_ca, "--tls-client-ca")):
        check_pem(path, option)
    fault = Fault(a.fault_delay_ms / 1000, a.fault_action) if a.fault_delay_ms or a.fault_action is not None else None
    if a.max_policy_mib is not None and not 1 <= a.max_policy_mib <= MAX_POLICY_MIB:
        raise ValueError(f"--max-policy-mib must be in 1..{MAX_POLICY_MIB}, got {a.max_policy_mib}")
    cap = {} if a.max_policy_mib is None else {"max_bytes": a.max_policy_mib << 20}  # else agents/export.py's
    confinement = Confinement(policy_dir(a.policy_dir) if a.policy_dir else None, a.allow_baselines, **cap)
    serve(a.policy, a.listen, a.metrics_port, tls, fault, say=lambda line: print(line, flush=True),
          confinement=confinement, metrics_addr=metrics_addr, metrics_public=a.metrics_public, node=a.node,
          decision_interval_s=a.decision_interval)
    return 0


def cmd_bench(a: argparse.Namespace) -> int:
    from rlctl.bench import SidecarBenchSizes, run_bench

    if a.policy is not None and a.what != "sidecar":
        raise ValueError(f"--policy applies to rlctl bench sidecar, not to bench {a.what}")
    result = run_bench(a.what, SidecarBenchSizes(policy=a.policy) if a.policy is not None else None)
    print("\n".join(f"{k}: {v}" for k, v in result.items()))
    if a.json:
        _write_json(a, result)
    return 0


def cmd_profile(a: argparse.Namespace) -> int:
    from engine.checkpoint import load_checkpoint
    from rlctl.profile import QUICK_GRID, Grid, profile, summary

    if a.repeats <= 0:
        raise ValueError(f"--repeats must be > 0, got {a.repeats}")
    out = _writable("--out", a.out)
    model = load_checkpoint(a.model_dir, device=a.device) if a.model_dir else None
    cost, report = profile(device=a.device, grid=QUICK_GRID if a.quick else Grid(), repeats=a.repeats,
                           seed=a.seed, model=model)
    print(summary(cost, report))
    try:
        cost.save(out, report=report)
    except OSError as exc:
        raise ValueError(f"--out {a.out}: cannot be written ({exc.strerror})") from None
    print(f"wrote {out}")
    return 0


def _gives_up(sc) -> set[str]:
    """The tenants of node scenario ``sc`` whose clients give up (their engine's ``client_timeout_s``)."""
    return {t.name for t in sc.tenants if sc.engine_config(t).client_timeout_s is not None}


def _node_rows(results: dict, gives_up: set[str] = frozenset()) -> list:
    """The per-tenant rows of a node's table: each tenant's goodput and SLO attainment, and restarts;
    for the tenants in ``gives_up`` (whose clients give up: ``client_timeout_s``), the requests given
    up, and the node's."""
    first = next(iter(results.values()))
    names = [k.split("/")[0] for k in first if k.endswith("/goodput_tokens_per_s")]
    rows = [("SLO attained (worst tenant)", "slo_attainment_min", "{:.1%}"), ("graceful restarts", "restarts", "{:.0f}")]
    rows += [ABANDONED_ROW] if gives_up else []
    for n in names:
        rows += [(f"{n}: goodput (tok/s)", f"{n}/goodput_tokens_per_s", "{:.1f}"),
                 (f"{n}: SLO attained", f"{n}/slo_attainment", "{:.1%}"), (f"{n}: OOM events", f"{n}/oom_events", "{:.0f}")]
        rows += [(f"{n}: {ABANDONED_ROW[0]}", f"{n}/requests_abandoned", ABANDONED_ROW[2])] if n in gives_up else []
    return rows


def _write_eval(a: argparse.Namespace, sc, results: dict) -> int:
    """``rlctl eval``'s files: the JSON document (``--json``) and the plot (``--plot``)."""
    if a.json:
        _write_json(a, {"scenario": sc.name, "results": results})
    if a.plot:
        from rlctl.plot import draw

        draw(results, a.plot, title=f"{sc.name}: {sc.description}")
        print(f"wrote {a.plot}")
    return 0


def _eval_node(a: argparse.Namespace) -> int:
    """``rlctl eval`` on a node scenario (several engines on one GPU, rlctl/SharedGPU-v0)."""
    import dataclasses

    from agents.node_spec import make_node_policy, node_baselines
    from agents.spec import label_policies
    from env.node_scenario import load_node_scenario
    from rlctl.evaluate import run_eval

    for value, option in ((a.trace, "--trace"), (a.time_scale, "--time-scale"), (a.load, "--load"),
                          (a.deployment, "--deployment"), (a.max_tokens, "--max-tokens"), (a.rate_scale, "--rate-scale"),
                          (a.client_timeout, "--client-timeout"), (a.prefix_caching or None, "--prefix-caching"),
                          (a.kv_tokens, "--kv-tokens")):
        if value is not None:
            raise ValueError(f"{option} applies to one engine's scenarios, not to node scenario {a.scenario}")
    if a.static_sweep:
        raise ValueError("--static-sweep applies to one engine's scenarios; on a node use --policy overcommit:K")
    sc = load_node_scenario(a.scenario)
    if a.steps is not None:
        if a.steps <= 0:
            raise ValueError(f"--steps must be > 0, got {a.steps}")
        sc = dataclasses.replace(sc, max_steps=a.steps)
    specs = list(dict.fromkeys(a.policy + (node_baselines(sc) if a.baselines else [])))
    if not specs:
        raise ValueError("give --policy SPEC (one or more) or --baselines")
    policies = label_policies({spec: make_node_policy(spec, sc.names) for spec in specs})  # every spec is checked first
    print(f"eval: node scenario {sc.name} ({', '.join(f'{t.name}: {t.deployment}' for t in sc.tenants)}), "
          f"{a.episodes} episode(s) of {sc.max_steps} x {sc.decision_interval_s:g} s, seeds {a.seed}..{a.seed + a.episodes - 1}")
    results = run_eval(list(policies.values()), sc, a.episodes, a.seed, a.shield, a.jobs)
    first = next(iter(results.values()))
    print(f"workload (episode 1): {first['workload']}\nclock: {first['clock']}")
    print(format_table(results, extra_rows=EVAL_ROWS + _node_rows(results, _gives_up(sc))))
    return _write_eval(a, sc, results)


def cmd_eval(a: argparse.Namespace) -> int:
    from agents.spec import baselines, canonical, is_trained, label_policies, make_policy, static_sweep
    from env.node_scenario import is_node_scenario
    from rlctl.evaluate import deployment_line, eval_scenario, run_evals, thin_windows_note

    if a.scenario is not None and is_node_scenario(a.scenario):
        return _eval_node(a)

    sc = eval_scenario(a.scenario, a.trace, a.time_scale, a.max_tokens, a.steps, a.load, a.deployment,
                       rate_scale=a.rate_scale, client_timeout=a.client_timeout, prefix_caching=a.prefix_caching,
                       kv_tokens=a.kv_tokens)
    sweep = static_sweep(sc.engine_config().overcommit_max) if a.static_sweep else []
    specs = list(dict.fromkeys(canonical(s) for s in a.policy + (baselines(sc.best_static) if a.baselines else []) + sweep))
    if not specs:
        raise ValueError("give --policy SPEC (one or more), --baselines or --static-sweep")
    policies = label_policies({spec: make_policy(spec) for spec in specs})  # every spec is checked before anything runs
    for spec, policy in policies.items():  # and the engine settings each pins, on this scenario's engine
        overrides = dict(getattr(policy, "engine_overrides", {}))
        overrides.pop("overcommit", None)  # a pinned factor is in range by definition, as the environment pins it
        try:
            sc.engine_config(**overrides)
        except ValueError as exc:
            raise ValueError(f"--policy {spec} cannot run on scenario {sc.name}: {exc}") from None
    print(f"eval: scenario {sc.name} ({sc.deployment}), {a.episodes} episode(s) of {sc.max_steps} x "
          f"{sc.decision_interval_s:g} s, seeds {a.seed}..{a.seed + a.episodes - 1}")
    print(deployment_line(sc))
    # a trained policy acts behind the shield, as it is served; a baseline only with --shield
    results = run_evals([(policy, a.shield or is_trained(str(spec))) for spec, policy in policies.items()], sc,
                        a.episodes, a.seed, a.jobs)
    first = next(iter(results.values()))
    print(f"workload (episode 1): {first['workload']}\nclock: {first['clock']}")
    cfg = sc.engine_config()
    print(format_table(results, extra_rows=EVAL_ROWS + ([ABANDONED_ROW] if cfg.client_timeout_s is not None else [])
                       + ([PREFIX_ROW] if cfg.prefix_caching else [])))
    for note in (slo_note(results, cfg.ttft_slo_s, cfg.tpot_slo_s), backlog_note(results),
                 thin_windows_note(sc, results, a.seed)):
        if note:
            print(note)
    if a.static_sweep:
        best = max((results[policies[s].name] for s in sweep), key=lambda r: r["goodput_tokens_per_s"])
        print(f"best fixed factor: {best['policy']} (goodput {best['goodput_tokens_per_s']:.1f} tok/s, "
              f"{best['oom_events']:g} OOM events) on seeds {a.seed}..{a.seed + a.episodes - 1}")
    return _write_eval(a, sc, results)


def cmd_explain(a: argparse.Namespace) -> int:
    import dataclasses

    from agents.export import POLICY_SUFFIX
    from agents.spec import is_trained, make_policy
    from env.scenario_yaml import load_scenario
    from rlctl.explain import action_index, explain, format_explain

    if not is_trained(a.policy):
        raise ValueError(f"--policy {a.policy}: explain reads a trained policy's decisions from its observations; "
                         "a baseline or a reference (oracle, lookahead) does not decide from them")
    if a.policy.startswith("unpark:"):
        raise ValueError(f"--policy {a.policy}: explain replays each observation alone, and a fallback decides from the "
                         "decisions before it (and the engine's queue); explain the policy it wraps")
    if a.top <= 0:
        raise ValueError(f"--top must be > 0, got {a.top}")
    if a.steps is not None and a.steps <= 0:
        raise ValueError(f"--steps must be > 0, got {a.steps}")
    action = action_index(a.action) if a.action is not None else None
    policy = make_policy(a.policy)
    if policy.name == "policy":  # a training run's policy.rlpolicy: named by its path (label_policies' label)
        policy.name = a.policy.removesuffix(POLICY_SUFFIX)
    scenarios = [load_scenario(name) for name in (a.scenario, a.reference)]
    if a.steps is not None:
        scenarios = [dataclasses.replace(sc, max_steps=a.steps) for sc in scenarios]
    out = explain(policy, *scenarios, a.seed, action)
    print(format_explain(out, a.top))
    if a.json:
        _write_json(a, out)
    return 0


def cmd_sweep(a: argparse.Namespace) -> int:
    from env.scenario_yaml import load_scenario
    from rlctl.sweep import format_sweep, sweep

    if a.episodes <= 0:
        raise ValueError(f"--episodes must be > 0, got {a.episodes}")
    out = sweep(load_scenario(a.scenario), a.episodes, a.seed, oracle=not a.no_oracle, jobs=a.jobs)
    print(format_sweep(out))
    if a.json:
        _write_json(a, out)
    return 0


def cmd_results(a: argparse.Namespace) -> int:
    from env.scenario_yaml import load_scenario
    from rlctl.evaluate import with_client_timeout
    from rlctl.results import format_results, results

    if a.episodes <= 0:
        raise ValueError(f"--episodes must be > 0, got {a.episodes}")
    from agents.spec import is_trained, make_policy

    for spec in a.policy:  # every policy file is checked before anything runs
        if not is_trained(spec):
            raise ValueError(f"--policy {spec}: rlctl results sets trained policies (files or shipped names) "
                             f"against every incumbent and the oracle, which it runs itself; for {spec} alone, "
                             f"rlctl eval --policy {spec}")
        make_policy(spec)
    scenarios = [load_scenario(name) for name in a.scenario]
    if a.client_timeout is not None:
        scenarios = [with_client_timeout(sc, a.client_timeout) for sc in scenarios]
    out = []
    for sc in scenarios:
        r = results(sc, a.policy, a.episodes, a.seed, oracle=not a.no_oracle, jobs=a.jobs)
        print(format_results(r), flush=True)
        print()
        out.append(r)
    if a.json:
        _write_json(a, out)
    return 0


def cmd_compare(a: argparse.Namespace) -> int:
    from rlctl.compare import compare, format_compare, load_cases, verdict

    if a.bar is not None and not (a.bar > 0 and math.isfinite(a.bar)):
        raise ValueError(f"--bar must be a ratio > 0, got {a.bar}")
    cases = load_cases(a.cases)
    out = compare(a.candidate, a.reference, cases, a.jobs, say=lambda line: print(line, flush=True))
    print()
    print(format_compare(out, a.bar))
    if a.bar is not None:
        out["bar"], out["met"] = a.bar, verdict(out, a.bar)
    if a.json:
        _write_json(a, out)
    return 0


def _check_logdir(logdir: str) -> None:
    if Path(logdir).exists() and not Path(logdir).is_dir():
        raise ValueError(f"--logdir {logdir}: a file, not a folder; runs are written into a folder")


def cmd_train(a: argparse.Namespace) -> int:
    from rlctl.train import is_node_config, load_train_config, train

    seeds = a.seeds or [a.seed]
    configs = [(path, load_train_config(path, timesteps=a.timesteps, seed=s, n_envs=a.n_envs, init_policy=a.init_policy))
               for path in a.config for s in seeds]  # every config is checked before anything runs
    if a.resume is not None:
        from rlctl.train import check_checkpoint

        if len(configs) > 1:
            raise ValueError("--resume continues one run: give one --config and no --seeds with it")
        check_checkpoint(a.resume)
        if a.init_policy is not None:  # a configuration's own init_policy is what its checkpoint descends from
            raise ValueError(f"--resume {a.resume} continues a checkpoint's network; --init-policy starts a new run "
                             "from a policy file's: give one or the other")
    _check_logdir(a.logdir)
    runs = []
    for path, cfg in configs:
        node = is_node_config(cfg)
        where = f"node scenario {cfg.scenarios[0]}" if node else f"scenarios {', '.join(cfg.scenarios)} x loads {list(cfg.loads)}"
        if cfg.weights:
            where += f", weights {list(cfg.weights)}"
        print(f"train: {path}: {where}, {cfg.timesteps} steps, seed {cfg.seed}, "
              f"double={cfg.double} dueling={cfg.dueling} prioritized={cfg.prioritized} n_steps={cfg.n_steps}")
        out = train(cfg, a.logdir, a.resume, progress_bar=not a.no_progress,
                    baseline_specs=None if not runs else [])
        runs.append((path, cfg, out))
        print(f"held-out evaluation ({cfg.eval_episodes} episodes, seeds {cfg.eval_seed}..):")
        print(format_table(out["results"], extra_rows=EVAL_ROWS + (_node_rows(out["results"]) if node else [])))
        print(f"run: {out['run']} ({out['timesteps']} steps, {out['wall_s']:.0f} s, {out['n_envs']} envs)\n"
              f"policy: {out['policy']}\nreview: tensorboard --logdir {Path(out['run']).parent}")
    if len(runs) > 1:
        table, data = compare(runs)
        print(table)
        with open(f"{a.logdir}/comparison.json", "w") as f:
            json.dump(data, f, indent=2, default=str)
    return 0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rlctl", description=__doc__)
    p.add_argument("--version", action="version", version=f"rlctl {__version__}")
    sub = p.add_subparsers(dest="command", required=True)

    r = sub.add_parser("replay", help="replay a trace through the engine at a fixed overcommit factor")
    _add_workload(r, trace_required=False)
    _add_deployment(r)
    r.add_argument("--overcommit", type=_factor, nargs="+", default=[1.0],
                   help="overcommit factor(s), one column each (default %(default)s; inf: no reservation)")
    r.add_argument("--oom", choices=["crash", "preempt"], default="crash", help="OOM semantics (default %(default)s)")
    _json_option(r, "the figures")
    c = r.add_argument_group("controller (a sidecar steering the engine: rlctl serve)")
    c.add_argument("--controller", default=None, metavar="ADDR",
                   help="the sidecar's address, unix:///path or HOST:PORT; --overcommit is then the safe factor (a "
                        "fallback's, where it is lower than the factor in force)")
    c.add_argument("--decision-interval", type=_positive, default=2.0, help="engine seconds between decisions (default %(default)s)")
    c.add_argument("--deadline-ms", type=_positive, default=200.0,
                   help="wall-clock deadline of a decision; later, the safe factor (or the lower one in force) holds "
                        "(default %(default)s)")
    c.add_argument("--controller-ca", default=None, help="TLS: the CA (PEM) that signed the sidecar's certificate")
    c.add_argument("--controller-cert", default=None, help="mutual TLS: this client's certificate (PEM)")
    c.add_argument("--controller-key", default=None, help="mutual TLS: this client's key (PEM)")
    _add_metrics(c, "the engine's metrics (vLLM's names, rlctl_ ones; with --controller), updated every decision "
                    "interval while the replay runs,")
    c.add_argument("--mps-next-limit", nargs="?", const="0", default=None, metavar="DEVICE",
                   help="set the NVIDIA MPS control daemon's default pinned-memory limit on DEVICE (ordinal or UUID, "
                        "default 0) to what this engine needs. The default is daemon-wide: every MPS server started "
                        "on this host afterwards takes it, not only the next engine's; a process joining its user's "
                        "running server takes that server's limit instead, and a running one keeps its limit. The "
                        "previous default is restored as the daemon shows it (in whole GiB from 1 GiB) when the replay "
                        "ends, on an error, SIGTERM or SIGHUP too, not after a SIGKILL; where no default is set, or it "
                        "cannot be read, nothing is changed, as it could not be put back. Refused for an engine holding its KV on the "
                        "CPU (--device cuda; with --controller)")
    c.add_argument("--node", default=None, metavar="SCENARIO",
                   help="run a node scenario's engines (several on one GPU, its own workloads; --seed picks the draw) "
                        "steered live by the node sidecar at --controller (rlctl serve --node)")
    c.add_argument("--processes", action="store_true",
                   help="with --node: every engine in its own process, an MPS client started with its limit in its "
                        "own CUDA_MPS_PINNED_DEVICE_MEM_LIMIT and restarted under a new one (nothing lost)")
    r.set_defaults(fn=cmd_replay)

    sv = sub.add_parser("serve", help="host a policy for a live engine: the gRPC sidecar, health, reflection, metrics")
    sv.add_argument("--policy", required=True,
                    help="the path of a policy file (*.rlpolicy) or a shipped policy's name (default), "
                         "unpark:F:[ontime:]PATH (that policy with the fallback against the parking, agents/unpark.py), "
                         "or with --allow-baselines a baseline spec (static:K, watermark, vllm, random)")
    sv.add_argument("--policy-dir", default=None, metavar="DIR",
                    help="ReloadPolicy takes a policy name, a file name in DIR (steady or steady.rlpolicy), and "
                         "nothing outside DIR; without it ReloadPolicy is off")
    sv.add_argument("--allow-baselines", action="store_true",
                    help="let --policy and ReloadPolicy serve baseline specs (static:K, watermark, vllm, random)")
    sv.add_argument("--node", action="store_true",
                    help="serve a node policy (several engines on one GPU; a policy file trained on a node scenario, "
                         "or with --allow-baselines watermark or random) to a node's DecideNode calls")
    sv.add_argument("--max-policy-mib", type=int, default=None, metavar="MIB",
                    help="refuse a policy file bigger than this, unread (default 64)")
    sv.add_argument("--decision-interval", type=float, default=2.0, metavar="S",
                    help="engine seconds between the engine's decisions (rlctl replay's --decision-interval): the "
                         "shield's admission headroom holds what the running batch grows into over it "
                         "(default %(default)s)")
    sv.add_argument("--listen", required=True,
                    help="unix:///path or 127.0.0.1:PORT (other addresses only with mutual TLS)")
    _add_metrics(sv, "the sidecar's metrics")
    sv.add_argument("--tls-cert", default=None, help="the server's certificate chain (PEM)")
    sv.add_argument("--tls-key", default=None, help="the server's private key (PEM)")
    sv.add_argument("--tls-client-ca", default=None, help="require client certificates signed by this CA (mutual TLS)")
    # fault injection, for the live loop's tests only: hidden from --help
    sv.add_argument("--fault-delay-ms", type=float, default=0.0, help=argparse.SUPPRESS)
    sv.add_argument("--fault-action", type=int, default=None, help=argparse.SUPPRESS)
    sv.set_defaults(fn=cmd_serve)

    d = sub.add_parser("demo", help="the shipped policy against every baseline; then train briefly and compare")
    d.add_argument("--timesteps", type=_count, default=None, help=f"training steps (default: training config {DEMO_CONFIG}'s)")
    d.add_argument("--seed", type=_seed, default=None)
    d.add_argument("--logdir", default="runs", help="TensorBoard and run directory root (default %(default)s)")
    d.add_argument("--no-progress", action="store_true", help="no progress bar")
    d.set_defaults(fn=cmd_demo)

    e = sub.add_parser("eval", help="run policies on a scenario's episodes and compare them")
    e.add_argument("--policy", action="append", default=[], help="static:K, watermark, vllm, sglang, random, oracle, lookahead (lookahead:N: N draws of the lengths, 2 by default; lookahead:N:warm: its estimate also knows an earlier episode's output lengths), a policy file or shipped name, or unpark:F:POLICY (that policy with a fallback to factor F while it parks at its floor; unpark:F:ontime:POLICY: only while no request waits past its TTFT target; agents/unpark.py) (repeatable)")
    e.add_argument("--baselines", action="store_true", help="add every baseline to the table")
    e.add_argument("--static-sweep", action="store_true",
                   help="add static:K for a grid of K from 1 to the scenario's overcommit_max and name the best "
                        "(tune a scenario's best_static on training seeds; rlctl sweep does more)")
    e.add_argument("--scenario", default=None,
                   help="scenario YAML or bundled name (default steady; with --trace the bundled 'trace' scenario's "
                        "deployment and settings)")
    e.add_argument("--trace", default=None, help="replay this trace on the scenario's deployment instead")
    e.add_argument("--time-scale", type=_positive, default=None, help="with --trace: arrival compression")
    e.add_argument("--load", type=float, default=None,
                   help="with --trace: replay it at this multiple of what the deployment sustains (the time scale is "
                        "computed from the trace's demand and the deployment's cost model, and printed)")
    e.add_argument("--deployment", default=None,
                   help="with --trace: the deployment to replay it on: a name in engine/roofline.py or CHECKPOINT_DIR@GPU[:LEN] (a local checkpoint's config.json on h100, h200, a10 or l40s, serving a context of LEN tokens as vLLM's --max-model-len; default: the scenario's)")
    e.add_argument("--max-tokens", default=None, help="with --trace: declared max_tokens rule")
    e.add_argument("--rate-scale", type=float, default=None,
                   help="with a scenario's own workload: its arrivals this many times as frequent (as a training "
                        "configuration's loads; a scenario that replays a trace replays it that much faster, a longer "
                        "slice in the same episode), e.g. 0.6 to read a scenario below its bundled load; --baselines' "
                        "static:K stays the scenario's best_static, tuned at its own rate")
    e.add_argument("--client-timeout", type=float, default=None, metavar="SECONDS",
                   help="clients give up a request still without its first token this many seconds after it arrived, "
                        "and the engine drops it, as vLLM aborts the request of a client that disconnected (default: "
                        "the scenario's client_timeout_s; none: they wait for ever); the table counts them")
    e.add_argument("--prefix-caching", action="store_true",
                   help="the engine keeps a prefix cache, as vLLM's (on by default there) and SGLang's radix cache: a "
                        "request takes the KV blocks of its first tokens another computed (a trace's hash_ids) "
                        "(default: as the scenario sets prefix_caching, off in every bundled one)")
    e.add_argument("--kv-tokens", type=int, default=None, metavar="N",
                   help="size the engine's KV to N tokens, as your engine reports its own (vLLM: 'GPU KV cache size: "
                        "N tokens'; SGLang: 'KV Cache is allocated. #tokens: N'), the GPU holding what it needs beside "
                        "the weights (default: the deployment's, sized as vLLM sizes it, conservatively)")
    e.add_argument("--episodes", type=_count, default=1)
    e.add_argument("--steps", type=int, default=None, help="decisions per episode (default: the scenario's)")
    e.add_argument("--seed", type=_seed, default=0, help="episode k uses seed + k, the same for every policy")
    e.add_argument("--shield", action="store_true",
                   help="filter the baselines' actions through the safety shield too (a trained policy's always are)")
    _json_option(e, "every figure and time series")
    e.add_argument("--plot", default=None, help="draw utilisation, factor, queue and OOMs over time to this PNG")
    _jobs_option(e)
    e.set_defaults(fn=cmd_eval)

    x = sub.add_parser("explain", help="which observation features a trained policy's decisions on a scenario turn "
                                       "on, against a reference scenario")
    x.add_argument("--policy", required=True, help="a policy file or shipped name (default, default_seed1, ...)")
    x.add_argument("--scenario", required=True, help="the scenario whose decisions to explain (YAML or bundled name)")
    x.add_argument("--reference", required=True,
                   help="the scenario whose feature means stand in, one feature at a time (e.g. one it trained on)")
    x.add_argument("--action", default=None, help="explain only the decisions that took this action (hold, scale_up, "
                                                  "back_off, defrag, evict; default: every decision)")
    x.add_argument("--seed", type=_seed, default=0, help="the episode's seed, the same for both scenarios")
    x.add_argument("--steps", type=int, default=None, help="decisions per episode (default: each scenario's)")
    x.add_argument("--top", type=int, default=10, help="features to print, most decisions changed first (default %(default)s)")
    _json_option(x, "every feature's figures")
    x.set_defaults(fn=cmd_explain)

    w = sub.add_parser("sweep", help="every fixed factor, the rules, the peers and the oracle on a scenario: does it "
                                     "need a controller")
    w.add_argument("--scenario", required=True, help="scenario YAML or bundled name")
    w.add_argument("--episodes", type=_count, default=3)
    w.add_argument("--seed", type=_seed, default=100, help="episode k uses seed + k (default: the training seeds 100..)")
    w.add_argument("--no-oracle", action="store_true", help="leave the (slow) oracle out")
    _json_option(w, "every figure and the verdict")
    _jobs_option(w)
    w.set_defaults(fn=cmd_sweep)

    rs = sub.add_parser("results", help="trained policies against every incumbent and the oracle, per scenario, "
                                         "with the share of headroom they capture")
    rs.add_argument("--policy", nargs="+", required=True, help="policy files (one per training seed)")
    rs.add_argument("--scenario", nargs="+", required=True, help="scenarios (YAML or bundled names)")
    rs.add_argument("--episodes", type=_count, default=3)
    rs.add_argument("--seed", type=_seed, default=1000, help="episode k uses seed + k (default: held-out seeds 1000..)")
    rs.add_argument("--no-oracle", action="store_true", help="leave the (slow) oracle out")
    rs.add_argument("--client-timeout", type=float, default=None, metavar="SECONDS",
                    help="clients give up a request still without its first token this long after its arrival "
                         "(as rlctl eval --client-timeout; none: they wait for ever); the table counts them")
    _json_option(rs, "every figure")
    _jobs_option(rs)
    rs.set_defaults(fn=cmd_results)

    c = sub.add_parser("compare", help="candidate policies against reference policies on a committed set of cases: "
                                       "the geometric mean of their goodput ratios and the OOMs on each side")
    c.add_argument("--candidate", nargs="+", required=True, help="policy files or shipped names (one per training seed)")
    c.add_argument("--reference", nargs="+", required=True,
                   help="as many policies, paired with the candidates in order (e.g. default default_seed1 default_seed2)")
    c.add_argument("--cases", required=True,
                   help=f"a set of cases: a YAML file or a bundled name (experiments/cases/: {', '.join(bundled(CASES, '.yaml'))})")
    c.add_argument("--bar", type=float, default=None,
                   help="say whether the geometric mean is at least this with no more OOMs (met / not met)")
    _json_option(c, "every figure")
    _jobs_option(c)
    c.set_defaults(fn=cmd_compare)

    t = sub.add_parser("train", help="train the DQN on a scenario; TensorBoard logs, checkpoints, exported policy")
    t.add_argument("--config", required=True, nargs="+", help="training YAML(s), or shipped names (steady: experiments/train/steady.yaml)")
    t.add_argument("--timesteps", type=_count, default=None, help="override the config's timesteps")
    t.add_argument("--seed", type=_seed, default=None, help="override the config's seed")
    t.add_argument("--seeds", type=_seed, nargs="+", default=None,
                   help="train every config once per seed and print the spread over seeds")
    t.add_argument("--n-envs", type=_whole, default=None, help="environments in parallel (default: the config's n_envs; 0, or a config without one: one per core)")
    t.add_argument("--logdir", default="runs", help="TensorBoard and run directory root (default %(default)s)")
    t.add_argument("--resume", default=None, help="a checkpoint (.zip) of an earlier run to continue")
    t.add_argument("--init-policy", default=None,
                   help="start from this policy file's network (or a shipped one's, e.g. default): fine-tune it")
    t.add_argument("--no-progress", action="store_true", help="no progress bar")
    t.set_defaults(fn=cmd_train)

    b = sub.add_parser("bench", help="benchmarks: engine (ratios against references run alongside), env (steps/s), sidecar (latency)")
    b.add_argument("what", choices=["engine", "env", "sidecar"],
                   help="engine: decode and compaction against references; env: environment steps/s, 1 and all cores; "
                        "sidecar: Decide latency and decisions/s over a unix socket and loopback against an in-process call")
    b.add_argument("--policy", default=None, metavar="SPEC",
                   help="sidecar: the policy to serve, as rlctl serve --policy takes it (a policy file's path, "
                        "unpark:F:[ontime:]PATH, or a baseline spec); default an untrained network of the training shape")
    _json_option(b, "the report")
    b.set_defaults(fn=cmd_bench)

    pr = sub.add_parser("profile", help="fit a cost model to the torch executor on this machine")
    pr.add_argument("--out", required=True, help="write the cost model and its fit report to this JSON file")
    pr.add_argument("--device", type=_device, default="cpu", help="cpu or cuda[:N] (default %(default)s)")
    pr.add_argument("--repeats", type=int, default=7, help="timed runs per point, the median counts (default %(default)s)")
    pr.add_argument("--quick", action="store_true", help="a smaller grid (seconds, not tens of seconds)")
    pr.add_argument("--model-dir", default=None, help='local Hugging Face checkpoint of a family the engine runs (README, "Replaying a trace") (default: tiny seeded model)')
    pr.add_argument("--seed", type=_seed, default=0)
    pr.set_defaults(fn=cmd_profile)
    return p


def main(argv: list[str] | None = None) -> int:
    a = parser().parse_args(argv)
    # --json -: standard output carries the JSON document alone, so that it pipes; the rest goes to stderr
    a.stdout = sys.stdout
    quiet = getattr(a, "json", None) == "-"
    try:
        if getattr(a, "json", None) not in (None, "-"):
            _writable("--json", a.json)
        if getattr(a, "plot", None):
            _writable("--plot", a.plot)
        with contextlib.redirect_stdout(sys.stderr) if quiet else contextlib.nullcontext():
            return a.fn(a)
    except (TraceError, ValueError, FileNotFoundError) as exc:
        print(f"rlctl {a.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
