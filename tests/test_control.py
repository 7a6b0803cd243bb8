"""The two doors into one loop: the environment and the live loop run ``engine.control.run_interval``,
so the same actions keep the same books."""
from __future__ import annotations


import yaml

from experiments import SCENARIOS
from engine.control import ACTIONS, run_interval
from engine.metrics import summarize
from env.overcommit_env import OvercommitEnv
from env.scenario_yaml import scenario_from_dict
from rlctl.online.live import LiveController

STEPS = 40


def sessions_scenario():
    """Multi-turn sessions on the A10: defrag and evict have contexts to move."""
    data = yaml.safe_load((SCENARIOS / "sessions.yaml").read_text())
    return scenario_from_dict({**data, "name": "sessions", "max_steps": STEPS})


class Recording(LiveController):
    """The live loop, remembering each action it applied and each snapshot it decided on."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.applied: list[int] = []
        self.seen: list = []

    def _decide(self, engine, snap):
        self.seen.append(snap)
        d = super()._decide(engine, snap)
        self.applied.append(0 if d is None else d.action)
        return d


def test_the_environment_and_the_live_loop_keep_the_same_books_for_the_same_actions(sidecars, tmp_path):
    sc = sessions_scenario()
    live_env = OvercommitEnv(sc)
    live_env.reset(seed=3)
    engine = live_env.engine  # the episode's engine and workload, driven by the live loop instead
    s = sidecars(f"unix://{tmp_path}/s.sock", "random")
    controller = Recording(s.address, deadline_s=5.0, evict_free_share=sc.evict_free_share)
    try:
        for k in range(1, STEPS + 1):
            controller.step(engine, k * sc.decision_interval_s)
    finally:
        controller.close()
    assert sum(controller.fallbacks.values()) == 0
    assert {ACTIONS[a] for a in controller.applied} == set(ACTIONS)  # every action was exercised

    env = OvercommitEnv(sc)  # no shield: the sidecar's shield already chose the applied actions
    env.reset(seed=3)
    snapshots = [env.engine.last_snapshot]
    for a in controller.applied:
        env.step(a)
        snapshots.append(env.engine.last_snapshot)
    assert snapshots[:-1] == controller.seen
    assert snapshots[-1] == engine.last_snapshot
    assert summarize(env.engine) == summarize(engine)
    assert env.engine.counters == engine.counters and env.engine.clock == engine.clock
    assert env.engine.counters.compactions > 0 and engine.traffic.out_blocks > 0


def test_run_interval_applies_the_action_then_runs_to_the_decision_time():
    env = OvercommitEnv(sessions_scenario())
    env.reset(seed=0)
    e = env.engine
    first = run_interval(e, 1, 2.0)  # scale up
    assert first.start_s == 0.0 and e.clock >= 2.0 and first.snapshot is e.last_snapshot
    assert first.snapshot.overcommit == e.config.overcommit * e.config.overcommit_step  # a multiplicative step
    defrag = run_interval(e, 3, 4.0)
    assert set(defrag.effect) == {"compacted_blocks", "copy_s"} and e.counters.compactions == 1
