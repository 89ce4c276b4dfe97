"""A lean, strict HTTP/1.1 client for upstreams: keep-alive connections driven by llhttp.

Why not aiohttp's client: on the proxy's hot path it cost about as much CPU as everything else
the gateway does (ClientRequest/ClientResponse objects, payload registry, connector
bookkeeping); this client halves the proxy's CPU per request (benches/README.md). Why llhttp
(httptools, the parser under uvicorn and Node.js): framing is where a proxy is attacked, and a
hand-written parser is lenient in ways nobody notices until an upstream abuses them (`0x2` as a
chunk size, bare LF line ends, Content-Length together with Transfer-Encoding). Each connection
is an `asyncio.Protocol` feeding the parser; the parser's callbacks fill the response in place,
so a request costs one future (for its head) and a body read costs none when bytes are already
there.

What it does, and only that (an OpenAI-compatible upstream needs no more):

- one request at a time per connection; the request head prebuilt per upstream (`head()`), sent
  with its body in one write; redirects never followed (a 3xx is returned as it is);
- idle connections reused LIFO (the warmest first), at most `max_idle` of them, and none
  within `REUSE_QUIET_S` (5 ms) of its last response's end unless its upstream echoes the
  request id. SPEC §16: "connections are never reused within a few milliseconds of a response
  ending with bytes still possibly in flight": a backend that sends its answer twice, a few ms
  apart, loses the connection to the duplicate (unsolicited bytes on an idle connection)
  instead of handing it to the next request. Where the upstream echoes `X-Request-Id` (vLLM,
  the mock) a duplicate is caught by its id instead, so no rest is needed; where a new
  connection costs a handshake (TLS, a proxy tunnel) a request waits out the rest of a resting
  one rather than open another;
- SPEC §16: "where the backend echoes the request id [...] the gateway checks it and treats a
  mismatch as a framing error": a response whose `X-Request-Id` is not the one sent (`request`'s
  `request_id`) loses its connection, and the request is sent once more on a fresh one (as for
  the keep-alive race: the answer it got was another request's);
- SPEC §16 "a chunk larger than the response bound is a framing error": llhttp (through
  httptools) does not expose a chunk's declared size, so the client reads each chunk-size line
  itself, at chunk boundaries only (the head is fed up to its end so the body's first byte is
  known; between sizes the data is skipped by count). A size over `request`'s `max_chunk`
  (2**64-1 included) fails the response at once instead of waiting for bytes that never come.
  llhttp still parses and validates every byte: this reading only ever rejects;
- SPEC §16: "An upstream that breaks HTTP framing (bytes past a message, unsolicited bytes on an
  idle connection, an invalid status line) loses that connection, and never another request's
  response." A connection goes back to the pool only when its response ended exactly at a
  message boundary with nothing after it; a byte arriving on an idle connection, or after the
  response ended, aborts it. (llhttp skips bare CR/LF between messages, as RFC 9112 §2.2 lets
  a parser do: such blank lines are consumed, never buffered, never read as a response.)
- strict parsing: llhttp's defaults (no leniency flags), plus a status in 100–599, HTTP/1.0 or
  1.1 only, and no transfer coding but `chunked`. Any violation is a `ConnectionResetError`;
- SPEC §16 bounds: a response head of at most 64 KiB and 100 header lines, at most 10 interim
  (1xx) responses before the final one, a body read whole only up to `read(limit)`, and at
  most ~256 KiB of unread body held per connection (reading from the socket pauses above it and
  resumes when the consumer drains it; a declared size is never preallocated);
- a request whose *reused* connection turns out closed by the server before any response byte
  (the keep-alive race: it never reached the application) is sent once more, on a fresh
  connection;
- cancellation at any point aborts the connection (it is never pooled);
- SPEC §6 TLS: `https` upstreams are verified against the system store or `ca_file`, with the
  name `server_name` (also the SNI) when given; verification cannot be turned off;
- SPEC §6 egress proxies: an explicit `proxy` URL, else `HTTPS_PROXY` / `HTTP_PROXY` from the
  environment unless `NO_PROXY` matches the host, as curl and httpx read them. Both https and
  http upstreams go through an HTTP CONNECT tunnel (TLS, if any, inside it); credentials in the
  proxy URL become `Proxy-Authorization: Basic`. Pooled connections are tunnelled ones.

Failures surface as `OSError` subclasses only: `ConnectError` (no connection: refused, DNS, TLS
or proxy failure), `TimeoutError` (connect timeout), `ConnectionResetError` (cut, reset,
truncated or broken framing) and its subclass `BodyTooLarge`.
"""

from __future__ import annotations

import asyncio
import base64
import fcntl
import ipaddress
import os
import re
import ssl as ssl_module
import termios
import time
from collections import deque
from collections.abc import Awaitable, Callable, Mapping
from urllib.parse import SplitResult, unquote, urlsplit

from httptools import HttpParserError, HttpParserUpgrade, HttpResponseParser

__all__ = ["HIGH_WATER", "BodyTooLarge", "Client", "ConnectError", "Headers", "Response"]

