"""Workloads whose mix moves between phases, a scenario at another load, and any trace put at a
chosen load of a deployment (rlctl eval --trace FILE --load X)."""
from __future__ import annotations

import numpy as np
import pytest

from engine.roofline import deployment
from env.scenario_yaml import load_scenario
from env.workload_builder import episode_requests
from env.workloads import LogNormalLengths, PoissonArrivals, generate_phases
from rlctl.cli import main
from rlctl.load import trace_load


def test_phases_follow_each_other_with_their_own_rates_and_lengths():
    chat = (PoissonArrivals(20.0), LogNormalLengths(200, 0.3), LogNormalLengths(100, 0.3), 30.0)
    reasoning = (PoissonArrivals(2.0), LogNormalLengths(200, 0.3), LogNormalLengths(3000, 0.3), 30.0)
    reqs = generate_phases(phases=[chat, reasoning], max_tokens_rule="fixed:16384", duration_s=600.0,
                           rng=np.random.default_rng(0))
    assert reqs == sorted(reqs, key=lambda r: r.arrival_s) and len({r.request_id for r in reqs}) == len(reqs)
    # each request belongs to one phase segment (its id's prefix); segments alternate chat, reasoning
    segments: dict[str, list] = {}
    for r in reqs:
        segments.setdefault(r.request_id.split("-")[0], []).append(r)
    means = [np.mean([r.output_len for r in seg]) for seg in segments.values() if len(seg) > 5]
    kinds = [m > 1000 for m in means]
    assert True in kinds and False in kinds
    long = [r for r in reqs if r.output_len > 1000]
    assert 0.05 < len(long) / len(reqs) < 0.5  # the reasoning phases arrive 10x more slowly


def test_a_scenario_at_a_load_has_that_many_more_arrivals():
    sc = load_scenario("long_outputs")
    n = [len(episode_requests(s.workload, s.episode_s, 8192, np.random.default_rng(7))[0])
         for s in (sc, sc.at_load(2.0))]
    assert n[1] == pytest.approx(2 * n[0], rel=0.2)
    with pytest.raises(ValueError, match="load must be > 0"):
        sc.at_load(0.0)


def test_the_time_scale_puts_a_trace_at_the_load_asked_of_the_deployment():
    d = deployment("llama3-8b-l40s")
    one, two = (trace_load("azure2023_conv.csv", d, "fixed:4096", x) for x in (1.0, 2.0))
    assert one.sustainable_rps == two.sustainable_rps and two.time_scale == pytest.approx(2 * one.time_scale)
    assert 5.0 < one.trace_rps < 6.0 and 1100 < one.mean_prompt < 1200  # the trace's own figures
    small = trace_load("azure2023_conv.csv", deployment("llama7b-fp16-a10"), "fixed:4096", 1.0)
    assert small.sustainable_rps < one.sustainable_rps  # a 24 GB GPU sustains less than a 48 GB one


def test_eval_puts_a_held_out_trace_at_a_load_and_says_how(capsys):
    assert main(["eval", "--trace", "arxiv_summarization_lengths_llama2tok.csv", "--load", "1.2",
                 "--policy", "static:1.0", "--steps", "3"]) == 0
    out = capsys.readouterr().out
    assert "load: arxiv_summarization_lengths_llama2tok.csv asks" in out and "puts it at 1.2x that" in out
    for bad, message in ((["--load", "0"], "--load must be a finite number > 0"),
                         (["--load", "inf"], "--load must be a finite number > 0"), (["--load", "1", "--time-scale", "2"], "not both"),
                         (["--load", "1", "--deployment", "gpu9000"], "unknown deployment 'gpu9000'")):
        assert main(["eval", "--trace", "azure2023_conv.csv", "--policy", "static:1.0", "--steps", "2", *bad]) == 2
        assert message in capsys.readouterr().err
    assert main(["eval", "--scenario", "steady", "--load", "1.2", "--policy", "static:1.0"]) == 2
    assert "apply to --trace" in capsys.readouterr().err


