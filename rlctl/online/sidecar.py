"""``rlctl serve``: a policy behind the controller's gRPC service, next to a live engine (docs/design.md, "Online").

Each decision: check the snapshot (rlctl/online/messages.py; a bad one is INVALID_ARGUMENT naming the
field), build the observation the policy was trained on (a policy file's own scales; for a
baseline the default scales), act,
run the safety shield on the snapshot (agents/shield.py, overrides counted), answer a
``Decision``. Also served: the standard health service (SERVING once the policy is loaded,
NOT_SERVING while shutting down) and server reflection. Listens on a unix socket or a loopback
address (server-only TLS allowed there); any other address only with mutual TLS. It binds every
address it names or none (``localhost`` is both loopbacks), and never takes a unix socket another
process listens on, nor replaces a file there that is not a socket. Prometheus
metrics, on their own registry, on ``--metrics-port`` (loopback).

The server is ``grpc.aio``, and a long-lived ``Live`` stream holds no thread. (A sync server would
hold one pool thread per open stream, so a few engines' streams could starve ``Decide``.) A
decision known to be cheap (a baseline, or a policy file's network small enough for the numpy
forward: ``ServedPolicy.inline``, tens of microseconds) runs on the event loop: the hop to a
thread and back costs more than the decision (~45 us at the median, milliseconds at the tail on
a loaded machine). Any other decision, and every one under an injected delay, runs in a small
thread pool, so health checks, reflection, ``GetPolicy`` and ``ReloadPolicy`` answer while it
computes; one that waited for a thread past its deadline is not computed at all.

``ReloadPolicy`` takes a policy name inside ``--policy-dir`` and nothing else, baseline specs only
with ``--allow-baselines`` (rlctl/online/confine.py: what a client may ask for, and the status of
each refusal). It loads and checks the new policy completely (the file loader's checks, then one
trial decision) off the event loop, then swaps one reference under a lock: a decision uses the
old policy or the new one, never half of each, and a failed reload leaves the old one serving.

``Fault`` injects faults for tests of the live loop (a delay before each decision, a fixed
action id on the wire); ``rlctl serve`` exposes it only through hidden ``--fault-*`` options.
"""
from __future__ import annotations

import asyncio
import ipaddress
import math
import re
import signal
import socket
import sys
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    Info,
    start_http_server,
)

from agents.shield import Shield
from engine.control import ACTIONS
from engine.node_control import action_names
from rlctl.online.addresses import check_metrics_addr, is_loopback_host, url_host
from rlctl.online.confine import BaselineRefused, Confinement, NoSuchPolicy, ReloadOff
from rlctl.online.messages import SnapshotError, snapshot_from_message
from rlctl.online.node_messages import node_state_from_message
from rlctl.online.proto import SERVICE_NAME
from rlctl.online.proto import controller_pb2 as pb
from rlctl.online.proto import controller_pb2_grpc as pb_grpc
from rlctl.online.served import (
    MAX_ENGINES,
    NodeMismatch,
    PolicyError,
    ServedNodePolicy,
    ServedPolicy,
    load_served_policy,
    reload_served_policy,
)

DECIDE_THREADS = 4
UNIX_PATH_MAX = 107  # sockaddr_un's sun_path, less its terminating NUL (Linux)
# torch intra-op threads in the sidecar, for a network too big for the numpy forward
# (agents/export.py): a decision is one matrix-vector product, and a parallel pool only adds
# wake-ups and competes with the engine for the cores (on this project's 2-core machine under
# load, 2 threads made a decision ~40x slower at the median than 1)
TORCH_THREADS = 1
LATENCY_BUCKETS = (5e-5, 1e-4, 2e-4, 5e-4, 1e-3, 2e-3, 5e-3, 1e-2, 2e-2, 5e-2, 0.1, 0.2, 0.5, 1.0, 2.0)


# a refused reload's status; any other failure (a file in the directory that is not a servable policy)
# is INVALID_ARGUMENT
_RELOAD_REFUSALS = ((ReloadOff, grpc.StatusCode.FAILED_PRECONDITION),
                    (BaselineRefused, grpc.StatusCode.PERMISSION_DENIED),
                    (NoSuchPolicy, grpc.StatusCode.NOT_FOUND))