_MAX_HEAD = 64 * 1024  # SPEC §16: status line and header lines of one response
_MAX_HEADERS = 100
_MAX_INTERIM = 10  # 1xx responses before the final one
#: Unread body bytes above which reading from the socket pauses (SPEC §16: bounded).
HIGH_WATER = 256 * 1024
_NO_BYTES = bytes(4)  # FIONREAD's answer for an empty receive queue (a C int of 0)
DEFAULT_MAX_IDLE = 256  # idle keep-alive connections kept per upstream (Client.max_idle)
#: The most idle connections one upstream keeps, however large its `max_concurrency`.
MAX_IDLE_CEILING = 4096
_MAX_PROXY_HEAD = 16 * 1024  # a proxy's answer to CONNECT
#: SPEC §16: a connection rests this long after its response before it carries another request.
REUSE_QUIET_S = 0.005
#: A chunk larger than this (bytes) is a framing error unless `request` says otherwise.
DEFAULT_MAX_CHUNK = 64 << 20
_MAX_SIZE_LINE = 4096  # a chunk-size line with its extensions
_BLANK = re.compile(rb"\n\r?\n")  # where a head may end (llhttp needs the LF)
_HEX_DIGITS = b"0123456789abcdefABCDEF"
#: The longest chunk-size line the relay's own reading takes (15 hex digits: under 2**60).
_FAST_SIZE_DIGITS = 15


class ConnectError(OSError):
    """The upstream could not be reached (refused, unreachable, DNS, TLS, egress proxy)."""


class BodyTooLarge(ConnectionResetError):
    """The response body exceeds the limit given to `Response.read`; its connection is cut."""


class _Stale(ConnectionResetError):
    """A reused connection was closed by the server before any byte of the answer."""


class _Crossed(ConnectionResetError):
    """The response names another request (`X-Request-Id`): the connection was out of step."""


class _Violation(Exception):
    """Raised inside a parser callback to stop parsing (the reason is kept on the connection)."""


class Headers(dict[str, str]):
    """Response headers with lower-case names; lookups are case-insensitive. Repeated fields
    are joined with `, `; values are decoded as latin-1 (any byte is accepted, none is lost)."""

    def get(self, key: str, default: str | None = None) -> str | None:  # type: ignore[override]
        return dict.get(self, key.lower(), default)

    def __getitem__(self, key: str) -> str:
        return dict.__getitem__(self, key.lower())

    def __contains__(self, key: object) -> bool:
        return isinstance(key, str) and dict.__contains__(self, key.lower())


