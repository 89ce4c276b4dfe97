"""The upstream HTTP/1.1 client against a raw scripted server: framing, keep-alive, faults."""

from __future__ import annotations

import asyncio
import contextlib
import random
import re
import socket
import threading
import time
import tracemalloc
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from gateway import http1
from gateway.http1 import REUSE_QUIET_S, BodyTooLarge, Client, ConnectError

Script = Callable[[asyncio.StreamReader, asyncio.StreamWriter, int], "asyncio.Future[None] | None"]


class RawServer:
    """Answers each request with `responses[i]` (bytes), counting connections."""

    def __init__(self, responses: list[bytes], close_after_each: bool = False) -> None:
        self.responses = responses
        self.close_after_each = close_after_each
        self.connections = 0
        self.requests: list[bytes] = []
        self.server: asyncio.Server | None = None
        self.port = 0
        self.writers: list[asyncio.StreamWriter] = []

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self.writers.append(writer)
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":")[1])
                body = await reader.readexactly(length)
                self.requests.append(head + body)
                writer.write(self.responses[min(len(self.requests), len(self.responses)) - 1])
                await writer.drain()
                if self.close_after_each:
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        writer.close()

    async def __aenter__(self) -> RawServer:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()
        for writer in self.writers:
            writer.close()
        await self.server.wait_closed()
        await asyncio.sleep(0)  # let the handlers see their connections close


@pytest.fixture
async def client_factory() -> AsyncIterator[Callable[[int], Client]]:
    made: list[Client] = []

    def make(port: int) -> Client:
        # Reused at once: these tests are about framing, not the rest after a response
        # (test_a_connection_rests_after_its_response covers that).
        c = Client(f"http://127.0.0.1:{port}/v1", connect_timeout=2, reuse_quiet_s=0)
        made.append(c)
        return c

    yield make
    for c in made:
        await c.close()


OK = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}"


async def _get(c: Client, body: bytes = b"x") -> tuple[int, bytes]:
    resp = await c.request(c.head("POST", "/v1/x", "Content-Type: application/json\r\n"), body)
    data = await resp.read()
    resp.release()
    return resp.status, data


async def test_keep_alive_reuses_one_connection(client_factory: Callable[[int], Client]) -> None:
    async with RawServer([OK]) as srv:
        c = client_factory(srv.port)
        for _ in range(5):
            assert await _get(c) == (200, b"{}")
        assert srv.connections == 1
        assert srv.requests[0].startswith(b"POST /v1/x HTTP/1.1\r\nHost: 127.0.0.1:")
        assert b"Content-Length: 1\r\n\r\nx" in srv.requests[0]


async def test_server_closing_idle_connections_is_not_a_failure(
    client_factory: Callable[[int], Client],
) -> None:
    async with RawServer([OK], close_after_each=True) as srv:
        c = client_factory(srv.port)
        for _ in range(3):
            await asyncio.sleep(0.05)  # the server has closed the idle connection by now
            assert await _get(c) == (200, b"{}")
        assert srv.connections == 3


async def test_chunked_body_with_trailers_and_batching(
    client_factory: Callable[[int], Client],
) -> None:
    body = b"5\r\nhello\r\n1;ext=1\r\n \r\n5\r\nworld\r\n0\r\nX-Trailer: 1\r\n\r\n"
    resp_bytes = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + body
    async with RawServer([resp_bytes]) as srv:
        c = client_factory(srv.port)
        assert await _get(c) == (200, b"hello world")
        assert await _get(c) == (200, b"hello world")  # framing left the connection clean
        assert srv.connections == 1


async def test_connection_close_framing_and_1xx(client_factory: Callable[[int], Client]) -> None:
    resp = b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nConnection: close\r\n\r\nuntil-eof"
    async with RawServer([resp], close_after_each=True) as srv:
        c = client_factory(srv.port)
        assert await _get(c) == (200, b"until-eof")
        assert await _get(c) == (200, b"until-eof")
        assert srv.connections == 2


async def test_redirects_are_returned_not_followed(client_factory: Callable[[int], Client]) -> None:
    redirect = b"HTTP/1.1 302 Found\r\nLocation: http://evil/\r\nContent-Length: 0\r\n\r\n"
    async with RawServer([redirect]) as srv:
        c = client_factory(srv.port)
        status, _ = await _get(c)
        assert status == 302
        assert len(srv.requests) == 1


@pytest.mark.parametrize(
    "response",
    [
        b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nshort",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhel",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\nhello\r\n",
        b"NOT HTTP\r\n\r\n",
    ],
)
async def test_truncated_or_malformed_answers_are_resets(
    client_factory: Callable[[int], Client], response: bytes
) -> None:
    async with RawServer([response], close_after_each=True) as srv:
        c = client_factory(srv.port)
        with pytest.raises(ConnectionResetError):
            await _get(c)


async def test_refused_connection_is_a_connect_error(
    client_factory: Callable[[int], Client],
) -> None:
    async with RawServer([OK]) as srv:
        port = srv.port
    c = client_factory(port)
    with pytest.raises(ConnectError):
        await _get(c)


