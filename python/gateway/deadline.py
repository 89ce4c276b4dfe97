"""A per-request deadline that costs one timer, not one per await.

`asyncio.timeout()` creates, reschedules and cancels a timer around every guarded await; on
the proxy's hot path that was ~9 % of the CPU. A `Watchdog` keeps at most one timer per request
and re-arms it lazily: moving the deadline *later* (the common case: first byte → total →
stream idle) only records the new time; the old timer fires early, sees the deadline has not
passed, and re-arms itself once. Moving it *earlier* replaces the timer. When the deadline
passes, the task is cancelled and `expired` is set, so the caller can tell a timeout from a
client that went away.
"""

from __future__ import annotations

import asyncio
import math
from typing import Any

__all__ = ["Watchdog"]


class Watchdog:
    __slots__ = ("_handle", "_task", "deadline", "expired", "loop")

    def __init__(self, loop: asyncio.AbstractEventLoop, task: asyncio.Task[Any]) -> None:
        # Both are passed in: asyncio.get_running_loop() costs a getpid() syscall on 3.11.
        self.loop = loop
        self._task = task
        self._handle: asyncio.TimerHandle | None = None
        self.deadline = math.inf
        self.expired = False

    def arm(self, deadline: float) -> None:
        """Cancels the task at loop time `deadline` unless re-armed or disarmed before."""
        self.deadline = deadline
        handle = self._handle
        if handle is None or handle.when() > deadline:
            if handle is not None:
                handle.cancel()
            self._handle = self.loop.call_at(deadline, self._fire)

    def arm_in(self, seconds: float) -> None:
        self.arm(self.loop.time() + seconds)

    def disarm(self) -> None:
        self.deadline = math.inf
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None

    def _fire(self) -> None:
        self._handle = None
        if math.isinf(self.deadline):
            return
        if self.loop.time() < self.deadline:
            self._handle = self.loop.call_at(self.deadline, self._fire)
            return
        self.expired = True
        self._task.cancel()

    def absorb(self) -> bool:
        """After catching `CancelledError`: whether it was this deadline (then the task's
        cancellation is withdrawn and the caller reports a timeout) or someone else's."""
        if not self.expired:
            return False
        self.expired = False
        self.deadline = math.inf
        self._task.uncancel()
        return True
