"""The local half of SPEC §13 leases: what one pool of this replica may admit on each instance,
enforced by the Rust core with no Redis call on the request path.

SPEC §13: "Each replica leases a share of every instance's `max_concurrency`; the sum of live
leases never exceeds it" and "No Redis round trip on the per-request path". The background sync
(`gateway.cluster.leases`) decides the shares; this module makes the core obey them:

- a lease of n ≥ 1 slots is the core's cap for the instance (`set_max_concurrency(i, n)`): the
  core already never grants past its cap, and a cap below the in-flight count only stops new
  grants until enough attempts finish;
- a lease of 0 ("blocked") cannot be a cap — the core refuses 0 — so it is enforced one step
  earlier: new requests enter the core with the blocked instances in their `excluded` set (as
  if already tried), and a request for which every instance is blocked waits here, bounded
  like a queue (`scheduler.high.max_wait_ms`, at least `lease_ms`), for a lease instead of
  entering the core's queue. Requests already queued when
  a leased instance becomes blocked could still be granted it, so at that moment they are
  answered 503 `overloaded` with `Retry-After` (only self-fencing, and more replicas than an
  instance has slots, ever block an instance that was leased).

Self-fencing (SPEC §13 "a replica that dies frees its share within `lease_ms`", so a replica
that cannot renew must stop first): each renewal sets an expiry on the monotonic clock,
`lease_ms − margin` after the renewal was *sent*, before Redis can expire the lease. Every
admission point — a request, a release, a probe, a scheduler tick, and a timer — checks it
first; the first one that finds it passed blocks every instance (each cap drops to what is in
flight) before it does anything else. A process woken from SIGSTOP therefore fences before it
grants anything from its stale lease. (Redis merely unreachable does not fence: the sync moves
the pool to its static share before the lease runs out, so its queue stays queued.)
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from gateway import _core
from gateway.clock import now_ms
from gateway.errors import DEFAULT_RETRY_AFTER_MS, GatewayError, Overloaded

__all__ = ["LocalLeases"]


def _lease_lost() -> GatewayError:
    return Overloaded(
        "This gateway replica lost its share of the pool's capacity; retry later.",
        retry_after_ms=DEFAULT_RETRY_AFTER_MS,
    )


class LocalLeases:
    """One pool's leased slots per core instance index, applied to its core."""

    def __init__(
        self,
        core: _core.Pool,
        fail_waiting: Callable[[Callable[[], GatewayError]], int],
        capacity: Callable[[int], int],
        gate_wait_ms: int,
    ) -> None:
        self._core = core
        # Answers every request queued in the core (PoolScheduler.fail_all_waiting).
        self._fail_waiting = fail_waiting
        # The configured max_concurrency of index i: no lease is larger.
        self._capacity = capacity
        self._gate_wait_s = gate_wait_ms / 1000
        self._slots: dict[int, int] = {}
        #: Instances this replica holds no slot of, as a bit set (excluded from new requests).
        self.blocked = 0
        #: Monotonic ms at which the lease must be considered lost (None: fenced or not leased).
        self.expiry_ms: int | None = None
        #: True until the first lease, and from a fence until the next fresh lease.
        self.fenced = True
        #: Requests waiting here because every instance they may use is blocked.
        self.waiting = 0
        self._changed = asyncio.Event()
        self._timer: asyncio.TimerHandle | None = None

    # ---- the request path ------------------------------------------------------------------

    async def admit(self, excluded: int) -> int:
        """The `excluded` set a new request enters the core with: its own plus the blocked
        instances. Waits (bounded like a queue) while every instance it may use is blocked;
        then raises `Overloaded` (503 with Retry-After)."""
        expiry = self.expiry_ms
        if expiry is not None and now_ms() >= expiry:
            self.fence()
        if not self.blocked:
            return excluded
        return await self._admit_blocked(excluded)

    def guard(self) -> None:
        """Fences if the lease expired; called before anything that may grant a slot."""
        expiry = self.expiry_ms
        if expiry is not None and now_ms() >= expiry:
            self.fence()

    async def _admit_blocked(self, excluded: int) -> int:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._gate_wait_s
        while True:
            mask = excluded | self.blocked
            if self._any_open(mask):
                return mask
            changed = self._changed
            self.waiting += 1
            try:
                async with asyncio.timeout_at(deadline):
                    await changed.wait()
            except TimeoutError:
                raise _lease_lost() from None
            finally:
                self.waiting -= 1

    def _any_open(self, mask: int) -> bool:
        """Whether some instance of the config is outside `mask`."""
        now = now_ms()
        core = self._core
        for i in range(core.instance_count):
            if not (mask >> i) & 1 and not core.instance(i, now).removed:
                return True
        return False

    # ---- the sync task's side --------------------------------------------------------------

    def lease(self, index: int) -> int | None:
        """Slots of instance `index` this replica may use now (0: blocked)."""
        return 0 if (self.blocked >> index) & 1 else self._slots.get(index, 0)

    def assign(self, slots: dict[int, int], expiry_ms: int | None) -> None:
        """`Capacity.assign`: a fresh lease until `expiry_ms`, or (None) the static share."""
        if expiry_ms is None:
            self.set_static(slots)
        else:
            self.apply(slots, expiry_ms)

    def shown_max(self, core_max: int, configured: int) -> int:
        return configured  # the core's cap is this replica's share

    def apply(self, slots: dict[int, int], expiry_ms: int) -> None:
        """A fresh lease from Redis: these slots per index, valid until `expiry_ms` (monotonic).
        Indexes not named keep their slots."""
        self.expiry_ms = expiry_ms
        self.fenced = False
        self._arm(expiry_ms)
        for index, n in slots.items():
            self._slots[index] = n
        self.reapply()

    def set_static(self, slots: dict[int, int]) -> None:
        """SPEC §13 "Redis unreachable": a safe static share, with no expiry."""
        self.expiry_ms = None
        self.fenced = False
        self._disarm()
        self._slots.update(slots)
        self.reapply()

    def fence(self) -> None:
        """SPEC §13 self-fencing: no new admissions; every cap drops to what is in flight."""
        self.expiry_ms = None
        self.fenced = True
        self._disarm()
        self._slots.clear()
        self.reapply()

    def forget(self, index: int) -> None:
        """Index `index` now holds another instance (a reload reused a drained slot)."""
        self._slots.pop(index, None)

    def reapply(self) -> None:
        """Puts every index's lease into the core (after a lease, a fence or a reload)."""
        opened = False
        now = now_ms()
        for i in range(self._core.instance_count):
            slots = min(self._slots.get(i, 0), self._capacity(i))
            opened |= self._apply(i, slots, now)
        if opened:
            changed, self._changed = self._changed, asyncio.Event()
            changed.set()

    def _apply(self, index: int, slots: int, now: int) -> bool:
        """Applies one index's slots; returns whether it was blocked and no longer is."""
        bit = 1 << index
        if slots > 0:
            self._core.set_max_concurrency(index, slots)
            was_blocked = bool(self.blocked & bit)
            self.blocked &= ~bit
            return was_blocked
        in_flight = self._core.instance(index, now).in_flight
        # The core refuses a cap of 0: the cap is what runs (at least 1), the mask does the rest.
        self._core.set_max_concurrency(index, max(1, in_flight))
        if not self.blocked & bit:
            self.blocked |= bit
            if self._core.waiting:
                # Queued requests were submitted without this instance excluded.
                self._fail_waiting(_lease_lost)
        return False

    def _arm(self, expiry_ms: int) -> None:
        self._disarm()
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # applied outside the loop (tests of the pool alone)
            return
        self._timer = loop.call_later(max(0, expiry_ms - now_ms()) / 1000, self.guard)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