async def test_cancellation_cuts_the_connection(client_factory: Callable[[int], Client]) -> None:
    hang = b""  # the server never answers the second request

    async with RawServer([OK, hang]) as srv:
        c = client_factory(srv.port)
        assert await _get(c) == (200, b"{}")
        task = asyncio.create_task(_get(c))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert c.idle_connections == 0  # the cut connection is never reused
        srv.responses = [OK]
        assert await _get(c) == (200, b"{}")
        assert srv.connections == 2


# --- framing faults: a connection that broke framing is lost, never another request's answer


class ScriptServer:
    """Runs `script(reader, writer, index)` for each accepted connection (index from 0)."""

    def __init__(self, script: Callable[..., Awaitable[None]]) -> None:
        self.script = script
        self.connections = 0
        self.server: asyncio.Server | None = None
        self.port = 0
        self.writers: list[asyncio.StreamWriter] = []
        self.tasks: set[asyncio.Task[None]] = set()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        index = self.connections
        self.connections += 1
        self.writers.append(writer)
        with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
            await self.script(reader, writer, index)
        writer.close()

    async def __aenter__(self) -> ScriptServer:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()
        for writer in self.writers:
            writer.transport.abort()
        await self.server.wait_closed()
        await asyncio.sleep(0.01)


async def read_request(reader: asyncio.StreamReader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":")[1])
    return head + await reader.readexactly(length)


def answer(body: bytes) -> bytes:
    return b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)


async def _post(c: Client, body: bytes) -> tuple[int, bytes]:
    return await _get(c, body)


def echo_script(first: bytes) -> Callable[..., Awaitable[None]]:
    """The first answer on the first connection is `first`; every other request is answered
    with its own body (so a shifted answer shows)."""

    async def script(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter, index: int
    ) -> None:
        n = 0
        while True:
            request = await read_request(reader)
            body = request.split(b"\r\n\r\n", 1)[1]
            writer.write(first if index == 0 and n == 0 else answer(body))
            n += 1
            await writer.drain()

    return script


@pytest.mark.parametrize(
    "extra",
    [
        b"EXTRA",  # bytes past Content-Length
        answer(b"EVIL"),  # a second response in the same write
        b"\r\n" + answer(b"EVIL"),
    ],
)
async def test_bytes_past_the_response_lose_the_connection(
    client_factory: Callable[[int], Client], extra: bytes
) -> None:
    async with ScriptServer(echo_script(answer(b"one") + extra)) as srv:
        c = client_factory(srv.port)
        assert await _post(c, b"one") == (200, b"one")  # the response itself is complete
        assert c.idle_connections == 0  # ... but its connection is not pooled
        for body in (b"two", b"three"):
            assert await _post(c, body) == (200, body)
        assert srv.connections == 2


async def test_bytes_past_the_response_arriving_later_lose_the_connection(
    client_factory: Callable[[int], Client],
) -> None:
    async def script(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter, index: int
    ) -> None:
        while True:
            body = (await read_request(reader)).split(b"\r\n\r\n", 1)[1]
            writer.write(answer(body))
            if index == 0:
                await writer.drain()
                await asyncio.sleep(0.05)
                writer.write(answer(b"EVIL"))
            await writer.drain()

    async with ScriptServer(script) as srv:
        c = client_factory(srv.port)
        resp = await c.request(c.head("POST", "/v1/x", ""), b"held")
        await asyncio.sleep(0.1)  # the stray answer arrives while the response is held
        assert await resp.read() == b"held"
        resp.release()
        assert c.idle_connections == 0
        assert await _post(c, b"two") == (200, b"two")
        assert srv.connections == 2


async def test_unsolicited_408_on_an_idle_connection_closes_it(
    client_factory: Callable[[int], Client],
) -> None:
    timeout = b"HTTP/1.1 408 Request Timeout\r\nContent-Length: 7\r\n\r\ntimeout"

    async def script(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter, index: int
    ) -> None:
        body = (await read_request(reader)).split(b"\r\n\r\n", 1)[1]
        writer.write(answer(body))
        if index == 0:
            await asyncio.sleep(0.05)
            writer.write(timeout)  # and keeps the connection open: a reuse would read it
            await asyncio.sleep(10)
        while True:
            body = (await read_request(reader)).split(b"\r\n\r\n", 1)[1]
            writer.write(answer(body))

    async with ScriptServer(script) as srv:
        c = client_factory(srv.port)
        assert await _post(c, b"one") == (200, b"one")
        assert c.idle_connections == 1
        await asyncio.sleep(0.15)
        assert await _post(c, b"two") == (200, b"two")
        assert await _post(c, b"three") == (200, b"three")
        assert srv.connections == 2


