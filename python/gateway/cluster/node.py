"""This replica's membership of the cluster (SPEC §13): the one background task that exchanges
leases, rate-limit chunks and ejection hints with Redis, and what `/admin/state`, `/readyz` and
`/metrics` show of it.

Every `renew_ms` (sooner when a key ran out of allowance) the task runs, concurrently, one
`LEASE_SYNC` per pool and one `RATE_SYNC` for every limited key — a handful of round trips per
period whatever the request rate, and none on the request path: the ingress only ever touches
the core's caps and masks (`local.LocalLeases`) and each key's local allowance
(`ratelimit.LeasedLimits`).

`Server` owns the task (start: one sync before listening; shutdown: after the drain, a last
sync that gives every lease back, so the others need not wait `lease_ms` for it).

With `--workers N` (SPEC §12 × §13) the lease belongs to the host, not the process: every worker
runs a `ClusterNode` with the host's `replica_id`, and the one holding the host's member role
(`host.HostSeat`) runs the lease syncs — its pool snapshots are already the host's queues and
in-flight counts (the region), plus what the others hold waiting for a lease — and publishes
the leases it applied; the others apply them each tick (`follow`) and show its cluster block.
Per-key limits are the host's too (SPEC §12: "one Redis connection per host does the syncing,
not one per worker"): each key's allowance lives in the region, every worker spends it, and the
member alone tops it up from the central bucket (`ratelimit.HostLeasedLimits`) — a worker that
is not the member never opens a Redis connection (unless the region's key table is full: such
a key keeps a per-worker chunk).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any, Protocol

from prometheus_client import Counter, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from gateway.cluster.hints import CONFIRM_GAP_S, HintTracker
from gateway.cluster.host import HostSeat
from gateway.cluster.leases import PoolLease
from gateway.cluster.ratelimit import RateShare, RateSync
from gateway.cluster.redis_state import RedisState, RedisUnavailable
from gateway.config import Cluster
from gateway.events import ProbeFinished
from gateway.redact import REDACTOR
from gateway.scheduler import now_ms

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

    from gateway.auth import KeyRing
    from gateway.config import Config
    from gateway.events import Events
    from gateway.pool import Pool

__all__ = ["ClusterNode", "Pools"]


class Pools(Protocol):
    """The running pools a replica leases slots for, with the settings and event stream
    they run under (the gateway's `Runtime` is one; a reload changes them in place)."""

    @property
    def pools(self) -> Mapping[str, Pool]: ...

    @property
    def config(self) -> Config: ...

    @property
    def events(self) -> Events: ...


log = logging.getLogger("gateway.cluster")

# A nudge (a key out of allowance) brings the next sync forward, but not closer than this
# fraction of `renew_ms` to the previous one.
_NUDGE_MIN_FRACTION = 0.25
_SYNC_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)


