"""The fallback against the parking (agents/unpark.py): it takes over from a policy parked at its
floor while requests wait over an idle KV, gives control back when the queue drains, and disarms
for good after a restart; with the on-time rule, only while no request waits past its TTFT target."""
from __future__ import annotations

import pickle
import shutil

import numpy as np
import pytest

from agents.policy import Policy
from agents.spec import is_trained, make_policy
from agents.unpark import Unpark
from engine.control import BACK_OFF, HOLD, SCALE_UP
from engine.metrics import summarize
from engine.request import Request
from engine.snapshot import HIST_EDGES, Snapshot
from env.observation import FEATURES, LOW
from tests.sidecar_process import REPO


class Always(Policy):
    name = "always"

    def __init__(self, action: int) -> None:
        self.action, self.resets = action, 0

    def reset(self, seed=None, env=None) -> None:
        self.resets += 1

    def act(self, obs: np.ndarray) -> int:
        return self.action


def obs(factor: float = 1.0, waiting: bool = True, alloc: float = 0.2, restarting: bool = False) -> np.ndarray:
    o = LOW.copy()
    o[FEATURES.index("overcommit")] = factor / 16.0
    o[FEATURES.index("queue_len")] = 0.5 if waiting else 0.0
    o[FEATURES.index("alloc_ratio")] = alloc
    o[FEATURES.index("restarting")] = float(restarting)
    return o


def test_it_takes_over_after_three_parked_decisions_and_scales_to_its_factor_then_holds():
    u = Unpark(Always(BACK_OFF), factor=4.0)
    assert [u.act(obs()) for _ in range(2)] == [BACK_OFF, BACK_OFF]
    assert u.act(obs()) == SCALE_UP
    assert u.act(obs(factor=3.05)) == SCALE_UP  # 3.05 x 1.25 = 3.81 <= 4
    assert u.act(obs(factor=3.81, alloc=0.9)) == HOLD  # engaged: the KV's use no longer matters
    assert u.engagements == 3
    assert u.act(obs(factor=3.81, waiting=False)) == BACK_OFF  # the queue drained: the policy again


@pytest.mark.parametrize("state", [dict(factor=1.25), dict(waiting=False), dict(alloc=0.6), dict(restarting=True)])
def test_it_leaves_a_policy_that_is_not_parked_alone(state):
    u = Unpark(Always(BACK_OFF), factor=4.0)
    assert [u.act(obs(**state)) for _ in range(6)] == [BACK_OFF] * 6 and u.engagements == 0


def test_a_restart_disarms_it_for_the_episode_and_a_new_episode_arms_it_again():
    inner = Always(HOLD)
    u = Unpark(inner, factor=4.0)
    [u.act(obs()) for _ in range(3)]
    assert u.engaged and u.act(obs(restarting=True)) == HOLD and not u.engaged
    assert [u.act(obs()) for _ in range(6)] == [HOLD] * 6  # parked again, but disarmed
    u.reset(seed=1)
    assert inner.resets == 2 and [u.act(obs()) for _ in range(3)][-1] == SCALE_UP


@pytest.mark.parametrize("slo, late", [(1.0, 1), (None, 0)])
def test_the_engine_counts_the_requests_waiting_past_their_ttft_target(make_engine, slo, late):
    eng = make_engine(num_blocks=64, block_size=4, segment_blocks=8, max_num_seqs=1, ttft_slo_s=slo)
    eng.submit(Request("a", 0.0, 8, 40, 40))
    eng.submit(Request("b", 0.0, 8, 40, 40))  # waits behind a: one sequence at a time
    eng.step()
    assert eng.waiting_late() == 0
    eng.clock = 2.0  # b has waited 2 s (past a 1 s target); a has its first token
    assert eng.waiting_late() == late == eng.snapshot().waiting_late  # what the controller is handed
    figures = summarize(eng)
    assert (figures["requests_waiting"], figures["requests_waiting_late"]) == (1, late)
    b = eng.scheduler.waiting[0]
    b.record.first_token_s = 0.5  # as a preempted sequence back in the queue: its first token came in time
    assert eng.waiting_late() == 0
    assert (summarize(eng)["requests_waiting"], summarize(eng)["requests_waiting_late"]) == (0, 0)


