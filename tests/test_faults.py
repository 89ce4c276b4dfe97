"""SPEC §6 under injected faults: users notice nothing while healthy capacity remains, and get
a fast honest answer when none does. After each test every counter is back to zero."""

from __future__ import annotations

import asyncio
import logging
import re
import select
import socket
import time
from typing import Any

import openai
import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gateway.events import RequestFinished
from gateway.sim.mock import MockServer
from hostile import head, sse_events
from support import GatewayFactory, MockFactory, RunningGateway, chat, eventually, pool_config


def two_pool_config(primary: dict[str, Any], **extra: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "pools": {"p": primary},
        "models": {"m": {"pool": "p"}},
        "health": {"failure_threshold": 2, "ejection_ms": 400, "max_ejection_ms": 3000},
        "timeouts": {"first_byte_ms": 400, "stream_idle_ms": 300, "total_ms": 5000},
    }
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            base[key] = {**base[key], **value}
        else:
            base[key] = value
    return base


async def _post(
    gw: RunningGateway, body: dict[str, Any] | None = None
) -> tuple[int, dict[str, Any], Any]:
    async with await gw.post("/v1/chat/completions", body or chat()) as resp:
        return resp.status, await resp.json(), resp.headers


def _instance(state: dict[str, Any], mock: MockServer, pool: str = "p") -> dict[str, Any]:
    for inst in state["pools"][pool]["instances"]:
        if inst["name"].startswith(f"m{mock.port}-"):
            return inst  # type: ignore[no-any-return]
    raise KeyError(mock.port)


async def test_crash_mid_run_is_invisible_and_ejects(
    mocks: MockFactory, gateway_factory: GatewayFactory
) -> None:
    a, b = await mocks(), await mocks()
    gw = await gateway_factory(two_pool_config(pool_config(a, b)))
    for _ in range(6):
        assert (await _post(gw))[0] == 200
    await a.set_down(True)  # the port now refuses
    statuses = [(await _post(gw))[0] for _ in range(20)]
    assert statuses == [200] * 20
    inst = _instance(await gw.state(), a)
    assert inst["state"] == "ejected" and inst["ejections"] >= 1
    await gw.assert_quiet()


async def test_hang_past_first_byte_timeout_is_retried_elsewhere(
    mocks: MockFactory, gateway_factory: GatewayFactory
) -> None:
    hang = await mocks(fail_rate=1.0, fail_mode="hang")
    ok = await mocks()
    gw = await gateway_factory(two_pool_config(pool_config(hang, ok)))
    t0 = time.monotonic()
    results = [await _post(gw) for _ in range(4)]
    assert [r[0] for r in results] == [200] * 4
    # at most failure_threshold attempts hit the hanging instance before it is ejected
    assert hang.stats.requests_total == 2
    assert time.monotonic() - t0 < 3
    await gw.assert_quiet()


async def test_only_a_hanging_instance_gives_504(
    mocks: MockFactory, gateway_factory: GatewayFactory
) -> None:
    hang = await mocks(fail_rate=1.0, fail_mode="hang")
    gw = await gateway_factory(two_pool_config(pool_config(hang)))
    status, body, _ = await _post(gw)
    assert status == 504 and body["error"]["code"] == "upstream_timeout"
    await gw.assert_quiet()


async def test_slow_but_within_limits_is_not_retried(
    mocks: MockFactory, gateway_factory: GatewayFactory
) -> None:
    slow, other = await mocks(latency_ms=250), await mocks()
    gw = await gateway_factory(
        two_pool_config(pool_config((slow, 8), (other, 1)), balancer="round_robin")
    )
    results = await asyncio.gather(*(_post(gw) for _ in range(6)))
    assert [r[0] for r in results] == [200] * 6
    assert slow.stats.requests_total + other.stats.requests_total == 6  # one attempt each
    assert _instance(await gw.state(), slow)["consecutive_failures"] == 0
    await gw.assert_quiet()


@pytest.mark.parametrize("mode", ["stall", "cut", "malformed"])
async def test_stream_failing_mid_way_ends_with_an_error_event(
    mocks: MockFactory, gateway_factory: GatewayFactory, mode: str
) -> None:
    m = await mocks(
        fail_rate=1.0, fail_mode=mode, fail_after_chunks=3, default_tokens=20, tokens_per_s=50
    )
    gw = await gateway_factory(two_pool_config(pool_config(m)))
    async with gw.session.post(gw.url + "/v1/chat/completions", json=chat(stream=True)) as resp:
        assert resp.status == 200
        body = (await resp.read()).decode()
    events = [e for e in body.split("\n\n") if e.strip()]
    assert events[-1].startswith('data: {"error":'), body
    assert "[DONE]" not in body
    assert "{not json" not in body
    # the official client raises instead of returning a truncated answer
    async with openai.AsyncOpenAI(base_url=gw.base_url, api_key="k", max_retries=0) as client:
        stream = await client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "x"}], stream=True
        )
        with pytest.raises(openai.APIError):
            async for _ in stream:
                pass
    # a started stream is never retried
    assert m.stats.requests_total == 2
    await gw.assert_quiet()


