"""A lean HTTP/1.1 client for upstreams: keep-alive connections over asyncio streams.

Why not aiohttp's client: on the proxy's hot path it cost about as much CPU as everything else
the gateway does (ClientRequest/ClientResponse objects, payload registry, connector
bookkeeping); measured on a bare pass-through proxy, this client halves the proxy's CPU per
request (benches/README.md). It does only what an OpenAI-compatible upstream needs:

- one request at a time per connection, idle connections reused (LIFO, so the warmest one);
- the request head prebuilt per upstream, written with the body in one write;
- responses framed by `Content-Length`, `Transfer-Encoding: chunked`, or connection close;
  chunked bodies are read chunk by chunk, so SSE events pass through as they arrive;
- redirects are never followed (a 3xx is returned as it is);
- a request whose reused connection turns out to have been closed by the server before any
  response byte (the keep-alive race) is sent once more on a fresh connection — it never
  reached the application, and it is not the instance's failure.

Failures surface as `OSError` subclasses: `ConnectError` (no connection), `TimeoutError`
(connect timeout), `ConnectionResetError` (cut, reset or truncated).
"""

from __future__ import annotations

import asyncio
import ssl as ssl_module
from collections import deque
from urllib.parse import urlsplit

__all__ = ["Client", "ConnectError", "Headers", "Response"]

_MAX_HEAD = 64 * 1024
_MAX_IDLE = 256


class ConnectError(OSError):
    """The upstream could not be reached (refused, unreachable, DNS)."""


class Headers(dict[str, str]):
    """Response headers with lower-case names; lookups are case-insensitive."""

    def get(self, key: str, default: str | None = None) -> str | None:  # type: ignore[override]
        return dict.get(self, key.lower(), default)

    def __getitem__(self, key: str) -> str:
        return dict.__getitem__(self, key.lower())

    def __contains__(self, key: object) -> bool:
        return isinstance(key, str) and dict.__contains__(self, key.lower())


class _Conn:
    __slots__ = ("reader", "reused", "writer")

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.reused = False

    def usable(self) -> bool:
        return not self.reader.at_eof() and not self.writer.is_closing()

    def abort(self) -> None:
        transport = self.writer.transport
        if not transport.is_closing():
            transport.abort()


def _complete_chunk_buffered(reader: asyncio.StreamReader) -> bool:
    """Whether a whole non-final chunk is already in the reader's buffer (peeks at
    `StreamReader._buffer`, the one private detail this module relies on; without it every
    chunk would cost a loop iteration and a write of its own)."""
    buf: bytearray = getattr(reader, "_buffer", bytearray())
    end = buf.find(b"\r\n")
    if end <= 0:
        return False
    try:
        size = int(bytes(buf[:end]).split(b";", 1)[0].strip(), 16)
    except ValueError:
        return True  # let _chunk raise on it
    return size > 0 and len(buf) >= end + 2 + size + 2


class Response:
    """A response whose body is read on demand (`read`, or `readany` piece by piece)."""

    __slots__ = (
        "_chunked",
        "_client",
        "_conn",
        "_eof",
        "_keep_alive",
        "_remaining",
        "content_type",
        "headers",
        "status",
    )

    def __init__(
        self, client: Client, conn: _Conn, status: int, headers: Headers, head_only: bool
    ) -> None:
        self._client = client
        self._conn: _Conn | None = conn
        self.status = status
        self.headers = headers
        ctype = headers.get("content-type") or ""
        self.content_type = ctype.split(";", 1)[0].strip().lower()
        self._keep_alive = (headers.get("connection") or "").lower() != "close"
        self._chunked = "chunked" in (headers.get("transfer-encoding") or "").lower()
        length = headers.get("content-length")
        self._remaining = -1  # unknown: until the connection closes
        if head_only or status in (204, 304) or 100 <= status < 200:
            self._remaining = 0
        elif not self._chunked and length is not None:
            try:
                self._remaining = int(length)
            except ValueError:
                raise ConnectionResetError("invalid Content-Length from upstream") from None
        if self._remaining == -1 and not self._chunked:
            self._keep_alive = False
        self._eof = self._remaining == 0 and not self._chunked

    @property
    def content(self) -> Response:
        """The body stream (this object), as aiohttp spells it."""
        return self

    def is_eof(self) -> bool:
        return self._eof

    async def readany(self) -> bytes:
        """The next piece of the body; `b""` at its end."""
        if self._eof:
            return b""
        conn = self._conn
        assert conn is not None, "body read after the response was closed"
        reader = conn.reader
        try:
            if self._chunked:
                data = await self._chunk(reader)
                if not data:
                    return b""
                # Chunks that already arrived go out together (one write downstream), as a
                # raw relay would send them; a chunk still in flight is not waited for.
                more = [data]
                while _complete_chunk_buffered(reader):
                    nxt = await self._chunk(reader)  # returns without suspending
                    if not nxt:
                        break
                    more.append(nxt)
                return more[0] if len(more) == 1 else b"".join(more)
            if self._remaining > 0:
                data = await reader.read(min(self._remaining, 65536))
                if not data:
                    raise ConnectionResetError("upstream closed the connection mid-body")
                self._remaining -= len(data)
                self._eof = self._remaining == 0
                return data
            data = await reader.read(65536)  # framed by connection close
            if not data:
                self._eof = True
            return data
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError) as exc:
            self.close()  # the framing is lost: the connection is of no further use
            raise ConnectionResetError(f"upstream body cut ({type(exc).__name__})") from None
        except ConnectionResetError:
            self.close()
            raise

    async def _chunk(self, reader: asyncio.StreamReader) -> bytes:
        line = await reader.readuntil(b"\r\n")
        size = int(line.split(b";", 1)[0].strip(), 16)
        if size == 0:
            while await reader.readuntil(b"\r\n") != b"\r\n":
                pass  # trailers
            self._eof = True
            return b""
        data = await reader.readexactly(size + 2)
        if data[-2:] != b"\r\n":
            raise ConnectionResetError("malformed chunk from upstream")
        return data[:-2]

    async def read(self) -> bytes:
        """The whole body."""
        parts = []
        while piece := await self.readany():
            parts.append(piece)
        return b"".join(parts)

    def release(self) -> None:
        """Done with the response: a fully read keep-alive connection goes back to the pool."""
        conn, self._conn = self._conn, None
        if conn is None:
            return
        if self._eof and self._keep_alive and conn.usable():
            self._client._put(conn)
        else:
            conn.abort()

    def close(self) -> None:
        """Abandons the response: the connection is cut (the upstream stops working on it)."""
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.abort()