async def test_a_probe_never_leaves_bytes_for_a_request() -> None:
    """Health probes share the pool: a probe answered with bytes past its end must not hand
    them to the next real request."""
    from gateway.config import InstanceSpec, Timeouts
    from gateway.upstream import Upstream

    async def script(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter, index: int
    ) -> None:
        while True:
            request = await read_request(reader)
            if request.startswith(b"GET"):
                writer.write(answer(b'{"data": []}') + answer(b'{"shifted": true}'))
            else:
                writer.write(answer(b'{"real": true}'))

    async with ScriptServer(script) as srv:
        spec = InstanceSpec(
            name="u", url=f"http://127.0.0.1:{srv.port}/v1", model="m", max_concurrency=1
        )
        up = Upstream(spec, Timeouts())
        try:
            assert await up.probe("/v1/models", 2) is True
            resp = await up.open("/chat/completions", b"{}")
            assert await resp.read() == b'{"real": true}'
            resp.release()
            assert srv.connections == 2
        finally:
            await up.close()


async def test_a_probe_never_raises() -> None:
    from gateway.config import InstanceSpec, Timeouts
    from gateway.upstream import Upstream

    big = b"HTTP/1.1 200 OK\r\nContent-Length: 2000000\r\n\r\n" + b"x" * 2_000_000

    async def script(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter, index: int
    ) -> None:
        await read_request(reader)
        writer.write([big, "HTTP/1.1 ²00 OK\r\n\r\n".encode()][index % 2])
        await writer.drain()

    async with ScriptServer(script) as srv:
        spec = InstanceSpec(
            name="u", url=f"http://127.0.0.1:{srv.port}/v1", model="m", max_concurrency=1
        )
        up = Upstream(spec, Timeouts())
        try:
            assert await up.probe("/v1/models", 2) is False  # body over the probe's bound
            assert await up.probe("/v1/models", 2) is False  # a broken status line
            assert up.client.idle_connections == 0
        finally:
            await up.close()
        dead = Upstream(
            InstanceSpec(name="d", url="http://127.0.0.1:9/v1", model="m", max_concurrency=1),
            Timeouts(),
        )
        assert await dead.probe("/v1/models", 2) is False
        await dead.close()


# --- strict parsing: each violation is a ConnectionResetError and the connection is lost

HEAD = b"HTTP/1.1 200 OK\r\n"
CHUNKED = HEAD + b"Transfer-Encoding: chunked\r\n\r\n"


@pytest.mark.parametrize(
    "response",
    [
        CHUNKED + b"0x2\r\n{}\r\n0\r\n\r\n",
        CHUNKED + b"+2\r\n{}\r\n0\r\n\r\n",
        CHUNKED + b"2_0\r\n" + b"x" * 32 + b"\r\n0\r\n\r\n",
        CHUNKED + b" 2\r\n{}\r\n0\r\n\r\n",
        CHUNKED + b"2\n{}\r\n0\r\n\r\n",
        CHUNKED + b"2\r\n{}XX0\r\n\r\n",
        CHUNKED + b"1FFFFFFFFFFFFFFFF\r\nx",  # overflows 64 bits
        b"HTTP/1.1 099 Too Low\r\nContent-Length: 0\r\n\r\n",
        b"HTTP/1.1 600 Too High\r\nContent-Length: 0\r\n\r\n",
        "HTTP/1.1 ²00 OK\r\nContent-Length: 0\r\n\r\n".encode(),
        b"HTTP/1.1 2000 OK\r\nContent-Length: 0\r\n\r\n",
        b"HTTP/2.0 200 OK\r\nContent-Length: 0\r\n\r\n",
        b"HTTP/1.1 200 OK\nContent-Length: 0\n\n",  # bare LF
        HEAD + b"X-A: 1\nContent-Length: 0\r\n\r\n",
        HEAD + b"X-A: 1\r\n folded\r\nContent-Length: 0\r\n\r\n",  # obs-fold
        HEAD + b"Content-Length: 2\r\nTransfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n",
        HEAD + b"Content-Length: 2\r\nContent-Length: 3\r\n\r\n{}x",
        HEAD + b"Content-Length: 2, 3\r\n\r\n{}x",
        HEAD + b"Content-Length: +2\r\n\r\n{}",
        HEAD + b"Transfer-Encoding: gzip\r\n\r\nxx",
        HEAD + b"Transfer-Encoding: gzip, chunked\r\n\r\n0\r\n\r\n",
        HEAD + b"X\x01Y: 1\r\nContent-Length: 0\r\n\r\n",
        HEAD + b"X-Y: a\x00b\r\nContent-Length: 0\r\n\r\n",
        HEAD + b"X-Y : 1\r\nContent-Length: 0\r\n\r\n",
        b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: h2c\r\nConnection: Upgrade\r\n\r\n",
        b"\xff\xfe garbage\r\n\r\n",
    ],
)
async def test_framing_violations_are_resets(
    client_factory: Callable[[int], Client], response: bytes
) -> None:
    async with RawServer([response]) as srv:
        c = client_factory(srv.port)
        with pytest.raises(ConnectionResetError) as err:
            await _get(c)
        assert type(err.value) is ConnectionResetError
        assert c.idle_connections == 0


