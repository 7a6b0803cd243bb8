"""The controller's vocabulary and the one loop both doors into the engine use.

``ACTIONS`` are docs/design.md's five actions. ``run_interval`` is one decision interval: apply an
action, run the engine to the next decision time (applying scheduled events, such as a co-tenant's
memory changing, at their times), and take the snapshot the next decision sees. The Gymnasium
environment (training, evaluation) and the live loop (serving) both call it, so an action means
the same thing offline and online.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Callable

from engine.engine import Engine
from engine.snapshot import Snapshot

ACTIONS = ("hold", "scale_up", "back_off", "defrag", "evict")
HOLD, SCALE_UP, BACK_OFF, DEFRAG, EVICT = range(len(ACTIONS))

Event = tuple[float, Callable[[Engine], None]]  # (engine time, what happens to the engine then)


def apply_due(engine: Engine, events: deque[Event]) -> None:
    """Apply the events of ``events`` whose time has come."""
    while events and events[0][0] <= engine.clock:
        events.popleft()[1](engine)


def apply_action(engine: Engine, action: int, evict_free_share: float) -> dict:
    """Apply one of ``ACTIONS`` to ``engine`` now (between iterations); what it did."""
    if action == SCALE_UP:  # multiplicative: a few decisions cross the useful range from 1 to 4
        engine.set_overcommit(engine.overcommit * engine.config.overcommit_step)
    elif action == BACK_OFF:
        engine.set_overcommit(engine.overcommit / engine.config.overcommit_step)
    elif action == DEFRAG:
        r = engine.compact()
        return {"compacted_blocks": r.blocks, "copy_s": r.seconds}
    elif action == EVICT:
        r = engine.evict(evict_free_share)
        return {"evicted_blocks": r.blocks, "copy_s": r.seconds}
    elif action != HOLD:
        raise ValueError(f"action must be one of 0..{len(ACTIONS) - 1} ({', '.join(ACTIONS)}), got {action!r}")
    return {}


def advance(engine: Engine, until: float, events: deque[Event] | None = None) -> None:
    """Run ``engine`` to ``until`` (or until it has nothing left), applying each event of
    ``events`` (in time order; applied ones are removed) once the clock reaches its time."""
    events = events if events is not None else deque()
    while engine.clock < until:
        stop = min(until, events[0][0]) if events else until
        engine.run(until=stop)
        apply_due(engine, events)
        if not engine.has_work() and engine.clock < stop:
            break


@dataclass(frozen=True)
class Interval:
    """One decision interval: what the action did, when it started, and the snapshot at its end."""

    effect: dict
    start_s: float
    snapshot: Snapshot


def run_interval(engine: Engine, action: int, until: float, events: deque[Event] | None = None,
                 evict_free_share: float = 0.2) -> Interval:
    """Apply ``action``, run to ``until`` with ``events`` (``advance``), snapshot."""
    start = engine.clock
    effect = apply_action(engine, action, evict_free_share)
    advance(engine, until, events)
    return Interval(effect, start, engine.snapshot())
