"""A node whose engines are separate processes: each an MPS client started with its own
``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT``, restarted under a new limit when one must take effect.

``ProcessNode`` offers what the node's decision interval (engine/node_control.py) and its live
loop (rlctl/online/node_live.py) use of an in-process ``Node``: the engines (``EngineHandle``,
each one process, rlctl/online/engine_process.py), the device, ``advance``, ``limit_for`` and
``set_limit``. So ``rlctl replay --node SCENARIO --processes`` runs the same loop, the same
checks and the same fallbacks as the in-process node, with the engines in their own processes:

- each engine process is started with ``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=<limit>`` in its own
  environment (nothing daemon-wide: no other client is touched) and sizes its KV to it;
- every engine charges one device ledger (engine/shared_device.py; on a GPU, the GPU), so a
  tenant that grows can leave another without memory, and that engine takes its own OOM path;
- ``set_limit`` is a graceful restart: the running process hands over every request it holds,
  with its tokens and its record (``drain``), a new process starts under the new limit, down for
  the engine's restart time, and takes them over (``resume``): nothing is lost, their KV is
  recomputed.

The node keeps the books of every request that finished, over all of an engine's processes.
"""
from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np

from engine.config import max_model_len
from engine.metrics import meets_slo
from engine.records import Counters, RequestRecord
from engine.roofline import deployment
from engine.shared_device import SharedDevice
from engine.snapshot import Snapshot
from env.node_scenario import load_node_scenario
from env.shared_gpu_env import node_requests
from rlctl.online.engine_process import request_to_dict
from rlctl.online.mps import CLIENT_LIMIT_ENV, client_limit_value, format_limit, parse_limit


class EngineProcessError(RuntimeError):
    """An engine process refused an operation or died; the message says which and why."""


@dataclass
class _Share:
    """What the node reads of an engine's MPS client: its limit and the bytes it holds."""

    capacity: int
    used: int


@dataclass(frozen=True)
class _Copy:
    blocks: int
    seconds: float


