"""SPEC §15: prefix affinity (consistent hashing with bounded loads), vLLM backend load and
tier routes — in the core, in the pieces around it, and end to end through the gateway."""

from __future__ import annotations

import argparse
import asyncio
import itertools
import math
import random
from collections import Counter
from typing import Any

import aiohttp
import openai
import pytest

from gateway import _core
from gateway._core import Affinity, Balancer, Outcome, PoolConfig, Priority
from gateway.affinity import affinity_key, render_prefix, stable_id
from gateway.backend_load import BackendLoad, parse_vllm_metrics
from gateway.check import describe
from gateway.config import parse_config
from gateway.errors import ConfigError
from gateway.sim.mock import add_arguments, behavior_from_args
from reference_scheduler import ReferencePool
from support import GatewayFactory, MockFactory, chat, eventually, pool_config, simple_config

HIGH = Priority.HIGH

# ---- the core: the rule, in lockstep with the reference model ------------------------------


def affine_core(n: int, epsilon: float = 0.25, slots: int = 100) -> _core.Pool:
    pool = _core.Pool(PoolConfig(balancer=Balancer.AFFINITY, affinity_epsilon=epsilon))
    for k in range(n):
        pool.add_instance(slots, stable_id(f"vllm-{k}"))
    return pool


def test_a_key_stays_on_its_instance_while_loads_allow() -> None:
    """The same key maps to the same instance ("hit") as long as that instance is under the
    bound; a request without a key is placed by least connections ("none")."""
    pool = affine_core(4)
    key = affinity_key({}, chat("the same problem statement"), 2048)
    homes = set()
    for ticket in range(1, 40):
        homes.add(pool.submit(ticket, HIGH, 0, affinity_key=key))
        assert pool.last_affinity() is Affinity.HIT
        pool.release(ticket, Outcome.SUCCESS, 0)
    assert len(homes) == 1
    assert pool.submit(100, HIGH, 0) is not None
    assert pool.last_affinity() is Affinity.NONE
    stats = pool.stats()
    assert (stats.affinity_hits, stats.affinity_spills) == (39, 0)


@pytest.mark.parametrize("epsilon", [0.1, 0.25, 1.0])
def test_a_hot_key_spills_within_the_bound(epsilon: float) -> None:
    """Mirrokni et al.: one key arriving faster than it leaves fills its instance up to
    ceil((1 + ε) × average), then the next on the ring, and so on — never past the bound."""
    pool = affine_core(4, epsilon)
    ref = ReferencePool(PoolConfig(balancer=Balancer.AFFINITY, affinity_epsilon=epsilon))
    for k in range(4):
        ref.add_instance(100, stable_id(f"vllm-{k}"))
    key = affinity_key({}, chat("hot"), 2048)
    placed = []
    for ticket in range(1, 81):
        granted = pool.submit(ticket, HIGH, 0, affinity_key=key)
        assert granted == ref.submit(ticket, HIGH, 0, affinity_key=key)
        assert pool.last_affinity() == ref.last_affinity()
        placed.append(pool.last_affinity())
        loads = [pool.instance(i, 0).in_flight for i in range(4)]
        average = sum(loads) / 4
        assert max(loads) <= math.ceil((1 + epsilon) * average) + 1, loads
        if ticket % 3 == 0:  # some finish
            done = ticket - 1
            pool.release(done, Outcome.SUCCESS, 0)
            ref.release(done, Outcome.SUCCESS, 0)
    assert Affinity.SPILL in placed and placed[0] is Affinity.HIT


def test_removing_an_instance_moves_only_its_keys() -> None:
    pool = affine_core(5)
    keys = [affinity_key({}, chat(f"problem {k}"), 2048) for k in range(200)]
    tickets = itertools.count(1)

    def home(key: int) -> int:
        ticket = next(tickets)
        inst = pool.submit(ticket, HIGH, 0, affinity_key=key)
        assert inst is not None
        pool.release(ticket, Outcome.SUCCESS, 0)
        return inst

    before = [home(k) for k in keys]
    pool.remove_instance(2)
    after = [home(k) for k in keys]
    moved = [(b, a) for b, a in zip(before, after, strict=True) if b != a]
    assert moved and all(b == 2 for b, _ in moved)
    assert 2 not in after


def test_backend_waiting_counts_as_load() -> None:
    """SPEC §15: least connections compares (in_flight + waiting) / max_concurrency, equal
    loads going to the emptier KV cache."""
    pool = _core.Pool(PoolConfig())
    pool.add_instance(4)
    pool.add_instance(4)
    pool.set_backend_load(0, 3, 0.9)
    assert [pool.submit(t, HIGH, 0) for t in (1, 2, 3)] == [1, 1, 1]
    pool.set_backend_load(1, 0, 0.95)
    assert pool.submit(4, HIGH, 0) == 0  # 3/4 each: the emptier cache
    info = pool.instance(0, 0)
    assert (info.backend_waiting, info.cache_permille) == (3, 900)