class _Late(Exception):
    """The caller's deadline passed while the decision waited for a thread: nobody is listening."""


@dataclass(frozen=True)
class Fault:
    """Fault injection, for tests only: sleep ``delay_s`` before each decision (in the decision
    thread, as a slow policy would), and put ``action`` on the wire instead of the decided one."""

    delay_s: float = 0.0
    action: int | None = None


@dataclass(frozen=True)
class TLSFiles:
    """PEM files: the server's certificate chain and key; with ``client_ca``, clients must present
    a certificate it signed (mutual TLS)."""

    cert: str
    key: str
    client_ca: str | None = None


# ---- metrics -----------------------------------------------------------------------------------
class SidecarMetrics:
    """The sidecar's Prometheus metrics, on a registry of their own."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.decisions = Counter("rlctl_sidecar_decisions", "Decisions answered, by action (after the shield)",
                                 ["action"], registry=r)
        self.latency = Histogram("rlctl_sidecar_decision_latency_seconds",
                                 "Time from a snapshot's arrival to its decision (check, observe, act, shield)",
                                 buckets=LATENCY_BUCKETS, registry=r)
        self.shield_overrides = Counter("rlctl_sidecar_shield_overrides",
                                        "Decisions the safety shield changed (the action, or a pinned factor held back)",
                                        registry=r)
        self.invalid = Counter("rlctl_sidecar_invalid_requests", "Snapshots refused (INVALID_ARGUMENT), by field",
                               ["field"], registry=r)
        self.errors = Counter("rlctl_sidecar_decision_errors", "Decisions the policy failed to make (INTERNAL)",
                              registry=r)
        self.reloads = Counter("rlctl_sidecar_reloads", "ReloadPolicy requests, by result", ["result"], registry=r)
        self.interval_mismatches = Counter(
            "rlctl_sidecar_interval_mismatches", "Snapshots that came more than twice as far from the one before, "
            "or less than half as far, as --decision-interval says (the headroom covers that interval's growth)",
            registry=r)
        self.policy = Info("rlctl_sidecar_policy", "The policy being served", registry=r)
        # each action's counter child, looked up once rather than by label on every decision
        self.decided = [self.decisions.labels(action=a) for a in ACTIONS]
        for result in ("ok", "failed"):
            self.reloads.labels(result=result)

    def serving(self, served: ServedPolicy) -> None:
        self.policy.info({"spec": served.spec, "name": served.policy.name, "kind": served.kind,
                          "policy_hash": served.policy_hash})


# ---- the service -------------------------------------------------------------------------------
class ControllerService(pb_grpc.ControllerServicer):
    def __init__(self, served: ServedPolicy, metrics: SidecarMetrics, pool: ThreadPoolExecutor,
                 confinement: Confinement, fault: Fault | None = None, shield: Shield = Shield()) -> None:
        self._served, self.metrics, self.pool, self.fault = served, metrics, pool, fault or Fault()
        # reloads load and check a file off the event loop one at a time, on a thread of their own: however
        # many are asked at once, they queue there and never take a decision's thread
        self.reloader = ThreadPoolExecutor(1, "reload")
        self.confinement, self.shield = confinement, shield  # a reloaded policy is served behind the same shield
        self._lock = threading.Lock()
        metrics.serving(served)
        self._asked: OrderedDict[str, tuple[int, float]] = OrderedDict()  # engine id -> its last (seq, time_s)
        self.warn: Callable[[str], None] = lambda line: print(line, file=sys.stderr, flush=True)
        self._warned = False

    def current(self) -> ServedPolicy:
        with self._lock:
            return self._served

    @property
    def node(self) -> bool:
        """Whether this sidecar serves a node policy (``DecideNode``) rather than one engine's (``Decide``)."""
        return isinstance(self._served, ServedNodePolicy)

    def _compute(self, served: ServedPolicy, state, expires: float | None, engine_id: str = "",
                 seq: int = 0) -> tuple[int, int]:
        if expires is not None and time.monotonic() > expires:  # so a backlog of late work cannot snowball
            raise _Late()
        if self.fault.delay_s:
            time.sleep(self.fault.delay_s)
        return served.decide(state, engine_id, seq)

    async def _decide(self, msg: pb.Snapshot, context) -> pb.Decision:
        t0 = time.perf_counter()
        if self.node:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"this sidecar serves node policy "
                                f"{self.current().spec} (rlctl serve --node): ask it with DecideNode")
        try:
            snapshot, _ = snapshot_from_message(msg)
        except SnapshotError as exc:
            self.metrics.invalid.labels(field=exc.field).inc()
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        served = self.current()
        if served.reads_waiting_late and not msg.HasField("waiting_late"):
            self.metrics.invalid.labels(field="waiting_late").inc()
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"snapshot.waiting_late is not set: policy "
                                f"{served.spec} reads it (the requests waiting for their first token past the "
                                "engine's TTFT target); send it, 0 when none waits late")
        self._check_interval(msg.engine_id, msg.seq, snapshot.time_s)
        chosen, action = await self._act(served, snapshot, context, msg.engine_id, msg.seq)
        if self.fault.action is not None:
            action = self.fault.action
        known = 0 <= action < len(ACTIONS)
        name = ACTIONS[action] if known else f"unknown:{action}"
        factor = served.expected_overcommit(snapshot)  # a pinned factor the shield holds back counts as an override
        overridden = (action != chosen or factor != (served.pinned_overcommit or factor)) and self.fault.action is None
        (self.metrics.decided[action] if known else self.metrics.decisions.labels(action=name)).inc()
        if overridden:
            self.metrics.shield_overrides.inc()
        self.metrics.latency.observe(time.perf_counter() - t0)
        return pb.Decision(seq=msg.seq, action=action, action_name=name,
                           overcommit=factor, shield_override=overridden,
                           policy_action=chosen, policy_hash=served.policy_hash,
                           admit_headroom=served.shield.headroom(snapshot))

    def _check_interval(self, engine_id: str, seq: int, time_s: float) -> None:
        """Count, and say once, snapshots an engine sends at an interval other than the one the
        shield's admission headroom covers (``--decision-interval``): behind an engine asking every 10 s, a
        sidecar left at 2 s would cover a fifth of the batch's growth, and nothing else would tell."""
        interval = self.shield.growth_interval_s
        last = self._asked.pop(engine_id, None)
        self._asked[engine_id] = (seq, time_s)
        if len(self._asked) > MAX_ENGINES:
            self._asked.popitem(last=False)
        if interval <= 0 or last is None or seq != last[0] + 1 or time_s <= last[1]:
            return
        gap = time_s - last[1]
        if not 0.5 <= gap / interval <= 2.0:
            self.metrics.interval_mismatches.inc()
            if not self._warned:  # once: the metric counts the rest
                self._warned = True
                self.warn(f"engine {engine_id or '(no id)'} asks every {gap:g} s of engine time; this sidecar's "
                          f"--decision-interval is {interval:g} s, the interval its admission headroom covers: "
                          "serve with the engine's interval (rlctl_sidecar_interval_mismatches counts such snapshots)")

    async def DecideNode(self, request, context):
        """One decision for a node of engines; see the protocol."""
        t0 = time.perf_counter()
        if not self.node:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"this sidecar serves one engine's policy "
                                f"{self.current().spec}: ask it with Decide (a node policy is served with --node)")
        try:
            state = node_state_from_message(request)
        except SnapshotError as exc:  # counted by the field, not by which engine: labels stay few
            self.metrics.invalid.labels(field=re.sub(r"\[\d+\]", "[]", exc.field)).inc()
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        served = self.current()
        chosen, action = await self._act(served, state, context)
        names = action_names(state.names)
        if self.fault.action is not None:
            action = self.fault.action
        name = names[action] if 0 <= action < len(names) else f"unknown:{action}"
        engine, _, what = name.partition(":") if 0 < action < len(names) else ("", "", "")
        overridden = action != chosen and self.fault.action is None
        # counted by what it does (hold, an engine action, unknown), not by engine: the engines' names come
        # from the client, and a label per name would grow the metrics without bound
        self.metrics.decisions.labels(action=f"node:{what}" if what else name.partition(":")[0]).inc()
        if overridden:
            self.metrics.shield_overrides.inc()
        self.metrics.latency.observe(time.perf_counter() - t0)
        return pb.NodeDecision(seq=request.seq, action=action, action_name=name, engine_id=engine, engine_action=what,
                               shield_override=overridden, policy_action=chosen, policy_hash=served.policy_hash)

    async def _act(self, served: ServedPolicy, state, context, engine_id: str = "", seq: int = 0) -> tuple[int, int]:
        """(the policy's action, the action after the shield) on a checked snapshot or node state
        (the ``seq``-th from ``engine_id``, whose state a stateful policy keeps): on the event loop
        when cheap, else in the pool within the caller's deadline."""
        try:
            if served.inline and not self.fault.delay_s:
                chosen, action = served.decide(state, engine_id, seq)
            else:
                remaining = context.time_remaining()
                expires = time.monotonic() + remaining if remaining is not None else None
                chosen, action = await asyncio.get_running_loop().run_in_executor(
                    self.pool, self._compute, served, state, expires, engine_id, seq)
        except NodeMismatch as exc:
            self.metrics.invalid.labels(field="engines").inc()
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except PolicyError as exc:
            self.metrics.errors.inc()
            await context.abort(grpc.StatusCode.INTERNAL, str(exc))
        except _Late:
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "the deadline passed before a thread was free")
        return chosen, action

    async def Decide(self, request, context):
        return await self._decide(request, context)

    async def Live(self, request_iterator, context):
        async for msg in request_iterator:
            yield await self._decide(msg, context)

    async def GetPolicy(self, request, context):
        return self.current().info()

    async def ReloadPolicy(self, request, context):
        try:
            new = await asyncio.get_running_loop().run_in_executor(self.reloader, reload_served_policy,
                                                                   request.policy, self.confinement, self.node,
                                                                   self.shield)
        except Exception as exc:  # whatever the cause, the old policy keeps serving and the caller learns why
            self.metrics.reloads.labels(result="failed").inc()
            code = next((c for kind, c in _RELOAD_REFUSALS if isinstance(exc, kind)), grpc.StatusCode.INVALID_ARGUMENT)
            await context.abort(code, f"reload refused, still serving {self.current().spec}: {exc}")
        with self._lock:
            old, self._served = self._served, new
        self.metrics.reloads.labels(result="ok").inc()
        self.metrics.serving(new)
        return pb.ReloadPolicyResponse(previous=old.info(), current=new.info())