class _Conn(asyncio.Protocol):
    """One connection: the protocol, the llhttp parser's callback target and the state of the
    response in flight. Body pieces are kept as the parser hands them over and joined only
    when read, so the pieces that arrived together leave together."""

    __slots__ = (
        "_buffered",
        "_chunk_left",
        "_chunks",
        "_client",
        "_complete",
        "_dirty",
        "_done_at",
        "_echoes",
        "_eof_framed",
        "_error",
        "_expect_id",
        "_fd",
        "_got_bytes",
        "_head_bytes",
        "_head_done",
        "_head_fed",
        "_head_only",
        "_headers",
        "_interim",
        "_keep_alive",
        "_loop",
        "_lost",
        "_max_chunk",
        "_nheaders",
        "_parser",
        "_paused",
        "_response",
        "_reused",
        "_scan",
        "_sink",
        "_sink_error",
        "_sink_stopped",
        "_size_line",
        "_tail",
        "_waiter",
        "_whole",
        "_why",
        "active",
        "transport",
    )

    def __init__(self, client: Client, loop: asyncio.AbstractEventLoop) -> None:
        self._client = client
        self._loop = loop
        self._parser = HttpResponseParser(self)
        self.transport: asyncio.Transport | None = None
        self.active = False  # a request is in flight (or its response not yet released)
        self._reused = False
        self._lost = False
        self._dirty = False  # broke framing: never pooled again
        self._paused = False
        self._waiter: asyncio.Future[None] | None = None
        self._chunks: list[bytes] = []
        self._buffered = 0
        # Relay mode (`Response.relay`): body bytes go to the sink from the protocol callback.
        self._sink: Callable[[bytes], bool] | None = None
        self._sink_error: BaseException | None = None
        self._sink_stopped = False
        # Relay mode, optional: takes one whole chunk as it came (see `Response.relay`).
        self._whole: Callable[[bytes], bool] | None = None
        self._done_at = 0.0  # when its last response was released (monotonic)
        self._fd = -1  # the socket's descriptor (-1: none known), for `unread`
        # The upstream echoed the X-Request-Id it was sent: a late duplicate on this
        # connection names its own request, and is caught as a framing error.
        self._echoes = False
        self._begin(False, None, DEFAULT_MAX_CHUNK)

    def _begin(self, head_only: bool, expect_id: str | None, max_chunk: int) -> None:
        """Resets the per-response state before a request is sent."""
        self._head_only = head_only
        self._expect_id = expect_id
        self._max_chunk = max_chunk
        self._scan = False  # reading chunk-size lines (a chunked body)
        self._chunk_left = 0  # bytes of the current chunk (and its CRLF) not seen yet
        self._size_line = b""  # an unfinished chunk-size line
        self._tail = b""  # the last bytes of an unfinished head
        self._got_bytes = False
        self._head_done = False
        self._complete = False
        self._keep_alive = False
        self._eof_framed = False
        self._head_bytes = 0
        self._head_fed = 0
        self._nheaders = 0
        self._interim = 0
        self._headers = Headers()
        self._response: Response | None = None
        self._error: ConnectionResetError | None = None
        self._why = ""

    # -- asyncio.Protocol --------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport instances: no isinstance check.
        self.transport = transport  # type: ignore[assignment]
        self._client._open += 1
        sock = transport.get_extra_info("socket")
        self._fd = sock.fileno() if sock is not None else -1

    def unread(self) -> bool:
        """Whether the kernel holds bytes of this idle connection the loop has not read yet:
        a loop busy for longer than the rest after a response (a GC pause, a burst) has not
        seen a duplicate answer that is already here, and the next request must not take the
        connection (SPEC §16). One `FIONREAD` ioctl (~0.5 µs)."""
        fd = self._fd
        if fd < 0:
            return False
        try:
            return fcntl.ioctl(fd, termios.FIONREAD, _NO_BYTES) != _NO_BYTES
        except OSError:
            return True  # a socket that cannot say is not reused

    def data_received(self, data: bytes) -> None:
        if self._complete or not self.active:
            # SPEC §16: bytes nobody asked for (an idle connection, or past the response's
            # end): the connection is lost, never read by the next request.
            self.abort()
            return
        self._got_bytes = True
        sink = self._sink
        if (
            sink is not None
            and self._scan
            and not self._chunk_left
            and not self._size_line
            and not self._chunks
        ):
            whole = self._whole
            if whole is not None and whole(data):
                return  # exactly one whole chunk (checked by `whole`), taken as it came
            # A relayed token stream's common read: exactly one whole chunk, `HEX CRLF data
            # CRLF` and nothing else, read at a chunk boundary. llhttp would hand `data` to
            # `on_body` and end where it started (before a chunk-size line), so the chunk is
            # taken here and llhttp never sees it (~1 µs a token event less). Anything else —
            # a chunk extension, a piece of a chunk, two chunks, the last chunk — goes to
            # llhttp below, with the §16 bounds; this strict subset is valid for it too.
            nl = data.find(b"\r\n", 0, _FAST_SIZE_DIGITS + 1)
            if nl > 0 and not data[:nl].translate(None, _HEX_DIGITS):
                start = nl + 2
                size = int(data[:nl], 16)
                if (
                    0 < size <= self._max_chunk
                    and len(data) == start + size + 2
                    and data[-2:] == b"\r\n"
                ):
                    self._sink_piece(sink, data[start:-2])
                    return
        head_before = self._head_done
        try:
            body = self._feed_head(data) if not head_before else data
            if body and not (self._scan and self._scan_chunks(body)):
                self._parser.feed_data(body)
        except HttpParserUpgrade:
            self._broken("upstream switched protocols (HTTP 101)")
        except HttpParserError as exc:
            self._broken(self._why or f"{exc}")
        else:
            if not self._head_done:
                # The callbacks count the head lines that ended; this counts every byte fed
                # while the head is unfinished (httptools holds a line until it ends).
                self._head_fed += len(data)
                if self._head_fed > _MAX_HEAD:
                    self._fail(f"upstream response head over {_MAX_HEAD} bytes")
            elif self._buffered > HIGH_WATER and not self._paused:
                # Flow control: the consumer is slower than the upstream.
                self.pause()
        if self._sink is not None and self._chunks:
            self._to_sink()
        waiter = self._waiter
        if waiter is not None and (
            self._chunks
            or self._sink_stopped
            or self._complete
            or self._error is not None
            or (self._head_done and not head_before)
        ):
            self._waiter = None
            if not waiter.done():
                waiter.set_result(None)

    def eof_received(self) -> bool | None:
        return None  # the transport closes; connection_lost settles the response

    def connection_lost(self, exc: Exception | None) -> None:
        self._lost = True
        self._client._open -= 1
        if self.active and not self._complete and self._error is None:
            if self._head_done and self._eof_framed and exc is None:
                self._complete = True  # a body framed by the connection's close
            elif not self._got_bytes and self._reused:
                self._error = _Stale("upstream closed the idle connection")
            elif self._head_done:
                self._error = ConnectionResetError("upstream closed the connection mid-body")
            else:
                self._error = ConnectionResetError(
                    "upstream closed the connection before answering"
                )
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            if not waiter.done():
                waiter.set_result(None)

    def _feed_head(self, data: bytes) -> bytes:
        """Feeds `data` up to the end of the response head (each blank line a head may end
        at, in turn, until the final head is done); returns the bytes after it (the body's
        first bytes; empty when the head is still unfinished: all was fed)."""
        feed = self._parser.feed_data
        n = len(data)
        pos = 0
        tail = self._tail
        while True:
            end = -1
            if pos == 0 and tail:
                # a blank line split between the last read and this one
                joined = tail + data[:2]
                for m in _BLANK.finditer(joined):
                    if m.end() > len(tail):
                        end = m.end() - len(tail)
                        break
            if end < 0:
                found = _BLANK.search(data, pos)
                end = found.end() if found is not None else n
            feed(data if pos == 0 and end == n else data[pos:end])
            pos = end
            if self._head_done:
                return data[pos:] if pos < n else b""
            if pos >= n:
                self._tail = (tail + data)[-2:]
                return b""

    def _scan_chunks(self, data: bytes) -> bool:
        """SPEC §16: reads the chunk-size lines in `data` (skipping chunk data by count);
        True when a chunk is larger than the response bound (the response failed)."""
        left = self._chunk_left
        n = len(data)
        if left >= n:
            self._chunk_left = left - n
            return False
        pos = left
        line = self._size_line
        while True:
            end = data.find(b"\n", pos)
            if end < 0:
                line += data[pos:]
                if len(line) > _MAX_SIZE_LINE:
                    self._fail(f"upstream chunk-size line over {_MAX_SIZE_LINE} bytes")
                    return True
                self._size_line = line
                self._chunk_left = 0
                return False
            text = line + data[pos:end] if line else data[pos:end]
            line = b""
            try:
                size = int(text if b";" not in text else text[: text.index(b";")], 16)
            except ValueError:
                # not a size: llhttp refuses the line itself (and says why)
                self._scan = False
                return False
            if size > self._max_chunk:
                self._fail(f"upstream declared a chunk of {size} bytes (over {self._max_chunk})")
                return True
            if size == 0:
                self._scan = False  # the last chunk: trailers (if any) and the end follow
                return False
            pos = end + 1 + size + 2  # the data and its CRLF
            if pos >= n:
                self._chunk_left = pos - n
                self._size_line = b""
                return False

    # -- llhttp callbacks --------------------------------------------------------------------

    def on_message_begin(self) -> None:
        if self._complete:
            # SPEC §16: a second message after the response (bytes past Content-Length, a
            # second response in the same write): the connection is lost.
            self._why = "upstream sent bytes past the end of its response"
            raise _Violation

    def on_status(self, status: bytes) -> None:
        self._head_bytes += len(status) + 15
        if self._head_bytes > _MAX_HEAD:
            self._why = f"upstream response head over {_MAX_HEAD} bytes"
            raise _Violation

    def on_header(self, name: bytes, value: bytes) -> None:
        self._nheaders += 1
        self._head_bytes += len(name) + len(value) + 4
        if self._nheaders > _MAX_HEADERS or self._head_bytes > _MAX_HEAD:
            self._why = f"upstream response head over {_MAX_HEADERS} lines or {_MAX_HEAD} bytes"
            raise _Violation
        # llhttp admits only token characters in a name and visible bytes in a value;
        # latin-1 maps every byte, so nothing here can fail to decode.
        key = name.decode("latin-1").lower()
        text = value.decode("latin-1").rstrip(" \t")
        headers = self._headers
        old = dict.get(headers, key)
        headers[key] = text if old is None else f"{old}, {text}"

    def on_headers_complete(self) -> None:
        parser = self._parser
        status = parser.get_status_code()
        if status < 200:
            if status < 100:
                self._why = f"invalid status {status:03d} from upstream"
                raise _Violation
            # An interim answer (100 Continue, 103 Early Hints): the real one follows.
            self._interim += 1
            if self._interim > _MAX_INTERIM:
                self._why = f"upstream sent more than {_MAX_INTERIM} interim (1xx) responses"
                raise _Violation
            self._headers = Headers()
            self._nheaders = 0
            return
        if status > 599:
            self._why = f"invalid status {status} from upstream"
            raise _Violation
        if parser.get_http_version() not in ("1.1", "1.0"):
            self._why = "upstream answered with an HTTP version other than 1.x"
            raise _Violation
        headers = self._headers
        te = dict.get(headers, "transfer-encoding")
        if te is not None and te.lower() != "chunked":
            # Other transfer codings would have to be decoded; no upstream of ours uses them.
            self._why = "upstream used a transfer coding other than chunked"
            raise _Violation
        expect = self._expect_id
        if expect is not None:
            echoed = dict.get(headers, "x-request-id")
            if echoed is not None and echoed != expect:
                # SPEC §16: the backend echoes the request id and this is not ours (a late
                # duplicate of an earlier answer, say): a framing error.
                self._why = "upstream answered another request (X-Request-Id)"
                self._error = _Crossed(f"upstream broke HTTP framing: {self._why}")
                raise _Violation
            self._echoes = echoed is not None
        self._keep_alive = parser.should_keep_alive()
        self._scan = te is not None
        self._eof_framed = (
            te is None and "content-length" not in headers and status != 204 and status != 304
        )
        self._head_done = True
        self._response = Response(self, status, headers)
        if self._head_only:
            # A HEAD answer has no body whatever its headers say; llhttp cannot be told, so
            # parsing stops here and the connection is not reused.
            self._complete = True
            self._keep_alive = False
            raise _Violation

    def on_body(self, body: bytes) -> None:
        self._chunks.append(body)
        self._buffered += len(body)

    def on_message_complete(self) -> None:
        if self._head_done:
            self._complete = True

    # -- helpers -------------------------------------------------------------------------------

    def _to_sink(self) -> None:
        """Relay mode: the pieces this read brought, in one piece, to the sink."""
        chunks = self._chunks
        data = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        chunks.clear()
        self._buffered = 0
        sink = self._sink
        assert sink is not None
        self._sink_piece(sink, data)

    def _sink_piece(self, sink: Callable[[bytes], bool], data: bytes) -> None:
        """Relay mode: `data` to the sink, which may say stop, or raise: either ends the
        relay (the relay's task is woken) and loses the connection."""
        try:
            more = sink(data)
        except Exception as exc:  # the sink's own failure (a malformed event, a bug)
            self._sink_error = exc
            more = False
        if not more:
            self._sink = None
            self._sink_stopped = True
            if self._sink_error is not None or not self._complete:
                # The upstream is still sending (or sent what we refuse): cut it.
                self.abort()
            # Else the sink stopped at the body's very end (a stream's `[DONE]` came with the
            # last chunk): nothing is lost, and the connection stays reusable (released by
            # the response's owner, like any complete response).
            waiter = self._waiter
            if waiter is not None:
                self._waiter = None
                if not waiter.done():
                    waiter.set_result(None)

    def _broken(self, why: str) -> None:
        """The parser stopped. After a complete response the response stands but the
        connection goes; before, the response fails."""
        if self._complete:
            self.abort()
        else:
            self._fail(why)

    def _fail(self, why: str) -> None:
        if self._error is None:
            # SPEC §16: "An upstream that breaks HTTP framing loses that connection".
            self._error = ConnectionResetError(f"upstream broke HTTP framing: {why}")
        self.abort()

    def abort(self) -> None:
        self._dirty = True
        transport = self.transport
        if transport is not None and not transport.is_closing():
            transport.abort()

    def usable(self) -> bool:
        transport = self.transport
        return not (self._lost or self._dirty or transport is None or transport.is_closing())

    async def wait(self) -> None:
        """Waits for the parser to make progress; a cancellation cuts the connection."""
        waiter = self._loop.create_future()
        self._waiter = waiter
        try:
            await waiter
        except BaseException:
            self._waiter = None
            self.abort()
            raise

    def pause(self) -> None:
        transport = self.transport
        if transport is not None and not transport.is_closing():
            self._paused = True
            transport.pause_reading()

    def resume(self) -> None:
        self._paused = False
        transport = self.transport
        if transport is not None and not transport.is_closing():
            transport.resume_reading()

    async def exchange(
        self, payload: bytes, head_only: bool, expect_id: str | None, max_chunk: int
    ) -> Response:
        """Sends one request; returns once the final response head arrived."""
        self._begin(head_only, expect_id, max_chunk)
        self.active = True
        transport = self.transport
        assert transport is not None
        try:
            transport.write(payload)
        except Exception:  # a transport that closed under us (uvloop raises, asyncio drops)
            self.abort()
            if self._reused:
                raise _Stale("upstream closed the idle connection") from None
            raise ConnectionResetError("upstream connection closed") from None
        while self._response is None and self._error is None:
            if self._lost:  # closed before it was ours (asyncio drops such writes)
                self._error = _Stale("upstream connection closed") if self._reused else None
                break
            await self.wait()
        response = self._response
        if response is None:
            self.abort()
            error = self._error
            raise error if error is not None else ConnectionResetError("no response")
        self._response = None  # handed over (and no reference cycle left behind)
        return response


