"""Per-key request and token limits (SPEC §7 429 `rate_limited`; issue: tenants and limits).

Each limited key has two token buckets refilled continuously — requests per minute and tokens
per minute — which allow a burst of one minute's worth and then the configured rate, as
OpenAI's limits behave. Tokens are estimated at admission (prompt characters / 4 plus the
requested completion budget) and reconciled with the upstream's `usage` afterwards, so a
tenant is charged what it really used. Headers follow OpenAI's `x-ratelimit-*` names.
"""

from __future__ import annotations

import hashlib
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gateway import _core
from gateway.errors import RateLimited as _RateLimited
from gateway.messages import message_chars

__all__ = [
    "Buffered",
    "HostLimits",
    "KeyLimits",
    "SharedKeyLimits",
    "estimate_tokens",
    "prompt_tokens",
]

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


# ---- SPEC §12: the rules outside the scheduler, once per host across workers ---------------


class Buffered:
    """SPEC §16 request bytes held against `limits.max_buffered_bytes`. One process counts
    its own; a worker (SPEC §12 "`limits.max_buffered_bytes` (per host)") counts in the shared
    region, in its own word, so the bound holds for the host and a dead worker's bytes come
    back when the supervisor reclaims it."""

    __slots__ = ("_mine", "_region", "_slot")

    def __init__(self, region: _core.Region | None = None, slot: int = 0) -> None:
        self._region, self._slot = region, slot
        self._mine = 0

    def take(self, n: int, bound: int) -> bool:
        """Holds `n` more bytes if the total stays within `bound`."""
        if self._region is None:
            if self._mine + n > bound:
                return False
        elif not self._region.take_bytes(self._slot, n, bound):
            return False
        self._mine += n
        return True

    def fits(self, n: int, bound: int) -> bool:
        """Whether `n` more bytes would fit now (nothing is held)."""
        return self.total + n <= bound

    def give(self, n: int) -> None:
        self._mine -= n
        if self._region is not None:
            self._region.give_bytes(self._slot, n)

    @property
    def mine(self) -> int:
        return self._mine

    @property
    def total(self) -> int:
        """What the whole host holds (this process's own without workers)."""
        return self._mine if self._region is None else self._region.buffered


def key_id(name: str) -> int:
    """A key's identity in the region: a stable hash of its name (never the secret)."""
    return int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "little")


class SharedKeyLimits(KeyLimits):
    """SPEC §12 "per-key `rpm`/`tpm` (a key gets its limit once per gateway, not once per
    worker)": a key's two buckets in the workers' shared region (one GCRA word each, taken by
    CAS), with `KeyLimits`' interface and answers."""

    def __init__(
        self, region: _core.Region, slot: int, entry: int, rpm: int | None, tpm: int | None
    ) -> None:
        super().__init__(rpm, tpm)
        self._region, self._slot, self.entry = region, slot, entry

    def admit(self, estimate: int) -> tuple[int, dict[str, str]]:
        now = time.monotonic_ns() // 1000
        region, k = self._region, self.entry
        if self.tpm:
            # As one process's bucket: a request larger than the minute is charged the minute.
            estimate = min(estimate, self.tpm)
        if self.rpm:
            wait_us = region.take_bucket(k, False, 1, self.rpm, now)
            if wait_us:
                raise RateLimited("requests", _seconds(wait_us), self._headers_at(now))
        if self.tpm:
            wait_us = region.take_bucket(k, True, estimate, self.tpm, now)
            if wait_us:
                if self.rpm:  # nothing is charged for a refused request
                    region.refund_bucket(k, False, 1, self.rpm, now)
                raise RateLimited("tokens", _seconds(wait_us), self._headers_at(now))
        return estimate, self._headers_at(now)

    def reconcile(self, charged: int, actual: int | None) -> None:
        if not self.tpm or actual is None or actual == charged:
            return
        now = time.monotonic_ns() // 1000
        if actual < charged:
            self._region.refund_bucket(self.entry, True, charged - actual, self.tpm, now)
        else:
            self._region.charge_bucket(self.entry, True, actual - charged, self.tpm, now)

    def leave(self) -> None:
        """This worker no longer has the key configured (the last to leave frees its entry)."""
        self._region.leave_key(self.entry, self._slot)

    def _headers_at(self, now_us: int) -> dict[str, str]:
        h: dict[str, str] = {}
        for name, tokens, limit in (("requests", False, self.rpm), ("tokens", True, self.tpm)):
            if not limit:
                continue
            level = self._region.bucket_level(self.entry, tokens, limit, now_us)
            h[f"x-ratelimit-limit-{name}"] = str(limit)
            h[f"x-ratelimit-remaining-{name}"] = str(level)
            h[f"x-ratelimit-reset-{name}"] = _reset_text((limit - level) * 60 / limit)
        return h


def _seconds(wait_us: int) -> float:
    return math.inf if wait_us >= 2**64 - 1 else wait_us / 1e6


class HostLimits:
    """Which buckets a key's requests spend: its own `KeyLimits` in one process; with workers
    (SPEC §12) the key's entry in the region, joined on first use and left when a reload drops
    the key or changes its limits (SPEC §16: entries of keys nobody has are reclaimed). Keys
    the table cannot hold keep their per-process buckets."""

    def __init__(self, region: _core.Region | None = None, slot: int = 0) -> None:
        self._region, self._slot = region, slot
        self._shared: dict[str, SharedKeyLimits] = {}
        self._ring: object = None

    def of(self, name: str, limits: KeyLimits | None, ring: object) -> KeyLimits | None:
        """The buckets for key `name` whose per-process limits are `limits` under key ring
        `ring` (a reload makes a new ring: keys it dropped are left then)."""
        # Only plain per-key buckets move to the region (a cluster's leased limits stay).
        if self._region is None or limits is None or type(limits) is not KeyLimits:
            return limits
        if ring is not self._ring:
            self._ring = ring
            self._prune(ring)
        shared = self._shared.get(name)
        if shared is not None and shared.same_limits(limits.rpm, limits.tpm):
            return shared
        if shared is not None:
            shared.leave()
            del self._shared[name]
        entry = self._region.key_slot(key_id(name), self._slot)
        if entry is None:
            return limits  # the table is full: this process's own buckets
        shared = SharedKeyLimits(self._region, self._slot, entry, limits.rpm, limits.tpm)
        self._shared[name] = shared
        return shared

    def _prune(self, ring: object) -> None:
        tenants = getattr(ring, "tenants", None)
        if tenants is None:
            return
        kept = {t.name for t in tenants}
        for name in [n for n in self._shared if n not in kept]:
            self._shared.pop(name).leave()

    def __len__(self) -> int:
        return len(self._shared)