class ClusterNode:
    """One replica of a gateway cluster."""

    def __init__(
        self,
        pools: Pools,
        keys: KeyRing,
        registry: CollectorRegistry,
        settings: Cluster,
        host: HostSeat | None = None,
    ) -> None:
        self.running = pools
        self.settings = settings
        #: SPEC §12 × §13: this worker's seat at its host's membership (None: one process).
        self.host = host
        #: The host member's last publication, as a follower saw it.
        self._doc: dict[str, Any] | None = None
        self._leading = False
        self._elsewhere: dict[str, int] = {}
        #: The member's publications: sequence number, and what it published (as a follower:
        #: the last one applied). `_unacked`: (seq, until monotonic ms, slots per pool) of
        #: those some other worker may not have applied yet.
        self._seq = 0
        self._unacked: list[tuple[int, int, dict[str, dict[str, int]]]] = []
        self._last_slots: dict[str, dict[str, int]] = {}
        self.replica = settings.replica_id
        lease_ms, renew_ms = settings.lease_ms, settings.renew_ms
        # Self-fence a quarter of a lease before Redis could expire it (2 s → 0.5 s).
        self.margin_ms = lease_ms // 4
        # SPEC §13 "every call has a timeout": a call that takes longer than this is as good
        # as lost. An eighth of a lease (2 s → 250 ms), so that two failed attempts, each
        # after a renew period, end well before the fence: the replica is on its static
        # share by then and its queue stays queued.
        self.timeout_ms = max(50, min(lease_ms // 8, 1000))
        self.redis = RedisState(
            settings.redis_url, replica=self.replica, timeout_ms=self.timeout_ms
        )
        self.pools: dict[str, PoolLease] = {}
        self.hints = HintTracker()
        self._wake = asyncio.Event()
        region = host.region if host is not None else None
        self.rates = RateSync(
            RateShare(renew_ms / 1000, lease_ms / 1000, self._wake.set),
            region,
            host.slot if host is not None else 0,
            # A refusal wakes the member's loop if it was the member's; the member sees the
            # others' in the region at each tick (`follow`) and brings its next chunk forward.
            RateShare(renew_ms / 1000, lease_ms / 1000, self._nudge_host),
        )
        self.redis_up = False
        self.failures = 0
        self.last_error: str | None = None
        self.last_latency_s: float | None = None
        self._last_ok: float | None = None  # monotonic s of the last successful call
        self._confirming: set[tuple[str, str]] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        r = registry
        self.sync_seconds = Histogram(
            "gateway_cluster_sync_seconds",
            "Duration of one lease or rate-limit sync with Redis",
            ["kind"],
            buckets=_SYNC_BUCKETS,
            registry=r,
        )
        self.sync_failures = Counter(
            "gateway_cluster_sync_failures", "Syncs with Redis that failed", ["kind"], registry=r
        )
        self.hint_count = Counter(
            "gateway_cluster_hints",
            "Ejection hints published to / received from other replicas",
            ["direction"],
            registry=r,
        )
        r.register(_ClusterCollector(self))
        self.adopt_keys(keys)

    # ---- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        """The first sync, before the replica listens (bounded by the client's timeouts). A
        worker that is not its host's member waits (at most `lease_ms`) for the member's
        first publication instead, or takes the role if it comes free meanwhile."""
        host = self.host
        if host is None or host.try_lead():
            await self.sync_once()
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.settings.lease_ms / 1000
        while self._doc is None and loop.time() < deadline:
            if host.try_lead():
                await self.sync_once()
                return
            await asyncio.sleep(0.01)
            self.follow()
        await self.sync_once()  # the rate-limit chunks of this worker

    async def run(self) -> None:
        """Syncs every `renew_ms` until cancelled."""
        renew_s = self.settings.renew_ms / 1000
        while True:
            started = time.monotonic()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(renew_s):
                    await self._wake.wait()
            # A nudge: not sooner than a fraction of the period after the last sync.
            rest = started + renew_s * _NUDGE_MIN_FRACTION - time.monotonic()
            if rest > 0:
                await asyncio.sleep(rest)
            self._wake.clear()
            try:
                await self.sync_once()
            except Exception:  # the loop must outlive anything: a fence is the fallback
                log.exception("cluster sync failed")

    async def close(self) -> None:
        """Gives every lease back (a last sync marked `leave`), then closes the client. A
        host's member gives them back only when nothing runs on the host any more (the other
        workers may still be draining: the lease then expires, or one of them takes the role
        and leaves last)."""
        for task in list(self._tasks):
            task.cancel()
        host = self.host
        if host is None or (host.member and self._host_idle()):
            for name in list(self.pools):
                with contextlib.suppress(*RedisUnavailable):
                    await self.redis.lease_sync(
                        name, self.replica, self.settings.lease_ms, 0, _LEAVE
                    )
        if host is not None:
            host.resign()
        with contextlib.suppress(*RedisUnavailable):
            await self.redis.close()

    def _nudge_host(self) -> None:
        if self.host is None or self.host.member:
            self._wake.set()

    def adopt_keys(self, ring: KeyRing) -> None:
        """SPEC §13 cluster-wide limits for the keys of a (new) key ring."""
        self.rates.adopt(ring)

    # ---- one sync --------------------------------------------------------------------------

    def _host_idle(self) -> bool:
        return all(
            p.snapshot().in_flight == 0 and p.snapshot().waiting == 0
            for p in self.running.pools.values()
        )

    async def sync_once(self) -> None:
        host = self.host
        if host is not None and not host.try_lead():
            # SPEC §12 × §13: another worker is the host's member (and the host's allowances
            # its business); this one's own chunks only, if any (a key table that was full).
            await self._sync_rates(member=False)
            self._follow_rates()
            return
        if host is not None:
            if not self._leading:
                self._take_over(host)
            self._elsewhere, acked = host.others()
            now = now_ms()
            self._unacked = [u for u in self._unacked if u[0] > acked and u[1] > now]
        pools = self.running.pools
        jobs = [self._sync_pool(name) for name in pools]
        jobs.append(self._sync_rates())
        for name in [n for n in self.pools if n not in pools]:
            jobs.append(self._leave(name))  # a pool a reload removed
        await asyncio.gather(*jobs)
        self._update_static()
        self.rates.refill_hosted()  # SPEC §13 Redis unreachable: the host's static share
        if host is not None:
            self._publish(host)

    def _lease_of(self, name: str) -> PoolLease:
        lease = self.pools.get(name)
        if lease is None:
            c = self.settings
            total_ms = self.running.config.timeouts.total_ms
            lease = self.pools[name] = PoolLease(
                name,
                c.lease_ms,
                self.margin_ms,
                total_ms,
                expected_replicas=c.expected_replicas,
                attempt_ms=c.renew_ms + self.timeout_ms,
            )
        return lease

    async def _sync_pool(self, name: str) -> None:
        pool = self.running.pools.get(name)
        if pool is None:
            return
        lease = self._lease_of(name)
        snap = pool.snapshot()
        held: dict[str, int] = {}
        for _, _, pools in self._unacked:  # SPEC §13: a cap another worker may still apply
            for instance, n in pools.get(name, {}).items():
                held[instance] = max(held.get(instance, 0), n)
        payload = lease.payload(snap, self._elsewhere.get(name, 0), held)
        payload["h"] = self.hints.outgoing(name, snap)
        sent = now_ms()
        try:
            reply = await self.redis.lease_sync(
                name, self.replica, self.settings.lease_ms, lease.replicas or 0, payload
            )
        except RedisUnavailable as exc:
            self._failed("lease", exc)
            self.hints.unsent(name, payload["h"])
            lease.failed(self.running.pools.get(name), sent)
            return
        self._succeeded("lease", sent)
        if lease.succeeded(self.running.pools.get(name), reply, sent) and lease.shrank:
            self._wake.set()  # report the smaller floor now: the others are waiting for it
        self.hint_count.labels("published").inc(len(payload["h"]))
        for instance in self.hints.incoming(name, reply.get("h"), now_ms()):
            self.hint_count.labels("received").inc()
            self._confirm(name, instance)

    async def _sync_rates(self, member: bool = True) -> None:
        if not self.rates.limits and not (member and self.rates.hosted):
            return
        sent = now_ms()
        try:
            called = await self.rates.sync(self.redis, member=member)
        except RedisUnavailable as exc:
            self._failed("rate", exc)
            return
        if called:  # a period with nothing to exchange made no call: it tells nothing of Redis
            self._succeeded("rate", sent)

    async def _leave(self, name: str) -> None:
        self.pools.pop(name, None)
        with contextlib.suppress(*RedisUnavailable):
            await self.redis.lease_sync(name, self.replica, self.settings.lease_ms, 0, _LEAVE)

    def _succeeded(self, kind: str, sent: int) -> None:
        elapsed = (now_ms() - sent) / 1000
        self.sync_seconds.labels(kind).observe(elapsed)
        self.last_latency_s = elapsed
        self._last_ok = time.monotonic()
        if not self.redis_up:
            log.info("cluster: Redis reachable", extra={"fields": {"replica": self.replica}})
        self.redis_up = True
        self.failures = 0

    def _failed(self, kind: str, exc: BaseException) -> None:
        self.sync_failures.labels(kind).inc()
        self.failures += 1
        self.last_error = REDACTOR.redact(f"{type(exc).__name__}: {exc}")[:200]
        if self.redis_up or self.failures == 1:
            log.warning(
                "cluster: Redis sync failed",
                extra={"fields": {"replica": self.replica, "error": self.last_error}},
            )
        self.redis_up = False

    def _update_static(self) -> None:
        """Rate limits follow the slots: static 1/N while any pool is on its static share."""
        counts = [p.divisor for p in self.pools.values() if p.fail_static]
        live = [p.replicas for p in self.pools.values() if p.replicas]
        self._rates_split(max(counts) if counts else None, max(live) if live else 1)

    def _rates_split(self, static: int | None, replicas: int) -> None:
        # A key's allowance in the region is the host's: its static share is 1/N of the hosts.
        self.rates.set_host_static(static, replicas)
        # A worker holding its own chunks (a key the region's table could not hold): a host's
        # static share of a key's rate is split among its workers, and so is its part of an
        # idle central bucket.
        workers = self.host.workers if self.host is not None else 1
        self.rates.set_static(static * workers if static else None)
        self.rates.share.replicas = replicas * workers

    # ---- SPEC §12 × §13: one member per host ----------------------------------------------

    @property
    def follower(self) -> bool:
        """A worker whose host's member is another worker."""
        return self.host is not None and not self.host.member

    def _take_over(self, host: HostSeat) -> None:
        """This worker just became its host's member: it continues the former member's lease
        state (its times are on the host's one monotonic clock), so a role that moved mid-lease
        or on the static share goes on as if nothing happened."""
        self._leading = True
        self.rates.restamp_hosted()  # the former member's static refills reached until now
        doc = self._doc if self._doc is not None else host.read()
        seq = doc.get("seq") if isinstance(doc, dict) else None
        self._seq = max(self._seq, seq if isinstance(seq, int) else 0)
        pools = doc.get("pools") if isinstance(doc, dict) else None
        if isinstance(pools, dict):
            for name, entry in pools.items():
                if name in self.running.pools and isinstance(entry, dict):
                    self._lease_of(name).restore(entry.get("lease"))
        log.info(
            "cluster: this worker is the host's member",
            extra={"fields": {"replica": self.replica, "worker": host.slot}},
        )

    def _publish(self, host: HostSeat) -> None:
        pools: dict[str, Any] = {}
        for name, lease in self.pools.items():
            if lease.applied is None:
                continue
            pools[name] = {
                "slots": lease.applied,
                "expiry_ms": lease.applied_expiry,
                "lease": lease.export(),
            }
        counts = [p.divisor for p in self.pools.values() if p.fail_static]
        live = [p.replicas for p in self.pools.values() if p.replicas]
        self._seq += 1
        now = now_ms()
        expiries = [e["expiry_ms"] for e in pools.values() if e["expiry_ms"] is not None]
        until = max(expiries, default=now + self.settings.lease_ms)
        slots = {n: e["slots"] for n, e in pools.items()}
        # A publication that lowers a cap is acknowledged by every worker once applied (the
        # others need not be: a worker still on an earlier one holds no more than now).
        last = self._last_slots
        shrink = any(
            n < last.get(pool, {}).get(instance, 0)
            for pool, caps in slots.items()
            for instance, n in caps.items()
        )
        self._last_slots = slots
        self._unacked.append((self._seq, until, slots))
        host.publish(
            {
                "seq": self._seq,
                "shrink": shrink,
                "member": {"worker": host.slot, "pid": os.getpid()},
                "at_ms": now_ms(),
                "pools": pools,
                "rates": {"static": max(counts) if counts else None, "replicas": max(live or [1])},
                "joined": self.joined,
                "state": self._state(),
            }
        )

    def follow(self) -> None:
        """Every tick of every worker of a host: reports what waits here for a lease, and a
        follower applies the member's publication when it changed (a `stat` otherwise)."""
        host = self.host
        if host is None:
            return
        pools = self.running.pools
        if not host.member:
            self._apply_published(host)
        elif not self._wake.is_set() and self.rates.refused_hosted():
            self._wake.set()  # a worker ran out of a key's allowance: the next chunk, sooner
        # After applying: the member counts a shrink as done once every worker reported it.
        host.report({name: p.lease_waiting for name, p in pools.items()}, self._seq)

    def _apply_published(self, host: HostSeat) -> None:
        pools = self.running.pools
        doc = host.changed()
        if doc is None:
            return
        self._doc = doc
        published = doc.get("pools")
        if not isinstance(published, dict):
            return
        for name, pool in pools.items():
            entry = published.get(name)
            if not isinstance(entry, dict) or not isinstance(entry.get("slots"), dict):
                continue
            slots = entry["slots"]
            expiry = entry.get("expiry_ms")
            by_index = {}
            for idx, up in pool.live_upstreams():
                n = slots.get(up.name, 0)
                by_index[idx] = n if isinstance(n, int) and n >= 0 else 0
            pool.apply_leases(by_index, expiry if isinstance(expiry, int) else None)
        seq = doc.get("seq")
        if doc.get("shrink") is True and isinstance(seq, int):
            self._seq = seq  # acknowledged in this tick's report (written only when it changes)

    def _follow_rates(self) -> None:
        rates = self._doc.get("rates") if self._doc is not None else None
        if not isinstance(rates, dict):
            return
        static, replicas = rates.get("static"), rates.get("replicas")
        self._rates_split(
            static if isinstance(static, int) and static > 0 else None,
            replicas if isinstance(replicas, int) and replicas > 0 else 1,
        )

    def _published_state(self) -> dict[str, Any] | None:
        doc = self._doc
        state = doc.get("state") if doc is not None else None
        return state if isinstance(state, dict) else None

    def _member_silent(self) -> bool:
        """The publication is older than a lease (the member stopped, and nobody took over)."""
        at = self._doc.get("at_ms") if self._doc is not None else None
        return not isinstance(at, int) or now_ms() - at > self.settings.lease_ms

    # ---- hints -----------------------------------------------------------------------------

    def _confirm(self, pool_name: str, instance: str) -> None:
        """Local probes for another replica's ejection hint (see `hints`)."""
        key = (pool_name, instance)
        if key in self._confirming or not self.running.config.health.probe.enabled:
            return
        self._confirming.add(key)
        task = asyncio.get_running_loop().create_task(self._probe_hinted(pool_name, instance))
        self._tasks.add(task)

        def done(t: asyncio.Task[None]) -> None:
            self._tasks.discard(t)
            self._confirming.discard(key)

        task.add_done_callback(done)

    async def _probe_hinted(self, pool_name: str, instance: str) -> None:
        runtime = self.running
        health = runtime.config.health
        for _ in range(health.failure_threshold):
            pool = runtime.pools.get(pool_name)
            found = [(i, u) for i, u in pool.live_upstreams() if u.name == instance] if pool else []
            if pool is None or not found:
                return
            idx, up = found[0]
            states = [i.state for i in pool.snapshot().instances if i.index == idx]
            if states != ["healthy"]:
                return  # already out here: local evidence decided
            ok = await up.probe(health.probe.path, health.probe.timeout_ms / 1000)
            if runtime.events:
                runtime.events.publish(ProbeFinished(pool_name, instance, ok))
            pool.record_probe(idx, ok)
            if ok:
                return
            await asyncio.sleep(CONFIRM_GAP_S)

    # ---- what people see -------------------------------------------------------------------

    @property
    def joined(self) -> bool:
        """Whether every pool serves: it had a lease at least once, or it is on its static
        share (SPEC §13: a replica that starts while Redis is unreachable serves on it)."""
        if self.follower:
            return self._doc is not None and self._doc.get("joined") is True
        return bool(self.pools) and all(
            p.replicas is not None or p.fail_static for p in self.pools.values()
        )

    @property
    def fail_static(self) -> bool:
        if self.follower:
            rates = self._doc.get("rates") if self._doc is not None else None
            return isinstance(rates, dict) and rates.get("static") is not None
        return any(p.fail_static for p in self.pools.values())

    @property
    def redis_reachable(self) -> bool:
        """Whether the host's last lease sync reached Redis (a follower: as published)."""
        if self.follower:
            state = self._published_state()
            redis = state.get("redis") if state is not None else None
            return isinstance(redis, dict) and redis.get("up") is True
        return self.redis_up

    @property
    def fenced(self) -> bool:
        return any(pool.snapshot().lease_fenced for pool in self.running.pools.values())

    @property
    def status(self) -> str:
        """`ok`, `degraded` (Redis unreachable, fenced or on the static share: SPEC §13
        "reports `cluster: degraded`") or `joining` (neither a lease nor a static share yet:
        not ready)."""
        if not self.joined:
            return "joining"
        if self.follower:
            state = self._published_state()
            if self.fenced or self._member_silent() or state is None:
                return "degraded"
            status = state.get("status")
            return status if status in ("ok", "degraded") else "degraded"
        if self.fail_static or self.fenced or self.failures >= 2:
            return "degraded"
        return "ok"

    def state(self) -> dict[str, Any]:
        """The `cluster` block of /admin/state (SPEC §13: "replicas seen, each instance's lease
        per replica"). With workers, any worker shows its host's (the member's publication,
        with who the member is)."""
        host = self.host
        if host is None:
            return self._state()
        if host.member:
            doc = self._state()
            member: Any = {"worker": host.slot, "pid": os.getpid()}
            age: int | None = 0
        else:
            doc = dict(self._published_state() or {"replica_id": self.replica, "pools": {}})
            doc["status"] = self.status
            doc["degraded"] = self.status == "degraded"
            member = self._doc.get("member") if self._doc is not None else None
            at = self._doc.get("at_ms") if self._doc is not None else None
            age = now_ms() - at if isinstance(at, int) else None
        doc["host"] = {
            "workers": host.workers,
            "member": member,
            "published_age_ms": age,
            "answered_by": host.slot,
        }
        return doc

    def _state(self) -> dict[str, Any]:
        seen: set[str] = set()
        pools: dict[str, Any] = {}
        for name, pool in self.running.pools.items():
            lease = self.pools.get(name)
            snap = pool.snapshot()
            view = lease.view if lease is not None else {}
            seen.update(view)
            instances: dict[str, Any] = {}
            for inst in snap.instances:
                if inst.removed:
                    continue
                instances[inst.name] = {
                    "max_concurrency": inst.max_concurrency,
                    "lease": inst.lease,
                    "in_flight": inst.in_flight,
                    "replicas": {
                        r: {"lease": row[inst.name][0], "in_flight": row[inst.name][1]}
                        for r, row in sorted(view.items())
                        if inst.name in row
                    },
                }
            pools[name] = {
                "replicas": lease.replicas if lease is not None else None,
                "recovering": lease.recovering if lease is not None else False,
                "fenced": snap.lease_fenced,
                "fail_static": lease.fail_static if lease is not None else False,
                "waiting_for_lease": snap.lease_waiting,
                "instances": instances,
            }
        age = None if self._last_ok is None else round(time.monotonic() - self._last_ok, 3)
        latency = self.last_latency_s
        return {
            "replica_id": self.replica,
            "status": self.status,
            "degraded": self.status == "degraded",
            "redis": {
                "up": self.redis_up,
                "consecutive_failures": self.failures,
                "last_error": self.last_error,
                "last_ok_age_s": age,
            },
            "sync": {
                "lease_ms": self.settings.lease_ms,
                "renew_ms": self.settings.renew_ms,
                "last_latency_ms": None if latency is None else round(latency * 1000, 3),
            },
            "replicas_seen": sorted(seen),
            "pools": pools,
            "hints": {
                "published": self.hints.published,
                "received": self.hints.received,
                "active": [
                    {"pool": p, "instance": i, "reporter": r, "remaining_ms": ms}
                    for p, i, r, ms in self.hints.active
                ],
            },
            "rate_limits": dict(self.rates.view()),
        }


_LEAVE: dict[str, Any] = {"i": {}, "h": {}, "leave": True}


class _ClusterCollector(Collector):
    """SPEC §13 gauges, read at scrape time: leases, replicas, Redis up, fail-static."""

    def __init__(self, node: ClusterNode) -> None:
        self._node = node

    def collect(self) -> Iterator[Any]:
        node = self._node
        mine = GaugeMetricFamily(
            "gateway_cluster_lease_slots",
            "Slots of each instance this replica holds (its local cap)",
            labels=["pool", "instance"],
        )
        theirs = GaugeMetricFamily(
            "gateway_cluster_replica_lease_slots",
            "Slots of each instance held per replica, as of the last sync",
            labels=["pool", "instance", "replica"],
        )
        replicas = GaugeMetricFamily(
            "gateway_cluster_replicas", "Live replicas seen at the last sync", labels=["pool"]
        )
        for name, pool in node.running.pools.items():
            for inst in pool.snapshot().instances:
                if not inst.removed and inst.lease is not None:
                    mine.add_metric([name, inst.name], inst.lease)
            lease = node.pools.get(name)
            if lease is None:
                continue
            if lease.replicas is not None:
                replicas.add_metric([name], lease.replicas)
            for replica, row in lease.view.items():
                for instance, (held, _) in row.items():
                    theirs.add_metric([name, instance, replica], held)
        yield from (mine, theirs, replicas)
        flags = (
            (
                "gateway_cluster_redis_up",
                "1 if the last sync with Redis succeeded",
                node.redis_reachable,
            ),
            (
                "gateway_cluster_fail_static",
                "1 while a pool runs on the static share (Redis unreachable)",
                node.fail_static,
            ),
            ("gateway_cluster_fenced", "1 while a pool is self-fenced", node.fenced),
            (
                "gateway_cluster_degraded",
                "1 while /readyz reports cluster: degraded",
                node.status == "degraded",
            ),
        )
        for metric, doc, value in flags:
            yield GaugeMetricFamily(metric, doc, value=1.0 if value else 0.0)