# ---- keys and backend readings ---------------------------------------------------------------


def test_affinity_key_is_the_session_or_the_prompt_prefix() -> None:
    statement = "Problem 1: given n integers, " + "x" * 3000
    a = chat(statement + " submission A")
    b = chat(statement + " submission B")
    assert affinity_key({}, a, 2048) == affinity_key({}, b, 2048) != 0
    assert affinity_key({}, a, 5000) != affinity_key({}, b, 5000)
    assert affinity_key({}, chat("other"), 2048) != affinity_key({}, a, 2048)
    # roles count, in order
    swapped = {"messages": [{"role": "system", "content": "hi"}]}
    assert affinity_key({}, swapped, 2048) != affinity_key({}, chat("hi"), 2048)
    # a session wins over the prompt: header first, then the body's `user`
    s1 = affinity_key({"X-Session-Id": "s-1"}, a, 2048)
    assert s1 == affinity_key({"X-Session-Id": "s-1"}, chat("anything"), 2048)
    assert s1 == affinity_key({}, {**chat("x"), "user": "s-1"}, 2048)
    assert affinity_key({}, {"model": "m", "messages": []}, 2048) == 0
    parts = {"messages": [{"role": "user", "content": [{"type": "text", "text": "abc"}]}]}
    assert render_prefix(parts, 100) == "user\nabc\n"
    assert render_prefix({"prompt": "complete me"}, 4) == "comp"


VLLM_METRICS = b"""\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="qwen"} 12.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="qwen"} 3.0
vllm:num_requests_waiting{engine="1",model_name="qwen"} 2.0
vllm:num_requests_waiting_total 99
# HELP vllm:gpu_cache_usage_perc GPU KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:gpu_cache_usage_perc gauge
vllm:gpu_cache_usage_perc{engine="0",model_name="qwen"} 0.42
vllm:gpu_cache_usage_perc{engine="1",model_name="qwen"} 0.61
"""


def test_vllm_metrics_are_read_by_a_line_scan() -> None:
    assert parse_vllm_metrics(VLLM_METRICS) == BackendLoad(5, 0.61)
    newer = b'vllm:kv_cache_usage_perc{model_name="q"} 0.5\nvllm:num_requests_waiting 1\n'
    assert parse_vllm_metrics(newer) == BackendLoad(1, 0.5)
    assert parse_vllm_metrics(b"# nothing here\nother_metric 1\n") is None
    assert parse_vllm_metrics(b'vllm:num_requests_waiting{a="b"} NaN\n') is None
    assert parse_vllm_metrics(b"vllm:gpu_cache_usage_perc 7\n") == BackendLoad(0, 1.0)


# ---- the mock's prefix cache and vLLM surface ------------------------------------------------


async def test_mock_prefix_cache_serves_hits_faster_and_exposes_vllm_metrics(
    mocks: MockFactory,
) -> None:
    mock = await mocks(prefix_cache=2, prefix_chars=400, prefill_us_per_char=200.0)
    problem = "p" * 400  # a miss prefills ~400 chars (~80 ms), a hit the few after the prefix
    async with aiohttp.ClientSession() as s:

        async def ask(text: str) -> float:
            t0 = asyncio.get_running_loop().time()
            async with s.post(mock.url + "/chat/completions", json=chat(text)) as r:
                assert r.status == 200
                await r.read()
            return asyncio.get_running_loop().time() - t0

        miss = await ask(problem + "A")
        hit = await ask(problem + "B")
        for other in ("q", "r", "s"):  # evicts problem p from the 2-entry LRU
            await ask(other * 400)
        again = await ask(problem + "C")
        assert hit < miss / 2 and again > hit * 2
        assert (mock.stats.prefix_hits, mock.stats.prefix_misses) == (1, 5)
        async with s.get(mock.base_url + "/metrics") as r:
            text = await r.read()
    assert parse_vllm_metrics(text) == BackendLoad(0, 1.0)
    assert b"vllm:prefix_cache_hits_total" in text


async def test_mock_max_num_seqs_queues_like_vllm(mocks: MockFactory) -> None:
    mock = await mocks(max_num_seqs=1, latency_ms=300.0)
    async with aiohttp.ClientSession() as s:
        tasks = [
            asyncio.create_task(s.post(mock.url + "/chat/completions", json=chat()))
            for _ in range(3)
        ]
        await eventually(lambda: mock.stats.waiting == 2, what="two waiting")
        load = parse_vllm_metrics(mock.metrics_text())
        assert load is not None and load.waiting == 2
        for resp in await asyncio.gather(*tasks):
            assert resp.status == 200
            resp.release()
    assert mock.stats.peak_waiting == 2 and mock.stats.waiting == 0


