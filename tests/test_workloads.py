"""Workloads: trace readers, replay rules and synthetic generators."""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from env.workloads import (
    EmpiricalLengths,
    GammaArrivals,
    LogNormalLengths,
    MarkovModulatedArrivals,
    MaxTokensRule,
    ParetoLengths,
    PoissonArrivals,
    ReplaySpec,
    TraceError,
    build_requests,
    clip_lengths,
    generate,
    generate_sessions,
    read_trace,
)

DATA = Path(__file__).resolve().parents[1] / "env" / "workloads" / "data"


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def mooncake_line(ms: float, prompt: int, output: int, hashes: str = "[]") -> str:
    return (
        f'{{"timestamp": {ms}, "input_length": {prompt}, "output_length": {output}, '
        f'"hash_ids": {hashes}}}\n'
    )


# ---- the bundled traces ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def azure():
    return read_trace(DATA / "azure2023_conv.csv")


@pytest.fixture(scope="module")
def sharegpt():
    return read_trace(DATA / "sharegpt_8k_lengths_llama2tok.csv")


def test_azure_trace_reads_every_row_with_arrivals_from_the_first(azure):
    assert azure.format == "azure" and azure.has_arrivals
    assert len(azure) == 19_366
    first, second, last = azure.records[0], azure.records[1], azure.records[-1]
    assert (first.arrival_s, first.prompt_len, first.output_len) == (0.0, 374, 44)
    # 18:15:50.9951690 - 18:15:46.6805900, and 19:14:08.4025270 - 18:15:46.6805900
    assert second.arrival_s == pytest.approx(4.3145790, abs=1e-9)
    assert last.arrival_s == pytest.approx(3501.7219370, abs=1e-9)
    assert (last.prompt_len, last.output_len) == (197, 183)


def test_mooncake_trace_reads_every_row_with_hash_ids():
    trace = read_trace(DATA / "mooncake_fast25_synthetic.jsonl")
    assert trace.format == "mooncake" and len(trace) == 3_993
    first = trace.records[0]
    assert (first.arrival_s, first.prompt_len, first.output_len) == (0.0, 40160, 6)
    assert first.hash_ids == tuple(range(79))  # one hash per 512-token block of 40,160 tokens
    assert trace.records[-1].arrival_s == pytest.approx(1022.025)


def test_length_only_traces_read_every_row_without_arrivals(sharegpt):
    arxiv = read_trace(DATA / "arxiv_summarization_lengths_llama2tok.csv")
    assert (sharegpt.format, len(sharegpt)) == ("lengths", 30_731)
    assert (arxiv.format, len(arxiv)) == ("lengths", 28_257)
    assert not sharegpt.has_arrivals
    assert sharegpt.records[0].arrival_s is None
    assert (sharegpt.records[0].prompt_len, sharegpt.records[0].output_len) == (74, 918)
    assert (arxiv.records[0].prompt_len, arxiv.records[0].output_len) == (3772, 54)


# ---- any file of these formats ---------------------------------------------------------------


def test_azure_timestamps_keep_all_seven_digits_across_midnight(tmp_path):
    path = write(
        tmp_path,
        "a.csv",
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2023-11-16 23:59:59.9999999,10,1\n"
        "2023-11-17 00:00:00.0000001,20,2\n",
    )
    records = read_trace(path).records
    assert records[1].arrival_s == pytest.approx(2e-7, abs=1e-12)


def test_azure_columns_by_name_zones_honoured_and_arrivals_from_the_earliest(tmp_path):
    path = write(
        tmp_path,
        "b.csv",
        "GeneratedTokens, TIMESTAMP ,ContextTokens\n"
        "5,2024-05-10 02:00:03+02:00,50\n"  # 00:00:03 UTC
        "7,2024-05-10T00:00:01.5Z,70\n",
    )
    records = read_trace(path).records
    assert [(r.arrival_s, r.prompt_len, r.output_len) for r in records] == [
        (1.5, 50, 5),
        (0.0, 70, 7),
    ]


