"""SPEC §7: "An upstream **429** (or 503) with `Retry-After` cools that instance (§6) and the
request is retried on another; when none is left the client gets **429 `rate_limited`** (an
upstream quota, e.g. OpenAI's) or 503 with the computed `Retry-After` — never a 502 without
one, so SDKs back off."

Real servers on 127.0.0.1: the project's mock, and a tiny OpenAI-like backend that answers 429
the way OpenAI does (`Retry-After`, a message naming the limit); the official openai client
where the client's view is the point. After each test the gateway is quiet (0 in flight, 0
queued)."""

from __future__ import annotations

import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import openai
import pytest
from aiohttp import web

from gateway.sim.mock import MockServer
from support import GatewayFactory, MockFactory, RunningGateway, chat, pool_config

UPSTREAM_KEY = "sk-upstream-quota-key-0123456789"


class QuotaServer:
    """An upstream answering every completion with `status` (OpenAI's quota answer by
    default): `Retry-After: retry_after` when given, and a body quoting the key it was sent
    and its own address (neither may reach the client)."""

    def __init__(self, status: int = 429, retry_after: str | None = "7") -> None:
        self.status = status
        self.retry_after = retry_after
        self.hits = 0
        self._runner: web.AppRunner | None = None
        self.port = 0

    async def _completion(self, request: web.Request) -> web.Response:
        self.hits += 1
        await request.read()
        auth = request.headers.get("Authorization", "")
        body = {
            "error": {
                "message": "Rate limit reached for gpt-4o on requests per min (RPM): Limit 3, "
                f"Used 3, Requested 1. Sent with {auth} to {request.host}.",
                "type": "requests",
                "param": None,
                "code": "rate_limit_exceeded",
            }
        }
        headers = {"Retry-After": self.retry_after} if self.retry_after is not None else {}
        return web.json_response(body, status=self.status, headers=headers)

    async def start(self) -> None:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self._completion)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = self._runner.addresses[0][1]

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    def instance(self, name: str) -> dict[str, Any]:
        return {
            "name": name,
            "url": f"http://127.0.0.1:{self.port}/v1",
            "model": "gpt-4o",
            "api_key": UPSTREAM_KEY,
            "max_concurrency": 4,
        }


QuotaFactory = Callable[..., Awaitable[QuotaServer]]


@pytest.fixture
async def quota() -> AsyncIterator[QuotaFactory]:
    started: list[QuotaServer] = []

    async def start(**kw: Any) -> QuotaServer:
        server = QuotaServer(**kw)
        await server.start()
        started.append(server)
        return server

    yield start
    for server in started:
        await server.stop()


def config(*pools: tuple[str, list[dict[str, Any]]], **extra: Any) -> dict[str, Any]:
    """Pools in order, each falling back to the next; alias `m` on the first. Failures never
    eject here (the threshold is high): what the client sees comes from the upstream's pause."""
    out: dict[str, Any] = {
        "pools": {},
        "models": {"m": {"pool": pools[0][0]}},
        "health": {"failure_threshold": 10, "max_ejection_ms": 60_000},
        "timeouts": {"first_byte_ms": 2000, "stream_idle_ms": 2000, "total_ms": 5000},
        **extra,
    }
    for k, (name, instances) in enumerate(pools):
        out["pools"][name] = {"instances": instances}
        if k + 1 < len(pools):
            out["pools"][name]["fallback"] = pools[k + 1][0]
    return out


async def _post(gw: RunningGateway, **body: Any) -> tuple[int, dict[str, Any], Any, float]:
    t0 = time.monotonic()
    async with await gw.post("/v1/chat/completions", chat(**body)) as resp:
        data = await resp.json()
        return resp.status, data, resp.headers, time.monotonic() - t0


def _states(state: dict[str, Any], pool: str = "p") -> dict[str, str]:
    return {i["name"]: i["state"] for i in state["pools"][pool]["instances"]}


async def _metric(gw: RunningGateway, name: str, **labels: str) -> float:
    """The sum of the series of `name` whose labels include `labels`."""
    async with gw.session.get(gw.url + "/metrics") as resp:
        assert resp.status == 200
        text = await resp.text()
    total = 0.0
    for m in re.finditer(rf"^{name}\{{([^}}]*)\}} (\S+)$", text, re.M):
        have = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1)))
        if all(have.get(k) == v for k, v in labels.items()):
            total += float(m.group(2))
    return total


