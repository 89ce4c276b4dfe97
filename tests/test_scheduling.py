"""SPEC §3 at saturation, observed end to end: one instance with one slot, a slow backend,
requests queued behind a blocker; the order the backend receives them is the grant order."""

from __future__ import annotations

import asyncio
import itertools
import time
from typing import Any

import aiohttp

from gateway.sim.mock import MockServer
from support import (
    GatewayFactory,
    MockFactory,
    RunningGateway,
    chat,
    eventually,
    pool_config,
    simple_config,
)


async def _send(
    gw: RunningGateway, marker: str, priority: str, **kw: Any
) -> tuple[int, dict[str, Any], dict[str, str]]:
    headers = {"X-Priority": priority}
    async with await gw.post("/v1/chat/completions", chat(marker), headers=headers, **kw) as resp:
        return resp.status, await resp.json(), dict(resp.headers)


def _order(m: MockServer) -> str:
    """The grant order as the backend saw it: the first letter of each prompt."""
    return "".join(r["body"]["messages"][0]["content"][0] for r in m.requests)


async def blocker(
    gw: RunningGateway, m: MockServer, text: str = "B", headers: dict[str, str] | None = None
) -> tuple[asyncio.Task[tuple[int, dict[str, Any], dict[str, str]]], asyncio.Event]:
    """A request in flight holding its slot until the event is set (then it ends at once),
    however long the queue behind it takes to build on a loaded machine: a stream paced at
    20 tokens a second for minutes, which its client leaves when told — the gateway sees
    that at its next token and gives the slot back (SPEC §3: the upstream is cancelled).
    Its answer was a 200 stream: (200, {}, headers)."""
    release = asyncio.Event()
    pace = m.behavior.tokens_per_s
    m.configure(tokens_per_s=20)

    async def hold() -> tuple[int, dict[str, Any], dict[str, str]]:
        body = chat(text, stream=True, max_tokens=4096)
        hdrs = {"X-Priority": "high", **(headers or {})}
        async with await gw.post("/v1/chat/completions", body, headers=hdrs) as resp:
            await resp.content.readline()  # streaming: in flight upstream
            await release.wait()
            resp.close()  # leaves mid-stream
            return resp.status, {}, dict(resp.headers)

    task = asyncio.create_task(hold())
    await gw.wait_in_flight(1)
    m.configure(tokens_per_s=pace)
    return task, release


async def _saturate(
    gw: RunningGateway,
    m: MockServer,
    lows: int,
    highs: int,
    first: str = "low",
    hold_s: float = 0.0,
) -> list[asyncio.Task[Any]]:
    """A blocker in flight, then `lows` and `highs` queued behind it, in that order (or highs
    first); the blocker leaves once the queue is built and, with `hold_s`, once everything
    queued has waited that long."""
    held, release = await blocker(gw, m)
    tasks = [held]
    plan = [("L", "low", lows), ("H", "high", highs)]
    if first == "high":
        plan.reverse()
    counts = {"high": 0, "low": 0}
    for letter, prio, n in plan:
        tasks.extend(asyncio.create_task(_send(gw, f"{letter}{i}", prio)) for i in range(n))
        counts[prio] += n
        await gw.wait_queued(counts["high"], counts["low"])
    since = time.monotonic()
    await eventually(lambda: time.monotonic() - since > hold_s, hold_s + 5, "the hold")
    release.set()
    return tasks


async def test_high_overtakes_a_low_backlog(
    mocks: MockFactory, gateway_factory: GatewayFactory
) -> None:
    m = await mocks(latency_ms=40)
    gw = await gateway_factory(simple_config(pool_config((m, 1))))
    tasks = await _saturate(gw, m, lows=5, highs=1)
    results = await asyncio.gather(*tasks)
    assert all(status == 200 for status, _, _ in results)
    assert _order(m) == "BHLLLLL"
    await gw.assert_quiet()


async def test_weighted_grants_seven_high_to_three_low(
    mocks: MockFactory, gateway_factory: GatewayFactory
) -> None:
    m = await mocks(latency_ms=15)
    gw = await gateway_factory(simple_config(pool_config((m, 1))))
    tasks = await _saturate(gw, m, lows=12, highs=14)
    await asyncio.gather(*tasks)
    order = _order(m)[1:]
    # SPEC §3: smooth weighted round-robin 7:3 while both classes wait
    assert order[:20] == "HLHHHLHHLH" * 2
    # then the lone class is served (work-conserving)
    assert order[20:] == "L" * 6
    await gw.assert_quiet()


async def test_strict_policy_with_starvation_guard(
    mocks: MockFactory, gateway_factory: GatewayFactory
) -> None:
    m = await mocks(latency_ms=15)
    config = simple_config(
        pool_config((m, 1)), scheduler={"policy": "strict", "max_consecutive_high": 3}
    )
    gw = await gateway_factory(config)
    tasks = await _saturate(gw, m, lows=3, highs=8)
    await asyncio.gather(*tasks)
    # SPEC §3: at most max_consecutive_high high grants in a row while lows wait, then one low
    assert _order(m)[1:] == "HHHLHHHLHHL"
    await gw.assert_quiet()