def test_burstgpt_rows_of_every_model_and_log_type_read_with_arrivals_from_the_earliest(tmp_path):
    # BurstGPT's columns (HPMLL/BurstGPT); a failed request (0 response tokens) is kept: it arrived
    path = write(
        tmp_path,
        "burst.csv",
        "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
        "12,ChatGPT,600,40,640,Conversation log\n"
        "12.5,GPT-4,1200,0,1200,API log\n"
        "30,\"ChatGPT\",90,310,400,Conversation log\n",
    )
    trace = read_trace(path)
    assert trace.format == "burstgpt" and trace.has_arrivals
    assert [(r.arrival_s, r.prompt_len, r.output_len) for r in trace.records] == [
        (0.0, 600, 40), (0.5, 1200, 0), (18.0, 90, 310)]


def test_mooncake_and_length_files_of_any_size(tmp_path):
    moon = write(
        tmp_path,
        "m.jsonl",
        mooncake_line(0, 600, 5, "[7, 8]") + '{"timestamp": 1500, "input_length": 3, '
        '"output_length": 1}\n\n',
    )
    records = read_trace(moon).records
    assert [(r.arrival_s, r.prompt_len, r.hash_ids) for r in records] == [
        (0.0, 600, (7, 8)),
        (1.5, 3, ()),
    ]
    lengths = write(
        tmp_path, "l.csv", "num_prefill_tokens,num_decode_tokens,num_total_tokens,pd_ratio\n"
        "12,3,15,4.0\n"
    )
    assert read_trace(lengths).records[0].prompt_len == 12


def test_every_format_counts_arrivals_from_its_earliest_row(tmp_path):
    # a Mooncake trace may count its milliseconds from an epoch or start late: its first request
    # arrives at 0 s as an Azure or BurstGPT trace's does (a replay window starts at 0)
    epoch = 1_715_299_200_000
    moon = write(tmp_path, "late.jsonl", mooncake_line(epoch + 2500, 10, 2, "[]") + mooncake_line(epoch + 500, 20, 3, "[]"))
    trace = read_trace(moon)
    assert [(r.arrival_s, r.prompt_len) for r in trace.records] == [(2.0, 10), (0.0, 20)]
    requests = build_requests(trace, ReplaySpec(max_tokens="fixed:64", duration_s=10))
    assert [(r.arrival_s, r.prompt_len) for r in requests] == [(0.0, 20), (2.0, 10)]


def test_vidur_traces_with_arrived_at_replay_their_own_arrivals(tmp_path):
    # vidur's processed traces (splitwise_conv.csv) add the arrival in seconds to the length-only columns
    path = write(tmp_path, "splitwise.csv", "arrived_at,num_prefill_tokens,num_decode_tokens\n"
                                            "3.5,374,44\n4.25,396,109\n")
    trace = read_trace(path)
    assert trace.format == "vidur" and trace.has_arrivals
    assert [(r.arrival_s, r.prompt_len, r.output_len) for r in trace.records] == [(0.0, 374, 44), (0.75, 396, 109)]
    with pytest.raises(TraceError, match=r"splitwise2\.csv:3: bad timestamp 'soon'"):
        read_trace(write(tmp_path, "splitwise2.csv", "arrived_at,num_prefill_tokens,num_decode_tokens\n"
                                                     "0,1,1\nsoon,2,2\n"))


def test_a_count_past_any_request_is_refused_by_line_not_overflowing_the_columns(tmp_path):
    with pytest.raises(TraceError, match=r"huge\.csv:3: token count num_prefill_tokens=99999999999999999999999 is past"):
        read_trace(write(tmp_path, "huge.csv", "num_prefill_tokens,num_decode_tokens\n5,3\n99999999999999999999999,3\n"))
    with pytest.raises(TraceError, match=r"huge\.jsonl:1: token count input_length=\d+ is past"):
        read_trace(write(tmp_path, "huge.jsonl", mooncake_line(0, 10**20, 3)))


