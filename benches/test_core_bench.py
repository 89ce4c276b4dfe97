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

Run with `make bench`, or `pytest benches --benchmark-only`; see benches/README.md.
"""

from __future__ import annotations

import itertools
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import gateway._core
from gateway._core import REGION_BYTES, Outcome, Pool, PoolConfig, Priority, Region

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
