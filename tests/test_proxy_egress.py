"""SPEC §6 egress proxies at the upstream client itself (the gateway-level checks are in
test_egress.py): which proxy a client picks (`proxy:` over `HTTPS_PROXY` / `HTTP_PROXY`, and
`NO_PROXY` as curl and httpx read it), the CONNECT tunnel with TLS inside it and keep-alive
through it, Basic credentials, and every proxy failure a `ConnectError` that never quotes them."""

from __future__ import annotations

import base64
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
import trustme

from gateway.http1 import Client, ConnectError, no_proxy_matches
from tlsutil import JSON_BODY, ConnectProxy, Upstream, running, server_context, write_ca

SECRET = "s3cret-proxy-pw"


@pytest.fixture(scope="module")
def ca() -> trustme.CA:
    return trustme.CA()


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("HTTPS_PROXY", "HTTP_PROXY", "NO_PROXY", "ALL_PROXY"):
        monkeypatch.delenv(name, raising=False)
        monkeypatch.delenv(name.lower(), raising=False)


@pytest.fixture
async def clients() -> AsyncIterator[Callable[..., Client]]:
    made: list[Client] = []

    def make(url: str, **kw: Any) -> Client:
        c = Client(url, connect_timeout=kw.pop("timeout", 5), **kw)
        made.append(c)
        return c

    yield make
    for c in made:
        await c.close()


async def _ask(c: Client) -> tuple[int, bytes]:
    resp = await c.request(c.head("POST", "/v1/chat/completions", ""), b"{}")
    data = await resp.read()
    resp.release()
    return resp.status, data


@pytest.mark.parametrize(
    ("host", "port", "no_proxy", "bypass"),
    [
        ("api.example.com", 443, "*", True),
        ("api.example.com", 443, "", False),
        ("api.example.com", 443, "example.com", True),  # a domain and its subdomains
        ("example.com", 443, "example.com", True),
        ("badexample.com", 443, "example.com", False),  # not a suffix at a dot
        ("api.example.com", 443, ".example.com", True),  # leading dot allowed
        ("example.com", 443, ".example.com", True),
        ("api.example.com", 443, "*.example.com", True),
        ("API.Example.COM", 443, " other.org , EXAMPLE.com ", True),  # spaces, case
        ("api.example.com", 443, "example.com:443", True),  # with a port
        ("api.example.com", 8443, "example.com:443", False),
        ("10.0.0.5", 8000, "10.0.0.5", True),  # IP addresses literally
        ("10.0.0.5", 8000, "10.0.0.50", False),
        ("10.0.0.5", 8000, "10.0.0.5:8000", True),
        ("10.0.0.5", 8000, "10.0.0.0/8", True),  # and by CIDR, as curl
        ("10.0.0.5", 8000, "example.com", False),
        ("::1", 443, "::1", True),
        ("::1", 443, "[::1]:443", True),
        ("::1", 8443, "[::1]:443", False),
        ("localhost", 80, "127.0.0.1", False),  # no name resolution
    ],
)
def test_no_proxy_matching(host: str, port: int, no_proxy: str, bypass: bool) -> None:
    assert no_proxy_matches(host, port, no_proxy) is bypass