async def test_5xx_is_retried_on_another_instance_and_attempts_are_bounded(
    mocks: MockFactory, gateway_factory: GatewayFactory
) -> None:
    bad = [await mocks(fail_rate=1.0, fail_status=500) for _ in range(4)]
    gw = await gateway_factory(two_pool_config(pool_config(*bad), health={"failure_threshold": 10}))
    status, body, _ = await _post(gw)
    assert status == 502 and body["error"]["code"] == "upstream_error"
    # retries.max_attempts = 3 in all, each on a different instance
    counts = sorted(m.stats.requests_total for m in bad)
    assert counts == [0, 1, 1, 1]
    await gw.assert_quiet()


async def test_5xx_retry_succeeds_elsewhere(
    mocks: MockFactory, gateway_factory: GatewayFactory
) -> None:
    bad, good = await mocks(fail_rate=1.0, fail_status=503), await mocks()
    gw = await gateway_factory(two_pool_config(pool_config(bad, good), balancer="round_robin"))
    results = [await _post(gw) for _ in range(4)]
    assert [r[0] for r in results] == [200] * 4
    assert all(r[2]["X-Gateway-Instance"].startswith(f"m{good.port}-") for r in results)
    await gw.assert_quiet()


async def test_429_with_retry_after_cools_the_instance(
    mocks: MockFactory, gateway_factory: GatewayFactory
) -> None:
    limited = await mocks(fail_rate=1.0, fail_status=429, retry_after_s=30)
    ok = await mocks()
    gw = await gateway_factory(
        two_pool_config(
            pool_config(limited, ok), health={"failure_threshold": 5, "max_ejection_ms": 60_000}
        )
    )
    for _ in range(6):
        assert (await _post(gw))[0] == 200
    # cooled for 30 s after the first 429: never tried again, yet not ejected (SPEC §7: the
    # state says `cooling` and `cooling_until` gives its end)
    assert limited.stats.requests_total == 1
    inst = _instance(await gw.state(), limited)
    assert inst["state"] == "cooling" and inst["consecutive_failures"] == 1
    assert inst["ejected_until"] is None
    assert inst["cooling_until"] > time.time() + 20
    assert inst["next_try_at"] > time.time() + 20
    await gw.assert_quiet()


async def test_qianfan_style_200_error_is_a_failure(
    mocks: MockFactory, gateway_factory: GatewayFactory
) -> None:
    lying, ok = await mocks(fail_rate=1.0, fail_mode="error200"), await mocks()
    gw = await gateway_factory(two_pool_config(pool_config(lying, ok), balancer="round_robin"))
    results = [await _post(gw) for _ in range(4)]
    assert [r[0] for r in results] == [200] * 4
    assert all("error_code" not in r[1] for r in results)
    assert _instance(await gw.state(), lying)["state"] == "ejected"
    await gw.assert_quiet()


async def test_all_instances_down_answers_fast_with_retry_after(
    mocks: MockFactory, gateway_factory: GatewayFactory
) -> None:
    a, b = await mocks(), await mocks()
    gw = await gateway_factory(
        two_pool_config(pool_config(a, b), health={"ejection_ms": 5000, "max_ejection_ms": 9000})
    )
    await a.set_down(True)
    await b.set_down(True)
    for _ in range(2):  # eject both
        await _post(gw)
    timings = []
    for _ in range(20):
        t0 = time.monotonic()
        status, body, headers = await _post(gw)
        timings.append(time.monotonic() - t0)
        assert status == 503 and body["error"]["code"] == "no_healthy_instance"
        assert 1 <= int(headers["Retry-After"]) <= 5
    assert max(timings) < 0.2  # ≪ first_byte / connect timeouts
    async with gw.session.get(gw.url + "/readyz") as resp:
        assert resp.status == 503
    await gw.assert_quiet()