async def test_low_wait_bound_forces_one_low_at_a_time(
    mocks: MockFactory, gateway_factory: GatewayFactory
) -> None:
    m = await mocks(latency_ms=100)
    config = simple_config(
        pool_config((m, 1)),
        scheduler={"policy": "strict", "max_consecutive_high": 1000, "max_low_wait_ms": 350},
    )
    gw = await gateway_factory(config)
    # everything queued has waited 0.5 s when the blocker leaves
    tasks = await _saturate(gw, m, lows=3, highs=12, first="low", hold_s=0.5)
    await asyncio.gather(*tasks)
    order = _order(m)[1:]
    lows = [i for i, c in enumerate(order) if c == "L"]
    # the lows waited behind the blocker past the bound: the first grant is forced low;
    # then the bound restarts and each next low comes after ~350 ms, i.e. after 3 (or, on a
    # slow machine, 2) high grants of 100 ms — one forced low per bound, never a run of them
    assert lows[0] == 0, order
    gaps = [b - a - 1 for a, b in itertools.pairwise(lows)]
    assert len(gaps) == 2 and all(g in (2, 3) for g in gaps), order
    await gw.assert_quiet()


async def test_queue_full_spills_then_rejects(
    mocks: MockFactory, gateway_factory: GatewayFactory
) -> None:
    m = await mocks(latency_ms=300)
    config = simple_config(
        pool_config((m, 1)), scheduler={"high": {"capacity": 1}, "low": {"capacity": 1}}
    )
    gw = await gateway_factory(config)
    blocker = asyncio.create_task(_send(gw, "B", "high"))
    await gw.wait_in_flight(1)
    queued = asyncio.create_task(_send(gw, "H0", "high"))
    await gw.wait_queued(1, 0)
    spilled = asyncio.create_task(_send(gw, "H1", "high"))
    await gw.wait_queued(1, 1)  # SPEC §3: high finding high full spills into low
    status, body, headers = await _send(gw, "H2", "high")
    assert status == 503
    assert body["error"]["code"] == "queue_full"
    assert int(headers["Retry-After"]) >= 1
    results = await asyncio.gather(blocker, queued, spilled)
    assert [s for s, _, _ in results] == [200, 200, 200]
    assert results[2][2]["X-Gateway-Priority"] == "low"  # it waited as low
    assert "H2" not in _order(m)
    await gw.assert_quiet()


async def test_queue_timeout(mocks: MockFactory, gateway_factory: GatewayFactory) -> None:
    m = await mocks(latency_ms=800)
    config = simple_config(pool_config((m, 1)), scheduler={"high": {"max_wait_ms": 150}})
    gw = await gateway_factory(config)
    blocker = asyncio.create_task(_send(gw, "B", "high"))
    await gw.wait_in_flight(1)
    t0 = time.monotonic()
    status, body, headers = await _send(gw, "H0", "high")
    waited = time.monotonic() - t0
    assert status == 503 and body["error"]["code"] == "queue_timeout"
    assert int(headers["Retry-After"]) >= 1
    assert 0.1 < waited < 0.7
    assert (await blocker)[0] == 200
    assert _order(m) == "B"
    await gw.assert_quiet()


async def test_client_leaving_the_queue_never_reaches_upstream(
    mocks: MockFactory, gateway_factory: GatewayFactory
) -> None:
    m = await mocks(latency_ms=400)
    gw = await gateway_factory(simple_config(pool_config((m, 1))))
    blocker = asyncio.create_task(_send(gw, "B", "high"))
    await gw.wait_in_flight(1)
    async with aiohttp.ClientSession() as s:
        try:
            async with s.post(
                gw.url + "/v1/chat/completions",
                json=chat("GONE"),
                timeout=aiohttp.ClientTimeout(total=0.1),
            ):
                pass
        except TimeoutError:
            pass
    # SPEC §3: removed at once; it no longer counts toward depth
    await gw.wait_queued(0, 0, within=1.0)
    state = (await gw.state())["pools"]["p"]
    assert state["in_flight"] == 1 and state["cancelled"] == 1
    assert (await blocker)[0] == 200
    # The cancelled request never reached the backend: it saw only the blocker.
    assert _order(m) == "B"
    await gw.assert_quiet()


async def test_max_concurrency_is_never_exceeded(
    mocks: MockFactory, gateway_factory: GatewayFactory
) -> None:
    a = await mocks(latency_ms=30, latency_dist="exponential", seed=1)
    b = await mocks(latency_ms=30, latency_dist="exponential", seed=2)
    gw = await gateway_factory(simple_config(pool_config((a, 2), (b, 3))))
    results = await asyncio.gather(*(_send(gw, f"x{i}", "high") for i in range(40)))
    assert [s for s, _, _ in results] == [200] * 40
    assert a.stats.peak_in_flight == 2 and b.stats.peak_in_flight == 3
    # least connections by ratio spreads load over both
    assert a.stats.requests_total + b.stats.requests_total == 40
    assert min(a.stats.requests_total, b.stats.requests_total) >= 10
    await gw.assert_quiet()


async def test_client_leaving_mid_stream_cancels_the_upstream(
    mocks: MockFactory, gateway_factory: GatewayFactory
) -> None:
    m = await mocks(tokens_per_s=20, default_tokens=100)
    gw = await gateway_factory(simple_config(pool_config((m, 1))))
    async with aiohttp.ClientSession() as s:
        resp = await s.post(gw.url + "/v1/chat/completions", json=chat("S", stream=True))
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        assert resp.headers["X-Accel-Buffering"] == "no"
        await resp.content.readline()
        resp.close()
    deadline = time.monotonic() + 3
    while m.stats.cancelled < 1:
        assert time.monotonic() < deadline, "the upstream generation was not cancelled"
        await asyncio.sleep(0.02)
    await gw.assert_quiet()
