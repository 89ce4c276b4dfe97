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

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from gateway import _core
from gateway._core import InstanceState, Outcome, Priority
from gateway.config import Config, PoolSpec
from gateway.errors import GatewayError
from gateway.events import Events, InstanceChanged
from gateway.scheduler import PoolScheduler, now_ms
from gateway.upstream import Upstream

__all__ = ["InstanceSnapshot", "Pool", "PoolSnapshot", "core_config", "now_ms"]

log = logging.getLogger("gateway.health")

_POLICIES = {"weighted": _core.Policy.WEIGHTED, "strict": _core.Policy.STRICT}
_BALANCERS = {
    "least_connections": _core.Balancer.LEAST_CONNECTIONS,
    "round_robin": _core.Balancer.ROUND_ROBIN,
    "random": _core.Balancer.RANDOM,
    "p2c": _core.Balancer.P2C,
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

    def __init__(self, name: str, spec: PoolSpec, config: Config, events: Events) -> None:
        self.name = name
        self.spec = spec
        self._events = events
        self._core = _core.Pool(core_config(config, spec), seed=config.seed)
        self._scheduler = PoolScheduler(name, self._core, self._on_transition)
        # The core's instance i is _upstreams[i]; removed ones stay until their slot is reused.
        self._upstreams: list[Upstream] = []
        # Upstreams replaced in a reused slot, closed by `collect`.
        self._replaced: list[Upstream] = []
        # The latest failed attempt per upstream (not per slot: a reused slot starts clean).
        self._last_errors: dict[Upstream, tuple[float, str]] = {}
        for inst in spec.instances:
            self._core.add_instance(inst.max_concurrency)
            self._upstreams.append(Upstream(inst, config.timeouts))

    # ---- the request path ----------------------------------------------------------------

    async def acquire(
        self, ticket: int, priority: Priority, tenant: int = 0, excluded: int = 0
    ) -> tuple[int, Priority]:
        """Waits for a slot: (instance index, the class it waited in). See `PoolScheduler`."""
        return await self._scheduler.acquire(ticket, priority, tenant, excluded)

    def upstream(self, index: int) -> Upstream:
        return self._upstreams[index]

    def release(self, ticket: int, outcome: Outcome, retry_after_ms: int = 0) -> None:
        """An attempt ended: its slot goes back. This never raises (it runs in `finally`
        blocks, and a slot that is not given back is lost until a restart)."""
        try:
            self._scheduler.release(ticket, outcome, retry_after_ms)
        except Exception:
            log.exception("releasing a slot failed", extra={"fields": {"pool": self.name}})

    def note_error(self, index: int, reason: str) -> None:
        """Remembers why an attempt on instance `index` failed (shown in /admin/state)."""
        self._last_errors[self._upstreams[index]] = (time.time(), reason)

    def record_probe(self, index: int, ok: bool) -> None:
        self._scheduler.record_probe(index, ok)

    def can_take_now(self) -> bool:
        """Whether a request would be dispatched at once (a free slot, nobody waiting)."""
        return self._core.waiting == 0 and self._core.free_slots(now_ms()) > 0

    def saturated(self, min_waiting: int) -> bool:
        """No free slot and at least `min_waiting` requests waiting (tier spill)."""
        return self._core.waiting >= min_waiting and self._core.free_slots(now_ms()) == 0

    def fail_all_waiting(self, make: Callable[[], GatewayError]) -> int:
        """Answers every waiter with the error `make` builds (drain deadline)."""
        return self._scheduler.fail_all_waiting(make)

    def tick(self) -> None:
        self._scheduler.tick()

    # ---- what people and the prober see ---------------------------------------------------

    def live_upstreams(self) -> list[tuple[int, Upstream]]:
        """The instances of the current config (not the removed, draining ones)."""
        now = now_ms()
        core = self._core
        return [(i, u) for i, u in enumerate(self._upstreams) if not core.instance(i, now).removed]

    def snapshot(self, now: int | None = None) -> PoolSnapshot:
        now = now_ms() if now is None else now
        core = self._core
        stats = core.stats()
        instances = []
        for i, up in enumerate(self._upstreams):
            info = core.instance(i, now)
            if info.removed and info.in_flight == 0:
                continue  # removed by a reload and drained: gone
            state = _display_state(info, now)
            instances.append(
                InstanceSnapshot(
                    index=i,
                    name=up.name,
                    state=state,
                    circuit=info.state,
                    in_flight=info.in_flight,
                    max_concurrency=info.max_concurrency,
                    consecutive_failures=info.consecutive_failures,
                    ejected_until_ms=info.ejected_until_ms,
                    cooling_until_ms=info.cool_until_ms if state == "cooling" else None,
                    next_try_ms=info.next_try_ms,
                    ejections=info.ejections,
                    removed=info.removed,
                    last_error=self._last_errors.get(up),
                )
            )
        return PoolSnapshot(
            name=self.name,
            now_ms=now,
            queued_high=core.queued(Priority.HIGH),
            queued_low=core.queued(Priority.LOW),
            in_flight=core.in_flight,
            waiting=core.waiting,
            outstanding=core.outstanding,
            waiters=self._scheduler.waiters,
            free_slots=core.free_slots(now),
            granted_high=stats.granted_high,
            granted_low=stats.granted_low,
            forced_low=stats.forced_low,
            expired=stats.expired,
            cancelled=stats.cancelled,
            rejected_full=stats.rejected_full,
            drain_rate_per_s=core.drain_rate(now),
            fallback=self.spec.fallback,
            instances=tuple(instances),
        )

    def _on_transition(self, index: int, state: InstanceState) -> None:
        # SPEC §9 lifecycle events: ejected, half-open, restored.
        event = {"healthy": "restored"}.get(state.label, state.label)
        info = self._core.instance(index, now_ms())
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
        self.spec = spec
        wanted = {inst.name: inst for inst in spec.instances}
        kept: set[str] = set()
        for idx, up in self.live_upstreams():
            inst = wanted.get(up.name)
            if inst is None or inst.url.rstrip("/") != up.base_url:
                self._core.remove_instance(idx)  # drains: in-flight attempts finish
                continue
            self._core.set_max_concurrency(idx, inst.max_concurrency)
            up.update(inst, config.timeouts)
            kept.add(up.name)
        for name, inst in wanted.items():
            if name in kept:
                continue
            idx = self._core.add_instance(inst.max_concurrency)
            fresh = Upstream(inst, config.timeouts)
            if idx < len(self._upstreams):
                # A drained, removed slot is reused; its old connections are closed later.
                self._replaced.append(self._upstreams[idx])
                self._upstreams[idx] = fresh
            else:
                self._upstreams.append(fresh)
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
            await up.close()
        self._replaced.clear()
        now = now_ms()
        for idx, up in enumerate(self._upstreams):
            info = self._core.instance(idx, now)
            if info.removed and info.in_flight == 0 and not up.closed:
                await up.close()

    async def close(self) -> None:
        self._scheduler.close()
        for up in [*self._upstreams, *self._replaced]:
            await up.close()
