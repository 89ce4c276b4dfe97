"""The running state built from a config: per pool, its core scheduler and its upstreams."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from gateway import _core
from gateway.config import Config, PoolSpec
from gateway.router import Router
from gateway.scheduler import PoolScheduler
from gateway.upstream import Upstream

__all__ = ["PoolRuntime", "Runtime", "core_config"]

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

    def live_upstreams(self) -> list[tuple[int, Upstream]]:
        """The instances of the current config (not the removed, draining ones)."""
        core = self.scheduler.core
        return [(i, u) for i, u in enumerate(self.upstreams) if not core.instance(i, 0).removed]


class Runtime:
    """Pools, upstreams and routing of one loaded config."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.router = Router(config)
        self.pools: dict[str, PoolRuntime] = {}
        self._tickets = itertools.count(1)
        for name, spec in config.pools.items():
            core = _core.Pool(core_config(config, spec), seed=config.seed)
            pool = PoolRuntime(name, spec, PoolScheduler(name, core))
            for inst in spec.instances:
                core.add_instance(inst.max_concurrency)
                pool.upstreams.append(Upstream(inst, config.timeouts))
            self.pools[name] = pool

    def next_ticket(self) -> int:
        """Tickets are allocated in arrival order; a retry keeps its ticket, hence its place."""
        return next(self._tickets)

    def quiet(self) -> bool:
        """Nothing waiting and nothing in flight anywhere."""
        return all(
            p.scheduler.core.waiting == 0 and p.scheduler.core.in_flight == 0
            for p in self.pools.values()
        )

    async def close(self) -> None:
        for pool in self.pools.values():
            pool.scheduler.close()
            for up in pool.upstreams:
                await up.close()