async def test_header_values_are_latin1_and_never_crash(
    client_factory: Callable[[int], Client],
) -> None:
    response = (
        HEAD + b"X-Raw: caf\xe9 \xff\x80  \r\nX-Two: a\r\nx-two: b\r\nContent-Length: 0\r\n\r\n"
    )
    async with RawServer([response]) as srv:
        c = client_factory(srv.port)
        resp = await c.request(c.head("GET", "/", ""), b"")
        assert resp.headers["X-RAW"] == "caf\xe9 \xff\x80"
        assert resp.headers.get("x-two") == "a, b"
        assert "x-raw" in resp.headers and resp.content_type == ""
        assert await resp.read() == b""
        resp.release()
        assert c.idle_connections == 1


async def test_interim_responses_are_skipped_but_bounded(
    client_factory: Callable[[int], Client],
) -> None:
    ten = b"HTTP/1.1 103 Early Hints\r\nLink: </x>\r\n\r\n" * 10 + OK
    async with RawServer([ten]) as srv:
        c = client_factory(srv.port)
        assert await _get(c) == (200, b"{}")
    flood = b"HTTP/1.1 100 Continue\r\n\r\n" * 11 + OK
    async with RawServer([flood]) as srv:
        c = client_factory(srv.port)
        with pytest.raises(ConnectionResetError, match="interim"):
            await _get(c)


@pytest.mark.parametrize(
    ("head", "ok"),
    [
        (HEAD + b"X-Big: " + b"a" * 60_000 + b"\r\n", True),
        (HEAD + b"X-Big: " + b"a" * 70_000 + b"\r\n", False),
        (HEAD + b"".join(b"X-%d: 1\r\n" % i for i in range(99)), True),
        (HEAD + b"".join(b"X-%d: 1\r\n" % i for i in range(101)), False),
        (b"HTTP/1.1 200 " + b"r" * 70_000 + b"\r\n", False),
    ],
)
async def test_response_head_is_bounded(
    client_factory: Callable[[int], Client], head: bytes, ok: bool
) -> None:
    async with RawServer([head + b"Content-Length: 2\r\n\r\n{}"]) as srv:
        c = client_factory(srv.port)
        if ok:
            assert await _get(c) == (200, b"{}")
        else:
            with pytest.raises(ConnectionResetError, match="head"):
                await _get(c)


async def test_a_head_dripping_in_forever_is_bounded(
    client_factory: Callable[[int], Client],
) -> None:
    async def script(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter, index: int
    ) -> None:
        await read_request(reader)
        writer.write(HEAD + b"X-Endless: ")
        for _ in range(1000):
            writer.write(b"a" * 1000)
            await writer.drain()
            await asyncio.sleep(0)

    async with ScriptServer(script) as srv:
        c = client_factory(srv.port)
        with pytest.raises(ConnectionResetError, match="head"):
            await _get(c)


# --- bounds on the body


async def test_read_limit(client_factory: Callable[[int], Client]) -> None:
    chunked = CHUNKED + b"".join(b"100\r\n" + b"c" * 256 + b"\r\n" for _ in range(8)) + b"0\r\n\r\n"
    async with RawServer([answer(b"x" * 1000), chunked, answer(b"y" * 10)]) as srv:
        c = client_factory(srv.port)
        resp = await c.request(c.head("POST", "/", ""), b"1")
        with pytest.raises(BodyTooLarge):  # over by its Content-Length, before reading it
            await resp.read(999)
        resp.release()
        assert c.idle_connections == 0
        resp = await c.request(c.head("POST", "/", ""), b"2")
        with pytest.raises(BodyTooLarge) as err:
            await resp.read(2047)
        assert isinstance(err.value, ConnectionResetError)
        resp.release()
        assert c.idle_connections == 0
        resp = await c.request(c.head("POST", "/", ""), b"3")
        assert await resp.read(10) == b"y" * 10  # exactly at the limit
        resp.release()
        assert c.idle_connections == 1
        assert srv.connections == 3


async def test_an_absurd_chunk_size_does_not_allocate(
    client_factory: Callable[[int], Client],
) -> None:
    async def script(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter, index: int
    ) -> None:
        await read_request(reader)
        writer.write(CHUNKED + b"FFFFFFFFFFFFFFFF\r\n")
        for _ in range(64):
            writer.write(b"z" * 65536)
            await writer.drain()

    async with ScriptServer(script) as srv:
        c = client_factory(srv.port)
        # No bound on a chunk's size here (`max_chunk`): what llhttp does with it alone.
        unbounded = 1 << 70
        tracemalloc.start()
        try:
            resp = await c.request(c.head("POST", "/", ""), b"", max_chunk=unbounded)
            with pytest.raises(BodyTooLarge):
                await resp.read(1 << 20)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert peak < 8 << 20
        # read piece by piece, the body ends in a reset when the server closes mid-chunk
        resp = await c.request(c.head("POST", "/", ""), b"", max_chunk=unbounded)
        total = 0
        with pytest.raises(ConnectionResetError, match="mid-body"):
            while piece := await resp.readany():
                total += len(piece)
        assert total == 64 * 65536


