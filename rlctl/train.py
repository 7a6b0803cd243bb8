"""``rlctl train``: the DQN trained offline on a scenario, reviewed in TensorBoard, exported.

A training configuration (``experiments/train/*.yaml``, or a shipped one by name) names the training scenario, the held-out
episodes it is judged on, the agent's switches (double, dueling, prioritized, n_steps) and its
hyperparameters. A run writes under ``<logdir>/<name>/``: TensorBoard events, checkpoints (with
the replay buffer, so ``--resume`` continues where it stopped), the evaluation table against the
baselines, and ``policy.rlpolicy``, the pickle-free exported policy that ``rlctl eval`` and
``rlctl serve`` load.

With ``select_seed``, the run keeps the network of the evaluation point (every ``eval_every``
steps, and the end) whose greedy policy earns the most reward, averaged over the evaluation
scenarios, on validation episodes from that seed: seeds neither training draws nor the held-out
evaluation uses, so the held-out figures stay a test. Without it the run keeps its last network.
A resumed run chooses among the points it reaches after resuming.

With ``members: N`` (N > 1), a run trains an ensemble: N networks of the same configuration on
training seeds ``seed * N + k``, all at once (one process each, under ``<run>/members/``), and
writes one policy file of all of them (agents/export.py ``export_ensemble``), which acts on the
mean of their Q-values; a network that learned a bad habit on its seed is then outvoted. Each
member's run is the run ``rlctl train`` gives that seed alone, bit for bit.

With ``init_policy`` (a policy file, or the name of a shipped one), training starts from that
file's network instead of a random one: the online and the target network both, with an empty
replay buffer and the configuration's own exploration schedule. That is fine-tuning: the shipped
default on one's own deployment or trace. The file must hold one network of the configuration's
shape (``net_arch``, ``dueling``) over this build's features and actions, read at the training
scenarios' observation scales; anything else is refused before a step runs, naming what differs.

With ``blind`` (feature names, env/observation.py), the network never reads those features: the
training observation leaves them out and the policy file is written blind to them, as a file
trained before they existed is (agents/export.py), so it computes the same whatever they say. That
trains the recipe of a file that predates a feature on this build, with this build's engine.

A configuration whose one scenario is a node scenario (several engines on one GPU) trains on
``rlctl/SharedGPU-v0`` and is judged against the node's baselines (agents/node_spec.py); its
policy file records the node's engines, and is refused on any other node or on one engine.
"""
from __future__ import annotations

import copy
import dataclasses
import json
import math
import os
import re
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

import gymnasium as gym
import numpy as np
from stable_baselines3.common.callbacks import BaseCallback, CallbackList, CheckpointCallback
from stable_baselines3.common.logger import configure
from stable_baselines3.common.vec_env import DummyVecEnv, SubprocVecEnv

from agents.policy import Policy
from agents.spec import baselines, make_policy
from agents.dqn import OvercommitDQN
from agents.node_spec import make_node_policy, node_baselines
from agents.shield import TRAINING
from env.mixture import MixtureEnv
from env.observation import FEATURES, HIGH, LOW, seen
from env.node_scenario import is_node_scenario, load_node_scenario
from env.scenario import Backlog, Reward, Scenario, ScenarioError, TraceWorkload
from env.scenario_yaml import from_mapping, load_scenario, read_yaml
from experiments import TRAIN, bundled, find
from rlctl.evaluate import evaluate, make_env, with_client_timeout


MAX_RUN_SEED = 2 ** 31 - 1


