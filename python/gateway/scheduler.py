"""Glue between the event loop and the Rust scheduling core.

The core decides (who goes next, to which instance, what health says); this module only
turns its answers into awaitable results: one future per waiting request, resolved when the
core grants, expires or evicts it, and one timer per pool armed at the core's next wakeup.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Iterable

from gateway import _core
from gateway._core import Affinity, EventKind, InstanceState, Outcome, Priority
from gateway.clock import LOOP_CLOCK, Clock, Timer, now_ms
from gateway.errors import (
    DEFAULT_RETRY_AFTER_MS,
    GatewayError,
    NoHealthyInstance,
    QueueTimeout,
    SloUnattainable,
)
from gateway.topology import WorkerLink

__all__ = ["PoolScheduler", "Unservable", "now_ms"]

_MAX_PAUSE_MS = 2**53
_U32_MAX = 2**32 - 1


class Unservable(NoHealthyInstance):
    """Evicted from the queue: no instance the request may use is up any more."""

    def __init__(self, retry_after_ms: int) -> None:
        super().__init__("no healthy instance left for the waiting request")
        self.retry_after_ms = retry_after_ms


class PoolScheduler:
    """One pool's core plus the futures of its waiting requests."""

    def __init__(
        self,
        name: str,
        core: _core.Pool,
        on_transition: Callable[[int, InstanceState], None] | None = None,
        link: WorkerLink | None = None,
        clock: Clock = LOOP_CLOCK,
    ) -> None:
        self.name = name
        self.core = core
        # The time every core call is given and the wake-up timer runs on (the composition
        # root's clock; a test's manual one). The function itself, kept: no lookup per call.
        self._clock = clock
        self._now = clock.now_ms
        # SPEC §12: the other workers, woken when a unit is theirs to take (None: one process).
        self._link = link
        # Told of every instance state change (ejected, half-open, restored), for the logs.
        self.on_transition = on_transition
        self._waiters: dict[int, tuple[asyncio.Future[tuple[int, Affinity, int]], Priority]] = {}
        self._timer: Timer | None = None
        self._timer_at: int | None = None

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
        """Waits for a slot; returns the granted instance index, the class it waited in,
        where it landed relative to its affinity key (SPEC §15; `NONE` without a key) and how
        many leading blocks of its prompt (`prefix`) that instance holds. SPEC §17:
        `deadline_ms` (arrival + TTFT objective on this module's clock; 0: none) orders the
        request inside its class, `prompt_tokens` feeds the latency model.

        Raises `QueueFull`, `NoHealthyInstance` (nothing up: try the fallback), `Unservable`
        (evicted while waiting, a `NoHealthyInstance`) or `QueueTimeout`. If the caller is
        cancelled while waiting, the request leaves the queue at once (or, if the grant raced
        the cancellation, its slot is released).
        """
        core = self.core
        granted = core.submit(
            ticket,
            priority,
            self._now(),
            tenant,
            excluded,
            affinity_key,
            prefix,
            deadline_ms=deadline_ms,
            prompt_tokens=prompt_tokens,
        )
        if core.has_transitions:
            self._transitions()
        if self._link is not None:
            self._wake_peers()
        if granted is not None:
            if not affinity_key and prefix is None:
                return granted, priority, Affinity.NONE, 0
            return granted, priority, core.last_affinity(), core.last_matched_blocks()
        # SPEC §3 "Overflow": a high request may wait as low.
        waited_as = core.waiting_class(ticket) or priority
        fut: asyncio.Future[tuple[int, Affinity, int]] = asyncio.get_running_loop().create_future()
        self._waiters[ticket] = (fut, waited_as)
        self.deliver(core.take_events())
        self._arm()
        try:
            instance, placed, matched = await fut
        except asyncio.CancelledError:
            self._abandon(ticket)
            raise
        return instance, waited_as, placed, matched

    def _abandon(self, ticket: int) -> None:
        """The waiter went away: take it out of the queue, or give back a slot it was granted."""
        self._waiters.pop(ticket, None)
        if not self.core.cancel(ticket):
            # Granted in the same loop iteration the cancellation arrived in.
            with contextlib.suppress(_core.UnknownTicket):  # expired or evicted: nothing held
                self.release(ticket, Outcome.NEUTRAL)

    def release(
        self, ticket: int, outcome: Outcome, retry_after_ms: int = 0, output_tokens: int = 0
    ) -> None:
        """An attempt ended; the freed slot goes to whoever the core picks. SPEC §17: the
        answer's `output_tokens` (0: unknown) teach the instance's latency model."""
        # The core clamps the pause to max_ejection_ms; this only keeps the value inside
        # the u64 it crosses the boundary as (an overflow there would lose the slot).
        pause = min(max(0, retry_after_ms), _MAX_PAUSE_MS)
        tokens = min(max(0, output_tokens), _U32_MAX)
        self.deliver(self.core.release(ticket, outcome, self._now(), pause, tokens))

    def first_token(self, ticket: int) -> None:
        """SPEC §17: the first content token of `ticket`'s attempt reached the gateway (the
        instance's TTFT sample)."""
        self.core.first_token(ticket, self._now())

    def record_probe(self, index: int, ok: bool) -> None:
        self.deliver(self.core.record_probe(index, ok, self._now()))

    def tick(self) -> None:
        """Expires overdue waiters and fills capacity that came back with time."""
        self.deliver(self.core.tick(self._now()))

    def _transitions(self) -> None:
        for index, state in self.core.take_transitions():
            if self.on_transition is not None:
                try:
                    self.on_transition(index, state)
                except Exception:  # a report failing must not lose the events with it
                    logging.getLogger("gateway.health").exception("transition report failed")

    def deliver(self, events: Iterable[_core.Event]) -> None:
        """Resolves the futures of the tickets the core moved (and reports state changes)."""
        if self.core.has_transitions:
            self._transitions()
        if self._link is not None:
            self._wake_peers()
        delivered = False
        for event in events:
            delivered = True
            ticket = event.ticket
            waiter = self._waiters.pop(ticket, None)
            fut = waiter[0] if waiter is not None else None
            if event.instance is not None:  # GRANTED
                if fut is None or fut.done():
                    # Its waiter is gone (cannot happen while cancel() runs first, but a
                    # slot must never leak): hand the slot straight back.
                    self.deliver(self.core.release(ticket, Outcome.NEUTRAL, self._now()))
                else:
                    fut.set_result((event.instance, event.affinity, event.matched_blocks))
            elif waiter is not None and fut is not None and not fut.done():
                if event.kind is EventKind.EXPIRED:
                    fut.set_exception(
                        QueueTimeout(
                            "Waited longer than the queue allows; retry later.",
                            retry_after_ms=self.retry_after(waiter[1]),
                        )
                    )
                elif event.kind is EventKind.UNATTAINABLE:
                    # SPEC §17 `shed_unattainable`: its objective was lost while it waited —
                    # answered now rather than served late.
                    fut.set_exception(
                        SloUnattainable(
                            "The request's latency objective can no longer be met; retry "
                            "later or with a longer objective.",
                            retry_after_ms=max(DEFAULT_RETRY_AFTER_MS, event.retry_after_ms),
                        )
                    )
                else:
                    # SPEC §6: 503 with "the time until the earliest instance may be tried".
                    wait = max(DEFAULT_RETRY_AFTER_MS, event.retry_after_ms)
                    fut.set_exception(Unservable(wait))
        if (delivered and self._waiters) or self._timer is not None:
            self._arm()

    def _wake_peers(self) -> None:
        """SPEC §12: workers the core found a free unit for (their class's turn, or a unit
        this worker's queue did not take) are woken through their eventfds."""
        assert self._link is not None
        mask = self.core.take_wakes()
        if mask:
            self._link.wake(mask)

    @property
    def waiters(self) -> int:
        """Requests awaiting an answer from the core (0 on a quiet gateway)."""
        return len(self._waiters)

    def retry_after(self, priority: Priority) -> int:
        """The core's estimate of the wait for a new request of this class, in ms."""
        return self.core.retry_after_ms(priority, self._now())

    def _arm(self) -> None:
        """Keeps one timer at the core's next wakeup (earliest deadline or recovery)."""
        now = self._now()
        at = self.core.next_wakeup(now)
        if at is None:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = self._timer_at = None
            return
        if self._timer is not None and self._timer_at is not None and self._timer_at <= at:
            return
        if self._timer is not None:
            self._timer.cancel()
        self._timer_at = at
        self._timer = self._clock.call_later(at - now, self._on_timer)

    def _on_timer(self) -> None:
        self._timer = self._timer_at = None
        self.tick()
        if self._waiters and self._timer is None:
            # A wake that answered nothing (a prediction moved since it was set, SPEC §17's
            # lost objectives) keeps the watch: the next wakeup is armed anyway.
            self._arm()

    def fail_all_waiting(self, make: Callable[[], GatewayError]) -> int:
        """Answers every waiter with an error (drain deadline, pool removed)."""
        n = 0
        for ticket in list(self._waiters):
            if self.core.cancel(ticket):
                fut, _ = self._waiters.pop(ticket)
                if not fut.done():
                    fut.set_exception(make())
                n += 1
        return n

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = self._timer_at = None
