"""SPEC §12 × §13: `cluster:` with `--workers N` is one replica per host — its leased share of
each instance is the cap the host's region enforces across its workers, and one worker per host
(the member) talks to Redis. Real processes throughout: a real `redis-server`, two hosts of
`gateway serve --workers 2`, and a mock backend that counts its own peak concurrency (and
answers 429, counted, past its cap).
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import signal
import socket
import time
from collections.abc import AsyncIterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import aiohttp
import pytest

from cluster_harness import Replica
from gateway import _core
from gateway.cluster.host import HostSeat
from gateway.cluster.ratelimit import HostLeasedLimits, RateShare, RateSync
from gateway.cluster.redis_state import RedisState
from gateway.errors import RateLimited
from gateway.limits import KeyLimits
from gateway.sim.mock import MockBehavior, MockServer
from redis_fixture import REDIS_SERVER, RedisServer
from test_cluster import (
    Load,
    Result,
    _quiet,
    _small_config,
    lease_records,
    redis_server,  # noqa: F401  (the fixture)
    until,
)

pytestmark = pytest.mark.skipif(
    REDIS_SERVER is None, reason="redis-server is not installed (CI installs Debian's)"
)


def _fresh_connections() -> aiohttp.ClientSession:
    # One connection per request: the kernel spreads them over the host's workers
    # (SO_REUSEPORT), so every worker of both hosts serves some.
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True, limit=0))


async def _ask(session: aiohttp.ClientSession, rep: Replica) -> Result:
    return await Load(session, [rep])._one(rep, stream=False)


@contextlib.asynccontextmanager
async def _two_hosts(
    tmp_path: Path, config: dict[str, Any], redis: RedisServer, mock: MockServer
) -> AsyncIterator[tuple[aiohttp.ClientSession, list[Replica]]]:
    """Two hosts of `--workers 2` on `config`, both leased, and a session of fresh connections;
    the hosts and `mock` are stopped at the end."""
    hosts = [Replica(tmp_path, f"h{i + 1}", config, workers=2) for i in range(2)]
    async with _fresh_connections() as session:
        try:
            for rep in hosts:
                rep.start()
            for rep in hosts:
                await rep.wait_ready(session)
            await until(lambda: _both_leased(redis), 5, "both hosts leased")
            yield session, hosts
        finally:
            for rep in hosts:
                rep.stop()
            await mock.stop()


async def _host(session: aiohttp.ClientSession, rep: Replica) -> dict[str, Any]:
    host: dict[str, Any] = (await rep.state(session))["cluster"]["host"]
    return host


async def _members(session: aiohttp.ClientSession, rep: Replica) -> set[int]:
    """The member's pid as several answers (from whichever worker took each) tell it."""
    pids = set()
    for _ in range(6):
        member = (await _host(session, rep))["member"]
        pids.add(member["pid"] if member else None)
    return pids


async def _both_leased(redis: RedisServer) -> bool:
    return set(await lease_records(redis)) == {"h1", "h2"}


async def test_two_hosts_of_two_workers_share_one_instance_through_load_a_stop_and_a_kill(
    tmp_path: Path,
    redis_server: RedisServer,  # noqa: F811
) -> None:
    """Two hosts of `--workers 2` on one Redis share one instance of `max_concurrency: 4`; the
    mock answers 429 (counted) past its cap, so any overrun shows. Starting the six processes
    costs seconds, so the facets below share one run, in turn — each ends with nothing in
    flight or queued, and the kill -9 goes last:

    1. forty concurrent slow requests over both hosts (issue 20 "Done when");
    2. an idle host's other worker gets a share while the other host is busy;
    3. a worker stopped (SIGSTOP) through a shrink of its host's lease;
    4. kill -9 of the worker that talks to Redis for its host, under load.

    Through all of it the backend never sees more than 4."""
    mock = MockServer(MockBehavior(latency_ms=250, max_concurrency=4))
    await mock.start()
    config = _small_config(redis_server.url, mock)
    async with _two_hosts(tmp_path, config, redis_server, mock) as (session, hosts):
        await _forty_slow_requests_never_overrun(session, hosts, mock, redis_server)
        mock.configure(latency_ms=300)
        await _an_idle_hosts_other_worker_gets_a_share(session, hosts, mock)
        mock.configure(latency_ms=150)
        await _a_worker_stopped_through_a_shrink(session, hosts, mock)
        mock.configure(latency_ms=100)
        await _kill_9_of_the_member_keeps_its_host_serving(session, hosts, mock, redis_server)
    assert mock.stats.peak_in_flight <= 4 and mock.stats.rejected == 0