def test_which_proxy_a_client_uses(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HTTPS_PROXY", "http://secure-proxy:3128")
    monkeypatch.setenv("HTTP_PROXY", "plain-proxy:8080")  # no scheme: http, as curl reads it
    secure = Client("https://api.example.com/v1", 1)
    plain = Client("http://10.0.0.5:8000/v1", 1)
    assert secure.proxy_address == ("secure-proxy", 3128)
    assert plain.proxy_address == ("plain-proxy", 8080)
    assert not Client("https://api.example.com/v1", 1, trust_env=False).proxied
    monkeypatch.setenv("https_proxy", "http://lower:1")  # the lower-case spelling wins
    assert Client("https://x.example/v1", 1).proxy_address == ("lower", 1)
    monkeypatch.setenv("NO_PROXY", "example.com")
    assert not Client("https://api.example.com/v1", 1).proxied
    # an instance's explicit proxy wins over the environment and over NO_PROXY
    explicit = Client("https://api.example.com/v1", 1, proxy="http://mine:3128")
    assert explicit.proxy_address == ("mine", 3128)


async def test_https_through_the_tunnel_reuses_it_and_sends_basic_credentials(
    ca: trustme.CA, tmp_path: Path, clients: Callable[..., Client]
) -> None:
    up = Upstream(server_context(ca, "localhost", "127.0.0.1"))
    proxy = ConnectProxy()
    async with running(up, proxy):
        c = clients(
            up.url, ca_file=write_ca(ca, tmp_path), proxy=proxy.url(f"us%40er:{SECRET}%3Ax@")
        )
        for _ in range(3):
            assert await _ask(c) == (200, JSON_BODY)
        assert proxy.targets == [f"CONNECT 127.0.0.1:{up.port}"]  # one tunnel, reused
        token = base64.b64encode(f"us@er:{SECRET}:x".encode()).decode()
        assert proxy.auth == [f"Basic {token}"]
        assert up.connections == 1 and len(up.sni) == 1  # TLS end to end, inside the tunnel


async def test_http_proxy_from_the_environment_for_a_plain_upstream(
    clients: Callable[..., Client], monkeypatch: pytest.MonkeyPatch
) -> None:
    up = Upstream()
    proxy = ConnectProxy()
    async with running(up, proxy):
        monkeypatch.setenv("HTTP_PROXY", proxy.url())
        monkeypatch.setenv("HTTPS_PROXY", "http://127.0.0.1:9")  # for https only: unused
        c = clients(up.url)
        monkeypatch.delenv("HTTP_PROXY")  # read when the client was made, not later
        assert await _ask(c) == (200, JSON_BODY)
        assert await _ask(c) == (200, JSON_BODY)
        assert proxy.targets == [f"CONNECT 127.0.0.1:{up.port}"]
        assert proxy.auth == [None]
        assert up.requests[0].startswith(b"POST /v1/chat/completions HTTP/1.1\r\n")


async def test_no_proxy_bypasses_the_proxy(
    clients: Callable[..., Client], monkeypatch: pytest.MonkeyPatch
) -> None:
    up = Upstream()
    proxy = ConnectProxy()
    async with running(up, proxy):
        monkeypatch.setenv("HTTP_PROXY", proxy.url())
        monkeypatch.setenv("no_proxy", f"example.com, 127.0.0.1:{up.port}")
        assert await _ask(clients(up.url)) == (200, JSON_BODY)
        assert proxy.targets == []


@pytest.mark.parametrize(
    ("answer", "why"),
    [
        (b"HTTP/1.1 403 Forbidden\r\nContent-Length: 0\r\n\r\n", "HTTP 403"),
        (b"HTTP/1.1 407 Proxy Authentication Required\r\n\r\n", "authentication"),
        (b"SSH-2.0-OpenSSH\r\n\r\n", "malformed"),
        (b"HTTP/1.1 200 OK\r\n\r\nHTTP/1.1 200 OK\r\n\r\n", "bytes"),
    ],
)
async def test_a_proxy_that_does_not_tunnel_is_a_connect_error_without_its_password(
    clients: Callable[..., Client], answer: bytes, why: str
) -> None:
    up = Upstream()
    proxy = ConnectProxy(answer=answer)
    async with running(up, proxy):
        c = clients(up.url, proxy=proxy.url(f"user:{SECRET}@"))
        with pytest.raises(ConnectError, match=why) as err:
            await _ask(c)
        assert SECRET not in str(err.value) and "user" not in str(err.value)
        assert up.connections == 0


async def test_an_unreachable_or_unsupported_proxy_is_a_connect_error(
    clients: Callable[..., Client], monkeypatch: pytest.MonkeyPatch
) -> None:
    c = clients("http://127.0.0.1:8000/v1", proxy=f"http://user:{SECRET}@127.0.0.1:9")
    with pytest.raises(ConnectError, match="egress proxy") as err:
        await _ask(c)
    assert SECRET not in str(err.value)
    monkeypatch.setenv("HTTPS_PROXY", f"socks5://user:{SECRET}@127.0.0.1:1080")
    c = clients("https://api.example.com/v1")
    with pytest.raises(ConnectError, match="HTTPS_PROXY must be an http") as err:
        await _ask(c)
    assert SECRET not in str(err.value)


async def test_a_slow_proxy_is_a_connect_timeout(clients: Callable[..., Client]) -> None:
    up = Upstream()
    proxy = ConnectProxy(delay=5)
    async with running(up, proxy):
        c = clients(up.url, proxy=proxy.url(), timeout=0.2)
        with pytest.raises(TimeoutError):
            await _ask(c)


async def test_tls_inside_the_tunnel_is_still_verified(
    ca: trustme.CA, clients: Callable[..., Client]
) -> None:
    up = Upstream(server_context(ca, "localhost", "127.0.0.1"))
    proxy = ConnectProxy()
    async with running(up, proxy):
        c = clients(up.url, proxy=proxy.url())  # the system store: the test CA is unknown
        with pytest.raises(ConnectError, match="certificate"):
            await _ask(c)
        assert proxy.targets == [f"CONNECT 127.0.0.1:{up.port}"] and not up.requests
