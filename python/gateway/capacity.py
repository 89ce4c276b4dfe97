"""One interface for "may I take a unit of this instance?" beyond the pool's own counters.

tower's split of *what load is* from *how to pick* is the model: the `Pool` calls its
`Capacity` unconditionally at a few points (admission, before anything that may grant a slot,
a reload, a snapshot) and does not know where the answer came from. `OwnCapacity` is a single
process or a worker whose region the core already consults (SPEC §12: nothing more to ask);
`cluster.local.LocalLeases` is a replica's leased share of each instance (SPEC §13).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from gateway import _core
    from gateway.errors import GatewayError

__all__ = ["Capacity", "CapacityFactory", "OwnCapacity", "own_capacity"]


class Capacity(Protocol):
    """Where an instance's slots come from, as the `Pool` sees it."""

    #: Requests waiting here because every instance they may use has no capacity for them.
    waiting: int
    #: Whether this pool has lost its share (SPEC §13 self-fencing): it admits nothing new.
    fenced: bool

    async def admit(self, excluded: int) -> int:
        """The `excluded` set a new request enters the core with (its own plus what this
        pool may not use now); may wait, bounded, or raise a `GatewayError`."""
        ...

    def guard(self) -> None:
        """Called before anything that may grant a slot (a release, a probe, a tick)."""
        ...

    def assign(self, slots: dict[int, int], expiry_ms: int | None) -> None:
        """A share per instance index from outside, valid until `expiry_ms` (None: static)."""
        ...

    def forget(self, index: int) -> None:
        """Index `index` now holds another instance (a reload reused a drained slot)."""
        ...

    def reapply(self) -> None:
        """Puts the share into the core again (after a reload)."""
        ...

    def lease(self, index: int) -> int | None:
        """Slots of instance `index` this pool holds (None: not leased, its own counters)."""
        ...

    def shown_max(self, core_max: int, configured: int) -> int:
        """The `max_concurrency` people see: the core's, or the configured one under a lease
        (whose cap in the core is the share)."""
        ...


class OwnCapacity:
    """The pool's own counters (one process; or a worker, whose core reads the region)."""

    waiting = 0
    fenced = False

    async def admit(self, excluded: int) -> int:
        return excluded

    def guard(self) -> None:
        pass

    def assign(self, slots: dict[int, int], expiry_ms: int | None) -> None:
        raise RuntimeError("cluster mode is off: no share to assign")

    def forget(self, index: int) -> None:
        pass

    def reapply(self) -> None:
        pass

    def lease(self, index: int) -> int | None:
        return None

    def shown_max(self, core_max: int, configured: int) -> int:
        return core_max


#: Builds one pool's `Capacity` from its core, the pool's "answer every request queued in the
#: core with this error" and the configured `max_concurrency` of an instance index. The
#: composition root chooses it (`Topology.capacity`), so the `Pool` never asks which topology
#: it runs in.
CapacityFactory = Callable[
    ["_core.Pool", Callable[[Callable[[], "GatewayError"]], int], Callable[[int], int]], Capacity
]


def own_capacity(
    core: _core.Pool,
    fail_waiting: Callable[[Callable[[], GatewayError]], int],
    configured: Callable[[int], int],
) -> Capacity:
    """One process, or a worker on the region: the pool's own counters."""
    return OwnCapacity()