class EngineHandle:
    """One engine process, seen from the node: the engine operations the node's interval applies,
    answered by the process. ``config`` is the engine's configuration with the KV blocks its limit holds."""

    def __init__(self, node: "ProcessNode", name: str, config) -> None:
        self.node, self.name, self.base_config = node, name, config
        self.proc: subprocess.Popen | None = None
        self.pids: list[int] = []
        self.env_limits: list[str] = []  # CUDA_MPS_PINNED_DEVICE_MEM_LIMIT of each process, as it read it
        self.counters_before = Counters()  # the counters of its processes that have ended
        self.last_snapshot: Snapshot | None = None
        self.state: dict = {}

    # ---- the process ------------------------------------------------------------------------------
    def start(self, limit: int, clock: float, down: bool) -> None:
        env = {**self.node.environ, CLIENT_LIMIT_ENV: client_limit_value({0: limit})}
        args = [sys.executable, "-m", "rlctl.online.engine_process", "--scenario", self.node.scenario_path,
                "--tenant", self.name, "--config", json.dumps(asdict(self.base_config)),
                "--ledger", str(self.node.ledger_path), "--clock", repr(clock)] + (["--down"] if down else [])
        # its standard error goes to a file, never a pipe nobody reads while it runs (a full pipe would stall it)
        self.stderr_path = self.node.ledger_path.with_name(f"{self.name}.{len(self.pids)}.stderr")
        with open(self.stderr_path, "w") as err:  # bytes; ``receive`` reads the answers' pipe itself (os.read)
            self.proc = subprocess.Popen(args, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err)
        self._unread = b""  # what the process wrote past the last answer read
        hello = self.call("hello")
        self.pids.append(hello["pid"])
        self.env_limits.append(hello["env_limit"])

    def send(self, op: str, **kw) -> None:
        try:
            self.proc.stdin.write((json.dumps({"op": op, **kw}) + "\n").encode())
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            self._died(op)

    def receive(self, op: str) -> dict:
        """The process's answer to ``op``. One that does not come within the node's ``reply_timeout_s``
        (a process stopped or stuck) ends it and raises, naming it: the node's other engines, which
        advance in lockstep with it, would otherwise wait on it for ever."""
        deadline = time.monotonic() + self.node.reply_timeout_s
        fd = self.proc.stdout.fileno()
        chunks, chunk = [self._unread], self._unread  # a long answer comes in many reads: joined once, at its end
        while b"\n" not in chunk:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                self.proc.kill()
                raise EngineProcessError(f"engine {self.name!r} (pid {self.proc.pid}) did not answer {op} within "
                                         f"{self.node.reply_timeout_s:g} s: it was killed")
            chunk = os.read(fd, 1 << 20)
            if not chunk:
                self._died(op)
            chunks.append(chunk)
        line, _, self._unread = b"".join(chunks).partition(b"\n")
        out = json.loads(line)
        if not out["ok"]:
            raise EngineProcessError(f"engine {self.name!r} (pid {self.proc.pid}) refused {op}: {out['error']}")
        if "state" in out:
            self.state = out["state"]
        return out

    def call(self, op: str, **kw) -> dict:
        self.send(op, **kw)
        return self.receive(op)

    def _died(self, op: str):
        self.proc.wait(timeout=10)
        err = self.stderr_path.read_text().strip()[-2000:]
        raise EngineProcessError(f"engine {self.name!r} (pid {self.proc.pid}) exited with status "
                                 f"{self.proc.returncode} during {op}" + (f": {err}" if err else ""))

    def stop(self) -> dict:
        """Hand over what it holds and end the process (``drain``)."""
        out = self.call("drain")
        self.proc.wait(timeout=30)
        self.proc.stdin.close()
        self.proc.stdout.close()
        for k, v in out["counters"].items():
            setattr(self.counters_before, k, getattr(self.counters_before, k) + v)
        self.proc = None
        return out

    # ---- what the node's interval uses of an engine ------------------------------------------------------
    @property
    def overcommit(self) -> float:
        return self.state["overcommit"]

    @property
    def num_blocks(self) -> int:
        return self.state["num_blocks"]

    @property
    def max_model_len(self) -> int:
        return self.state["max_model_len"]

    @property
    def config(self):
        return replace(self.base_config, num_blocks=self.num_blocks)

    @property
    def device(self) -> _Share:
        return _Share(self.state["limit"], self.state["held_bytes"])

    @property
    def counters(self) -> Counters:
        now = self.state.get("counters", {})
        return Counters(**{k: getattr(self.counters_before, k) + now.get(k, 0) for k in asdict(Counters())})

    def has_work(self) -> bool:
        return self.state["has_work"]

    def set_overcommit(self, factor: float) -> float:
        return self.call("set_overcommit", factor=factor)["state"]["overcommit"]

    def compact(self) -> _Copy:
        out = self.call("compact")
        return _Copy(out["blocks"], out["seconds"])

    def evict(self, share: float) -> _Copy:
        out = self.call("evict", share=share)
        return _Copy(out["blocks"], out["seconds"])

    def snapshot(self) -> Snapshot:
        d = self.call("snapshot")["snapshot"]
        self.last_snapshot = Snapshot(**{**d, "queue_hist": tuple(d["queue_hist"]),
                                         "running_hist": tuple(d["running_hist"])})
        return self.last_snapshot


