"""How raw lengths become a Request: fitting them to the model's context and declaring max_tokens.

Traces and generators both record what a request really generated; the limit its client declared
is not in the data, so every workload states a rule for it. Keeping that rule here means a replay
and a synthetic workload with the same rule declare the same limits.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation

import numpy as np

from engine.request import Request


@dataclass(frozen=True)
class MaxTokensRule:
    """A rule for the declared ``max_tokens``, written ``"fixed:N"`` or ``"scale:X"``.

    ``fixed:N`` is a service cap: every request declares N. ``scale:X`` declares
    ceil(X × real output). Either way the declared limit is at least the real output (a client
    never generates past its own limit) and at most ``max_model_len - prompt`` (what fits).
    """

    text: str
    fixed: int | None = None
    scale: Decimal | None = None  # Decimal so that "scale:1.1" of 10 tokens is 11, not 12

    @classmethod
    def parse(cls, text: str, name: str = "max_tokens") -> MaxTokensRule:
        """Parse ``text``; a ValueError naming ``name`` says what is wrong with it."""
        kind, _, value = str(text).partition(":")
        if kind == "fixed":
            if re.fullmatch(r"[0-9]+", value.strip()) and int(value) >= 1:
                return cls(text=text, fixed=int(value))
            raise ValueError(f"{name}: 'fixed:N' needs an integer N >= 1, got {text!r}")
        if kind == "scale":
            try:
                factor = Decimal(value.strip())
            except InvalidOperation:
                factor = Decimal("NaN")
            if factor.is_finite() and factor > 0:
                return cls(text=text, scale=factor)
            raise ValueError(f"{name}: 'scale:X' needs a finite number X > 0, got {text!r}")
        raise ValueError(f"{name} must be 'fixed:N' or 'scale:X', got {text!r}")

    def declare(self, prompt_len: int, output_len: int, max_model_len: int | None) -> int:
        """The declared max_tokens for a request whose lengths already fit ``max_model_len``."""
        if self.fixed is not None:
            declared = self.fixed
        else:
            declared = math.ceil(self.scale * output_len)
        declared = max(declared, output_len, 1)
        if max_model_len is not None:
            declared = min(declared, max_model_len - prompt_len)
        return declared


def clip_lengths(prompt_len: int, output_len: int, max_model_len: int | None) -> tuple[int, int]:
    """Fit lengths to the model: prompt <= max_model_len - 1, prompt + output <= max_model_len.

    Both are raised to at least one token: an engine cannot serve an empty prompt and always
    produces the first token, so a zero in a trace means "as little as possible".
    """
    prompt_len, output_len = max(prompt_len, 1), max(output_len, 1)
    if max_model_len is not None:
        prompt_len = min(prompt_len, max_model_len - 1)
        output_len = min(output_len, max_model_len - prompt_len)
    return prompt_len, output_len


def clip_length_arrays(prompt_lens, output_lens, max_model_len: int):
    """``clip_lengths`` over numpy arrays of lengths, as a whole trace's: the same rule, elementwise."""
    prompts = np.minimum(np.maximum(prompt_lens, 1), max_model_len - 1)
    return prompts, np.minimum(np.maximum(output_lens, 1), max_model_len - prompts)


def sized_request(
    request_id: str,
    arrival_s: float,
    prompt_len: int,
    output_len: int,
    rule: MaxTokensRule,
    max_model_len: int | None,
    session_id: str | None = None,
    hash_ids: tuple[int, ...] = (),
    hash_block_tokens: int | None = None,
) -> Request:
    """A Request with clipped lengths and the max_tokens that ``rule`` declares for them."""
    prompt_len, output_len = clip_lengths(int(prompt_len), int(output_len), max_model_len)
    return Request(
        request_id=request_id,
        arrival_s=float(arrival_s),
        prompt_len=prompt_len,
        output_len=output_len,
        max_tokens=rule.declare(prompt_len, output_len, max_model_len),
        session_id=session_id,
        hash_ids=tuple(hash_ids),
        hash_block_tokens=hash_block_tokens if hash_ids else None,
    )