@pytest.mark.parametrize(
    ("writes", "split"),
    [
        pytest.param([CHUNKED + b"FFFFFFFFFFFFFFFF\r\nxy"], False, id="with-head"),
        pytest.param([CHUNKED, b"FFFFFFFFFFFFFFFF\r\n", b"xy"], False, id="after-head"),
        pytest.param([CHUNKED + b"2\r\n{}\r\n1000", b"01\r\nxy"], True, id="split-size"),
        pytest.param([CHUNKED[:-1], b"\n4;ext=1\r\nab", b"cd\r\n20001\r\n"], True, id="split-head"),
    ],
)
async def test_a_chunk_over_the_bound_fails_at_once(
    client_factory: Callable[[int], Client], writes: list[bytes], split: bool
) -> None:
    """SPEC §16: "a chunk larger than the response bound is a framing error" — declared,
    not waited for: the upstream holds its connection open and sends nothing more."""
    async with ScriptServer(_script_of(writes, pause=0.01)) as srv:
        c = client_factory(srv.port)
        t0 = time.monotonic()
        with pytest.raises(ConnectionResetError, match="declared a chunk of"):
            resp = await c.request(c.head("POST", "/", ""), b"", max_chunk=0x10000)
            await resp.read()
        assert time.monotonic() - t0 < 1.0
        assert c.idle_connections == 0


async def test_chunk_sizes_are_read_wherever_the_reads_split(
    client_factory: Callable[[int], Client],
) -> None:
    """The chunk-size reading never refuses a valid body, however it is cut into reads."""
    rng = random.Random(25)
    body = b"".join(b"data: %d\n\n" % i for i in range(200))
    pieces = []
    pos = 0
    while pos < len(body):
        n = rng.choice((1, 3, 17, 100, 700))
        pieces.append(body[pos : pos + n])
        pos += n
    wire = b"".join(b"%x;x=y\r\n%b\r\n" % (len(p), p) for p in pieces) + b"0\r\n\r\n"
    full = CHUNKED + wire
    cuts = sorted(rng.sample(range(1, len(full)), 60))

    async def script(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter, index: int
    ) -> None:
        await read_request(reader)
        last = 0
        for cut in [*cuts, len(full)]:
            writer.write(full[last:cut])
            last = cut
            await writer.drain()
            await asyncio.sleep(0.001)
        await reader.read()

    async with ScriptServer(script) as srv:
        c = client_factory(srv.port)
        resp = await c.request(c.head("POST", "/", ""), b"", max_chunk=max(map(len, pieces)))
        assert await resp.read() == body
        resp.release()


async def test_a_connection_rests_after_its_response() -> None:
    """SPEC §16: "connections are never reused within a few milliseconds of a response
    ending": a request right after another opens a connection; once the first has rested it
    is reused again."""
    async with RawServer([OK]) as srv:
        c = Client(f"http://127.0.0.1:{srv.port}/v1", connect_timeout=2)
        try:
            assert await _get(c) == (200, b"{}")
            assert await _get(c) == (200, b"{}")
            assert srv.connections == 2
            await asyncio.sleep(REUSE_QUIET_S * 2)
            assert await _get(c) == (200, b"{}")
            assert srv.connections == 2
        finally:
            await c.close()


