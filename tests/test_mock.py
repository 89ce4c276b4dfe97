"""`gateway mock`: the simulated OpenAI-compatible backend, seen from real clients over loopback."""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import openai
import pytest

from gateway.sim.mock import (
    FAIL_MODES,
    LATENCY_DISTS,
    MockBehavior,
    MockServer,
    add_arguments,
    behavior_from_args,
    sample_latency_ms,
)

CHAT: dict[str, Any] = {
    "model": "judge-lite",
    "messages": [{"role": "user", "content": "does this compile?"}],
}


@pytest.fixture
async def mock() -> AsyncIterator[MockServer]:
    async with MockServer(MockBehavior(seed=1)) as m:
        yield m


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


def client(m: MockServer, **kw: Any) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=m.url, api_key="sk-test", max_retries=0, **kw)


async def stats(http: aiohttp.ClientSession, m: MockServer) -> dict[str, Any]:
    async with http.get(m.base_url + "/mock/stats") as r:
        assert r.status == 200
        result: dict[str, Any] = await r.json()
        return result


async def post_chat(
    http: aiohttp.ClientSession, m: MockServer, headers: dict[str, str] | None = None, **body: Any
) -> tuple[int, bytes]:
    async with http.post(m.url + "/chat/completions", json=CHAT | body, headers=headers) as r:
        return r.status, await r.read()


async def wait_for(pred: Any, within_s: float = 2.0) -> None:
    deadline = time.monotonic() + within_s
    while not await pred():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.01)


# ---- the OpenAI surface, through the official client ------------------------------------------


async def test_chat_non_streaming(mock: MockServer) -> None:
    async with client(mock) as c:
        r = await c.chat.completions.create(
            model="judge-lite", messages=[{"role": "user", "content": "x" * 40}], max_tokens=5
        )
        assert r.object == "chat.completion"
        assert r.model == "judge-lite"
        assert r.choices[0].message.role == "assistant"
        assert len((r.choices[0].message.content or "").split()) == 5
        assert r.choices[0].finish_reason == "length"
        assert r.usage is not None
        assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (
            10,
            5,
            15,
        )
        d = await c.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
        assert d.usage is not None and d.usage.completion_tokens == 16
        assert d.choices[0].finish_reason == "stop"


async def test_chat_streaming_is_incremental(mock: MockServer) -> None:
    mock.behavior.tokens_per_s = 100.0
    messages: Any = [{"role": "user", "content": "what is the worst case?"}]
    async with client(mock) as c:
        stream = await c.chat.completions.create(
            model="judge-pro",
            messages=messages,
            max_tokens=20,
            stream=True,
            stream_options={"include_usage": True},
        )
        arrivals: list[float] = []
        chunks = []
        start = time.perf_counter()
        async for chunk in stream:
            arrivals.append(time.perf_counter())
            chunks.append(chunk)
        plain = await c.chat.completions.create(model="judge-pro", messages=messages, max_tokens=20)
    parts: list[str] = []
    for chunk in chunks[:-1]:
        assert chunk.object == "chat.completion.chunk" and chunk.model == "judge-pro"
        parts.append(chunk.choices[0].delta.content or "")
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 20
    assert sum(1 for p in parts if p) == 20
    # 20 tokens at 100/s: 19 gaps of 10 ms between the first and the last token. The server
    # paces exactly; the client-side span has slack for a client starved by a busy machine.
    assert arrivals[-3] - start >= 0.18  # event-loop timers may fire up to ~1 ms early
    span = arrivals[-3] - arrivals[1]
    assert 0.1 < span < 1.0, span
    assert "".join(parts) == plain.choices[0].message.content


async def test_completions(mock: MockServer) -> None:
    async with client(mock) as c:
        r = await c.completions.create(model="m", prompt="def f(): pass", max_tokens=4)
        assert r.object == "text_completion" and r.model == "m"
        assert len(r.choices[0].text.split()) == 4
        assert r.usage is not None and r.usage.completion_tokens == 4
        stream = await c.completions.create(
            model="m", prompt="def f(): pass", max_tokens=4, stream=True
        )
        texts = [chunk.choices[0].text async for chunk in stream if chunk.choices]
    assert "".join(texts) == r.choices[0].text
    assert len(texts) == 5  # four tokens and the finish chunk


