"""Micro-benchmarks of the scheduling core from Python: one submit -> grant -> release cycle.

The pool is busy but not saturated — every instance runs half its slots — so each cycle is
an immediate grant that makes the balancer compare every instance (least connections), then
a release that finds nobody waiting: the gateway's steady state below saturation. The same
cycle runs on the pure-Python reference model (tests/reference_scheduler.py) for scale.

SPEC §12 (`--workers N`): `rust-shared` is the same cycle on a pool attached as worker 0 of a
2-worker region over a memfd (what each worker runs: every grant and release is a CAS on the
instance's shared lease word, the queues' union and the selector state are shared);
`rust-shared-peer` is that pool with the load held by the other worker's pool (worker 1, in
this process) instead of its own, so the balancer reads the peer's fields of every lease word.

SPEC §17: `test_predicted_deadline_cycle` is the cycle on a `predicted` pool whose latency
models are calibrated (every grant scores every instance with its model), each request carrying
a deadline and a prompt size: `idle` is the immediate grant below saturation (plus
`first_token` and a release with output tokens, which train the model); `saturated` keeps every
slot busy and 64 requests waiting with random deadlines, so each cycle queues one request at its
deadline's place and each release grants the earliest deadline.

Run with `make bench`, or `pytest benches --benchmark-only`; see benches/README.md.
"""

from __future__ import annotations

import collections
import itertools
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import gateway._core
from gateway._core import REGION_BYTES, Balancer, Outcome, Pool, PoolConfig, Priority, Region

# The reference model lives with the tests; only that directory is added, so `gateway`
# still comes from wherever it is installed (a release wheel, for honest numbers).
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from reference_scheduler import ReferencePool

SLOTS = 16  # max_concurrency of each instance
BUSY = SLOTS // 2  # attempts kept in flight on each instance while measuring


def region_pools(cfg: PoolConfig, workers: int = 2) -> list[Pool]:
    """One pool per worker slot, attached to a fresh region over a memfd (SPEC §12), as the
    supervisor and its workers make them (here all in this process)."""
    fd = os.memfd_create("bench-region", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, REGION_BYTES)
    regions = [Region(fd, workers)] + [Region(fd) for _ in range(workers - 1)]
    os.close(fd)  # the mappings keep the memory
    pools = []
    for worker, region in enumerate(regions):
        pool = Pool(cfg, 1)
        pool.attach(region, 1, worker)
        pools.append(pool)
    return pools


MODELS: dict[str, Callable[[PoolConfig], Any]] = {
    "rust": lambda cfg: Pool(cfg, 1),
    "rust-shared": lambda cfg: region_pools(cfg)[0],
    "rust-shared-peer": region_pools,  # [measured (worker 0), loaded (worker 1)]
    "reference": lambda cfg: ReferencePool(cfg, 1),
}


def busy_pool(model: str, instances: int) -> tuple[Any, Any]:
    """A pool of `instances` instances, each running BUSY of its SLOTS attempts (held by the
    other worker's pool for `rust-shared-peer`): (the pool, the pool holding the load)."""
    made = MODELS[model](PoolConfig())
    pool, loaded = (made[0], made[1]) if isinstance(made, list) else (made, made)
    for p in {id(pool): pool, id(loaded): loaded}.values():
        for i in range(instances):
            if model.startswith("rust-shared"):
                # An attached pool finds an instance's lease word by this id, as the gateway's
                # stable_id(name): without it the id is the index, and 0 and 1 both become 1.
                p.add_instance(SLOTS, 1000 + i)
            else:
                p.add_instance(SLOTS)
    for ticket in range(instances * BUSY):
        granted = loaded.submit(ticket, Priority.HIGH, 0)
        assert granted is not None and granted >= 0
    assert loaded.in_flight == instances * BUSY
    return pool, loaded