async def test_a_duplicate_that_came_while_the_loop_was_busy_is_never_read() -> None:
    """SPEC §16: a backend (another process: here a thread) sends its answer twice, 2 ms
    apart, while the gateway's loop is busy for 20 ms (a GC pause, a burst) — past the rest,
    with the duplicate already in the kernel but not yet read by the loop. The next request
    must not take that connection: it would read the duplicate as its own answer."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    accepted: list[int] = []

    def serve() -> None:
        with contextlib.suppress(OSError):
            while True:
                conn, _ = listener.accept()
                accepted.append(1)
                threading.Thread(target=answer_twice, args=(conn,), daemon=True).start()

    def answer_twice(conn: socket.socket) -> None:
        n = 0
        with conn, contextlib.suppress(OSError):
            while True:
                head = b""
                while b"\r\n\r\n" not in head:
                    got = conn.recv(65536)
                    if not got:
                        return
                    head += got
                n += 1
                body = f'{{"n":{len(accepted)}{n}}}'.encode()
                reply = b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
                conn.sendall(reply)
                time.sleep(0.002)
                conn.sendall(reply)  # the same answer again

    threading.Thread(target=serve, daemon=True).start()
    c = Client(f"http://127.0.0.1:{port}/v1", connect_timeout=2)
    try:
        answers = []
        for _ in range(5):
            status, body = await _get(c)
            assert status == 200
            answers.append(body)
            time.sleep(0.02)  # noqa: ASYNC251 — the loop is busy: nothing is read meanwhile
        # Every request got its own answer: the first of each connection, never a duplicate.
        assert len(set(answers)) == len(answers), answers
        assert len(accepted) == 5  # each duplicate cost its connection
    finally:
        await c.close()
        listener.close()


async def test_a_duplicate_answer_in_the_rest_costs_only_that_connection() -> None:
    """A backend that sends its answer twice, 2 ms apart: the duplicate lands on the resting
    connection (unsolicited bytes: lost), never on the next request."""
    two = OK.replace(b"{}", b"{1") + b""

    async def script(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter, index: int
    ) -> None:
        with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
            while await read_request(reader):
                writer.write(two)
                await asyncio.sleep(0.002)
                writer.write(two)  # the same answer again
                await writer.drain()

    async with ScriptServer(script) as srv:
        # a rest far longer than the 2 ms, so a loaded test machine cannot blur the two
        c = Client(f"http://127.0.0.1:{srv.port}/v1", connect_timeout=2, reuse_quiet_s=0.05)
        try:
            for _ in range(20):
                assert await _get(c) == (200, b"{1")
        finally:
            await c.close()


async def test_an_echoed_request_id_of_another_request_is_a_framing_error(
    client_factory: Callable[[int], Client],
) -> None:
    """SPEC §16: where the backend echoes the request id, a mismatch is a framing error; the
    request is sent once more on a fresh connection and gets its own answer."""
    answers = [b"HTTP/1.1 200 OK\r\nX-Request-Id: other\r\nContent-Length: 2\r\n\r\n{}"]

    async def script(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter, index: int
    ) -> None:
        with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
            await _answer_echoing(reader, writer, index)

    async def _answer_echoing(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter, index: int
    ) -> None:
        while head := await read_request(reader):
            rid = re.search(rb"X-Request-Id: (\S+)", head)
            mine = rid.group(1) if rid else b"none"
            if answers and index == 0 and b"want-other" in head:
                writer.write(answers.pop())
            else:
                writer.write(
                    b"HTTP/1.1 200 OK\r\nX-Request-Id: %b\r\nContent-Length: %d\r\n\r\n%b"
                    % (mine, len(mine), mine)
                )
            await writer.drain()

    async with ScriptServer(script) as srv:
        c = client_factory(srv.port)
        head = c.head("POST", "/", "X-Request-Id: a1\r\n")
        resp = await c.request(head, b"", request_id="a1")
        assert await resp.read() == b"a1"
        resp.release()
        head = c.head("POST", "/", "X-Request-Id: b2\r\nX-Want: want-other\r\n")
        resp = await c.request(head, b"", request_id="b2")
        assert await resp.read() == b"b2"
        resp.release()
        assert srv.connections == 2  # the crossed one was lost, the retry on a fresh one


async def test_an_endless_body_is_flow_controlled(client_factory: Callable[[int], Client]) -> None:
    written = 0

    async def script(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter, index: int
    ) -> None:
        nonlocal written
        await read_request(reader)
        writer.write(CHUNKED)
        piece = b"10000\r\n" + b"e" * 65536 + b"\r\n"
        while True:
            writer.write(piece)
            written += 65536
            await writer.drain()

    async with ScriptServer(script) as srv:
        c = client_factory(srv.port)
        resp = await c.request(c.head("POST", "/", ""), b"")
        bound = http1.HIGH_WATER + 256 * 1024  # the mark plus at most one socket read
        await asyncio.sleep(0.3)  # a consumer that does not read at all
        stalled = written
        await asyncio.sleep(0.2)
        assert written == stalled  # the server is blocked: nothing grows anywhere
        assert resp.reading_paused and resp.buffered <= bound
        read = 0
        for _ in range(50):  # a slow consumer
            assert resp.buffered <= bound
            read += len(await resp.readany())
            await asyncio.sleep(0.002)
        assert read > 4 * http1.HIGH_WATER  # reading resumed each time it drained
        resp.close()
        assert c.idle_connections == 0


# --- the keep-alive race and cancellation


async def test_a_stale_reused_connection_is_resent_on_a_fresh_one(
    client_factory: Callable[[int], Client],
) -> None:
    """Each connection answers one request, then closes on the next without a byte (the
    keep-alive race seen from the client). The resend must not pick another stale idle
    connection: it connects anew."""

    async def script(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter, index: int
    ) -> None:
        body = (await read_request(reader)).split(b"\r\n\r\n", 1)[1]
        await asyncio.sleep(0.02)  # keeps both first requests in flight together
        writer.write(answer(body))
        await writer.drain()
        await read_request(reader)  # ... and closes without answering

    async with ScriptServer(script) as srv:
        c = client_factory(srv.port)
        assert await asyncio.gather(_post(c, b"a"), _post(c, b"b")) == [(200, b"a"), (200, b"b")]
        # two, and the one opened ahead while both were in flight (preconnect)
        assert c.idle_connections == 3 and srv.connections == 3
        assert await _post(c, b"c") == (200, b"c")
        assert srv.connections == 4  # one stale idle connection tried, then a fresh one
        # a fresh connection closed before answering is a reset, not resent
        async with ScriptServer(lambda r, w, i: read_request(r)) as mute:
            m = client_factory(mute.port)
            with pytest.raises(ConnectionResetError, match="before answering"):
                await _post(m, b"x")
            assert mute.connections == 1


async def test_cancelling_a_body_read_cuts_the_connection(
    client_factory: Callable[[int], Client],
) -> None:
    async def script(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter, index: int
    ) -> None:
        while True:
            await read_request(reader)
            writer.write(CHUNKED + b"2\r\nhi\r\n")  # then nothing
            await writer.drain()

    async with ScriptServer(script) as srv:
        c = client_factory(srv.port)
        resp = await c.request(c.head("POST", "/", ""), b"")
        assert await resp.readany() == b"hi"
        task = asyncio.create_task(resp.readany())
        await asyncio.sleep(0.02)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        resp.release()  # a cancelled read left the connection unusable: it is not pooled
        assert c.idle_connections == 0
        with pytest.raises(ConnectionResetError):
            await resp.readany()


async def test_body_framed_by_close_and_reset_mid_body(
    client_factory: Callable[[int], Client],
) -> None:
    async def script(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter, index: int
    ) -> None:
        await read_request(reader)
        if index == 0:
            writer.write(HEAD + b"\r\nuntil the end")
        else:
            writer.write(HEAD + b"Content-Length: 100\r\n\r\npartial")
            await writer.drain()
            writer.transport.abort()

    async with ScriptServer(script) as srv:
        c = client_factory(srv.port)
        assert await _get(c) == (200, b"until the end")
        assert c.idle_connections == 0
        resp = await c.request(c.head("POST", "/", ""), b"")
        assert await resp.readany() == b"partial"
        with pytest.raises(ConnectionResetError):
            await resp.readany()


SSE_HEAD = (
    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
)


def _sse_chunks(*events: bytes) -> bytes:
    return b"".join(b"%x\r\n%b\r\n" % (len(e), e) for e in events)


async def _relay_until_done(c: Client) -> tuple[bool, list[bytes]]:
    """A stream relayed the gateway's way: the sink stops at `[DONE]`."""
    resp = await c.request(c.head("POST", "/v1/x", "Content-Type: application/json\r\n"), b"x")
    got: list[bytes] = []

    def sink(data: bytes) -> bool:
        got.append(data)
        return b"[DONE]" not in b"".join(got)

    async def drain() -> None:
        return None

    ended = await resp.relay(sink, drain)
    if resp.is_eof():
        resp.release()
    else:
        resp.close()
    return ended, got


