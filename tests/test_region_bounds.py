"""SPEC §12 "Bounded and reclaimed": the workers' shared region never fills up — cells of
removed instances, idle tenants and closed pools are reclaimed — and a region file of the
wrong size or without its seals is refused with a clear error (a short one used to SIGBUS the
process).

The table tests run two workers' pools in one process on one memfd (fast, exact); one test
reloads a real `gateway serve --workers 2` through `POST /admin/reload` past the old limits."""

from __future__ import annotations

import asyncio
import fcntl
import os
import time
from pathlib import Path

import pytest

from gateway import _core
from gateway._core import Outcome, Priority
from gateway.sim.mock import MockServer
from support import MockFactory
from test_workers import _write, workers

# Instance names through HTTP: the region refused the 128th before cells were reclaimed.
LAST = 150


SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW


def _memfd(size: int, *, sealing: bool = True) -> int:
    fd = os.memfd_create("region-test", os.MFD_CLOEXEC | (os.MFD_ALLOW_SEALING if sealing else 0))
    os.ftruncate(fd, size)
    return fd


def _region(workers: int = 2) -> _core.Region:
    fd = _memfd(_core.REGION_BYTES)
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
    return _core.Region(fd, workers)


# ---- the fd ---------------------------------------------------------------------------------


@pytest.mark.parametrize("size", [4096, _core.REGION_BYTES - 8, _core.REGION_BYTES + 4096])
def test_a_region_file_of_the_wrong_size_is_refused(size: int) -> None:
    fd = _memfd(size)
    try:
        for workers in (2, None):  # the supervisor's init and a worker's attach alike
            with pytest.raises(ValueError, match=f"shared region file is {size} bytes") as e:
                _core.Region(fd, workers)
            assert f"region is {_core.REGION_BYTES} bytes" in str(e.value)
    finally:
        os.close(fd)


def test_a_region_file_without_its_seals_is_refused_by_a_worker_and_sealed_by_init() -> None:
    fd = _memfd(_core.REGION_BYTES)
    other = _memfd(_core.REGION_BYTES, sealing=False)
    try:
        # A worker attaching to an unsealed file refuses it (it could shrink under it).
        with pytest.raises(ValueError, match="not sealed against shrinking and growing"):
            _core.Region(fd)
        # The supervisor seals a memfd that allows it, then works on it.
        region = _core.Region(fd, 2)
        assert fcntl.fcntl(fd, fcntl.F_GET_SEALS) & SEALS == SEALS
        assert _core.Region(fd).workers == region.workers == 2
        # One that cannot be sealed is refused even to the supervisor.
        with pytest.raises(ValueError, match="not sealed"):
            _core.Region(other, 2)
    finally:
        os.close(fd)
        os.close(other)


# ---- the tables, two workers in one process ------------------------------------------------


def _pool(region: _core.Region, worker: int) -> _core.Pool:
    pool = _core.Pool(_core.PoolConfig())
    pool.attach(region, 42, worker)
    return pool


def test_five_hundred_renames_leave_the_region_bounded() -> None:
    """A reload loop renaming the one instance 500 times, requests running across each
    reload: the pool's instance cells stay at most two (old draining, new) and drop to one
    once the old drained; every reload works (the old limit was 128 names)."""
    region = _region()
    pools = [_pool(region, 0), _pool(region, 1)]
    idx = [p.add_instance(2, 1000) for p in pools]
    ticket = 0
    for name in range(1001, 1501):
        ticket += 1
        assert pools[0].submit(ticket, Priority.HIGH, name) == idx[0]
        for w, pool in enumerate(pools):
            pool.remove_instance(idx[w])
            idx[w] = pool.add_instance(2, name)  # raised "region is full" at the 128th
        ticket += 1
        assert pools[1].submit(ticket, Priority.HIGH, name) == idx[1]
        cells = region.tables()[0]
        assert cells == [2], cells
        pools[0].release(ticket - 1, Outcome.SUCCESS, name)
        pools[1].release(ticket, Outcome.SUCCESS, name)
        for pool in pools:
            pool.tick(name)
        assert region.tables()[0] == [1]
        assert all(p.instance_count <= 2 for p in pools)


