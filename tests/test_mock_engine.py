"""`gateway mock --engine`: the continuous-batching engine model (design §5 after vLLM V1),
seen from the official openai client over loopback, plus the step arithmetic in process."""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import openai
import pytest

from gateway.sim.engine import PROFILES, Engine, profile_with
from gateway.sim.mock import MockBehavior, MockServer, add_arguments, behavior_from_args


def client(m: MockServer) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=m.url, api_key="sk-test", max_retries=0)


def prompt(tag: str, tokens: int) -> str:
    """A prompt of about `tokens` tokens (4 characters each), unique by `tag`."""
    head = f"[{tag}] "
    return head + "x" * (tokens * 4 - len(head))


async def stream_times(c: openai.AsyncOpenAI, text: str, n: int) -> list[float]:
    """Seconds from the request to each content delta (the role-only chunk is not a token)."""
    t0 = time.perf_counter()
    times: list[float] = []
    stream = await c.chat.completions.create(
        model="m", messages=[{"role": "user", "content": text}], max_tokens=n, stream=True
    )
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            times.append(time.perf_counter() - t0)
    assert len(times) == n
    return times


def tpot_ms(times: list[float]) -> float:
    return (times[-1] - times[0]) / (len(times) - 1) * 1000


async def metrics(m: MockServer) -> dict[str, float]:
    async with aiohttp.ClientSession() as s, s.get(m.base_url + "/metrics") as r:
        assert r.status == 200
        text = await r.text()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("vllm:"):
            name, value = line.rsplit(" ", 1)
            out[name.split("{")[0]] = float(value)
    return out


async def wait_metric(m: MockServer, name: str, at_least: float, within: float = 10.0) -> None:
    deadline = time.monotonic() + within
    while (await metrics(m))[name] < at_least:
        assert time.monotonic() < deadline, name
        await asyncio.sleep(0.005)


@pytest.fixture
async def h100() -> AsyncIterator[MockServer]:
    async with MockServer(MockBehavior(engine="h100-7b", seed=1)) as m:
        yield m


# ---- through HTTP ------------------------------------------------------------------------------


async def test_idle_ttft_of_1k_tokens_is_the_prefill(h100: MockServer) -> None:
    """Design §5's check on h100-7b: an idle engine answers 1k uncached prompt tokens' first
    token after ≈ 41 ms (6 ms + 1000 × 0.035 ms), later tokens one step (≈ 6 ms) apart."""
    async with client(h100) as c:
        await stream_times(c, prompt("warm-up", 10), 2)  # the connection and the client
        ttfts, tpots = [], []
        for i in range(3):
            times = await stream_times(c, prompt(f"idle-{i}", 1000), 10)
            ttfts.append(times[0] * 1000)
            tpots.append(tpot_ms(times))
    ttft = statistics.median(ttfts)
    assert 30 <= ttft <= 250, ttfts
    assert 4 <= statistics.median(tpots) <= 40, tpots
    # the same prompt again: its blocks are cached, the prefill is (almost) skipped
    async with client(h100) as c:
        again = await stream_times(c, prompt("idle-0", 1000), 2)
    assert again[0] * 1000 < ttft - 15, (again, ttfts)
    m = await metrics(h100)
    assert m["vllm:prefix_cache_hits_total"] > 0
    assert m["vllm:num_requests_running"] == 0 and m["vllm:num_requests_waiting"] == 0


async def test_usage_counts_prompt_and_completion_tokens(h100: MockServer) -> None:
    async with client(h100) as c:
        r = await c.chat.completions.create(
            model="m", messages=[{"role": "user", "content": prompt("u", 50)}], max_tokens=7
        )
    assert r.usage is not None
    assert r.usage.completion_tokens == 7
    assert r.usage.prompt_tokens == 50
    assert r.choices[0].finish_reason == "length"


async def test_time_per_token_rises_with_running_sequences() -> None:
    """Every running sequence lengthens every other's step: a backend past its knee (here 2
    running, +4 ms a step for each one more) gives 10 concurrent streams a time per token
    several times the lone stream's."""
    b = MockBehavior(engine="h100-7b", seed=2, max_num_seqs=16, knee=2, knee_ms=4.0)
    async with MockServer(b) as m, client(m) as c:
        await stream_times(c, prompt("warm-up", 10), 2)
        alone = tpot_ms(await stream_times(c, prompt("alone", 100), 30))
        many = await asyncio.gather(*(stream_times(c, prompt(f"b{i}", 100), 30) for i in range(10)))
        crowded = statistics.median(tpot_ms(t) for t in many)
    # alone ≈ 6 ms; 10 running ≈ 6 + 0.3 + 8 × 4 ≈ 38 ms
    assert crowded > 2.5 * alone, (alone, crowded)


