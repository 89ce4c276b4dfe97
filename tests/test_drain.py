"""SPEC §7 "SIGTERM drains the way load balancers and Kubernetes expect": a real `gateway serve`
and real signals. First `/readyz` turns 503 while the listener keeps accepting and serving for
`shutdown.drain_delay_ms`; then new connections stop and in-flight work finishes; a second
SIGTERM or SIGINT skips the delay (and a third ends the drain: the rest are answered 503)."""

from __future__ import annotations

import asyncio
import signal
import sys
import textwrap
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import aiohttp
import pytest

from gateway.config import parse_config
from gateway.server import Server
from gateway.sim.mock import MockServer
from support import MockFactory, eventually, free_port

GATEWAY = [sys.executable, "-m", "gateway.cli"]
BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
pytestmark = pytest.mark.timeout(60)


def _config(m: MockServer, port: int, delay_ms: int, timeout_ms: int = 25_000) -> str:
    return textwrap.dedent(
        f"""\
        listen: {{host: 127.0.0.1, port: {port}}}
        health: {{probe: {{enabled: false}}}}
        shutdown: {{drain_delay_ms: {delay_ms}, drain_timeout_ms: {timeout_ms}}}
        pools:
          p:
            instances:
              - {{name: a, url: "{m.url}", model: up, max_concurrency: 4}}
        models:
          m: {{pool: p}}
        """
    )


class Serving:
    """A `gateway serve` process and a client that opens a fresh connection per request."""

    def __init__(self, proc: asyncio.subprocess.Process, url: str, port: int) -> None:
        self.proc = proc
        self.url = url
        self.port = port
        self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True))

    async def chat(self) -> tuple[int, str, str | None]:
        """(status, body, Connection header) of one request on a new connection."""
        async with self.session.post(self.url + "/v1/chat/completions", json=BODY) as r:
            return r.status, await r.text(), r.headers.get("Connection")

    async def readyz(self) -> tuple[int, str]:
        async with self.session.get(self.url + "/readyz") as r:
            return r.status, await r.text()

    async def refuses(self) -> bool:
        """Whether a new TCP connection is refused."""
        try:
            _, w = await asyncio.open_connection("127.0.0.1", self.port)
        except OSError:
            return True
        w.close()
        return False


@asynccontextmanager
async def serving(tmp_path: Path, config: str, port: int) -> AsyncIterator[Serving]:
    path = tmp_path / "gateway.yaml"
    path.write_text(config)
    proc = await asyncio.create_subprocess_exec(
        *GATEWAY,
        "serve",
        "--config",
        str(path),
        "--no-access-log",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.DEVNULL,
    )
    assert proc.stdout is not None
    line = await asyncio.wait_for(proc.stdout.readline(), 30)
    assert b"listening on" in line, line
    s = Serving(proc, f"http://127.0.0.1:{port}", port)
    try:
        yield s
    finally:
        await s.session.close()
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def test_sigterm_keeps_serving_through_the_delay_then_drains(
    tmp_path: Path, mocks: MockFactory
) -> None:
    m = await mocks(latency_ms=3800, latency_dist="fixed")
    port = free_port()
    async with serving(tmp_path, _config(m, port, delay_ms=3000), port) as gw:
        # In flight at the signal, and still after the delay.
        slow = asyncio.create_task(gw.chat())
        await eventually(lambda: m.stats.in_flight == 1, what="the slow request started")
        m.configure(latency_ms=20)
        assert (await gw.readyz())[0] == 200
        t0 = time.monotonic()
        gw.proc.send_signal(signal.SIGTERM)

        # /readyz turns 503 at once ...
        async def unready() -> bool:
            return (await gw.readyz())[0] == 503

        await eventually(unready, within=0.5, what="/readyz 503")
        status, text = await gw.readyz()
        assert status == 503 and "draining" in text
        # ... while new connections are still accepted and served, told to reconnect.
        status, _, connection = await gw.chat()
        assert status == 200
        assert connection == "close"
        assert time.monotonic() - t0 < 2.5, "served during the delay"
        assert not await gw.refuses()
        # After the delay: new connections stop; the slow request is still being served.
        await eventually(gw.refuses, within=6, what="new connections refused")
        refused_at = time.monotonic() - t0
        assert 2.9 <= refused_at < 4.5, refused_at
        assert not slow.done()
        status, _, _ = await slow
        assert status == 200
        assert await asyncio.wait_for(gw.proc.wait(), 10) == 0
        exited_at = time.monotonic() - t0
        assert exited_at >= 3.5, "the process waited for the in-flight request"
    assert m.stats.in_flight == 0


async def test_a_second_signal_skips_the_delay_and_a_third_ends_the_drain(
    tmp_path: Path, mocks: MockFactory
) -> None:
    m = await mocks(latency_ms=20_000, latency_dist="fixed")
    port = free_port()
    async with serving(tmp_path, _config(m, port, delay_ms=30_000), port) as gw:
        slow = asyncio.create_task(gw.chat())
        await eventually(lambda: m.stats.in_flight == 1, what="the slow request started")
        m.configure(latency_ms=20)
        t0 = time.monotonic()
        gw.proc.send_signal(signal.SIGTERM)

        async def unready() -> bool:
            return (await gw.readyz())[0] == 503

        await eventually(unready, within=0.5, what="/readyz 503")
        assert (await gw.chat())[0] == 200  # the delay: still serving
        # A second signal (SIGINT, as Ctrl-C would) skips the 30 s delay.
        gw.proc.send_signal(signal.SIGINT)
        await eventually(gw.refuses, within=3, what="new connections refused")
        assert time.monotonic() - t0 < 5
        assert not slow.done() and gw.proc.returncode is None  # draining the slow one
        # A third ends the drain: the unfinished request gets an honest 503, and it exits.
        gw.proc.send_signal(signal.SIGTERM)
        status, text, _ = await asyncio.wait_for(slow, 5)
        assert status == 503 and '"draining"' in text
        assert await asyncio.wait_for(gw.proc.wait(), 10) == 0
        assert time.monotonic() - t0 < 10


async def test_an_in_process_shutdown_does_not_wait_for_the_delay(
    tmp_path: Path, mocks: MockFactory
) -> None:
    """The delay belongs to the signal: `Server.shutdown()` (tests, the demo, benches) drains
    at once unless asked for a delay."""
    m = await mocks(latency_ms=5)
    cfg = parse_config(_config(m, 0, delay_ms=5000), env={})
    server = Server(cfg, host="127.0.0.1", port=0)
    await server.start()
    async with (
        aiohttp.ClientSession() as s,
        s.post(server.url + "/v1/chat/completions", json=BODY) as r,
    ):
        assert r.status == 200
    t0 = time.monotonic()
    await server.shutdown()
    assert time.monotonic() - t0 < 2.0
