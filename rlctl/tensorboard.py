"""TensorBoard review of a training run: what each episode did, the evaluation against the
baselines, and the hyperparameters with their final figures (tests/tensorboard_events.py reads
the event files back).

- ``ReviewCallback``: a stable-baselines3 callback for ``model.learn`` on a VecEnv of
  ``OvercommitEnv`` (``DummyVecEnv`` or ``SubprocVecEnv``). At each episode end (an ``info`` with
  ``summary``) it records to the model's logger, under ``episode/...``, ``actions/...`` and
  ``rolling/...``: the episode reward, each reward term's contribution, goodput, tokens/s, KV
  utilisation (mean, p99), OOM events, preemptions, the share of each applied action (a node's as
  ``actions/share_<engine>/<action>``), the mean overcommit factor and the shield's overrides;
  then it dumps the logger at that step, so that no episode is lost between SB3's own dumps
  (episodes of several environments that end at the same step are averaged). The model's own ``train/*`` (loss, q_mean, td_abs_mean, per_beta,
  priority_mean) and ``rollout/exploration_rate`` go out with these dumps and SB3's.
- ``log_evaluation``: ``rlctl.evaluate``'s results as a markdown table (text plugin, tag
  ``eval/table``) and as scalars ``eval/<policy>/<figure>``.
- ``log_hparams``: hyperparameters and final figures for the HPARAMS tab.

Reward terms: ``episode/reward_terms/<term>`` is the term's signed, weighted contribution summed
over the episode (``alpha*goodput``, ``kappa*late``, ``-gamma*slo_violation``, ``-omega*ooms``,
``-rho*recompute``, ``beta*alloc``, as each step's ``info["weighted_reward_terms"]`` gives them), so they add up
to the environment's episode reward; ``episode/raw_terms/<term>`` is the unweighted sum. An
environment whose ``info`` has no weighted terms gets the raw sums only.
"""
from __future__ import annotations

import math
import os
from collections import deque
from pathlib import Path

import numpy as np
from stable_baselines3.common.callbacks import BaseCallback

from engine.control import ACTIONS
from env.overcommit_env import REWARD_TERMS

TERMS = tuple(REWARD_TERMS)
# summary key -> tag under episode/ (figures of engine.metrics.summarize and the env's summary)
EPISODE_FIGURES = {
    "goodput_tokens_per_s": "goodput_tokens_per_s",
    "tokens_per_s": "tokens_per_s",
    "kv_util_mean": "kv_util_mean",
    "kv_util_p99": "kv_util_p99",
    "oom_events": "oom_events",
    "preemptions": "preemptions",
    "shield_overrides": "shield_overrides",
    "requests_completed": "requests_completed",
    "slo_attainment": "slo_attainment",
    "ttft_p50_s": "ttft_p50_s",
    "ttft_p99_s": "ttft_p99_s",
    "compactions": "compactions",
    "swap_out_blocks": "swap_out_blocks",
    "final_overcommit": "final_overcommit",
}
# figures of evaluate()'s results written as eval/<policy>/<figure>
EVAL_FIGURES = ("goodput_tokens_per_s", "tokens_per_s", "kv_util_mean", "kv_util_p99", "oom_events", "preemptions",
                "ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "tpot_p99_s", "requests_completed", "shield_overrides",
                "episode_reward")


def _number(value) -> float | None:
    """``value`` as a finite float, or None (None, NaN, inf, non-numbers)."""
    if value is None or isinstance(value, (str, bytes)):
        return None
    try:
        f = float(value)
    except (TypeError, ValueError):
        return None
    return f if math.isfinite(f) else None


class _Episode:
    """What one environment's current episode has done so far."""

    def __init__(self) -> None:
        self.reward = 0.0
        self.steps = 0
        self.terms = dict.fromkeys(TERMS, 0.0)
        self.weighted: dict[str, float] | None = dict.fromkeys(TERMS, 0.0)
        self.overcommit: list[float] = []
        self.actions = dict.fromkeys(ACTIONS, 0)  # a node's actions (engine:action) are added as they come

    def add(self, reward: float, info: dict) -> None:
        self.reward += float(reward)
        self.steps += 1
        for k, v in (info.get("reward_terms") or {}).items():
            if k in self.terms and _number(v) is not None:
                self.terms[k] += float(v)
        weighted = info.get("weighted_reward_terms")
        if weighted is None:  # an environment that does not weigh its terms: raw sums only
            self.weighted = None
        elif self.weighted is not None:
            for k in self.weighted:
                self.weighted[k] += float(weighted.get(k, 0.0))
        if _number(info.get("overcommit")) is not None:
            self.overcommit.append(float(info["overcommit"]))
        if isinstance(info.get("applied_action"), str):
            self.actions[info["applied_action"]] = self.actions.get(info["applied_action"], 0) + 1