async def _forty_slow_requests_never_overrun(
    session: aiohttp.ClientSession, hosts: list[Replica], mock: MockServer, redis: RedisServer
) -> None:
    """Issue 20 "Done when": 40 concurrent slow requests (250 ms) spread over both replicas
    and all four workers: the backend never sees more than 4, none fails; Redis knows two
    replicas (one per host, not one per worker); any worker shows its host's cluster block; at
    rest nothing is in flight or queued."""
    started = time.monotonic()
    results = await asyncio.gather(*(_ask(session, hosts[i % 2]) for i in range(40)))
    took = time.monotonic() - started
    records = await lease_records(redis)
    blocks = [(await rep.state(session))["cluster"] for rep in hosts for _ in range(4)]
    await until(lambda: _quiet(session, hosts), 10, "quiet")
    waiting = [
        (await rep.state(session))["pools"]["p"]["instances"][0]["in_flight"] for rep in hosts
    ]
    statuses = [r.status for r in results]
    assert statuses == [200] * 40, {s: statuses.count(s) for s in set(statuses)}
    assert mock.stats.peak_in_flight <= 4 and mock.stats.rejected == 0
    # The host's lease is the cap across its workers, and the two hosts use the whole 4.
    assert mock.stats.peak_in_flight == 4
    # 40 x 250 ms over 4 slots is 2.5 s.
    assert took < 10, f"40 requests took {took:.1f} s"
    assert set(records) == {"h1", "h2"}, records  # one replica per host, not per worker
    for block in blocks:
        assert block["host"]["workers"] == 2 and block["host"]["member"] is not None
        assert block["replica_id"] in ("h1", "h2") and block["status"] == "ok"
    assert waiting == [0, 0]
    print(f"40 answered 200 in {took:.2f} s; backend peak {mock.stats.peak_in_flight}")


async def _kill_9_of_the_member_keeps_its_host_serving(
    session: aiohttp.ClientSession, hosts: list[Replica], mock: MockServer, redis: RedisServer
) -> None:
    """The process that talks to Redis for a host is killed (-9) under load: the host's other
    worker keeps serving within the lease (no answer other than 200 — only requests on the
    killed worker's own connections may fail), takes the member role over within a lease and
    renews the host's lease under the same replica id (Redis never sees a third replica), the
    backend never sees more than 4, and at rest nothing is in flight or queued."""
    load = Load(session, hosts)
    try:
        members = await _members(session, hosts[0])
        assert len(members) == 1 and None not in members, members
        (victim,) = members
        load.start(12)
        await until(lambda: len(load.results) >= 20, 10, "load running")
        os.kill(victim, signal.SIGKILL)
        killed = time.monotonic()

        async def moved() -> bool:
            pids = await _members(session, hosts[0])
            return len(pids) == 1 and victim not in pids and None not in pids

        took_over = await until(moved, 5, "the member role came back")
        # The load goes on across the takeover; then a lease's worth more.
        await asyncio.sleep(1.5)
        records = await lease_records(redis)
        await load.stop()
        await until(lambda: _quiet(session, hosts), 10, "quiet")
        after = [r for r in load.results if r.seconds >= killed]
        state = (await hosts[0].state(session))["cluster"]
    finally:
        load.cancel()
    assert set(records) == {"h1", "h2"}, records
    failed = [r for r in load.results if r.status != 200]
    # The killed worker's own connections die with it (at most the requests it held).
    assert all(r.status is None for r in failed), failed[:5]
    assert len(failed) <= 12, failed
    assert len([r for r in after if r.status == 200]) >= 20
    assert mock.stats.peak_in_flight <= 4 and mock.stats.rejected == 0
    assert state["status"] == "ok" and state["host"]["member"]["pid"] != victim
    print(
        f"member role back after {took_over:.2f} s; {len(failed)} of {len(load.results)}"
        " requests lost with the killed worker's connections"
    )


