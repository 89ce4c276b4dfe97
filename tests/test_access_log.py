"""The access log as operators run it (SPEC §9): one line per request, built from typed fields,
written off the event loop by a bounded writer — a stderr nobody reads never stalls requests,
and lines the writer cannot keep up with are counted, not queued without limit."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import sys
import textwrap
from pathlib import Path

import aiohttp
import orjson
import pytest

from gateway.events import RequestFinished
from gateway.logs import ACCESS_FIELDS, AccessLog, Sink
from gateway.sim.mock import MockServer
from support import free_port

GATEWAY = [sys.executable, "-m", "gateway.cli"]
CLIENT_KEY = "sk-client-canary-31d2a9"
UPSTREAM_KEY = "sk-upstream-canary-77a0e4"


def _config(tmp_path: Path, url: str, port: int) -> Path:
    path = tmp_path / "gateway.yaml"
    path.write_text(
        textwrap.dedent(
            f"""\
            listen: {{host: 127.0.0.1, port: {port}}}
            health: {{probe: {{enabled: false}}}}
            shutdown: {{drain_timeout_ms: 3000, drain_delay_ms: 0}}
            auth:
              keys: [{{key: "{CLIENT_KEY}", name: tenant-a}}]
            pools:
              p:
                instances:
                  - {{name: a, url: "{url}", model: M, max_concurrency: 64,
                      api_key: "{UPSTREAM_KEY}"}}
            models:
              m: {{pool: p}}
            """
        )
    )
    return path


async def _serve(tmp_path: Path, url: str, fmt: str) -> tuple[asyncio.subprocess.Process, str]:
    port = free_port()
    proc = await asyncio.create_subprocess_exec(
        *GATEWAY,
        "--log-format",
        fmt,
        "serve",
        "--config",
        str(_config(tmp_path, url, port)),
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )
    for _ in range(200):
        assert proc.returncode is None, "gateway exited early"
        try:
            _, w = await asyncio.open_connection("127.0.0.1", port)
            w.close()
            return proc, f"http://127.0.0.1:{port}"
        except OSError:
            await asyncio.sleep(0.05)
    raise AssertionError("gateway never listened")


async def _stop(proc: asyncio.subprocess.Process) -> str:
    if proc.returncode is None:
        proc.terminate()
    _, err = await asyncio.wait_for(proc.communicate(), 20)
    return err.decode()


def test_the_access_fields_are_the_event_fields() -> None:
    names = [f.name for f in dataclasses.fields(RequestFinished) if f.name != "at"]
    assert names == list(ACCESS_FIELDS)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("fmt", ["json", "text"])
async def test_a_stderr_nobody_reads_never_stalls_requests(tmp_path: Path, fmt: str) -> None:
    """The gateway's stderr is a pipe nobody reads while 1,200 requests (300-400 KB of access
    lines, a pipe holds 64 KiB) are served: every one is answered promptly (the lines wait in
    the writer thread's bounded queue, not on the event loop), then every line arrives whole,
    with the key's name and token counts, and neither key anywhere."""
    mock = MockServer()
    await mock.start()
    proc, url = await _serve(tmp_path, mock.url, fmt)
    try:
        headers = {"Authorization": f"Bearer {CLIENT_KEY}", "X-Request-Id": CLIENT_KEY}
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
        async with aiohttp.ClientSession() as s:

            async def worker(n: int) -> list[int]:
                out = []
                for _ in range(n):
                    async with s.post(
                        url + "/v1/chat/completions", json=body, headers=headers
                    ) as r:
                        await r.read()
                        out.append(r.status)
                return out

            statuses = await asyncio.wait_for(asyncio.gather(*(worker(40) for _ in range(30))), 60)
        assert all(st == 200 for batch in statuses for st in batch)
    finally:
        log = await _stop(proc)
        await mock.stop()
    assert CLIENT_KEY not in log and UPSTREAM_KEY not in log
    lines = [ln for ln in log.splitlines() if "gateway.access" in ln]
    assert len(lines) == 1200
    assert sum(len(ln) + 1 for ln in lines) > 4 * 65536  # several pipes' worth
    if fmt == "json":
        for ln in lines:
            rec = orjson.loads(ln)
            assert rec["status"] == 200 and rec["key"] == "tenant-a", rec
            assert rec["prompt_tokens"] > 0 and rec["completion_tokens"] > 0, rec
            assert rec["id"] == "[redacted]", rec  # the client's id was a key
    else:
        for ln in lines:
            assert " status=200 " in ln and " key=tenant-a " in ln, ln
            assert "prompt_tokens=" in ln and "completion_tokens=" in ln, ln


async def test_a_sink_that_cannot_keep_up_drops_and_counts() -> None:
    """SPEC §16: bounded. A pipe nobody reads and 512 KiB allowed behind: lines beyond that are
    dropped and counted at once (the loop never waits); what was kept arrives whole."""
    r, w = os.pipe()
    try:
        sink = Sink(w, max_pending=512 << 10)
        access = AccessLog(sink, "json")
        values = (
            "id-1",
            "p",
            "a",
            "high",
            None,
            None,
            0.1,
            1.0,
            200,
            1,
            None,
            1.5,
            "http",
            "k",
            3,
            4,
            None,
            None,
            None,
        )
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        for _ in range(20_000):  # ~4 MB of lines
            access.write(values)
            if _ % 1000 == 0:
                await asyncio.sleep(0)
        sink.flush()
        assert loop.time() - t0 < 2.0
        assert sink.dropped > 10_000
        kept = b""
        os.set_blocking(r, False)
        deadline = loop.time() + 10
        while loop.time() < deadline:
            try:
                kept += os.read(r, 1 << 16)
            except BlockingIOError:
                if sink._pending == 0:  # all written, and all of it read
                    break
                await asyncio.sleep(0.01)
        sink.close()
        written = kept.splitlines()
        assert written and all(orjson.loads(x)["id"] == "id-1" for x in written)
        assert len(written) + sink.dropped == 20_000
    finally:
        os.close(r)
        os.close(w)