def test_the_on_time_rule_engages_only_on_a_queue_still_in_time_and_hands_back_once_it_is_late(make_engine):
    eng = make_engine(num_blocks=64, block_size=4, segment_blocks=8, max_num_seqs=1, ttft_slo_s=1.0)
    eng.submit(Request("a", 0.0, 8, 40, 40))
    eng.submit(Request("b", 0.0, 8, 40, 40))
    eng.step()
    u = Unpark(Always(BACK_OFF), factor=4.0, on_time=True)
    assert u.name == "unpark:4:ontime:always"

    def act(o: np.ndarray) -> int:
        u.see(eng.snapshot())  # as rlctl eval and the sidecar do before each decision
        return u.act(o)

    assert [act(obs()) for _ in range(3)] == [BACK_OFF, BACK_OFF, SCALE_UP]  # b is still in time
    eng.clock = 2.0
    assert act(obs(factor=1.25)) == BACK_OFF and not u.engaged  # b is late: the policy again
    assert [act(obs()) for _ in range(4)] == [BACK_OFF] * 4 and u.engagements == 1  # and it stays out
    eng.scheduler.waiting[0].record.first_token_s = 2.0  # b served: nothing waits late any more
    assert [act(obs()) for _ in range(3)] == [BACK_OFF, BACK_OFF, SCALE_UP] and u.engagements == 2
    with pytest.raises(RuntimeError, match="reads the snapshot's waiting_late"):
        Unpark(Always(BACK_OFF), factor=4.0, on_time=True).act(obs())


def test_on_a_deployment_where_the_shipped_policy_parks_it_serves_the_queue():
    from rlctl.evaluate import eval_scenario, evaluate, make_env

    sc = eval_scenario(None, "azure2023_conv.csv", None, None, None, 1.2, "Qwen3-30B-A3B@h100", say=lambda *a: None)
    env = make_env(sc, True)
    plain, wrapped = make_policy("default"), make_policy("unpark:4:default")
    a, b = evaluate(env, plain, 1, 4000), evaluate(env, wrapped, 1, 4000)
    assert wrapped.engagements > 0 and a["oom_events"] == b["oom_events"] == 0
    assert b["series"]["overcommit"][-1] > 3 > a["series"]["overcommit"][-1]
    assert b["tokens_per_s"] > 1.2 * a["tokens_per_s"]


def test_the_on_time_rule_gives_the_same_figures_in_evaluation_processes_as_in_this_one():
    from rlctl.evaluate import eval_scenario, run_evals

    sc = eval_scenario(None, "azure2023_conv.csv", None, None, 20, 1.2, "Qwen3-30B-A3B@h100", say=lambda *a: None)
    u = make_policy("unpark:4:ontime:default")
    here = run_evals([(u, True)], sc, 2, 4000)
    assert u.snapshot is not None and pickle.loads(pickle.dumps(u)).snapshot == u.snapshot
    there = run_evals([(u, True)], sc, 2, 4000, jobs=2)
    assert [e["goodput_tokens_per_s"] for e in here[u.name]["episodes"]] == \
        [e["goodput_tokens_per_s"] for e in there[u.name]["episodes"]]
    assert here[u.name]["series"]["overcommit"] == there[u.name]["series"]["overcommit"]


def test_the_spec_names_a_factor_and_a_trained_policy_and_acts_behind_the_shield():
    u = make_policy("unpark:4:default")
    assert isinstance(u, Unpark) and u.factor == 4.0 and u.name == "unpark:4:default" and is_trained("unpark:4:default")
    on_time = make_policy("unpark:4:ontime:default")
    assert on_time.on_time and not u.on_time and on_time.name == "unpark:4:ontime:default"
    for bad in ("unpark:x:default", "unpark:inf:default", "unpark:nan:default", "unpark:4:", "unpark:4:vllm", "unpark:4:unpark:4:default", "unpark:4:ontime:",
                "unpark:4:ontime", "unpark:4:ontime:vllm"):
        with pytest.raises(ValueError, match="unpark:F:POLICY needs"):
            make_policy(bad)
    with pytest.raises(ValueError, match="above the floor"):
        make_policy("unpark:1:default")


# ---- served (rlctl/online/served.py): one copy of its state an engine ---------------------------
SHIPPED = REPO / "experiments" / "policies" / "default.rlpolicy"


