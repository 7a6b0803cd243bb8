"""How long an iteration or a KV copy takes, when a ``ProfiledExecutor`` does not measure it.

A linear model: an iteration costs a fixed overhead, a cost per batched token (the weights'
work) and a cost per context token read by attention; a copy costs a fixed overhead plus bytes
over a bandwidth. ``source`` says where the numbers come from (stated, fitted, roofline), so
that a result can say whether its clock was measured or modelled.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CostModel:
    fixed_s: float
    per_token_s: float
    per_context_token_s: float
    copy_fixed_s: float
    copy_bytes_per_s: float
    source: str = "stated"

    def __post_init__(self) -> None:
        for name in ("fixed_s", "per_token_s", "per_context_token_s", "copy_fixed_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.copy_bytes_per_s <= 0:
            raise ValueError(f"copy_bytes_per_s must be > 0, got {self.copy_bytes_per_s}")

    def iteration_s(self, num_tokens: int, context_tokens: int) -> float:
        return self.fixed_s + self.per_token_s * num_tokens + self.per_context_token_s * context_tokens

    def copy_s(self, nbytes: int) -> float:
        return self.copy_fixed_s + nbytes / self.copy_bytes_per_s if nbytes else 0.0