def test_csv_fields_may_be_quoted_with_commas_and_line_breaks_inside(tmp_path):
    path = write(
        tmp_path,
        "q.csv",
        'num_prefill_tokens,num_decode_tokens,note\n'
        '12,3,"short, with a comma"\n'
        '"40", 5, "two\nlines, and a comma"\n'
        '7,2,plain\n',
    )
    assert [(r.prompt_len, r.output_len) for r in read_trace(path).records] == [(12, 3), (40, 5), (7, 2)]
    azure = write(tmp_path, "qa.csv", 'TIMESTAMP,ContextTokens,GeneratedTokens,Note\n'
                                      '"2023-11-16 18:00:00",4,3,"a, b"\n"2023-11-16 18:00:02",6,1,c\n')
    assert [(r.arrival_s, r.prompt_len) for r in read_trace(azure).records] == [(0.0, 4), (2.0, 6)]


def test_after_a_record_that_spans_lines_errors_still_name_the_right_line(tmp_path):
    path = write(tmp_path, "span.csv", 'num_prefill_tokens,num_decode_tokens,note\n1,1,"a\nb\nc"\n\n2,x,d\n')
    with pytest.raises(TraceError, match=r"span\.csv:6: non-integer token count num_decode_tokens='x'"):
        read_trace(path)
    broken = write(tmp_path, "quote.csv", 'num_prefill_tokens,num_decode_tokens,note\n1,1,ok\n2,2,"never closed\n')
    with pytest.raises(TraceError, match=r"quote\.csv:3: malformed line: unexpected end of data"):
        read_trace(broken)


@pytest.mark.parametrize(
    "name, text, line, problem",
    [
        ("few.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:00:00,1,1\n"
         "2023-11-16 18:00:01,5\n", 3, "expected 3 fields, got 2"),
        ("frac.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:00:00,12.5,1\n",
         2, "non-integer token count ContextTokens='12.5'"),
        ("neg.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:00:00,4,-3\n",
         2, "negative token count GeneratedTokens=-3"),
        ("empty_field.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:00:00,,3\n",
         2, "missing field ContextTokens"),
        ("time.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\nyesterday,4,3\n",
         2, "bad timestamp 'yesterday'"),
        ("month.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-13-01 00:00:00,4,3\n",
         2, "bad timestamp"),
        ("json.jsonl", mooncake_line(0, 1, 1) + "\n{not json\n", 3, "not JSON"),
        ("key.jsonl", '{"timestamp": 0, "input_length": 4}\n', 1,
         "missing field 'output_length'"),
        ("neg.jsonl", mooncake_line(0, -4, 1), 1, "negative token count input_length=-4"),
        ("stamp.jsonl", mooncake_line('"soon"', 4, 1), 1, "bad timestamp"),
        ("list.jsonl", mooncake_line(0, 4, 1) + "[1, 2]\n", 2, "not a JSON object"),
        ("hash.jsonl", mooncake_line(0, 4, 1, '["a"]'), 1, "bad hash_ids"),
        ("len.csv", "num_prefill_tokens,num_decode_tokens\n3,abc\n", 2,
         "non-integer token count num_decode_tokens='abc'"),
        ("what.csv", "time,prompt,output\n0,1,1\n", 1, "unknown trace format"),
        ("burst.csv", "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
         "5,ChatGPT,4,3,7,API log\n-1,ChatGPT,4,3,7,API log\n", 3, "bad timestamp '-1'"),
        ("burst2.csv", "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
         "5,ChatGPT,4,x,7,API log\n", 2, "non-integer token count Response tokens='x'"),
        ("header.csv", "num_prefill_tokens,num_decode_tokens\n", 1, "header but no records"),
        # found by review: a trace hashed in smaller blocks (Dynamo's converter's 128) read as Mooncake's 512
        ("small.jsonl", mooncake_line(0, 600, 1, "[1, 2, 3, 4, 5]"), 1,
         "bad hash_ids: 5 for 600 input tokens, where a mooncake hash id covers 512 tokens (at most 2)"),
        ("huge.jsonl", mooncake_line("1" + "0" * 400, 4, 1), 1, "bad timestamp '1000"),
        ("array.json", '[\n  {"timestamp": 0, "input_length": 4, "output_length": 1}\n]\n', 1,
         "a JSON array: a JSON trace is read as JSONL, one object a line"),
        ("pretty.jsonl", '{\n  "timestamp": 0,\n  "input_length": 4,\n  "output_length": 1\n}\n', 1,
         "not JSON (Expecting property name enclosed in double quotes; a JSONL trace holds one object a line)"),
        ("tabs.tsv", "TIMESTAMP\tContextTokens\tGeneratedTokens\n2023-11-16 18:00:00\t4\t3\n", 1,
         "its columns look separated by tabs or semicolons, where CSV traces are read comma-separated"),
        ("tar.csv", "trace.csv\x00\x00\x00ustar\n", 1, "binary data, not a text trace (a tar archive?"),
    ],
)
def test_a_bad_line_fails_the_read_naming_file_and_line(tmp_path, name, text, line, problem):
    path = write(tmp_path, name, text)
    with pytest.raises(TraceError) as caught:
        read_trace(path)
    assert str(caught.value).startswith(f"{path}:{line}: ")
    assert problem in str(caught.value)
    assert caught.value.line == line


