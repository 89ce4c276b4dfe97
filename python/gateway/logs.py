"""Structured logs: one JSON object per line (`--log-format json`) or readable text.

Records carry their data in `extra={"fields": {...}}`. Every record handler redacts what it is
given (`gateway.redact`): known secrets and credential-shaped text never reach the output.

The access log (one line per request) does not go through `logging` once `setup_logging` ran:
its line is built once from typed fields (ids, names, numbers — the one free-text field, a
request id the client chose, is redacted), as JSON or text, and handed to a `Sink` with the
other records. On the event loop the line is built in one call into the sink's buffer as the
request finishes (`gateway._core.LineBuffer.access`: the fields read and written without a
Python call each); what that call leaves to Python (a request id the client chose, a value
it cannot write exactly as orjson or `str()` would) is built by `AccessLog.line` from
`AccessSource.values`, the same line. The sink flushes its buffer every `FLUSH_S` or
`BATCH_LINES` lines to a writer thread, which alone writes to stderr: a slow terminal or a
full pipe stalls that thread, never the loop. Bounded (SPEC §16): while the thread is
`MAX_PENDING_BYTES` behind, further lines are dropped and counted
(`gateway_log_lines_dropped_total`), never queued without limit.
"""

from __future__ import annotations

import asyncio
import atexit
import logging
import os
import queue
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

import orjson

from gateway._core import LineBuffer
from gateway.redact import RedactingFilter

__all__ = [
    "ACCESS_FIELDS",
    "AccessLog",
    "AccessSource",
    "Sink",
    "access_log",
    "dropped_lines",
    "setup_logging",
]

#: Lines (bytes) handed to the writer thread and not written yet, beyond which lines drop.
MAX_PENDING_BYTES = 8 << 20
#: A buffered line waits at most this long on the loop before it goes to the writer thread.
FLUSH_S = 0.05
BATCH_LINES = 1024
#: A record other than an access line waits for the writer only while it is this close behind.
SETTLE_MAX_BYTES = 64 << 10

#: The access line's fields, in order (`RequestFinished` has the same names).
ACCESS_FIELDS = (
    "id",
    "pool",
    "instance",
    "priority",
    "complexity",
    "rule",
    "queue_ms",
    "upstream_ms",
    "status",
    "attempts",
    "error",
    "total_ms",
    "source",
    "key",
    "prompt_tokens",
    "completion_tokens",
    "affinity",
    "affinity_match",
    "slo",
)
_JSON_HEAD: dict[str, Any] = {
    "ts": 0.0,
    "level": "info",
    "logger": "gateway.access",
    "msg": "request",
}
_TEXT_HEAD = " info  gateway.access: request "
_TEXT_KEYS = tuple(k + "=" for k in ACCESS_FIELDS)


def _text_stamp(wall: float) -> str:
    """A text access line's head for the second of `wall` (what `AccessLog.line` writes)."""
    return time.strftime("%H:%M:%S", time.localtime(wall)) + _TEXT_HEAD


class AccessSource(Protocol):
    """What the access line of a finished request is built from (`gateway.access`): the
    prefix of the request ids the gateway makes (any other id is the client's, redacted) and
    the line's values in `ACCESS_FIELDS` order at monotonic time `now`."""

    @property
    def prefix(self) -> str: ...

    def values(self, ex: Any, now: float) -> tuple[Any, ...]: ...


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": round(record.created, 3),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict):
            out.update(fields)
        exc = _exc_text(self, record)
        if exc:
            out["exc"] = exc
        return orjson.dumps(out, default=str).decode()


class TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        stamp = time.strftime("%H:%M:%S", time.localtime(record.created))
        fields = getattr(record, "fields", None)
        tail = ""
        if isinstance(fields, dict):
            tail = " " + " ".join(f"{k}={v}" for k, v in fields.items() if v is not None)
        text = f"{stamp} {record.levelname.lower():5} {record.name}: {record.getMessage()}{tail}"
        exc = _exc_text(self, record)
        if exc:
            text += "\n" + exc
        return text