def test_a_thousand_tenants_leave_the_tenant_table_bounded() -> None:
    """1,000 tenants (a thousand batch owners, or keys) through two workers: the tenant
    table never grows past its 63 entries — idle ones are swept when it is full — so every
    tenant gets an entry of its own (the core's test checks the overflow count stays 0)."""
    region = _region()
    pools = [_pool(region, 0), _pool(region, 1)]
    for p in pools:
        p.add_instance(1, 7)
    most = 0
    for tenant in range(1, 1001):
        pool = pools[tenant % 2]
        first, second = 2 * tenant, 2 * tenant + 1
        assert pool.submit(first, Priority.LOW, tenant, tenant=tenant) is not None
        assert pool.submit(second, Priority.LOW, tenant, tenant=tenant) is None  # waits
        most = max(most, region.tables()[1][0])
        events = pool.release(first, Outcome.SUCCESS, tenant)
        assert [e.ticket for e in events] == [second]
        pool.release(second, Outcome.SUCCESS, tenant)
    assert most <= 63, most
    assert region.tables()[1][0] <= 63


def test_a_hundred_pool_renames_leave_the_region_bounded() -> None:
    """A reload loop renaming the *pool* 100 times (the region held 32 pool names per start):
    each closed pool detaches in both workers and its place and cells go back, while a pool
    of the same name still in use keeps them."""
    region = _region()
    for name in range(100, 200):
        pools = [_core.Pool(_core.PoolConfig()) for _ in range(2)]
        for w, pool in enumerate(pools):
            pool.attach(region, name, w)  # raised "region is full" at the 33rd name
            assert pool.add_instance(2, 7) == 0
            assert pool.submit(1, Priority.HIGH, name) == 0
        assert len(region.tables()[0]) == 1, "the one pool of this name, nothing older"
        for pool in pools:
            pool.release(1, Outcome.SUCCESS, name)
            pool.detach()
            pool.detach()  # idempotent
        assert region.tables() == ([], [], 0)


def test_a_closing_pool_leaves_nothing_its_successor_of_the_same_name_uses() -> None:
    """A worker holds two pools of one name while a removed one drains beside its re-added
    successor: the first to close leaves no cell the other uses (the cap still counts the
    successor's attempt), and the last to close frees the place."""
    region = _region()
    old, new, peer = _pool(region, 0), _pool(region, 0), _pool(region, 1)
    for pool in (old, new, peer):
        pool.add_instance(1, 7)  # max_concurrency 1, one cell for all three
    assert old.submit(1, Priority.HIGH, 0) == 0
    old.release(1, Outcome.SUCCESS, 1)
    old.remove_instance(0)
    assert new.submit(2, Priority.HIGH, 2) == 0  # worker 0 holds the instance's one unit
    old.tick(3)
    old.detach()
    assert region.tables()[0] == [1], "the successor's cell stays"
    assert peer.submit(3, Priority.HIGH, 4) is None, "the cap still sees worker 0's attempt"
    assert peer.cancel(3)
    new.release(2, Outcome.SUCCESS, 5)
    new.detach()
    assert region.tables()[0] == [1], "worker 1 still uses the pool"
    assert peer.submit(4, Priority.HIGH, 6) == 0
    peer.release(4, Outcome.SUCCESS, 7)
    peer.detach()
    assert region.tables() == ([], [], 0)


def test_key_entries_are_left_and_reclaimed_with_a_dead_worker() -> None:
    region = _region()
    slots = [region.key_slot(k, 0) for k in range(600)]
    assert slots.count(None) == 600 - _core.MAX_KEYS, "a full table refuses, nothing breaks"
    for k, slot in enumerate(slots[:100]):
        assert slot is not None and region.key_slot(k, 1) == slot
    assert region.reclaim(0) == 0
    assert region.tables()[2] == 100, "worker 1 still has the first hundred"
    for slot in slots[:100]:
        assert slot is not None and region.leave_key(slot, 1)
    assert region.tables()[2] == 0


# ---- through HTTP: reloads keep working past the old limit ---------------------------------