async def test_every_instance_at_its_quota_answers_429_with_retry_after(
    quota: QuotaFactory, gateway_factory: GatewayFactory
) -> None:
    a, b = await quota(retry_after="7"), await quota(retry_after="7")
    gw = await gateway_factory(config(("p", [a.instance("qa"), b.instance("qb")])))
    rejected = await _metric(gw, "gateway_rejections_total", reason="rate_limited")
    answered = await _metric(gw, "gateway_requests_total", code="429")

    status, body, headers, _ = await _post(gw)
    assert status == 429, body
    err = body["error"]
    assert (err["code"], err["type"]) == ("rate_limited", "rate_limit_error")
    assert 6 <= int(headers["Retry-After"]) <= 7
    # the client learns which limit it hit, never the key the gateway sent upstream
    assert "requests per min" in err["message"]
    assert "retry after 7s" in err["message"]  # what the Batch API reads
    assert UPSTREAM_KEY not in str(body) and "quota-key" not in str(body)
    assert f"127.0.0.1:{a.port}" not in err["message"]  # nor where the instance is
    # each instance tried once (SPEC §6: retried on another, never the same)
    assert (a.hits, b.hits) == (1, 1)
    assert _states(await gw.state()) == {"qa": "cooling", "qb": "cooling"}

    # arriving while everything cools: the same answer at once, nothing sent upstream
    status, body, headers, took = await _post(gw)
    assert status == 429 and body["error"]["code"] == "rate_limited", body
    assert 1 <= int(headers["Retry-After"]) <= 7
    assert took < 1.0
    assert (a.hits, b.hits) == (1, 1)

    # counted like every rejection, and under the status the client got
    assert await _metric(gw, "gateway_rejections_total", reason="rate_limited") == rejected + 2
    assert await _metric(gw, "gateway_requests_total", code="429") == answered + 2
    await gw.assert_quiet()


async def test_a_429_is_retried_on_an_instance_with_room(
    quota: QuotaFactory, mocks: MockFactory, gateway_factory: GatewayFactory
) -> None:
    limited = await quota(retry_after="7")
    ok = await mocks()
    gw = await gateway_factory(
        config(("p", [limited.instance("limited"), pool_config(ok)["instances"][0]]))
    )
    statuses = [(await _post(gw))[0] for _ in range(5)]
    assert statuses == [200] * 5
    assert limited.hits <= 1 and ok.stats.requests_total == 5
    await gw.assert_quiet()


async def test_a_retry_that_finds_the_rest_cooling_is_answered_now(
    quota: QuotaFactory, mocks: MockFactory, gateway_factory: GatewayFactory
) -> None:
    """One instance is paused by its quota, the other fails (500): a request whose attempt on
    the failing one leaves only the paused one is answered 429 at once — not held in the
    queue until the 7 s pause ends."""
    limited = await quota(retry_after="7")
    broken = await mocks(fail_rate=1.0, fail_status=500)
    gw = await gateway_factory(
        config(("p", [limited.instance("limited"), pool_config(broken)["instances"][0]]))
    )
    await _post(gw)  # 502 or 429 as the order of the two attempts falls: either way, paused
    assert _states(await gw.state())["limited"] == "cooling"
    for _ in range(3):
        status, body, headers, took = await _post(gw)
        assert status == 429 and body["error"]["code"] == "rate_limited", body
        # the earliest instance it could use is the failing one, not ejected: there now
        assert headers["Retry-After"] == "1"
        assert took < 2.0
    assert limited.hits == 1 and broken.stats.requests_total == 4
    await gw.assert_quiet()


async def test_fallback_pool_serves_when_the_primary_is_at_its_quota(
    quota: QuotaFactory, mocks: MockFactory, gateway_factory: GatewayFactory
) -> None:
    limited = await quota(retry_after="7")
    spare = await mocks()
    gw = await gateway_factory(
        config(("p", [limited.instance("limited")]), ("spare", pool_config(spare)["instances"]))
    )
    for _ in range(3):
        status, _, headers, _ = await _post(gw)
        assert status == 200 and headers["X-Gateway-Pool"] == "spare"
    assert limited.hits == 1  # cooling: later requests go straight to the fallback
    await gw.assert_quiet()