async def test_fallback_pool_serves_when_the_primary_is_down(
    mocks: MockFactory, gateway_factory: GatewayFactory
) -> None:
    primary, spare = await mocks(), await mocks()
    config = two_pool_config(pool_config(primary, fallback="spare"))
    config["pools"]["spare"] = pool_config(spare)
    gw = await gateway_factory(config)
    await primary.set_down(True)
    results = [await _post(gw) for _ in range(5)]
    assert [r[0] for r in results] == [200] * 5
    assert {r[2]["X-Gateway-Pool"] for r in results} == {"spare"}
    assert spare.stats.requests_total == 5
    await gw.assert_quiet()


async def test_probe_passing_while_requests_fail_keeps_the_instance_out(
    mocks: MockFactory, gateway_factory: GatewayFactory
) -> None:
    # /v1/models answers 200, every completion fails
    liar, ok = await mocks(fail_rate=1.0, fail_status=500), await mocks()
    gw = await gateway_factory(
        two_pool_config(
            pool_config(liar, ok),
            health={"ejection_ms": 100, "probe": {"interval_ms": 50, "timeout_ms": 200}},
        ),
        probes=True,
    )
    for _ in range(4):
        assert (await _post(gw))[0] == 200
    first = _instance(await gw.state(), liar)
    assert first["ejections"] == 1
    # ejections of 100, 200, 400, 800 ms: about five fit in 2 s, as 200 ms doubling in 4 s
    deadline = time.monotonic() + 2
    while time.monotonic() < deadline:
        assert (await _post(gw))[0] == 200
        await asyncio.sleep(0.05)
    inst = _instance(await gw.state(), liar)
    # each half-open trial fails and re-ejects with a doubled time; it is never restored
    assert inst["state"] in ("ejected", "half_open")
    assert 2 <= inst["ejections"] <= 6
    # at most one trial per ejection reached it after the first ejection
    assert liar.stats.by_path["/v1/chat/completions"] <= 2 + inst["ejections"]
    await gw.assert_quiet()


async def test_half_open_admits_exactly_the_trial_count(
    mocks: MockFactory, gateway_factory: GatewayFactory
) -> None:
    flaky = await mocks(latency_ms=300)
    gw = await gateway_factory(
        two_pool_config(
            pool_config((flaky, 8)),
            health={"ejection_ms": 300, "half_open_max_requests": 2, "success_threshold": 2},
        )
    )
    await flaky.set_down(True)
    for _ in range(2):
        await _post(gw)
    assert _instance(await gw.state(), flaky)["state"] == "ejected"
    await flaky.set_down(False)
    # the ejection ends after 300 ms; probing is off, so it turns half-open
    await gw.wait_state(lambda s: _instance(s, flaky)["state"] == "half_open")
    flaky.reset()
    burst = [asyncio.create_task(_post(gw)) for _ in range(8)]
    # the trials take 300 ms
    state = await gw.wait_state(lambda s: _instance(s, flaky)["in_flight"] == 2)
    state = await gw.wait_queued(6, 0)
    # the burst: exactly 2 trials in flight, the other 6 wait in the queue for them
    assert _instance(state, flaky)["state"] == "half_open"
    assert _instance(state, flaky)["in_flight"] == 2
    assert state["pools"]["p"]["queued"]["high"] == 6
    results = await asyncio.gather(*burst)
    assert sorted(r[0] for r in results) == [200] * 8
    assert _instance(await gw.state(), flaky)["state"] == "healthy"
    await gw.assert_quiet()


async def test_flapping_instance_has_bounded_state_changes(
    mocks: MockFactory, gateway_factory: GatewayFactory
) -> None:
    flap, ok = await mocks(), await mocks()
    gw = await gateway_factory(
        two_pool_config(
            pool_config(flap, ok),
            health={"ejection_ms": 200, "max_ejection_ms": 5000, "success_threshold": 2},
        )
    )

    async def flapper() -> None:
        for _ in range(6):  # up 0.3 s / down 0.3 s
            await flap.set_down(True)
            await asyncio.sleep(0.3)
            await flap.set_down(False)
            await asyncio.sleep(0.3)

    task = asyncio.create_task(flapper())
    statuses = []
    while not task.done():
        statuses.append((await _post(gw))[0])
        await asyncio.sleep(0.01)
    assert set(statuses) == {200}
    inst = _instance(await gw.state(), flap)
    # ejection time grows (200, 400, 800, ...): over 3.6 s only a few ejections fit
    assert 1 <= inst["ejections"] <= 5
    await gw.assert_quiet()