def test_a_backlog_moves_the_first_requests_to_time_zero_until_their_prompts_hold_the_tokens():
    from env.workload_builder import front_loaded
    from env.workloads import Request

    reqs = [Request(f"r{i}", 10.0 * i + 1, 100, 10, 50) for i in range(6)]
    moved = front_loaded(list(reversed(reqs)), 250)  # any order in, arrival order out
    assert [r.request_id for r in moved] == [f"r{i}" for i in range(6)]
    assert [r.arrival_s for r in moved] == [0.0, 0.0, 0.0, 31.0, 41.0, 51.0]  # 100 + 100 < 250 <= 300
    assert [(r.prompt_len, r.output_len, r.max_tokens) for r in moved] == [(100, 10, 50)] * 6
    assert front_loaded(reqs, 0) == reqs
    # of a session only the opening turn moves, so its later turns still come after it
    turns = [Request("s-t0", 5.0, 100, 10, 50, session_id="s"), Request("s-t1", 6.0, 20, 10, 50, session_id="s"),
             Request("u", 7.0, 100, 10, 50)]
    assert [(r.request_id, r.arrival_s) for r in front_loaded(turns, 1000)] == [("s-t0", 0.0), ("u", 0.0),
                                                                                ("s-t1", 6.0)]


def test_an_environment_that_starts_behind_has_its_backlog_waiting_and_without_one_is_unchanged():
    from env.observation import FEATURES
    from env.overcommit_env import OvercommitEnv
    from env.scenario import Backlog

    plain, behind = OvercommitEnv("long_outputs"), OvercommitEnv("long_outputs", backlog=Backlog(share=1.0, kv=(1.0, 1.0)))
    off = OvercommitEnv("long_outputs", backlog=None)
    _, info = plain.reset(seed=3)
    _, again = off.reset(seed=3)
    assert again["workload"] == info["workload"] and "behind" not in info["workload"]
    _, info = behind.reset(seed=3)
    assert "starts behind" in info["workload"]
    obs, *_ = behind.step(0)
    plain_obs, *_ = plain.step(0)
    queue_tokens = FEATURES.index("queue_tokens")
    assert obs[queue_tokens] > plain_obs[queue_tokens] + 0.3  # a KV's worth of prompts waits at the start
    with pytest.raises(ValueError, match="backlog share"):
        Backlog(share=0.0)
    with pytest.raises(ValueError, match="backlog kv"):
        Backlog(kv=(2.0, 1.0))


def _azure(path, rows):
    """An Azure-format trace: (seconds after the first arrival, prompt tokens, output tokens) per row."""
    lines = ["TIMESTAMP,ContextTokens,GeneratedTokens"]
    lines += [f"2023-11-16 18:{15 + int(t) // 60:02d}:{int(t) % 60:02d}.{round(t % 1 * 1e7):07d},{p},{o}" for t, p, o in rows]
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def test_a_trace_put_at_a_load_says_what_it_cannot_keep(tmp_path, capsys):
    base = ["eval", "--policy", "static:1.0", "--episodes", "1", "--deployment", "llama3-8b-l40s", "--load", "1.2"]
    # no rate to read: one request, or all at one time
    for name, rows in (("one", [(0.0, 300, 40)]), ("same", [(1.5, 300, 40)] * 3)):
        assert main([*base, "--trace", _azure(tmp_path / f"{name}.csv", rows), "--steps", "2"]) == 2
        assert "--load needs a trace whose arrivals span some time" in capsys.readouterr().err
    # twenty requests over ten seconds: the episode outlasts them, and the line says so and how to keep within
    short = _azure(tmp_path / "short.csv", [(i * 0.5, 300, 40) for i in range(20)] + [(10.0, 200_000, 40)] * 2)
    assert main([*base, "--trace", short, "--steps", "40"]) == 0
    out = capsys.readouterr().out
    assert "2 of the trace's 22 prompts leave no room for an output in llama3-8b-l40s's context" in out
    assert "only drains, so the episode as a whole runs below 1.2x" in out
    steps = int(out.split("(--steps ")[1].split(" ")[0])
    assert 1 <= steps < 40
    assert main([*base, "--trace", short, "--steps", str(steps)]) == 0
    assert "only drains" not in capsys.readouterr().out
    assert main([*base, "--trace", short, "--steps", str(steps + 1)]) == 0  # the most that does
    assert "only drains" in capsys.readouterr().out
    # arrivals over in less than a step: no --steps keeps within them, and the note does not offer one
    brief = _azure(tmp_path / "brief.csv", [(0.0, 300, 40), (0.5, 300, 40)])
    assert main([*base, "--trace", brief, "--steps", "1"]) == 0
    out = capsys.readouterr().out
    assert "within the first 2 s step, so no episode stays within them" in out and "(--steps" not in out


