"""Cluster-wide per-key limits (SPEC §13: "Per-key `rpm`/`tpm` limits are cluster-wide"), by
leased token chunks from a central bucket — with no Redis call per request.

Each limited key has, per dimension (requests, tokens), a central token bucket in Redis with
the local limiter's semantics (a minute's worth of burst, refilled continuously; see
`scripts.RATE_SYNC`). A replica admits only from the allowance it holds: `admit` spends it,
exactly like the local bucket, and the background sync tops it up by taking chunks from the
central bucket (or gives surplus back). The chunk it asks for follows its demand: what it
spent per second over the last sync times two sync periods, plus whatever it refused, at least
a standing allowance of `lease_ms` worth of the rate (so a lone request never waits for a
sync, and while the central bucket is full a part of it, so a burst passes at once). That is
the "leased chunks" row of the design's comparison: **never over the limit**
(every admitted request was paid from the central bucket), under-use bounded by the chunks
held; a replica that dies takes its unspent chunk with it (under-use, never excess).

Headers stay OpenAI's `x-ratelimit-*`: the limit as configured, remaining = this replica's
allowance plus the central level last seen (refilled since), reset = until that is full; a
429 carries `Retry-After` = the time until the tokens it lacks exist anywhere, at least one
sync period. TPM reserves the estimate at admission and settles with `usage`, as locally.

Redis unreachable: each replica refills its own allowance at `rate / N_last` (the static
share of SPEC §13, as for slots), capped at `limit / N_last`; back on Redis it returns what it
holds beyond its demand.

With `--workers N` (SPEC §12 × §13: "one Redis connection per host does the syncing, not one
per worker"; per-key limits "once per gateway") the replica is the host, and so is the
allowance: `HostLeasedLimits` keeps it in the key's entry of the workers' region (per dimension,
in thousandths). Every worker spends it by CAS, never below zero, and counts there what it spent
and was refused; only the host's member (`host.HostSeat`) tops it up from the central bucket,
sizing the chunk from those counts exactly as one replica does, gives surplus back, and on the
static share refills it at `rate / N_last` hosts. The allowance outlives the member: when the
role moves (a member killed with `kill -9`), the next one continues from it — what the dead one
took from Redis but never added is under-use, never excess.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from gateway.limits import KeyLimits, RateLimited, _Bucket, _reset_text, key_id

if TYPE_CHECKING:
    from gateway import _core
    from gateway.auth import KeyRing
    from gateway.cluster.redis_state import RedisState

__all__ = ["HostLeasedLimits", "LeasedLimits", "RateShare", "RateSync"]

#: The region counts a host's allowance in thousandths of a request or token.
_SCALE = 1000
#: A host's exchange with nothing to take or give back is left out, but the central level it
#: brings is never older than this (the headers' `remaining`, a 429's `Retry-After` and the
#: standing allowance read it).
_QUIET_MAX_S = 1.0
#: ... and while it holds at least this part of the allowance the chunk protocol sizes (two
#: periods of its spending at least: 3/4 of it lasts the period until the next look).
_QUIET_HELD = 0.75


@dataclass(slots=True)
class RateShare:
    """What every leased limit of the replica shares: the sync period, how to ask for a sync
    now, and the static divisor while Redis is unreachable."""

    interval_s: float
    standing_s: float
    nudge: Callable[[], None]
    static_replicas: int | None = None
    #: Live replicas at the last lease sync: an idle key's central bucket is shared among them.
    replicas: int = 1


@dataclass(slots=True)
class _Dim:
    """One leased dimension of a key: its local bucket's level is the allowance held."""

    suffix: str  # "r" requests, "t" tokens
    bucket: _Bucket
    central: float
    central_at: float
    used: float = 0.0
    refused: float = 0.0
    asked: float = 0.0

    @property
    def limit(self) -> float:
        return self.bucket.per_minute

    def central_now(self, now: float, static: bool) -> float:
        if static:
            return 0.0
        return min(self.limit, self.central + (now - self.central_at) * self.limit / 60)


