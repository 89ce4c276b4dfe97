"""Bad input gets a clear OpenAI-shaped error, and nothing reaches the upstream (SPEC §7)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from gateway.sim.mock import MockServer
from support import GatewayFactory, MockFactory, RunningGateway, chat, pool_config, simple_config


async def _raw(
    gw: RunningGateway,
    body: bytes,
    headers: dict[str, str] | None = None,
    path: str = "/v1/chat/completions",
) -> tuple[int, dict[str, Any]]:
    hdrs = {"Content-Type": "application/json", **(headers or {})}
    async with gw.session.post(gw.url + path, data=body, headers=hdrs) as resp:
        return resp.status, await resp.json()


@pytest.fixture
async def setup(
    mocks: MockFactory, gateway_factory: GatewayFactory
) -> tuple[RunningGateway, MockServer]:
    m = await mocks()
    gw = await gateway_factory(simple_config(pool_config(m), max_body_bytes=4096))
    return gw, m


def _assert_error(status: int, body: dict[str, Any], want_status: int, code: str) -> None:
    assert status == want_status, body
    err = body["error"]
    assert err["code"] == code
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (b"{not json", None),
        (b"", None),
        (b"[1, 2]", None),
        (b'"text"', None),
        (b'{"messages": [{"role": "user", "content": "x"}]}', None),  # no model
        (b'{"model": "m"}', None),  # no messages
        (b'{"model": "m", "messages": []}', "messages"),
        (b'{"model": "m", "messages": "hi"}', "messages"),
        (b'{"model": 7, "messages": [{"role": "user", "content": "x"}]}', "model"),
        (b'{"model": "m", "messages": [{"role": "wizard", "content": "x"}]}', "messages[0].role"),
        (b'{"model": "m", "messages": [{"content": "x"}]}', None),
        (
            b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "stream": "yes"}',
            "stream",
        ),
        (
            b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": 0}',
            "max_tokens",
        ),
        (
            b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "temperature": 9}',
            "temperature",
        ),
        (b'{"model": "m", "messages": [{"role": "user", "content": "\\u0000"}]}', None),
        (b'{"model": "m", "messages": [{"role": "user", "content": "\\ud800"}]}', None),
        (b'{"model": "m", "messages": [{"role": "user", "content": "\xff\xfe"}]}', None),
        (b'{"model": "m\\r\\nX-Evil: 1", "messages": [{"role": "user", "content": "x"}]}', "model"),
    ],
)
async def test_malformed_requests_are_400(
    setup: tuple[RunningGateway, MockServer], body: bytes, param: str | None
) -> None:
    gw, m = setup
    status, data = await _raw(gw, body)
    _assert_error(status, data, 400, "invalid_request")
    if param is not None:
        assert data["error"]["param"] == param
    assert m.stats.requests_total == 0
    await gw.assert_quiet()


async def test_unicode_prompts_pass_through(setup: tuple[RunningGateway, MockServer]) -> None:
    gw, m = setup
    text = "这段代码的最坏情况时间复杂度是多少？ 🚀 \\u0000 as text"
    async with await gw.post("/v1/chat/completions", chat(text)) as resp:
        assert resp.status == 200
    assert m.requests[-1]["body"]["messages"][0]["content"] == text


async def test_wrong_content_type(setup: tuple[RunningGateway, MockServer]) -> None:
    gw, m = setup
    status, data = await _raw(gw, b'{"model": "m"}', {"Content-Type": "text/plain"})
    _assert_error(status, data, 400, "invalid_request")
    assert "Content-Type" in data["error"]["message"]
    assert m.stats.requests_total == 0


async def test_body_over_the_limit_is_413(setup: tuple[RunningGateway, MockServer]) -> None:
    gw, m = setup
    big = chat("x" * 10_000)
    async with await gw.post("/v1/chat/completions", big) as resp:
        _assert_error(resp.status, await resp.json(), 413, "request_too_large")

    async def chunks() -> Any:  # no Content-Length: the limit holds while reading
        for _ in range(10):
            yield b"x" * 1000

    async with gw.session.post(
        gw.url + "/v1/chat/completions", data=chunks(), headers={"Content-Type": "application/json"}
    ) as resp:
        _assert_error(resp.status, await resp.json(), 413, "request_too_large")
    assert m.stats.requests_total == 0


@pytest.mark.parametrize(
    ("headers", "param"),
    [({"X-Priority": "urgent"}, "X-Priority"), ({"X-Complexity": "medium"}, "X-Complexity")],
)
async def test_bad_header_values(
    setup: tuple[RunningGateway, MockServer], headers: dict[str, str], param: str
) -> None:
    gw, m = setup
    async with await gw.post("/v1/chat/completions", chat(), headers=headers) as resp:
        data = await resp.json()
    _assert_error(resp.status, data, 400, "invalid_request")
    assert data["error"]["param"] == param
    assert m.stats.requests_total == 0


async def test_priority_sources(setup: tuple[RunningGateway, MockServer]) -> None:
    gw, _ = setup
    cases = [
        ({"X-Priority": "batch"}, {}, "low"),
        ({"X-Priority": "realtime"}, {"service_tier": "flex"}, "high"),
        ({}, {"service_tier": "flex"}, "low"),
        ({}, {"service_tier": "priority"}, "high"),
        ({}, {}, "high"),  # default_priority
    ]
    for headers, extra, want in cases:
        async with await gw.post("/v1/chat/completions", chat(**extra), headers=headers) as resp:
            assert resp.status == 200
            assert resp.headers["X-Gateway-Priority"] == want, (headers, extra)


async def test_unknown_route_and_method(setup: tuple[RunningGateway, MockServer]) -> None:
    gw, _ = setup
    async with gw.session.get(gw.url + "/v1/nope") as resp:
        _assert_error(resp.status, await resp.json(), 404, "not_found")
    async with gw.session.get(gw.url + "/v1/chat/completions") as resp:
        _assert_error(resp.status, await resp.json(), 405, "method_not_allowed")


async def test_probes_endpoints(setup: tuple[RunningGateway, MockServer]) -> None:
    gw, _ = setup
    for path in ("/livez", "/healthz", "/readyz"):
        async with gw.session.get(gw.url + path) as resp:
            assert resp.status == 200, path


async def test_slow_headers_are_cut(mocks: MockFactory, gateway_factory: GatewayFactory) -> None:
    m = await mocks()
    gw = await gateway_factory(simple_config(pool_config(m), limits={"header_timeout_ms": 300}))
    host, port = gw.url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    t0 = time.monotonic()
    writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")
    await writer.drain()
    # a slowloris trickles one header line at a time and never finishes
    closed = False
    for _ in range(20):
        await asyncio.sleep(0.1)
        if reader.at_eof():
            closed = True
            break
        try:
            writer.write(b"X-Slow: 1\r\n")
            await writer.drain()
        except ConnectionError:
            closed = True
            break
    if not closed:
        data = await asyncio.wait_for(reader.read(), 1.0)
        closed = data == b""
    writer.close()
    assert closed and time.monotonic() - t0 < 1.5
    assert m.stats.requests_total == 0


async def test_slow_body_is_408(mocks: MockFactory, gateway_factory: GatewayFactory) -> None:
    m = await mocks()
    gw = await gateway_factory(simple_config(pool_config(m), limits={"body_timeout_ms": 300}))

    async def trickle() -> Any:
        yield b'{"model": "m", '
        await asyncio.sleep(1.0)
        yield b'"messages": []}'

    async with gw.session.post(
        gw.url + "/v1/chat/completions",
        data=trickle(),
        headers={"Content-Type": "application/json"},
    ) as resp:
        _assert_error(resp.status, await resp.json(), 408, "request_timeout")
    assert m.stats.requests_total == 0


async def test_api_keys(mocks: MockFactory, gateway_factory: GatewayFactory) -> None:
    m = await mocks()
    canary = "sk-canary-' OR 1=1 --"
    gw = await gateway_factory(
        simple_config(
            pool_config(m),
            auth={"keys": [{"key": canary, "name": "paid", "priority": "low"}]},
        )
    )
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic abc"}):
        async with await gw.post("/v1/chat/completions", chat(), headers=headers) as resp:
            text = await resp.text()
            assert resp.status == 401
            assert '"invalid_api_key"' in text and "wrong" not in text
    async with await gw.post(
        "/v1/chat/completions", chat(), headers={"Authorization": f"Bearer {canary}"}
    ) as resp:
        assert resp.status == 200
        assert resp.headers["X-Gateway-Priority"] == "low"  # the key's default
    assert canary not in str(m.requests)
