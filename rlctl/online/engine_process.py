"""One engine of a node in its own process: an MPS client that reads its memory limit from its
environment, as MPS does, and is driven by its node (rlctl/online/process_node.py) over a pipe.

    CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=30517M python -m rlctl.online.engine_process \\
        --scenario node_chat_pair --tenant a --config '{...}' --ledger /tmp/node/device

The process sizes its engine's KV capacity to the limit in ``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT``
(device 0), as vLLM sizes its pool from the memory it sees, and charges every byte to the
device ledger the node's engines share (engine/shared_device.py; on a GPU, the GPU itself). It
runs the tenant's engine on the scenario's cost model, as the in-process node does. A limit
cannot change in a running client: the node stops the process (``drain``) and starts another
under the new limit, which takes over every request the first one held.

The wire: one JSON object a line on standard input, ``{"op": NAME, ...}``, each answered by one
JSON line on standard output, ``{"ok": true, ...}`` or ``{"ok": false, "error": TEXT}`` (the
process stays up after an error; nothing it held is lost). Operations:

| op | arguments | answer |
|---|---|---|
| ``hello`` | | ``pid``, ``env_limit`` (the variable as set), ``state`` |
| ``submit`` | ``requests``: requests as dicts | ``state`` |
| ``resume`` | ``held``: what another process of this engine held (``drain``'s) | ``state`` |
| ``advance`` | ``until``: engine seconds | ``finished``: records since the last answer, ``state`` |
| ``snapshot`` | | ``snapshot``, ``state`` |
| ``set_overcommit`` | ``factor`` | ``state`` |
| ``compact``, ``evict`` | ``share`` (evict) | ``blocks``, ``seconds``, ``state`` |
| ``limit_for`` | ``blocks`` | ``bytes``: the MPS limit that holds this many KV blocks |
| ``drain`` | | ``held``, ``pending`` (requests not yet arrived), ``finished``, ``counters``; then it exits |

``state`` is the engine's clock, factor, KV blocks, MPS limit, bytes held on the device, whether
it has work or is down, and its counters.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict, replace

from engine.config import EngineConfig
from engine.executor import ProfiledExecutor
from engine.node import Node
from engine.records import RequestRecord
from engine.request import Request
from engine.roofline import deployment
from engine.shared_device import SharedDevice
from env.node_scenario import load_node_scenario
from rlctl.online.mps import CLIENT_LIMIT_ENV, parse_client_limit


def request_to_dict(r: Request) -> dict:
    return asdict(r)


def request_from_dict(d: dict) -> Request:
    return Request(**{**d, "prompt_ids": None if d.get("prompt_ids") is None else tuple(d["prompt_ids"]),
                      "hash_ids": tuple(d.get("hash_ids", ()))})


def limit_from_env(environ=os.environ) -> int:
    """This client's limit on device 0, from ``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT``."""
    value = environ.get(CLIENT_LIMIT_ENV)
    if value is None:
        raise ValueError(f"{CLIENT_LIMIT_ENV} is not set: an engine process is an MPS client started with its limit")
    limits = parse_client_limit(value)
    if "0" not in limits:
        raise ValueError(f"{CLIENT_LIMIT_ENV}={value!r} sets no limit on device 0")
    return limits["0"]


