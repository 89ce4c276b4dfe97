"""How a relayed token stream reaches the client on the wire (issue 25: time to first chunk)."""

from __future__ import annotations

import asyncio
import json
import socket
import struct
import sys

import pytest

from support import GatewayFactory, MockFactory, pool_config, simple_config

# struct tcp_info (linux/tcp.h): tcpi_data_segs_in, the segments that carried data, at byte 152
# (Linux 4.6 and later).
_DATA_SEGS_IN = 152


def _data_segments_in(sock: socket.socket) -> int:
    info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 256)
    (segs,) = struct.unpack_from("I", info, _DATA_SEGS_IN)
    return int(segs)


@pytest.mark.skipif(sys.platform != "linux", reason="TCP_INFO's layout is Linux's")
async def test_the_head_and_the_first_token_arrive_in_one_segment(
    mocks: MockFactory, gateway_factory: GatewayFactory
) -> None:
    # The next token comes 250 ms after the first: whatever reached the client until then is
    # what the gateway wrote for the first one.
    m = await mocks(tokens_per_s=4, default_tokens=3)
    gw = await gateway_factory(simple_config(pool_config(m)))
    body = json.dumps(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    ).encode()
    port = int(gw.url.rsplit(":", 1)[1])
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\nAuthorization: Bearer k\r\n"
            b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%b" % (len(body), body)
        )
        got = b""
        async with asyncio.timeout(5):
            while b'"content":"' not in got.split(b"\r\n\r\n", 1)[-1]:
                piece = await reader.read(65536)
                assert piece, f"the connection closed: {got!r}"
                got += piece
        assert got.startswith(b"HTTP/1.1 200 "), got
        assert b"text/event-stream" in got
        # One write for the response head and the events up to the first token (the held role
        # chunk and the first content delta): one segment, one wake-up of the client, where
        # aiohttp's StreamResponse writes its head alone first.
        assert _data_segments_in(writer.get_extra_info("socket")) == 1
        async with asyncio.timeout(5):
            rest = await reader.readuntil(b"data: [DONE]\n\n")
        assert rest.count(b'"content":"') >= 2
    finally:
        writer.close()
    await gw.assert_quiet()
