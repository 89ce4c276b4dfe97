"""Test helpers for upstream TLS and egress proxies: a raw HTTP(S) upstream and a CONNECT proxy,
both asyncio servers on 127.0.0.1 that count what they see (no mocks of the gateway's code)."""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import trustme

JSON_BODY = b'{"object": "chat.completion", "choices": [{"message": {"content": "over tls"}}]}'
SSE_EVENTS = [b'data: {"choices": [{"delta": {"content": "s"}}]}\n\n', b"data: [DONE]\n\n"]


def write_ca(ca: trustme.CA, directory: Path) -> str:
    """The CA's certificate as a PEM file (what an instance's `tls.ca_file` names)."""
    path = directory / "ca.pem"
    ca.cert_pem.write_to_path(str(path))
    return str(path)


async def _read_request(reader: asyncio.StreamReader) -> tuple[bytes, bytes]:
    head = await reader.readuntil(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":")[1])
    return head, await reader.readexactly(length)


@dataclass
class Upstream:
    """An OpenAI-like upstream: `POST` answers JSON, or SSE (chunked) when the body asks for
    `"stream": true`; `GET` answers a model list. Over TLS when given a server context, whose
    SNI callback records the name each handshake carried."""

    ctx: ssl.SSLContext | None = None
    port: int = 0
    connections: int = 0
    requests: list[bytes] = field(default_factory=list)
    sni: list[str | None] = field(default_factory=list)
    server: asyncio.Server | None = None
    writers: list[asyncio.StreamWriter] = field(default_factory=list)

    @property
    def url(self) -> str:
        scheme = "https" if self.ctx is not None else "http"
        return f"{scheme}://127.0.0.1:{self.port}/v1"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self.writers.append(writer)
        with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError, ssl.SSLError):
            while True:
                head, body = await _read_request(reader)
                self.requests.append(head + body)
                if head.startswith(b"GET"):
                    out = b'{"object": "list", "data": []}'
                    writer.write(
                        b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(out), out)
                    )
                elif b'"stream": true' in body or b'"stream":true' in body:
                    writer.write(
                        b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                        b"Transfer-Encoding: chunked\r\n\r\n"
                    )
                    for event in SSE_EVENTS:
                        writer.write(b"%x\r\n%s\r\n" % (len(event), event))
                        await writer.drain()
                    writer.write(b"0\r\n\r\n")
                else:
                    writer.write(
                        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                        b"Content-Length: %d\r\n\r\n%s" % (len(JSON_BODY), JSON_BODY)
                    )
                await writer.drain()
        writer.close()

    async def start(self) -> Upstream:
        if self.ctx is not None:

            def on_sni(obj: ssl.SSLObject, name: str | None, ctx: ssl.SSLContext) -> None:
                self.sni.append(name)

            self.ctx.sni_callback = on_sni
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0, ssl=self.ctx)
        self.port = self.server.sockets[0].getsockname()[1]
        return self

    async def stop(self) -> None:
        assert self.server is not None
        self.server.close()
        for writer in self.writers:
            writer.transport.abort()
        await self.server.wait_closed()
        await asyncio.sleep(0.01)


def server_context(ca: trustme.CA, *names: str) -> ssl.SSLContext:
    """A server context with a certificate from `ca` for `names`."""
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert(*names).configure_cert(ctx)
    return ctx


@dataclass
class ConnectProxy:
    """A small HTTP CONNECT proxy: records each CONNECT target and Proxy-Authorization, then
    pipes bytes both ways. `answer`, when set, is sent instead of a 200 (and nothing is
    tunnelled): a refusal, a malformed answer, or a 200 followed by stray bytes."""

    answer: bytes | None = None
    delay: float = 0.0
    port: int = 0
    targets: list[str] = field(default_factory=list)
    auth: list[str | None] = field(default_factory=list)
    server: asyncio.Server | None = None
    tasks: list[asyncio.StreamWriter] = field(default_factory=list)

    def url(self, credentials: str = "") -> str:
        return f"http://{credentials}127.0.0.1:{self.port}"

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.tasks.append(writer)
        with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError, OSError):
            head = await reader.readuntil(b"\r\n\r\n")
            lines = head.decode("latin-1").split("\r\n")
            method, target, _ = lines[0].split(" ", 2)
            auth = None
            for line in lines[1:]:
                name, _, value = line.partition(":")
                if name.lower() == "proxy-authorization":
                    auth = value.strip()
            self.targets.append(f"{method} {target}")
            self.auth.append(auth)
            await asyncio.sleep(self.delay)
            if self.answer is not None or method != "CONNECT":
                writer.write(self.answer or b"HTTP/1.1 405 Method Not Allowed\r\n\r\n")
                await writer.drain()
                await asyncio.sleep(0.05)
                return
            host, port = target.rsplit(":", 1)
            up_reader, up_writer = await asyncio.open_connection(host.strip("[]"), int(port))
            self.tasks.append(up_writer)
            writer.write(b"HTTP/1.1 200 Connection established\r\n\r\n")
            await writer.drain()
            await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))
        writer.close()

    async def start(self) -> ConnectProxy:
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]
        return self

    async def stop(self) -> None:
        assert self.server is not None
        self.server.close()
        for writer in self.tasks:
            writer.transport.abort()
        await self.server.wait_closed()
        await asyncio.sleep(0.01)


async def _pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
    try:
        while data := await src.read(65536):
            dst.write(data)
            await dst.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        dst.close()


@contextlib.asynccontextmanager
async def running(*servers: Upstream | ConnectProxy) -> AsyncIterator[None]:
    for server in servers:
        await server.start()
    try:
        yield
    finally:
        for server in servers:
            await server.stop()