@dataclass(frozen=True)
class TrainConfig:
    scenarios: tuple[str, ...]                       # trained on all of them, each episode one drawn at random
    name: str = ""
    loads: tuple[float, ...] = (1.0,)                # ... at each of these loads (arrival rate multipliers)
    weights: tuple[float, ...] | None = None         # each scenario's share of the episodes, relative (default: equal)
    eval_starts: tuple[float, float] | None = None  # held-out trace windows (trace scenarios)
    eval_episodes: int = 3
    eval_seed: int = 1000                            # held-out seeds: never used in training
    eval_every: int = 10_000
    select_seed: int | None = None                   # keep the best point on validation seeds from here (above)
    timesteps: int = 60_000
    n_envs: int = 0                                  # 0: one per CPU core
    seed: int = 0
    members: int = 1                                 # > 1: an ensemble of this many networks (above)
    double: bool = True
    dueling: bool = True
    prioritized: bool = True
    n_steps: int = 3
    shield: bool = True
    shaping: bool = False                            # potential-based shaping with the work under way (env/overcommit_env.py)
    backlog: Backlog | None = None                   # a share of training episodes start behind (env/scenario.py)
    reward: Reward | None = None                     # the reward every training scenario trains on in place of its own
    client_timeout_ttft: float | None = None         # each scenario also with clients giving up at this many times
                                                     # its TTFT target (a twin at every load, as many episodes)
    init_policy: str | None = None                   # a policy file (or shipped name) whose network training starts from
    blind: tuple[str, ...] = ()                      # features the network never reads (above)
    net_arch: tuple[int, ...] = (128, 128)
    learning_rate: float = 5e-4
    buffer_size: int = 50_000
    batch_size: int = 64
    gamma: float = 0.99
    train_freq: int = 4
    gradient_steps: int = 1
    learning_starts: int = 1_000
    target_update_interval: int = 1_000
    exploration_fraction: float = 0.3
    exploration_final_eps: float = 0.05
    per_alpha: float = 0.6
    per_beta0: float = 0.4
    checkpoint_every: int = 10_000

    def __post_init__(self) -> None:
        positive = ("members", "eval_episodes", "eval_every", "timesteps", "n_steps", "buffer_size", "batch_size",
                    "train_freq", "gradient_steps", "target_update_interval", "checkpoint_every", "learning_rate")
        for name in positive:
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        for name in ("n_envs", "seed", "eval_seed", "learning_starts", "per_alpha"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        # numpy's seeds end at 2**32 - 1, and a run counts up from its seeds (environments, episodes): an
        # ensemble's members train on seeds members x seed .. members x seed + members - 1
        for name, last in (("seed", self.members * self.seed + self.members - 1), ("eval_seed", self.eval_seed),
                           ("select_seed", self.select_seed or 0)):
            if last > MAX_RUN_SEED:
                raise ValueError(f"{name} must be at most {MAX_RUN_SEED} (2**31 - 1)"
                                 + (f" counting the {self.members} members' seeds" if last != getattr(self, name) else "")
                                 + f", got {getattr(self, name)}")
        if "/" in self.name or "\\" in self.name or self.name in (".", ".."):
            raise ValueError(f"name must be a plain folder name (the run's under --logdir), got {self.name!r}")
        for name in ("gamma", "exploration_fraction", "exploration_final_eps", "per_beta0"):
            if not 0 <= getattr(self, name) <= 1:
                raise ValueError(f"{name} must be in [0, 1], got {getattr(self, name)}")
        unknown = [f for f in self.blind if f not in FEATURES]
        if unknown or len(set(self.blind)) != len(self.blind) or len(self.blind) >= len(FEATURES):
            raise ValueError(f"blind must name distinct features of this build, not all of them; got {list(self.blind)} "
                             f"(unknown: {unknown}; the features: {', '.join(FEATURES)})")
        if self.client_timeout_ttft is not None and not (math.isfinite(self.client_timeout_ttft)
                                                         and self.client_timeout_ttft > 0):
            raise ValueError(f"client_timeout_ttft must be a finite multiple > 0 of each scenario's TTFT target, got "
                             f"{self.client_timeout_ttft}")
        if self.weights is not None and (len(self.weights) != len(self.scenarios) or min(self.weights) <= 0):
            raise ValueError(f"weights must be one share > 0 for each of the {len(self.scenarios)} scenarios, in "
                             f"their order; got {list(self.weights)}")
        if any(int(w) != w or w <= 0 for w in self.net_arch):
            raise ValueError(f"net_arch must be positive layer widths, got {list(self.net_arch)}")
        if self.select_seed is not None:
            if self.select_seed < 0:
                raise ValueError(f"select_seed must be >= 0, got {self.select_seed}")
            held = range(self.eval_seed, self.eval_seed + self.eval_episodes)
            if any(k in held for k in range(self.select_seed, self.select_seed + self.eval_episodes)):
                raise ValueError(f"select_seed: validation seeds {self.select_seed}.. overlap the held-out seeds "
                                 f"{self.eval_seed}..{self.eval_seed + self.eval_episodes - 1}")
            if self.eval_starts is not None:
                raise ValueError("select_seed: with eval_starts the held-out trace windows are the only episodes "
                                 "training does not see; validating on them would select on the test")

    def agent_kwargs(self) -> dict:
        keys = ("double", "dueling", "prioritized", "n_steps", "learning_rate", "buffer_size", "batch_size", "gamma",
                "train_freq", "gradient_steps", "learning_starts", "target_update_interval", "exploration_fraction",
                "exploration_final_eps", "per_alpha", "per_beta0")
        return {k: getattr(self, k) for k in keys} | {"net_arch": tuple(int(w) for w in self.net_arch)}


def load_train_config(path: str | Path, **overrides) -> TrainConfig:
    """Read a training YAML, or a shipped one by name (``steady``: experiments/train/steady.yaml);
    unknown keys and bad values fail naming the field."""
    p = find(path, TRAIN, ".yaml")
    data = read_yaml(p, f"training config {path}: no such file (bundled: {', '.join(bundled(TRAIN, '.yaml'))})")
    if isinstance(data, dict):
        data = {"name": p.stem, **data, **{k: v for k, v in overrides.items() if v is not None}}
    try:
        cfg = from_mapping(TrainConfig, data, str(p))
    except ValueError as exc:
        raise ScenarioError(str(exc) if str(exc).startswith(str(p)) else f"{p}: {exc}") from None
    try:  # a bad scenario or load fails now, not after the first checkpoint
        scenarios = training_scenarios(cfg)
        if not is_node_config(cfg):
            MixtureEnv(scenarios)
        elif cfg.shaping:
            raise ScenarioError("shaping: a node policy trains on the plain reward (rlctl/SharedGPU-v0 has no shaping)")
        elif cfg.reward is not None:
            raise ScenarioError("reward: a node policy trains on its node scenario's reward")
        elif cfg.backlog is not None:
            raise ScenarioError("backlog: a node policy's episodes start as its node scenario starts them")
        held_out(cfg)
        if cfg.blind and is_node_config(cfg):
            raise ScenarioError("blind: a node policy reads env/node_observation.py's features, all of them")
        if cfg.blind and cfg.init_policy is not None:
            raise ScenarioError("blind: fine-tuning (init_policy) starts from a network of this build's whole layout")
        if cfg.init_policy is not None:
            initial_network(cfg, scenarios[0])
    except ValueError as exc:
        raise ScenarioError(f"{p}: {exc}") from None
    return cfg


def initial_network(cfg: TrainConfig, scenario: Scenario):
    """The network of ``cfg.init_policy`` that training starts from (module docstring), checked
    against ``cfg`` and its training ``scenario`` (the mixture's share their observation scales,
    env/mixture.py); a ``ValueError`` names the file and what does not fit."""
    from agents.export import ExportedPolicy
    from agents.spec import make_policy

    where = f"init_policy {cfg.init_policy}"
    node = is_node_config(cfg)
    if node or cfg.members > 1:
        raise ValueError(f"{where}: fine-tuning starts one engine's network; this configuration trains "
                         + ("a node's policy" if node else f"an ensemble of {cfg.members}"))
    try:
        policy = make_policy(cfg.init_policy)
    except ValueError as exc:  # a missing or bad file, a node policy: the loader's own message
        raise ValueError(f"{where}: {exc}") from None
    if not isinstance(policy, ExportedPolicy):
        raise ValueError(f"{where}: not a trained policy (a policy file or a shipped name)")
    if len(policy.networks) != 1:
        raise ValueError(f"{where}: an ensemble of {len(policy.networks)} networks; fine-tuning starts from one")
    net = policy.header["network"]
    theirs, ours = (list(net["net_arch"]), bool(net["dueling"])), (list(cfg.net_arch), cfg.dueling)
    if theirs != ours:
        raise ValueError(f"{where}: its network is net_arch {theirs[0]}, dueling {theirs[1]}; this configuration's "
                         f"is net_arch {ours[0]}, dueling {ours[1]}")
    policy.check_scenario(scenario)
    if policy.inputs is not None:  # trained before some of this build's features: it starts blind to them
        from agents.export import blind_network
        return blind_network(policy.networks[0], policy.inputs, policy.obs_dim)
    return policy.networks[0]


def is_node_config(cfg: TrainConfig) -> bool:
    """Whether ``cfg`` trains a node's policy (its one scenario has several engines on one GPU)."""
    node = [is_node_scenario(name) for name in cfg.scenarios]
    if any(node) and (len(node) > 1 or cfg.loads != (1.0,) or cfg.eval_starts is not None):
        raise ScenarioError("scenarios: a node policy trains on one node scenario, at its own load, on held-out "
                            f"seeds (no loads, no eval_starts); got {list(cfg.scenarios)}")
    return any(node)


def training_scenarios(cfg: TrainConfig) -> list[Scenario]:
    """Every training scenario at every load."""
    if is_node_config(cfg):
        return [load_node_scenario(cfg.scenarios[0])]
    out = []
    for name in cfg.scenarios:
        sc = load_scenario(name)
        if cfg.reward is not None:
            sc = dataclasses.replace(sc, reward=cfg.reward)
        for variant in [sc] + ([_giving_up(sc, cfg.client_timeout_ttft)] if cfg.client_timeout_ttft else []):
            out += [variant if load == 1.0 else variant.at_load(load) for load in cfg.loads]
    return out


def _giving_up(sc: Scenario, times_ttft: float) -> Scenario:
    """``sc``'s twin with clients that give up at ``times_ttft`` its TTFT target (``client_timeout_ttft``)."""
    ttft = sc.engine_config().ttft_slo_s
    if ttft is None:
        raise ScenarioError(f"client_timeout_ttft: scenario {sc.name} has no TTFT target (ttft_slo_s) to give up at a "
                            "multiple of")
    twin = with_client_timeout(sc, times_ttft * ttft)
    return dataclasses.replace(twin, name=f"{sc.name}+gives_up_{times_ttft:g}x")


def episode_weights(cfg: TrainConfig) -> list[float] | None:
    """Each of ``training_scenarios``' shares of the episodes: a scenario's weight at each of its
    loads, and for its twin whose clients give up (None: all alike)."""
    twins = 2 if cfg.client_timeout_ttft else 1
    return None if cfg.weights is None else [w for w in cfg.weights for _ in range(twins) for _ in cfg.loads]


def held_out(cfg: TrainConfig) -> list[Scenario]:
    """The evaluation scenarios: the training ones at their own load, with the held-out trace windows."""
    if is_node_config(cfg):
        return [load_node_scenario(cfg.scenarios[0])]
    out = []
    for name in cfg.scenarios:
        sc = load_scenario(name)
        if cfg.eval_starts is not None:
            if not isinstance(sc.workload, TraceWorkload):
                raise ScenarioError(f"eval_starts: scenario {name} is not a trace replay")
            sc = dataclasses.replace(sc, workload=dataclasses.replace(sc.workload, starts=tuple(cfg.eval_starts)))
        out.append(sc)
    return out


class BlindObservation(gym.ObservationWrapper):
    """An environment's observation without the features ``blind`` names (``TrainConfig.blind``)."""

    def __init__(self, env: gym.Env, blind: tuple[str, ...]) -> None:
        super().__init__(env)
        self.keep = seen(blind)
        self.observation_space = gym.spaces.Box(LOW[self.keep], HIGH[self.keep], dtype=np.float32)

    def observation(self, obs: np.ndarray) -> np.ndarray:
        return obs[self.keep]


class AgentPolicy(Policy):
    """A model being trained, as a ``Policy`` (greedy), reading the features at ``keep`` (all by default)."""

    def __init__(self, model: OvercommitDQN, name: str = "dqn", keep: np.ndarray | None = None) -> None:
        self.model, self.name, self.engine_overrides, self.keep = model, name, {}, keep

    def act(self, obs: np.ndarray) -> int:
        return int(self.model.predict(obs if self.keep is None else obs[self.keep], deterministic=True)[0])


class HeldOutEval(BaseCallback):
    """Every ``eval_every`` steps: the greedy agent on the held-out episodes of each scenario, logged
    under eval/dqn/ (the mean over scenarios) and eval/<scenario>/dqn/; with ``select_seed``, also on
    the validation episodes (eval/validation/episode_reward), keeping the best network so far."""

    def __init__(self, scenarios: list[Scenario], cfg: TrainConfig) -> None:
        super().__init__()
        self.envs = [make_env(sc, cfg.shield) for sc in scenarios]
        self.cfg, self.last = cfg, 0
        self.history: list[dict] = []
        self.candidates: list[dict] = []  # each validated point: timesteps, validation reward
        self.best: dict | None = None  # the best of them (the first of equals)
        self.best_state: dict | None = None  # its network

    def _runs(self, seed: int) -> dict[str, dict]:
        """The greedy agent on ``eval_episodes`` episodes of each scenario from ``seed``."""
        agent = AgentPolicy(self.model, keep=seen(self.cfg.blind) if self.cfg.blind else None)
        return {env.scenario.name: evaluate(env, agent, self.cfg.eval_episodes, seed) for env in self.envs}

    def validate(self) -> None:
        """Score the current network on the validation episodes; keep it if it is the best so far."""
        reward = float(np.mean([r["episode_reward"] for r in self._runs(self.cfg.select_seed).values()]))
        self.candidates.append({"timesteps": int(self.model.num_timesteps), "validation_reward": reward})
        if self.best is None or reward > self.best["validation_reward"]:
            self.best, self.best_state = self.candidates[-1], copy.deepcopy(self.model.policy.q_net.state_dict())
        self.logger.record("eval/validation/episode_reward", reward)

    def selection(self) -> dict:
        """What the policy file records of the choice."""
        return {"seeds": [self.cfg.select_seed, self.cfg.select_seed + self.cfg.eval_episodes - 1],
                **self.best, "candidates": self.candidates}

    def _on_step(self) -> bool:
        if self.num_timesteps - self.last >= self.cfg.eval_every:
            self.last = self.num_timesteps
            if self.cfg.select_seed is not None:
                self.validate()
            runs = self._runs(self.cfg.eval_seed)
            mean = {k: float(np.mean([r[k] for r in runs.values() if r[k] is not None] or [0.0])) for k in FIGURES}
            self.history.append({"timesteps": self.num_timesteps, **mean})
            for k in FIGURES:
                self.logger.record(f"eval/dqn/{k}", mean[k])
                if len(runs) > 1:
                    for name, r in runs.items():
                        if r[k] is not None:
                            self.logger.record(f"eval/{name}/dqn/{k}", r[k])
        return True


FIGURES = ("goodput_tokens_per_s", "tokens_per_s", "kv_util_mean", "kv_util_p99", "oom_events", "preemptions",
           "ttft_p50_s", "ttft_p99_s", "episode_reward", "shield_overrides")


def _make_env(scenarios: list[Scenario], cfg: TrainConfig):
    shaping_gamma = cfg.gamma if cfg.shaping else None  # the agent's own discount: the optimal policy is unchanged

    def make():
        if len(scenarios) == 1 and shaping_gamma is None and cfg.backlog is None:
            env = make_env(scenarios[0], cfg.shield, training=True)
        else:
            env = MixtureEnv(scenarios, shield=TRAINING if cfg.shield else None, shaping_gamma=shaping_gamma,
                             weights=episode_weights(cfg), backlog=cfg.backlog)
        return BlindObservation(env, cfg.blind) if cfg.blind else env
    return make


def _run_dir(logdir: Path, name: str, resume: str | None) -> Path:
    """A new folder for the run: ``logdir/name`` (``_2``, ``_3``... when taken); a resumed run's
    next to the run it continues (``<run>_resumed``), which is left as it was."""
    if resume:
        origin = Path(resume).resolve().parent.parent
        logdir, name = origin.parent, f"{origin.name}_resumed"
    run = logdir / name
    k = 1
    while run.exists():
        k += 1
        run = logdir / f"{name}_{k}"
    return run


def _judge(run: Path, cfg: TrainConfig, evaluation: list[Scenario], baseline_specs: list[str] | None,
           timesteps: int, n_envs: int) -> tuple[dict, dict]:
    """The run's policy file and the baselines on the held-out episodes of every evaluation scenario,
    logged to TensorBoard; (tables by scenario, the first scenario's table)."""
    from rlctl.tensorboard import log_evaluation, log_hparams

    tables = {}
    node = is_node_config(cfg)
    make = make_node_policy if node else make_policy
    for sc in evaluation:
        specs = baseline_specs if baseline_specs is not None else (
            node_baselines(sc) if node else baselines(sc.best_static))
        eval_env = make_env(sc, cfg.shield)
        table = {"dqn": evaluate(eval_env, make(str(run / "policy.rlpolicy")), cfg.eval_episodes, cfg.eval_seed)}
        table["dqn"]["policy"] = "dqn"
        for spec in specs:
            policy = make(spec)
            table[policy.name] = evaluate(eval_env, policy, cfg.eval_episodes, cfg.eval_seed)
        tables[sc.name] = table
        log_evaluation(run, table, timesteps, tag="eval" if len(evaluation) == 1 else f"eval/{sc.name}")
    final = {k: float(np.mean([t["dqn"][k] for t in tables.values() if t["dqn"][k] is not None] or [0.0]))
             for k in FIGURES}
    log_hparams(run, {**cfg.agent_kwargs(), "scenarios": ",".join(cfg.scenarios), "seed": cfg.seed,
                      "members": cfg.members, "n_envs": n_envs}, final)
    return tables, tables[evaluation[0].name]


def member_seeds(cfg: TrainConfig) -> list[int]:
    """The training seeds of an ensemble's members (one network: the run's own seed)."""
    return [cfg.seed * cfg.members + k for k in range(cfg.members)]


def _train_member(cfg: TrainConfig, logdir: str, log: str) -> None:
    """One member of an ensemble, in its own process, its output in ``log``."""
    with open(log, "w") as f:
        os.dup2(f.fileno(), 1)
        os.dup2(f.fileno(), 2)
    train(cfg, logdir, progress_bar=False, baseline_specs=[])


def _train_ensemble(cfg: TrainConfig, logdir: str | Path, baseline_specs: list[str] | None) -> dict:
    """``cfg.members`` networks trained at once, one process each, exported as one ensemble file."""
    import multiprocessing

    from agents.export import export_ensemble

    evaluation = held_out(cfg)
    run = _run_dir(Path(logdir), cfg.name, None)
    (run / "members").mkdir(parents=True)
    (run / "config.json").write_text(json.dumps(dataclasses.asdict(cfg), indent=2) + "\n")
    members = [dataclasses.replace(cfg, members=1, seed=s, name=f"seed{s}") for s in member_seeds(cfg)]
    logs = [run / "members" / f"seed{m.seed}.log" for m in members]
    context = multiprocessing.get_context("forkserver")
    procs = [context.Process(target=_train_member, args=(m, str(run / "members"), str(log)), name=m.name)
             for m, log in zip(members, logs)]
    t0 = time.time()
    try:
        for proc in procs:
            proc.start()
        for proc in procs:
            proc.join()
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.terminate()
                proc.join()
    failed = [f"seed {m.seed} (exit code {proc.exitcode}; its output: {log})"
              for m, proc, log in zip(members, procs, logs) if proc.exitcode != 0]
    if failed:
        raise RuntimeError(f"train: {cfg.name}: member(s) failed: {', '.join(failed)}")
    files = [run / "members" / m.name / "policy.rlpolicy" for m in members]
    header = export_ensemble(files, run / "policy.rlpolicy", training_config=dataclasses.asdict(cfg))
    n_envs = cfg.n_envs or os.cpu_count() or 1
    tables, results = _judge(run, cfg, evaluation, baseline_specs, cfg.timesteps, n_envs)
    history = [json.loads((f.parent / "evaluation.json").read_text())["held_out"] for f in files]
    summary = {"run": str(run), "policy": str(run / "policy.rlpolicy"), "timesteps": cfg.timesteps,
               "wall_s": time.time() - t0, "n_envs": n_envs, "members": [str(f.parent) for f in files],
               "held_out": history, "results": results, "by_scenario": tables, "header": header}
    (run / "evaluation.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
    return summary


def check_checkpoint(resume: str) -> None:
    """Refuse a ``--resume`` that is not a checkpoint ``rlctl train`` wrote (``<run>/checkpoints/*.zip``)
    before anything is created or run."""
    path = Path(resume)
    if not path.is_file():
        raise ValueError(f"--resume {resume}: no such file")
    if not zipfile.is_zipfile(path):
        raise ValueError(f"--resume {resume}: not a checkpoint (a checkpoint is the .zip under <run>/checkpoints/; "
                         "its replay buffer's .pkl beside it is read with it)")
    if path.resolve().parent.name != "checkpoints":
        raise ValueError(f"--resume {resume}: a checkpoint is read from <run>/checkpoints/, where rlctl train "
                         "writes it; this one is not in such a folder")


def _checkpoint_settings(model) -> dict:
    """The agent settings a checkpoint trains on, under ``TrainConfig.agent_kwargs``' names."""
    kw = model.replay_buffer_kwargs  # SB3's own n_steps attribute is its n-step buffer's, not ours
    return {"double": model.double, "dueling": model.dueling, "prioritized": model.prioritized,
            "n_steps": kw["n_steps"], "learning_rate": model.learning_rate, "buffer_size": model.buffer_size,
            "batch_size": model.batch_size, "gamma": model.gamma, "train_freq": model.train_freq.frequency,
            "gradient_steps": model.gradient_steps, "learning_starts": model.learning_starts,
            "target_update_interval": model.target_update_interval,
            "exploration_fraction": model.exploration_fraction, "exploration_final_eps": model.exploration_final_eps,
            "per_alpha": kw["alpha"], "per_beta0": model.per_beta0,
            "net_arch": tuple(int(w) for w in model.policy_kwargs["net_arch"])}


def _check_resumed_settings(resume: str, model, cfg: TrainConfig) -> None:
    """A resumed run trains on its checkpoint's settings and records the configuration's: refuse one
    where they differ, so that what the run records is what it trained on."""
    mine = _checkpoint_settings(model)
    differ = [f"{k} {mine[k]!r} in the checkpoint, {v!r} in {cfg.name}" for k, v in cfg.agent_kwargs().items()
              if mine[k] != v]
    if differ:
        raise ValueError(f"--resume {resume}: the checkpoint trains on other settings than the configuration "
                         f"given ({'; '.join(differ)}); resume with the configuration it was trained with (its "
                         "run's config.json lists its settings)")


def train(cfg: TrainConfig, logdir: str | Path = "runs", resume: str | None = None, progress_bar: bool = True,
          baseline_specs: list[str] | None = None) -> dict:
    """Train (or resume) per ``cfg``; returns the run's summary (paths, evaluation table)."""
    if cfg.members > 1:
        if resume:
            raise ValueError(f"--resume continues one network's run; {cfg.name} trains an ensemble of "
                             f"{cfg.members} (members: {cfg.members}), whose members' runs are under "
                             "<run>/members/: resume one with its own config.json, or train the ensemble anew")
        return _train_ensemble(cfg, logdir, baseline_specs)
    from agents.export import export_policy
    from rlctl.tensorboard import ReviewCallback

    import torch

    # the Q-network is a few 128-wide layers: one intra-op thread computes it faster than two
    # (which wait on each other, and on the environments for the other core)
    torch.set_num_threads(1)
    scenarios = training_scenarios(cfg)
    evaluation = held_out(cfg)
    n_envs = cfg.n_envs or os.cpu_count() or 1
    if resume:
        check_checkpoint(resume)
    run = _run_dir(Path(logdir), cfg.name, resume)
    makers = [_make_env(scenarios, cfg) for _ in range(n_envs)]
    venv = SubprocVecEnv(makers, start_method="forkserver") if n_envs > 1 else DummyVecEnv(makers)
    venv.seed(cfg.seed)
    t0 = time.time()
    try:
        if resume:
            try:
                model = OvercommitDQN.load(resume, env=venv)
            except Exception as exc:  # SB3 raises what its reader meets: an assertion, a KeyError, a zip error,
                # or a checkpoint of other observations than this configuration's (blind features, say)
                raise ValueError(f"--resume {resume}: cannot be loaded as a checkpoint of {cfg.name} "
                                 f"({type(exc).__name__}: {exc})") from None
            _check_resumed_settings(resume, model, cfg)
            buffer = Path(re.sub(r"_(\d+)_steps\.zip$", r"_replay_buffer_\1_steps.pkl", str(resume)))
            if buffer.exists():
                model.load_replay_buffer(buffer)
            if model.num_timesteps >= cfg.timesteps:
                raise ValueError(f"--resume {resume}: the checkpoint is at {model.num_timesteps} steps, and "
                                 f"timesteps is {cfg.timesteps}: nothing to train (give --timesteps above "
                                 f"{model.num_timesteps})")
        else:
            model = OvercommitDQN(env=venv, seed=cfg.seed, verbose=0, **cfg.agent_kwargs())
            if cfg.init_policy is not None:
                start = initial_network(cfg, scenarios[0]).state_dict()
                model.policy.q_net.q_net.load_state_dict(start)
                model.policy.q_net_target.q_net.load_state_dict(start)
        run.mkdir(parents=True, exist_ok=True)
        model.set_logger(configure(str(run), ["tensorboard", "csv"]))
        (run / "config.json").write_text(json.dumps(dataclasses.asdict(cfg), indent=2) + "\n")
        held = HeldOutEval(evaluation, cfg)
        callbacks = CallbackList([
            ReviewCallback(), held,
            CheckpointCallback(max(cfg.checkpoint_every // n_envs, 1), str(run / "checkpoints"),
                               save_replay_buffer=True)])
        remaining = cfg.timesteps - model.num_timesteps
        if remaining > 0:
            model.learn(remaining, callback=callbacks, reset_num_timesteps=not resume, progress_bar=progress_bar)
        selection = None
        if cfg.select_seed is not None:
            if not held.candidates or held.candidates[-1]["timesteps"] != model.num_timesteps:
                held.validate()  # the end is a candidate too
            selection = held.selection()
            model.policy.q_net.load_state_dict(held.best_state)
            print(f"train: kept the network of step {selection['timesteps']:,} (validation reward "
                  f"{selection['validation_reward']:.2f}; " + ", ".join(
                      f"{c['timesteps']:,}: {c['validation_reward']:.2f}" for c in selection["candidates"]) + ")")
        header = export_policy(model, run / "policy.rlpolicy", scenario=scenarios[0],
                               training_config=dataclasses.asdict(cfg), selection=selection, blind=cfg.blind)
        tables, results = _judge(run, cfg, evaluation, baseline_specs, model.num_timesteps, n_envs)
    finally:
        venv.close()
    summary = {"run": str(run), "policy": str(run / "policy.rlpolicy"), "timesteps": model.num_timesteps,
               "wall_s": time.time() - t0, "n_envs": n_envs, "held_out": held.history, "results": results,
               "by_scenario": tables, "header": header}
    (run / "evaluation.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
    return summary