class ReviewCallback(BaseCallback):
    """Records each finished episode's figures to the model's logger (see the module docstring).

    ``window``: episodes in the ``rolling/*`` means. ``dump``: dump the logger at every step where
    an episode ended (default; every figure of every episode reaches the event file at its step);
    with ``False`` the figures are averaged until SB3 dumps at its ``log_interval``. At the end of
    training whatever is still recorded and not dumped (episodes, the last ``train/*``) is dumped.
    """

    def __init__(self, window: int = 20, dump: bool = True, verbose: int = 0) -> None:
        super().__init__(verbose)
        if window <= 0:
            raise ValueError(f"window must be > 0, got {window}")
        self.window, self.dump = window, dump
        self.episodes: list[_Episode] = []
        self.recent: dict[str, deque] = {}
        self.episodes_done = 0
        self._pending = False

    def _on_training_start(self) -> None:
        n = self.training_env.num_envs
        # learn(reset_num_timesteps=False) goes on with the episodes under way: keep their sums
        if self.locals.get("reset_num_timesteps", True) or len(self.episodes) != n:
            self.episodes = [_Episode() for _ in range(n)]

    def _on_step(self) -> bool:
        infos = self.locals.get("infos") or []
        rewards = self.locals.get("rewards")
        dones = self.locals.get("dones")
        ended = False
        for i, info in enumerate(infos):
            if i >= len(self.episodes):
                self.episodes.append(_Episode())
            ep = self.episodes[i]
            ep.add(0.0 if rewards is None else rewards[i], info)
            done = bool(dones[i]) if dones is not None else False
            if "summary" in info or done:
                self._record(ep, info.get("summary"))
                self.episodes[i] = _Episode()
                ended = True
        if ended:
            if self.dump:
                self.logger.dump(self.num_timesteps)
            else:
                self._pending = True
        return True

    def _on_training_end(self) -> None:
        # what was recorded since the last dump (episodes with dump=False, the last train/* figures
        # of the final gradient steps) would otherwise never reach the event file
        if self._pending or getattr(self.logger, "name_to_value", None):
            self.logger.dump(self.num_timesteps)
        self._pending = False

    def _record(self, ep: _Episode, summary: dict | None) -> None:
        self.episodes_done += 1
        values: dict[str, float] = {"episode/reward": ep.reward, "episode/length": float(ep.steps)}
        for t in TERMS:
            values[f"episode/raw_terms/{t}"] = ep.terms[t]
            if ep.weighted is not None:
                values[f"episode/reward_terms/{t}"] = ep.weighted[t]
        if ep.overcommit:
            values["episode/overcommit_mean"] = float(np.mean(ep.overcommit))
        counts = dict(ep.actions)
        if summary is not None:
            for key, tag in EPISODE_FIGURES.items():
                v = _number(summary.get(key))
                if v is not None:
                    values[f"episode/{tag}"] = v
            if isinstance(summary.get("actions"), dict):  # one engine's ACTIONS, or a node's (engine:action)
                counts = {a: n for a, n in summary["actions"].items() if _number(n) is not None}
        total = sum(counts.values())
        if total > 0:
            names = list(ACTIONS) if set(counts) <= set(ACTIONS) else list(counts)
            for a in names:
                values[f"actions/share_{a.replace(':', '/')}"] = counts.get(a, 0) / total
        for tag, v in values.items():
            self.logger.record_mean(tag, v)
        for tag in ("episode/reward", "episode/goodput_tokens_per_s", "episode/oom_events", "episode/kv_util_mean"):
            if tag in values:
                self.recent.setdefault(tag, deque(maxlen=self.window)).append(values[tag])
                self.logger.record("rolling/" + tag.split("/", 1)[1], float(np.mean(self.recent[tag])))
        self.logger.record("episode/count", self.episodes_done)


# ---- writers ----------------------------------------------------------------------------------------
def _summary_writer(target):
    """(SummaryWriter, close it afterwards?) for a SummaryWriter, an SB3 Logger or model, or a run directory."""
    from torch.utils.tensorboard import SummaryWriter

    if isinstance(target, SummaryWriter):
        return target, False
    if isinstance(target, (str, os.PathLike)):
        return SummaryWriter(log_dir=str(target)), True
    logger = getattr(target, "logger", None) if not hasattr(target, "output_formats") else target
    if logger is not None and hasattr(logger, "output_formats"):
        from stable_baselines3.common.logger import TensorBoardOutputFormat

        for fmt in logger.output_formats:
            if isinstance(fmt, TensorBoardOutputFormat) and not getattr(fmt, "_is_closed", False):
                return fmt.writer, False
        if logger.get_dir():
            return SummaryWriter(log_dir=logger.get_dir()), True
    raise TypeError(f"expected a SummaryWriter, a stable-baselines3 Logger or model with a log directory, "
                    f"or a run directory; got {type(target).__name__}")


