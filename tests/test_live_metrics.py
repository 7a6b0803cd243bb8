"""The live loop publishes the engine's metrics and acts through the actuators: ``rlctl replay
--controller ADDR --metrics-port P`` steered by a real ``rlctl serve`` process, the sidecar killed
mid-replay, the metrics scraped over HTTP while the replay runs and once it has finished (before
its server stops), and the actuators' last reports in the replay's JSON.

The engine is tests/test_sidecar.py's tensor-free profiled one (the command's ``build_engine``
swapped for it), so that the replay takes milliseconds of CPU and no figure depends on timing.
"""
from __future__ import annotations

import json

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

import rlctl.cli as cli
import rlctl.online.engine_metrics as engine_metrics
import rlctl.online.live as live
import rlctl.report as report
from engine.executor import ProfiledExecutor
from rlctl.online.mps import NOT_AVAILABLE, MPSLimit
from env.workloads import bundled_trace
from rlctl.replay import build_engine
from tests.sidecar_process import free_port, scrape_text
from tests.test_sidecar import CPU_COST

TRACE = str(bundled_trace("azure2023_conv.csv"))
# tests/test_sidecar.py's deployment and window; max_tokens = the real output, so that the factors
# the watermark policy reaches run out of memory (OOM crashes, 1 s restarts) where the decisions
# come every 0.5 s (``SPARSE``): the KV fills between two of them, past the shield's eviction and
# admission headroom
ARGS = ["replay", "--trace", TRACE, "--time-scale", "40", "--duration", "30", "--max-tokens", "scale:1.0",
        "--blocks", "128", "--max-model-len", "2048", "--downtime", "1.0", "--decision-interval", "0.1",
        "--deadline-ms", "2000"]
SPARSE = ["--decision-interval", "0.5"]  # the last one given counts