class LeasedLimits(KeyLimits):
    """A key's limits spent from leased chunks (`KeyLimits`' interface, so the ingress and the
    key ring are unchanged)."""

    def __init__(self, name: str, rpm: int | None, tpm: int | None, share: RateShare) -> None:
        super().__init__(rpm, tpm)
        self.name = name
        self._share = share
        now = time.monotonic()
        self._dims: dict[str, _Dim] = {}
        for suffix, bucket in (("r", self._requests), ("t", self._tokens)):
            if bucket is not None:
                bucket.level, bucket.stamp = 0.0, now  # nothing held until the first chunk
                self._dims[suffix] = _Dim(suffix, bucket, bucket.per_minute, now)

    # ---- the request path (no I/O) ---------------------------------------------------------

    def admit(self, estimate: int) -> tuple[int, dict[str, str]]:
        now = time.monotonic()
        if self._share.static_replicas:
            self._refill_static(now)
        req, tok = self._dims.get("r"), self._dims.get("t")
        if tok is not None:
            estimate = min(estimate, int(tok.limit))
        wait, which = 0.0, ""
        if req is not None and req.bucket.level < 1:
            wait, which = self._wait(req, 1, now), "requests"
        if tok is not None and tok.bucket.level < estimate:
            tok_wait = self._wait(tok, estimate, now)
            if tok_wait > wait or not which:
                wait, which = tok_wait, "tokens"
        if which:
            if req is not None:
                req.refused += 1
            if tok is not None:
                tok.refused += estimate
            self._share.nudge()
            raise RateLimited(which, wait, self._headers_at(now))
        if req is not None:
            req.bucket.level -= 1
            req.used += 1
        if tok is not None:
            tok.bucket.level -= estimate
            tok.used += estimate
        return estimate, self._headers_at(now)

    def reconcile(self, charged: int, actual: int | None) -> None:
        tok = self._dims.get("t")
        if tok is None or actual is None:
            return
        tok.bucket.level = min(tok.limit, tok.bucket.level + charged - actual)
        tok.used += actual - charged

    def _wait(self, dim: _Dim, need: float, now: float) -> float:
        """Seconds until `need` exists anywhere (here or centrally), at least one sync."""
        static = self._share.static_replicas
        rate = dim.limit / (static or 1)
        have = dim.bucket.level + dim.central_now(now, bool(static))
        return max(self._share.interval_s, (need - have) * 60 / rate)

    def _headers_at(self, now: float) -> dict[str, str]:
        static = bool(self._share.static_replicas)
        h: dict[str, str] = {}
        for name, suffix in (("requests", "r"), ("tokens", "t")):
            dim = self._dims.get(suffix)
            if dim is None:
                continue
            left = min(dim.limit, max(0.0, dim.bucket.level + dim.central_now(now, static)))
            h[f"x-ratelimit-limit-{name}"] = str(int(dim.limit))
            h[f"x-ratelimit-remaining-{name}"] = str(math.floor(left))
            h[f"x-ratelimit-reset-{name}"] = _reset_text((dim.limit - left) * 60 / dim.limit)
        return h

    def _refill_static(self, now: float) -> None:
        """Redis unreachable: this replica's 1/N of the rate, refilled locally."""
        n = self._share.static_replicas or 1
        for dim in self._dims.values():
            b = dim.bucket
            cap = dim.limit / n
            grown = b.level + (now - b.stamp) * dim.limit / n / 60
            b.level = max(b.level, min(cap, grown))
            b.stamp = now

    # ---- the sync's side -------------------------------------------------------------------

    def restamp(self, now: float) -> None:
        for dim in self._dims.values():
            dim.bucket.stamp = now

    def exchange(self, elapsed_s: float) -> list[tuple[str, int, float]]:
        """What to take (> 0) or give back (< 0) per dimension at this sync. Given-back
        allowance leaves at once (if the call fails it is lost: under-use, never excess)."""
        out: list[tuple[str, int, float]] = []
        share = self._share
        for dim in self._dims.values():
            spent_rate = dim.used / max(elapsed_s, 1e-3)
            # A standing allowance: `lease_ms` of the rate, or while the central bucket is full
            # of unused tokens a half of this replica's part of them (bursts pass at once).
            standing = max(dim.limit / 60 * share.standing_s, dim.central / 2 / share.replicas)
            desired = min(dim.limit, max(standing, spent_rate * 2 * share.interval_s) + dim.refused)
            have = dim.bucket.level
            delta = 0.0
            if have < desired:
                delta = desired - have
            elif have > 2 * desired:
                delta = desired - have
                dim.bucket.level = desired
            dim.used = dim.refused = 0.0
            dim.asked = delta
            out.append((f"{self.name}|{dim.suffix}", int(dim.limit), round(delta, 6)))
        return out

    def settle(self, results: list[Any], now: float) -> None:
        """The script's `[granted, central level]` per dimension, in `exchange`'s order."""
        for dim, (granted, central) in zip(self._dims.values(), results, strict=True):
            dim.bucket.level += float(granted)
            dim.central, dim.central_at = float(central), now

    def view(self) -> dict[str, Any]:
        now = time.monotonic()
        static = bool(self._share.static_replicas)
        names = {"r": "requests", "t": "tokens"}
        return {
            names[d.suffix]: {
                "limit_per_minute": int(d.limit),
                "allowance": round(d.bucket.level, 3),
                "central": round(d.central_now(now, static), 3),
            }
            for d in self._dims.values()
        }


