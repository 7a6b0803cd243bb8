"""The live loop: an engine steered by the sidecar, that keeps serving whatever the sidecar does.

Every ``decision_interval_s`` of engine time the engine's snapshot goes to the sidecar (``Decide``
with a deadline), and the decision that comes back is checked (the snapshot's sequence number,
a known action id and name, a factor > 0, an admission headroom no larger than the shield asks)
and applied by ``engine.control.run_interval``,
the loop the environment runs too: the same action, the same effect, online and offline.

A deadline miss, a lost connection, an RPC error, a decision that fails the check, or anything
else that goes wrong in asking (a channel that cannot be rebuilt, say a TLS file being rotated) is
a fault: the engine runs that interval under the safe static policy (factor ``safe_factor``, or the
factor in force where that is lower, the admission headroom in force kept, hold: a fallback never
admits more than the decisions it stands in for), the
fallback is counted by reason, the channel is dropped, and a fresh one is tried after a backoff
that doubles up to ``backoff_max_s`` (decisions in between run under the safe policy too, counted
under the fault that started the backoff). The engine waits at most ``deadline_s`` on the
sidecar per interval, and never while backing off. (The MPS actuator, given ``mps``, talks to
its control daemon once per engine, when the loop first meets it, before that engine's first
decision: at most four commands of ``MPSLimit.timeout_s`` (5 s) each, where the daemon hangs.)

What a decision changes goes through the actuators (rlctl/online/actuators.py, rlctl/online/mps.py), and the
controller keeps the last report of each and counts the reports that changed something:

* ``EngineQuota``: the factor in force after every decision (moved by the action, set by a
  policy that pins its factor, or a fallback's safe factor), and the shield's admission headroom
  that the decision carries (a fallback keeps the one in force: it never admits more than the
  decisions it stands in for), immediate;
* ``TorchMemoryFraction``: the fraction of its device this process's CUDA allocator may take,
  once per engine: it is the engine's weights, workspace and whole KV capacity over the device
  (``engine_memory_bytes``), which no overcommit factor changes (the factor changes how much
  demand is admitted onto that capacity, never the capacity). On an engine not on CUDA it reports
  why not ("CUDA is not available", "cpu is not a CUDA device");
* ``MPSLimit`` (only when given ``mps``): the default MPS pinned-memory limit on ``mps_device`` for
  the engine processes started next, set to what this engine needs, once per engine for the same
  reason. MPS never resizes a running client: this engine keeps the limit it started with. The
  default is daemon-wide (every MPS client started afterwards on the host gets it): ``steer``
  restores the one it replaced when the replay ends, on an error too.

With ``metrics`` (an ``EngineMetrics``) every decision interval updates the engine's Prometheus
metrics and every fallback counts there too, under the same reasons (``FALLBACK_REASONS``, one
list, defined in rlctl/online/engine_metrics.py).

Why unary ``Decide`` and not the ``Live`` stream: each decision gets its own deadline, enforced
and cancelled by gRPC on both sides, with no reader thread and no matching of late replies; a
slow decision cannot hold up the next one behind it on a stream; and a fault is confined to the
call that met it. The price, a new HTTP/2 stream per call, is tens of microseconds once per
decision interval (``rlctl bench sidecar`` measures both).
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import secrets
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import grpc

from agents.shield import MAX_HEADROOM
from engine.engine import Engine
from engine.metrics import summarize
from engine.control import ACTIONS, HOLD, run_interval
from engine.request import Request
from rlctl.online.actuators import ActuatorReport, EngineQuota, TorchMemoryFraction
from rlctl.online.addresses import channel_options, url_host
from rlctl.online.engine_metrics import FALLBACK_REASONS, EngineMetrics
from rlctl.online.messages import snapshot_message
from rlctl.online.mps import MPSLimit
from rlctl.online.proto import controller_pb2 as pb, controller_pb2_grpc as pb_grpc

ACTUATORS = (EngineQuota.name, TorchMemoryFraction.name, MPSLimit.name)
_REASON = {grpc.StatusCode.DEADLINE_EXCEEDED: "deadline", grpc.StatusCode.UNAVAILABLE: "connection",
           grpc.StatusCode.CANCELLED: "connection"}



@dataclass(frozen=True)
class ClientTLS:
    """PEM files: the CA that signed the sidecar's certificate; a client certificate and key for
    mutual TLS; ``server_name`` when the certificate does not name the address (a unix socket)."""

    ca: str
    cert: str | None = None
    key: str | None = None
    server_name: str | None = None


def open_channel(address: str, tls: ClientTLS | None = None) -> grpc.Channel:
    """A channel to the sidecar at ``unix:///path`` or ``HOST:PORT``; never through a proxy when
    the sidecar is on this host (rlctl/online/addresses.py)."""
    options = channel_options(address)
    if tls is None:
        return grpc.insecure_channel(address, options=options)
    read = lambda p: Path(p).read_bytes() if p else None  # noqa: E731
    creds = grpc.ssl_channel_credentials(read(tls.ca), read(tls.key), read(tls.cert))
    if tls.server_name:
        options.append(("grpc.ssl_target_name_override", tls.server_name))
    return grpc.secure_channel(address, creds, options=options)


def wait_serving(address: str, timeout_s: float = 60.0, tls: ClientTLS | None = None,
                 alive: Callable[[], bool] = lambda: True) -> None:
    """Wait until the sidecar at ``address`` reports SERVING on the health service; ``TimeoutError``
    after ``timeout_s``, ``RuntimeError`` as soon as ``alive()`` says the sidecar is gone."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    deadline = time.monotonic() + timeout_s
    with open_channel(address, tls) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        while time.monotonic() < deadline:
            if not alive():
                raise RuntimeError(f"the sidecar at {address} exited before serving")
            try:
                if stub.Check(health_pb2.HealthCheckRequest(), timeout=1).status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.05)
    raise TimeoutError(f"the sidecar at {address} is not SERVING after {timeout_s:g} s")


