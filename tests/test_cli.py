"""The command line as an operator uses it: real processes, real signals."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import aiohttp
import pytest

from support import MockFactory, eventually

GATEWAY = [sys.executable, "-m", "gateway.cli"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _config(tmp_path: Path, url: str, port: int, extra: str = "") -> Path:
    path = tmp_path / "gateway.yaml"
    path.write_text(
        textwrap.dedent(
            f"""\
            listen: {{host: 127.0.0.1, port: {port}}}
            health: {{probe: {{enabled: false}}}}
            shutdown: {{drain_timeout_ms: 3000}}
            pools:
              light:
                instances:
                  - {{name: qwen-a, url: "{url}", model: Qwen2.5-7B, max_concurrency: 2,
                      api_key: "${{UPSTREAM_KEY}}"}}
            models:
              judge-lite: {{pool: light}}
            """
        )
        + extra
    )
    return path


def test_check_prints_the_routing_table_without_secrets(tmp_path: Path) -> None:
    path = _config(tmp_path, "http://127.0.0.1:9/v1", 8080)
    env = {**os.environ, "UPSTREAM_KEY": "sk-canary-0123456789"}
    out = subprocess.run([*GATEWAY, "check", str(path)], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr
    assert "judge-lite" in out.stdout and "qwen-a" in out.stdout and "light" in out.stdout
    assert "sk-canary" not in out.stdout + out.stderr


def test_check_names_the_field_of_an_invalid_config(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(
        "pools:\n  light:\n    instances:\n"
        "      - {name: a, url: 'http://x/v1', model: m, max_concurrency: 0}\n"
        "models:\n  m: {pool: light}\n"
    )
    out = subprocess.run([*GATEWAY, "check", str(path)], capture_output=True, text=True)
    assert out.returncode == 2
    assert "pools.light.instances[0].max_concurrency" in out.stderr


async def _wait_pool(url: str, in_flight: int, high: int, low: int = 0) -> None:
    """Until the `light` pool of the gateway at `url` shows exactly this load."""

    async def there() -> bool:
        async with aiohttp.ClientSession() as s, s.get(url + "/admin/state") as r:
            pool = (await r.json())["pools"]["light"]
        return bool(pool["in_flight"] == in_flight and pool["queued"] == {"high": high, "low": low})

    await eventually(there, what=f"{in_flight} in flight, {high}/{low} queued")


async def _wait_listening(port: int, proc: asyncio.subprocess.Process) -> None:
    for _ in range(200):
        assert proc.returncode is None, "gateway exited early"
        try:
            _, w = await asyncio.open_connection("127.0.0.1", port)
            w.close()
            return
        except OSError:
            await asyncio.sleep(0.05)
    raise AssertionError("gateway never listened")


@pytest.mark.timeout(60)
async def test_serve_then_sigterm_drains_in_flight_requests(
    tmp_path: Path, mocks: MockFactory
) -> None:
    m = await mocks(latency_ms=600)
    port = _free_port()
    path = _config(tmp_path, m.url, port)
    env = {**os.environ, "UPSTREAM_KEY": "sk-canary-0123456789"}
    proc = await asyncio.create_subprocess_exec(
        *GATEWAY,
        "--log-format",
        "json",
        "serve",
        "--config",
        str(path),
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        await _wait_listening(port, proc)
        url = f"http://127.0.0.1:{port}"
        body = {"model": "judge-lite", "messages": [{"role": "user", "content": "hi"}]}
        async with aiohttp.ClientSession() as s:

            async def one() -> int:
                async with s.post(url + "/v1/chat/completions", json=body) as r:
                    await r.read()
                    return r.status

            # 2 in flight, 2 queued behind them
            tasks = [asyncio.create_task(one()) for _ in range(4)]
            await _wait_pool(url, 2, 2)
            proc.send_signal(signal.SIGTERM)
            statuses = await asyncio.gather(*tasks)
        assert statuses == [200, 200, 200, 200]
        # new connections stop once draining
        with pytest.raises(OSError):
            await asyncio.open_connection("127.0.0.1", port)
        assert await asyncio.wait_for(proc.wait(), 10) == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    _, err = await proc.communicate()
    log = err.decode()
    assert '"status":200' in log  # one JSON access line per request
    assert "sk-canary" not in log


async def _models(url: str) -> list[str]:
    async with aiohttp.ClientSession() as s, s.get(url + "/v1/models") as r:
        return sorted(m["id"] for m in (await r.json())["data"])


async def _eventually_models(url: str, want: list[str]) -> None:
    for _ in range(100):
        if await _models(url) == want:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"models never became {want}: {await _models(url)}")


@pytest.mark.timeout(60)
async def test_watch_and_sighup_reload_the_config(tmp_path: Path, mocks: MockFactory) -> None:
    m = await mocks()
    port = _free_port()
    path = _config(tmp_path, m.url, port)
    env = {**os.environ, "UPSTREAM_KEY": "k"}
    proc = await asyncio.create_subprocess_exec(
        *GATEWAY,
        "serve",
        "--config",
        str(path),
        "--watch",
        env=env,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        await _wait_listening(port, proc)
        url = f"http://127.0.0.1:{port}"
        assert await _models(url) == ["judge-lite"]
        # --watch: a changed file is picked up within about a second
        path.write_text(path.read_text() + "  judge-2: {pool: light}\n")
        await _eventually_models(url, ["judge-2", "judge-lite"])
        # an invalid file is refused; the running config stays
        good = path.read_text()
        path.write_text(good.replace("max_concurrency: 2", "max_concurrency: -1"))

        async def refused() -> bool:
            async with aiohttp.ClientSession() as s, s.get(url + "/metrics") as r:
                return 'gateway_config_reloads_total{result="failure"} 1.0' in await r.text()

        await eventually(refused, what="the watcher's reload refused")
        assert await _models(url) == ["judge-2", "judge-lite"]
        # SIGHUP
        path.write_text(good + "  judge-3: {pool: light}\n")
        proc.send_signal(signal.SIGHUP)
        await _eventually_models(url, ["judge-2", "judge-3", "judge-lite"])
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 10) == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    _, err = await proc.communicate()
    assert "pools.light.instances[0].max_concurrency" in err.decode()


@pytest.mark.timeout(60)
async def test_sigterm_past_the_drain_deadline_answers_everyone(
    tmp_path: Path, mocks: MockFactory
) -> None:
    m = await mocks(latency_ms=5000, tokens_per_s=2, default_tokens=50)
    port = _free_port()
    path = _config(tmp_path, m.url, port)
    path.write_text(path.read_text().replace("drain_timeout_ms: 3000", "drain_timeout_ms: 500"))
    proc = await asyncio.create_subprocess_exec(
        *GATEWAY,
        "serve",
        "--config",
        str(path),
        env={**os.environ, "UPSTREAM_KEY": "k"},
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.DEVNULL,
    )
    try:
        await _wait_listening(port, proc)
        url = f"http://127.0.0.1:{port}/v1/chat/completions"
        body = {"model": "judge-lite", "messages": [{"role": "user", "content": "hi"}]}
        m.configure(latency_ms=0)
        async with aiohttp.ClientSession() as s:

            async def plain() -> tuple[int, str]:
                async with s.post(url, json=body) as r:
                    return r.status, await r.text()

            async def stream() -> tuple[int, str]:
                async with s.post(url, json={**body, "stream": True}) as r:
                    return r.status, await r.text()

            # 2 slots: a stream and a request in flight, 2 more queued behind them
            m.configure(latency_ms=0)
            tasks = [asyncio.create_task(stream())]
            await eventually(lambda: m.stats.in_flight == 1, what="the stream started")
            m.configure(latency_ms=5000)
            tasks += [asyncio.create_task(plain()) for _ in range(3)]
            await _wait_pool(url.removesuffix("/v1/chat/completions"), 2, 2)
            t0 = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            results = await asyncio.gather(*tasks)
            assert time.monotonic() - t0 < 4  # the drain deadline, not the 5 s upstream
        status, text = results[0]
        assert status == 200 and text.rstrip().splitlines()[-1].startswith('data: {"error"')
        assert "[DONE]" not in text
        for status, text in results[1:]:  # in flight or queued: exactly one honest answer each
            assert status == 503 and '"draining"' in text
        assert await asyncio.wait_for(proc.wait(), 10) == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