def _exc_text(formatter: logging.Formatter, record: logging.LogRecord) -> str | None:
    """The record's traceback: already rendered (and redacted) by `RedactingFilter`."""
    if record.exc_text:
        return record.exc_text
    if record.exc_info:
        return formatter.formatException(record.exc_info)
    return None


class Sink:
    """Lines to a file descriptor through a writer thread, batched on the event loop and
    bounded (see the module docstring). Thread-safe: `write` may be called from any thread;
    off the loop (or with no loop running) a line goes to the thread at once."""

    def __init__(self, fd: int, max_pending: int = MAX_PENDING_BYTES) -> None:
        self._fd = fd
        self._max_pending = max_pending
        # Lines waiting on the loop for the next flush (access lines are built into it).
        self._lines = LineBuffer(_text_stamp)
        self._timer: asyncio.TimerHandle | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._queue: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        self._lock = threading.Condition(threading.Lock())
        self._pending = 0  # bytes queued for the thread, not written yet
        self.dropped = 0  # lines dropped while the thread was too far behind
        self._thread: threading.Thread | None = None
        self._pid = 0

    def write(self, line: bytes) -> None:
        """Buffers one line (ending in a newline)."""
        loop = _running_loop()
        if loop is None:  # another thread, or no loop running: straight to the writer
            self._hand(line, 1)
            return
        if loop is not self._loop:
            self.flush()  # lines buffered for a loop no longer running
            self._loop = loop
        self.added(self._lines.push(line), loop)

    def added(self, buffered: int, loop: asyncio.AbstractEventLoop) -> None:
        """After a line was added on `loop` (the sink's): flushes at `BATCH_LINES` lines,
        else makes sure a flush is due within `FLUSH_S`."""
        if buffered >= BATCH_LINES:
            self.flush()
        elif self._timer is None:
            self._timer = loop.call_later(FLUSH_S, self.flush)

    def flush(self) -> None:
        """Hands the buffered lines to the writer thread."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        taken = self._lines.take()
        if taken is not None:
            self._hand(*taken)

    def _hand(self, data: bytes, lines: int) -> None:
        """Hands `lines` lines (`data`) to the writer thread."""
        with self._lock:
            if self._pending + len(data) > self._max_pending:
                # SPEC §16: bounded — the sink cannot keep up; the lines are counted, not kept.
                self.dropped += lines
                return
            self._pending += len(data)
        if self._thread is None or self._pid != os.getpid():
            self._start()
        self._queue.put(data)

    def _start(self) -> None:
        self._pid = os.getpid()
        self._thread = threading.Thread(target=self._run, name="gateway-log", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        get, fd = self._queue.get, self._fd
        while True:
            data = get()
            if data is None:
                return
            view = memoryview(data)
            try:
                while view:
                    view = view[os.write(fd, view) :]
            except OSError:
                pass  # stderr closed: nothing else to tell it
            with self._lock:
                self._pending -= len(data)
                if not self._pending:
                    self._lock.notify_all()

    def settle(self, timeout: float = 0.1) -> None:
        """Hands over what is buffered and waits (at most `timeout`) until it is written, so
        whatever the process writes to stderr directly next comes after it. Not at all while
        the writer is stuck (more than `SETTLE_MAX_BYTES` behind): the loop never waits on a
        stuck pipe for more than one such timeout."""
        self.flush()
        with self._lock:
            if self._pending <= SETTLE_MAX_BYTES:
                self._lock.wait_for(lambda: not self._pending, timeout)

    def close(self, timeout: float = 2.0) -> None:
        """Writes what is buffered and stops the thread (at exit)."""
        self.flush()
        thread = self._thread
        if thread is not None and thread.is_alive() and self._pid == os.getpid():
            self._queue.put(None)
            thread.join(timeout)
        self._thread = None


class _SinkHandler(logging.Handler):
    """A `logging` handler writing formatted records through the sink (the same order as the
    access lines, and the same writer thread)."""

    def __init__(self, sink: Sink) -> None:
        super().__init__()
        self._sink = sink

    def emit(self, record: logging.LogRecord) -> None:
        try:
            text = self.format(record)
            sink = self._sink
            sink.write(text.encode("utf-8", "replace") + b"\n")
            # Events are rare and read beside what the process prints itself (a last line
            # before exiting): written now, in order, unless stderr is stuck.
            sink.settle()
        except Exception:
            self.handleError(record)


class AccessLog:
    """The access-log line of one request, built from its typed fields."""

    def __init__(self, sink: Sink, fmt: str) -> None:
        self.sink = sink
        self.json = fmt == "json"
        self._second = -1
        self._stamp = ""

    def line(self, values: tuple[Any, ...], now: float | None = None) -> bytes:
        """`values` in `ACCESS_FIELDS` order (at wall-clock time `now`); None values are left
        out of a text line."""
        if now is None:
            now = time.time()
        if self.json:
            out = _JSON_HEAD.copy()
            out["ts"] = round(now, 3)
            out.update(zip(ACCESS_FIELDS, values, strict=True))
            return orjson.dumps(out, option=orjson.OPT_APPEND_NEWLINE)
        second = int(now)
        if second != self._second:
            self._second = second
            self._stamp = time.strftime("%H:%M:%S", time.localtime(now)) + _TEXT_HEAD
        # `k=` + str(v): what f"{k}={v}" made, a third cheaper
        tail = " ".join(
            [k + str(v) for k, v in zip(_TEXT_KEYS, values, strict=True) if v is not None]
        )
        return (self._stamp + tail + "\n").encode()

    def write(self, values: tuple[Any, ...]) -> None:
        self.sink.write(self.line(values))

    def record(self, source: AccessSource, item: Any) -> None:
        """The line of `item`, a request finished now: built at once into the sink's buffer
        in one call (`LineBuffer.access`, ~1 µs; nothing of the request is kept), else by
        `line` from `source.values`. The request's hot path (issue 25): the line built in
        Python cost ~6 µs of the loop's CPU, ~15 µs end to end."""
        sink = self.sink
        loop = _running_loop()
        mono = _monotonic()
        if loop is not None and loop is sink._loop:
            n = sink._lines.access(item, mono, source.prefix, self.json)
            if n >= 0:
                sink.added(n, loop)
                return
        try:
            line = self.line(source.values(item, mono))
        except Exception:  # a line that cannot be built is lost, and counted
            sink.dropped += 1
            return
        sink.write(line)


