"""One pool's side of the SPEC §13 lease protocol: what this replica reports to Redis, how it
applies the answer, and what it falls back to when Redis cannot be reached.

The protocol (the script is `scripts.LEASE_SYNC`; the local enforcement `local.LocalLeases`):

- **Report** per instance `[C, floor, want, in_flight]`. `floor` = max(in-flight, the current
  cap): everything this replica may have in flight by the time the answer lands, so Redis never
  accounts for less than can run. `want` follows demand (SPEC §13 "Shares follow demand"):
  in-flight, plus the pool's queued requests spread over the instances by capacity, plus a
  quarter of headroom (at least one slot). What nobody wants the script splits evenly (the
  idle baseline), so a replica admits a burst at once up to its share.
- **Apply** only a fresh answer: the lease is valid until `sent + lease_ms − margin` on the
  monotonic clock, measured from *sending* — Redis renewed it later than that, so the replica
  stops (self-fences, in `LocalLeases`) before Redis can hand its slots to another. An answer
  that arrives after that is ignored: the replica stays fenced and asks again.
- **Redis unreachable** (SPEC §13: "each replica keeps serving on a safe static share
  (`max_concurrency` divided by the last known replica count)"): once the lease has fully
  expired and two attempts in a row failed (the second begun after expiry, so a process just
  woken from SIGSTOP asks Redis before it concludes anything), every instance gets
  `floor(C / N_last)` — at once where that is below the replica's last lease, and above it only
  after `timeouts.total_ms` (the longest an attempt admitted under the old leases can still
  run): Σ caps ≤ Σ old leases ≤ C first, ≤ N · floor(C/N) ≤ C after. A replica that never
  synced does not know N and stays fenced ("joining").
- **Redis back** (also a restarted, empty one): the next report registers `floor` — at least
  the in-flight — and the script's recovery window keeps everyone within their static share
  until every replica had a lease's time to report.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from gateway.pool import Pool, PoolSnapshot
from gateway.scheduler import now_ms

__all__ = ["PoolLease", "demand_of"]


def demand_of(snap: PoolSnapshot) -> dict[str, list[int]]:
    """Per instance name `[C, floor, want, in_flight]` (a removed instance still draining under
    the same name adds its in-flight to both `floor` and `in_flight`)."""
    live = [i for i in snap.instances if not i.removed]
    total = sum(i.max_concurrency for i in live) or 1
    queued = snap.queued_high + snap.queued_low + snap.lease_waiting
    out: dict[str, list[int]] = {}
    for inst in snap.instances:
        row = out.setdefault(inst.name, [inst.max_concurrency, 0, 0, 0])
        row[3] += inst.in_flight
        if inst.removed:
            row[1] += inst.in_flight
            continue
        row[0] = inst.max_concurrency
        row[1] += max(inst.in_flight, inst.lease or 0)
        spread = math.ceil(queued * inst.max_concurrency / total)
        headroom = max(1, math.ceil(inst.in_flight / 4))
        row[2] = min(inst.max_concurrency, inst.in_flight + spread + headroom)
    return out


@dataclass(slots=True)
class PoolLease:
    """The lease state of one pool of this replica."""

    name: str
    lease_ms: int
    margin_ms: int
    #: How long an attempt may run at most (`timeouts.total_ms`): the static share's phase 1.
    max_attempt_ms: int
    #: Monotonic ms the last fresh answer's request was sent (None: never).
    last_ok_sent: int | None = None
    #: Live replicas in the last answer (None: never synced).
    replicas: int | None = None
    failures: int = 0
    recovering: bool = False
    #: Targets of the last fresh answer, by instance name.
    targets: dict[str, int] = field(default_factory=dict)
    #: replica → instance → [held, in_flight], from the last answer.
    view: dict[str, dict[str, list[int]]] = field(default_factory=dict)
    #: Monotonic ms the static share began (None: not in it).
    static_since: int | None = None
    #: Whether the last fresh answer lowered a lease (the node then syncs again at once).
    shrank: bool = False

    @property
    def fail_static(self) -> bool:
        return self.static_since is not None

    def payload(self, snap: PoolSnapshot) -> dict[str, Any]:
        return {"i": demand_of(snap)}

    def succeeded(self, pool: Pool | None, reply: dict[str, Any], sent: int) -> bool:
        """Takes an answer sent at `sent`; applies it if still fresh. Returns whether it was
        (a stale one counts as a failed attempt: Redis too slow to lease from)."""
        expiry = sent + self.lease_ms - self.margin_ms
        if now_ms() >= expiry:
            self.failed(pool, sent)  # too late to trust: the lease it renewed may be gone
            return False
        self.failures = 0
        self.recovering = bool(reply.get("rec"))
        n = int(reply.get("n", 0))
        # The replica count is what the static share and the recovery clamp divide by: while
        # the others re-register (a recovery window) it may read low, so it only grows then.
        if self.recovering and self.replicas is not None:
            n = max(n, self.replicas)
        self.replicas = n or None
        view = reply.get("v")
        self.view = view if isinstance(view, dict) else {}
        targets = reply.get("t")
        before = self.targets
        self.targets = (
            {str(k): int(v) for k, v in targets.items()} if isinstance(targets, dict) else {}
        )
        # A lease that shrank is reported again at once, so Redis frees it for the others.
        self.shrank = any(self.targets.get(k, 0) < v for k, v in before.items())
        self.last_ok_sent = sent
        self.static_since = None
        if pool is not None:
            slots = {idx: self.targets.get(up.name, 0) for idx, up in pool.live_upstreams()}
            pool.apply_leases(slots, expiry)
        return True

    def failed(self, pool: Pool | None, started: int) -> None:
        """An attempt begun at `started` failed: maybe time for the static share."""
        self.failures += 1
        if self.replicas is None or self.last_ok_sent is None or pool is None:
            return  # never synced: the replica count is unknown, stay fenced
        if self.failures < 2 or started < self.last_ok_sent + self.lease_ms:
            return
        now = now_ms()
        if self.static_since is None:
            self.static_since = now
        pool.apply_leases(self.static_share(pool, now), None)

    def static_share(self, pool: Pool, now: int) -> dict[int, int]:
        """SPEC §13 `floor(C / N_last)` per instance, not above the last lease until every
        attempt admitted under it has ended."""
        assert self.replicas is not None and self.static_since is not None
        settled = now >= self.static_since + self.max_attempt_ms
        out: dict[int, int] = {}
        for idx, up in pool.live_upstreams():
            share = up.spec.max_concurrency // self.replicas
            out[idx] = share if settled else min(share, self.targets.get(up.name, 0))
        return out
