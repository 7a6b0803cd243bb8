"""Workloads: the requests the engine serves, from real traces or synthetic generators."""
from env.workloads.arrivals import (
    ArrivalProcess,
    GammaArrivals,
    MarkovModulatedArrivals,
    PoissonArrivals,
)
from env.workloads.generators import generate, generate_phases, generate_sessions
from env.workloads.lengths import (
    EmpiricalLengths,
    LengthDistribution,
    LogNormalLengths,
    ParetoLengths,
)
from env.workloads.replay import ReplaySpec, build_requests
from engine.request import Request
from env.workloads.sizing import MaxTokensRule, clip_length_arrays, clip_lengths
from env.workloads.traces import FORMATS, Trace, TraceError, TraceRecord, bundled_trace, read_trace

__all__ = [
    "FORMATS",
    "ArrivalProcess",
    "EmpiricalLengths",
    "GammaArrivals",
    "LengthDistribution",
    "LogNormalLengths",
    "MarkovModulatedArrivals",
    "MaxTokensRule",
    "ParetoLengths",
    "PoissonArrivals",
    "ReplaySpec",
    "Request",
    "Trace",
    "TraceError",
    "TraceRecord",
    "build_requests",
    "bundled_trace",
    "clip_length_arrays",
    "clip_lengths",
    "generate",
    "generate_phases",
    "generate_sessions",
    "read_trace",
]