async def _lease_on(session: aiohttp.ClientSession, rep: Replica) -> int:
    lease: int = (await rep.state(session))["pools"]["p"]["instances"][0]["lease"]
    return lease


async def _follower_session(rep: Replica) -> aiohttp.ClientSession:
    """A session whose one keep-alive connection landed on a worker of `rep` that is not its
    member (the kernel picks the worker per connection: new ones until one does — for a few
    seconds, as a worker that is still starting takes none)."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1))
        state = await rep.state(session)
        if state["cluster"]["host"]["member"]["worker"] != state["worker"]:
            return session
        await session.close()
        await asyncio.sleep(0.02)
    raise AssertionError("no connection reached the non-member worker")


async def _an_idle_hosts_other_worker_gets_a_share(
    session: aiohttp.ClientSession, hosts: list[Replica], mock: MockServer
) -> None:
    """SPEC §13 "Shares follow demand", with the demand of the whole host: host h1 is busy with
    all 4 slots, so idle h2 holds none; then requests reach h2's worker that does not talk to
    Redis. They wait there for a lease — before the shared queue, where the member would not
    see them — so the member adds them to the host's demand: h2 gets slots from h1 within a
    few renew periods, long before h1's backlog (300 ms requests) is done. The backend never
    sees more than 4."""
    followers: list[aiohttp.ClientSession] = []
    try:
        followers = [await _follower_session(hosts[1]) for _ in range(2)]
        started = time.monotonic()
        busy = [asyncio.create_task(_ask(session, hosts[0])) for _ in range(60)]

        async def h2_idle() -> bool:
            return await _lease_on(session, hosts[1]) == 0

        await until(h2_idle, 5, "the idle host's share went to the busy one")
        late = time.monotonic()
        mine = await asyncio.gather(*(_ask(f, hosts[1]) for f in followers))
        served_in = time.monotonic() - late
        theirs = await asyncio.gather(*busy)
        backlog = time.monotonic() - started
        await until(lambda: _quiet(session, hosts), 10, "quiet")
    finally:
        for f in followers:
            await f.close()
    assert [r.status for r in mine] == [200] * 2, [r.status for r in mine]
    assert [r.status for r in theirs] == [200] * 60
    assert mock.stats.peak_in_flight <= 4 and mock.stats.rejected == 0
    # h1's backlog alone is 60 x 300 ms over 4 slots = 4.5 s; h2's must not wait for it.
    assert served_in < backlog - 2.0, f"h2 served in {served_in:.2f} s, backlog {backlog:.2f} s"
    print(f"the idle host's other worker served in {served_in:.2f} s (backlog {backlog:.2f} s)")


def test_host_seat_one_member_and_what_the_workers_tell_it(tmp_path: Path) -> None:
    """The member role is one exclusive lock (a second seat cannot take it until the holder
    gives it up or dies); a publication is seen once per change; the member sums what the
    others hold waiting and learns the lowest publication they all applied (0 while one of
    them has not reported: the member then keeps every unexpired cap in its floor)."""
    seats = [HostSeat(str(tmp_path), k, 3) for k in range(3)]
    assert seats[0].try_lead() and seats[0].member
    assert not seats[1].try_lead() and not seats[2].try_lead()
    seats[0].publish({"seq": 7, "pools": {"p": {"slots": {"m0": 2}, "expiry_ms": 123}}})
    seen = seats[1].changed()
    assert seen is not None and seen["seq"] == 7
    assert seats[1].changed() is None  # unchanged: one stat, nothing read
    seats[1].report({"p": 3}, 7)
    assert seats[0].others() == ({"p": 3}, 0)  # slot 2 has not reported
    seats[2].report({"p": 1, "q": 0}, 6)
    assert seats[0].others() == ({"p": 4}, 6)
    seats[0].resign()
    assert seats[2].try_lead() and not seats[1].try_lead()


def test_host_seat_files_are_rewritten_in_place_and_a_half_write_is_never_read(
    tmp_path: Path,
) -> None:
    """The publication and the reports are rewritten in place (no rename: on ext4 a rename
    over a file costs ~70 us of CPU and blocks the loop ~0.2 ms, ten times a second on the
    member): a shorter publication after a longer one reads as itself, and a file caught
    half written (here: a body byte changed under its CRC) is not applied — the follower
    keeps what it had and the member keeps the last whole report — until the next whole
    write, which is."""
    member, follower = HostSeat(str(tmp_path), 0, 2), HostSeat(str(tmp_path), 1, 2)
    assert member.try_lead()
    member.publish({"seq": 1, "pools": {"p": {"slots": {f"m{i}": i for i in range(50)}}}})
    first = follower.changed()
    assert first is not None and len(first["pools"]["p"]["slots"]) == 50
    member.publish({"seq": 2, "pools": {"p": {"slots": {"m0": 1}}}})
    assert follower.changed() == {"seq": 2, "pools": {"p": {"slots": {"m0": 1}}}}
    published = tmp_path / "cluster-host.json"
    assert len(list(tmp_path.iterdir())) == 2, "a temporary file was left"  # lock + publication
    member.publish({"seq": 3, "pools": {"p": {"slots": {"m0": 2}}}})
    data = bytearray(published.read_bytes())
    data[data.index(b'"m0":2') + 5] = ord("9")  # the body no longer matches its CRC
    published.write_bytes(bytes(data))
    assert follower.changed() is None and follower.changed() is None
    assert follower.read() == {"seq": 2, "pools": {"p": {"slots": {"m0": 1}}}}
    member.publish({"seq": 4, "pools": {"p": {"slots": {"m0": 3}}}})
    assert follower.changed() == {"seq": 4, "pools": {"p": {"slots": {"m0": 3}}}}
    follower.report({"p": 2}, 4)
    assert member.others() == ({"p": 2}, 4)
    report = tmp_path / "cluster-waiting.1"
    data = bytearray(report.read_bytes())
    data[-2] = ord("5")  # "seq":4} -> "seq":5}, the CRC unchanged
    report.write_bytes(bytes(data))
    assert member.others() == ({"p": 2}, 4)
    follower.report({"p": 1}, 5)
    assert member.others() == ({"p": 1}, 5)


async def _member_session(rep: Replica) -> aiohttp.ClientSession:
    """A session whose one keep-alive connection landed on `rep`'s member worker."""
    for _ in range(50):
        session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1))
        state = await rep.state(session)
        if state["cluster"]["host"]["member"]["worker"] == state["worker"]:
            return session
        await session.close()
    raise AssertionError("no connection reached the member worker")


