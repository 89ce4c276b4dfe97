"""The clock as a value: a `Pool` handed a manual clock reads the time and arms its wake-up
timer on it, so what waits in the queue (SPEC §3 `max_wait_ms`) expires when that clock says,
not when the wall clock does — and so does a whole gateway whose `Server` (the composition
root) was handed that clock."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import pytest
import yaml

from gateway._core import Outcome, Priority
from gateway.clock import LOOP_CLOCK, ManualClock, now_ms
from gateway.config import Config, parse_config
from gateway.errors import QueueTimeout
from gateway.events import Events
from gateway.pool import Pool
from gateway.server import Server
from support import MockFactory, chat, eventually, pool_config, simple_config


def _config(max_wait_ms: int) -> Config:
    return parse_config(
        yaml.safe_dump(
            {
                "pools": {
                    "p": {
                        "instances": [
                            {
                                "name": "a",
                                "url": "http://127.0.0.1:9",
                                "model": "x",
                                "max_concurrency": 1,
                            }
                        ]
                    }
                },
                "models": {"m": {"pool": "p"}},
                "scheduler": {"high": {"max_wait_ms": max_wait_ms}},
            }
        ),
        env={},
    )


async def test_a_queued_request_expires_on_the_pools_clock() -> None:
    cfg = _config(60_000)  # a minute: the wall clock never gets there in this test
    clock = ManualClock()
    pool = Pool("p", cfg.pools["p"], cfg, Events(), clock=clock)
    try:
        assert (await pool.acquire(1, Priority.HIGH))[0] == 0
        waiting = asyncio.ensure_future(pool.acquire(2, Priority.HIGH))
        await asyncio.sleep(0)
        assert pool.snapshot().queued_high == 1
        assert clock.pending, "the pool's wake-up is armed on its clock"
        clock.advance(59_000)
        await asyncio.sleep(0)
        assert not waiting.done()  # 59 s on the pool's clock: still within max_wait_ms
        clock.advance(1_001)
        with pytest.raises(QueueTimeout):
            await asyncio.wait_for(waiting, 1)
        snap = pool.snapshot()
        assert snap.queued_high == 0 and snap.in_flight == 1
        pool.release(1, Outcome.SUCCESS)
        assert pool.snapshot().in_flight == 0
    finally:
        await pool.close()


def test_the_real_clock_is_the_module_function() -> None:
    """On the hot path a clock call costs what `now_ms()` did: the real clock's `now_ms` is
    that function, not a bound method around it."""
    assert LOOP_CLOCK.now_ms is now_ms
    assert abs(LOOP_CLOCK.now_ms() - now_ms()) <= 1


def test_the_manual_clock_runs_what_comes_due_in_order() -> None:
    clock = ManualClock(0)
    ran: list[tuple[str, int]] = []
    clock.call_later(30, lambda: ran.append(("b", clock.now_ms())))
    clock.call_later(10, lambda: clock.call_later(5, lambda: ran.append(("a", clock.now_ms()))))
    dropped = clock.call_later(20, lambda: ran.append(("x", clock.now_ms())))
    dropped.cancel()
    clock.advance(29)
    assert ran == [("a", 15)] and clock.now_ms() == 29
    clock.advance(1)
    assert ran == [("a", 15), ("b", 30)] and clock.pending == []


async def test_the_servers_clock_reaches_the_pools_through_http(mocks: MockFactory) -> None:
    """The composition root hands its clock down: a gateway served on a manual clock answers
    a queued request 503 `queue_timeout` when that clock passes `max_wait_ms` (a minute),
    while the request ahead of it, on the wall clock, is still being served."""
    m = await mocks(latency_ms=400)
    config = simple_config(
        pool_config((m, 1)),
        scheduler={"high": {"max_wait_ms": 60_000}},
        health={"probe": {"enabled": False}},
    )
    clock = ManualClock()
    server = Server(parse_config(yaml.safe_dump(config), env={}), port=0, clock=clock)
    await server.start()
    url = server.url + "/v1/chat/completions"
    try:
        async with aiohttp.ClientSession() as session:

            async def ask() -> tuple[int, dict[str, Any]]:
                async with session.post(url, json=chat()) as r:
                    return r.status, await r.json()

            first = asyncio.ensure_future(ask())
            pool = server.gateway.runtime.pools["p"]
            await eventually(lambda: pool.snapshot().in_flight == 1)
            second = asyncio.ensure_future(ask())
            await eventually(lambda: pool.snapshot().queued_high == 1)
            clock.advance(60_001)
            status, body = await asyncio.wait_for(second, 2)
            assert (status, body["error"]["code"]) == (503, "queue_timeout")
            assert not first.done()  # 400 ms on the wall clock
            assert (await first)[0] == 200
        snap = pool.snapshot()
        assert snap.in_flight == 0 and snap.queued_high == 0 and snap.queued_low == 0
    finally:
        await server.shutdown(drain=False)