class Client:
    """Keep-alive connections to one upstream origin."""

    def __init__(self, base_url: str, connect_timeout: float) -> None:
        parts = urlsplit(base_url)
        self.secure = parts.scheme == "https"
        self.host = parts.hostname or ""
        self.port = parts.port or (443 if self.secure else 80)
        default_port = self.port == (443 if self.secure else 80)
        self.host_header = self.host if default_port else f"{self.host}:{self.port}"
        self.connect_timeout = connect_timeout
        self._ssl = ssl_module.create_default_context() if self.secure else None
        self._idle: deque[_Conn] = deque()
        self.closed = False

    async def _connect(self) -> _Conn:
        try:
            async with asyncio.timeout(self.connect_timeout):
                reader, writer = await asyncio.open_connection(
                    self.host,
                    self.port,
                    ssl=self._ssl,
                    server_hostname=self.host if self._ssl else None,
                    limit=_MAX_HEAD,
                )
        except TimeoutError:
            raise
        except OSError as exc:
            raise ConnectError(exc.errno, exc.strerror or str(exc)) from None
        return _Conn(reader, writer)

    def _get(self) -> _Conn | None:
        while self._idle:
            conn = self._idle.pop()
            if conn.usable():
                conn.reused = True
                return conn
            conn.abort()
        return None

    def _put(self, conn: _Conn) -> None:
        if self.closed or len(self._idle) >= _MAX_IDLE:
            conn.abort()
        else:
            self._idle.append(conn)

    def head(self, method: str, path: str, headers: str) -> bytes:
        """A request head up to (not including) Content-Length; `headers` is `Name: v\\r\\n`*."""
        return f"{method} {path} HTTP/1.1\r\nHost: {self.host_header}\r\n{headers}".encode(
            "latin-1"
        )

    async def request(self, head: bytes, body: bytes, head_only: bool = False) -> Response:
        """Sends `head` (from `head()`) with `body`; returns once the response head arrived.
        Cancellation at any point cuts the connection."""
        payload = head + b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body
        for _ in range(2):
            conn = self._get()
            fresh = conn is None
            if conn is None:
                conn = await self._connect()
            try:
                conn.writer.write(payload)
                raw = await conn.reader.readuntil(b"\r\n\r\n")
                while raw[9:10] == b"1":  # 1xx informational: the real answer follows
                    raw = await conn.reader.readuntil(b"\r\n\r\n")
            except asyncio.IncompleteReadError as exc:
                conn.abort()
                if not fresh and not exc.partial:
                    continue  # the server had closed the idle connection: once more, fresh
                raise ConnectionResetError("upstream closed the connection") from None
            except asyncio.LimitOverrunError:
                conn.abort()
                raise ConnectionResetError("upstream response head too large") from None
            except BaseException:
                conn.abort()
                raise
            return self._parse_head(conn, raw, head_only)
        raise ConnectionResetError("upstream closed the connection")  # pragma: no cover

    def _parse_head(self, conn: _Conn, raw: bytes, head_only: bool) -> Response:
        lines = raw.decode("latin-1").split("\r\n")
        parts = lines[0].split(" ", 2)
        if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or not parts[1].isdigit():
            conn.abort()
            raise ConnectionResetError("malformed response from upstream")
        headers = Headers()
        for line in lines[1:]:
            if not line:
                continue
            name, sep, value = line.partition(":")
            if not sep:
                continue
            key = name.strip().lower()
            value = value.strip()
            old = dict.get(headers, key)
            headers[key] = value if old is None else f"{old}, {value}"
        try:
            response = Response(self, conn, int(parts[1]), headers, head_only)
        except ConnectionResetError:
            conn.abort()
            raise
        if parts[0] == "HTTP/1.0" and (headers.get("connection") or "").lower() != "keep-alive":
            response._keep_alive = False
        return response

    async def close(self) -> None:
        self.closed = True
        while self._idle:
            self._idle.pop().abort()
