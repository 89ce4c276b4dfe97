"""Server-sent events checked on the way through.

The relay forwards whole events as soon as they are complete (never buffering the stream),
and checks each `data:` payload: JSON or `[DONE]`. A malformed event is the upstream's failure:
the client gets an error event instead of garbage its SDK would choke on. `usage` from the
final chunk (`stream_options.include_usage`) is kept for the token counters.

Cost is linear in the bytes relayed: each chunk is searched for an event boundary once (plus
the two bytes before it, for a boundary split across chunks), an incomplete event is kept as a
list of pieces, never re-joined and rescanned per chunk, and each complete event is parsed
once. SPEC §16: one event is bounded by `limits.max_event_bytes`; an upstream that never ends
its event (no blank line) gets `EventTooLarge` once the bound is passed.
"""

from __future__ import annotations

from typing import Any

import msgspec

__all__ = ["EventTooLarge", "MalformedEvent", "SseChecker"]


class _Event(msgspec.Struct):
    usage: dict[str, Any] | None = None
    error: Any = None


_event = msgspec.json.Decoder(_Event)


class MalformedEvent(ValueError):
    """A `data:` payload that is neither JSON nor `[DONE]`."""


class EventTooLarge(MalformedEvent):
    """SPEC §16: one SSE event larger than `limits.max_event_bytes`."""


def _boundary_end(data: bytes) -> int:
    """The index just past the last blank line (`\\n\\n` or `\\r\\n\\r\\n`) in `data`, or -1."""
    lf = data.rfind(b"\n\n")
    crlf = data.rfind(b"\n\r\n")
    if lf < 0 and crlf < 0:
        return -1
    return lf + 2 if lf > crlf else crlf + 3


class SseChecker:
    """Splits a byte stream into events and validates them; see `feed`."""

    __slots__ = ("_last", "_parts", "_pending", "max_event_bytes", "upstream_error", "usage")

    def __init__(self, max_event_bytes: int = 1 << 20) -> None:
        self.max_event_bytes = max_event_bytes
        self._parts: list[bytes] = []  # the incomplete last event, in pieces
        self._pending = 0  # its size
        self._last = b""  # its last two bytes (a boundary may straddle two chunks)
        self.usage: dict[str, Any] | None = None
        self.upstream_error: str | None = None

    def feed(self, chunk: bytes) -> bytes:
        """Returns the complete events in `chunk` (with any carried-over start), ready to send;
        keeps an incomplete last event for the next call. Raises `MalformedEvent` (or
        `EventTooLarge`)."""
        if self._pending:
            shift = len(self._last)
            end = _boundary_end(self._last + chunk[:3]) if shift else -1
            # A boundary inside the chunk itself wins: it is the later one.
            inner = _boundary_end(chunk)
            cut = inner if inner >= 0 else (end - shift if end >= 0 else -1)
        else:
            cut = _boundary_end(chunk)
        if cut < 0:
            self._keep(chunk)
            return b""
        rest = chunk[cut:]
        if self._parts:
            self._parts.append(chunk[:cut])
            complete = b"".join(self._parts)
            self._parts = []
        else:
            complete = chunk[:cut] if rest else chunk
        self._pending = 0
        self._last = b""
        self._check_all(complete)
        if rest:
            self._keep(rest)
        return complete

    def _keep(self, piece: bytes) -> None:
        self._parts.append(piece)
        self._pending += len(piece)
        self._last = (self._last + piece[-2:])[-2:]
        if self._pending > self.max_event_bytes:
            raise EventTooLarge(
                f"a stream event exceeded limits.max_event_bytes ({self.max_event_bytes})"
            )

    def finish(self) -> bytes:
        """What is left at the end of the stream (an unterminated last event), checked."""
        tail = b"".join(self._parts)
        self._parts, self._pending, self._last = [], 0, b""
        if tail.strip():
            self._check_all(tail)
        return tail

    def _check_all(self, events: bytes) -> None:
        if b"\r" in events:
            events = events.replace(b"\r\n", b"\n")
        for event in events.split(b"\n\n"):
            if event:
                self._check(event)

    def _check(self, event: bytes) -> None:
        for line in event.split(b"\n"):
            if not line.startswith(b"data:"):
                continue  # comments, `event:`, `id:`, `retry:` pass as they are
            payload = line[5:].strip()
            if payload == b"[DONE]":
                continue
            try:
                # The whole payload's syntax is checked; only `usage` and `error` become
                # Python objects (the choices are skipped, which is most of the cost saved).
                obj = _event.decode(payload)
            except msgspec.ValidationError:
                continue  # JSON, but not an object: nothing for us in it
            except msgspec.DecodeError:
                raise MalformedEvent("a stream event was not JSON") from None
            if obj.usage:
                self.usage = obj.usage
            if obj.error is not None:
                err = obj.error
                msg = err.get("message") if isinstance(err, dict) else err
                self.upstream_error = str(msg)[:200]