def parked(late: int = 0, restarting: bool = False) -> Snapshot:
    """A queue of 400 over a KV a fifth used, the factor at its floor: where the shipped weights do
    not scale up (they evict), and the fallback takes over on the third such decision."""
    bins = [0.0] * (len(HIST_EDGES) - 1)
    bins[3] = 1.0
    return Snapshot(time_s=10.0, alloc_ratio=0.2, alloc_slope=0.0, frag_entropy=0.0, queue_len=400, prefill_frac=0.0,
                    len_mean=0.0, len_std=0.0, swapped=0, decode_ms=0.0, overcommit=1.0, reserved_ratio=0.2,
                    device_free=0.5, queue_hist=tuple(bins), running_hist=tuple(bins), kv_tokens_total=200_000,
                    kv_blocks_used=2_500, kv_blocks_total=12_500, max_num_seqs=256, waiting_tokens=400 * 600,
                    restarting=restarting, waiting_late=late)


def test_served_it_keeps_each_engines_state_apart_and_hands_back_once_the_queue_is_late():
    from rlctl.online.confine import Confinement
    from rlctl.online.served import load_served_policy

    served = load_served_policy(f"unpark:4:ontime:{SHIPPED}", Confinement())
    alone = load_served_policy(str(SHIPPED), Confinement())
    inner = [alone.decide(parked())[0]] * 2
    assert inner[0] != SCALE_UP and served.inline and served.states.copies == {}  # the trial decision left none
    assert [served.decide(parked(), "a")[0] for _ in range(3)] == inner + [SCALE_UP]
    assert [served.decide(parked(), "b")[0] for _ in range(2)] == inner  # b's own count: two parked so far
    assert served.decide(parked(late=1), "a")[0] == inner[0]  # a's queue is late: the weights again
    assert served.decide(parked(), "b")[0] == SCALE_UP
    assert served.decide(parked(restarting=True), "b")[0] != SCALE_UP  # b restarted: disarmed for good
    assert [served.decide(parked(), "b")[0] for _ in range(5)] == inner * 2 + inner[:1]
    assert [served.decide(parked(), "a")[0] for _ in range(3)] == inner + [SCALE_UP]  # a is still armed
    info = served.info()
    assert info.name == "unpark:4:ontime:default" and info.kind == "file" and info.file_sha256 == alone.file_sha256
    hashes = {load_served_policy(f"unpark:{f}{SHIPPED}", Confinement()).policy_hash
              for f in ("4:", "4.0000001:", "1e9:", "1.0000001e9:")}
    assert len(hashes | {served.policy_hash, alone.policy_hash}) == 6  # every setting counts, to the last digit


def test_served_it_starts_an_engine_afresh_when_its_snapshots_are_numbered_afresh():
    from rlctl.online.confine import Confinement
    from rlctl.online.served import load_served_policy

    served = load_served_policy(f"unpark:4:{SHIPPED}", Confinement())
    inner = load_served_policy(str(SHIPPED), Confinement()).decide(parked())[0]
    assert [served.decide(parked(), "a", seq)[0] for seq in (1, 2, 3)] == [inner, inner, SCALE_UP]
    assert served.decide(parked(), "a", 4)[0] == SCALE_UP  # the same run: still engaged
    assert served.decide(parked(restarting=True), "a", 5)[0] != SCALE_UP  # a restart disarms it for the run
    assert [served.decide(parked(), "a", seq)[0] for seq in (6, 7, 8)] == [inner] * 3
    assert [served.decide(parked(), "a", seq)[0] for seq in (1, 2, 3)] == [inner, inner, SCALE_UP]  # a new run


def test_served_engines_decide_in_parallel_threads_each_on_its_own_state():
    from concurrent.futures import ThreadPoolExecutor

    from rlctl.online.confine import Confinement
    from rlctl.online.served import load_served_policy

    served = load_served_policy(f"unpark:4:{SHIPPED}", Confinement())
    inner = load_served_policy(str(SHIPPED), Confinement()).decide(parked())[0]
    def four_runs(engine: str) -> list[list[int]]:
        return [[served.decide(parked(), engine, seq)[0] for seq in range(1, 5)] for _ in range(4)]

    with ThreadPoolExecutor(8) as pool:
        runs = [run for engine_runs in pool.map(four_runs, [f"e{k}" for k in range(8)]) for run in engine_runs]
    # eight engines, each four runs of four decisions, interleaved with the other engines' in any
    # order: no engine saw another's count, and each run numbered afresh started its engine afresh
    assert len(runs) == 32 and all(run == [inner, inner, SCALE_UP, SCALE_UP] for run in runs)