async def test_a_relay_stopped_at_the_body_end_keeps_the_connection(
    client_factory: Callable[[int], Client],
) -> None:
    """A token stream whose `[DONE]` comes with the last chunk (vLLM, OpenAI): the sink stops
    there, nothing is left unread, so the connection is reused by the next stream instead of
    a new TCP connection (and its setup) per stream. A sink that stops before the body ended
    still cuts the connection: the upstream must stop working."""
    whole = SSE_HEAD + _sse_chunks(b'data: {"a":1}\n\n', b"data: [DONE]\n\n") + b"0\r\n\r\n"
    async with RawServer([whole]) as srv:
        c = client_factory(srv.port)
        for _ in range(3):
            ended, got = await _relay_until_done(c)
            assert b"".join(got).endswith(b"data: [DONE]\n\n")
            assert not ended  # the sink stopped it (at the end)
        assert srv.connections == 1
    # `[DONE]` with more of the body still to come (no last chunk yet): cut.
    unfinished = SSE_HEAD + _sse_chunks(b"data: [DONE]\n\n")
    async with RawServer([unfinished, whole]) as srv:
        c = client_factory(srv.port)
        await _relay_until_done(c)
        ended, got = await _relay_until_done(c)
        assert b"".join(got).endswith(b"data: [DONE]\n\n")
        assert srv.connections == 2


async def _relay_pieces(c: Client) -> tuple[list[bytes], BaseException | None]:
    """A stream relayed as the gateway does: what the sink was given, and what the relay
    raised (None: the body ended cleanly)."""
    resp = await c.request(c.head("POST", "/v1/x", ""), b"x")
    got: list[bytes] = []

    def sink(data: bytes) -> bool:
        got.append(data)
        return True

    async def drain() -> None:
        return None

    try:
        await resp.relay(sink, drain)
    except ConnectionResetError as exc:
        resp.close()
        return got, exc
    resp.release()
    return got, None


def _script_of(writes: list[bytes], pause: float = 0.005) -> Callable[..., Awaitable[None]]:
    """A server script: reads the request, sends `writes` one write each, `pause` s apart (one
    read each on the client's side), then holds the connection until the client leaves."""

    async def script(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter, index: int
    ) -> None:
        await read_request(reader)
        for piece in writes:
            writer.write(piece)
            await writer.drain()
            await asyncio.sleep(pause)
        await reader.read()

    return script