def check_decision(d: pb.Decision, seq: int) -> str | None:
    """What is wrong with decision ``d`` for the snapshot numbered ``seq``, or None."""
    if d.seq != seq:
        return f"decision for snapshot {d.seq}, expected {seq}"
    if not 0 <= d.action < len(ACTIONS):
        return f"unknown action id {d.action} (known: 0..{len(ACTIONS) - 1}, {', '.join(ACTIONS)})"
    if d.action_name != ACTIONS[d.action]:
        return f"action {d.action} is {ACTIONS[d.action]!r}, the decision names it {d.action_name!r}"
    if not d.overcommit > 0:  # NaN fails too; inf (no reservation) is a factor, as a snapshot carries it
        return f"overcommit factor {d.overcommit} is not a factor > 0 (inf: no reservation)"
    if not 0 <= d.admit_headroom <= MAX_HEADROOM:
        return (f"admission headroom {d.admit_headroom} is not a share in [0, {MAX_HEADROOM:g}] (the most the "
                "safety shield asks: past it the KV would be kept half empty)")
    return None


class LiveController:
    """Asks the sidecar at ``address`` for each decision and applies it to an engine; see the module docstring."""

    def __init__(self, address: str, deadline_s: float = 0.2, safe_factor: float = 1.0, backoff_s: float = 0.05,
                 backoff_max_s: float = 2.0, evict_free_share: float = 0.2, engine_id: str | None = None,
                 tls: ClientTLS | None = None, metrics: EngineMetrics | None = None, mps: MPSLimit | None = None,
                 mps_device: int | str = 0) -> None:
        if not deadline_s > 0:
            raise ValueError(f"deadline must be > 0 s, got {deadline_s}")
        if not (math.isfinite(safe_factor) and safe_factor > 0):
            raise ValueError(f"the safe factor must be a finite factor > 0, got {safe_factor}")
        if not 0 < backoff_s <= backoff_max_s:
            raise ValueError(f"backoff must satisfy 0 < backoff_s <= backoff_max_s, got {backoff_s}, {backoff_max_s}")
        self.address, self.deadline_s, self.safe_factor = address, deadline_s, safe_factor
        self.backoff_s, self.backoff_max_s, self.evict_free_share = backoff_s, backoff_max_s, evict_free_share
        # an id of its own unless given: a stateful policy's sidecar keeps one state an engine id
        self.engine_id, self.tls = engine_id or f"rlctl-replay-{secrets.token_hex(4)}", tls
        self.decisions, self.reconnects, self.shield_overrides = 0, 0, 0
        self.fallbacks = dict.fromkeys(FALLBACK_REASONS, 0)
        self.actions = dict.fromkeys(ACTIONS, 0)
        self.policies: list[str] = []  # policy hashes seen, in order
        self.last_fault: str | None = None
        self.metrics, self.mps, self.mps_device = metrics, mps, mps_device
        # the last report of each actuator, and how many of its reports changed something
        self.actuators: dict[str, ActuatorReport] = {
            MPSLimit.name: ActuatorReport(MPSLimit.name, False, "not asked (rlctl replay --mps-next-limit)")}
        self.actuator_changes = dict.fromkeys(ACTUATORS, 0)
        self._engine: Engine | None = None
        self._quota: EngineQuota | None = None
        self._seq = 0
        self._fault: str | None = None  # the reason of the fault being backed off from
        self._retry_at = 0.0
        self._backoff = backoff_s
        self._channel: grpc.Channel | None = None
        self._connect()

    def _connect(self) -> None:
        if self._channel is not None:
            self._channel.close()
        self._channel = open_channel(self.address, self.tls)
        self._stub = pb_grpc.ControllerStub(self._channel)

    def close(self) -> None:
        if self._channel is not None:
            self._channel.close()
            self._channel = None

    def _attach(self, engine: Engine) -> None:
        """A new engine: its quota actuator, and the limits that depend only on its shape, set once."""
        self._engine, self._quota = engine, EngineQuota(engine)
        self._record(TorchMemoryFraction(device=str(engine.torch_device)).apply_for(engine), changed=None)
        if self.mps is not None:
            self._record(self.mps.apply_for(engine, self.mps_device), changed=None)

    def _record(self, report: ActuatorReport, changed: bool | None) -> None:
        """Keep ``report`` as its actuator's last; count it if it changed something (``changed``
        None: if it was applied)."""
        self.actuators[report.name] = report
        if report.applied if changed is None else changed:
            self.actuator_changes[report.name] += 1

    def step(self, engine: Engine, until: float) -> pb.Decision | None:
        """One decision interval steered by the sidecar: a decision on the engine's last snapshot
        (the sidecar's, or the safe policy's after a fault: None), then ``run_interval`` to
        ``until``, the same loop the environment runs."""
        if engine is not self._engine:
            self._attach(engine)
        snap = engine.last_snapshot or engine.snapshot()
        before = engine.overcommit, engine.admit_headroom
        d = self._decide(engine, snap)
        action = HOLD if d is None else d.action
        run_interval(engine, action, until, evict_free_share=self.evict_free_share)
        label = f"decision {self._seq}: {d.action_name} from {d.overcommit:g}" if d else f"fallback {self._seq}: {self._fault}"
        report = self._quota.report()
        self._record(dataclasses.replace(report, detail=f"{report.detail} ({label})"),
                     changed=(engine.overcommit, engine.admit_headroom) != before)
        if self.metrics is not None:
            self.metrics.update(engine)
        return d

    def _ask(self, target, rpc: str, message: Callable[[int], object], check: Callable[[object, int], str | None]):
        """The next decision through ``rpc`` on ``message(seq)``, checked by ``check(decision, seq)``;
        None after a fault (or while backing off from one), ``target`` then falling back."""
        self._seq += 1
        if self._fault is not None:
            if time.monotonic() < self._retry_at:
                return self._fall_back(target, self._fault)
            try:
                self._connect()
            except Exception as exc:  # noqa: BLE001 - whatever it is, the engine serves on under the safe policy
                return self._faulted(target, "error", f"reconnecting: {type(exc).__name__}: {exc}")
            self.reconnects += 1
        try:
            d = getattr(self._stub, rpc)(message(self._seq), timeout=self.deadline_s)
            problem = check(d, self._seq)
        except grpc.RpcError as exc:
            code = exc.code()
            return self._faulted(target, _REASON.get(code, "error"), f"{code.name}: {exc.details()}")
        except Exception as exc:  # noqa: BLE001 - the same
            return self._faulted(target, "error", f"{type(exc).__name__}: {exc}")
        if problem:
            return self._faulted(target, "invalid", problem)
        self._fault, self._backoff = None, self.backoff_s
        return d

    def _decide(self, engine: Engine, snap) -> pb.Decision | None:
        d = self._ask(engine, "Decide", lambda seq: snapshot_message(snap, engine.max_model_len, self.engine_id, seq),
                      check_decision)
        if d is None:
            return None
        if d.overcommit != snap.overcommit:  # a policy that pins its factor (check_decision: > 0, inf allowed)
            self._quota.apply(d.overcommit)
        if d.admit_headroom != engine.admit_headroom:  # the shield's (check_decision: in [0, MAX_HEADROOM])
            self._quota.apply_headroom(d.admit_headroom)
        self._tally(d, d.action_name)
        return d

    def _tally(self, d, action: str | None) -> None:
        """Count a decision that passed its check: ``action`` (one of ``ACTIONS``; None: none of
        them), its shield override, the policy that made it."""
        self.decisions += 1
        if action is not None:
            self.actions[action] += 1
        self.shield_overrides += d.shield_override
        if not self.policies or self.policies[-1] != d.policy_hash:
            self.policies.append(d.policy_hash)

    def _faulted(self, target, reason: str, detail: str) -> None:
        self.last_fault = f"{reason}: {detail}"
        self._fault = reason
        self._retry_at = time.monotonic() + self._backoff
        self._backoff = min(2 * self._backoff, self.backoff_max_s)
        return self._fall_back(target, reason)

    def _fall_back(self, target, reason: str) -> None:
        self.fallbacks[reason] += 1
        if self.metrics is not None:
            self.metrics.fallback(reason)
        self._safe_policy(target)
        return None

    def _safe_policy(self, engine: Engine) -> None:
        """The safe static policy, which never admits more than the decisions it stands in for: the safe
        factor, or the factor in force where that is lower, the admission headroom in force kept, hold."""
        if engine.overcommit > self.safe_factor:
            self._quota.apply(self.safe_factor)

    def report(self) -> dict:
        return {"controller": self.address, "controller_decisions": self.decisions,
                "fallbacks": sum(self.fallbacks.values()), "fallbacks_by_reason": dict(self.fallbacks),
                **{f"fallbacks_{r}": n for r, n in self.fallbacks.items()},
                "reconnects": self.reconnects, "shield_overrides": self.shield_overrides,
                "actions": dict(self.actions), "policy_hashes": list(self.policies), "last_fault": self.last_fault,
                "deadline_ms": 1000 * self.deadline_s, "safe_factor": self.safe_factor,
                "actuators": {n: self.actuators[n].to_dict() for n in ACTUATORS if n in self.actuators},
                "actuator_changes": dict(self.actuator_changes)}