class Response:
    """A response whose body is read on demand (`read`, or `readany` piece by piece)."""

    __slots__ = ("_conn", "_done", "content_type", "headers", "status")

    def __init__(self, conn: _Conn, status: int, headers: Headers) -> None:
        self._conn: _Conn | None = conn
        self._done = False
        self.status = status
        self.headers = headers
        ctype = dict.get(headers, "content-type")
        self.content_type = ctype.split(";", 1)[0].strip().lower() if ctype else ""

    @property
    def content(self) -> Response:
        """The body stream (this object), as aiohttp spells it."""
        return self

    @property
    def buffered(self) -> int:
        """Body bytes received from the upstream and not read yet (0 once released)."""
        conn = self._conn
        return conn._buffered if conn is not None else 0

    @property
    def reading_paused(self) -> bool:
        """Whether reading from the upstream is paused until the consumer drains the body
        (flow control: more than `HIGH_WATER` bytes unread)."""
        conn = self._conn
        return conn is not None and conn._paused

    def is_eof(self) -> bool:
        """Whether the whole body has been received and read."""
        conn = self._conn
        if conn is None:
            return self._done
        return conn._complete and not conn._chunks

    async def readany(self) -> bytes:
        """Every body byte received so far and not yet read, in one piece (waiting for the
        next one if there is none); `b""` at the body's end."""
        conn = self._conn
        if conn is None:
            if self._done:
                return b""
            raise ConnectionResetError("the upstream response was closed")
        while True:
            chunks = conn._chunks
            if chunks:
                data = chunks[0] if len(chunks) == 1 else b"".join(chunks)
                chunks.clear()
                conn._buffered = 0
                if conn._paused:
                    conn.resume()
                return data
            if conn._complete:
                return b""
            error = conn._error
            if error is not None:
                self.close()
                raise error
            await conn.wait()

    async def relay(
        self,
        sink: Callable[[bytes], bool],
        drain: Callable[[], Awaitable[None]],
        whole: Callable[[bytes], bool] | None = None,
    ) -> bool:
        """Hands the rest of the body to `sink` as it arrives, straight from the protocol
        callback: no task switch and no future per piece (a token stream's hot path). `sink`
        returns False to stop (the connection is then lost, so the upstream stops working,
        unless the body had already ended: then it stays reusable) and
        may call `pause_reading` when its own output backs up; `drain` is then awaited before
        reading resumes. Returns True when the body ended, False when the sink stopped;
        raises what the connection or the sink raised.

        `whole(read)`, when given, is offered each read of a chunked body that starts at a
        chunk boundary (the relay's hot path: a token event passed on with its framing as it
        came, in one call). It returns True only when it took the read, which it may do only
        when the read is exactly one whole chunk of a size from 1 to the response's
        `max_chunk` (`HEX CRLF data CRLF`, nothing else) — it checks that itself; False
        leaves the read to this connection (and `sink`). It must not raise."""
        conn = self._conn
        if conn is None:
            raise ConnectionResetError("the upstream response was closed")
        conn._whole = whole
        if conn._chunks:
            conn._sink = sink
            conn._to_sink()
        else:
            conn._sink = sink
        try:
            while True:
                if conn._sink_stopped:
                    error = conn._sink_error
                    if error is not None:
                        raise error
                    return False
                if conn._complete:
                    return True
                if conn._error is not None:
                    error = conn._error
                    self.close()
                    raise error
                if conn._paused:
                    await drain()
                    conn.resume()
                    continue
                await conn.wait()
        finally:
            conn._sink = None
            conn._whole = None
            conn._sink_error = None
            conn._sink_stopped = False

    @property
    def max_chunk(self) -> int:
        """The largest chunk this response may declare (`Client.request`'s `max_chunk`)."""
        conn = self._conn
        return conn._max_chunk if conn is not None else 0

    def pause_reading(self) -> None:
        """Stops reading from the upstream until `relay`'s drain returns (flow control)."""
        conn = self._conn
        if conn is not None and not conn._paused:
            conn.pause()
            waiter = conn._waiter
            if waiter is not None:
                conn._waiter = None
                if not waiter.done():
                    waiter.set_result(None)

    async def read(self, limit: int | None = None) -> bytes:
        """The whole body. Over `limit` bytes: `BodyTooLarge`, and the connection is cut."""
        if limit is not None:
            declared = dict.get(self.headers, "content-length")
            if declared is not None and declared.isdigit() and int(declared) > limit:
                self.close()
                raise BodyTooLarge(f"upstream response body over {limit} bytes")
        parts: list[bytes] = []
        total = 0
        while piece := await self.readany():
            total += len(piece)
            if limit is not None and total > limit:
                self.close()
                raise BodyTooLarge(f"upstream response body over {limit} bytes")
            parts.append(piece)
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def release(self) -> None:
        """Done with the response: a connection whose response ended cleanly at a message
        boundary goes back to the pool; any other is cut."""
        conn = self._conn
        if conn is None:
            return
        self._conn = None
        self._done = conn._complete and not conn._chunks
        if conn._complete and conn._keep_alive and conn.usable():
            conn._chunks.clear()
            conn._buffered = 0
            conn.active = False
            conn._done_at = time.monotonic()
            if conn._paused:
                conn.resume()
            conn._client._put(conn)
        else:
            conn.abort()

    def close(self) -> None:
        """Abandons the response: the connection is cut (the upstream stops working on it)."""
        conn = self._conn
        if conn is not None:
            self._conn = None
            self._done = conn._complete and not conn._chunks
            conn.abort()