# ---- listening ---------------------------------------------------------------------------------
def check_listen(listen: str, tls: TLSFiles | None) -> None:
    """Refuse an address that is neither a unix socket nor loopback TCP, unless with mutual TLS."""
    if listen.startswith("unix:"):
        if not listen[len("unix:"):].lstrip("/"):
            raise ValueError(f"--listen {listen}: a unix socket needs a path, e.g. unix:///tmp/rlctl.sock")
        path = unix_path(listen)  # what gRPC's bind would only report as "Failed to bind"
        if not path.parent.is_dir():
            raise ValueError(f"--listen {listen}: directory {path.parent} does not exist")
        if len(str(path).encode()) > UNIX_PATH_MAX:
            raise ValueError(f"--listen {listen}: the socket's path is {len(str(path).encode())} bytes; a unix "
                             f"socket's holds at most {UNIX_PATH_MAX}")
        return
    host, sep, port = listen.rpartition(":")
    if not sep or not port.isdigit() or int(port) > 65535 or not host:
        raise ValueError(f"--listen {listen}: expected unix:///path or HOST:PORT, e.g. 127.0.0.1:50051")
    if not is_loopback_host(host) and (tls is None or tls.client_ca is None):
        # server-only TLS would let any host that reaches the port steer the engine: clients must prove who they are
        raise ValueError(f"--listen {listen}: {host} is not a loopback address; the sidecar steers an engine's "
                         f"memory, so it listens beyond this host only with mutual TLS (--tls-cert, --tls-key "
                         f"and --tls-client-ca)")


