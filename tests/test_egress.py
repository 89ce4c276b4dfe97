"""SPEC §6 egress, for real: TLS to upstreams (a CA made by the test with trustme) and egress
proxies (a small HTTP CONNECT proxy written here), through the real gateway and the official
openai client.

- `https` instances verify the certificate: against the instance's `tls.ca_file`, with
  `tls.server_name` as the name checked and sent as SNI; an unknown CA or a wrong name is a
  connect failure of that instance (retried elsewhere, ejected), never a 500.
- Keep-alive reuse works over TLS and through a tunnel.
- `HTTPS_PROXY` / `HTTP_PROXY` / `NO_PROXY` are honoured as curl and httpx do, and an
  instance's `proxy:` wins; proxy credentials go as `Proxy-Authorization: Basic`; a proxy that
  refuses is a connect failure whose error never quotes the proxy's password.
"""

from __future__ import annotations

import asyncio
import base64
import ssl
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import openai
import orjson
import pytest
import trustme
from aiohttp import web

from support import GatewayFactory, MockFactory, RunningGateway, chat, pool_config


@pytest.fixture(scope="module")
def ca() -> trustme.CA:
    return trustme.CA()


@dataclass
class TlsUpstream:
    """An HTTPS OpenAI-compatible upstream: records connections and SNI names."""

    port: int
    # One entry per TLS handshake (the SNI name the client sent, None for none).
    sni: list[str | None] = field(default_factory=list)
    requests: int = 0

    @property
    def url(self) -> str:
        return f"https://127.0.0.1:{self.port}/v1"


def _completion(text: str) -> bytes:
    return orjson.dumps(
        {
            "id": "chatcmpl-tls",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": "up-model",
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": text},
                    "finish_reason": "stop",
                }
            ],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
        }
    )


@pytest.fixture
async def tls_upstream(ca: trustme.CA) -> AsyncIterator[TlsUpstream]:
    """HTTPS on 127.0.0.1 with a certificate for `localhost` and `127.0.0.1`."""
    cert = ca.issue_cert("localhost", "127.0.0.1")
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    cert.configure_cert(ctx)
    state = TlsUpstream(0)

    def on_sni(sock: ssl.SSLObject, name: str | None, _ctx: ssl.SSLContext) -> None:
        state.sni.append(name)

    ctx.sni_callback = on_sni  # type: ignore[assignment]

    async def handle(request: web.BaseRequest) -> web.StreamResponse:
        state.requests += 1
        body = await request.json() if request.method == "POST" else {}
        if request.method == "GET":
            return web.json_response({"object": "list", "data": []})
        if body.get("stream"):
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            chunk = {"object": "chat.completion.chunk", "choices": [{"delta": {"content": "s"}}]}
            await resp.write(b"data: " + orjson.dumps(chunk) + b"\n\n")
            await resp.write(b"data: [DONE]\n\n")
            return resp
        return web.Response(body=_completion("over tls"), content_type="application/json")

    server = web.Server(handle)
    runner = web.ServerRunner(server)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=ctx)
    await site.start()
    state.port = runner.addresses[0][1]
    yield state
    await runner.cleanup()


def _instance(name: str, url: str, **extra: Any) -> dict[str, Any]:
    return {"name": name, "url": url, "model": "up-model", "max_concurrency": 4, **extra}


def _config(*instances: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {
        "pools": {"p": {"instances": list(instances)}},
        "models": {"m": {"pool": "p"}},
        "health": {"failure_threshold": 1, "ejection_ms": 60_000},
        **extra,
    }


def _ca_file(ca: trustme.CA, tmp_path: Path) -> str:
    path = tmp_path / "ca.pem"
    ca.cert_pem.write_to_path(str(path))
    return str(path)


async def _ask(gw: RunningGateway, **kw: Any) -> tuple[int, dict[str, Any]]:
    async with await gw.post("/v1/chat/completions", chat(**kw)) as resp:
        text = await resp.text()
        if resp.content_type == "application/json":
            return resp.status, orjson.loads(text)
        return resp.status, {"text": text}


async def test_tls_verified_against_the_instances_ca_file_with_the_openai_client(
    ca: trustme.CA, tls_upstream: TlsUpstream, tmp_path: Path, gateway_factory: GatewayFactory
) -> None:
    tls = {"ca_file": _ca_file(ca, tmp_path)}
    gw = await gateway_factory(_config(_instance("tls", tls_upstream.url, tls=tls)))
    client = openai.AsyncOpenAI(base_url=gw.base_url, api_key="x", max_retries=0)
    done = await client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "hi"}]
    )
    assert done.choices[0].message.content == "over tls"
    stream = await client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "hi"}], stream=True
    )
    pieces = [c.choices[0].delta.content async for c in stream if c.choices]
    assert pieces == ["s"]
    await client.close()
    await gw.assert_quiet()


