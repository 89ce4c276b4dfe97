"""SPEC §12 "So do the rules outside the scheduler": with `--workers N` a key gets its
`rpm` once per gateway, not once per worker, and `limits.max_buffered_bytes` bounds the
host's request bytes (SPEC §16) — `/admin/state.buffered_bytes` shows the host's number from
any worker, and a killed worker's bytes come back."""

from __future__ import annotations

import asyncio
import fcntl
import os
import signal
import time
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import aiohttp
import pytest

from gateway import _core
from gateway.errors import RateLimited
from gateway.limits import HostLimits, KeyLimits
from support import MockFactory
from test_workers import Workers, _instances, workers

pytestmark = pytest.mark.timeout(120)


async def test_a_keys_rpm_holds_across_two_workers(tmp_path: Path, mocks: MockFactory) -> None:
    """One key with `rpm: 10` behind `--workers 2`, 30 requests on fresh connections (spread
    over both workers by SO_REUSEPORT): at most 10 (+1 for a refill) pass, the rest are 429
    with the usual headers (was: 20 of 30, 10 per worker)."""
    m = await mocks()
    auth = "auth:\n  admin_key: admin-key\n  keys:\n    - {key: k-ten, name: ten, rpm: 10}\n"
    async with workers(tmp_path, 2, _instances((m, 4)), auth) as gw:
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
        statuses: Counter[int] = Counter()
        refused: list[aiohttp.ClientResponse] = []
        for _ in range(30):
            async with gw.session.post(
                gw.url + "/v1/chat/completions",
                json=body,
                headers={"Authorization": "Bearer k-ten"},
            ) as r:
                doc = await r.json()
                statuses[r.status] += 1
                if r.status == 429:
                    assert doc["error"]["code"] == "rate_limited", doc
                    refused.append(r)
        assert set(statuses) == {200, 429}, statuses
        assert 10 <= statuses[200] <= 11, statuses
        for r in refused:
            assert int(r.headers["Retry-After"]) >= 1
            assert r.headers["x-ratelimit-limit-requests"] == "10"
            assert r.headers["x-ratelimit-remaining-requests"] == "0"
        # Both workers answered some of them (else this proves nothing about workers).
        seen = set()
        deadline = time.monotonic() + 10
        while len(seen) < 2:
            async with gw.session.get(
                gw.url + "/admin/state", headers={"Authorization": "Bearer admin-key"}
            ) as r:
                seen.add((await r.json())["worker"])
            assert time.monotonic() < deadline


async def _upload(
    url: str, held: int, length: int
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """Starts a request whose body stops after `held` of its `length` bytes."""
    host, port = url.split("://")[1].split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\n"
        b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % length
    )
    writer.write(b" " * held)
    await writer.drain()
    return reader, writer


async def _status(reader: asyncio.StreamReader, within: float) -> int | None:
    """The status the gateway answered within `within` s (None: nothing yet; 0: closed)."""
    try:
        line = await asyncio.wait_for(reader.readline(), within)
    except TimeoutError:
        return None
    except ConnectionError:
        return 0
    return int(line.split()[1]) if line else 0


async def _buffered(gw: Workers, expect: int, within: float = 10.0) -> None:
    """Waits until both workers (asked over fresh connections) show `expect` host-wide."""
    deadline = time.monotonic() + within
    latest: dict[int, int] = {}
    while not (len(latest) == 2 and all(v == expect for v in latest.values())):
        assert time.monotonic() < deadline, f"buffered_bytes never {expect}: {latest}"
        try:
            doc = await gw.state()
            latest[doc["worker"]] = doc["buffered_bytes"]
        except aiohttp.ClientError:
            pass  # a killed worker's connection
        await asyncio.sleep(0.05)


async def _held_or_answered(
    gw: Workers, reader: asyncio.StreamReader, held: int, within: float = 10.0
) -> int | None:
    """An upload's fate, awaited rather than slept for: the status the gateway answered, or
    None once the host counts `held` bytes and it is still unanswered 0.2 s later."""
    deadline = time.monotonic() + within
    while True:
        status = await _status(reader, 0.02)
        if status is not None:
            return status
        if (await gw.state())["buffered_bytes"] == held:
            return await _status(reader, 0.2)
        assert time.monotonic() < deadline, "an upload neither held nor answered"


