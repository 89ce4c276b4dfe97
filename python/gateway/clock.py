"""Time as a value: what the pools, their schedulers and the supervisor read the time from and
schedule a call on, decided once by the composition root (`Server`, the supervisor's start)
and handed down.

`LOOP_CLOCK` is the real one: the monotonic clock in milliseconds (every core call is given
it; CLOCK_MONOTONIC is one clock for every process of a host, so a worker's heartbeat and the
supervisor's reading of it compare) and the running loop's timers. `ManualClock` is a test
clock (tokio's paused clock, linkerd's tests are the model): time moves only when the test
advances it, and the calls it passes run then, in order — so a restart back-off of 30 s or a
hang check is tested in microseconds, in one process.

On the hot path a clock call costs what the module function it replaces did: `LOOP_CLOCK
.now_ms` *is* that function (a static method, no bound-method object); holders keep
`clock.now_ms` in an attribute and call it.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import time
from collections.abc import Callable
from typing import Protocol

__all__ = ["LOOP_CLOCK", "Clock", "LoopClock", "ManualClock", "Timer", "now_ms"]


def now_ms() -> int:
    """The monotonic clock every core call is given, in milliseconds."""
    return time.monotonic_ns() // 1_000_000


class Timer(Protocol):
    """A call scheduled on a clock; `cancel()` before it ran means it never runs."""

    def cancel(self) -> None: ...


class Clock(Protocol):
    """Monotonic milliseconds and a way to run a call later."""

    def now_ms(self) -> int: ...

    def call_later(self, delay_ms: float, callback: Callable[[], object]) -> Timer:
        """Runs `callback` (on the loop) `delay_ms` from now, at the earliest."""
        ...


class LoopClock:
    """The real clock: `time.monotonic_ns` and the running event loop's timers."""

    now_ms = staticmethod(now_ms)

    def call_later(self, delay_ms: float, callback: Callable[[], object]) -> Timer:
        return asyncio.get_running_loop().call_later(max(0.0, delay_ms) / 1000, callback)


#: The clock everything runs on unless a test hands another one down.
LOOP_CLOCK: Clock = LoopClock()


class _ManualTimer:
    __slots__ = ("at", "callback", "cancelled")

    def __init__(self, at: int, callback: Callable[[], object]) -> None:
        self.at = at
        self.callback = callback
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


class ManualClock:
    """A test clock: `now_ms()` is what the test set; `advance(ms)` moves it and runs every
    call that came due, in due order (a call scheduled by a call runs too if it is due)."""

    def __init__(self, start_ms: int = 1_000_000) -> None:
        self._now = start_ms
        self._due: list[tuple[int, int, _ManualTimer]] = []
        self._order = itertools.count()

    def now_ms(self) -> int:
        return self._now

    def call_later(self, delay_ms: float, callback: Callable[[], object]) -> Timer:
        timer = _ManualTimer(self._now + max(0, int(-(-delay_ms // 1))), callback)
        heapq.heappush(self._due, (timer.at, next(self._order), timer))
        return timer

    @property
    def pending(self) -> list[int]:
        """When the calls not yet run (nor cancelled) are due, earliest first."""
        return sorted(at for at, _, t in self._due if not t.cancelled)

    def advance(self, ms: int) -> None:
        """Moves the clock `ms` on, running what comes due on the way at its own time."""
        end = self._now + ms
        while self._due and self._due[0][0] <= end:
            at, _, timer = heapq.heappop(self._due)
            if timer.cancelled:
                continue
            self._now = max(self._now, at)
            timer.callback()
        self._now = end