async def test_keep_alive_reuse_over_tls(
    ca: trustme.CA, tls_upstream: TlsUpstream, tmp_path: Path, gateway_factory: GatewayFactory
) -> None:
    tls = {"ca_file": _ca_file(ca, tmp_path)}
    gw = await gateway_factory(_config(_instance("tls", tls_upstream.url, tls=tls)))
    for _ in range(6):
        assert (await _ask(gw))[0] == 200
    # one TLS handshake served all six requests
    assert len(tls_upstream.sni) == 1
    assert tls_upstream.requests == 6
    await gw.assert_quiet()


async def test_server_name_is_checked_and_sent_as_sni(
    ca: trustme.CA, tls_upstream: TlsUpstream, tmp_path: Path, gateway_factory: GatewayFactory
) -> None:
    tls = {"ca_file": _ca_file(ca, tmp_path), "server_name": "localhost"}
    gw = await gateway_factory(_config(_instance("tls", tls_upstream.url, tls=tls)))
    assert (await _ask(gw))[0] == 200
    assert tls_upstream.sni == ["localhost"]
    await gw.assert_quiet()


@pytest.mark.parametrize("how", ["unknown_ca", "wrong_name"])
async def test_a_tls_failure_is_the_instances_connect_failure_never_a_500(
    how: str,
    ca: trustme.CA,
    tls_upstream: TlsUpstream,
    tmp_path: Path,
    mocks: MockFactory,
    gateway_factory: GatewayFactory,
) -> None:
    if how == "unknown_ca":
        tls: dict[str, Any] | None = None  # the system store has never heard of the test CA
    else:
        tls = {"ca_file": _ca_file(ca, tmp_path), "server_name": "not-the-cert.example"}
    bad = _instance("tls-bad", tls_upstream.url, **({"tls": tls} if tls else {}))
    good = await mocks()
    gw = await gateway_factory(_config(bad, pool_config(good)["instances"][0]))
    for _ in range(4):
        status, body = await _ask(gw)
        assert status == 200, body  # retried on the good instance
    state = (await gw.state())["pools"]["p"]["instances"]
    tls_state = next(i for i in state if i["name"] == "tls-bad")
    assert tls_state["state"] == "ejected"
    assert "connect" in (tls_state["last_error"] or "")
    assert tls_upstream.requests == 0  # no request ever reached it unverified
    # Alone, the instance answers 502/503, OpenAI-shaped, never 500.
    gw2 = await gateway_factory(_config(bad))
    status, body = await _ask(gw2)
    assert status in (502, 503), body
    assert set(body["error"]) == {"message", "type", "param", "code"}
    await gw.assert_quiet()
    await gw2.assert_quiet()


# ---- egress proxies ---------------------------------------------------------------------


@dataclass
class ConnectProxy:
    """A small HTTP CONNECT proxy: records targets and credentials, pipes bytes both ways,
    or refuses every CONNECT with 403."""

    refuse: bool = False
    port: int = 0
    targets: list[str] = field(default_factory=list)
    auth: list[str | None] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            lines = head.decode("latin-1").split("\r\n")
            method, target, _ = lines[0].split(" ", 2)
            auth = next(
                (
                    line.split(":", 1)[1].strip()
                    for line in lines[1:]
                    if line.lower().startswith("proxy-authorization:")
                ),
                None,
            )
            self.targets.append(f"{method} {target}")
            self.auth.append(auth)
            if method != "CONNECT" or self.refuse:
                writer.write(b"HTTP/1.1 403 Forbidden\r\nContent-Length: 0\r\n\r\n")
                await writer.drain()
                return
            host, port = target.rsplit(":", 1)
            up_reader, up_writer = await asyncio.open_connection(host, int(port))
            writer.write(b"HTTP/1.1 200 Connection established\r\n\r\n")
            await writer.drain()

            async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
                try:
                    while data := await src.read(65536):
                        dst.write(data)
                        await dst.drain()
                except (ConnectionError, OSError):
                    pass
                finally:
                    dst.close()

            await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))
        except (asyncio.IncompleteReadError, ConnectionError, OSError):
            pass
        finally:
            writer.close()