class HostLeasedLimits(KeyLimits):
    """A key's limits spent from its host's allowance in the region (see the module doc):
    `KeyLimits`' interface for the request path of every worker, `exchange`/`settle`/`refill`
    for the host's member."""

    def __init__(
        self,
        name: str,
        rpm: int | None,
        tpm: int | None,
        share: RateShare,
        region: _core.Region,
        entry: int,
    ) -> None:
        super().__init__(rpm, tpm)
        self.name = name
        self.entry = entry
        self._share = share
        self._region = region
        #: (suffix, tokens?, limit) per dimension configured.
        self._dims = [(s, t, lim) for s, t, lim in (("r", False, rpm), ("t", True, tpm)) if lim]
        #: The headers' names and fixed values per dimension (built on every request).
        self._heads = [
            (
                tokens,
                float(limit),
                60 / limit,
                str(limit),
                f"x-ratelimit-limit-{name}",
                f"x-ratelimit-remaining-{name}",
                f"x-ratelimit-reset-{name}",
            )
            for _, tokens, limit in self._dims
            for name in ("tokens" if tokens else "requests",)
        ]
        self._stamp = time.monotonic()  # the member's last static refill
        #: (spent, refused) per dimension drained by a quiet look, for the next exchange.
        self._carry: list[tuple[int, int]] = [(0, 0)] * len(self._dims)

    # ---- the request path of every worker (no I/O) -----------------------------------------

    def admit(self, estimate: int) -> tuple[int, dict[str, str]]:
        now = time.monotonic()
        region, k = self._region, self.entry
        if self.tpm:
            estimate = min(estimate, self.tpm)
        if self.rpm and not region.allowance_take(k, False, _SCALE):
            self._share.nudge()
            raise RateLimited(
                "requests", self._wait(False, self.rpm, 1, now), self._headers_at(now)
            )
        if self.tpm and not region.allowance_take(k, True, estimate * _SCALE):
            if self.rpm:  # nothing is charged for a refused request
                region.allowance_add(k, False, _SCALE, -_SCALE)
            self._share.nudge()
            raise RateLimited(
                "tokens", self._wait(True, self.tpm, estimate, now), self._headers_at(now)
            )
        return estimate, self._headers_at(now)

    def reconcile(self, charged: int, actual: int | None) -> None:
        if not self.tpm or actual is None or actual == charged:
            return
        # Usage above the estimate may leave a debt the next chunks pay (as one replica's).
        back = (charged - actual) * _SCALE
        self._region.allowance_add(self.entry, True, back, -back)

    def _central_now(self, tokens: bool, limit: float, now: float) -> float:
        if self._share.static_replicas:
            return 0.0
        level, at_us = self._region.central(self.entry, tokens)
        if not at_us:
            return float(limit)  # never synced: a missing central bucket is a full one
        grown = level / _SCALE + max(0.0, now - at_us / 1e6) * limit / 60
        return min(float(limit), grown)

    def _wait(self, tokens: bool, limit: int, need: float, now: float) -> float:
        """Seconds until `need` exists anywhere (here or centrally), at least one sync."""
        static = self._share.static_replicas
        have = self._region.allowance(self.entry, tokens) / _SCALE
        have += self._central_now(tokens, limit, now)
        return max(self._share.interval_s, (need - have) * 60 / (limit / (static or 1)))

    def _headers_at(self, now: float) -> dict[str, str]:
        # On every admitted request of every worker: the names and fixed values prebuilt.
        h: dict[str, str] = {}
        region, k = self._region, self.entry
        for tokens, limit, per, limit_text, h_limit, h_left, h_reset in self._heads:
            left = region.allowance(k, tokens) / _SCALE + self._central_now(tokens, limit, now)
            left = min(limit, max(0.0, left))
            h[h_limit] = limit_text
            h[h_left] = str(math.floor(left))
            h[h_reset] = _reset_text((limit - left) * per)
        return h

    # ---- the host member's side ------------------------------------------------------------

    def restamp(self, now: float) -> None:
        self._stamp = now

    def refill(self, now: float) -> None:
        """Redis unreachable: the host's 1/N of the rate (N: hosts last seen), refilled into
        its allowance, capped at 1/N of the limit."""
        n = self._share.static_replicas or 1
        elapsed, self._stamp = max(0.0, now - self._stamp), now
        for _, tokens, limit in self._dims:
            add = int(elapsed * limit / n / 60 * _SCALE)
            self._region.allowance_refill(self.entry, tokens, add, int(limit / n * _SCALE))

    def _drain(self) -> list[tuple[int, int]]:
        """What every worker spent and was refused per dimension since the last exchange (the
        region's counts, drained, plus what a quiet look drained before)."""
        out = []
        for i, (_, tokens, _) in enumerate(self._dims):
            used, refused = self._region.allowance_drain(self.entry, tokens)
            carried = self._carry[i]
            out.append((carried[0] + used, carried[1] + refused))
        return out

    def _delta(
        self, tokens: bool, limit: int, used: int, refused: int, elapsed_s: float
    ) -> tuple[float, float]:
        """What this dimension's exchange would take (> 0) or give back (< 0), as
        `LeasedLimits.exchange` sizes it, and the allowance it sizes (`desired`)."""
        share, region, k = self._share, self._region, self.entry
        spent_rate = max(0, used) / _SCALE / max(elapsed_s, 1e-3)
        level, at_us = region.central(k, tokens)
        central = level / _SCALE if at_us else float(limit)
        standing = max(limit / 60 * share.standing_s, central / 2 / share.replicas)
        desired = min(limit, max(standing, spent_rate * 2 * share.interval_s) + refused / _SCALE)
        have = region.allowance(k, tokens) / _SCALE
        if have < desired:
            return desired - have, desired
        if have > 2 * desired and not share.static_replicas:
            return desired - have, desired
        return 0.0, desired

    def quiet(self, now: float, elapsed_s: float) -> bool:
        """Whether this period's exchange can be left out: nothing refused, nothing to give
        back, at least `_QUIET_HELD` of the allowance the protocol sizes held (so a top-up of
        a few requests against a standing allowance of millions waits), and the central
        level seen less than `_QUIET_MAX_S` ago. What it drained is carried into the next
        exchange (its rate is over the whole time since)."""
        counts = self._drain()
        self._carry = counts
        for (_, tokens, limit), (used, refused) in zip(self._dims, counts, strict=True):
            if refused:
                return False
            _, at_us = self._region.central(self.entry, tokens)
            if not at_us or now - at_us / 1e6 >= _QUIET_MAX_S:
                return False
            delta, desired = self._delta(tokens, limit, used, refused, elapsed_s)
            if delta < 0 or delta > desired * (1 - _QUIET_HELD):
                return False
        return True

    def exchange(self, elapsed_s: float) -> list[tuple[str, int, float]]:
        """As `LeasedLimits.exchange`, for the host: its spending and refusals are the counts
        every worker left in the region since the last exchange."""
        out: list[tuple[str, int, float]] = []
        region, k = self._region, self.entry
        counts = self._drain()
        self._carry = [(0, 0)] * len(self._dims)
        for (suffix, tokens, limit), (used, refused) in zip(self._dims, counts, strict=True):
            delta, _ = self._delta(tokens, limit, used, refused, elapsed_s)
            if delta < 0:
                # Given back from the region first: a worker can no longer spend it. (Not on
                # the static share: the call would most likely fail, and what it took be lost.)
                delta = -region.allowance_take_upto(k, tokens, int(-delta * _SCALE))
                delta /= _SCALE
            out.append((f"{self.name}|{suffix}", limit, round(delta, 6)))
        return out

    def settle(self, results: list[Any], now: float) -> None:
        """The script's `[granted, central level]` per dimension, in `exchange`'s order."""
        at_us = int(now * 1e6)
        for (_, tokens, _), (granted, central) in zip(self._dims, results, strict=True):
            got = int(float(granted) * _SCALE)
            if got:
                self._region.allowance_add(self.entry, tokens, got, 0)
            self._region.set_central(
                self.entry, tokens, max(0, int(float(central) * _SCALE)), at_us
            )

    def view(self) -> dict[str, Any]:
        now = time.monotonic()
        return {
            ("tokens" if tokens else "requests"): {
                "limit_per_minute": limit,
                "allowance": round(self._region.allowance(self.entry, tokens) / _SCALE, 3),
                "central": round(self._central_now(tokens, limit, now), 3),
                "host": True,
            }
            for _, tokens, limit in self._dims
        }