class EngineProcess:
    """The engine this process runs, and the answer to each operation of the wire."""

    def __init__(self, scenario: str, tenant: str, config: dict, ledger: str, clock: float, down: bool) -> None:
        sc = load_node_scenario(scenario)
        t = next((t for t in sc.tenants if t.name == tenant), None)
        if t is None:
            raise ValueError(f"node scenario {sc.name} has no tenant {tenant!r} (tenants: {', '.join(sc.names)})")
        self.limit = limit_from_env()
        self.node = Node(SharedDevice(ledger), sc.slice_s)
        self.engine = self.node.add(t.name, deployment(t.deployment).model, EngineConfig(**config), self.limit,
                                    executor=ProfiledExecutor(sc.cost_model(t)))
        self.node.clock = self.engine.clock = float(clock)
        if down:  # a restart under a new limit: down for the engine's restart time, as Node.set_limit is
            self.engine.down_until = self.engine.clock + self.engine.config.restart_downtime_s
        self.reported = 0

    def state(self) -> dict:
        e = self.engine
        return {"clock": e.clock, "overcommit": e.overcommit, "num_blocks": e.num_blocks, "limit": e.device.capacity,
                "held_bytes": e.device.used, "has_work": e.has_work(), "down": e.down_until is not None,
                "max_model_len": e.max_model_len, "counters": asdict(e.counters)}

    def finished(self) -> list[dict]:
        done = self.engine.completed[self.reported:]
        self.reported += len(done)
        return [asdict(r) for r in done]

    def answer(self, op: str, msg: dict) -> dict:
        e = self.engine
        if op == "hello":
            return {"pid": os.getpid(), "env_limit": os.environ[CLIENT_LIMIT_ENV]}
        if op == "submit":
            for d in msg["requests"]:
                e.submit(request_from_dict(d))
        elif op == "resume":
            for h in reversed(msg["held"]):  # each goes to the front of the queue: the oldest ends first
                e.resume(request_from_dict(h["request"]), h["token_ids"], h["context_len"], h["num_generated"],
                         RequestRecord(**h["record"]))
        elif op == "advance":
            self.node.advance(float(msg["until"]))
            return {"finished": self.finished()}
        elif op == "snapshot":
            return {"snapshot": asdict(e.snapshot())}
        elif op == "set_overcommit":
            e.set_overcommit(float(msg["factor"]))
        elif op in ("compact", "evict"):
            r = e.compact() if op == "compact" else e.evict(float(msg["share"]))
            return {"blocks": r.blocks, "seconds": r.seconds}
        elif op == "limit_for":
            return {"bytes": e.plan_memory(replace(e.config, num_blocks=int(msg["blocks"]))).total}
        elif op == "drain":
            return self.drain()
        else:
            raise ValueError(f"unknown operation {op!r}")
        return {}

    def drain(self) -> dict:
        """Everything this engine holds, for the process that takes over: a graceful restart
        (``Engine.restart``: what it admitted goes back to the front of its queue, oldest first,
        with its tokens, its record counting the restart), then every queued request with its
        tokens and record, and those not yet arrived. What it still charges goes back to the device."""
        self.engine.restart()
        s, share = self.engine.scheduler, self.engine.device
        for kind, nbytes in list(share.charged.items()):  # the process ends: its memory goes back to the device
            if nbytes:
                share.release(kind, nbytes)
        held = list(s.waiting)
        return {"held": [{"request": request_to_dict(q.request), "token_ids": list(q.token_ids),
                          "context_len": q.context_len, "num_generated": q.num_generated,
                          "record": asdict(q.record)} for q in held],
                "pending": [request_to_dict(p[2].request) for p in sorted(s.pending, key=lambda p: p[:2])],
                "finished": self.finished(), "counters": asdict(self.engine.counters)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m rlctl.online.engine_process", description=__doc__.split("\n\n")[0])
    p.add_argument("--scenario", required=True)
    p.add_argument("--tenant", required=True)
    p.add_argument("--config", required=True, help="the tenant's EngineConfig as JSON")
    p.add_argument("--ledger", required=True, help="the node's shared device ledger (engine/shared_device.py)")
    p.add_argument("--clock", type=float, default=0.0, help="the node's clock: the engine starts there")
    p.add_argument("--down", action="store_true", help="a restart: down for the engine's restart time first")
    a = p.parse_args(argv)
    try:
        proc = EngineProcess(a.scenario, a.tenant, json.loads(a.config), a.ledger, a.clock, a.down)
    except (ValueError, OSError) as exc:
        print(f"engine process: {exc}", file=sys.stderr)
        return 2
    for line in sys.stdin:
        try:
            msg = json.loads(line)
            op = msg.get("op")
            out = {"ok": True, **proc.answer(op, msg)}
            if op != "drain":
                out["state"] = proc.state()
        except Exception as exc:  # an answer, not a dead engine: the node decides what to do
            out, op = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}, None
        sys.stdout.write(json.dumps(out) + "\n")
        sys.stdout.flush()
        if op == "drain":
            break
    return 0


if __name__ == "__main__":
    sys.exit(main())