@pytest.mark.parametrize("instances", [2, 8, 64])
@pytest.mark.parametrize("model", list(MODELS))
def test_submit_grant_release(benchmark: Any, model: str, instances: int) -> None:
    """One request's whole life in the scheduler, at the given pool size."""
    benchmark.group = f"submit->grant->release, {instances:>2} instances"  # sorts 2, 8, 64
    benchmark.extra_info["core"] = gateway._core.__file__
    pool, loaded = busy_pool(model, instances)
    tickets = itertools.count(instances * BUSY)
    high, success = Priority.HIGH, Outcome.SUCCESS

    def cycle() -> None:
        ticket = next(tickets)
        pool.submit(ticket, high, 1)
        pool.release(ticket, success, 1)

    benchmark(cycle)
    # the pool is exactly as busy as before: every cycle was granted and released
    assert (loaded.in_flight, pool.waiting) == (instances * BUSY, 0)


def calibrated_pool(instances: int) -> tuple[Pool, int]:
    """A `predicted` pool of `instances` x SLOTS whose models are calibrated (warmed up by
    rounds of requests at varying load); returns it and the clock after the warm-up."""
    pool = Pool(PoolConfig(balancer=Balancer.PREDICTED), 1)
    for i in range(instances):
        pool.add_instance(SLOTS, 1000 + i)
    now, ticket = 1, 0
    for round_ in range(400):
        if round_ >= 64 and all(pool.instance(i, now).calibrated for i in range(instances)):
            break
        batch = []
        for _ in range(instances * (1 + round_ % 4)):
            granted = pool.submit(ticket, Priority.HIGH, now, prompt_tokens=200 + ticket % 800)
            assert granted is not None
            batch.append(ticket)
            ticket += 1
        now += 30
        for t in batch:
            pool.first_token(t, now)
        now += 200
        for t in batch:
            pool.release(t, Outcome.SUCCESS, now, output_tokens=40)
    assert all(pool.instance(i, now).calibrated for i in range(instances))
    return pool, now


@pytest.mark.parametrize("instances", [2, 8, 64])
@pytest.mark.parametrize("load", ["idle", "saturated"])
def test_predicted_deadline_cycle(benchmark: Any, load: str, instances: int) -> None:
    """SPEC §17: a grant with prediction and deadline order (`predicted`, calibrated models,
    every request with a TTFT objective), at the given pool size."""
    benchmark.group = f"predicted + deadlines ({load}), {instances:>2} instances"
    benchmark.extra_info["core"] = gateway._core.__file__
    pool, now = calibrated_pool(instances)
    tickets = itertools.count(1_000_000)
    high, success = Priority.HIGH, Outcome.SUCCESS
    running: list[int] = []
    busy = instances * (SLOTS if load == "saturated" else BUSY)
    for _ in range(busy):
        t = next(tickets)
        assert pool.submit(t, high, now, deadline_ms=now + 500, prompt_tokens=500) is not None
        running.append(t)
    if load == "idle":
        t0 = now

        def cycle() -> None:
            ticket = next(tickets)
            pool.submit(ticket, high, t0, deadline_ms=t0 + 500, prompt_tokens=500)
            pool.first_token(ticket, t0)
            pool.release(ticket, success, t0, output_tokens=40)

        benchmark(cycle)
        assert (pool.in_flight, pool.waiting) == (busy, 0)
        return
    # saturated: 64 waiting with deadlines 1-60 s away, in no order
    deadlines = itertools.cycle([now + 1_000 + (k * 7_919) % 59_000 for k in range(256)])
    for _ in range(64):
        assert pool.submit(next(tickets), high, now, deadline_ms=next(deadlines)) is None
    pending: collections.deque[int] = collections.deque(running)

    def saturated() -> None:
        # one arrives (queued at its deadline's place), one ends (the earliest deadline goes)
        pool.submit(next(tickets), high, now, deadline_ms=next(deadlines), prompt_tokens=500)
        for event in pool.release(pending.popleft(), success, now, output_tokens=40):
            pending.append(event.ticket)

    benchmark(saturated)
    assert (pool.in_flight, pool.waiting) == (busy, 64)
