"""The running state built from a config: per pool, its core scheduler and its upstreams."""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass, field

from gateway import _core
from gateway.config import Config, PoolSpec
from gateway.router import Router
from gateway.scheduler import PoolScheduler
from gateway.upstream import Upstream

__all__ = ["PoolRuntime", "Runtime", "core_config"]

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


@dataclass(slots=True)
class PoolRuntime:
    """One pool: `upstreams[i]` is the core's instance `i` (removed ones stay until drained)."""

    name: str
    spec: PoolSpec
    scheduler: PoolScheduler
    upstreams: list[Upstream] = field(default_factory=list)
    # The latest failed attempt per instance index: (unix time, our own reason text).
    last_errors: dict[int, tuple[float, str]] = field(default_factory=dict)

    def live_upstreams(self) -> list[tuple[int, Upstream]]:
        """The instances of the current config (not the removed, draining ones)."""
        core = self.scheduler.core
        return [(i, u) for i, u in enumerate(self.upstreams) if not core.instance(i, 0).removed]


class Runtime:
    """Pools, upstreams and routing of the running config; `reload` swaps in a new one."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.router = Router(config)
        self.pools: dict[str, PoolRuntime] = {}
        # Pools removed by a reload, kept until their last attempt finished.
        self.retired: list[PoolRuntime] = []
        self._draining: list[Upstream] = []
        self._tickets = itertools.count(1)
        for name, spec in config.pools.items():
            self.pools[name] = self._new_pool(name, spec)

    def _new_pool(self, name: str, spec: PoolSpec) -> PoolRuntime:
        core = _core.Pool(core_config(self.config, spec), seed=self.config.seed)
        pool = PoolRuntime(name, spec, PoolScheduler(name, core))

        def on_transition(index: int, state: _core.InstanceState) -> None:
            # SPEC §9 lifecycle events: ejected, half-open, restored.
            event = {"healthy": "restored"}.get(state.label, state.label)
            info = core.instance(index, 0)
            log.log(
                logging.WARNING if event == "ejected" else logging.INFO,
                f"instance {event}",
                extra={
                    "fields": {
                        "pool": name,
                        "instance": pool.upstreams[index].name,
                        "state": state.label,
                        "ejections": info.ejections,
                    }
                },
            )

        pool.scheduler.on_transition = on_transition
        for inst in spec.instances:
            core.add_instance(inst.max_concurrency)
            pool.upstreams.append(Upstream(inst, self.config.timeouts))
        return pool

    def next_ticket(self) -> int:
        """Tickets are allocated in arrival order; a retry keeps its ticket, hence its place."""
        return next(self._tickets)

    def reload(self, config: Config) -> list[str]:
        """Applies a new, already validated config without dropping anything (SPEC §8 "Hot
        reload"): capacities, weights, thresholds, balancer and timeouts apply to the next
        decision; new instances join; removed instances take nothing new and drain; queued
        requests stay, and those of a removed pool go to its fallback or get 503.
        Returns notes on what could not be applied live."""
        notes = []
        if config.listen != self.config.listen:
            notes.append("listen address changes need a restart")
        if config.limits != self.config.limits:
            notes.append("limits apply to new connections only")
        self.config = config
        pools: dict[str, PoolRuntime] = {}
        for name, spec in config.pools.items():
            pool = self.pools.get(name)
            if pool is None:
                pools[name] = self._new_pool(name, spec)
                continue
            pool.scheduler.core.configure(core_config(config, spec))
            pool.spec = spec
            self._reconcile_instances(pool, config)
            pools[name] = pool
        for name, pool in self.pools.items():
            if name not in pools:
                core = pool.scheduler.core
                for idx in range(core.instance_count):
                    core.remove_instance(idx)
                # Its waiters find no instance: they move to the fallback or answer 503.
                pool.scheduler.tick()
                self.retired.append(pool)
        self.pools = pools
        self.router = Router(config)
        for pool in pools.values():
            pool.scheduler.tick()  # new capacity serves the queue at once
        return notes

    def _reconcile_instances(self, pool: PoolRuntime, config: Config) -> None:
        core = pool.scheduler.core
        wanted = {inst.name: inst for inst in pool.spec.instances}
        kept: set[str] = set()
        for idx, up in pool.live_upstreams():
            spec = wanted.get(up.name)
            if spec is None or spec.url.rstrip("/") != up.base_url:
                core.remove_instance(idx)  # drains: in-flight attempts finish
                continue
            core.set_max_concurrency(idx, spec.max_concurrency)
            up.update(spec, config.timeouts)
            kept.add(up.name)
        for name, spec in wanted.items():
            if name in kept:
                continue
            idx = core.add_instance(spec.max_concurrency)
            fresh = Upstream(spec, config.timeouts)
            if idx < len(pool.upstreams):
                # A drained, removed slot is reused; its old pool is closed by `collect`.
                self._draining.append(pool.upstreams[idx])
                pool.upstreams[idx] = fresh
            else:
                pool.upstreams.append(fresh)

    async def collect(self) -> None:
        """Closes the connection pools of removed instances once they drained."""
        for up in self._draining:
            await up.close()
        self._draining.clear()
        for pool in self.pools.values():
            core = pool.scheduler.core
            for idx, up in enumerate(pool.upstreams):
                info = core.instance(idx, 0)
                if info.removed and info.in_flight == 0 and not up.closed:
                    await up.close()
        still = []
        for pool in self.retired:
            if pool.scheduler.core.in_flight == 0 and pool.scheduler.core.waiting == 0:
                pool.scheduler.close()
                for up in pool.upstreams:
                    await up.close()
            else:
                still.append(pool)
        self.retired = still

    async def close(self) -> None:
        for pool in [*self.pools.values(), *self.retired]:
            pool.scheduler.close()
            for up in pool.upstreams:
                await up.close()
        for up in self._draining:
            await up.close()