async def test_requests_beyond_kv_capacity_wait_inside_the_backend() -> None:
    """A 2048-token KV cache holds two 960-token prompts (61 blocks of 16 each; 63 once
    they have decoded 40 tokens): the other two wait in the engine — visible in its
    `vllm:num_requests_waiting` — and are served when blocks free; all four answer."""
    b = MockBehavior(engine="h100-7b", seed=3, kv_tokens=2048)
    async with MockServer(b) as m, client(m) as c:
        await stream_times(c, prompt("warm-up", 10), 2)
        tasks = [asyncio.create_task(stream_times(c, prompt(f"kv{i}", 960), 40)) for i in range(4)]
        seen: list[dict[str, float]] = []
        while not all(t.done() for t in tasks):
            seen.append(await metrics(m))
            await asyncio.sleep(0.02)
        results = await asyncio.gather(*tasks)
        assert all(len(r) == 40 for r in results)
        waiting = max(s["vllm:num_requests_waiting"] for s in seen)
        running = max(s["vllm:num_requests_running"] for s in seen)
        usage = max(s["vllm:kv_cache_usage_perc"] for s in seen)
        assert waiting >= 1, seen
        assert running == 2, seen
        assert 0.9 < usage <= 1.0
        # the two that waited got their first token after a whole first pair had decoded
        firsts = sorted(r[0] for r in results)
        assert firsts[2] > firsts[1] + 0.1, firsts
        final = await metrics(m)
    assert final["vllm:num_requests_waiting"] == 0 and final["vllm:num_requests_running"] == 0
    assert final["vllm:gpu_cache_usage_perc"] == 0.0  # the deprecated name the gateway reads
    assert final["vllm:cache_config_info"] == 1.0
    assert final["vllm:num_preemptions_total"] == 0


async def test_speed_factor_and_runtime_drift() -> None:
    """`speed` 3 answers three times faster than `speed` 1; `time_factor` (changed at runtime
    through /mock/config) slows every step."""
    slow_b = MockBehavior(engine="h100-7b", seed=4)
    fast_b = MockBehavior(engine="h100-7b", seed=4, speed=3.0)

    async def e2e(m: MockServer, tag: str) -> float:
        async with client(m) as c:
            await c.chat.completions.create(
                model="m", messages=[{"role": "user", "content": "warm"}], max_tokens=1
            )
            took = []
            for i in range(3):
                t0 = time.perf_counter()
                await c.chat.completions.create(
                    model="m",
                    messages=[{"role": "user", "content": prompt(f"{tag}{i}", 400)}],
                    max_tokens=40,
                )
                took.append(time.perf_counter() - t0)
            return statistics.median(took)

    async with MockServer(slow_b) as slow, MockServer(fast_b) as fast:
        t_slow, t_fast = await e2e(slow, "s"), await e2e(fast, "f")
        # ≈ 20 ms + 40 × 6 ms = 260 ms against ≈ 87 ms
        assert 2.0 < t_slow / t_fast < 4.5, (t_slow, t_fast)
        async with (
            aiohttp.ClientSession() as s,
            s.post(slow.base_url + "/mock/config", json={"time_factor": 2.0}) as r,
        ):
            assert r.status == 200
        t_drift = await e2e(slow, "d")
        assert 1.5 < t_drift / t_slow < 3.0, (t_slow, t_drift)


async def test_waiting_queue_is_bounded() -> None:
    """Beyond `max_waiting` waiting requests the engine answers 503 at once (OpenAI-shaped)."""
    b = MockBehavior(engine="h100-7b", seed=5, max_num_seqs=1, max_waiting=1)
    async with MockServer(b) as m, client(m) as c:
        first = asyncio.create_task(stream_times(c, prompt("run", 10), 300))
        await wait_metric(m, "vllm:num_requests_running", 1)
        second = asyncio.create_task(stream_times(c, prompt("wait", 10), 5))
        await wait_metric(m, "vllm:num_requests_waiting", 1)
        t0 = time.perf_counter()
        with pytest.raises(openai.InternalServerError) as err:
            await c.chat.completions.create(
                model="m", messages=[{"role": "user", "content": "third"}], max_tokens=5
            )
        assert time.perf_counter() - t0 < 0.5
        assert err.value.status_code == 503
        body: Any = err.value.body
        assert body["code"] == "overloaded"
        assert len(await second) == 5 and len(await first) == 300