def _proc_state(pid: int) -> str | None:
    """The state letter `ps` shows for `pid` (None: gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return None


async def _exited(pid: int, within: float = 10.0) -> None:
    """Until `pid` has exited (gone, or a zombie: its sockets closed either way)."""
    deadline = time.monotonic() + within
    while True:
        if _proc_state(pid) in (None, "Z", "X"):
            return
        assert time.monotonic() < deadline, f"{pid} still running"
        await asyncio.sleep(0.01)


async def test_max_buffered_bytes_holds_per_host_and_a_killed_workers_bytes_come_back(
    tmp_path: Path, mocks: MockFactory
) -> None:
    """Six uploads of 3,000 bytes each stop half-way against a 10,000-byte bound behind two
    workers: three are held, three answered 503 `overloaded` (per process, up to six could be
    held). Any worker's `/admin/state` shows the host's 9,000. A worker killed with uploads of
    its own gives their bytes back; the rest stay counted."""
    m = await mocks()
    extra = "limits: {max_buffered_bytes: 10000, body_timeout_ms: 30000}"
    async with workers(tmp_path, 2, _instances((m, 4)), extra) as gw:
        uploads: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
        answered: Counter[int | None] = Counter()
        for _ in range(6):
            reader, writer = await _upload(gw.url, 3000, 6000)
            status = await _held_or_answered(gw, reader, 3000 * (len(uploads) + 1))
            answered[status] += 1
            if status is None:
                uploads.append((reader, writer))
            else:
                writer.close()
        assert answered == Counter({None: 3, 503: 3}), answered
        await _buffered(gw, 9000)

        # Kill workers until one held an upload (its connections close with it).
        alive = uploads
        for slot in (0, 1):
            pid = gw.slots()[slot]
            os.kill(pid, signal.SIGKILL)
            await _exited(pid)  # its sockets are closed
            alive = [u for u in uploads if await _status(u[0], 0.2) is None]
            if len(alive) < len(uploads):
                break
            deadline = time.monotonic() + 10
            while gw.slots().get(slot, pid) == pid:  # its replacement, before the next kill
                assert time.monotonic() < deadline, "no replacement"
                await asyncio.sleep(0.05)
        assert len(alive) < len(uploads), "a killed worker held none of the uploads"
        # Its bytes came back at reclaim; those still uploading to the other stay counted.
        await _buffered(gw, 3000 * len(alive))
        for _, writer in uploads:
            writer.close()
        await _buffered(gw, 0)
        await gw.assert_quiet()


class _Ring:
    """What `HostLimits` reads of a key ring: its tenants' names."""

    def __init__(self, *names: str) -> None:
        self.tenants = [SimpleNamespace(name=n) for n in names]


def test_reloads_through_a_thousand_key_names_leave_the_key_table_bounded() -> None:
    """SPEC §12/§16 in one process on one memfd: two workers' `HostLimits` share a key's
    buckets (one minute's burst for both together), and reloads that replace the keys 1,000
    times leave only the configured keys' entries in the region."""
    fd = os.memfd_create("limits-test", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, _core.REGION_BYTES)
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
    regions = [_core.Region(fd, 2), _core.Region(fd)]
    os.close(fd)
    hosts = [HostLimits(regions[0], 0), HostLimits(regions[1], 1)]
    ring = _Ring("a")
    mine = KeyLimits(4, None)
    passed = 0
    for k in range(8):
        limits = hosts[k % 2].of("a", mine, ring)
        assert limits is not None and limits is not mine
        try:
            limits.admit(1)
            passed += 1
        except RateLimited as e:
            assert e.headers["x-ratelimit-remaining-requests"] == "0"
    assert passed == 4, "rpm 4 across both workers, not 4 each"
    for n in range(1000):
        ring = _Ring(f"key-{n}", f"key-{n + 1}")
        for host in hosts:
            for name in (f"key-{n}", f"key-{n + 1}"):
                host.of(name, KeyLimits(10, 100), ring)
        assert regions[0].tables()[2] == 2
        assert all(len(h) == 2 for h in hosts)