def test_served_it_forgets_the_engine_asked_least_recently_past_its_bound(monkeypatch):
    from rlctl.online import served as served_module
    from rlctl.online.confine import Confinement

    monkeypatch.setattr(served_module, "MAX_ENGINES", 2)
    served = served_module.load_served_policy(f"unpark:4:{SHIPPED}", Confinement())
    for engine in ("a", "b", "a", "c"):
        served.decide(parked(), engine)
    assert list(served.states.copies) == ["a", "c"]  # b was asked least recently


def test_serve_takes_a_shipped_policy_by_its_name_as_rlctl_eval_does():
    from rlctl.online.confine import Confinement
    from rlctl.online.served import load_served_policy

    by_path = load_served_policy(f"unpark:4:ontime:{SHIPPED}", Confinement())
    by_name = load_served_policy("unpark:4:ontime:default", Confinement())
    assert by_name.spec == "unpark:4:ontime:default" and by_name.policy_hash == by_path.policy_hash
    assert load_served_policy("default", Confinement()).file_sha256 == by_path.file_sha256


def test_serve_refuses_a_fallback_that_cannot_serve_saying_why(tmp_path):
    from agents.export import PolicyFileError
    from rlctl.online.confine import Confinement
    from rlctl.online.served import load_served_policy

    with pytest.raises(ValueError, match="serve the fallback against the parking as unpark:F:PATH or unpark:F:ontime:PATH"):
        load_served_policy("unpark:4:ontime:watermark", Confinement(allow_baselines=True))
    with pytest.raises(PolicyFileError, match="no such file"):
        load_served_policy(f"unpark:4:{tmp_path / 'none.rlpolicy'}", Confinement())
    with pytest.raises(ValueError, match="one engine's policy"):
        load_served_policy(f"unpark:4:{SHIPPED}", Confinement(), node=True)


def test_a_sidecar_serves_it_over_grpc_and_reloads_it_from_its_directory(sidecars, tmp_path):
    import grpc

    from rlctl.online.live import open_channel
    from rlctl.online.messages import snapshot_message
    from rlctl.online.proto import controller_pb2 as pb

    policies = tmp_path / "policies"
    policies.mkdir()
    shutil.copy(SHIPPED, policies / "default.rlpolicy")
    s = sidecars(f"unix://{tmp_path}/s.sock", f"unpark:4:ontime:{SHIPPED}", "--policy-dir", str(policies))
    with open_channel(s.address) as ch:
        stub = s.stub(ch)

        def ask(engine: str, **kw) -> int:
            return stub.Decide(snapshot_message(parked(**kw), 32768, engine, 1), timeout=30).policy_action

        first = stub.GetPolicy(pb.GetPolicyRequest())
        a = [ask("a") for _ in range(3)]
        b, late = ask("b"), ask("a", late=2)
        reloaded = stub.ReloadPolicy(pb.ReloadPolicyRequest(policy="unpark:4:ontime:default"), timeout=30).current
        again = [ask("a") for _ in range(3)]  # a fresh policy: fresh state
        with pytest.raises(grpc.RpcError) as err:
            stub.ReloadPolicy(pb.ReloadPolicyRequest(policy="unpark:4:ontime:none"), timeout=30)
        kept = stub.GetPolicy(pb.GetPolicyRequest())
        old_sender = snapshot_message(parked(), 32768, "a", 2)
        old_sender.ClearField("waiting_late")  # a sender that predates the field: refused, not read as 0
        with pytest.raises(grpc.RpcError) as unset:
            stub.Decide(old_sender, timeout=30)
    assert first.name == "unpark:4:ontime:default" and first.spec == f"unpark:4:ontime:{SHIPPED}"
    assert a[2] == SCALE_UP != a[0] == a[1] == b == late and again == a
    assert reloaded.spec == "unpark:4:ontime:default.rlpolicy" and reloaded.policy_hash == first.policy_hash
    assert err.value.code() == grpc.StatusCode.NOT_FOUND and "still serving" in err.value.details()
    assert kept.spec == reloaded.spec
    assert unset.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "waiting_late is not set" in unset.value.details()