_monotonic = time.monotonic
# asyncio's own C lookup (what get_running_loop uses, without raising off the loop)
_running_loop: Callable[[], asyncio.AbstractEventLoop | None] = asyncio.events._get_running_loop

_SINK: Sink | None = None
_ACCESS: AccessLog | None = None


def access_log() -> AccessLog | None:
    """The process's access log, when `setup_logging` turned it on."""
    return _ACCESS


def dropped_lines() -> int:
    """Log lines dropped so far because the writer could not keep up."""
    return _SINK.dropped if _SINK is not None else 0


def setup_logging(fmt: str = "text", level: str = "info", access: bool = True) -> None:
    global _SINK, _ACCESS
    if _SINK is None:
        _SINK = Sink(sys.stderr.fileno())
        atexit.register(_SINK.close)
    sys.stderr.flush()
    handler = _SinkHandler(_SINK)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    # SPEC §7: no key in any log line, whoever logs it (aiohttp's tracebacks included).
    handler.addFilter(RedactingFilter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # The access lines bypass `logging` (`access_log()`); a handler an embedder adds to
    # `gateway.access` after raising its level still gets records the slow way.
    _ACCESS = AccessLog(_SINK, fmt) if access else None
    logging.getLogger("gateway.access").setLevel(logging.WARNING)
    # aiohttp's own access log duplicates ours.
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