# ---- end to end through the gateway ----------------------------------------------------------


def judge_request(problem: int, submission: int) -> dict[str, Any]:
    """One judge request: a long problem statement (the shared prefix) and a submission."""
    statement = f"Problem {problem}. " + f"Given an array of n integers (variant {problem}). " * 60
    code = f"def solve(a):\n    return sorted(a)[{submission}]\n"
    return {
        "model": "m",
        "messages": [
            {"role": "system", "content": statement},
            {"role": "user", "content": f"Judge this submission:\n{code}"},
        ],
        "max_tokens": 4,
    }


async def judge_run(gw_url: str, problems: int, per_problem: int) -> Counter[str]:
    """Sends the workload (seeded shuffle, 8 at a time); counts X-Gateway-Affinity."""
    order = [(p, s) for s in range(per_problem) for p in range(problems)]
    random.Random(7).shuffle(order)
    seen: Counter[str] = Counter()
    sem = asyncio.Semaphore(8)
    async with aiohttp.ClientSession() as session:

        async def one(p: int, s: int) -> None:
            url = gw_url + "/v1/chat/completions"
            async with sem, session.post(url, json=judge_request(p, s)) as r:
                assert r.status == 200, await r.text()
                seen[r.headers["X-Gateway-Affinity"]] += 1

        await asyncio.gather(*(one(p, s) for p, s in order))
    return seen


async def test_affinity_raises_the_prefix_cache_hit_rate(
    gateway_factory: GatewayFactory, mocks: MockFactory
) -> None:
    """The judge workload (12 problems × 10 submissions) on 4 backends that each cache 4
    prefixes: under least connections every backend sees every problem; under affinity each
    sees about a quarter of them, so its cache hits far more often (generous bounds: the
    benchmark, benches/affinity.py, measures the real ratio)."""
    rates = {}
    for balancer in ("least_connections", "affinity"):
        backends = [await mocks(prefix_cache=4, latency_ms=5.0) for _ in range(4)]
        gw = await gateway_factory(
            simple_config(pool_config(*[(m, 8) for m in backends]), balancer=balancer)
        )
        seen = await judge_run(gw.url, problems=12, per_problem=10)
        hits = sum(m.stats.prefix_hits for m in backends)
        rates[balancer] = hits / (hits + sum(m.stats.prefix_misses for m in backends))
        if balancer == "affinity":
            assert seen["hit"] >= 60 and seen["none"] == 0, seen
            pool = (await gw.state())["pools"]["p"]
            assert pool["balancer"] == "affinity"
            assert pool["affinity"] == {"hits": seen["hit"], "spills": seen["spill"]}
        else:
            assert seen == Counter({"none": 120})
        await gw.assert_quiet()
    assert rates["affinity"] >= max(0.4, 1.6 * rates["least_connections"]), rates


async def test_a_session_sticks_and_a_hot_key_spills(
    gateway_factory: GatewayFactory, mocks: MockFactory
) -> None:
    backends = [await mocks(latency_ms=150.0) for _ in range(4)]
    gw = await gateway_factory(
        simple_config(
            pool_config(*[(m, 8) for m in backends], balancer="affinity"),
            affinity={"epsilon": 0.5},
        )
    )
    instances = set()
    for _ in range(5):
        resp = await gw.post("/v1/chat/completions", chat("x"), headers={"X-Session-Id": "s1"})
        assert resp.status == 200
        assert resp.headers["X-Gateway-Affinity"] == "hit"
        instances.add(resp.headers["X-Gateway-Instance"])
        resp.release()
    assert len(instances) == 1
    # 16 at once with one key: ceil(1.5 × average) + 1 caps the first choice, the rest spill
    resps = await asyncio.gather(
        *(gw.post("/v1/chat/completions", chat("hot problem")) for _ in range(16))
    )
    placed = Counter(r.headers["X-Gateway-Affinity"] for r in resps)
    per_instance = Counter(r.headers["X-Gateway-Instance"] for r in resps)
    for r in resps:
        assert r.status == 200
        r.release()
    assert placed["hit"] >= 1 and placed["spill"] >= 8, placed
    assert max(per_instance.values()) <= math.ceil(1.5 * 16 / 4) + 1, per_instance
    await gw.assert_quiet()