def _workers_of(rep: Replica) -> list[int]:
    assert rep.proc is not None
    pid = rep.proc.pid
    return [int(k) for k in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


async def _a_worker_stopped_through_a_shrink(
    session: aiohttp.ClientSession, hosts: list[Replica], mock: MockServer
) -> None:
    """Host h1 is busy with all 4 slots; its worker that is not the member is stopped
    (SIGSTOP) while host h2's load makes h1's lease shrink, and resumed before that lease
    expires: the stopped worker's units stay in its host's in-flight count (the region) and so
    in the floor h1 reports, the member keeps the old cap in that floor until the resumed
    worker acknowledges the smaller one, and the resumed worker applies it: the backend never
    sees more than 4 (the mock answers 429 and counts it past its cap), every request is
    answered 200, and at rest nothing runs. (The acknowledgement matters when the stopped
    worker held queued requests and few units — a timing this test does not force: it passed
    three runs out of three with the held floor switched off.)"""
    first, second = Load(session, [hosts[0]]), Load(session, [hosts[1]])
    stopped: int | None = None
    to_member: aiohttp.ClientSession | None = None
    try:
        first.start(12)

        async def h1_all() -> bool:
            return await _lease_on(session, hosts[0]) == 4

        await until(h1_all, 5, "the busy host holds the whole cap")
        to_member = await _member_session(hosts[0])  # the stopped worker answers nothing
        member = (await _host(to_member, hosts[0]))["member"]["pid"]
        (stopped,) = [pid for pid in _workers_of(hosts[0]) if pid != member]
        os.kill(stopped, signal.SIGSTOP)
        second.start(12)

        async def h1_shrank() -> bool:
            return await _lease_on(to_member, hosts[0]) < 4

        await until(h1_shrank, 3, "the busy host's lease shrank for the other")
        os.kill(stopped, signal.SIGCONT)
        stopped = None
        await asyncio.sleep(1.5)
        await first.stop()
        await second.stop()
        await until(lambda: _quiet(session, hosts), 10, "quiet")
    finally:
        if stopped is not None:
            os.kill(stopped, signal.SIGCONT)
        if to_member is not None:
            await to_member.close()
        first.cancel()
        second.cancel()
    results = first.results + second.results
    statuses = [r.status for r in results]
    assert statuses == [200] * len(results), {s: statuses.count(s) for s in set(statuses)}
    assert mock.stats.peak_in_flight <= 4 and mock.stats.rejected == 0
    print(f"{len(results)} answered 200; backend peak {mock.stats.peak_in_flight}")


async def test_a_reload_reaches_every_worker_of_a_host(
    tmp_path: Path,
    redis_server: RedisServer,  # noqa: F811
) -> None:
    """`POST /admin/reload` to any worker of a cluster host reloads all of them (SPEC §12) and
    the host's lease follows (SPEC §13): a second instance added to the config is leased and
    serves from every worker, and the reload's answer carries no note about cluster settings.
    The config names no `replica_id`: the default is the host name and the supervisor's pid,
    one replica in Redis for the host, the same before and after the reload."""
    first = MockServer(MockBehavior(latency_ms=5, max_concurrency=4))
    second = MockServer(MockBehavior(latency_ms=5, max_concurrency=4))
    await first.start()
    await second.start()
    config = _small_config(redis_server.url, first)
    rep = Replica(tmp_path, "h1", config, workers=2)
    import yaml

    unnamed = yaml.safe_load(rep.config_path.read_text())
    del unnamed["cluster"]["replica_id"]
    rep.config_path.write_text(yaml.safe_dump(unnamed))
    async with _fresh_connections() as session:
        try:
            rep.start()
            await rep.wait_ready(session)
            assert rep.proc is not None
            host_id = f"{socket.gethostname()}-{rep.proc.pid}"
            bigger = yaml.safe_load(rep.config_path.read_text())
            bigger["pools"]["p"]["instances"].append(
                {"name": "m1", "url": second.url, "model": "up", "max_concurrency": 4}
            )
            rep.config_path.write_text(yaml.safe_dump(bigger))
            headers = {"Authorization": "Bearer admin-key-for-tests"}
            async with session.post(rep.url + "/admin/reload", headers=headers) as resp:
                assert resp.status == 200, await resp.text()
                answer = await resp.json()

            async def everywhere() -> bool:
                for _ in range(6):  # fresh connections: both workers answer some
                    state = await rep.state(session)
                    leases = {i["name"]: i["lease"] for i in state["pools"]["p"]["instances"]}
                    if leases.get("m1", 0) < 1:
                        return False
                return True

            await until(everywhere, 5, "the new instance leased in every worker")
            records = await lease_records(redis_server)
            results = await asyncio.gather(*(_ask(session, rep) for _ in range(24)))
            await until(lambda: _quiet(session, [rep]), 10, "quiet")
        finally:
            rep.stop()
            await first.stop()
            await second.stop()
    assert [r.status for r in results] == [200] * 24
    assert not any("cluster" in note for note in answer.get("notes", [])), answer
    assert second.stats.completed > 0
    assert list(records) == [host_id], records


# ---- per-key limits: the host's allowance, one Redis connection per host --------------------

RPM = 10


async def _gateway_connections(redis: RedisServer) -> dict[str, int]:
    """Redis's own count of its clients per name, the gateway's (`gateway:<replica>`) only."""
    async with redis.client() as r:
        clients = await r.client_list()
    out: dict[str, int] = {}
    for c in clients:
        name = c.get("name", "")
        if name.startswith("gateway:"):
            out[name] = out.get(name, 0) + 1
    return out


async def _limited(
    session: aiohttp.ClientSession, rep: Replica, key: str = "sk-limited-0001"
) -> tuple[int, dict[str, str]]:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    headers = {"Authorization": f"Bearer {key}"}
    try:
        async with session.post(
            rep.url + "/v1/chat/completions", json=body, headers=headers
        ) as resp:
            await resp.read()
            return resp.status, {k.lower(): v for k, v in resp.headers.items()}
    except aiohttp.ClientError:
        return 0, {}  # a connection the killed worker held: no answer


async def test_a_keys_limit_holds_across_hosts_of_workers_and_on_the_static_share(
    tmp_path: Path,
    redis_server: RedisServer,  # noqa: F811
) -> None:
    """Per-key limits on two hosts of `--workers 2` on one Redis. Starting the six processes
    costs seconds, so two facets share one run, in turn (each with its own key): a key's
    `rpm: 10` held across the hosts through a kill -9 of h1's member, with one Redis connection
    per host; then Redis killed, and another key's `rpm: 120` on h1's static share."""
    mock = MockServer(MockBehavior(latency_ms=5))
    await mock.start()
    config = _small_config(redis_server.url, mock)
    config["auth"]["keys"].append({"key": "sk-limited-0001", "name": "limited", "rpm": RPM})
    config["auth"]["keys"].append({"key": STATIC_KEY, "name": "static", "rpm": STATIC_RPM})
    async with _two_hosts(tmp_path, config, redis_server, mock) as (session, hosts):
        await _a_keys_rpm_holds_across_hosts_with_one_redis_connection_each(
            session, hosts, redis_server
        )
        await _a_keys_host_allowance_on_the_static_share_while_redis_is_down(
            session, hosts, redis_server
        )


async def _a_keys_rpm_holds_across_hosts_with_one_redis_connection_each(
    session: aiohttp.ClientSession, hosts: list[Replica], redis: RedisServer
) -> None:
    """SPEC §12 × §13: a key's limit once per gateway — one key with `rpm: 10`, 30 requests on
    fresh connections spread over both hosts and all four workers, h1's member killed (-9)
    while the second ten are sent: at most 10 succeed (plus the central bucket's refill while
    the test runs: 10/60 a second, so one more only if it takes 6 s), the rest answer 429 with
    Retry-After and the limit headers; and Redis sees one connection per host (named after its
    replica, before and after the kill: the workers that are not the member never open one).
    At rest nothing is in flight or queued."""
    answers: list[tuple[int, dict[str, str]]] = []
    before = await _gateway_connections(redis)
    members = await _members(session, hosts[0])
    assert len(members) == 1 and None not in members, members
    (victim,) = members
    started = time.monotonic()
    answers += await asyncio.gather(*(_limited(session, hosts[i % 2]) for i in range(10)))
    during = [asyncio.create_task(_limited(session, hosts[i % 2])) for i in range(10)]
    os.kill(victim, signal.SIGKILL)
    answers += await asyncio.gather(*during)

    async def moved() -> bool:
        pids = await _members(session, hosts[0])
        return len(pids) == 1 and victim not in pids and None not in pids

    await until(moved, 5, "the member role came back")
    answers += await asyncio.gather(*(_limited(session, hosts[i % 2]) for i in range(10)))
    elapsed = time.monotonic() - started
    after = await _gateway_connections(redis)
    await until(lambda: _quiet(session, hosts), 10, "quiet")
    statuses = [s for s, _ in answers]
    admitted = statuses.count(200)
    allowed = RPM + RPM / 60 * elapsed  # the central bucket full at the start, then its refill
    # Requests on the killed worker's connections get no answer (0): any of them that was
    # admitted spent the host's allowance all the same, so counting them out only weakens
    # the bound, and there are at most the five sent at h1 during the kill.
    assert set(statuses) <= {200, 429, 0} and statuses.count(0) <= 5, statuses
    assert admitted <= allowed, f"{admitted} admitted in {elapsed:.1f} s, limit {allowed:.2f}"
    assert admitted >= 5, f"only {admitted} admitted: the hosts' allowances went unused"
    limited = [h for s, h in answers if s == 429]
    assert limited and all("retry-after" in h for h in limited)
    assert all(h["x-ratelimit-limit-requests"] == str(RPM) for s, h in answers if s)
    assert before == {"gateway:h1": 1, "gateway:h2": 1}, before
    assert after == {"gateway:h1": 1, "gateway:h2": 1}, after
    print(f"{admitted} of 30 admitted in {elapsed:.2f} s; Redis connections {before} / {after}")


STATIC_KEY = "sk-limited-0002"
STATIC_RPM = 120


async def _a_keys_host_allowance_on_the_static_share_while_redis_is_down(
    session: aiohttp.ClientSession, hosts: list[Replica], redis: RedisServer
) -> None:
    """SPEC §13 "Redis unreachable → static share", for a key's limit on a host of workers:
    Redis is killed; h1's member refills the host's allowance at the static share (`rpm: 120`
    over 2 hosts: 1 a second, at most 60 held). 80 requests at once over h1's workers run it
    out (429 with Retry-After); then, with Redis still down, the refill admits the key again
    within a few seconds; over the whole time at most 60 plus the refill pass. h1 reports
    degraded, and at rest nothing is in flight or queued."""
    answers: list[tuple[int, dict[str, str]]] = []

    async def split() -> bool:  # idle: the slots split evenly (the static share's)
        return [await _lease_on(session, rep) for rep in hosts] == [2, 2]

    await until(split, 5, "the idle hosts' even split")
    started = time.monotonic()
    redis.stop()

    async def degraded() -> bool:
        state = (await hosts[0].state(session))["cluster"]
        return bool(state["status"] == "degraded")

    await until(degraded, 5, "h1 on its static share")
    answers += await asyncio.gather(*(_limited(session, hosts[0], STATIC_KEY) for _ in range(80)))
    burst = [s for s, _ in answers]

    async def admitted_again() -> bool:
        answers.append(await _limited(session, hosts[0], STATIC_KEY))
        return answers[-1][0] == 200

    refilled = await until(admitted_again, 6, "the key admitted again on the refill")
    elapsed = time.monotonic() - started
    state = (await hosts[0].state(session))["cluster"]
    await until(lambda: _quiet(session, hosts), 10, "quiet")
    statuses = [s for s, _ in answers]
    admitted = statuses.count(200)
    assert set(statuses) <= {200, 429}, statuses
    assert 429 in burst, "80 at once ran the allowance out"
    allowed = STATIC_RPM / 2 + STATIC_RPM / 2 / 60 * elapsed  # the static share, then its refill
    assert admitted <= allowed, f"{admitted} admitted in {elapsed:.1f} s, limit {allowed:.1f}"
    assert all("retry-after" in h for s, h in answers if s == 429)
    assert state["status"] == "degraded"
    print(
        f"{burst.count(200)} of a burst of 80 admitted on the static share, the next"
        f" {refilled:.2f} s later; {admitted} in {elapsed:.2f} s"
    )


async def test_a_hosts_key_allowance_in_one_process_member_handover_and_tokens(
    redis_server: RedisServer,  # noqa: F811
) -> None:
    """The protocol on one memfd in one process, against the real Redis script: two workers'
    rings (`rpm: 6`, `tpm: 1000`) get the same region entry; only the member's sync takes a
    chunk, and both workers spend that one allowance (together at most the key's minute: 6
    requests, whoever asks); usage above a request's token estimate is a debt of the host's
    allowance, usage below it is given back; the other worker, made member, continues from
    the allowance left and the key stays within its minute; a key both rings drop leaves the
    region's table."""
    fd = os.memfd_create("host-allowance", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, _core.REGION_BYTES)
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
    regions = [_core.Region(fd, 2), _core.Region(fd)]
    os.close(fd)

    def share() -> RateShare:
        return RateShare(0.15, 1.5, lambda: None)

    syncs = [RateSync(share(), regions[w], w, share()) for w in (0, 1)]
    rings = [
        SimpleNamespace(tenants=[SimpleNamespace(name="k", limits=KeyLimits(6, 1000))])
        for _ in syncs
    ]
    for sync, ring in zip(syncs, rings, strict=True):
        sync.adopt(ring)  # type: ignore[arg-type]
    limits = [ring.tenants[0].limits for ring in rings]
    assert all(isinstance(lim, HostLeasedLimits) for lim in limits)
    assert limits[0].entry == limits[1].entry and regions[0].tables()[2] == 1
    redis = RedisState(redis_server.url, replica="t", timeout_ms=500)
    started = time.monotonic()
    try:
        with pytest.raises(RateLimited):
            limits[1].admit(10)  # nothing held before the member's first chunk
        await syncs[0].sync(redis)  # the member (worker 0)
        await syncs[1].sync(redis, member=False)  # the other: nothing to sync
        entry = limits[0].entry
        passed = 0
        for n in range(12):
            try:
                charged, headers = limits[n % 2].admit(10)
            except RateLimited as e:
                assert e.retry_after_ms and e.retry_after_ms >= 150
                await syncs[0].sync(redis)  # the refusals size the member's next chunk
                continue
            passed += 1
            assert charged == 10 and headers["x-ratelimit-limit-requests"] == "6"
            before = regions[0].allowance(entry, True)
            limits[n % 2].reconcile(charged, 200 if n == 0 else 5)
            # Usage above the estimate is a debt of the host's; below it, given back.
            assert regions[1].allowance(entry, True) == before - (190 if n == 0 else -5) * 1000
        assert passed == 6, "the key's minute, whoever of the two workers asks"
        # The member role moves to worker 1: it continues from what the host holds, and the
        # key stays within its minute (plus the refill: 6 a minute, under 1 in this test).
        await syncs[1].sync(redis)
        for n in range(6):
            with contextlib.suppress(RateLimited):
                limits[n % 2].admit(1)
                passed += 1
        assert passed <= 6 + 6 / 60 * (time.monotonic() - started)
        rings[1].tenants = []
        syncs[1].adopt(rings[1])  # type: ignore[arg-type]
        assert regions[0].tables()[2] == 1  # worker 0 still has it
        rings[0].tenants = []
        syncs[0].adopt(rings[0])  # type: ignore[arg-type]
        assert regions[0].tables()[2] == 0
    finally:
        await redis.close()


async def test_a_hosts_key_far_from_its_limit_is_not_synced_every_period(
    redis_server: RedisServer,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The member's rate sync makes no Redis call in a period where the host's allowance
    needs nothing (no refusal, held within its sizing, the central level seen less than a
    second ago) — a key far below its limit cost a call every renew period (5 a second) —
    but a refusal brings the call back at once, and so does a central level grown older
    than the bound; what the quiet periods spent is counted in the next exchange."""
    from gateway.cluster import ratelimit

    fd = os.memfd_create("host-quiet", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, _core.REGION_BYTES)
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
    region = _core.Region(fd, 2)
    os.close(fd)
    sync = RateSync(RateShare(0.2, 2.0, lambda: None), region, 0, RateShare(0.2, 2.0, lambda: None))
    ring = SimpleNamespace(tenants=[SimpleNamespace(name="q", limits=KeyLimits(6, None))])
    sync.adopt(ring)  # type: ignore[arg-type]
    limits = ring.tenants[0].limits
    assert isinstance(limits, HostLeasedLimits)
    redis = RedisState(redis_server.url, replica="t", timeout_ms=500)
    try:
        assert await sync.sync(redis)  # the first chunk: half the idle central bucket, 3
        seen = region.central(limits.entry, False)
        assert not await sync.sync(redis)  # held 3 against a central 3: nothing to exchange
        assert region.central(limits.entry, False) == seen  # no call, nothing settled
        for _ in range(3):
            limits.admit(1)
        with pytest.raises(RateLimited):
            limits.admit(1)
        assert await sync.sync(redis)  # the refusal: a chunk at once
        assert region.allowance(limits.entry, False) > 0
        monkeypatch.setattr(ratelimit, "_QUIET_MAX_S", 0.0)
        assert await sync.sync(redis)  # a central level too old: the call again
        assert region.central(limits.entry, False)[1] > seen[1]
        monkeypatch.setattr(ratelimit, "_QUIET_MAX_S", 1.0)
        # A key far below its limit: a few requests' top-up against its standing allowance
        # (half the central bucket) waits while most of that is held; below 3/4, the call.
        big_ring = SimpleNamespace(
            tenants=[SimpleNamespace(name="b", limits=KeyLimits(600_000, None))]
        )
        big_sync = RateSync(
            RateShare(0.2, 2.0, lambda: None), region, 0, RateShare(0.2, 2.0, lambda: None)
        )
        big_sync.adopt(big_ring)  # type: ignore[arg-type]
        big = big_ring.tenants[0].limits
        assert isinstance(big, HostLeasedLimits)
        assert await big_sync.sync(redis)  # 300,000: half the idle central bucket
        _, at_us = region.central(big.entry, False)
        region.set_central(big.entry, False, 600_000 * 1000, at_us)  # as if refilled meanwhile
        for _ in range(10):
            big.admit(1)
        assert not await big_sync.sync(redis)  # 299,990 held of 300,000: no call
        region.allowance_take_upto(big.entry, False, 80_000 * 1000)
        assert await big_sync.sync(redis)  # 219,990 held: below 3/4, topped up
        assert region.allowance(big.entry, False) == 300_000 * 1000
    finally:
        await redis.close()