def test_eval_names_the_windows_a_gappy_trace_leaves_thin_and_states_the_deployment(tmp_path, capsys):
    # two busy hours a day apart: --load reads the trace's mean rate, so most windows fall in the gap,
    # hold no request and run far below the load asked; the table alone would not show it
    from datetime import datetime, timedelta

    start = datetime(2024, 5, 10)
    times = [i * 2.0 for i in range(1800)] + [86_400 + i * 2.0 for i in range(1800)]
    rows = [f"{(start + timedelta(seconds=t)).isoformat(sep=' ')}.000000+00:00,300,40" for t in times]
    gappy, even = tmp_path / "gappy.csv", tmp_path / "even.csv"
    gappy.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n" + "\n".join(rows) + "\n")
    even.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n" + "\n".join(
        f"{(start + timedelta(seconds=i * 48.0)).isoformat(sep=' ')}.000000+00:00,300,40" for i in range(1800)) + "\n")
    base = ["eval", "--policy", "static:1.0", "--episodes", "3", "--steps", "2", "--deployment", "llama3-8b-l40s",
            "--load", "1.2", "--trace"]
    assert main([*base, str(gappy)]) == 0
    out = capsys.readouterr().out
    assert "deployment: llama3-8b-l40s: 8.0B params at 16 bits on NVIDIA L40S 48GB; KV " in out
    assert "episode(s) drew a window of " in out and "seed 0: 0" in out
    assert main([*base, str(even)]) == 0
    assert "drew a window" not in capsys.readouterr().out
    # an episode that outlasts an even trace holds all of it: said by the note on the trace's end, not this one
    short = _azure(tmp_path / "short.csv", [(float(i), 300, 40) for i in range(40)])
    assert main(["eval", "--policy", "static:1.0", "--episodes", "2", "--steps", "60", "--time-scale", "1",
                 "--trace", short]) == 0
    out = capsys.readouterr().out
    assert "drew a window" not in out and "only drains" in out


def test_eval_sizes_the_kv_to_what_a_users_engine_reports(tmp_path, capsys):
    # vLLM logs "GPU KV cache size: N tokens", SGLang "#tokens: N": --kv-tokens replays on that KV, --load's batch and
    # the device (its memory as the engine that reported it has it) following; the deployment's sizing is conservative
    trace = _azure(tmp_path / "long.csv", [(float(i), 3000, 1000) for i in range(60)])
    base = ["eval", "--policy", "static:1.0", "--episodes", "1", "--steps", "2", "--deployment", "llama3-8b-l40s",
            "--load", "1.2", "--trace", trace]
    assert main(base) == 0
    plain = capsys.readouterr().out
    assert "(48 decoding together)" in plain and "the scenario sizes its KV" not in plain  # 194,176 tokens / 4,000
    assert main([*base, "--kv-tokens", "300000"]) == 0
    out = capsys.readouterr().out
    assert "(75 decoding together)" in out and "the scenario sizes its KV to 18750 blocks (300000 tokens), more than " \
        "the NVIDIA L40S 48GB holds beside the weights here (its memory taken as 61.9 GB to hold it)" in out
    assert main([*base, "--kv-tokens", "100000"]) == 0
    out = capsys.readouterr().out
    assert "the scenario sizes its KV to 6250 blocks (100000 tokens)" in out and "more than" not in out
    for value, why in (("0", "--kv-tokens must be a whole number of tokens > 0, got 0"),
                       ("5", "--kv-tokens 5 is less than one block of 16 tokens")):
        assert main([*base, "--kv-tokens", value]) == 2
        assert why in capsys.readouterr().err
    assert main(["eval", "--policy", "static:1.0", "--scenario", "node_chat_pair", "--kv-tokens", "1000"]) == 2
    assert "--kv-tokens" in capsys.readouterr().err


