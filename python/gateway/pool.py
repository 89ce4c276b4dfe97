"""One pool, one object: its core scheduling state, its upstream instances and its waiters.

`Pool` is the only door to a pool. The ingress asks it for a slot (`acquire`) and gives it
back (`release`); the prober reports to it (`record_probe`); `/admin/state`, `/readyz`, the
metrics and the demo read immutable `PoolSnapshot`s of it (grpc-go's picker is the model: an
immutable snapshot of the balancer's state). Nobody reaches into the core through it, and
"the core's instance `i` is `upstreams[i]`" is kept here and nowhere else.

This is also the seam where state shared beyond one process plugs in (SPEC §12 workers over
shared memory, SPEC §13 cluster leases): the methods above are the whole contract the ingress
and the prober rely on.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from gateway import _core
from gateway._core import Affinity, InstanceState, Outcome, Priority
from gateway.affinity import prefix_capacity_blocks, stable_id
from gateway.backend_load import BackendLoad
from gateway.capacity import Capacity, CapacityFactory, own_capacity
from gateway.clock import LOOP_CLOCK, Clock, now_ms
from gateway.config import Config, PoolSpec
from gateway.errors import GatewayError
from gateway.events import Events, InstanceChanged
from gateway.scheduler import PoolScheduler
from gateway.topology import WorkerLink
from gateway.upstream import Upstream

__all__ = ["InstanceSnapshot", "Pool", "PoolSnapshot", "core_config", "now_ms"]

log = logging.getLogger("gateway.health")

_POLICIES = {"weighted": _core.Policy.WEIGHTED, "strict": _core.Policy.STRICT}
_BALANCERS = {
    "least_connections": _core.Balancer.LEAST_CONNECTIONS,
    "round_robin": _core.Balancer.ROUND_ROBIN,
    "random": _core.Balancer.RANDOM,
    "p2c": _core.Balancer.P2C,
    "affinity": _core.Balancer.AFFINITY,
    # SPEC §17: the most headroom under the request's objective, by the latency model.
    "predicted": _core.Balancer.PREDICTED,
}


def core_config(config: Config, pool: PoolSpec) -> _core.PoolConfig:
    """The core's view of one pool's settings (SPEC §8 scheduler, balancer, health)."""
    s, h = config.scheduler, config.health
    return _core.PoolConfig(
        policy=_POLICIES[s.policy],
        high_capacity=s.high.capacity,
        low_capacity=s.low.capacity,
        high_weight=s.high.weight,
        low_weight=s.low.weight,
        high_max_wait_ms=s.high.max_wait_ms,
        low_max_wait_ms=s.low.max_wait_ms,
        max_consecutive_high=s.max_consecutive_high,
        max_low_wait_ms=s.max_low_wait_ms,
        overflow_high_to_low=s.overflow_high_to_low,
        balancer=_BALANCERS[pool.balancer or config.balancer],
        affinity_epsilon=config.affinity.epsilon,
        # SPEC §15: "bounded by that instance's cache size".
        prefix_capacity_blocks=prefix_capacity_blocks(config.affinity, len(pool.instances)),
        failure_threshold=h.failure_threshold,
        ejection_ms=h.ejection_ms,
        max_ejection_ms=h.max_ejection_ms,
        half_open_max_requests=h.half_open_max_requests,
        success_threshold=h.success_threshold,
        probing=h.probe.enabled,
    )


@dataclass(frozen=True, slots=True)
class InstanceSnapshot:
    """One instance at one moment. Times are monotonic milliseconds (the core's clock)."""

    index: int
    name: str
    # SPEC §7: `healthy`, `ejected`, `half_open`, or `cooling` (an upstream's Retry-After).
    state: str
    circuit: InstanceState
    in_flight: int
    max_concurrency: int
    consecutive_failures: int
    ejected_until_ms: int | None
    cooling_until_ms: int | None
    next_try_ms: int
    ejections: int
    removed: bool
    # The latest failed attempt: (unix time, our own reason text).
    last_error: tuple[float, str] | None
    # SPEC §15: what a vLLM backend last reported of its own load (None: not read).
    backend: BackendLoad | None = None
    # SPEC §13: the slots of it this replica holds (None: cluster mode off). In cluster mode
    # `max_concurrency` stays the configured capacity; the core's cap is this lease.
    lease: int | None = None
    # SPEC §15 (`balancer: affinity`): prompt blocks the index remembers as sent to it, and
    # its bound (the instance's cache size in blocks); None in other pools.
    prefix_index: tuple[int, int] | None = None
    # SPEC §17: the cap in force (an adaptive instance's current limit, else its
    # max_concurrency), whether it is adaptive, and the latency model's view of it: p90 TTFT
    # and TPOT of a typical request sent there now (ms), their mean absolute errors (ms), the
    # share of TTFT samples within the p90 band, the samples learnt from (decayed), and
    # whether the predictions are calibrated (only then do they place or shed requests).
    concurrency_limit: int = 0
    adaptive: bool = False
    predicted_ttft_ms: float = 0.0
    predicted_tpot_ms: float = 0.0
    ttft_mae_ms: float = 0.0
    tpot_mae_ms: float = 0.0
    ttft_coverage: float = 0.0
    samples: float = 0.0
    calibrated: bool = False

    @property
    def usable(self) -> bool:
        """Counts for readiness: in the config and not ejected."""
        return not self.removed and self.circuit is not InstanceState.EJECTED


@dataclass(frozen=True, slots=True)
class PoolSnapshot:
    """One pool at one moment: what /admin/state, /readyz and the metrics show."""

    name: str
    now_ms: int
    queued_high: int
    queued_low: int
    in_flight: int
    waiting: int
    outstanding: int
    waiters: int
    free_slots: int
    granted_high: int
    granted_low: int
    forced_low: int
    expired: int
    cancelled: int
    rejected_full: int
    drain_rate_per_s: float
    fallback: str | None
    # The instances of the config, and removed ones still finishing attempts.
    instances: tuple[InstanceSnapshot, ...]
    # SPEC §15: the pool's balancer, and its affinity grants to a key's first choice / later.
    balancer: str = "least_connections"
    affinity_hits: int = 0
    affinity_spills: int = 0
    # SPEC §13 (cluster mode): requests waiting for a lease (every instance they may use is
    # unleased), and whether the replica fenced itself (its lease could not be renewed).
    lease_waiting: int = 0
    lease_fenced: bool = False
    # SPEC §17 goodput in this process: requests with an objective, met / missed / shed.
    slo_met: int = 0
    slo_missed: int = 0
    slo_shed: int = 0

    @property
    def ready(self) -> bool:
        """SPEC §7 /readyz: at least one instance of the pool is not ejected."""
        return any(i.usable for i in self.instances)


def _display_state(info: _core.InstanceInfo, now: int) -> str:
    if info.state is not InstanceState.EJECTED and info.cool_until_ms > now:
        return "cooling"
    return info.state.label


class Pool:
    """A set of interchangeable instances with one dual queue (SPEC §3, §5, §6)."""

    def __init__(
        self,
        name: str,
        spec: PoolSpec,
        config: Config,
        events: Events,
        link: WorkerLink | None = None,
        clock: Clock = LOOP_CLOCK,
        capacity: CapacityFactory = own_capacity,
    ) -> None:
        self.name = name
        self.spec = spec
        self._events = events
        # The clock the core's time comes from (the composition root's; a test's manual one).
        self._now = clock.now_ms
        self._core = _core.Pool(core_config(config, spec), seed=config.seed)
        # SPEC §17: with shedding, a waiter whose objective is lost is answered, not re-keyed.
        self._core.set_shed_unattainable(config.scheduler.shed_unattainable)
        # SPEC §12: with --workers, this pool is one worker's share of the region (the
        # topology the composition root decided, handed down).
        self._link = link
        if self._link is not None:
            self._core.attach(self._link.region, stable_id(name), self._link.slot)
        self._scheduler = PoolScheduler(name, self._core, self._on_transition, self._link, clock)
        #: SPEC §15: requests carry an affinity key here (`balancer: affinity`).
        self.balancer = spec.balancer or config.balancer
        self.affine = self.balancer == "affinity"
        self._affinity = config.affinity
        # The core's instance i is _upstreams[i]; removed ones stay until their slot is reused.
        self._upstreams: list[Upstream] = []
        # SPEC §17: requests with an objective answered from this pool, by verdict.
        self._slo: dict[str, int] = {"met": 0, "missed": 0, "shed": 0}
        # Upstreams replaced in a reused slot, closed by `collect`.
        self._replaced: list[Upstream] = []
        # The latest failed attempt per upstream (not per slot: a reused slot starts clean).
        self._last_errors: dict[Upstream, tuple[float, str]] = {}
        # SPEC §15: the latest backend load reading per upstream (vLLM instances).
        self._backend: dict[Upstream, BackendLoad] = {}
        for inst in spec.instances:
            self._core.add_instance(
                inst.max_concurrency, stable_id(inst.name), inst.adaptive_concurrency
            )
            self._upstreams.append(Upstream(inst, config.timeouts))
        # Where slots come from beyond the core's counters: its own (one process, or a worker
        # on the region), or SPEC §13 this replica's leased share of each instance — the
        # composition root's choice (`Topology.capacity`). Called unconditionally.
        self._capacity: Capacity = capacity(
            self._core,
            self._scheduler.fail_all_waiting,
            lambda i: self._upstreams[i].spec.max_concurrency,
        )
        self._capacity.reapply()

    # ---- the request path ----------------------------------------------------------------

    async def acquire(
        self,
        ticket: int,
        priority: Priority,
        tenant: int = 0,
        excluded: int = 0,
        affinity_key: int = 0,
        prefix: _core.Prefix | None = None,
        deadline_ms: int = 0,
        prompt_tokens: int = 0,
    ) -> tuple[int, Priority, Affinity, int]:
        """Waits for a slot: (instance index, the class it waited in, where it landed relative
        to its affinity key, the leading blocks of `prefix` it holds). See `PoolScheduler`."""
        # SPEC §13: only instances this replica holds a lease of (a local mask, no Redis).
        excluded = await self._capacity.admit(excluded)
        return await self._scheduler.acquire(
            ticket, priority, tenant, excluded, affinity_key, prefix, deadline_ms, prompt_tokens
        )

    def attainable(self, priority: Priority, deadline_ms: int, prompt_tokens: int) -> int:
        """SPEC §17 "Unattainable": 0 when an instance of this pool is predicted to meet the
        deadline (or nothing is calibrated yet: fail open), else when it may be, in ms."""
        return self._core.attainable(priority, deadline_ms, prompt_tokens, self._now())

    def best_ttft_ms(self, prompt_tokens: int) -> float:
        """The lowest p90 TTFT predicted for a request of this size on a live instance of
        this pool now (inf: none), to rank pools by speed."""
        now = self._now()
        core = self._core
        best = float("inf")
        for i in range(len(self._upstreams)):
            info = core.instance(i, now)
            if info.removed or info.state is InstanceState.EJECTED or not info.calibrated:
                continue
            best = min(best, core.predict(i, prompt_tokens, now)[0])
        return best

    def first_token(self, ticket: int) -> None:
        """SPEC §17: the first content token of `ticket`'s attempt arrived (never raises)."""
        try:
            self._scheduler.first_token(ticket)
        except Exception:
            log.exception("recording a first token failed", extra={"fields": {"pool": self.name}})

    def note_slo(self, result: str) -> None:
        """SPEC §17: one request with an objective ended `met`, `missed` or `shed` here."""
        if result in self._slo:
            self._slo[result] += 1

    def upstream(self, index: int) -> Upstream:
        return self._upstreams[index]

    def release(
        self, ticket: int, outcome: Outcome, retry_after_ms: int = 0, output_tokens: int = 0
    ) -> None:
        """An attempt ended: its slot goes back. This never raises (it runs in `finally`
        blocks, and a slot that is not given back is lost until a restart)."""
        try:
            self._capacity.guard()  # SPEC §13 self-fencing before the slot is re-granted
            self._scheduler.release(ticket, outcome, retry_after_ms, output_tokens)
        except (KeyboardInterrupt, SystemExit, asyncio.CancelledError):
            raise
        except BaseException:
            # BaseException: a panic in the core surfaces as pyo3's PanicException, which is
            # not an Exception; it must not take the rest of the `finally` with it either.
            log.exception("releasing a slot failed", extra={"fields": {"pool": self.name}})

    def note_error(self, index: int, reason: str) -> None:
        """Remembers why an attempt on instance `index` failed (shown in /admin/state)."""
        self._last_errors[self._upstreams[index]] = (time.time(), reason)

    def claim_probe(self, index: int, interval_ms: int) -> bool:
        """SPEC §12 "one probe per instance per interval, not N": whether this worker probes
        instance `index` in this round (always, for a single process)."""
        return self._core.claim_probe(index, self._now(), max(1, interval_ms * 9 // 10))

    def record_probe(self, index: int, ok: bool) -> None:
        self._capacity.guard()
        self._scheduler.record_probe(index, ok)

    def set_backend_load(self, index: int, upstream: Upstream, load: BackendLoad | None) -> None:
        """SPEC §15: a reading of instance `index`'s own load (None: unreadable, so cleared).
        Ignored when a reload gave the index to another upstream meanwhile."""
        if index >= len(self._upstreams) or self._upstreams[index] is not upstream:
            return
        if load is None:
            if self._backend.pop(upstream, None) is not None:
                self._core.set_backend_load(index, 0, 0.0)
            return
        self._backend[upstream] = load
        self._core.set_backend_load(index, load.waiting, load.gpu_cache_usage)
        if load.kv_tokens and self.affine:
            # SPEC §15: the index of what was sent there is "bounded by that instance's cache
            # size" — its own, where vLLM says it (`vllm:cache_config_info`).
            blocks = prefix_capacity_blocks(self._affinity, len(self._upstreams), load.kv_tokens)
            if self._core.instance(index, self._now()).prefix_capacity != blocks:
                self._core.set_prefix_capacity(index, blocks)

    def can_take_now(self) -> bool:
        """Whether a request would be dispatched at once (a free slot, nobody waiting)."""
        return self._core.waiting == 0 and self._core.free_slots(self._now()) > 0

    def saturated(self, min_waiting: int) -> bool:
        """No free slot and at least `min_waiting` requests waiting (tier spill)."""
        return self._core.waiting >= min_waiting and self._core.free_slots(self._now()) == 0

    def fail_all_waiting(self, make: Callable[[], GatewayError]) -> int:
        """Answers every waiter with the error `make` builds (drain deadline)."""
        return self._scheduler.fail_all_waiting(make)

    def tick(self) -> None:
        self._capacity.guard()
        self._scheduler.tick()

    # ---- SPEC §13 cluster leases: the cluster sync's door ---------------------------------

    def apply_leases(self, slots: dict[int, int], expiry_ms: int | None) -> None:
        """This replica's share per instance index: a fresh lease valid until `expiry_ms`
        (monotonic ms; the replica fences itself then unless renewed), or with
        `expiry_ms=None` a static share that does not expire (Redis unreachable)."""
        self._capacity.assign(slots, expiry_ms)  # RuntimeError when cluster mode is off
        self.tick()  # capacity that came with the lease serves the queue at once

    @property
    def lease_waiting(self) -> int:
        """Requests waiting here for a lease (cheap: no snapshot; the host's member adds the
        other workers' to its demand, SPEC §12 × §13)."""
        return self._capacity.waiting

    # ---- what people and the prober see ---------------------------------------------------

    def live_upstreams(self) -> list[tuple[int, Upstream]]:
        """The instances of the current config (not the removed, draining ones)."""
        now = self._now()
        core = self._core
        return [(i, u) for i, u in enumerate(self._upstreams) if not core.instance(i, now).removed]

    def snapshot(self, now: int | None = None) -> PoolSnapshot:
        now = self._now() if now is None else now
        self._capacity.guard()  # SPEC §13: an expired lease reads as fenced, never as held
        core = self._core
        free_slots = core.free_slots(now)  # first: in a worker this reads the others' state
        stats = core.stats()
        granted_high, granted_low = core.grants_everywhere()
        peers_high, peers_low = core.peers_waiting()
        instances = []
        for i, up in enumerate(self._upstreams):
            info = core.instance(i, now)
            if info.removed and info.in_flight + info.peer_in_flight == 0:
                continue  # removed by a reload and drained (in every worker): gone
            instances.append(self._instance_snapshot(i, up, info, now))
        return PoolSnapshot(
            name=self.name,
            now_ms=now,
            queued_high=core.queued(Priority.HIGH) + peers_high,
            queued_low=core.queued(Priority.LOW) + peers_low,
            in_flight=sum(i.in_flight for i in instances),
            waiting=core.waiting + peers_high + peers_low,
            outstanding=core.outstanding,
            waiters=self._scheduler.waiters,
            free_slots=free_slots,
            granted_high=granted_high,
            granted_low=granted_low,
            forced_low=stats.forced_low,
            expired=stats.expired,
            cancelled=stats.cancelled,
            rejected_full=stats.rejected_full,
            drain_rate_per_s=core.drain_rate(now),
            fallback=self.spec.fallback,
            instances=tuple(instances),
            balancer=self.balancer,
            affinity_hits=stats.affinity_hits,
            affinity_spills=stats.affinity_spills,
            lease_waiting=self._capacity.waiting,
            lease_fenced=self._capacity.fenced,
            slo_met=self._slo["met"],
            slo_missed=self._slo["missed"],
            slo_shed=self._slo["shed"],
        )

    def _instance_snapshot(
        self, i: int, up: Upstream, info: _core.InstanceInfo, now: int
    ) -> InstanceSnapshot:
        state = _display_state(info, now)
        capacity = self._capacity
        return InstanceSnapshot(
            index=i,
            name=up.name,
            state=state,
            circuit=info.state,
            in_flight=info.in_flight + info.peer_in_flight,  # SPEC §12: every worker's
            max_concurrency=capacity.shown_max(info.max_concurrency, up.spec.max_concurrency),
            consecutive_failures=info.consecutive_failures,
            ejected_until_ms=info.ejected_until_ms,
            cooling_until_ms=info.cool_until_ms if state == "cooling" else None,
            next_try_ms=info.next_try_ms,
            ejections=info.ejections,
            removed=info.removed,
            last_error=self._last_errors.get(up),
            backend=self._backend.get(up),
            lease=capacity.lease(i),
            prefix_index=(info.prefix_blocks, info.prefix_capacity) if self.affine else None,
            concurrency_limit=info.concurrency_limit,
            adaptive=info.adaptive,
            predicted_ttft_ms=info.predicted_ttft_ms,
            predicted_tpot_ms=info.predicted_tpot_ms,
            ttft_mae_ms=info.ttft_mae_ms,
            tpot_mae_ms=info.tpot_mae_ms,
            ttft_coverage=info.ttft_coverage,
            samples=info.samples,
            calibrated=info.calibrated,
        )

    def _on_transition(self, index: int, state: InstanceState) -> None:
        # SPEC §9 lifecycle events: ejected, half-open, restored.
        event = {"healthy": "restored"}.get(state.label, state.label)
        info = self._core.instance(index, self._now())
        name = self._upstreams[index].name
        if self._events:
            self._events.publish(InstanceChanged(self.name, name, state.label, info.ejections))
        log.log(
            logging.WARNING if event == "ejected" else logging.INFO,
            f"instance {event}",
            extra={
                "fields": {
                    "pool": self.name,
                    "instance": name,
                    "state": state.label,
                    "ejections": info.ejections,
                }
            },
        )

    # ---- reload and teardown --------------------------------------------------------------

    def reconfigure(self, spec: PoolSpec, config: Config) -> None:
        """SPEC §8 hot reload: new settings apply to the next decision; instances whose name
        and URL stay keep their state and connections; removed ones take nothing new and
        drain; new ones join."""
        self._core.configure(core_config(config, spec))
        self._core.set_shed_unattainable(config.scheduler.shed_unattainable)
        self.spec = spec
        self.balancer = spec.balancer or config.balancer
        self.affine = self.balancer == "affinity"
        self._affinity = config.affinity
        wanted = {inst.name: inst for inst in spec.instances}
        kept: set[str] = set()
        for idx, up in self.live_upstreams():
            inst = wanted.get(up.name)
            if inst is None or inst.url.rstrip("/") != up.base_url:
                self._core.remove_instance(idx)  # drains: in-flight attempts finish
                continue
            self._core.set_max_concurrency(idx, inst.max_concurrency)
            self._core.set_adaptive(idx, inst.adaptive_concurrency)
            up.update(inst, config.timeouts)
            kept.add(up.name)
        for name, inst in wanted.items():
            if name in kept:
                continue
            idx = self._core.add_instance(
                inst.max_concurrency, stable_id(inst.name), inst.adaptive_concurrency
            )
            self._capacity.forget(idx)  # a reused slot: its old lease was another's
            fresh = Upstream(inst, config.timeouts)
            if idx < len(self._upstreams):
                # A drained, removed slot is reused; its old connections are closed later.
                self._replaced.append(self._upstreams[idx])
                self._upstreams[idx] = fresh
            else:
                self._upstreams.append(fresh)
        # SPEC §13: a configured capacity is never a cap here; new instances wait for a lease.
        self._capacity.reapply()
        self.tick()  # new capacity serves the queue at once

    def retire(self) -> None:
        """The pool left the config: every instance is removed; its waiters find none and
        move to the fallback or answer 503."""
        for idx in range(self._core.instance_count):
            self._core.remove_instance(idx)
        self.tick()

    @property
    def drained(self) -> bool:
        return self._core.in_flight == 0 and self._core.waiting == 0

    async def collect(self) -> None:
        """Closes the connection pools of removed instances once they drained."""
        for up in self._replaced:
            self._last_errors.pop(up, None)
            self._backend.pop(up, None)
            await up.close()
        self._replaced.clear()
        now = self._now()
        for idx, up in enumerate(self._upstreams):
            info = self._core.instance(idx, now)
            if info.removed and info.in_flight == 0 and not up.closed:
                await up.close()

    def abandon(self) -> None:
        """A pool built by a reload that was then refused: it never served, holds no
        connection, and leaves the region at once (SPEC §12)."""
        self._scheduler.close()
        self._core.detach()

    async def close(self) -> None:
        self._scheduler.close()
        self._core.detach()  # SPEC §12: its region cells (the last of its name: its place) go back
        for up in [*self._upstreams, *self._replaced]:
            await up.close()