def _bracket(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def _env(environ: Mapping[str, str], name: str) -> str:
    """`name` from the environment, the lower-case spelling first (as urllib and curl)."""
    return (environ.get(name.lower()) or environ.get(name.upper()) or "").strip()


def no_proxy_matches(host: str, port: int, no_proxy: str) -> bool:
    """Whether `NO_PROXY` exempts host:port, as curl and httpx read it: a comma list where `*`
    matches everything, a domain matches itself and its subdomains (a leading dot or `*.`
    allowed), an entry may carry `:port`, and IP addresses match literally (or by CIDR)."""
    host = host.lower().strip("[]").rstrip(".")
    try:
        ip: ipaddress.IPv4Address | ipaddress.IPv6Address | None = ipaddress.ip_address(host)
    except ValueError:
        ip = None
    for raw in no_proxy.split(","):
        entry = raw.strip().lower()
        if not entry:
            continue
        if entry == "*":
            return True
        entry_port: int | None = None
        if entry.startswith("["):  # [v6]:port
            addr, _, rest = entry[1:].partition("]")
            entry = addr
            if rest.startswith(":") and rest[1:].isdigit():
                entry_port = int(rest[1:])
        elif entry.count(":") == 1:
            name, _, num = entry.partition(":")
            if num.isdigit():
                entry, entry_port = name, int(num)
        if entry_port is not None and entry_port != port:
            continue
        if ip is not None:
            try:
                if ip in ipaddress.ip_network(entry, strict=False):
                    return True
            except ValueError:
                pass
            continue
        entry = entry.lstrip("*").lstrip(".").rstrip(".")
        if entry and (host == entry or host.endswith("." + entry)):
            return True
    return False


class _ProxyHandshake(asyncio.Protocol):
    """Reads a proxy's answer to CONNECT (a bounded head) before the tunnel is handed over."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.buffer = bytearray()
        self.done: asyncio.Future[int] = loop.create_future()

    def data_received(self, data: bytes) -> None:
        if self.done.done():
            self.buffer += data
            return
        self.buffer += data
        end = self.buffer.find(b"\r\n\r\n")
        if end >= 0:
            self.done.set_result(end + 4)
        elif len(self.buffer) > _MAX_PROXY_HEAD:
            self.done.set_exception(ConnectError(0, "egress proxy answer head too large"))

    def eof_received(self) -> bool | None:
        return None

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.done.done():
            self.done.set_exception(
                ConnectError(0, "egress proxy closed the connection during CONNECT")
            )


class _Proxy:
    __slots__ = ("host", "port", "request")

    def __init__(self, host: str, port: int, request: bytes) -> None:
        self.host = host
        self.port = port
        self.request = request  # the CONNECT request, credentials included


class Client:
    """Keep-alive connections to one upstream origin, directly or through an egress proxy.

    `ca_file` / `server_name` are SPEC §6's `tls:` (for `https` only); `proxy` an explicit
    egress proxy URL, which wins over the environment (read here, once, when `trust_env`);
    `reuse_quiet_s` how long a connection rests after a response before it is reused."""

    def __init__(
        self,
        base_url: str,
        connect_timeout: float,
        *,
        ca_file: str | None = None,
        server_name: str | None = None,
        proxy: str | None = None,
        trust_env: bool = True,
        reuse_quiet_s: float = REUSE_QUIET_S,
    ) -> None:
        parts = urlsplit(base_url)
        self.reuse_quiet_s = reuse_quiet_s
        self.secure = parts.scheme == "https"
        self.host = parts.hostname or ""
        self.port = parts.port or (443 if self.secure else 80)
        default_port = self.port == (443 if self.secure else 80)
        host = _bracket(self.host)
        self.host_header = host if default_port else f"{host}:{self.port}"
        self.connect_timeout = connect_timeout
        self._ssl: ssl_module.SSLContext | None = None
        self._sni: str | None = None
        if self.secure:
            # SPEC §6: verification always (CERT_REQUIRED, host name checked); `ca_file`
            # replaces the system store. One context per client: built once, shared by every
            # connection (and its session cache).
            ctx = ssl_module.create_default_context(cafile=ca_file)
            ctx.set_alpn_protocols(["http/1.1"])
            self._ssl = ctx
            self._sni = server_name or self.host
        self._proxy: _Proxy | None = None
        self._proxy_error: str | None = None
        self._resolve_proxy(proxy, os.environ if trust_env else {})
        self._idle: deque[_Conn] = deque()
        #: Idle connections kept (SPEC §16: bounded): an instance's `max_concurrency` when
        #: larger than 256 (`Upstream` sets it), so a burst of that many concurrent requests
        #: or streams keeps its connections for the next one instead of closing and
        #: reconnecting the ones past 256.
        self.max_idle = DEFAULT_MAX_IDLE
        # Released within the last `REUSE_QUIET_S`, oldest first: not reused yet.
        self._resting: deque[_Conn] = deque()
        self.closed = False
        self._open = 0  # connections made and not lost yet: idle, resting, in use
        self._spare: asyncio.Task[None] | None = None  # a preconnect under way

    @property
    def idle_connections(self) -> int:
        """How many keep-alive connections wait in the pool for the next request."""
        return len(self._idle) + len(self._resting)

    @property
    def proxy_address(self) -> tuple[str, int] | None:
        """The egress proxy's (host, port) the connections are tunnelled through, if any."""
        proxy = self._proxy
        return (proxy.host, proxy.port) if proxy is not None else None

    @property
    def proxied(self) -> bool:
        """Whether connections go through an egress proxy."""
        return self._proxy is not None or self._proxy_error is not None

    def _resolve_proxy(self, explicit: str | None, environ: Mapping[str, str]) -> None:
        """SPEC §6: the instance's `proxy:` if set; else `HTTPS_PROXY` (https upstreams) or
        `HTTP_PROXY` (http upstreams) unless `NO_PROXY` exempts the host."""
        url = explicit
        source = "the instance's proxy"
        if url is None:
            source = "HTTPS_PROXY" if self.secure else "HTTP_PROXY"
            url = _env(environ, source)
            if not url or no_proxy_matches(self.host, self.port, _env(environ, "NO_PROXY")):
                return
        if "://" not in url:
            url = "http://" + url  # curl's reading of a bare host:port
        # Reasons never quote the URL: it may carry credentials.
        try:
            parts: SplitResult = urlsplit(url)
            port = parts.port or 80
        except ValueError:
            self._proxy_error = f"{source} is not a valid URL"
            return
        if parts.scheme.lower() != "http" or not parts.hostname:
            self._proxy_error = f"{source} must be an http:// URL (HTTP CONNECT)"
            return
        target = f"{_bracket(self.host)}:{self.port}"
        lines = [f"CONNECT {target} HTTP/1.1", f"Host: {target}"]
        if parts.username is not None:
            secret = f"{unquote(parts.username)}:{unquote(parts.password or '')}"
            token = base64.b64encode(secret.encode("utf-8")).decode("ascii")
            lines.append(f"Proxy-Authorization: Basic {token}")
        request = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1", "replace")
        self._proxy = _Proxy(parts.hostname, port, request)

    async def _connect(self) -> _Conn:
        if self._proxy_error is not None:
            raise ConnectError(0, self._proxy_error)
        loop = asyncio.get_running_loop()
        conn = _Conn(self, loop)
        try:
            async with asyncio.timeout(self.connect_timeout):
                if self._proxy is not None:
                    await self._tunnel(loop, conn, self._proxy)
                else:
                    await loop.create_connection(
                        lambda: conn, self.host, self.port, ssl=self._ssl, server_hostname=self._sni
                    )
        except (TimeoutError, ConnectError):
            conn.abort()
            raise
        except ssl_module.SSLCertVerificationError as exc:
            conn.abort()
            why = exc.verify_message or exc.reason or "verification failed"
            raise ConnectError(exc.errno, f"upstream TLS certificate rejected: {why}") from None
        except ssl_module.SSLError as exc:
            conn.abort()
            raise ConnectError(exc.errno, f"TLS handshake failed: {exc.reason or exc}") from None
        except OSError as exc:
            conn.abort()
            raise ConnectError(exc.errno, exc.strerror or str(exc) or type(exc).__name__) from None
        except (ValueError, UnicodeError) as exc:  # a host name that cannot be encoded
            conn.abort()
            raise ConnectError(0, f"cannot connect to upstream ({type(exc).__name__})") from None
        return conn

    async def _tunnel(self, loop: asyncio.AbstractEventLoop, conn: _Conn, proxy: _Proxy) -> None:
        """SPEC §6: an HTTP CONNECT tunnel through the egress proxy, TLS inside it if https."""
        handshake = _ProxyHandshake(loop)
        try:
            transport, _ = await loop.create_connection(lambda: handshake, proxy.host, proxy.port)
        except OSError as exc:
            why = exc.strerror or type(exc).__name__
            raise ConnectError(exc.errno, f"cannot reach the egress proxy ({why})") from None
        try:
            transport.write(proxy.request)
            end = await handshake.done
            head = bytes(handshake.buffer[:end])
            line = head.split(b"\r\n", 1)[0].split(b" ", 2)
            if (
                len(line) < 2
                or line[0] not in (b"HTTP/1.1", b"HTTP/1.0")
                or len(line[1]) != 3
                or not line[1].isdigit()
            ):
                raise ConnectError(0, "egress proxy sent a malformed answer to CONNECT")
            status = int(line[1])
            if not 200 <= status < 300:
                hint = " (proxy authentication required)" if status == 407 else ""
                raise ConnectError(0, f"egress proxy refused the tunnel: HTTP {status}{hint}")
            if len(handshake.buffer) > end:
                raise ConnectError(0, "egress proxy sent bytes before the tunnel was used")
            if self._ssl is not None:
                tls = await loop.start_tls(transport, conn, self._ssl, server_hostname=self._sni)
                if tls is None:
                    raise ConnectError(0, "egress proxy tunnel closed during the TLS handshake")
                conn.connection_made(tls)  # start_tls does not call it
            else:
                transport.set_protocol(conn)
                conn.connection_made(transport)
        except BaseException:
            transport.abort()
            raise

    def _get(self) -> _Conn | None:
        idle = self._idle
        resting = self._resting
        if resting:
            # SPEC §16: "connections are never reused within a few milliseconds of a response
            # ending with bytes still possibly in flight".
            rested = time.monotonic() - self.reuse_quiet_s
            while resting and resting[0]._done_at <= rested:
                conn = resting.popleft()
                if conn.unread():
                    conn.abort()  # bytes nobody asked for arrived during the rest
                else:
                    idle.append(conn)
        while idle:
            conn = idle.pop()
            if conn.usable():
                conn._reused = True
                return conn
            conn.abort()
        return None

    def _put(self, conn: _Conn) -> None:
        if self.closed or len(self._idle) + len(self._resting) >= self.max_idle:
            conn.abort()
        elif conn._echoes:
            # No bytes "possibly in flight" can pass for the next answer: the upstream echoes
            # the request id, and a late duplicate names the request it answers (a framing
            # error, the request sent again on a fresh connection). Reused at once.
            self._idle.append(conn)
        else:
            self._resting.append(conn)

    async def _rested(self) -> _Conn | None:
        """A resting connection once its rest is over, where opening a new one costs more
        than the wait (a TLS handshake, a proxy tunnel: round trips and CPU, against at most
        `reuse_quiet_s`); else None, and the caller connects. Back-to-back requests to an
        OpenAI-like upstream keep one connection instead of a handshake each."""
        resting = self._resting
        if not resting or not (self.secure or self._proxy is not None):
            return None
        # uvloop's timers count whole milliseconds and may fire a little early: wait until
        # the clock really says the rest is over.
        for _ in range(3):
            wait = resting[0]._done_at + self.reuse_quiet_s - time.monotonic() if resting else 0
            if wait <= 0:
                break
            await asyncio.sleep(wait + 0.0005)
        return self._get()

    def head(self, method: str, path: str, headers: str) -> bytes:
        """A request head up to (not including) Content-Length; `headers` is `Name: v\\r\\n`*."""
        return f"{method} {path} HTTP/1.1\r\nHost: {self.host_header}\r\n{headers}".encode(
            "latin-1"
        )

    async def request(
        self,
        head: bytes,
        body: bytes,
        head_only: bool = False,
        *,
        request_id: str | None = None,
        max_chunk: int = DEFAULT_MAX_CHUNK,
    ) -> Response:
        """Sends `head` (from `head()`) with `body`; returns once the final response head
        arrived. Cancellation at any point cuts the connection. `request_id`: the
        `X-Request-Id` the head carries (an echo of another is a framing error); `max_chunk`:
        the largest chunk a chunked body may declare."""
        payload = b"".join((head, b"Content-Length: ", b"%d" % len(body), b"\r\n\r\n", body))
        conn = self._get() or await self._rested()
        if conn is not None:
            self._preconnect()
            try:
                return await conn.exchange(payload, head_only, request_id, max_chunk)
            except (_Stale, _Crossed):
                # the keep-alive race (the server had closed it), or the answer of another
                # request: once more, on a fresh connection
                pass
        conn = await self._connect()
        self._preconnect()
        return await conn.exchange(payload, head_only, request_id, max_chunk)

    def _preconnect(self) -> None:
        """Envoy's preconnect: while requests overlap (another one holds a connection
        beside this one's) and no idle connection is left, one more is opened in the
        background, so the next request (a token stream's time to first chunk) does not wait
        for a TCP (and TLS) handshake. One at a time: bounded by the requests that come.
        Requests one after another never open one."""
        if self._idle or self._spare is not None or self.closed:
            return
        if self._open - len(self._resting) - len(self._idle) < 2:
            return
        self._spare = asyncio.ensure_future(self._open_spare())

    async def _open_spare(self) -> None:
        try:
            conn = await self._connect()
        except (OSError, TimeoutError):
            return  # the next request connects, and reports what fails, itself
        finally:
            self._spare = None
        if self.closed or len(self._idle) + len(self._resting) >= self.max_idle:
            conn.abort()
        else:
            self._idle.append(conn)

    def close_idle(self) -> None:
        """Closes the idle connections and stops pooling (in-flight ones close when done)."""
        self.closed = True
        if self._spare is not None:
            self._spare.cancel()
        while self._idle:
            self._idle.pop().abort()
        while self._resting:
            self._resting.pop().abort()

    async def close(self) -> None:
        self.close_idle()
