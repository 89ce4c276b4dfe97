"""The upstream HTTP/1.1 client against a raw scripted server: framing, keep-alive, faults."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

import pytest

from gateway.http1 import Client, ConnectError

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
        c = Client(f"http://127.0.0.1:{port}/v1", connect_timeout=2)
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
        assert not c._idle  # the cut connection is never reused
        srv.responses = [OK]
        assert await _get(c) == (200, b"{}")
        assert srv.connections == 2