def _tag_part(name: str) -> str:
    return "_".join(str(name).replace("/", "_").split())


def evaluation_markdown(results: dict[str, dict], extra_rows: list | None = None) -> str:
    """``rlctl.report.format_table``'s rows and cells as a markdown table (one column per policy)."""
    from rlctl.report import EVAL_ROWS, ROWS, _cell

    rows = ROWS + list(EVAL_ROWS if extra_rows is None else extra_rows)
    names = list(results)
    lines = ["| figure | " + " | ".join(names) + " |", "|---|" + "---:|" * len(names)]
    for label, key, fmt in rows:
        lines.append(f"| {label} | " + " | ".join(_cell(results[n], key, fmt) for n in names) + " |")
    first = next(iter(results.values()), {})
    head = []
    if first.get("scenario"):
        head.append(f"scenario: {first['scenario']}")
    if isinstance(first.get("episodes"), list):
        head.append(f"episodes: {len(first['episodes'])}")
    return ("  \n".join(head) + "\n\n" if head else "") + "\n".join(lines)


def log_evaluation(logger_or_writer, results: dict[str, dict], step: int, tag: str = "eval") -> None:
    """Write ``results`` (policy name -> ``rlctl.evaluate.evaluate``'s figures) at ``step``: the table
    as markdown text under ``<tag>/table`` and each of ``EVAL_FIGURES`` as ``<tag>/<policy>/<figure>``
    (figures that are None, e.g. TTFT with no request finished, are left out).

    ``logger_or_writer``: a ``torch.utils.tensorboard.SummaryWriter``, a stable-baselines3 Logger
    (or a model: its logger; the run directory of its TensorBoard output) or a run directory."""
    if not results:
        raise ValueError("log_evaluation: no results")
    writer, close = _summary_writer(logger_or_writer)
    try:
        writer.add_text(f"{tag}/table", evaluation_markdown(results), step)
        for name, figures in results.items():
            for key in EVAL_FIGURES:
                v = _number(figures.get(key))
                if v is not None:
                    writer.add_scalar(f"{tag}/{_tag_part(name)}/{key}", v, step)
        writer.flush()
    finally:
        if close:
            writer.close()


def flatten_hparams(hparams: dict, prefix: str = "") -> dict[str, int | float | str | bool]:
    """``hparams`` with nested dicts flattened to ``a.b`` keys and every value an int, float, str
    or bool (numpy scalars to Python numbers, None / sequences / anything else to their text)."""
    out: dict[str, int | float | str | bool] = {}
    for k, v in hparams.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten_hparams(v, key + "."))
        elif isinstance(v, np.generic):
            out[key] = v.item()
        elif isinstance(v, (bool, int, float, str)):
            out[key] = v
        elif isinstance(v, (list, tuple, np.ndarray)):
            out[key] = str(list(np.asarray(v).tolist()) if isinstance(v, np.ndarray) else list(v))
        else:
            out[key] = str(v)
    return out


def log_hparams(run_dir: str | os.PathLike, hparams: dict, metrics: dict, run_name: str = "hparams") -> Path:
    """Write ``hparams`` and the final ``metrics`` for TensorBoard's HPARAMS tab, into the session
    ``run_dir/run_name`` (the experiment, session start and end summaries and each metric as a
    scalar there, as ``SummaryWriter.add_hparams`` does, without its stray timestamped folder).
    Metrics that are None or not numbers are left out. Returns the session directory.

    Hyperparameters are flattened by ``flatten_hparams``; torch's ``hparams`` stores a bool as a
    number (1.0 / 0.0), so the HPARAMS tab shows booleans as 1 and 0."""
    from torch.utils.tensorboard import SummaryWriter
    from torch.utils.tensorboard.summary import hparams as hparams_summaries

    flat = flatten_hparams(hparams)
    metric_values = {str(k): v for k, v in ((k, _number(v)) for k, v in metrics.items()) if v is not None}
    session = Path(run_dir) / run_name
    exp, ssi, sei = hparams_summaries(flat, metric_values)
    with SummaryWriter(log_dir=str(session)) as w:
        w.file_writer.add_summary(exp)
        w.file_writer.add_summary(ssi)
        w.file_writer.add_summary(sei)
        for k, v in metric_values.items():
            w.add_scalar(k, v)
    return session
