"""One pool's side of the SPEC §13 lease protocol: what this replica reports to Redis, how it
applies the answer, and what it falls back to when Redis cannot be reached.

The protocol (the script is `scripts.LEASE_SYNC`; the local enforcement `local.LocalLeases`):

- **Report** per instance `[C, floor, want, in_flight]`. `floor` = max(in-flight, the current
  cap): everything this replica may have in flight by the time the answer lands, so Redis never
  accounts for less than can run. `want` follows demand (SPEC §13 "Shares follow demand"):
  in-flight, plus the pool's queued requests spread over the instances by capacity, plus a
  quarter of headroom (at least one slot) — and nothing at all for an idle replica. What
  nobody wants the script splits evenly (the idle baseline), so a replica admits a burst at
  once up to its share while the cluster is idle.
- **Apply** only a fresh answer: the lease is valid until `sent + lease_ms − margin` on the
  monotonic clock, measured from *sending* — Redis renewed it later than that, so the replica
  stops (self-fences, in `LocalLeases`) before Redis can hand its slots to another. An answer
  that arrives after that is ignored: the replica stays fenced and asks again.
- **Redis unreachable** (SPEC §13: "each replica keeps serving on a safe static share
  (`max_concurrency` divided by the last known replica count)" and "Losing Redis never fails a
  request by itself: queued requests stay queued and are served on the static share"): the
  replica moves to its static share *before* its lease runs out, so it never fences (a fence
  answers the queue 503): while the lease is still valid, after two failed attempts in a row,
  or after one when the lease would run out before another attempt could end. Every instance
  then gets `floor(C / N_last)` — at once where that is below the replica's last lease (so
  the queue keeps its slots and nothing is granted past what Redis still counts as this
  replica's), and above it only after `timeouts.total_ms` (the longest an attempt admitted
  under the old leases can still run): Σ caps ≤ Σ old leases ≤ C first, ≤ N · floor(C/N) ≤ C
  after. A replica whose lease already ran out (woken from SIGSTOP: it fenced before anything
  else) asks Redis first: the static share only after two failures, the second begun after
  the lease expired in Redis too.
- **Starting without Redis** (SPEC §13: "A replica that starts while Redis is unreachable
  serves on the static share (replica count from `cluster.expected_replicas`)"): it held
  nothing, so its static share applies in full at the first failed attempt.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from gateway.pool import Pool, PoolSnapshot
from gateway.scheduler import now_ms

__all__ = ["PoolLease", "demand_of"]


def demand_of(
    snap: PoolSnapshot, elsewhere: int = 0, held: dict[str, int] | None = None
) -> dict[str, list[int]]:
    """Per instance name `[C, floor, want, in_flight]` (a removed instance still draining under
    the same name adds its in-flight to both `floor` and `in_flight`). `elsewhere`: requests
    the host's other workers hold waiting for a lease (SPEC §12 × §13: the demand is the
    host's; its queues and in-flight counts are already in `snap`, from the region); `held`:
    caps another worker of the host may still apply (a shrink it has not acknowledged), which
    the floor covers too."""
    live = [i for i in snap.instances if not i.removed]
    total = sum(i.max_concurrency for i in live) or 1
    queued = snap.queued_high + snap.queued_low + snap.lease_waiting + elsewhere
    out: dict[str, list[int]] = {}
    for inst in snap.instances:
        row = out.setdefault(inst.name, [inst.max_concurrency, 0, 0, 0])
        row[3] += inst.in_flight
        if inst.removed:
            row[1] += inst.in_flight
            continue
        row[0] = inst.max_concurrency
        row[1] += max(inst.in_flight, inst.lease or 0, (held or {}).get(inst.name, 0))
        spread = math.ceil(queued * inst.max_concurrency / total)
        # SPEC §13 "Shares follow demand": an idle replica wants nothing (its share shrinks to
        # its in-flight, so a busy one can use the whole cap); a busy one a quarter more.
        busy = inst.in_flight + spread
        headroom = max(1, math.ceil(inst.in_flight / 4)) if busy else 0
        row[2] = min(inst.max_concurrency, busy + headroom)
    return out


@dataclass(slots=True)
class PoolLease:
    """The lease state of one pool of this replica."""

    name: str
    lease_ms: int
    margin_ms: int
    #: How long an attempt may run at most (`timeouts.total_ms`): the static share's phase 1.
    max_attempt_ms: int
    #: `cluster.expected_replicas`: the replica count before Redis ever answered.
    expected_replicas: int = 2
    #: How long before the lease runs out the last attempt must have begun (renew + timeout).
    attempt_ms: int = 0
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
    #: What was last applied to the pool: slots by instance name, and the lease's expiry
    #: (None: the static share). With workers, the member publishes it for the others.
    applied: dict[str, int] | None = None
    applied_expiry: int | None = None

    @property
    def fail_static(self) -> bool:
        return self.static_since is not None

    def payload(
        self, snap: PoolSnapshot, elsewhere: int = 0, held: dict[str, int] | None = None
    ) -> dict[str, Any]:
        return {"i": demand_of(snap, elsewhere, held)}

    def export(self) -> dict[str, Any]:
        """What a worker taking the host's member role over continues from (SPEC §12 × §13):
        the monotonic times compare across the host's processes."""
        return {
            "last_ok_sent": self.last_ok_sent,
            "replicas": self.replicas,
            "targets": self.targets,
            "static_since": self.static_since,
        }

    def restore(self, doc: Any) -> None:
        """Continues from a former member's `export` (ignores what does not fit)."""
        if not isinstance(doc, dict):
            return
        sent, replicas, since = (
            doc.get("last_ok_sent"),
            doc.get("replicas"),
            doc.get("static_since"),
        )
        self.last_ok_sent = sent if isinstance(sent, int) else None
        self.replicas = replicas if isinstance(replicas, int) and replicas > 0 else None
        self.static_since = since if isinstance(since, int) else None
        targets = doc.get("targets")
        if isinstance(targets, dict):
            self.targets = {str(k): v for k, v in targets.items() if isinstance(v, int)}

    def _applied(self, pool: Pool, slots: dict[int, int], expiry: int | None) -> None:
        names = dict(pool.live_upstreams())
        self.applied = {names[i].name: n for i, n in slots.items() if i in names}
        self.applied_expiry = expiry
        pool.apply_leases(slots, expiry)

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
            self._applied(pool, slots, expiry)
        return True

    def failed(self, pool: Pool | None, started: int) -> None:
        """An attempt begun at `started` failed: maybe time for the static share."""
        self.failures += 1
        if pool is None:
            return
        now = now_ms()
        if self.static_since is None:
            if not self._go_static(now, started):
                return
            self.static_since = now
        self._applied(pool, self.static_share(pool, now), None)

    def _go_static(self, now: int, started: int) -> bool:
        if self.last_ok_sent is None:
            return True  # never leased: nothing held, the static share of a starting replica
        fence_at = self.last_ok_sent + self.lease_ms - self.margin_ms
        if now < fence_at:
            # Still leased: before the fence, so the queue stays queued.
            return self.failures >= 2 or now + self.attempt_ms >= fence_at
        return self.failures >= 2 and started >= self.last_ok_sent + self.lease_ms

    @property
    def divisor(self) -> int:
        """The replica count the static share divides by: the last known, else expected."""
        return self.replicas or self.expected_replicas

    def static_share(self, pool: Pool, now: int) -> dict[int, int]:
        """SPEC §13 `floor(C / N_last)` per instance, not above the last lease until every
        attempt admitted under it has ended (a replica that never held a lease: at once)."""
        assert self.static_since is not None
        settled = self.last_ok_sent is None or now >= self.static_since + self.max_attempt_ms
        out: dict[int, int] = {}
        for idx, up in pool.live_upstreams():
            share = up.spec.max_concurrency // self.divisor
            out[idx] = share if settled else min(share, self.targets.get(up.name, 0))
        return out
