"""scripts/gpu_check on a machine without CUDA: one JSON document, the GPU checks skipped with
"CUDA is not available", NVML's "no GPU" report, exit status 0. The same checks' code run on the
CPU (--cpu-dry-run) so that it keeps working where no GPU tests it; and a check past its time
budget is stopped and reported failed."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.gpu.checks import GPU_CHECKS, _child

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "gpu_check"


def run_script(*args: str, timeout: float) -> tuple[int, dict]:
    done = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout,
                          cwd=ROOT)
    return done.returncode, json.loads(done.stdout)  # the whole of stdout is one JSON document


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_without_cuda_the_gpu_checks_are_skipped_and_the_report_is_one_json_document():
    rc, report = run_script(timeout=120)
    assert rc == 0 and report["ok"] and report["failed"] == []
    checks = report["checks"]
    assert list(checks) == ["cuda", *GPU_CHECKS, "nvml", "mps"]
    for name in ("cuda", *GPU_CHECKS):
        assert checks[name]["status"] == "skipped" and checks[name]["reason"] == "CUDA is not available", name
    nvml = checks["nvml"]
    assert nvml["status"] == "skipped" and nvml["reason"].startswith("no GPU: ")
    assert nvml["report"] == {"name": "nvml", "applied": False, "detail": nvml["reason"], "value": None}
    assert checks["mps"]["status"] == "skipped" and checks["mps"]["reason"].startswith("MPS is not available")
    assert report["elapsed_s"] < 60


def test_the_gpu_checks_code_runs_on_the_cpu():
    rc, report = run_script("--cpu-dry-run", timeout=300)
    checks = report["checks"]
    assert rc == 0 and report["ok"], {n: c.get("error") for n, c in checks.items()}
    assert report["dry_run_on_cpu"]
    for name in GPU_CHECKS:
        assert checks[name]["status"] == "ok", name
    assert checks["torch_executor"]["bigger"]["all_served"]
    assert checks["torch_executor"]["moe"]["all_served"] and checks["torch_executor"]["moe"]["model"]["num_experts"] == 8
    oom = checks["oom_crash"]
    assert oom["oom_events"] == 1 and oom["requests_lost"] == [] and oom["pool_bytes_after_crash"] == 0
    # the ledger refuses the pool's next segment, or first the iteration's workspace (decodes of
    # unequal lengths read every layer's K/V expanded to all heads): on CUDA torch's OutOfMemoryError
    assert len(oom["oom_sources"]) == 1
    assert oom["oom_sources"][0] in ("kv pool growth: device ledger", "iteration workspace: device ledger")
    copy = checks["copy_bandwidth"]
    assert copy["compaction"]["kept_data"] and copy["swap_kept_data"] and copy["compaction"]["bytes_moved"] > 0


def test_a_check_past_its_budget_is_stopped_and_reported_failed():
    result = _child("torch_executor", budget_s=0.5, dry_run=True)
    assert result["status"] == "failed" and "time budget" in result["error"]
