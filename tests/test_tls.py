"""SPEC §6 TLS at the upstream client itself (the gateway-level checks are in test_egress.py):
verification against `ca_file` or the system store, `server_name` as the name checked and the
SNI sent, every TLS failure a `ConnectError`, keep-alive reuse over TLS, and a reload that
changes `tls:` building a new client."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
import trustme

from gateway.config import InstanceSpec, Timeouts, TlsSpec
from gateway.http1 import Client, ConnectError
from gateway.upstream import Upstream as UpstreamInstance
from tlsutil import JSON_BODY, SSE_EVENTS, Upstream, running, server_context, write_ca


@pytest.fixture(scope="module")
def ca() -> trustme.CA:
    return trustme.CA()


@pytest.fixture
async def clients() -> AsyncIterator[Callable[..., Client]]:
    made: list[Client] = []

    def make(url: str, **kw: Any) -> Client:
        c = Client(url, connect_timeout=5, trust_env=False, **kw)
        made.append(c)
        return c

    yield make
    for c in made:
        await c.close()


async def _ask(c: Client, body: bytes = b"{}") -> tuple[int, str, bytes]:
    resp = await c.request(c.head("POST", "/v1/chat/completions", ""), body)
    data = await resp.read()
    resp.release()
    return resp.status, resp.content_type, data


async def test_verified_against_ca_file_json_sse_and_one_connection(
    ca: trustme.CA, tmp_path: Path, clients: Callable[..., Client]
) -> None:
    up = Upstream(server_context(ca, "localhost", "127.0.0.1"))
    async with running(up):
        c = clients(up.url, ca_file=write_ca(ca, tmp_path))
        assert await _ask(c) == (200, "application/json", JSON_BODY)
        resp = await c.request(c.head("POST", "/v1/chat/completions", ""), b'{"stream": true}')
        assert resp.content_type == "text/event-stream"
        events = b""
        while piece := await resp.readany():
            events += piece
        resp.release()
        assert events == b"".join(SSE_EVENTS)
        for _ in range(4):
            assert (await _ask(c))[0] == 200
        # keep-alive over TLS: one TCP connection, one handshake, six requests
        assert up.connections == 1 and len(up.sni) == 1 and len(up.requests) == 6
        assert up.sni == [None]  # an IP address is never sent as SNI


async def test_the_system_store_does_not_know_a_private_ca(
    ca: trustme.CA, clients: Callable[..., Client]
) -> None:
    up = Upstream(server_context(ca, "localhost", "127.0.0.1"))
    async with running(up):
        c = clients(up.url)
        with pytest.raises(ConnectError, match="certificate") as err:
            await _ask(c)
        assert type(err.value) is ConnectError
        assert not up.requests and c.idle_connections == 0


async def test_a_wrong_server_name_is_a_connect_error(
    ca: trustme.CA, tmp_path: Path, clients: Callable[..., Client]
) -> None:
    up = Upstream(server_context(ca, "localhost", "127.0.0.1"))
    async with running(up):
        c = clients(up.url, ca_file=write_ca(ca, tmp_path), server_name="other.example")
        with pytest.raises(ConnectError, match="certificate"):
            await _ask(c)
        assert up.sni == ["other.example"] and not up.requests


async def test_server_name_overrides_the_url_host(
    ca: trustme.CA, tmp_path: Path, clients: Callable[..., Client]
) -> None:
    """The certificate names only `localhost`; the URL says 127.0.0.1. Without `server_name`
    the names disagree; with it, the name checked and sent is `localhost` (the Host header
    stays the URL's)."""
    up = Upstream(server_context(ca, "localhost"))
    ca_file = write_ca(ca, tmp_path)
    async with running(up):
        with pytest.raises(ConnectError, match="certificate"):
            await _ask(clients(up.url, ca_file=ca_file))
        c = clients(up.url, ca_file=ca_file, server_name="localhost")
        assert (await _ask(c))[0] == 200
        assert up.sni == [None, "localhost"]  # the first handshake sent none (an IP address)
        assert f"Host: 127.0.0.1:{up.port}\r\n".encode() in up.requests[0]


async def test_a_host_name_is_sent_as_sni(
    ca: trustme.CA, tmp_path: Path, clients: Callable[..., Client]
) -> None:
    up = Upstream(server_context(ca, "localhost"))
    async with running(up):
        c = clients(f"https://localhost:{up.port}/v1", ca_file=write_ca(ca, tmp_path))
        assert (await _ask(c))[0] == 200
        assert up.sni == ["localhost"]


async def test_plain_http_behind_an_https_url_is_a_connect_error(
    clients: Callable[..., Client],
) -> None:
    async def plain(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read(1)  # a ClientHello is no request: a plain server says so
        writer.write(b"HTTP/1.1 400 Bad Request\r\nConnection: close\r\n\r\n")
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(plain, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        with pytest.raises(ConnectError, match="TLS"):
            await _ask(clients(f"https://127.0.0.1:{port}/v1"))
    finally:
        server.close()
        await server.wait_closed()


async def test_a_reload_that_changes_tls_builds_a_new_client(
    ca: trustme.CA, tmp_path: Path
) -> None:
    up = Upstream(server_context(ca, "localhost", "127.0.0.1"))
    async with running(up):
        spec = InstanceSpec(name="t", url=up.url, model="m", max_concurrency=1)
        inst = UpstreamInstance(spec, Timeouts())
        try:
            assert await inst.probe("/v1/models", 5) is False  # the system store: rejected
            first = inst.client
            tls = TlsSpec(ca_file=write_ca(ca, tmp_path))
            inst.update(
                InstanceSpec(name="t", url=up.url, model="m", max_concurrency=1, tls=tls),
                Timeouts(),
            )
            assert inst.client is not first and first.closed
            assert await inst.probe("/v1/models", 5) is True
            same = inst.client
            inst.update(inst.spec, Timeouts(connect_ms=1000))  # nothing TLS changed: kept
            assert inst.client is same and same.connect_timeout == 1.0
        finally:
            await inst.close()