async def test_embeddings(mock: MockServer) -> None:
    async with client(mock) as c:
        # The client asks for base64 by default and decodes it; ask for floats too.
        r64 = await c.embeddings.create(model="emb", input=["alpha", "beta"])
        rfl = await c.embeddings.create(
            model="emb", input=["alpha", "beta"], encoding_format="float"
        )
        again = await c.embeddings.create(model="emb", input="alpha", encoding_format="float")
    assert [d.index for d in r64.data] == [0, 1]
    assert len(r64.data[0].embedding) == 8
    for a, b in zip(r64.data[0].embedding, rfl.data[0].embedding, strict=True):
        assert a == pytest.approx(b, abs=1e-6)
    assert again.data[0].embedding == rfl.data[0].embedding
    assert rfl.data[0].embedding != rfl.data[1].embedding
    assert math.isclose(math.hypot(*rfl.data[0].embedding), 1.0, abs_tol=1e-4)
    assert r64.usage.prompt_tokens >= 1
    async with client(mock) as c:
        small = await c.embeddings.create(model="emb", input="alpha", dimensions=3)
    assert len(small.data[0].embedding) == 3


async def test_models_and_health(mock: MockServer, http: aiohttp.ClientSession) -> None:
    mock.configure(model="Qwen2.5-7B-Instruct")
    async with client(mock) as c:
        models = await c.models.list()
    assert [m.id for m in models.data] == ["Qwen2.5-7B-Instruct"]
    async with http.get(mock.base_url + "/health") as r:
        assert r.status == 200
    async with http.get(mock.url + "/nope") as r:
        assert r.status == 404
        assert (await r.json())["error"]["code"] == "not_found"


async def test_bad_requests(mock: MockServer, http: aiohttp.ClientSession) -> None:
    async with http.post(mock.url + "/chat/completions", data=b"{oops") as r:
        assert r.status == 400
        assert set((await r.json())["error"]) == {"message", "type", "param", "code"}
    status, _ = await post_chat(http, mock, messages=None)
    assert status == 400
    mock.configure(strict_model=True, model="real")
    status, body = await post_chat(http, mock)
    assert status == 404 and b"model_not_found" in body


# ---- latency --------------------------------------------------------------------------------


async def test_latency_and_override(mock: MockServer, http: aiohttp.ClientSession) -> None:
    mock.configure(latency_ms=150.0)
    t = time.perf_counter()
    assert (await post_chat(http, mock))[0] == 200
    assert time.perf_counter() - t >= 0.14
    t = time.perf_counter()
    assert (await post_chat(http, mock, headers={"X-Mock-Latency-Ms": "0"}))[0] == 200
    assert time.perf_counter() - t < 0.1


@pytest.mark.parametrize("dist", LATENCY_DISTS)
def test_latency_distributions(dist: str) -> None:
    b = MockBehavior(latency_ms=100.0, latency_dist=dist)  # type: ignore[arg-type]
    rng = random.Random(3)
    xs = [sample_latency_ms(rng, b) for _ in range(20_000)]
    assert min(xs) >= 0.0
    if dist == "pareto":
        # Infinite variance: the mean converges badly, so check the shape instead.
        assert min(xs) >= 100.0 / 3 - 1e-9
        assert statistics.median(xs) == pytest.approx(100.0 / 3 * 2 ** (1 / 1.5), rel=0.05)
        assert max(xs) > 20 * statistics.median(xs)
    else:
        assert statistics.fmean(xs) == pytest.approx(100.0, rel=0.05)
    capped = MockBehavior(latency_ms=100.0, latency_dist="exponential", latency_max_ms=150.0)
    assert max(sample_latency_ms(rng, capped) for _ in range(1000)) <= 150.0


# ---- failure injection, as clients see it ------------------------------------------------