async def test_vllm_backend_load_shows_in_admin_state(
    gateway_factory: GatewayFactory, mocks: MockFactory
) -> None:
    vllm = await mocks(max_num_seqs=1, latency_ms=400.0, prefix_cache=4)
    other = await mocks()
    cfg = simple_config(pool_config((vllm, 4), other), health={"probe": {"interval_ms": 50}})
    cfg["pools"]["p"]["instances"][0]["provider"] = "vllm"
    gw = await gateway_factory(cfg)
    async with aiohttp.ClientSession() as s:
        # three requests straight at the backend: one runs, two wait in vLLM's own queue
        tasks = [
            asyncio.create_task(s.post(vllm.url + "/chat/completions", json=chat()))
            for _ in range(3)
        ]
        state = await gw.wait_state(
            lambda st: (st["pools"]["p"]["instances"][0]["backend"] or {}).get("waiting") == 2,
            what="the backend's queue in /admin/state",
        )
        inst = state["pools"]["p"]["instances"]
        assert inst[1]["backend"] is None  # not a vLLM instance: not read
        # the gateway counts that queue: a new request goes to the other instance
        resp = await gw.post("/v1/chat/completions", chat())
        assert resp.headers["X-Gateway-Instance"] == inst[1]["name"]
        resp.release()
        for r in await asyncio.gather(*tasks):
            r.release()


# ---- tier routes -----------------------------------------------------------------------------


async def test_tier_routes_send_the_same_alias_to_different_pools(
    gateway_factory: GatewayFactory, mocks: MockFactory
) -> None:
    """The seed: paid users to the fastest model, free users to the fallback model — through
    the official openai client, with `model: judge` from both."""
    fast, lite = await mocks(), await mocks()
    gw = await gateway_factory(
        {
            "pools": {"fast": pool_config(fast), "lite": pool_config(lite)},
            "models": {"judge": {"pool": "fast"}, "judge-lite": {"pool": "lite"}},
            "auth": {
                "keys": [
                    {"key": "sk-free", "name": "free", "routes": {"judge": "judge-lite"}},
                    {"key": "sk-paid", "name": "paid"},
                ]
            },
        }
    )
    pools = {}
    for key in ("sk-free", "sk-paid"):
        async with openai.AsyncOpenAI(base_url=gw.base_url, api_key=key, max_retries=0) as c:
            raw = await c.chat.completions.with_raw_response.create(
                model="judge", messages=[{"role": "user", "content": "verdict?"}]
            )
            pools[key] = raw.headers["X-Gateway-Pool"]
            assert raw.parse().choices[0].message.content
    assert pools == {"sk-free": "lite", "sk-paid": "fast"}
    assert len(lite.requests) == 1 and len(fast.requests) == 1


def test_tier_routes_are_validated_and_shown_by_check() -> None:
    base = """
pools: {light: {instances: [{name: a, url: "http://h:1/v1", model: q, max_concurrency: 2}]},
        heavy: {balancer: affinity,
                instances: [{name: b, url: "http://h:2/v1", model: g, max_concurrency: 2}]}}
models: {judge: {pool: heavy}, judge-lite: {pool: light}}
"""
    cfg = parse_config(
        base + "auth: {keys: [{key: k1, name: free, routes: {judge: judge-lite}}]}\n", env={}
    )
    text = describe(cfg)
    assert "route judge → judge-lite  (pool light)" in text
    assert (
        "affinity(block_bytes=64 max_blocks=512 cache_tokens=131072 hash_seed=0 epsilon=0.25)"
        in text
    )
    assert "balancer=affinity" in text
    for bad, where in [
        ("auth: {keys: [{key: k1, name: f, routes: {judge: nope}}]}", "auth.keys[0].routes.judge"),
        ("auth: {keys: [{key: k1, name: f, routes: {nope: judge}}]}", "auth.keys[0].routes.nope"),
        ("affinity: {epsilon: 0}", "affinity.epsilon"),
        ("affinity: {prefix_chars: 0}", "affinity.prefix_chars"),
        ("balancer: sticky", "balancer"),
    ]:
        with pytest.raises(ConfigError) as err:
            parse_config(base + bad + "\n", env={})
        assert err.value.path == where, err.value


def test_mock_flags_set_the_prefix_cache() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    flags = {"--prefix-cache": 8, "--prefix-chars": 1024, "--prefill-us-per-char": 40}
    argv = ["--port", "1", "--max-num-seqs", "16"]
    for flag, value in flags.items():
        argv += [flag, str(value)]
    args = parser.parse_args(argv)
    b = behavior_from_args(args)
    assert (b.prefix_cache, b.prefix_chars, b.prefill_us_per_char, b.max_num_seqs) == (
        8,
        1024,
        40.0,
        16,
    )
    with pytest.raises(ValueError):
        behavior_from_args(parser.parse_args(["--port", "1", "--prefix-cache", "-1"]))
