"""The running state built from a config: its pools and its routing; `reload` swaps in a new
config without dropping anything."""

from __future__ import annotations

import itertools
from collections.abc import Callable

from gateway import _core
from gateway.capacity import CapacityFactory, own_capacity
from gateway.clock import LOOP_CLOCK, Clock
from gateway.config import Config
from gateway.errors import ConfigError
from gateway.events import Events
from gateway.pool import Pool
from gateway.router import Router
from gateway.topology import WorkerLink

__all__ = ["Runtime"]


class Runtime:
    """Pools and routing of the running config."""

    def __init__(
        self,
        config: Config,
        events: Events | None = None,
        link: WorkerLink | None = None,
        clock: Clock = LOOP_CLOCK,
        capacity: Callable[[Config], CapacityFactory] = lambda _config: own_capacity,
    ) -> None:
        self.config = config
        self._link = link  # SPEC §12: the region new pools attach to (None: one process)
        self._clock = clock  # what every pool's core reads the time from
        # Where a pool's slots come from beyond its core (SPEC §13: a replica's leases), for
        # the config it is built from: the composition root's `Topology.capacity`.
        self._capacity = capacity
        self.events = events if events is not None else Events()
        self.router = Router(config)
        self.pools: dict[str, Pool] = {
            name: Pool(name, spec, config, self.events, link, clock, capacity(config))
            for name, spec in config.pools.items()
        }
        # Pools removed by a reload, kept until their last attempt finished.
        self.retired: list[Pool] = []
        self._tickets = itertools.count(1)

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
        old = self.config.limits
        if (config.limits.header_timeout_ms, config.limits.keepalive_timeout_ms) != (
            old.header_timeout_ms,
            old.keepalive_timeout_ms,
        ):
            # The HTTP server's protocol factory takes these once, at start.
            notes.append("limits.header_timeout_ms and keepalive_timeout_ms need a restart")
        # New pools first, before anything changes: with --workers each takes a place in the
        # shared region, and when it has none free (SPEC §12: its places are reclaimed as
        # retired pools drain, but they are bounded) the reload is refused whole and the
        # running config stays — never half applied, never a 500.
        fresh: dict[str, Pool] = {}
        try:
            for name, spec in config.pools.items():
                if name not in self.pools:
                    fresh[name] = Pool(
                        name,
                        spec,
                        config,
                        self.events,
                        self._link,
                        self._clock,
                        self._capacity(config),
                    )
        except _core.GatewayError as exc:
            for pool in fresh.values():
                pool.abandon()
            raise ConfigError("pools", f"cannot add a pool now: {exc}") from exc
        self.config = config
        pools: dict[str, Pool] = {}
        for name, spec in config.pools.items():
            if name in fresh:
                pools[name] = fresh[name]
            else:
                pools[name] = self.pools[name]
                pools[name].reconfigure(spec, config)
        for name, pool in self.pools.items():
            if name not in pools:
                pool.retire()
                self.retired.append(pool)
        self.pools = pools
        self.router = Router(config, previous=self.router)
        return notes

    async def collect(self) -> None:
        """Closes the connections of removed instances and pools once they drained."""
        for pool in self.pools.values():
            await pool.collect()
        still = []
        for pool in self.retired:
            if pool.drained:
                await pool.close()
            else:
                still.append(pool)
        self.retired = still

    async def close(self) -> None:
        for pool in [*self.pools.values(), *self.retired]:
            await pool.close()