def _credentials(tls: TLSFiles) -> grpc.ServerCredentials:
    read = lambda p: Path(p).read_bytes()  # noqa: E731
    return grpc.ssl_server_credentials([(read(tls.key), read(tls.cert))],
                                       root_certificates=read(tls.client_ca) if tls.client_ca else None,
                                       require_client_auth=tls.client_ca is not None)


def unix_path(listen: str) -> Path:
    """The socket file of ``unix:///abs/path`` or ``unix:rel/path``, as gRPC reads them."""
    rest = listen[len("unix:"):]
    return Path(rest[2:] if rest.startswith("//") else rest)


def _refuse_taken_socket(listen: str) -> None:
    """gRPC replaces whatever file is at a unix socket's path before it binds: a second sidecar
    would take the first one's engines from it without a word, and a regular file there would be
    lost. Refuse both; a socket nothing answers on (a sidecar that died) may be replaced."""
    path = unix_path(listen)
    if not path.exists() and not path.is_symlink():
        return
    if not path.is_socket():
        raise ValueError(f"--listen {listen}: {path} exists and is not a socket; refusing to replace it")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(1.0)
        try:
            probe.connect(str(path))
        except OSError:
            return  # stale: nothing listens there
    raise ValueError(f"--listen {listen}: another process is listening on {path}; stop it or choose another path")