async def test_a_prompt_beyond_the_kv_cache_is_refused() -> None:
    """A prompt (with its max_tokens) the whole KV cache cannot hold would wait forever:
    400 at once, as vLLM refuses a request beyond its context length."""
    b = MockBehavior(engine="h100-7b", seed=6, kv_tokens=256)
    async with MockServer(b) as m, client(m) as c:
        with pytest.raises(openai.BadRequestError) as err:
            await c.chat.completions.create(
                model="m",
                messages=[{"role": "user", "content": prompt("big", 200)}],
                max_tokens=100,
            )
        body: Any = err.value.body
        assert body["code"] == "context_length_exceeded"
        r = await c.chat.completions.create(
            model="m", messages=[{"role": "user", "content": prompt("small", 100)}], max_tokens=3
        )
        assert r.usage is not None and r.usage.completion_tokens == 3


async def test_cancelled_stream_frees_its_place(h100: MockServer) -> None:
    """A client that goes away mid-stream leaves the engine empty (nothing running, waiting
    or holding KV blocks)."""
    async with client(h100) as c:
        stream = await c.chat.completions.create(
            model="m",
            messages=[{"role": "user", "content": prompt("gone", 100)}],
            max_tokens=2000,
            stream=True,
        )
        got = 0
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                got += 1
                if got == 3:
                    break
        await stream.close()
    deadline = time.monotonic() + 5
    while True:
        m = await metrics(h100)
        if m["vllm:num_requests_running"] == 0 and m["vllm:kv_cache_usage_perc"] == 0.0:
            break
        assert time.monotonic() < deadline, m
        await asyncio.sleep(0.02)


# ---- the model in process (no clock) -----------------------------------------------------------


def test_step_time_matches_design_checks() -> None:
    """Design §5's checks on h100-7b: a step of 64 decodes at 1.5k context ≈ 12 ms, of 256
    ≈ 29 ms (±5 % jitter)."""
    e = Engine(PROFILES["h100-7b"], seed=1)
    assert 11.0 * 0.95 <= e.step_ms(0, 64, 64 * 1500) <= 12.0 * 1.05
    assert 28.0 * 0.95 <= e.step_ms(0, 256, 256 * 1500) <= 30.0 * 1.05
    assert 39.0 <= e.step_ms(1000, 0, 0) <= 43.0  # 1k-token prefill ≈ 41 ms
    slow = Engine(PROFILES["a100-7b"], seed=1, speed=0.5)
    assert 19.0 <= slow.step_ms(0, 1, 100) <= 21.5  # t0 10 ms, twice as slow


async def test_out_of_blocks_preempts_the_newest_and_recomputes() -> None:
    """16 blocks of KV for two 100-token prompts that grow to 160: the newest is preempted
    (recompute), waits, and both still produce every token."""
    e = Engine(profile_with("h100-7b", kv_tokens=256), seed=1)
    a = e.submit(prompt("a", 100), 100, 60)
    b = e.submit(prompt("b", 100), 100, 60)
    assert e._task is not None
    e._task.cancel()  # driven by hand below, no clock
    steps = 0
    while not (a.finished and b.finished):
        plan = e.schedule()
        assert plan is not None
        e.apply(plan[0])
        assert e.used_blocks <= e.total_blocks
        steps += 1
        assert steps < 1000
    assert (a.produced, b.produced) == (60, 60)
    assert e.preemptions >= 1 and b.preemptions >= 1 and a.preemptions == 0
    assert e.used_blocks == 0 and not e.running and not e.waiting


def test_flags() -> None:
    p = argparse.ArgumentParser()
    add_arguments(p)
    flags = "--port 1 --engine a100-7b --max-num-seqs 4 --kv-tokens 20000 --speed 0.5"
    flags += " --time-factor 1.5 --knee 4 --knee-ms 20 --max-waiting 64"
    args = p.parse_args(flags.split(" "))
    b = behavior_from_args(args)
    assert (b.engine, b.max_num_seqs, b.kv_tokens, b.speed, b.time_factor) == (
        "a100-7b",
        4,
        20000,
        0.5,
        1.5,
    )
    assert (b.knee, b.knee_ms, b.max_waiting) == (4, 20.0, 64)
    assert behavior_from_args(p.parse_args(["--port", "1"])).engine == ""
    with pytest.raises(ValueError):
        MockBehavior(engine="tpu-9000")
    with pytest.raises(ValueError):
        MockBehavior(engine="h100-7b", speed=0.0)
    out = subprocess.run(
        [sys.executable, "-c", "from gateway.cli import main; main()", "mock", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout
    for flag in ("--engine", "--speed", "--time-factor", "--knee", "--kv-tokens", "--max-waiting"):
        assert flag in out
