"""SPEC §16 bounds the idle keep-alive connections an upstream keeps; the bound follows the
instance's `max_concurrency` (one request per connection), so a burst of more concurrent
requests or streams than the default 256 keeps its connections for the next burst instead of
closing the ones past 256 and connecting again (a TCP — in production often a TLS — handshake
each)."""

from __future__ import annotations

import asyncio
import json

from gateway.config import parse_config
from gateway.upstream import Upstream

OK = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}"


async def test_a_burst_above_256_keeps_its_connections_for_the_next() -> None:
    connections = 0
    arrived = 0
    all_in = asyncio.Event()
    burst = 300

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal connections, arrived
        connections += 1
        try:
            while True:
                await reader.readuntil(b"\r\n\r\n")
                await reader.readexactly(1)  # the one-byte body
                arrived += 1
                if arrived % burst == 0:
                    all_in.set()
                await all_in.wait()  # every request of the burst is in flight at once
                writer.write(OK)
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    cfg = parse_config(
        json.dumps(
            {
                "pools": {
                    "p": {
                        "instances": [
                            {
                                "name": "a",
                                "url": f"http://127.0.0.1:{port}/v1",
                                "model": "m",
                                "max_concurrency": 400,
                            }
                        ]
                    }
                },
                "models": {"m": {"pool": "p"}},
            }
        ),
        env={},
    )
    up = Upstream(cfg.pools["p"].instances[0], cfg.timeouts)
    client = up.client
    client.reuse_quiet_s = 0  # this test is about the bound, not the rest after a response

    async def one() -> int:
        resp = await client.request(client.head("POST", "/v1/x", ""), b"x")
        await resp.read()
        resp.release()
        return resp.status

    try:
        for round_ in range(2):
            all_in.clear()
            assert await asyncio.gather(*(one() for _ in range(burst))) == [200] * burst
            # + 1: the connection opened ahead while the requests overlapped (preconnect)
            assert client.idle_connections == burst + 1, round_
        # The second burst ran on the first one's connections (256 of them before).
        assert connections == burst + 1
    finally:
        all_in.set()
        await client.close()
        server.close()
