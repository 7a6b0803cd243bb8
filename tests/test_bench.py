"""``rlctl bench engine`` runs end to end and reports what it promises; timings are never judged."""
from __future__ import annotations

import json

import pytest

from engine.config import ModelConfig
from rlctl.bench import BenchSizes, run_bench


def test_small_engine_bench_reports_every_figure_and_generates_what_transformers_does():
    pytest.importorskip("transformers")
    sizes = BenchSizes(decode_model=ModelConfig(), batch=4, prompt_len=16, new_tokens=6,
                       kv_model=ModelConfig(), kv_blocks=32, block_size=4, seq_blocks=2, repeats=1)
    report = run_bench("engine", sizes, device="cpu")

    json.dumps(report)  # the CLI prints it as JSON
    assert report["device"] == "cpu"
    for key in ("torch_version", "torch_threads", "repeats", "bench_s"):
        assert key in report
    decode = report["decode"]
    assert decode["batch"] == 4 and decode["prompt_len"] == 16 and decode["new_tokens"] == 6
    assert decode["decode_tokens"] == 4 * 5  # the first token of each comes from the prefill
    for key in ("engine_decode_tok_s", "hf_decode_tok_s", "ratio"):
        assert key in decode
    assert decode["tokens_identical"] is True

    compaction = report["compaction"]
    assert compaction["blocks_moved"] > 0
    assert compaction["bytes_moved"] == compaction["blocks_moved"] * compaction["block_bytes"]
    for key in ("compaction_bytes_per_s", "torch_copy_bytes_per_s", "ratio"):
        assert compaction[key] > 0
    assert compaction["compaction_kept_data"] is True