async def test_status_failure_with_retry_after(
    mock: MockServer, http: aiohttp.ClientSession
) -> None:
    mock.configure(fail_rate=1.0, fail_mode="status", fail_status=429, retry_after_s=1.5)
    async with http.post(mock.url + "/chat/completions", json=CHAT) as r:
        assert r.status == 429
        assert r.headers["Retry-After"] == "2"
        assert r.headers["retry-after-ms"] == "1500"
        err = (await r.json())["error"]
        assert err["type"] == "rate_limit_error" and err["param"] is None
    mock.configure(fail_status=500, retry_after_s=None)
    async with client(mock) as c:
        with pytest.raises(openai.InternalServerError):
            await c.chat.completions.create(**CHAT)
    assert (await stats(http, mock))["injected"] == {"status": 2}


async def test_reset(mock: MockServer, http: aiohttp.ClientSession) -> None:
    mock.configure(fail_rate=1.0, fail_mode="reset")
    async with client(mock) as c:
        with pytest.raises(openai.APIConnectionError):
            await c.chat.completions.create(**CHAT)
    with pytest.raises((aiohttp.ServerDisconnectedError, aiohttp.ClientOSError)):
        await post_chat(http, mock)
    s = await stats(http, mock)
    assert s["aborted"] == 2 and s["completed"] == 0 and s["in_flight"] == 0


async def test_hang_and_client_disconnect_counted(
    mock: MockServer, http: aiohttp.ClientSession
) -> None:
    with pytest.raises(TimeoutError):
        async with http.post(
            mock.url + "/chat/completions",
            json=CHAT,
            headers={"X-Mock-Fail": "hang"},
            timeout=aiohttp.ClientTimeout(total=0.2),
        ) as r:
            await r.read()

    async def cancelled() -> bool:
        s = await stats(http, mock)
        return bool(s["cancelled"] == 1 and s["in_flight"] == 0)

    await wait_for(cancelled)


async def test_stop_is_prompt_with_hanging_requests(http: aiohttp.ClientSession) -> None:
    m = MockServer(MockBehavior(fail_rate=1.0, fail_mode="hang"))
    await m.start()
    pending = [asyncio.create_task(post_chat(http, m)) for _ in range(3)]
    await wait_for(lambda: _in_flight(m, 3))
    t = time.perf_counter()
    await m.stop()
    assert time.perf_counter() - t < 1.0
    results = await asyncio.gather(*pending, return_exceptions=True)
    assert all(isinstance(r, aiohttp.ClientError) for r in results), results
    assert m.stats.in_flight == 0


async def _in_flight(m: MockServer, n: int) -> bool:
    return m.stats.in_flight == n


async def test_error200_qianfan_style(mock: MockServer, http: aiohttp.ClientSession) -> None:
    status, body = await post_chat(http, mock, headers={"X-Mock-Fail": "error200"})
    assert status == 200
    assert body == b'{"error_code":336501,"error_msg":"Open api daily request limit reached"}'


async def read_sse(resp: aiohttp.ClientResponse) -> list[bytes]:
    return [line.rstrip(b"\n") async for line in resp.content if line.strip()]


async def test_stall_stream(mock: MockServer, http: aiohttp.ClientSession) -> None:
    mock.configure(fail_rate=1.0, fail_mode="stall", fail_after_chunks=3)
    lines: list[bytes] = []
    with pytest.raises(TimeoutError):
        async with http.post(
            mock.url + "/chat/completions",
            json=CHAT | {"stream": True},
            timeout=aiohttp.ClientTimeout(sock_read=0.3),
        ) as r:
            assert r.status == 200
            async for line in r.content:
                if line.strip():
                    lines.append(line)
    assert len(lines) == 3


async def test_cut_stream(mock: MockServer, http: aiohttp.ClientSession) -> None:
    mock.configure(fail_rate=1.0, fail_mode="cut")
    lines: list[bytes] = []
    with pytest.raises(aiohttp.ClientPayloadError):
        async with http.post(mock.url + "/chat/completions", json=CHAT | {"stream": True}) as r:
            async for line in r.content:
                if line.strip():
                    lines.append(line)
    assert len(lines) == 2 and all(line.startswith(b"data: {") for line in lines)
    assert (await stats(http, mock))["aborted"] == 1