async def test_reloads_keep_renaming_instances_past_the_old_limit(
    tmp_path: Path, mocks: MockFactory
) -> None:
    """150 renames by `POST /admin/reload` to a `--workers 2` gateway (the region used to
    refuse the reload that brought the 128th name): every reload is applied and the renamed
    instance serves through both workers."""
    m: MockServer = await mocks()

    def one(name: int) -> str:
        return f'      - {{name: r{name}, url: "{m.url}", model: up, max_concurrency: 2}}'

    async with workers(tmp_path, 2, one(0)) as gw:
        port = int(gw.url.rsplit(":", 1)[1])
        path = tmp_path / "gateway.yaml"
        started = time.monotonic()
        for name in range(1, LAST + 1):
            _write(path, port, one(name))
            async with gw.session.post(gw.url + "/admin/reload") as r:
                assert r.status == 200, f"reload {name}: {await r.text()}"
            if name % 50 == 0:
                results = await asyncio.gather(*(gw.chat() for _ in range(6)))
                assert all(r.status == 200 for r in results), [r.status for r in results]

        # Both workers end on the last name (fresh connections reach either).
        deadline = time.monotonic() + 15
        seen: set[int] = set()
        while len(seen) < 2:
            doc = await gw.state()
            names = {i["name"] for i in doc["pools"]["p"]["instances"] if not i["removed"]}
            if names == {f"r{LAST}"}:
                seen.add(doc["worker"])
            assert time.monotonic() < deadline, f"a worker never reached r{LAST}: {names}"
        print(f"{LAST} reloads in {time.monotonic() - started:.1f} s")
        results = await asyncio.gather(*(gw.chat() for _ in range(8)))
        assert all(r.status == 200 for r in results), [r.status for r in results]
        await gw.assert_quiet()


async def test_reloads_keep_renaming_pools_past_the_old_limit(
    tmp_path: Path, mocks: MockFactory
) -> None:
    """100 pool renames by `POST /admin/reload` to a `--workers 2` gateway (the region held 32
    pool names per start: the 31st rename was refused): every reload is applied, each closed
    pool gives its place back, and the last pool (named `p` again) serves through both
    workers."""
    m: MockServer = await mocks()
    instance = f'      - {{name: i, url: "{m.url}", model: up, max_concurrency: 2}}'

    async with workers(tmp_path, 2, instance) as gw:

        async def on(pool: str) -> None:
            """Until both workers run `pool` alone (the other applies a reload a moment after
            the one asked: meanwhile requests queued in its old pool would get the removed
            pool's 503, SPEC §8)."""
            deadline = time.monotonic() + 15
            seen: set[int] = set()
            while len(seen) < 2:
                doc = await gw.state()
                if set(doc["pools"]) == {pool}:
                    seen.add(doc["worker"])
                assert time.monotonic() < deadline, f"a worker never reached {pool}: {doc}"

        port = int(gw.url.rsplit(":", 1)[1])
        path = tmp_path / "gateway.yaml"
        for n, pool in enumerate([*(f"p{k}" for k in range(1, 101)), "p"], 1):
            _write(path, port, instance, pool=pool)
            async with gw.session.post(gw.url + "/admin/reload") as r:
                assert r.status == 200, f"reload {n} ({pool}): {await r.text()}"
            if n % 25 == 0 or pool == "p":
                await on(pool)
                results = await asyncio.gather(*(gw.chat() for _ in range(6)))
                assert all(r.status == 200 for r in results), [r.status for r in results]
        await gw.assert_quiet()


async def test_a_reload_beyond_the_regions_pools_is_refused_whole(
    tmp_path: Path, mocks: MockFactory
) -> None:
    """With `--workers 2` the region holds 32 pools at once (live plus draining): a reload that
    would make a 33rd is refused with its reason, like an invalid config (never a 500, never
    half applied), and the running config keeps serving."""
    m: MockServer = await mocks()
    instance = f'      - {{name: i, url: "{m.url}", model: up, max_concurrency: 2}}'

    async with workers(tmp_path, 2, instance) as gw:
        port = int(gw.url.rsplit(":", 1)[1])
        lines = [
            f"listen: {{host: 127.0.0.1, port: {port}}}",
            "shutdown: {drain_timeout_ms: 5000, drain_delay_ms: 0}",
            "pools:",
        ]
        for k in range(33):
            lines += [f"  p{k}:", "    instances:", instance.replace("name: i,", f"name: i{k},")]
        lines += ["models:", "  m: {pool: p0}"]
        path = tmp_path / "gateway.yaml"
        tmp = path.with_suffix(".tmp")
        tmp.write_text("\n".join(lines) + "\n")
        os.replace(tmp, path)
        async with gw.session.post(gw.url + "/admin/reload") as r:
            body = await r.text()
            assert r.status != 200 and r.status < 500, (r.status, body)
            assert "cannot add a pool" in body, body
        doc = await gw.state()
        assert len(doc["pools"]) == 1, sorted(doc["pools"])
        results = await asyncio.gather(*(gw.chat() for _ in range(4)))
        assert all(r.status == 200 for r in results), [r.status for r in results]
        await gw.assert_quiet()
