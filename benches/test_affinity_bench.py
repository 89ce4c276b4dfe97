"""Micro-benchmarks of placement by the longest shared prefix (SPEC §15), from Python.

- `blocks`: `_core.Prefix` of a 4 KiB prompt (64 chained 64-byte blocks): ASCII, and 1,366
  CJK characters (4 KiB of UTF-8: the str's UTF-8 encoding is part of the cost), a fresh
  str each round.
- `placement`: one submit -> grant -> release cycle in an `affinity` pool of 8 instances, each
  running half its slots, whose index already holds 48 problems: every request is one of them
  (1.8 KB statement) followed by 2.2 KB of code never seen before, so the longest-match
  search finds a run of ~28 blocks on one instance and the grant records ~36 new blocks.
  `placement+blocks` adds computing the blocks (the whole per-request cost in the gateway);
  `least_connections` is the same cycle without affinity, for scale.

Run with `pytest benches/test_affinity_bench.py --benchmark-only`; see benches/README.md.
"""

from __future__ import annotations

import itertools
import random
from typing import Any

import pytest

from gateway._core import Balancer, Outcome, Pool, PoolConfig, Prefix, Priority
from gateway.affinity import stable_id

INSTANCES, SLOTS, BUSY = 8, 16, 8
BLOCK, MAX_BLOCKS, SEED = 64, 512, 12345


def prompt(problem: int, code: int) -> str:
    """A 4 KiB judge prompt: problem `problem`'s statement, then submission `code`."""
    rng = random.Random(problem)
    statement = "".join(chr(97 + rng.randrange(26)) for _ in range(1800))
    rng = random.Random(10_000 + code)
    tail = "".join(chr(65 + rng.randrange(26)) for _ in range(4096 - 1800))
    return statement + tail


@pytest.mark.parametrize("script", ["ascii", "cjk"])
def test_blocks(benchmark: Any, script: str) -> None:
    benchmark.group = "prefix blocks of a 4 KiB prompt"
    text = prompt(1, 1) if script == "ascii" else "题目描述" * 341 + "题a"
    assert len(text.encode()) == 4096
    # A fresh str every round, as every request's is: CPython caches a str's UTF-8 once made.
    fresh = itertools.count()

    def setup() -> tuple[tuple[str, int, int, int], dict[str, Any]]:
        return (text[:-1] + chr(97 + next(fresh) % 26), BLOCK, MAX_BLOCKS, SEED), {}

    blocks = benchmark.pedantic(Prefix, setup=setup, rounds=20_000)
    assert len(blocks) == 64


def affine_pool(balancer: Balancer) -> Pool:
    pool = Pool(PoolConfig(balancer=balancer, high_capacity=10_000), 1)
    for i in range(INSTANCES):
        pool.add_instance(SLOTS, stable_id(f"vllm-{i}"))
    for ticket in range(INSTANCES * BUSY):  # the busy half, no key: least connections
        assert pool.submit(ticket, Priority.HIGH, 0) is not None
    return pool


@pytest.mark.parametrize("what", ["least_connections", "placement", "placement+blocks"])
def test_placement(benchmark: Any, what: str) -> None:
    benchmark.group = f"submit->grant->release, {INSTANCES} instances, 4 KiB prompts"
    balancer = Balancer.LEAST_CONNECTIONS if what == "least_connections" else Balancer.AFFINITY
    pool = affine_pool(balancer)
    texts = [prompt(p % 48, p) for p in range(4_000)]
    prefixes = [Prefix(t, BLOCK, MAX_BLOCKS, SEED) for t in texts]
    tickets = itertools.count(1_000_000)
    for p in range(48):  # warm: every problem sent once
        t = next(tickets)
        pool.submit(t, Priority.HIGH, 1, prefix=prefixes[p])
        pool.release(t, Outcome.SUCCESS, 1)
    turn = itertools.cycle(range(48, 4_000))
    high, success = Priority.HIGH, Outcome.SUCCESS

    if what == "placement+blocks":

        def cycle() -> None:
            ticket = next(tickets)
            blocks = Prefix(texts[next(turn)], BLOCK, MAX_BLOCKS, SEED)
            pool.submit(ticket, high, 1, prefix=blocks)
            pool.release(ticket, success, 1)

    elif what == "placement":

        def cycle() -> None:
            ticket = next(tickets)
            pool.submit(ticket, high, 1, prefix=prefixes[next(turn)])
            pool.release(ticket, success, 1)

    else:

        def cycle() -> None:
            ticket = next(tickets)
            pool.submit(ticket, high, 1)
            pool.release(ticket, success, 1)

    benchmark(cycle)
    assert (pool.in_flight, pool.waiting) == (INSTANCES * BUSY, 0)
    if what != "least_connections":
        # the statements were found: the last request matched its problem's ~28 blocks
        assert pool.last_matched_blocks() >= 1800 // BLOCK