async def test_malformed_stream(mock: MockServer, http: aiohttp.ClientSession) -> None:
    async with http.post(
        mock.url + "/chat/completions",
        json=CHAT | {"stream": True},
        headers={"X-Mock-Fail": "malformed"},
    ) as r:
        assert r.headers["Content-Type"].startswith("text/event-stream")
        lines = await read_sse(r)
    assert lines[-1] == b"data: {not json"
    assert b"data: [DONE]" not in lines


@pytest.mark.parametrize("mode", ["stall", "cut", "malformed"])
async def test_non_streaming_broken_bodies(
    mode: str, mock: MockServer, http: aiohttp.ClientSession
) -> None:
    with pytest.raises((TimeoutError, aiohttp.ClientPayloadError, ValueError)):
        async with http.post(
            mock.url + "/chat/completions",
            json=CHAT,
            headers={"X-Mock-Fail": mode},
            timeout=aiohttp.ClientTimeout(sock_read=0.3),
        ) as r:
            assert r.status == 200
            await r.json()


async def test_down_aborts_everything_but_control(
    mock: MockServer, http: aiohttp.ClientSession
) -> None:
    async with http.post(mock.base_url + "/mock/config", json={"down": True}) as r:
        assert r.status == 200 and (await r.json())["down"] is True
    for path in ("/health", "/v1/models"):
        with pytest.raises((aiohttp.ServerDisconnectedError, aiohttp.ClientOSError)):
            async with http.get(mock.base_url + path) as r:
                await r.read()
    mock.configure(down=False)
    async with http.get(mock.base_url + "/health") as r:
        assert r.status == 200


async def test_set_down_refuses_connections(mock: MockServer, http: aiohttp.ClientSession) -> None:
    port = mock.port
    await mock.set_down(True)
    assert mock.refusing
    with pytest.raises(aiohttp.ClientConnectorError):
        async with http.get(mock.base_url + "/health") as r:
            await r.read()
    await mock.set_down(False)
    assert mock.port == port and not mock.refusing
    async with http.get(mock.base_url + "/health") as r:
        assert r.status == 200


async def test_crash_endpoint(mock: MockServer, http: aiohttp.ClientSession) -> None:
    async with http.post(mock.base_url + "/mock/crash", json={"for_s": 0.3}) as r:
        assert r.status == 200
    await asyncio.sleep(0.12)
    with pytest.raises(aiohttp.ClientConnectorError):
        async with http.get(mock.base_url + "/health") as r:
            await r.read()

    async def back() -> bool:
        try:
            async with http.get(mock.base_url + "/health") as r:
                return r.status == 200
        except aiohttp.ClientConnectorError:
            return False

    await wait_for(back)


async def test_fail_every(mock: MockServer, http: aiohttp.ClientSession) -> None:
    mock.configure(fail_every=3, fail_status=503)
    statuses = [(await post_chat(http, mock))[0] for _ in range(6)]
    assert statuses == [200, 200, 503, 200, 200, 503]


async def test_header_overrides(mock: MockServer, http: aiohttp.ClientSession) -> None:
    mock.configure(fail_rate=1.0)
    assert (await post_chat(http, mock, headers={"X-Mock-Fail": "none"}))[0] == 200
    assert (await post_chat(http, mock, headers={"X-Mock-Status": "503"}))[0] == 503
    assert (await post_chat(http, mock, headers={"X-Mock-Status": "200"}))[0] == 200
    assert sorted(FAIL_MODES) == sorted(
        ["status", "reset", "hang", "error200", "stall", "cut", "malformed"]
    )


async def test_max_concurrency(mock: MockServer, http: aiohttp.ClientSession) -> None:
    mock.configure(max_concurrency=2, latency_ms=200.0)
    results = await asyncio.gather(*(post_chat(http, mock) for _ in range(3)))
    assert sorted(status for status, _ in results) == [200, 200, 429]
    s = await stats(http, mock)
    assert s["rejected"] == 1 and s["peak_in_flight"] == 2


# ---- observation and control -------------------------------------------------------------