@pytest.mark.parametrize("text", ["", "\n  \n"])
def test_an_empty_file_is_an_error(tmp_path, text):
    path = write(tmp_path, "empty.csv", text)
    with pytest.raises(TraceError, match="empty file") as caught:
        read_trace(path)
    assert str(path) in str(caught.value)


def test_a_missing_file_is_a_trace_error(tmp_path):
    with pytest.raises(TraceError, match="no such file"):
        read_trace(tmp_path / "absent.csv")


@pytest.mark.parametrize("start, problem", [
    (b"\xfd7zXZ\x00\x00", "an xz file: traces are read as text or gzip; decompress it first"),
    (b"BZh91AY&SY", "a bzip2 file"), (b"PK\x03\x04\x14\x00", "a zip file"), (b"\x28\xb5\x2f\xfd\x00", "a zstd file"),
    ("TIMESTAMP,ContextTokens,GeneratedTokens\n".encode("utf-16"),
     "UTF-16 text: traces are read as UTF-8 (iconv -f UTF-16 -t UTF-8 converts it)"),
    (b",,\n , ,\n", "no header: every line holds only empty fields"),
])
def test_files_that_are_not_a_text_trace_say_what_they_are(tmp_path, start, problem):
    # found by review: other compressors' files and UTF-16 all read as "not UTF-8 text", and a file of
    # empty fields ended in a StopIteration traceback
    path = tmp_path / "trace.csv"
    path.write_bytes(start)
    with pytest.raises(TraceError) as caught:
        read_trace(path)
    assert str(caught.value) == f"{path}: {problem}" or problem in str(caught.value)