async def test_a_relay_reads_whole_chunks_and_hands_over_exactly_the_data(
    client_factory: Callable[[int], Client],
) -> None:
    """A relayed stream whose reads are one whole chunk each (a token stream's common read,
    taken without llhttp), mixed with reads llhttp takes (a chunk cut in two, two chunks at
    once, an extension, upper-case and zero-padded sizes): the sink gets exactly the data,
    never a size line or a CRLF, and the connection is reused after the last chunk."""
    events = [b'data: {"i":%d}\n\n' % i for i in range(12)]
    one = [b"%x\r\n%b\r\n" % (len(e), e) for e in events]
    writes = [
        SSE_HEAD,
        one[0],
        one[1],
        one[2][:7],  # a chunk cut in two reads
        one[2][7:],
        one[3],  # a whole chunk again, once the cut one ended
        one[4] + one[5],  # two chunks in one read
        b"%X\r\n%b\r\n" % (len(events[6]), events[6]),  # upper-case hex
        b"000%x\r\n%b\r\n" % (len(events[7]), events[7]),  # zero-padded
        b"%x;ext=1\r\n%b\r\n" % (len(events[8]), events[8]),  # an extension
        one[9][:-1],  # all but the last byte
        one[9][-1:] + one[10],
        one[11],
        b"0\r\n\r\n",
    ]
    async with ScriptServer(_script_of(writes)) as srv:
        c = client_factory(srv.port)
        got, error = await _relay_pieces(c)
        assert error is None
        assert b"".join(got) == b"".join(events)
        assert c.idle_connections == 1  # kept for the next request


@pytest.mark.parametrize(
    "bad",
    [
        b"+1e\r\n" + b"d" * 30 + b"\r\n",  # sizes Python's int() would read, llhttp not
        b"0x1e\r\n" + b"d" * 30 + b"\r\n",
        b"1_e\r\n" + b"d" * 30 + b"\r\n",
        b" 1e\r\n" + b"d" * 30 + b"\r\n",
        b"1e\r\n" + b"d" * 30 + b"XY",  # the chunk's CRLF missing
        b"1e\n" + b"d" * 30 + b"\r\n",  # a bare LF after the size
        b"FFFFFFFFFFFFFFFF\r\n" + b"d" * 16,  # over the bound
        b"0000000000000000001e\r\n" + b"d" * 30 + b"\r\n",  # a size line the fast path skips
    ],
)
async def test_a_relay_refuses_chunks_llhttp_refuses(
    client_factory: Callable[[int], Client], bad: bytes
) -> None:
    """A relayed stream's whole-chunk reads are read as strictly as llhttp reads them: a
    size line it refuses, or a chunk not ended by CRLF, is a framing error (the connection
    lost), never data for the client. (The last case is valid: llhttp takes it.)"""
    good = b'data: {"i":0}\n\n'
    writes = [SSE_HEAD, b"%x\r\n%b\r\n" % (len(good), good), bad, b"0\r\n\r\n"]
    async with ScriptServer(_script_of(writes)) as srv:
        c = client_factory(srv.port)
        got, error = await _relay_pieces(c)
        data = b"".join(got)
        assert data.startswith(good)
        if bad.startswith(b"00000"):
            assert error is None and data == good + b"d" * 30
            return
        assert isinstance(error, ConnectionResetError)
        assert b"\r\n" not in data and b"1e" not in data
        assert c.idle_connections == 0


async def test_overlapping_requests_open_the_next_connection_ahead(
    client_factory: Callable[[int], Client],
) -> None:
    """Preconnect: while two requests are in flight and no idle connection is left, one more
    connection is opened in the background, so the next request goes out at once on it (no
    handshake on its path: a stream's time to first chunk). One request at a time never
    opens one."""
    release = asyncio.Event()

    async def script(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter, index: int
    ) -> None:
        while True:
            body = (await read_request(reader)).split(b"\r\n\r\n", 1)[1]
            if body != b"now":
                await release.wait()
            writer.write(answer(b"%d" % index))
            await writer.drain()

    async with ScriptServer(script) as srv:
        c = client_factory(srv.port)
        assert await _post(c, b"now") == (200, b"0")
        await asyncio.sleep(REUSE_QUIET_S * 2)
        assert await _post(c, b"now") == (200, b"0")  # one at a time: one connection
        assert srv.connections == 1
        held = [asyncio.ensure_future(_post(c, b"a")), asyncio.ensure_future(_post(c, b"b"))]
        for _ in range(200):
            if srv.connections == 3 and c.idle_connections == 1:
                break
            await asyncio.sleep(0.005)
        assert srv.connections == 3 and c.idle_connections == 1  # two in use, one ahead
        # The third request is answered on the connection opened ahead (index 2); taking it
        # opens the next one ahead while the other two are still in flight.
        assert await _post(c, b"now") == (200, b"2")
        release.set()
        assert sorted(await asyncio.gather(*held)) == [(200, b"0"), (200, b"1")]
        assert srv.connections == 4
    await c.close()
    assert c.idle_connections == 0