class ProcessNode:
    """The engines of node scenario ``scenario`` (its workloads drawn with ``seed``), each in its
    own process under the MPS limit ``limits`` gives it (``NodeScenario.limit_bytes``'s rule)."""

    def __init__(self, scenario: str, seed: int = 0, limits: str | float = "scenario",
                 workdir: str | Path | None = None, environ: dict | None = None,
                 reply_timeout_s: float = 120.0) -> None:
        if not reply_timeout_s > 0:
            raise ValueError(f"reply_timeout_s must be > 0 s, got {reply_timeout_s}")
        self.reply_timeout_s = reply_timeout_s  # the longest an engine process may take to answer one operation
        sc = load_node_scenario(scenario)  # the engine processes read it again, by this name or path
        self.scenario, self.scenario_path, self.slice_s = sc, str(scenario), sc.slice_s
        self._tmp = tempfile.TemporaryDirectory(prefix="rlctl-node-") if workdir is None else None
        self.ledger_path = Path(workdir or self._tmp.name) / "device"
        self.device = SharedDevice.create(self.ledger_path, sc.gpu.memory_bytes)
        self.environ = dict(os.environ if environ is None else environ)
        self.clock = 0.0
        self.records: dict[str, dict[str, RequestRecord]] = {t.name: {} for t in sc.tenants}
        self.submitted: dict[str, int] = {}
        self.engines: dict[str, EngineHandle] = {}
        rng = np.random.default_rng(seed)
        try:
            for t in sc.tenants:
                cfg = sc.engine_config(t, seed=int(rng.integers(2**31)))
                self.engines[t.name] = handle = EngineHandle(self, t.name, cfg)
                handle.start(self.exact_limit(sc.limit_bytes(t, limits)), 0.0, down=False)
            lens = {n: max_model_len(deployment(t.deployment).model, e.base_config)
                    for (n, e), t in zip(self.engines.items(), sc.tenants)}
            for name, (requests, _) in node_requests(sc, lens, rng).items():
                self.engines[name].call("submit", requests=[request_to_dict(r) for r in requests])
                self.submitted[name] = len(requests)
        except BaseException:
            self.close()
            raise

    @staticmethod
    def exact_limit(nbytes: int) -> int:
        """The limit as MPS takes it (whole MiB, rounded down): what the process will read."""
        return parse_limit(format_limit(nbytes))

    @property
    def names(self) -> list[str]:
        return list(self.engines)

    def limits(self) -> dict[str, int]:
        return {n: e.device.capacity for n, e in self.engines.items()}

    def has_work(self) -> bool:
        return any(e.has_work() for e in self.engines.values())

    def advance(self, until: float, events=None) -> None:
        """Every engine to ``until`` in the node's lockstep slices, the processes running each slice together."""
        if events:
            raise ValueError("a process node's engines take no scheduled events")
        while self.clock < until:
            self.clock = min(self.clock + self.slice_s, until)
            for e in self.engines.values():
                e.send("advance", until=self.clock)
            failed = None  # the first engine that fails; the others' answers are read all the same
            for name, e in self.engines.items():
                try:
                    for r in e.receive("advance")["finished"]:
                        self.records[name][r["request_id"]] = RequestRecord(**r)
                except EngineProcessError as exc:
                    failed = failed or exc
            if failed is not None:
                raise failed

    def limit_for(self, name: str, num_blocks: int) -> int:
        return self.engines[name].call("limit_for", blocks=num_blocks)["bytes"]

    def set_limit(self, name: str, limit: int) -> bool:
        """Restart engine ``name``'s process gracefully under a new MPS limit; False when it is the
        limit in force (no restart)."""
        e = self.engines[name]
        limit = self.exact_limit(limit)
        if limit == e.device.capacity:
            return False
        if not 0 < limit <= self.device.capacity:
            raise ValueError(f"engine {name!r}: an MPS limit must be in (0, {self.device.capacity}] B, got {limit}")
        out = e.stop()
        for r in out["finished"]:
            self.records[name][r["request_id"]] = RequestRecord(**r)
        e.start(limit, self.clock, down=True)
        e.call("resume", held=out["held"])
        e.call("submit", requests=out["pending"])
        return True

    def figures(self) -> dict:
        """Each engine's figures over the node's span, from the records of every process it had."""
        out = {}
        for name, e in self.engines.items():
            cfg = e.base_config
            done = list(self.records[name].values())
            good = [r for r in done if meets_slo(r, cfg.ttft_slo_s, cfg.tpot_slo_s)]
            c = e.counters
            out[name] = {"requests_submitted": self.submitted[name], "requests_completed": len(done),
                         "goodput_tokens_per_s": sum(r.output_len for r in good) / max(self.clock, 1e-9),
                         "slo_attainment": len(good) / len(done) if done else None, "oom_events": c.oom_events,
                         "preemptions": c.preemptions, "restarts": c.restarts, "requests_abandoned": c.abandoned,
                         "mps_limit_bytes": e.device.capacity,
                         "pids": list(e.pids), "env_limits": list(e.env_limits)}
        return out

    def close(self) -> None:
        """End every engine process (killed if it does not stop) and remove the ledger."""
        for e in self.engines.values():
            if e.proc is not None and e.proc.poll() is None:
                e.proc.kill()
                e.proc.wait(timeout=10)
            if e.proc is not None:
                for pipe in (e.proc.stdin, e.proc.stdout):
                    try:
                        pipe.close()
                    except OSError:  # a dead process's stdin cannot flush what was written to it
                        pass
        self.device.close()
        if self._tmp is not None:
            self._tmp.cleanup()

    def __enter__(self) -> "ProcessNode":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