def scrape(port: int) -> dict[tuple[str, frozenset], float]:
    text = scrape_text(port)
    return {(s.name, frozenset((k, v) for k, v in s.labels.items() if k not in ("model_name", "engine"))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def profiled_engine(cfg, factor, oom, model_dir=None, device="cpu", kv_cache_dtype="auto"):
    return build_engine(cfg, factor, oom, executor=ProfiledExecutor(CPU_COST, materialize=False),
                        kv_cache_dtype=kv_cache_dtype)


def test_one_list_of_fallback_reasons():
    assert live.FALLBACK_REASONS is engine_metrics.FALLBACK_REASONS
    assert [key for _, key, _ in report.LIVE_ROWS if key.startswith("fallbacks_")] == [
        f"fallbacks_{r}" for r in engine_metrics.FALLBACK_REASONS]


def test_a_steered_replay_serves_the_engine_metrics_and_reports_its_actuators(
        sidecars, tmp_path, monkeypatch, capsys):
    address = f"unix://{tmp_path}/s.sock"
    sidecar = sidecars(address, "watermark")
    port, out = free_port(), tmp_path / "live.json"
    seen: dict = {}

    class Chaos(live.LiveController):
        """The sidecar killed at the 5th decision, started again after 3 connection fallbacks;
        the metrics scraped over HTTP at the kill, while the replay runs."""

        def __init__(self, *a, **kw):
            super().__init__(*a, **{**kw, "backoff_s": 0.001, "backoff_max_s": 0.01})

        def step(self, engine, until):
            if self.decisions == 5 and "killed" not in seen:
                sidecar.stop()
                seen["killed"], seen["during"] = self.decisions, scrape(port)
            elif self.fallbacks["connection"] >= 3 and "restarted" not in seen:
                sidecars(address, "watermark")
                seen["restarted"] = self.decisions
            return super().step(engine, until)

    replay_live = live.replay_live

    def replay_and_scrape(requests, engine, controller, interval):
        figures = replay_live(requests, engine, controller, interval)
        seen.update(engine=engine, controller=controller, after=scrape(port))  # its server is still up
        return figures

    monkeypatch.setattr(cli, "build_engine", profiled_engine)
    monkeypatch.setattr(live, "LiveController", Chaos)
    monkeypatch.setattr(live, "replay_live", replay_and_scrape)
    rc = cli.main(ARGS + SPARSE + ["--controller", address, "--metrics-port", str(port), "--mps-next-limit",
                          "--json", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    figures = json.loads(out.read_text())
    engine, controller, during, after = seen["engine"], seen["controller"], seen["during"], seen["after"]

    # the replay: steered, the sidecar lost and found again, no request lost
    assert seen["killed"] == seen["restarted"] == 5
    assert figures["requests_completed"] == figures["requests_submitted"] > 40 and figures["requests_unfinished"] == 0
    assert figures["controller_decisions"] > 5 and figures["reconnects"] >= 1
    assert figures["fallbacks_connection"] >= 3 and figures["fallbacks"] == figures["fallbacks_connection"]
    assert figures["metrics_port"] == port and f"http://127.0.0.1:{port}/metrics" in text

    # the metrics, under vLLM's names and rlctl_ ones, during the replay and at its end
    def value(samples, name, **labels):
        return samples[(name, frozenset(labels.items()))]

    assert value(during, "vllm:num_requests_running") + value(during, "vllm:num_requests_waiting") > 0
    assert 0 <= value(during, "vllm:kv_cache_usage_perc") <= 1
    assert value(during, "rlctl_controller_fallbacks_total", reason="connection") == 0  # killed, not yet asked
    assert value(after, "vllm:num_requests_running") == value(after, "vllm:num_requests_waiting") == 0
    assert value(after, "vllm:kv_cache_usage_perc") == engine.kv.blocks.usage()
    assert value(after, "vllm:num_preemptions_total") == engine.counters.preemptions == figures["preemptions"]
    assert value(after, "rlctl_oom_events_total") == engine.counters.oom_events == figures["oom_events"] > 0
    assert value(after, "vllm:time_to_first_token_seconds_count") == figures["requests_completed"]
    assert value(after, "rlctl_overcommit_factor") == engine.overcommit
    for reason in engine_metrics.FALLBACK_REASONS:  # the loop's own count, reason by reason
        assert value(after, "rlctl_controller_fallbacks_total", reason=reason) == controller.fallbacks[reason] \
            == figures[f"fallbacks_{reason}"]
    assert value(after, "rlctl_controller_fallbacks_total", reason="connection") >= 3

    # the actuators: the engine's quota at every decision, the others once, each saying why not here
    acts, changes = figures["actuators"], figures["actuator_changes"]
    assert list(acts) == list(live.ACTUATORS)
    quota = acts["engine_quota"]
    assert quota["applied"] and quota["value"] == engine.overcommit
    assert f"overcommit {engine.overcommit:g} in force" in quota["detail"] and "decision" in quota["detail"]
    assert changes["engine_quota"] > 0
    fraction = acts["torch_memory_fraction"]
    assert not fraction["applied"] and changes["torch_memory_fraction"] == 0
    assert fraction["detail"] == ("cpu is not a CUDA device" if torch.cuda.is_available() else "CUDA is not available")
    mps = acts["mps_pinned_mem_limit"]
    if MPSLimit().available() is not None:
        assert not mps["applied"] and mps["detail"].startswith(NOT_AVAILABLE) and changes["mps_pinned_mem_limit"] == 0
    else:  # a machine with an MPS control daemon: the default limit for the next engine process, read back
        assert mps["applied"] and "clients started from now on" in mps["detail"]
    for name in live.ACTUATORS:  # and the printed summary says the same
        assert f"  {name} ({changes[name]}): " in text
    assert "CUDA is not available" in text or "cpu is not a CUDA device" in text


def test_without_mps_next_limit_the_mps_actuator_is_not_asked(sidecars, tmp_path, monkeypatch, capsys):  # noqa: F811
    address = f"unix://{tmp_path}/s.sock"
    sidecars(address, "static:1.2")
    out = tmp_path / "live.json"
    monkeypatch.setattr(cli, "build_engine", profiled_engine)
    assert cli.main(ARGS + ["--limit", "8", "--controller", address, "--json", str(out)]) == 0
    figures = json.loads(out.read_text())
    assert figures["fallbacks"] == 0 and "metrics_port" not in figures
    mps, quota = figures["actuators"]["mps_pinned_mem_limit"], figures["actuators"]["engine_quota"]
    assert not mps["applied"] and "not asked" in mps["detail"]
    # the factor is pinned once; the shield's admission headroom follows the running batch (agents/shield.py)
    assert quota["applied"] and quota["value"] == 1.2 and figures["actuator_changes"]["engine_quota"] >= 1


@pytest.mark.parametrize("option", [["--metrics-port", "9464"], ["--mps-next-limit"]])
def test_metrics_and_mps_need_the_live_loop(option, capsys):
    assert cli.main(ARGS + option) == 2
    err = capsys.readouterr().err
    assert f"rlctl replay: error: {option[0]} belongs to the live loop: give --controller ADDR too" in err


def test_a_bad_mps_device_or_metrics_port_is_refused_before_the_replay(capsys):
    assert cli.main(ARGS + ["--controller", "unix:///nonexistent.sock", "--mps-next-limit", "gpu 0"]) == 2
    assert "--mps-next-limit: MPS device must be an ordinal or a UUID" in capsys.readouterr().err
    assert cli.main(ARGS + ["--controller", "unix:///nonexistent.sock", "--metrics-port", "70000"]) == 2
    assert "--metrics-port must be a port number" in capsys.readouterr().err


def test_a_metrics_port_in_use_is_refused_before_the_replay(monkeypatch, capsys):
    import socket

    monkeypatch.setattr(cli, "build_engine", profiled_engine)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert cli.main(ARGS + ["--controller", "unix:///nonexistent.sock", "--metrics-port", str(port)]) == 2
    assert f"--metrics-port {port}: cannot serve on 127.0.0.1 (Address already in use)" in capsys.readouterr().err


def test_metrics_serve_on_the_address_given_and_beyond_loopback_only_when_meant(sidecars, tmp_path, monkeypatch,
                                                                                   capsys):
    address = f"unix://{tmp_path}/s.sock"
    sidecars(address, "static:1.2")
    port, seen = free_port(), {}
    replay_live = live.replay_live

    def replay_and_scrape(requests, engine, controller, interval):
        figures = replay_live(requests, engine, controller, interval)
        seen["text"] = scrape_text(port, "127.0.0.2")  # another loopback address: served there
        return figures

    monkeypatch.setattr(cli, "build_engine", profiled_engine)
    monkeypatch.setattr(live, "replay_live", replay_and_scrape)
    assert cli.main(ARGS + ["--limit", "8", "--controller", address, "--metrics-port", str(port),
                            "--metrics-addr", "127.0.0.2"]) == 0
    assert f"metrics: http://127.0.0.2:{port}/metrics" in capsys.readouterr().out
    assert "vllm:num_requests_running" in seen["text"]

    for command in (ARGS + ["--controller", address], ["serve", "--policy", "vllm", "--listen", address]):
        assert cli.main(command + ["--metrics-port", "0", "--metrics-addr", "0.0.0.0"]) == 2
        err = capsys.readouterr().err
        assert "--metrics-addr 0.0.0.0: not a loopback address" in err and "--metrics-public" in err
        assert cli.main(command + ["--metrics-addr", "127.0.0.1"]) == 2
        assert "give --metrics-port too" in capsys.readouterr().err


def test_the_sidecar_serves_its_metrics_on_the_address_given(sidecars, tmp_path):
    port = free_port()
    sidecars(f"unix://{tmp_path}/s.sock", "static:1.2", "--metrics-port", str(port), "--metrics-addr", "127.0.0.2")
    assert 'rlctl_sidecar_policy_info{' in scrape_text(port, "127.0.0.2")
