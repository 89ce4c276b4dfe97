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

from gateway.telemetry import add_reasons

__all__ = ["EventTooLarge", "MalformedEvent", "SseChecker"]


class _Event(msgspec.Struct):
    usage: dict[str, Any] | None = None
    error: Any = None


class _Choice(msgspec.Struct):
    finish_reason: Any = None


class _TracedEvent(_Event):
    """An event of a sampled request: its choices' finish reasons are read too."""

    choices: list[_Choice] | None = None


_event = msgspec.json.Decoder(_Event)
_traced_event = msgspec.json.Decoder(_TracedEvent)


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
    """Splits a byte stream into events and validates them; see `feed`.

    After `data: [DONE]` the stream is over (`done`): whatever follows it is never relayed.
    A stream must carry at least one `data:` event (`finish` says so); a line that is no SSE
    field (`data`, `event`, `id`, `retry`, or a `:` comment) is garbage, not an event.
    """

    __slots__ = (
        "_last",
        "_parts",
        "data_events",
        "done",
        "error_seen",
        "finish_reasons",
        "max_event_bytes",
        "pending",
        "upstream_error",
        "usage",
    )

    def __init__(self, max_event_bytes: int = 1 << 20) -> None:
        self.max_event_bytes = max_event_bytes
        self._parts: list[bytes] = []  # the incomplete last event, in pieces
        self.pending = 0  # its size (0: no event is incomplete)
        self._last = b""  # its last two bytes (a boundary may straddle two chunks)
        self.usage: dict[str, Any] | None = None
        self.upstream_error: str | None = None
        self.done = False
        # Whether the events `feed` last returned hold an error event (they may quote
        # upstream text that must be scrubbed before it leaves).
        self.error_seen = False
        self.data_events = 0
        #: None: finish reasons are not read (the default: the choices are never decoded). A
        #: list (a sampled request's trace asks for them): each choice's `finish_reason`.
        self.finish_reasons: list[str] | None = None

    def feed(self, chunk: bytes) -> bytes:
        """Returns the complete events in `chunk` (with any carried-over start), ready to send;
        keeps an incomplete last event for the next call. Raises `MalformedEvent` (or
        `EventTooLarge`). Returns nothing once `done`."""
        self.error_seen = False
        if self.done:
            return b""
        if (
            not self.pending
            and chunk[:5] == b"data:"
            and chunk.find(b"\n") == len(chunk) - 2
            and chunk[-1:] == b"\n"
        ):
            # The common piece of a token stream: exactly one complete one-line `data:` event
            # (`data: {...}\n\n`; the only line feeds are its blank line). Checked like any
            # event, without the splitting `_check_all` does.
            if len(chunk) - 2 > self.max_event_bytes:
                raise EventTooLarge(
                    f"a stream event exceeded limits.max_event_bytes ({self.max_event_bytes})"
                )
            payload = chunk[5:-2].strip()
            if self.finish_reasons is not None or payload == b"[DONE]":
                if self._data(payload):
                    self.done = True
                return chunk
            # `_data` of an untraced stream's event, inline (the relay's per-event path).
            self.data_events += 1
            try:
                obj = _event.decode(payload)
            except msgspec.ValidationError:
                return chunk  # JSON, but not an object: nothing for us in it
            except msgspec.DecodeError:
                raise MalformedEvent("a stream event was not JSON") from None
            if obj.usage:
                self.usage = obj.usage
            if obj.error is not None:
                self._error(obj.error)
            return chunk
        if self.pending:
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
        self.pending = 0
        self._last = b""
        complete = self._check_all(complete)
        if rest and not self.done:
            self._keep(rest)
        return complete

    def _keep(self, piece: bytes) -> None:
        self._parts.append(piece)
        self.pending += len(piece)
        self._last = (self._last + piece[-2:])[-2:]
        if self.pending > self.max_event_bytes:
            raise EventTooLarge(
                f"a stream event exceeded limits.max_event_bytes ({self.max_event_bytes})"
            )

    def finish(self) -> bytes:
        """What is left at the end of the stream (an unterminated last event), checked.
        Raises `MalformedEvent` when the stream held no event at all."""
        tail = b"".join(self._parts)
        self._parts, self.pending, self._last = [], 0, b""
        self.error_seen = False
        tail = self._check_all(tail) if tail.strip() and not self.done else b""
        if not self.data_events and not self.done:
            raise MalformedEvent("the stream held no event")
        return tail

    def _check_all(self, events: bytes) -> bytes:
        """Checks complete events; returns them, cut after `[DONE]` if it is among them."""
        text = events.replace(b"\r\n", b"\n") if b"\r" in events else events
        offset = 0
        bound = self.max_event_bytes
        for event in text.split(b"\n\n"):
            offset += len(event) + 2
            if len(event) > bound:
                # SPEC §16: a complete event is bounded too, not only one still arriving.
                raise EventTooLarge(f"a stream event exceeded limits.max_event_bytes ({bound})")
            if event and self._check(event):
                self.done = True
                if text is events:
                    return events[: min(offset, len(events))]
                return text[: min(offset, len(text))]
        return events

    def _check(self, event: bytes) -> bool:
        """Validates one event; True when it is `data: [DONE]`."""
        for line in event.split(b"\n"):
            if line.startswith(b"data:"):
                payload = line[5:].strip()
            elif not line or line.startswith((b":", b"event:", b"id:", b"retry:")):
                continue  # comments and the other SSE fields pass as they are
            else:
                raise MalformedEvent("a stream line was not an SSE field")
            if self._data(payload):
                return True
        return False

    def _data(self, payload: bytes) -> bool:
        """Validates one `data:` payload (stripped); True when it is `[DONE]`."""
        self.data_events += 1
        if payload == b"[DONE]":
            return True
        try:
            # The whole payload's syntax is checked; only `usage` and `error` become
            # Python objects (the choices are skipped, which is most of the cost saved).
            obj = (_event if self.finish_reasons is None else _traced_event).decode(payload)
        except msgspec.ValidationError:
            return False  # JSON, but not an object: nothing for us in it
        except msgspec.DecodeError:
            raise MalformedEvent("a stream event was not JSON") from None
        if obj.usage:
            self.usage = obj.usage
        if isinstance(obj, _TracedEvent) and obj.choices:
            add_reasons(self.finish_reasons, (c.finish_reason for c in obj.choices))
        if obj.error is not None:
            self._error(obj.error)
        return False

    def _error(self, err: Any) -> None:
        """An event's `error` (vLLM reports a failure mid-stream this way)."""
        msg = err.get("message") if isinstance(err, dict) else err
        self.upstream_error = str(msg)[:200]
        self.error_seen = True