def test_every_trace_replay_says_which_lengths_it_changed(tmp_path, capsys):
    # with --time-scale as with --load: prompts past the context, outputs cut to end at it, and a
    # BurstGPT failed request's 0 response tokens (served as one token) are counted, not replayed silently
    burst = tmp_path / "burst.csv"
    burst.write_text("Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
                     "0,ChatGPT,300,40,340,Conversation log\n1,GPT-4,200,0,200,API log\n"
                     "2,ChatGPT,40000,10,40010,Conversation log\n3,ChatGPT,32000,2000,34000,Conversation log\n")
    assert main(["eval", "--policy", "static:1.0", "--episodes", "1", "--steps", "2", "--deployment", "llama3-8b-l40s",
                 "--time-scale", "1", "--trace", str(burst)]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("lengths: "))
    assert line == ("lengths: 1 of the trace's 4 prompts leaves no room for an output in llama3-8b-l40s's context "
                    "(32768 tokens) and is cut to 32767, where an engine would refuse it; 1 of the others' outputs "
                    "is cut to end at the context; 1 record with 0 output tokens (BurstGPT's failed requests), replayed "
                    "as 1 token")
    # rlctl replay says so too (found by review: it served them as one token without a word)
    assert main(["replay", "--trace", str(burst), "--duration", "2", "--blocks", "64", "--max-tokens", "fixed:16"]) == 0
    assert ("lengths: 1 record with 0 output tokens (BurstGPT's failed requests), replayed as 1 token"
            in capsys.readouterr().out.splitlines())
    assert main(["eval", "--policy", "static:1.0", "--episodes", "1", "--steps", "2", "--trace", _azure(
        tmp_path / "plain.csv", [(0.0, 300, 40), (1.0, 200, 10)])]) == 0
    assert "lengths: " not in capsys.readouterr().out
    # a scenario's own trace, on the context its engine settings give (8,192 here, not the deployment's 32,768)
    import yaml

    scenario = tmp_path / "own.yaml"
    scenario.write_text(yaml.safe_dump({"name": "own", "deployment": "llama3-8b-l40s", "max_steps": 2,
                                        "engine": {"max_model_len": 8192},
                                        "workload": {"trace": str(burst), "time_scale": 1.0, "max_tokens": "fixed:64"}}))
    assert main(["eval", "--policy", "static:1.0", "--episodes", "1", "--scenario", str(scenario)]) == 0
    out = capsys.readouterr().out
    assert "lengths: 2 of the trace's 4 prompts leave no room for an output in llama3-8b-l40s's context (8192 tokens)" in out
    # a scenario's KV past what the GPU holds is said in its deployment line
    scenario.write_text(yaml.safe_dump({**yaml.safe_load(scenario.read_text()), "engine": {"num_blocks": 10**7}}))
    assert main(["eval", "--policy", "static:1.0", "--episodes", "1", "--scenario", str(scenario)]) == 0
    assert ("the scenario sizes its KV to 10000000 blocks (160000000 tokens), more than the NVIDIA L40S 48GB holds "
            "beside the weights") in capsys.readouterr().out


def test_a_chunked_layers_decode_reads_its_mean_over_a_requests_decodes():
    # a chunked layer's keys follow a sawtooth over the positions (Llama 4's): the one point at the mean context
    # could be off by the chunk's length, so the load reads their mean over the request's decodes; a windowed
    # layer's, a concave min(context, window), at the mean context
    from rlctl.load import decode_keys

    for p, o in ((8000, 400), (16000, 780), (100, 50)):
        assert decode_keys(p, o, 8192, True) == pytest.approx(sum(q % 8192 + 1 for q in range(p, p + o)) / o)
    assert decode_keys(8000, 400, 4096, False) == 4096 and decode_keys(100, 50, 4096, False) == 125
