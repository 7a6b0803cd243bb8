"""Reading TensorBoard event files back, so that tests can check what a run logged."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np


def event_files(run_dir: str | os.PathLike) -> list[Path]:
    """Every TensorBoard event file under ``run_dir`` (recursively), in name order."""
    root = Path(run_dir)
    if root.is_file():
        return [root]
    return sorted(p for p in root.rglob("*") if p.is_file() and "tfevents" in p.name)


def _accumulators(run_dir):
    from tensorboard.backend.event_processing import event_accumulator as ea

    guidance = {ea.SCALARS: 0, ea.TENSORS: 0, ea.COMPRESSED_HISTOGRAMS: 0, ea.HISTOGRAMS: 0, ea.IMAGES: 0,
                ea.AUDIO: 0}
    for path in event_files(run_dir):
        acc = ea.EventAccumulator(str(path), size_guidance=guidance)
        acc.Reload()
        yield path, acc


def _plugin_tags(acc, plugin: str) -> dict[str, bytes]:
    try:
        return acc.PluginTagToContent(plugin)
    except KeyError:  # no tag of that plugin in this file
        return {}


def read_scalars(run_dir: str | os.PathLike) -> dict[str, list[tuple[int, float]]]:
    """Every scalar under ``run_dir``: tag -> [(step, value), ...], merged over all event files
    (a tag in several files, e.g. a metric in the run and its hparams session, has all points),
    sorted by step then wall time. Scalars written as tensors (``new_style``) are included."""
    from tensorboard.util import tensor_util

    points: dict[str, list[tuple[int, float, float]]] = {}
    for _, acc in _accumulators(run_dir):
        tags = acc.Tags()
        for tag in tags.get("scalars", []):
            points.setdefault(tag, []).extend((e.step, e.wall_time, float(e.value)) for e in acc.Scalars(tag))
        for tag in _plugin_tags(acc, "scalars"):
            if tag in tags.get("tensors", []):
                points.setdefault(tag, []).extend(
                    (e.step, e.wall_time, float(tensor_util.make_ndarray(e.tensor_proto).item())) for e in acc.Tensors(tag))
    return {tag: [(s, v) for s, _, v in sorted(p, key=lambda x: (x[0], x[1]))] for tag, p in sorted(points.items())}


def read_text(run_dir: str | os.PathLike) -> dict[str, list[tuple[int, str]]]:
    """Every text summary under ``run_dir``: tag -> [(step, text), ...] (SummaryWriter.add_text's
    tags end in ``/text_summary``)."""
    from tensorboard.util import tensor_util

    out: dict[str, list[tuple[int, float, str]]] = {}
    for _, acc in _accumulators(run_dir):
        for tag in _plugin_tags(acc, "text"):
            for e in acc.Tensors(tag):
                arr = tensor_util.make_ndarray(e.tensor_proto)
                parts = [x.decode("utf-8") if isinstance(x, bytes) else str(x) for x in np.ravel(arr)]
                out.setdefault(tag, []).append((e.step, e.wall_time, "\n".join(parts)))
    return {tag: [(s, t) for s, _, t in sorted(p, key=lambda x: (x[0], x[1]))] for tag, p in sorted(out.items())}


def read_hparams(run_dir: str | os.PathLike) -> dict[str, dict[str, Any]]:
    """The HParams plugin data under ``run_dir``: session directory (relative to ``run_dir``) ->
    {"hparams": {name: value}, "metrics": [metric tags], "status": session end status}."""
    from tensorboard.plugins.hparams import plugin_data_pb2

    root = Path(run_dir)
    out: dict[str, dict[str, Any]] = {}
    for path, acc in _accumulators(run_dir):
        content = _plugin_tags(acc, "hparams")
        if not content:
            continue
        rel = os.path.relpath(path.parent, root) if root.is_dir() else str(path.parent)
        entry = out.setdefault(rel, {"hparams": {}, "metrics": [], "status": None})
        for blob in content.values():
            data = plugin_data_pb2.HParamsPluginData.FromString(blob)
            kind = data.WhichOneof("data")
            if kind == "experiment":
                entry["metrics"] = [m.name.tag for m in data.experiment.metric_infos]
            elif kind == "session_start_info":
                for name, value in data.session_start_info.hparams.items():
                    which = value.WhichOneof("kind")
                    entry["hparams"][name] = (getattr(value, which) if which in ("number_value", "string_value", "bool_value")
                                              else str(value))
            elif kind == "session_end_info":
                entry["status"] = data.session_end_info.status
    return out