@pytest.fixture
async def proxy_factory() -> AsyncIterator[Any]:
    servers: list[asyncio.Server] = []

    async def start(refuse: bool = False) -> ConnectProxy:
        proxy = ConnectProxy(refuse=refuse)
        server = await asyncio.start_server(proxy.handle, "127.0.0.1", 0)
        proxy.port = server.sockets[0].getsockname()[1]
        servers.append(server)
        return proxy

    yield start
    for server in servers:
        server.close()
        await server.wait_closed()


async def test_an_instances_proxy_tunnels_https_with_basic_credentials(
    ca: trustme.CA,
    tls_upstream: TlsUpstream,
    tmp_path: Path,
    proxy_factory: Any,
    gateway_factory: GatewayFactory,
) -> None:
    proxy = await proxy_factory()
    url = proxy.url.replace("http://", "http://user:s3cret-proxy-pw@")
    tls = {"ca_file": _ca_file(ca, tmp_path)}
    gw = await gateway_factory(_config(_instance("via", tls_upstream.url, tls=tls, proxy=url)))
    for _ in range(3):
        assert (await _ask(gw))[0] == 200
    assert proxy.targets == [f"CONNECT 127.0.0.1:{tls_upstream.port}"]  # one tunnel, reused
    expected = "Basic " + base64.b64encode(b"user:s3cret-proxy-pw").decode()
    assert proxy.auth == [expected]
    await gw.assert_quiet()


async def test_an_instances_proxy_for_a_plain_http_upstream(
    proxy_factory: Any, mocks: MockFactory, gateway_factory: GatewayFactory
) -> None:
    proxy = await proxy_factory()
    m = await mocks()
    inst = {**pool_config(m)["instances"][0], "proxy": proxy.url}
    gw = await gateway_factory(_config(inst))
    assert (await _ask(gw))[0] == 200
    assert proxy.targets == [f"CONNECT 127.0.0.1:{m.port}"]
    await gw.assert_quiet()


async def test_https_proxy_from_the_environment_and_no_proxy(
    ca: trustme.CA,
    tls_upstream: TlsUpstream,
    tmp_path: Path,
    proxy_factory: Any,
    gateway_factory: GatewayFactory,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    proxy = await proxy_factory()
    tls = {"ca_file": _ca_file(ca, tmp_path)}
    monkeypatch.setenv("HTTPS_PROXY", proxy.url)
    monkeypatch.delenv("NO_PROXY", raising=False)
    monkeypatch.delenv("no_proxy", raising=False)
    gw = await gateway_factory(_config(_instance("env", tls_upstream.url, tls=tls)))
    assert (await _ask(gw))[0] == 200
    assert proxy.targets == [f"CONNECT 127.0.0.1:{tls_upstream.port}"]
    # NO_PROXY names the host: the proxy sees nothing more
    monkeypatch.setenv("NO_PROXY", "localhost,127.0.0.1")
    gw2 = await gateway_factory(_config(_instance("direct", tls_upstream.url, tls=tls)))
    assert (await _ask(gw2))[0] == 200
    assert len(proxy.targets) == 1
    await gw.assert_quiet()
    await gw2.assert_quiet()


async def test_a_refusing_proxy_is_a_connect_failure_that_never_quotes_its_password(
    proxy_factory: Any, mocks: MockFactory, gateway_factory: GatewayFactory
) -> None:
    proxy = await proxy_factory(refuse=True)
    m = await mocks()
    url = proxy.url.replace("http://", "http://user:s3cret-proxy-pw@")
    inst = {**pool_config(m)["instances"][0], "proxy": url}
    gw = await gateway_factory(_config(inst))
    async with await gw.post("/v1/chat/completions", chat()) as resp:
        text = await resp.text()
        assert resp.status in (502, 503), text
        assert "s3cret-proxy-pw" not in text
    state = await gw.state()
    assert "s3cret-proxy-pw" not in orjson.dumps(state).decode()
    assert m.stats.requests_total == 0
    await gw.assert_quiet()