def replay_live(requests: list[Request], engine: Engine, controller: LiveController,
                decision_interval_s: float = 2.0) -> dict:
    """Run every request to completion with ``controller`` deciding every ``decision_interval_s``
    of engine time (first at time 0, as the environment does); the replay's figures and the controller's."""
    if not decision_interval_s > 0:
        raise ValueError(f"decision interval must be > 0 s, got {decision_interval_s}")
    for r in requests:
        engine.submit(r)
    k = 0
    while engine.has_work():
        k += 1
        controller.step(engine, k * decision_interval_s)
    return {**summarize(engine), **controller.report(), "decision_interval_s": decision_interval_s}


@contextlib.contextmanager
def _terminate_by_exception():
    """SIGTERM and SIGHUP end the replay as Ctrl-C does, by an exception (``SystemExit`` with the
    shell's status, 128 + the signal), so that ``steer``'s clean-up runs: the MPS default, which
    outlives this process, is put back. Python's default for both ends the process on the spot.
    Only the first such signal raises, so that a second one cannot cut the clean-up short; a signal
    this process ignores (SIGHUP under ``nohup``) stays ignored."""
    if threading.current_thread() is not threading.main_thread():  # only the main thread may set handlers
        yield
        return
    raised = []

    def end(signum, _frame):
        if not raised:
            raised.append(signum)
            raise SystemExit(128 + signum)

    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGHUP)}
    for sig, handler in previous.items():
        if handler is not signal.SIG_IGN:
            signal.signal(sig, end)
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def steer(requests: list[Request], engine: Engine, address: str, decision_interval_s: float, deadline_s: float,
          safe_factor: float, tls: ClientTLS | None = None, metrics_port: int | None = None,
          model_name: str = "rlctl", mps_device: str | None = None, say: Callable[[str], None] = print,
          metrics_addr: str = "127.0.0.1") -> dict:
    """``replay_live`` with everything around it: the engine's metrics served on ``metrics_addr``
    (``metrics_port``, 0: any free port) while it runs, the MPS limit for the next engine process on
    ``mps_device`` when given, the channel and the metrics server closed at the end."""
    metrics = server = None
    if metrics_port is not None:
        metrics = EngineMetrics(model_name=model_name, max_model_len=engine.max_model_len)
        try:
            server, _ = metrics.start_http(metrics_port, metrics_addr)
        except OSError as exc:
            raise ValueError(f"--metrics-port {metrics_port}: cannot serve on {metrics_addr} "
                             f"({exc.strerror or exc})") from None
        say(f"metrics: http://{url_host(metrics_addr)}:{server.server_port}/metrics while the replay runs")
    mps = MPSLimit() if mps_device is not None else None
    if mps is not None:
        say(f"mps: --mps-next-limit sets the MPS control daemon's default pinned-memory limit on device {mps_device}, "
            "daemon-wide: every MPS server started on this host from now on takes it, not only the next "
            "engine's (a process joining its user's running server takes that server's limit instead); the default "
            "it replaces is restored as the daemon shows it when the replay ends (not after a SIGKILL); where none "
            "is set, none is set now")
    controller = LiveController(address, deadline_s, safe_factor, tls=tls, metrics=metrics, mps=mps,
                                mps_device=mps_device or 0)
    restored: list = []
    with _terminate_by_exception():  # held through the clean-up too: a second signal cannot cut it short
        try:
            figures = replay_live(requests, engine, controller, decision_interval_s)
        finally:
            controller.close()
            if server is not None:
                server.shutdown()
                server.server_close()
            if mps is not None:  # on an error too: the daemon outlives this process
                restored = mps.restore()
                for report in restored:
                    say(f"mps: {report.detail}")
    return {**figures, **({"metrics_port": server.server_port} if server is not None else {}),
            **({"mps_restored": [r.to_dict() for r in restored]} if mps is not None else {})}
