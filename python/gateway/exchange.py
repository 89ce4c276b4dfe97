"""What is known about one request on its way through; becomes its headers and log line."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from multidict import istr

from gateway._core import Prefix, Priority
from gateway.deadline import Watchdog
from gateway.router import Decision

if TYPE_CHECKING:
    from gateway.telemetry import RequestSpan

__all__ = ["Attempt", "Exchange"]

# The response headers' names as aiohttp's case-insensitive headers keep them: a response
# built from str names folds each one's case (~1.1 µs for the nine of a request, 0.35 as istr).
_REQUEST_ID = istr("X-Request-Id")
_POOL = istr("X-Gateway-Pool")
_PRIORITY = istr("X-Gateway-Priority")
_COMPLEXITY = istr("X-Gateway-Complexity")
_INSTANCE = istr("X-Gateway-Instance")
_QUEUE_MS = istr("X-Gateway-Queue-Ms")
_AFFINITY = istr("X-Gateway-Affinity")
_AFFINITY_MATCH = istr("X-Gateway-Affinity-Match")
_SPILLED_FROM = istr("X-Gateway-Spilled-From")
_SLO = istr("X-Gateway-SLO")


@dataclass(slots=True)
class Attempt:
    """What one attempt on one instance learned. The forwarder makes a fresh one for every
    attempt, so a retry never sees what the previous attempt found."""

    # Time to first byte (the head, or for a stream its first chunk), seconds.
    ttfb: float | None = None
    # The upstream's `usage` (from the body, or the stream's last usage chunk).
    usage: dict[str, Any] | None = None
    # Why the attempt failed after the response started (for /admin/state).
    error: str | None = None
    # SPEC §17: when a stream's first content token reached the gateway (monotonic seconds;
    # None: not yet, or not a stream), and the stream's content events counted (its tokens,
    # where the upstream reports no `usage`).
    first_token_at: float | None = None
    tokens: int = 0


@dataclass(slots=True)
class Exchange:
    """One request: its decision, where it went, and how it went."""

    request_id: str
    started: float
    watchdog: Watchdog
    decision: Decision | None = None
    pool: str | None = None
    instance: str | None = None
    queue_ms: float = 0.0
    upstream_ms: float = 0.0
    attempts: int = 0
    waited_as: Priority | None = None
    status: int = 0
    error: str | None = None
    # The current (or last) attempt's findings; `None` before the first attempt.
    attempt: Attempt | None = None
    limit_headers: dict[str, str] | None = None
    spilled_from: str | None = None
    # SPEC §15: the request's affinity key (0: none) and where its attempt landed relative to
    # it — `hit`, `spill` or `none` (`X-Gateway-Affinity`).
    affinity_key: int = 0
    affinity: str = "none"
    # SPEC §15: the prompt's chained block hashes (None: no full block, or no affinity pool),
    # and the bytes of its leading blocks the granted instance held (None: not placed by them).
    affinity_prefix: Prefix | None = None
    affinity_match: int | None = None
    # Who asked: "http" (a client), or "batch" (a Batch API line run by the gateway itself).
    source: str = "http"
    # The name (`auth.keys[].name`, never the key) of the client key that made the request;
    # None without auth or before a key was recognised. Per-key metrics and the access log.
    key_name: str | None = None
    # Tracing (gateway.telemetry), when on: the request's span, its trace id when sampled
    # (exemplars, log line), and the trace-context header lines for the current attempt.
    span: RequestSpan | None = None
    trace_id: str | None = None
    trace_headers: bytes = b""
    # SPEC §17 latency objectives (gateway.slo): TTFT and TPOT objectives in ms (None: none),
    # the absolute deadline on the core's clock (arrival + TTFT objective; 0: none), the
    # prompt's estimated tokens, the verdict sent as `X-Gateway-SLO` (None: not judged yet)
    # and the final one counted (`met`, `missed`, `shed`; None: not judged yet).
    slo_ttft_ms: int | None = None
    slo_tpot_ms: int | None = None
    slo_deadline_ms: int = 0
    prompt_tokens: int = 0
    slo: str | None = None
    slo_result: str | None = None

    @property
    def has_objective(self) -> bool:
        return self.slo_ttft_ms is not None or self.slo_tpot_ms is not None

    @property
    def usage(self) -> dict[str, Any] | None:
        """The last attempt's `usage`, if it reported one."""
        a = self.attempt
        return a.usage if a is not None else None

    @property
    def priority_label(self) -> str | None:
        d = self.decision
        return (self.waited_as or d.priority).label if d is not None else None

    def headers(self) -> dict[str, str]:
        h: dict[str, str] = {_REQUEST_ID: self.request_id}
        d = self.decision
        if d is not None:
            h[_POOL] = self.pool or d.pool
            h[_PRIORITY] = (self.waited_as or d.priority).label
            h[_COMPLEXITY] = d.complexity_header
        if self.instance is not None:
            h[_INSTANCE] = self.instance
            h[_QUEUE_MS] = f"{self.queue_ms:.1f}"
            h[_AFFINITY] = self.affinity
            if self.affinity_match is not None:
                h[_AFFINITY_MATCH] = str(self.affinity_match)
        if self.spilled_from is not None:
            h[_SPILLED_FROM] = self.spilled_from
        if d is not None:
            # SPEC §17: `met`, `missed` (an error is never met) or `none` (no objective).
            h[_SLO] = self.slo or ("missed" if self.has_objective else "none")
        if self.limit_headers:
            h.update(self.limit_headers)
        return h
