"""``rlctl bench``: benchmarks that report each figure as a ratio against a reference measured in
the same run (engine: decode and compaction; env: environment steps/s; sidecar: decision latency)."""
from __future__ import annotations

from rlctl.bench.engine import BenchSizes, bench_engine
from rlctl.bench.env import EnvBenchSizes, bench_env
from rlctl.bench.sidecar import SidecarBenchSizes, bench_sidecar

BENCHMARKS = ("engine", "env", "sidecar")


def run_bench(what: str, sizes: BenchSizes | EnvBenchSizes | SidecarBenchSizes | None = None,
              device: str | None = None) -> dict:
    """Run the benchmark named ``what`` and return its report (JSON-ready). ``sizes`` is a
    ``BenchSizes`` for ``engine``, an ``EnvBenchSizes`` for ``env``, a ``SidecarBenchSizes`` for
    ``sidecar`` (``device`` is the engine bench's; the env and sidecar benches are CPU only)."""
    if what == "engine":
        if sizes is not None and not isinstance(sizes, BenchSizes):
            raise ValueError(f"bench engine: sizes must be BenchSizes, got {type(sizes).__name__}")
        return bench_engine(sizes, device)
    if what == "env":
        if sizes is not None and not isinstance(sizes, EnvBenchSizes):
            raise ValueError(f"bench env: sizes must be EnvBenchSizes, got {type(sizes).__name__}")
        return bench_env(sizes)
    if what == "sidecar":
        if sizes is not None and not isinstance(sizes, SidecarBenchSizes):
            raise ValueError(f"bench sidecar: sizes must be SidecarBenchSizes, got {type(sizes).__name__}")
        return bench_sidecar(sizes)
    raise ValueError(f"unknown benchmark {what!r} (known: {', '.join(BENCHMARKS)})")
