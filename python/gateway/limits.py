"""Per-key request and token limits (SPEC §7 429 `rate_limited`; issue: tenants and limits).

Each limited key has two token buckets refilled continuously — requests per minute and tokens
per minute — which allow a burst of one minute's worth and then the configured rate, as
OpenAI's limits behave. Tokens are estimated at admission (prompt characters / 4 plus the
requested completion budget) and reconciled with the upstream's `usage` afterwards, so a
tenant is charged what it really used. Headers follow OpenAI's `x-ratelimit-*` names.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gateway.errors import RateLimited as _RateLimited
from gateway.messages import message_chars

__all__ = ["KeyLimits", "estimate_tokens", "prompt_tokens"]

# What a request without max_tokens is assumed to generate until usage says otherwise.
DEFAULT_COMPLETION_ESTIMATE = 256


def prompt_tokens(body: Mapping[str, Any]) -> int:
    """The prompt's tokens, estimated at ~4 characters a token (also the latency model's
    input size, SPEC §17)."""
    chars = message_chars(body.get("messages"))
    for field in ("prompt", "input"):
        value = body.get(field)
        if isinstance(value, str):
            chars += len(value)
        elif isinstance(value, list):
            chars += sum(len(v) for v in value if isinstance(v, str))
    return chars // 4 + 1


def estimate_tokens(body: Mapping[str, Any]) -> int:
    """A cheap upper-ish estimate: ~4 characters per prompt token plus the completion budget."""
    budget = body.get("max_completion_tokens") or body.get("max_tokens")
    if not isinstance(budget, int) or budget < 0:
        budget = 0 if "input" in body else DEFAULT_COMPLETION_ESTIMATE
    return prompt_tokens(body) + budget


def _reset_text(seconds: float) -> str:
    """OpenAI's reset format: `1s`, `6m0s`, `850ms`."""
    if seconds < 1:
        return f"{max(1, math.ceil(seconds * 1000))}ms"
    whole = math.ceil(seconds)
    minutes, secs = divmod(whole, 60)
    return f"{minutes}m{secs}s" if minutes else f"{secs}s"


@dataclass(slots=True)
class _Bucket:
    per_minute: float
    level: float
    stamp: float

    def refill(self, now: float) -> None:
        self.level = min(self.per_minute, self.level + (now - self.stamp) * self.per_minute / 60)
        self.stamp = now

    def wait_for(self, amount: float) -> float:
        """Seconds until `amount` is available (inf if it can never be)."""
        if amount > self.per_minute:
            return math.inf
        return max(0.0, (amount - self.level) * 60 / self.per_minute)

    def until_full(self) -> float:
        return (self.per_minute - self.level) * 60 / self.per_minute


class KeyLimits:
    """The buckets of one API key."""

    def __init__(self, rpm: int | None, tpm: int | None) -> None:
        now = time.monotonic()
        self.rpm, self.tpm = rpm, tpm
        self._requests = _Bucket(rpm, rpm, now) if rpm else None
        self._tokens = _Bucket(tpm, tpm, now) if tpm else None

    def same_limits(self, rpm: int | None, tpm: int | None) -> bool:
        return (self.rpm, self.tpm) == (rpm, tpm)

    def admit(self, estimate: int) -> tuple[int, dict[str, str]]:
        """Charges one request and `estimate` tokens; returns the tokens charged and the
        `x-ratelimit-*` headers. Raises `RateLimited` (429) and charges nothing when over."""
        now = time.monotonic()
        req, tok = self._requests, self._tokens
        if req is not None:
            req.refill(now)
        if tok is not None:
            tok.refill(now)
            # A request larger than the whole minute budget is charged the budget: it could
            # otherwise never pass.
            estimate = min(estimate, int(tok.per_minute))
        wait = 0.0
        which = ""
        if req is not None and req.level < 1:
            wait, which = req.wait_for(1), "requests"
        if tok is not None and tok.level < estimate:
            tok_wait = tok.wait_for(estimate)
            if tok_wait > wait:
                wait, which = tok_wait, "tokens"
        if which:
            raise RateLimited(which, wait, self._headers())
        if req is not None:
            req.level -= 1
        if tok is not None:
            tok.level -= estimate
        return estimate, self._headers()

    def reconcile(self, charged: int, actual: int | None) -> None:
        """Replaces the admission estimate with the tokens really used."""
        if self._tokens is None or actual is None:
            return
        self._tokens.refill(time.monotonic())
        self._tokens.level = min(self._tokens.per_minute, self._tokens.level + charged - actual)

    def _headers(self) -> dict[str, str]:
        h: dict[str, str] = {}
        for name, bucket in (("requests", self._requests), ("tokens", self._tokens)):
            if bucket is None:
                continue
            h[f"x-ratelimit-limit-{name}"] = str(int(bucket.per_minute))
            h[f"x-ratelimit-remaining-{name}"] = str(max(0, math.floor(bucket.level)))
            h[f"x-ratelimit-reset-{name}"] = _reset_text(bucket.until_full())
        return h


def RateLimited(which: str, wait_s: float, headers: dict[str, str]) -> _RateLimited:
    """429 with Retry-After and the limit headers."""
    wait_ms = 60_000 if math.isinf(wait_s) else max(1, math.ceil(wait_s * 1000))
    return _RateLimited(
        f"Rate limit reached for {which} per minute on this API key; "
        f"retry after {_reset_text(wait_ms / 1000)}.",
        retry_after_ms=wait_ms,
        headers=headers,
    )