async def test_a_thousand_mixed_faults_leave_every_counter_at_zero(
    mocks: MockFactory, gateway_factory: GatewayFactory
) -> None:
    backends = [
        await mocks(fail_rate=0.2, fail_mode=mode, seed=i, latency_ms=2, tokens_per_s=2000)
        for i, mode in enumerate(["status", "reset", "hang", "error200", "cut", "malformed"])
    ]
    backends.append(await mocks(seed=99))
    config = two_pool_config(
        pool_config(*[(b, 3) for b in backends]),
        health={"ejection_ms": 100, "max_ejection_ms": 400},
        timeouts={"first_byte_ms": 150, "stream_idle_ms": 150},
        scheduler={"high": {"capacity": 50, "max_wait_ms": 2000}},
    )
    gw = await gateway_factory(config)
    sem = asyncio.Semaphore(40)
    outcomes: dict[int, int] = {}

    async def one(i: int) -> None:
        async with sem:
            body = chat(f"r{i}", stream=i % 3 == 0)
            headers = {"X-Priority": "low" if i % 2 else "high"}
            try:
                async with await gw.post(
                    "/v1/chat/completions",
                    body,
                    headers=headers,
                    timeout=__import__("aiohttp").ClientTimeout(total=0.05 if i % 17 == 0 else 10),
                ) as resp:
                    await resp.read()
                    outcomes[resp.status] = outcomes.get(resp.status, 0) + 1
            except TimeoutError:
                outcomes[-1] = outcomes.get(-1, 0) + 1  # the client gave up

    await asyncio.gather(*(one(i) for i in range(1000)))
    assert sum(outcomes.values()) == 1000
    assert outcomes.get(200, 0) > 700, outcomes
    await gw.assert_quiet(within=10)


async def test_lifecycle_events_are_logged(
    mocks: MockFactory, gateway_factory: GatewayFactory, caplog: pytest.LogCaptureFixture
) -> None:
    a, b = await mocks(), await mocks()
    gw = await gateway_factory(
        two_pool_config(pool_config(a, b), health={"ejection_ms": 200, "success_threshold": 1})
    )
    name = f"m{a.port}-0"
    with caplog.at_level("INFO", logger="gateway.health"):
        await a.set_down(True)
        for _ in range(6):
            assert (await _post(gw))[0] == 200
        await a.set_down(False)
        # the ejection (200 ms) ends: the instance is tried again, half-open
        await gw.wait_state(lambda s: _instance(s, a)["state"] == "half_open")
        for _ in range(6):
            assert (await _post(gw))[0] == 200
    events = [
        (r.getMessage(), r.fields["instance"])  # type: ignore[attr-defined]
        for r in caplog.records
        if r.name == "gateway.health" and hasattr(r, "fields")
    ]
    mine = [msg for msg, inst in events if inst == name]
    assert mine[:3] == ["instance ejected", "instance half_open", "instance restored"], events
    await gw.assert_quiet()


async def test_a_waiter_evicted_by_an_ejection_gets_the_real_retry_after(
    mocks: MockFactory, gateway_factory: GatewayFactory
) -> None:
    """SPEC §6: 503 "with Retry-After (the time until the earliest instance may be tried)".
    A queued request evicted because its pool's last instance was ejected used to be told
    `Retry-After: 1` whatever the ejection's length."""
    m = await mocks(latency_ms=300, fail_rate=1.0, fail_status=500)
    gw = await gateway_factory(
        two_pool_config(
            pool_config((m, 1)),
            health={"failure_threshold": 1, "ejection_ms": 8000, "max_ejection_ms": 60_000},
            retries={"max_attempts": 1},
        )
    )
    blocker = asyncio.create_task(_post(gw))
    await gw.wait_in_flight(1)
    waiter = asyncio.create_task(_post(gw))
    await gw.wait_queued(1, 0)
    status, body, _ = await blocker
    assert status == 502
    status, body, headers = await waiter
    assert status == 503 and body["error"]["code"] == "no_healthy_instance"
    assert 7 <= int(headers["Retry-After"]) <= 8  # the ejection's 8 s, not 1
    await gw.assert_quiet()


