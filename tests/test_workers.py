"""SPEC §12 through HTTP: `gateway serve --workers N` is one gateway — one cap per instance,
one queue, one health state — and survives `kill -9` of any worker."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import socket
import sys
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest

from gateway.sim.mock import MockServer
from support import MockFactory

GATEWAY = [sys.executable, "-m", "gateway.cli"]
pytestmark = pytest.mark.timeout(120)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _instances(*items: tuple[MockServer, int]) -> str:
    return "\n".join(
        f'      - {{name: i{k}, url: "{m.url}", model: up, max_concurrency: {cap}}}'
        for k, (m, cap) in enumerate(items)
    )


def _write(path: Path, port: int, instances: str, extra: str = "", alias: str = "m") -> None:
    lines = [
        f"listen: {{host: 127.0.0.1, port: {port}}}",
        "shutdown: {drain_timeout_ms: 5000}",
        *extra.splitlines(),
        "pools:",
        "  p:",
        "    instances:",
        instances,
        "models:",
        f"  {alias}: {{pool: p}}",
    ]
    path.write_text("\n".join(lines) + "\n")


class Workers:
    """A `gateway serve --workers N` process tree and a client with fresh connections (so
    SO_REUSEPORT spreads them over the workers)."""

    def __init__(self, proc: asyncio.subprocess.Process, url: str, session: aiohttp.ClientSession):
        self.proc = proc
        self.url = url
        self.session = session

    def pids(self) -> list[int]:
        """The worker processes (children of the supervisor)."""
        path = f"/proc/{self.proc.pid}/task/{self.proc.pid}/children"
        with open(path) as f:
            return [int(p) for p in f.read().split()]

    async def chat(self, priority: str = "high", model: str = "m") -> aiohttp.ClientResponse:
        body = {"model": model, "messages": [{"role": "user", "content": "hi"}]}
        async with self.session.post(
            self.url + "/v1/chat/completions", json=body, headers={"X-Priority": priority}
        ) as r:
            await r.read()
            return r

    async def state(self) -> dict[str, Any]:
        async with self.session.get(self.url + "/admin/state") as r:
            assert r.status == 200
            doc: dict[str, Any] = await r.json()
            return doc

    async def until(
        self, check: Callable[[dict[str, Any]], bool], within: float = 10.0
    ) -> dict[str, Any]:
        deadline = time.monotonic() + within
        while True:
            try:
                doc = await self.state()
                if check(doc):
                    return doc
            except (aiohttp.ClientError, AssertionError):
                doc = {}
            if time.monotonic() > deadline:
                raise AssertionError(f"never reached: {doc}")
            await asyncio.sleep(0.05)

    async def assert_quiet(self, within: float = 10.0) -> None:
        """Every worker (asked over fresh connections) shows 0 in flight and 0 queued."""

        def quiet(doc: dict[str, Any]) -> bool:
            p = doc["pools"]["p"]
            return p["in_flight"] == 0 and p["queued"] == {"high": 0, "low": 0}

        seen: set[int] = set()
        deadline = time.monotonic() + within
        while len(seen) < 2 or time.monotonic() < deadline - within + 1.0:
            doc = await self.until(quiet, within)
            seen.add(doc["worker"])
            if time.monotonic() > deadline:
                break


@asynccontextmanager
async def workers(
    tmp_path: Path, n: int, instances: str, extra: str = "", env: dict[str, str] | None = None
) -> AsyncIterator[Workers]:
    port = _free_port()
    path = tmp_path / "gateway.yaml"
    _write(path, port, instances, extra)
    proc = await asyncio.create_subprocess_exec(
        *GATEWAY,
        "serve",
        "--config",
        str(path),
        "--workers",
        str(n),
        "--no-access-log",
        stdout=asyncio.subprocess.PIPE,
        env={**os.environ, **(env or {})},
    )
    assert proc.stdout is not None
    line = await asyncio.wait_for(proc.stdout.readline(), 60)
    assert f"({n} workers)" in line.decode(), line
    connector = aiohttp.TCPConnector(force_close=True, limit=0)
    timeout = aiohttp.ClientTimeout(total=30)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        try:
            yield Workers(proc, f"http://127.0.0.1:{port}", session)
        finally:
            if proc.returncode is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    await asyncio.wait_for(proc.wait(), 20)
                except TimeoutError:
                    proc.kill()
                    await proc.wait()


async def test_the_cap_holds_across_four_workers(tmp_path: Path, mocks: MockFactory) -> None:
    # The backend answers 429 beyond 3 at once: any overrun across workers shows.
    m = await mocks(latency_ms=120, max_concurrency=3)
    async with workers(tmp_path, 4, _instances((m, 3))) as gw:
        results = await asyncio.gather(*(gw.chat() for _ in range(60)))
        assert [r.status for r in results] == [200] * 60
        assert m.stats.rejected == 0
        assert m.stats.peak_in_flight == 3
        answered = {(await gw.state())["worker"] for _ in range(40)}
        assert len(answered) >= 2, "SO_REUSEPORT spreads connections over the workers"
        await gw.assert_quiet()


async def test_high_requests_overtake_a_low_backlog_across_workers(
    tmp_path: Path, mocks: MockFactory
) -> None:
    m = await mocks(latency_ms=150)
    async with workers(tmp_path, 4, _instances((m, 1))) as gw:
        order: list[str] = []

        async def one(priority: str) -> None:
            r = await gw.chat(priority)
            assert r.status == 200
            order.append(priority)

        lows = [asyncio.create_task(one("low")) for _ in range(14)]
        await gw.until(lambda d: d["pools"]["p"]["queued"]["low"] >= 10)
        highs = [asyncio.create_task(one("high")) for _ in range(4)]
        await asyncio.gather(*lows, *highs)
        last_high = max(i for i, p in enumerate(order) if p == "high")
        lows_after = len(order) - 1 - last_high
        # 7:3 while both wait: the four highs go within ~6 grants, most of the backlog after.
        assert lows_after >= 4, order
        await gw.assert_quiet()


async def test_an_ejection_by_one_worker_holds_for_all(tmp_path: Path, mocks: MockFactory) -> None:
    bad = await mocks(fail_rate=1.0, fail_mode="status", fail_status=500)
    good = await mocks(latency_ms=5)
    extra = (
        "health: {failure_threshold: 2, ejection_ms: 60000, probe: {enabled: false}}\n"
        "retries: {max_attempts: 2}"
    )
    async with workers(tmp_path, 4, _instances((bad, 4), (good, 4)), extra) as gw:
        statuses = [(await gw.chat()).status for _ in range(40)]
        assert statuses == [200] * 40
        # Two failures eject it in the worker that saw them; the other three never try it.
        assert bad.stats.requests_total <= 3, bad.stats.requests_total
        doc = await gw.state()
        assert {i["name"]: i["state"] for i in doc["pools"]["p"]["instances"]}["i0"] == "ejected"
        await gw.assert_quiet()


async def test_one_probe_per_instance_per_interval(tmp_path: Path, mocks: MockFactory) -> None:
    m = await mocks()
    extra = "health: {probe: {enabled: true, interval_ms: 200, path: /models}}"
    async with workers(tmp_path, 4, _instances((m, 4)), extra):
        await asyncio.sleep(0.5)
        before = m.stats.requests_total
        await asyncio.sleep(2.0)
        probes = m.stats.requests_total - before
        # One per 200 ms interval across the workers: ~10, not ~40.
        assert 5 <= probes <= 16, probes


async def test_a_reload_through_one_worker_applies_to_all(
    tmp_path: Path, mocks: MockFactory
) -> None:
    m = await mocks()
    async with workers(tmp_path, 3, _instances((m, 4))) as gw:
        path = tmp_path / "gateway.yaml"
        port = int(gw.url.rsplit(":", 1)[1])
        _write(path, port, _instances((m, 4)), alias="renamed")
        async with gw.session.post(gw.url + "/admin/reload") as r:
            assert r.status == 200, await r.text()

        async def everywhere() -> bool:
            results = await asyncio.gather(*(gw.chat(model="renamed") for _ in range(12)))
            return all(r.status == 200 for r in results)

        deadline = time.monotonic() + 10
        while not await everywhere():
            assert time.monotonic() < deadline, "a worker kept the old config"
            await asyncio.sleep(0.1)


async def test_sighup_to_the_supervisor_reloads_every_worker(
    tmp_path: Path, mocks: MockFactory
) -> None:
    m = await mocks()
    async with workers(tmp_path, 3, _instances((m, 4))) as gw:
        port = int(gw.url.rsplit(":", 1)[1])
        _write(tmp_path / "gateway.yaml", port, _instances((m, 4)), alias="after-hup")
        gw.proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 10
        while True:
            results = await asyncio.gather(*(gw.chat(model="after-hup") for _ in range(12)))
            if all(r.status == 200 for r in results):
                break
            assert time.monotonic() < deadline, "a worker kept the old config"
            await asyncio.sleep(0.1)


async def _serve_to_exit(
    tmp_path: Path, port: int, env: dict[str, str] | None = None
) -> tuple[int | None, bytes, bytes]:
    """`serve --workers 2` of a one-instance config expected to exit: (status, stdout, stderr)."""
    path = tmp_path / "gateway.yaml"
    _write(
        path, port, '      - {name: a, url: "http://127.0.0.1:9/v1", model: up, max_concurrency: 1}'
    )
    proc = await asyncio.create_subprocess_exec(
        *GATEWAY,
        "serve",
        "--config",
        str(path),
        "--workers",
        "2",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=env,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 30)
    return proc.returncode, out, err


async def test_a_taken_port_is_a_clear_error(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code, _, err = await _serve_to_exit(tmp_path, port)
        assert code == 1
        assert b"cannot listen on 127.0.0.1" in err and b"Traceback" not in err


async def test_sigterm_to_the_supervisor_drains_every_worker(
    tmp_path: Path, mocks: MockFactory
) -> None:
    m = await mocks(latency_ms=500)
    async with workers(tmp_path, 2, _instances((m, 2))) as gw:
        tasks = [asyncio.create_task(gw.chat()) for _ in range(4)]
        await gw.until(lambda d: d["pools"]["p"]["in_flight"] == 2)
        gw.proc.send_signal(signal.SIGTERM)
        statuses = [r.status for r in await asyncio.gather(*tasks)]
        assert statuses == [200] * 4
        assert await asyncio.wait_for(gw.proc.wait(), 20) == 0


async def test_kill_9_of_workers_under_load(tmp_path: Path, mocks: MockFactory) -> None:
    m = await mocks(latency_ms=40)
    async with workers(tmp_path, 4, _instances((m, 4))) as gw:
        outcomes: dict[str, int] = {}
        stop = time.monotonic() + 30  # a kill every second for 30 s (issue 12)

        async def client() -> None:
            while time.monotonic() < stop:
                try:
                    r = await asyncio.wait_for(gw.chat(random.choice(["high", "low"])), 15)
                except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError):
                    kind = "closed"  # its worker was killed mid-request
                else:
                    if r.status == 503:
                        assert r.headers.get("Retry-After"), "a 503 says when to retry"
                    assert r.status in (200, 503), r.status
                    kind = str(r.status)
                outcomes[kind] = outcomes.get(kind, 0) + 1

        async def killer() -> None:
            kills = 0
            while time.monotonic() < stop - 1:
                await asyncio.sleep(1.0)
                pids = gw.pids()
                if pids:
                    os.kill(random.choice(pids), signal.SIGKILL)
                    kills += 1
            assert kills >= 25

        await asyncio.gather(*(client() for _ in range(8)), killer())
        print("outcomes under kill -9:", outcomes)
        assert outcomes.get("200", 0) > 100, outcomes
        # Every slot respawned, and nothing the dead held is counted any more.
        await gw.until(lambda d: len(gw.pids()) == 4, within=10)
        await gw.assert_quiet()
        answered = {(await gw.state())["worker"] for _ in range(40)}
        assert len(answered) >= 2


async def test_a_hung_worker_is_killed_and_replaced(tmp_path: Path, mocks: MockFactory) -> None:
    m = await mocks()
    env = {"GATEWAY_WORKER_HANG_MS": "1000"}
    async with workers(tmp_path, 2, _instances((m, 4)), env=env) as gw:
        victim = gw.pids()[0]
        os.kill(victim, signal.SIGSTOP)
        await gw.until(lambda d: victim not in gw.pids() and len(gw.pids()) == 2, within=15)
        results = await asyncio.gather(*(gw.chat() for _ in range(20)))
        assert [r.status for r in results] == [200] * 20
        await gw.assert_quiet()


async def test_the_batch_api_works_through_any_worker(tmp_path: Path, mocks: MockFactory) -> None:
    """One store, one runner (worker 0); the others relay, so the official client works over
    connections that land on any worker."""
    from openai import AsyncOpenAI

    m = await mocks(latency_ms=5)
    extra = f"batch: {{store: {tmp_path / 'batches.db'}}}"
    async with workers(tmp_path, 3, _instances((m, 4)), extra) as gw:
        lines = [
            orjson.dumps(
                {
                    "custom_id": f"r{k}",
                    "method": "POST",
                    "url": "/v1/chat/completions",
                    "body": {"model": "m", "messages": [{"role": "user", "content": f"q{k}"}]},
                }
            )
            for k in range(20)
        ]

        def client() -> AsyncOpenAI:  # a fresh connection: it may land on any worker
            return AsyncOpenAI(base_url=gw.url + "/v1", api_key="sk-x", max_retries=0)

        c = client()
        f = await c.files.create(file=("in.jsonl", b"\n".join(lines)), purpose="batch")
        b = await c.batches.create(
            input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        deadline = time.monotonic() + 30
        while b.status not in ("completed", "failed", "expired", "cancelled"):
            assert time.monotonic() < deadline, b.status
            await asyncio.sleep(0.1)
            async with client() as poll:  # each poll may land on another worker
                b = await poll.batches.retrieve(b.id)
        assert b.status == "completed" and b.request_counts is not None
        assert b.request_counts.completed == 20
        assert b.output_file_id is not None
        for _ in range(10):  # every worker answers the same (fresh connections spread)
            async with client() as again:
                assert (await again.batches.retrieve(b.id)).status == "completed"
        async with client() as fetch:
            out = (await fetch.files.content(b.output_file_id)).content
        assert sorted(orjson.loads(x)["custom_id"] for x in out.splitlines()) == sorted(
            f"r{k}" for k in range(20)
        )
        await c.close()
        await gw.assert_quiet()


async def test_metrics_from_any_worker_count_the_whole_gateway(
    tmp_path: Path, mocks: MockFactory
) -> None:
    m = await mocks()
    async with workers(tmp_path, 3, _instances((m, 4))) as gw:
        results = await asyncio.gather(*(gw.chat() for _ in range(30)))
        assert [r.status for r in results] == [200] * 30
        line = 'gateway_requests_total{code="200",pool="p",priority="high"}'
        await asyncio.sleep(1.5)  # each worker's snapshot for the others is at most 1 s old
        for _ in range(12):  # fresh connections: several workers answer
            async with gw.session.get(gw.url + "/metrics") as r:
                text = await r.text()
            values = [x.split()[-1] for x in text.splitlines() if x.startswith(line)]
            assert values == ["30.0"], values
            assert 'gateway_instance_in_flight{instance="i0",pool="p"} 0.0' in text
        # A worker killed and replaced: what it counted stays in the totals (no going back).
        os.kill(gw.pids()[0], signal.SIGKILL)
        await gw.until(lambda d: len(gw.pids()) == 3)
        await asyncio.sleep(1.5)
        for _ in range(6):
            async with gw.session.get(gw.url + "/metrics") as r:
                text = await r.text()
            values = [x.split()[-1] for x in text.splitlines() if x.startswith(line)]
            assert values == ["30.0"], values


async def test_a_saturated_unit_goes_round_every_workers_clients(
    tmp_path: Path, mocks: MockFactory
) -> None:
    """One unit, eight clients on keep-alive connections (so each stays with one worker): the
    unit goes round all of them in turn, not only the clients of the worker that frees it."""
    m = await mocks(latency_ms=5, latency_dist="fixed")
    async with workers(tmp_path, 2, _instances((m, 1))) as gw:
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
        stop = time.monotonic() + 4
        done: list[int] = []

        async def client() -> None:
            n = 0
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1)) as own:
                while time.monotonic() < stop:
                    async with own.post(gw.url + "/v1/chat/completions", json=body) as r:
                        await r.read()
                        assert r.status == 200
                    n += 1
            done.append(n)

        await asyncio.gather(*(client() for _ in range(8)))
        assert min(done) >= max(done) // 2, done
        await gw.assert_quiet()


async def test_workers_that_cannot_start_stop_the_supervisor(tmp_path: Path) -> None:
    """A worker dying before it ever listens, three times in a row: exit 1 with a reason, not
    a restart loop nobody sees."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(
        "import os, sys\nif os.environ.get('GATEWAY_WORKER'):\n    sys.exit(3)\n"
    )
    env = {**os.environ, "PYTHONPATH": f"{site}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    code, out, err = await _serve_to_exit(tmp_path, _free_port(), env)
    assert code == 1
    assert b"workers cannot start" in err
    assert b"listening" not in out


async def test_queue_capacity_bounds_every_workers_queue_together(
    tmp_path: Path, mocks: MockFactory
) -> None:
    """SPEC §3 capacity is the pool's, not each worker's: 1 running + 3 queued, the rest 503."""
    m = await mocks(latency_ms=1500, latency_dist="fixed")
    extra = "scheduler: {high: {capacity: 3}, overflow_high_to_low: false}"
    async with workers(tmp_path, 3, _instances((m, 1)), extra) as gw:
        first = asyncio.create_task(gw.chat())
        await gw.until(lambda d: d["pools"]["p"]["in_flight"] == 1)
        rest = await asyncio.gather(*(gw.chat() for _ in range(11)))
        statuses = sorted([(await first).status, *(r.status for r in rest)])
        assert statuses == [200] * 4 + [503] * 8, statuses
        await gw.assert_quiet()