@dataclass(slots=True)
class RateSync:
    """Every leased limit of the replica, and their one script call per sync. With a region
    (`--workers N`, SPEC §12 × §13) a key's allowance is its host's (`hosted`), synced only by
    the host's member; a key the region's table cannot hold keeps a per-worker allowance
    (`limits`, synced by each worker: the one case a worker other than the member talks to
    Redis)."""

    share: RateShare
    #: The region and this worker's slot in it (None: one process).
    region: _core.Region | None = None
    slot: int = 0
    #: What the host's allowances share (the host is the replica: static 1/N of hosts).
    host_share: RateShare | None = None
    limits: dict[str, LeasedLimits] = field(default_factory=dict)
    hosted: dict[str, HostLeasedLimits] = field(default_factory=dict)
    _last: float = field(default_factory=time.monotonic)

    def adopt(self, ring: KeyRing) -> None:
        """Turns the ring's limited keys into leased ones (right after the ring is built, before
        any request can use it)."""
        current: dict[str, LeasedLimits] = {}
        hosted: dict[str, HostLeasedLimits] = {}
        for tenant in ring.tenants:
            limits = tenant.limits
            if limits is None:
                continue
            if isinstance(limits, HostLeasedLimits):
                hosted[tenant.name] = limits
                continue
            if isinstance(limits, LeasedLimits):
                current[tenant.name] = limits
                continue
            host = self._hosted(tenant.name, limits.rpm, limits.tpm)
            if host is not None:
                tenant.limits = hosted[tenant.name] = host
                continue
            limits = LeasedLimits(tenant.name, limits.rpm, limits.tpm, self.share)
            tenant.limits = current[tenant.name] = limits
        if self.region is not None:
            # SPEC §16: the entries of keys this worker no longer has are left (the last
            # worker to leave one frees it).
            for name, old in self.hosted.items():
                if name not in hosted:
                    self.region.leave_key(old.entry, self.slot)
        self.limits, self.hosted = current, hosted

    def _hosted(self, name: str, rpm: int | None, tpm: int | None) -> HostLeasedLimits | None:
        region, share = self.region, self.host_share
        if region is None or share is None:
            return None
        old = self.hosted.get(name)
        entry = old.entry if old is not None else region.key_slot(key_id(name), self.slot)
        if entry is None:
            return None  # the table is full: this worker's own chunks
        return HostLeasedLimits(name, rpm, tpm, share, region, entry)

    async def sync(self, redis: RedisState, *, member: bool = True) -> bool:
        """One script call for this worker's own leased keys and, if it is its host's member
        (or one process), the host's. False: no call was needed."""
        hosted: list[HostLeasedLimits] = list(self.hosted.values()) if member else []
        mine: list[LeasedLimits | HostLeasedLimits] = [*self.limits.values(), *hosted]
        if not mine:
            return False
        now = time.monotonic()
        elapsed = now - self._last
        # SPEC §13 "limit chunks ... are exchanged in the background": a host whose every
        # allowance needs nothing this period (no refusal, most of its sizing held, the central
        # level fresh) makes no call — a key far below its limit is synced about once a
        # second, not at every renew period (each call costs the member ~0.5 ms of CPU).
        if not self.limits and all(lim.quiet(now, elapsed) for lim in hosted):
            return False
        self._last = now
        plan = [(lim, lim.exchange(elapsed)) for lim in mine]
        reply = await redis.rate_sync([e for _, entries in plan for e in entries])
        results = reply.get("r")
        flat = results if isinstance(results, list) else []
        if len(flat) != sum(len(entries) for _, entries in plan):
            raise ValueError("rate script answered a different number of buckets")
        at = time.monotonic()
        i = 0
        for lim, entries in plan:
            lim.settle(flat[i : i + len(entries)], at)
            i += len(entries)
        return True

    def refill_hosted(self) -> None:
        """The member, Redis unreachable: the host's static share into its allowances."""
        if self.host_share is None or not self.host_share.static_replicas:
            return
        now = time.monotonic()
        for lim in self.hosted.values():
            lim.refill(now)

    def restamp_hosted(self) -> None:
        """A worker just became its host's member: its refills start now (the former member
        refilled up to now)."""
        now = time.monotonic()
        for lim in self.hosted.values():
            lim.restamp(now)

    def refused_hosted(self) -> bool:
        """Whether a worker of the host was refused a key since the member's last exchange
        (one pass over the region's key table: ~1 us, at every tick of the member)."""
        return bool(self.hosted) and self.region is not None and self.region.any_allowance_refused()

    def set_static(self, replicas: int | None) -> None:
        """Redis unreachable (`replicas` = the last known count) or back (`None`)."""
        if replicas == self.share.static_replicas:
            return
        self.share.static_replicas = replicas
        now = time.monotonic()
        for lim in self.limits.values():
            lim.restamp(now)

    def set_host_static(self, hosts: int | None, replicas: int) -> None:
        """As `set_static`, for the host's allowances (`hosts`: the replicas are hosts)."""
        share = self.host_share
        if share is None:
            return
        share.replicas = replicas
        if hosts != share.static_replicas:
            share.static_replicas = hosts
            self.restamp_hosted()

    def view(self) -> Mapping[str, Any]:
        out = {name: lim.view() for name, lim in self.limits.items()}
        out.update((name, lim.view()) for name, lim in self.hosted.items())
        return out