class _RawStreamUpstream:
    """One instance that serves one streamed chat over a plain socket: the head and the role
    chunk at once, the rest when the test says (`send_events`). Its bytes go straight to the
    kernel (not through a loop's write buffer, flushed at the end of an iteration), so bytes
    sent here and a client socket closed right after reach the gateway in the same poll, in
    that order: the gateway's task wakes to the upstream's bytes while the client's connection
    is already closing and the loop has not cancelled the request yet (without the fix the
    `head` case failed 500 and the `end` case 200, every run)."""

    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.listener.setblocking(False)
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}/v1"
        self.conn: socket.socket | None = None
        self.asked = asyncio.Event()
        self.task = asyncio.create_task(self._serve())

    async def _serve(self) -> None:
        loop = asyncio.get_running_loop()
        conn, _ = await loop.sock_accept(self.listener)
        data = b""
        while b"\r\n\r\n" not in data:
            data += await loop.sock_recv(conn, 65536)
        head_, _, body = data.partition(b"\r\n\r\n")
        declared = re.search(rb"(?i)content-length: *(\d+)", head_)
        assert declared is not None
        length = int(declared.group(1))
        while len(body) < length:
            body += await loop.sock_recv(conn, 65536)
        self.conn = conn
        self.send(
            head(200, [("Content-Type", "text/event-stream"), ("Transfer-Encoding", "chunked")])
        )
        self.events = sse_events("tag", n=2)
        self.send_events(1)  # the role chunk: held by the gateway until a content token
        self.asked.set()

    def send(self, data: bytes) -> None:
        assert self.conn is not None
        self.conn.sendall(data)  # a few hundred bytes into an empty socket buffer: at once

    def send_events(self, n: int) -> None:
        """The next `n` events, one chunk each (all that is left: then the stream's end)."""
        out = [b"%x\r\n%b\r\n" % (len(e), e) for e in self.events[:n]]
        del self.events[:n]
        self.send(b"".join(out) + (b"" if self.events else b"0\r\n\r\n"))

    def close(self) -> None:
        self.task.cancel()
        if self.conn is not None:
            self.conn.close()
        self.listener.close()


async def _codes(gw: RunningGateway) -> dict[str, float]:
    """gateway_requests_total of pool `p` by status code."""
    async with gw.session.get(gw.url + "/metrics") as resp:
        text = await resp.text()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        if family.name == "gateway_requests":
            for s in family.samples:
                if s.name.endswith("_total") and s.labels["pool"] == "p":
                    out[s.labels["code"]] = out.get(s.labels["code"], 0) + s.value
    return out


@pytest.mark.parametrize("at", ["head", "end"])
async def test_a_client_leaving_a_stream_at_its_head_or_end_is_499(
    gateway_factory: GatewayFactory, caplog: pytest.LogCaptureFixture, at: str
) -> None:
    """Issue 22: a stream's head waits for its first content token (SPEC §17); a client that
    leaves just as it comes finds the head's write failing ("Cannot write to closing
    transport") before the loop cancels its request — that was an unhandled error, answered
    and counted 500; at the stream's end, a 200. Either way it is the client leaving: one
    499 `client_closed` (metric and access line), no error logged, the slot back, the
    instance not blamed, and the first token's TTFT learnt as for any cancelled stream."""
    upstream = _RawStreamUpstream()
    client: socket.socket | None = None
    try:
        pool = {
            "instances": [
                {"name": "raw", "url": upstream.url, "model": "up-model", "max_concurrency": 1}
            ]
        }
        gw = await gateway_factory(two_pool_config(pool))
        finished: list[RequestFinished] = []
        gw.gateway.events.subscribe(
            lambda e: finished.append(e) if isinstance(e, RequestFinished) else None
        )
        body = orjson.dumps(chat("hi", stream=True))
        port = int(gw.url.rsplit(":", 1)[1])
        # A plain blocking socket: its close() sends the FIN at once (localhost: connect and
        # a small send never block).
        client = socket.create_connection(("127.0.0.1", port))
        with caplog.at_level(logging.ERROR, logger="gateway"):
            client.sendall(
                b"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\n"
                b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%b"
                % (len(body), body)
            )
            await upstream.asked.wait()
            if at == "end":
                upstream.send_events(1)  # the first content token: the head and it go out
                got = b""

                def readable() -> bool:
                    nonlocal got
                    if select.select([client], [], [], 0)[0]:
                        got += client.recv(65536)
                    return b"tag part0" in got

                await eventually(readable, what="the first token at the client")
                assert got.startswith(b"HTTP/1.1 200")
            # The upstream's next bytes and the client's leaving, together.
            upstream.send_events(1 if at == "head" else len(upstream.events))
            client.close()
            await eventually(lambda: bool(finished), what="the request's end")
            await gw.assert_quiet()
        (line,) = finished
        assert (line.status, line.error) == (499, "client_closed")
        assert not [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
        assert await _codes(gw) == {"499": 1}
        (inst,) = (await gw.state())["pools"]["p"]["instances"]
        assert inst["state"] == "healthy" and inst["consecutive_failures"] == 0
        assert inst["prediction"]["samples"] > 0  # its TTFT, from the first token
    finally:
        if client is not None:
            client.close()
        upstream.close()