def _bindable(address: str, port: int = 0) -> int | None:
    """The port a plain socket binds on ``address`` (``port``, or any for 0) as gRPC binds, with
    SO_REUSEADDR, so that only a listener refuses it; None where it cannot (the port taken there,
    or an address this host cannot bind, as ``localhost``'s ::1 where IPv6 is off)."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((address, port))
        except OSError:
            return None
        return probe.getsockname()[1]


def _free_on_all(listen: str, addresses: list[str], port: int) -> int:
    """``port`` (for 0: one free on the first address) if no socket listens on it at any of
    ``addresses``; else ``ValueError`` naming where it is taken."""
    for address in addresses:
        got = _bindable(address, port)
        if got is None:
            shown = f"[{address}]" if ":" in address else address
            raise ValueError(f"--listen {listen}: cannot listen on {shown}:{port} (the port is taken there)")
        port = port or got
    return port


def _bind(server, listen: str, tls: TLSFiles | None) -> str:
    """Bind ``listen`` on every address it names, or on none: a host name is resolved here and each
    of its addresses bound on one port, so that a port taken on one of them (``localhost`` is both
    127.0.0.1 and ::1) fails the start instead of splitting the engines between two sidecars.
    Returns the address bound, with the port chosen for port 0."""
    add = (lambda a: server.add_secure_port(a, _credentials(tls))) if tls else server.add_insecure_port
    if listen.startswith("unix:"):
        _refuse_taken_socket(listen)
        targets = [listen]
    else:
        host, _, port = listen.rpartition(":")
        bare = host[1:-1] if host.startswith("[") and host.endswith("]") else host
        try:
            ipaddress.ip_address(bare)
            addresses = [bare]
        except ValueError:  # a name: every address it resolves to (gRPC's clients take localhost as both loopbacks)
            try:
                infos = socket.getaddrinfo(bare, int(port), type=socket.SOCK_STREAM)
            except OSError as exc:
                raise ValueError(f"--listen {listen}: cannot resolve {bare} ({exc})") from None
            named = [info[4][0] for info in infos] + (["127.0.0.1", "::1"] if bare == "localhost" else [])
            addresses = [a for a in dict.fromkeys(named) if _bindable(a) is not None]
            if not addresses:
                raise ValueError(f"--listen {listen}: none of the addresses {bare} resolves to is this host's")
        if len(addresses) > 1:  # look before binding any: gRPC lets go of a bound port only once started
            port = _free_on_all(listen, addresses, int(port))
        targets = [f"[{a}]" if ":" in a else a for a in addresses]
    chosen = None
    for target in targets:
        address = target if target.startswith("unix:") else f"{target}:{chosen if chosen is not None else port}"
        try:
            got = add(address)
        except (RuntimeError, OSError) as exc:
            raise ValueError(f"--listen {listen}: cannot listen on {address} ({exc})") from None
        if not target.startswith("unix:"):
            if not got:
                raise ValueError(f"--listen {listen}: cannot listen on {address} (the port is taken or the "
                                 "address is not this host's)")
            chosen = got
    return listen if listen.startswith("unix:") else f"{listen.rpartition(':')[0]}:{chosen}"


async def start_server(served: ServedPolicy, listen: str, confinement: Confinement, tls: TLSFiles | None = None,
                       fault: Fault | None = None, metrics: SidecarMetrics | None = None, shield: Shield = Shield()):
    """Start the server; (server, health servicer, controller service, bound address)."""
    check_listen(listen, tls)
    metrics = metrics or SidecarMetrics()
    # no SO_REUSEPORT: a second sidecar on a taken port must fail, not share the port's traffic
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    service = ControllerService(served, metrics, ThreadPoolExecutor(DECIDE_THREADS, "decide"), confinement, fault,
                                shield)
    pb_grpc.add_ControllerServicer_to_server(service, server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection((SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    bound = _bind(server, listen, tls)
    await server.start()
    for name in ("", SERVICE_NAME):  # the policy is loaded: ready
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    return server, health_servicer, service, bound


def serve(policy_spec: str, listen: str, metrics_port: int | None = None, tls: TLSFiles | None = None,
          fault: Fault | None = None, say: Callable[[str], None] = print, *, confinement: Confinement,
          metrics_addr: str = "127.0.0.1", metrics_public: bool = False, node: bool = False,
          decision_interval_s: float = 2.0) -> None:
    """Load the policy, then serve it on ``listen`` until SIGINT or SIGTERM, and its metrics on
    ``metrics_addr:metrics_port`` (loopback unless ``metrics_public``). A policy that cannot serve,
    or an address that cannot be used, raises ``ValueError`` before anything listens.
    ``confinement`` (rlctl/online/confine.py) says what may be served and reloaded;
    ``decision_interval_s`` is how often the engine asks, which the shield's admission headroom
    covers the running batch's growth over (agents/shield.py)."""
    import torch

    check_listen(listen, tls)
    check_metrics_addr(metrics_addr, metrics_public)
    torch.set_num_threads(TORCH_THREADS)
    if not (math.isfinite(decision_interval_s) and decision_interval_s > 0):
        raise ValueError(f"--decision-interval must be > 0 s, got {decision_interval_s}")
    shield = Shield(growth_interval_s=decision_interval_s)
    served = load_served_policy(policy_spec, confinement, node, shield)
    asyncio.run(_serve(served, listen, confinement, metrics_port, metrics_addr, tls, fault, say, shield))