def test_a_file_that_cannot_be_opened_is_a_trace_error(tmp_path, monkeypatch):
    # found by review: a trace another user owns (permission denied) ended in a traceback
    import env.workloads.traces as traces

    def denied(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(traces, "open", denied, raising=False)
    with pytest.raises(TraceError, match=r"theirs\.csv: cannot be read \(permission denied\)"):
        read_trace(tmp_path / "theirs.csv")


def test_qwen_bailian_traces_read_in_seconds_with_their_16_token_hash_blocks(tmp_path):
    # found by review: alibaba-edu/qwen-bailian-usagetraces-anon's rows (Mooncake's fields, a chat's own, seconds,
    # 16-token SipHash blocks) were read as Mooncake's, 1000 times compressed and hashed in 512-token blocks
    rows = [{"chat_id": 159, "parent_chat_id": -1, "timestamp": 61.114, "input_length": 40, "output_length": 132,
             "type": "text", "turn": 1, "hash_ids": [1089, 1090, 1091]},
            {"chat_id": 160, "parent_chat_id": 159, "timestamp": 62.5, "input_length": 60, "output_length": 80,
             "type": "text", "turn": 2, "hash_ids": [1089, 1090, 1091, 1092]}]
    path = write(tmp_path, "qwen_traceA_blksz_16.jsonl", "".join(json.dumps(r) + "\n" for r in rows))
    trace = read_trace(path)
    assert trace.format == "bailian" and trace.hash_block_tokens == 16
    assert [r.arrival_s for r in trace.records] == pytest.approx([0.0, 1.386])
    assert trace.records[1].hash_ids == (1089, 1090, 1091, 1092)
    with pytest.raises(TraceError, match=r":1: bad hash_ids: 3 for 20 input tokens, where a bailian hash id covers 16"):
        read_trace(write(tmp_path, "cut.jsonl", json.dumps({**rows[0], "input_length": 20}) + "\n"))


# ---- replay rules ----------------------------------------------------------------------------


@pytest.fixture
def five_moon(tmp_path):
    """Arrivals at 40, 0, 10, 30, 20 s (file order is not arrival order)."""
    times = [40, 0, 10, 30, 20]
    return read_trace(write(tmp_path, "five.jsonl", "".join(
        mooncake_line(t * 1000, 100 + i, 10 + i) for i, t in enumerate(times)
    )))


def test_window_and_time_scale_compress_the_chosen_span(five_moon):
    spec = ReplaySpec("scale:1", time_scale=2, start_s=10, duration_s=20)
    requests = build_requests(five_moon, spec)
    assert [(r.request_id, r.arrival_s) for r in requests] == [("five-2", 0.0), ("five-4", 5.0)]


def test_requests_are_sorted_by_arrival_and_limited(five_moon):
    requests = build_requests(five_moon, ReplaySpec("scale:1", limit=3))
    assert [r.request_id for r in requests] == ["five-1", "five-2", "five-4"]
    assert [r.arrival_s for r in requests] == [0.0, 10.0, 20.0]


def test_clipping_to_max_model_len(tmp_path):
    trace = read_trace(write(tmp_path, "c.jsonl", mooncake_line(0, 1100, 50, "[1, 2, 3]")
                             + mooncake_line(1, 60, 70)))
    long, mid = build_requests(trace, ReplaySpec("fixed:1000", max_model_len=100))
    assert (long.prompt_len, long.output_len, long.max_tokens) == (99, 1, 1)
    assert long.hash_ids == (1,)  # 99 tokens fill only the first 512-token block
    assert (mid.prompt_len, mid.output_len, mid.max_tokens) == (60, 40, 40)


def test_max_tokens_rules(five_moon):
    outputs = [10, 11, 12, 13, 14]  # by row
    fixed = {r.request_id: r.max_tokens for r in build_requests(five_moon, ReplaySpec("fixed:12"))}
    assert [fixed[f"five-{i}"] for i in range(5)] == [12, 12, 12, 13, 14]  # never below output
    scaled = build_requests(five_moon, ReplaySpec("scale:1.1"))
    by_row = {r.request_id: r.max_tokens for r in scaled}
    assert [by_row[f"five-{i}"] for i in range(5)] == [math.ceil(o * 1.1 - 1e-9) for o in outputs]
    assert by_row["five-0"] == 11  # exact decimal arithmetic: 1.1 x 10 is 11, not 12


@given(
    prompt=st.integers(0, 100_000),
    output=st.integers(0, 10_000),
    max_model_len=st.integers(2, 50_000),
    rule=st.sampled_from(["fixed:1", "fixed:2048", "scale:1", "scale:0.5", "scale:3.7"]),
)
def test_fitted_lengths_and_declared_limits_always_fit(prompt, output, max_model_len, rule):
    fitted_prompt, fitted_output = clip_lengths(prompt, output, max_model_len)
    declared = MaxTokensRule.parse(rule).declare(fitted_prompt, fitted_output, max_model_len)
    assert 1 <= fitted_prompt <= max_model_len - 1
    assert 1 <= fitted_output <= declared <= max_model_len - fitted_prompt
    assert fitted_prompt == min(max(prompt, 1), max_model_len - 1)


def test_length_only_traces_get_seeded_poisson_arrivals(sharegpt):
    spec = ReplaySpec("fixed:2048", rate_rps=5.0, seed=3)
    first, again = build_requests(sharegpt, spec), build_requests(sharegpt, spec)
    other = build_requests(sharegpt, ReplaySpec("fixed:2048", rate_rps=5.0, seed=4))
    assert [r.arrival_s for r in first] == [r.arrival_s for r in again]
    assert [r.arrival_s for r in first] != [r.arrival_s for r in other]
    assert first[0].request_id == "sharegpt_8k_lengths_llama2tok-0"  # file order kept
    assert len(first) / first[-1].arrival_s == pytest.approx(5.0, rel=0.03)


def test_arrivals_must_come_from_exactly_one_place(azure, sharegpt):
    with pytest.raises(ValueError, match="rate_rps is required"):
        build_requests(sharegpt, ReplaySpec("fixed:2048"))
    with pytest.raises(ValueError, match="rate_rps is for length-only"):
        build_requests(azure, ReplaySpec("fixed:2048", rate_rps=1.0))


@pytest.mark.parametrize(
    "field, value",
    [
        ("time_scale", 0), ("time_scale", -1.0), ("time_scale", float("nan")),
        ("start_s", -1.0), ("duration_s", 0.0), ("max_model_len", 1), ("max_model_len", 2.5),
        ("max_tokens", "fixed:0"), ("max_tokens", "fixed:abc"), ("max_tokens", "scale:-1"),
        ("max_tokens", "scale:nan"), ("max_tokens", "always"), ("rate_rps", 0.0),
        ("seed", -1), ("limit", 0),
    ],
)
def test_replay_spec_names_the_bad_field(field, value):
    arguments = {"max_tokens": "fixed:2048", field: value}
    with pytest.raises(ValueError, match=field):
        ReplaySpec(**arguments)


def test_describe_states_every_rule_on_one_line():
    text = ReplaySpec("fixed:2048", time_scale=4, start_s=60, duration_s=600,
                      max_model_len=4096, limit=100).describe()
    assert "\n" not in text
    for part in ["compressed 4x", "[60 s, 660 s)", "prompts clipped to 4095",
                 "prompt+output to 4096", "max_tokens fixed:2048", "first 100"]:
        assert part in text


# ---- synthetic workloads ---------------------------------------------------------------------


def counts_per_window(times: np.ndarray, window_s: float, duration_s: float) -> np.ndarray:
    return np.histogram(times, bins=np.arange(0.0, duration_s + window_s, window_s))[0]


def test_poisson_arrivals_keep_their_rate_over_a_long_horizon():
    times = PoissonArrivals(20.0).times(5_000.0, np.random.default_rng(0))
    assert np.all(np.diff(times) >= 0) and times[-1] < 5_000.0
    assert times.size / 5_000.0 == pytest.approx(20.0, rel=0.02)


def test_bursty_gamma_arrivals_vary_more_than_poisson_at_the_same_rate():
    rng = np.random.default_rng(1)
    poisson = counts_per_window(PoissonArrivals(10.0).times(20_000.0, rng), 10.0, 20_000.0)
    bursty = counts_per_window(GammaArrivals(10.0, cv=3.0).times(20_000.0, rng), 10.0, 20_000.0)
    assert bursty.mean() == pytest.approx(100.0, rel=0.05)
    assert poisson.var() / poisson.mean() == pytest.approx(1.0, abs=0.2)
    assert bursty.var() / bursty.mean() > 4.0  # renewal theory: tends to cv^2 = 9


def test_markov_modulated_arrivals_switch_between_rates():
    process = MarkovModulatedArrivals(rates=(1.0, 20.0), mean_dwell_s=(30.0, 10.0))
    times = process.times(40_000.0, np.random.default_rng(2))
    assert process.mean_rate == pytest.approx(5.75)
    assert times.size / 40_000.0 == pytest.approx(5.75, rel=0.1)
    counts = counts_per_window(times, 5.0, 40_000.0)
    assert counts.var() / counts.mean() > 3.0


def test_the_first_arrivals_do_not_depend_on_the_horizon():
    process = GammaArrivals(5.0, cv=2.0)
    short = process.times(100.0, np.random.default_rng(7))
    first = process.first(short.size + 10, np.random.default_rng(7))
    np.testing.assert_array_equal(first[: short.size], short)


def test_lognormal_lengths_have_the_stated_mean_within_bounds():
    rng = np.random.default_rng(3)
    values = LogNormalLengths(mean=500.0, sigma=1.0).sample(200_000, rng)
    assert values.dtype == np.int64 and values.min() >= 1
    assert values.mean() == pytest.approx(500.0, rel=0.03)
    clipped = LogNormalLengths(mean=500.0, sigma=1.0, low=50, high=800).sample(10_000, rng)
    assert clipped.min() == 50 and clipped.max() == 800


def test_bounded_pareto_lengths_are_long_tailed_within_bounds():
    alpha, low, high = 1.5, 10, 10_000
    values = ParetoLengths(alpha, low, high).sample(200_000, np.random.default_rng(4))
    assert low <= values.min() and values.max() <= high
    expected = (low**alpha / (1 - (low / high) ** alpha)) * alpha / (alpha - 1) * (
        low ** (1 - alpha) - high ** (1 - alpha)
    )
    assert values.mean() == pytest.approx(expected, rel=0.05)
    assert np.median(values) < values.mean() / 1.5


def workload(seed: int):
    return generate(
        arrivals=PoissonArrivals(2.0),
        prompt_lengths=LogNormalLengths(mean=800.0, sigma=1.0),
        output_lengths=ParetoLengths(1.2, 5, 3000),
        max_tokens_rule="fixed:1024",
        duration_s=300.0,
        rng=np.random.default_rng(seed),
        max_model_len=4096,
    )


def test_generated_requests_are_sorted_fitted_and_reproducible():
    requests = workload(5)
    arrivals = [r.arrival_s for r in requests]
    assert arrivals == sorted(arrivals) and 0 <= arrivals[0] and arrivals[-1] < 300.0
    assert [r.request_id for r in requests[:2]] == ["req-0", "req-1"]
    for r in requests:
        assert r.prompt_len + r.output_len <= 4096
        assert r.max_tokens == max(r.output_len, min(1024, 4096 - r.prompt_len))
    assert workload(5) == requests
    assert workload(6) != requests


def sessions(seed: int, duration_s: float = 20_000.0):
    return generate_sessions(
        session_arrivals=PoissonArrivals(0.2),
        mean_turns=4.0,
        mean_think_s=30.0,
        first_prompt_lengths=EmpiricalLengths([1000]),
        prompt_lengths=EmpiricalLengths([10]),
        output_lengths=LogNormalLengths(mean=100.0, sigma=0.5),
        max_tokens_rule="scale:2",
        duration_s=duration_s,
        rng=np.random.default_rng(seed),
    )


def test_sessions_have_ordered_turns_separated_by_think_time():
    requests = sessions(8)
    assert [r.arrival_s for r in requests] == sorted(r.arrival_s for r in requests)
    turns: dict[str, list] = {}
    for r in requests:
        turns.setdefault(r.session_id, []).append(r)
    gaps = []
    for session_id, session in turns.items():
        assert [r.request_id for r in session] == [
            f"{session_id}-t{k}" for k in range(len(session))
        ]
        # the opening turn brings the whole question, later turns only their new tokens
        assert [r.prompt_len for r in session] == [1000] + [10] * (len(session) - 1)
        gaps.extend(np.diff([r.arrival_s for r in session]))
    assert min(gaps) > 0
    assert np.mean(gaps) == pytest.approx(30.0, rel=0.05)
    assert len(requests) / len(turns) == pytest.approx(4.0, rel=0.05)
    assert sessions(8) == requests and sessions(9) != requests


@pytest.mark.parametrize(
    "make, name",
    [
        (lambda: PoissonArrivals(-1.0), "rate"),
        (lambda: GammaArrivals(1.0, cv=0.0), "cv"),
        (lambda: MarkovModulatedArrivals(rates=(1.0,), mean_dwell_s=(1.0,)), "rates"),
        (lambda: MarkovModulatedArrivals(rates=(1.0, -2.0), mean_dwell_s=(1, 1)), r"rates\[1\]"),
        (lambda: MarkovModulatedArrivals(rates=(1.0, 2.0), mean_dwell_s=(1, 0)), "mean_dwell_s"),
        (lambda: LogNormalLengths(mean=0.0, sigma=1.0), "mean"),
        (lambda: LogNormalLengths(mean=10.0, sigma=-1.0), "sigma"),
        (lambda: ParetoLengths(0.0, 1, 10), "alpha"),
        (lambda: ParetoLengths(1.0, 10, 5), "high"),
        (lambda: EmpiricalLengths([]), "values"),
    ],
)
def test_bad_distribution_arguments_are_named(make, name):
    with pytest.raises(ValueError, match=name):
        make()


@pytest.mark.parametrize(
    "change, name",
    [
        ({"duration_s": 0.0}, "duration_s"),
        ({"rng": np.random.RandomState(0)}, "rng"),
        ({"max_tokens_rule": "fixed:-2"}, "max_tokens_rule"),
        ({"max_model_len": 1}, "max_model_len"),
        ({"mean_turns": 0.5}, "mean_turns"),
        ({"mean_think_s": -1.0}, "mean_think_s"),
    ],
)
def test_bad_generator_arguments_are_named(change, name):
    arguments = dict(
        session_arrivals=PoissonArrivals(1.0), mean_turns=2.0, mean_think_s=5.0,
        prompt_lengths=EmpiricalLengths([10]), output_lengths=EmpiricalLengths([10]),
        max_tokens_rule="fixed:10", duration_s=10.0, rng=np.random.default_rng(0),
    )
    with pytest.raises(ValueError, match=name):
        generate_sessions(**{**arguments, **change})


def test_a_whole_token_count_written_with_a_point_reads_as_in_json(tmp_path):
    csv = read_trace(write(tmp_path, "pandas.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n"
                                                   "2023-11-16 18:00:00,1000.0,12.\n"))
    jsonl = read_trace(write(tmp_path, "pandas.jsonl", mooncake_line(0, 1000.0, 12.0)))
    assert [(r.prompt_len, r.output_len) for r in csv.records] == [(1000, 12)]
    assert [(r.prompt_len, r.output_len) for r in jsonl.records] == [(1000, 12)]


def test_a_gzip_compressed_trace_reads_as_the_plain_one(tmp_path):
    import gzip

    text = "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:00:00,40,5\n2023-11-16 18:00:02,30,6\n"
    plain = read_trace(write(tmp_path, "t.csv", text))
    packed = tmp_path / "t.csv.gz"
    packed.write_bytes(gzip.compress(text.encode()))
    assert read_trace(packed).records == plain.records and read_trace(packed).format == "azure"
    # told by its first bytes, not its name; request ids name the trace without the .gz
    (tmp_path / "named-plain.csv").write_bytes(packed.read_bytes())
    assert read_trace(tmp_path / "named-plain.csv").records == plain.records
    assert [r.request_id for r in build_requests(read_trace(packed), ReplaySpec("fixed:100"))] == ["t-0", "t-1"]
    cut = tmp_path / "cut.csv.gz"
    cut.write_bytes(packed.read_bytes()[:-12])
    with pytest.raises(TraceError, match=r"cut\.csv\.gz: a gzip file that does not decompress"):
        read_trace(cut)