async def test_request_log(mock: MockServer, http: aiohttp.ClientSession) -> None:
    async with client(mock, default_headers={"X-Trace": "t1"}) as c:
        await c.chat.completions.create(**CHAT)
    await http.get(mock.base_url + "/health")
    async with http.get(
        mock.base_url + "/mock/requests", params={"path": "/v1/chat/completions"}
    ) as r:
        log = await r.json()
    assert len(log) == 1
    entry = log[0]
    assert entry["method"] == "POST"
    assert entry["headers"]["authorization"] == "Bearer sk-test"
    assert entry["headers"]["x-trace"] == "t1"
    assert entry["body"]["model"] == "judge-lite"
    assert entry["fail"] is None
    async with http.get(mock.base_url + "/mock/requests", params={"limit": "1"}) as r:
        assert [e["path"] for e in await r.json()] == ["/health"]
    assert len(mock.requests) == 2


async def test_stats_under_concurrency(mock: MockServer, http: aiohttp.ClientSession) -> None:
    mock.configure(latency_ms=100.0)
    await asyncio.gather(*(post_chat(http, mock) for _ in range(6)))
    s = await stats(http, mock)
    assert s["peak_in_flight"] == 6 and s["in_flight"] == 0
    assert s["completed"] == 6 and s["by_status"] == {"200": 6}
    assert s["requests_total"] == 6 and s["by_path"] == {"/v1/chat/completions": 6}
    assert s["completion_tokens"] == 6 * 16


async def test_config_patch_and_reset(mock: MockServer, http: aiohttp.ClientSession) -> None:
    url = mock.base_url + "/mock/config"
    for bad in ({"fail_mode": "bogus"}, {"fail_rate": 2}, {"no_such_knob": 1}, [1]):
        async with http.post(url, json=bad) as r:
            assert r.status == 400, bad
    async with http.post(url, json={"latency_ms": 5, "tokens_per_s": 1000}) as r:
        cfg = await r.json()
    assert cfg["latency_ms"] == 5.0 and cfg["tokens_per_s"] == 1000.0
    assert mock.behavior.latency_ms == 5.0
    await post_chat(http, mock)
    async with http.post(mock.base_url + "/mock/reset") as r:
        assert r.status == 200
    s = await stats(http, mock)
    assert s["requests_total"] == 0 and s["completed"] == 0
    assert mock.requests == []


async def test_seeded_determinism(http: aiohttp.ClientSession) -> None:
    behavior: dict[str, Any] = dict(
        seed=42, fail_rate=0.4, latency_ms=2.0, latency_dist="exponential"
    )

    async def run_once(m: MockServer) -> list[tuple[Any, Any]]:
        for _ in range(12):
            await post_chat(http, m)
        return [(e["fail"], e["latency_ms"]) for e in m.requests]

    async with MockServer(MockBehavior(**behavior)) as a, MockServer(MockBehavior(**behavior)) as b:
        first = await run_once(a)
        assert first == await run_once(b)
        assert {f for f, _ in first} == {None, "status"}
        a.reset()
        assert await run_once(a) == first
        a.configure(seed=43)
        a.reset()
        assert await run_once(a) != first


# ---- command line ----------------------------------------------------------------------------


def test_add_arguments_defaults() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--port", "9", "--fail-mode", "cut", "--latency-dist", "pareto"])
    b = behavior_from_args(args)
    assert (args.host, b.fail_mode, b.latency_dist, b.fail_rate) == (
        "127.0.0.1",
        "cut",
        "pareto",
        0,
    )
    with pytest.raises(SystemExit):
        parser.parse_args([])  # --port is required


async def test_cli_run_serves_until_sigterm(http: aiohttp.ClientSession) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    code = (
        "import argparse, gateway.sim.mock as m; p = argparse.ArgumentParser(); "
        "m.add_arguments(p); raise SystemExit(m.run(p.parse_args()))"
    )
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        code,
        "--port",
        str(port),
        "--model",
        "cli-model",
        stdout=subprocess.PIPE,
        env=os.environ | {"PYTHONUNBUFFERED": "1"},
    )
    try:
        assert proc.stdout is not None
        line = await asyncio.wait_for(proc.stdout.readline(), 10)
        assert line.decode().strip() == f"mock listening on http://127.0.0.1:{port}/v1"
        async with http.get(f"http://127.0.0.1:{port}/v1/models") as r:
            assert (await r.json())["data"][0]["id"] == "cli-model"
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 10) == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