async def _serve(served, listen, confinement, metrics_port, metrics_addr, tls, fault, say, shield) -> None:
    metrics = SidecarMetrics()
    http = None
    if metrics_port is not None:
        try:
            http, _ = start_http_server(metrics_port, addr=metrics_addr, registry=metrics.registry)
        except OSError as exc:
            raise ValueError(f"--metrics-port {metrics_port}: cannot serve on {metrics_addr} "
                             f"({exc.strerror or exc})") from None
    server, health_servicer, service, bound = await start_server(served, listen, confinement, tls, fault, metrics,
                                                                  shield)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):  # a closed terminal stops it as cleanly,
        if signal.getsignal(sig) is not signal.SIG_IGN:  # but a SIGHUP ignored (under nohup) stays ignored
            loop.add_signal_handler(sig, stop.set)
    say(f"serving {'node policy ' if service.node else ''}{served.spec} ({served.kind}, {served.policy_hash[:12]}) on {bound}"
        f"{' with mutual TLS' if tls and tls.client_ca else ' with TLS' if tls else ''}; health SERVING"
        + (f"; metrics on http://{url_host(metrics_addr)}:{http.server_port}/metrics" if http else "")
        + (f"; ReloadPolicy from {confinement.policy_dir}" if confinement.policy_dir else "; ReloadPolicy off")
        + ("; baseline specs allowed" if confinement.allow_baselines else ""))
    await stop.wait()
    say("shutting down: health NOT_SERVING")
    await health_servicer.enter_graceful_shutdown()
    await server.stop(grace=1.0)
    service.pool.shutdown(wait=False, cancel_futures=True)
    service.reloader.shutdown(wait=False, cancel_futures=True)
    if http is not None:
        http.shutdown()
