"""Server-sent events checked on the way through.

The relay forwards whole events as soon as they are complete (never buffering the stream),
and checks each `data:` payload: JSON or `[DONE]`. A malformed event is the upstream's failure:
the client gets an error event instead of garbage its SDK would choke on. `usage` from the
final chunk (`stream_options.include_usage`) is kept for the token counters.
"""

from __future__ import annotations

from typing import Any

import msgspec

__all__ = ["MalformedEvent", "SseChecker"]


class _Event(msgspec.Struct):
    usage: dict[str, Any] | None = None
    error: Any = None


_event = msgspec.json.Decoder(_Event)


class MalformedEvent(ValueError):
    """A `data:` payload that is neither JSON nor `[DONE]`."""


class SseChecker:
    """Splits a byte stream into events and validates them; see `feed`."""

    __slots__ = ("_tail", "done", "upstream_error", "usage")

    def __init__(self) -> None:
        self._tail = b""
        self.done = False
        self.usage: dict[str, Any] | None = None
        self.upstream_error: str | None = None

    def feed(self, chunk: bytes) -> bytes:
        """Returns the complete events in `chunk` (with any carried-over start), ready to send;
        keeps an incomplete last event for the next call. Raises `MalformedEvent`."""
        data = self._tail + chunk if self._tail else chunk
        if b"\r" in data:
            data = data.replace(b"\r\n", b"\n")
        end = data.rfind(b"\n\n")
        if end < 0:
            self._tail = data
            return b""
        complete, self._tail = data[: end + 2], data[end + 2 :]
        for event in complete.split(b"\n\n"):
            if event:
                self._check(event)
        return complete

    def finish(self) -> bytes:
        """What is left at the end of the stream (an unterminated last event), checked."""
        tail, self._tail = self._tail, b""
        if tail.strip():
            self._check(tail)
        return tail

    def _check(self, event: bytes) -> None:
        for line in event.split(b"\n"):
            if not line.startswith(b"data:"):
                continue  # comments, `event:`, `id:`, `retry:` pass as they are
            payload = line[5:].strip()
            if payload == b"[DONE]":
                self.done = True
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
