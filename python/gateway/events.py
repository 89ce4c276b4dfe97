"""The gateway's public, typed event stream: what happened, for programs (the demo's
analysis, tests, embedders) — never parsed out of log text.

    unsubscribe = server.gateway.events.subscribe(print)

Publishing costs one truthiness check while nobody listens. A listener runs on the event loop
inside the gateway's own bookkeeping: it must be quick and must not block; an exception it
raises is logged and otherwise ignored.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any, TypeAlias

__all__ = ["Events", "GatewayEvent", "InstanceChanged", "ProbeFinished", "RequestFinished"]

log = logging.getLogger("gateway")


@dataclass(frozen=True, slots=True)
class RequestFinished:
    """One proxied request answered (its access-log line, typed)."""

    id: str
    pool: str | None
    instance: str | None
    priority: str | None
    complexity: str | None
    rule: str | None
    queue_ms: float
    upstream_ms: float
    status: int
    attempts: int
    error: str | None
    total_ms: float
    # "http", or "batch" for a Batch API line (SPEC §14: marked as such in the access log).
    source: str = "http"
    # The client key's configured name (`auth.keys[].name`; None: no key) — never the key.
    key: str | None = None
    # Tokens the upstream's `usage` reported for the answer (None: it reported none).
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    # SPEC §15: hit, spill or none, and the prompt bytes the instance held (None: no blocks).
    affinity: str | None = None
    affinity_match: int | None = None
    # SPEC §17: the latency objectives' verdict, met, missed or shed (None: no objective).
    slo: str | None = None
    at: float = field(default_factory=time.time)

    def fields(self) -> dict[str, Any]:
        """The access log's fields."""
        out = asdict(self)
        del out["at"]
        return out


@dataclass(frozen=True, slots=True)
class InstanceChanged:
    """SPEC §9 lifecycle: an instance's circuit state changed (`ejected`, `half_open`,
    `healthy`)."""

    pool: str
    instance: str
    state: str
    ejections: int
    at: float = field(default_factory=time.time)


@dataclass(frozen=True, slots=True)
class ProbeFinished:
    """One active probe's result (SPEC §6)."""

    pool: str
    instance: str
    ok: bool
    at: float = field(default_factory=time.time)


GatewayEvent: TypeAlias = RequestFinished | InstanceChanged | ProbeFinished
Listener: TypeAlias = Callable[[GatewayEvent], None]


class Events:
    """Subscribers of one gateway's events."""

    __slots__ = ("_listeners",)

    def __init__(self) -> None:
        self._listeners: tuple[Listener, ...] = ()

    def __bool__(self) -> bool:
        """Whether anyone listens (publishers may skip building an event otherwise)."""
        return bool(self._listeners)

    def subscribe(self, listener: Listener) -> Callable[[], None]:
        """Adds `listener`; returns the function that removes it."""
        self._listeners = (*self._listeners, listener)

        def unsubscribe() -> None:
            self._listeners = tuple(x for x in self._listeners if x is not listener)

        return unsubscribe

    def publish(self, event: GatewayEvent) -> None:
        for listener in self._listeners:
            try:
                listener(event)
            except Exception:
                log.exception("event listener failed")