async def test_retry_after_is_the_earliest_instance_of_pool_and_fallback(
    quota: QuotaFactory, gateway_factory: GatewayFactory
) -> None:
    slow, soon = await quota(retry_after="30"), await quota(retry_after="3")
    gw = await gateway_factory(
        config(("p", [slow.instance("slow")]), ("spare", [soon.instance("soon")]))
    )
    status, body, headers, _ = await _post(gw)
    assert status == 429 and body["error"]["code"] == "rate_limited", body
    assert 2 <= int(headers["Retry-After"]) <= 3
    assert (slow.hits, soon.hits) == (1, 1)
    await gw.assert_quiet()


async def test_retry_after_is_clamped_to_max_ejection(
    quota: QuotaFactory, gateway_factory: GatewayFactory
) -> None:
    a = await quota(retry_after="86400")
    gw = await gateway_factory(
        config(
            ("p", [a.instance("a")]),
            health={"failure_threshold": 10, "ejection_ms": 1000, "max_ejection_ms": 4000},
        )
    )
    status, _, headers, _ = await _post(gw)
    assert status == 429 and 3 <= int(headers["Retry-After"]) <= 4
    await gw.assert_quiet()


async def test_an_upstream_503_with_retry_after_answers_503_with_retry_after(
    mocks: MockFactory, gateway_factory: GatewayFactory
) -> None:
    a = await mocks(fail_rate=1.0, fail_status=503, retry_after_s=5)
    b = await mocks(fail_rate=1.0, fail_status=503, retry_after_s=5)
    gw = await gateway_factory(config(("p", pool_config(a, b)["instances"])))
    rejected = await _metric(gw, "gateway_rejections_total", reason="no_healthy_instance")
    for _ in range(2):  # after the attempts, then on arrival while both cool
        status, body, headers, _ = await _post(gw)
        assert status == 503 and body["error"]["code"] == "no_healthy_instance", body
        assert 4 <= int(headers["Retry-After"]) <= 5
    assert (a.stats.requests_total, b.stats.requests_total) == (1, 1)
    assert set(_states(await gw.state()).values()) == {"cooling"}
    assert await _metric(gw, "gateway_rejections_total", reason="no_healthy_instance") == (
        rejected + 2
    )
    await gw.assert_quiet()


async def test_a_429_without_retry_after_is_still_a_429_with_one(
    quota: QuotaFactory, gateway_factory: GatewayFactory
) -> None:
    """No pause was asked for, so nothing cools; the upstream's quota answer still reaches the
    client as 429 `rate_limited`, with Retry-After: 1 (the earliest instance is there now)."""
    a, b = await quota(retry_after=None), await quota(retry_after=None)
    gw = await gateway_factory(config(("p", [a.instance("qa"), b.instance("qb")])))
    status, body, headers, _ = await _post(gw)
    assert status == 429 and body["error"]["code"] == "rate_limited", body
    assert headers["Retry-After"] == "1"
    assert (a.hits, b.hits) == (1, 1)
    assert _states(await gw.state()) == {"qa": "healthy", "qb": "healthy"}
    # not cooling: the next request is tried upstream again
    assert (await _post(gw))[0] == 429
    assert a.hits + b.hits == 4
    await gw.assert_quiet()


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
async def test_the_openai_client_raises_rate_limit_error_with_retry_after(
    mocks: MockFactory, gateway_factory: GatewayFactory, stream: bool
) -> None:
    limited: list[MockServer] = [
        await mocks(fail_rate=1.0, fail_status=429, retry_after_s=7) for _ in range(2)
    ]
    gw = await gateway_factory(config(("p", pool_config(*limited)["instances"])))
    async with openai.AsyncOpenAI(base_url=gw.base_url, api_key="k", max_retries=0) as client:
        for _ in range(2):  # after the attempts, then on arrival while both cool
            with pytest.raises(openai.RateLimitError) as caught:
                await client.chat.completions.create(
                    model="m", messages=[{"role": "user", "content": "x"}], stream=stream
                )
            err = caught.value
            assert err.status_code == 429 and err.code == "rate_limited"
            assert 1 <= int(err.response.headers["retry-after"]) <= 7
    assert [m.stats.requests_total for m in limited] == [1, 1]
    await gw.assert_quiet()
