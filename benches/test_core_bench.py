"""Micro-benchmarks of the scheduling core from Python: one submit -> grant -> release cycle.

The pool is busy but not saturated — every instance runs half its slots — so each cycle is
an immediate grant that makes the balancer compare every instance (least connections), then
a release that finds nobody waiting: the gateway's steady state below saturation. The same
cycle runs on the pure-Python reference model (tests/reference_scheduler.py) for scale.

Run with `make bench`, or `pytest benches --benchmark-only`; see benches/README.md.
"""

from __future__ import annotations

import itertools
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import gateway._core
from gateway._core import Outcome, Pool, PoolConfig, Priority

# The reference model lives with the tests; only that directory is added, so `gateway`
# still comes from wherever it is installed (a release wheel, for honest numbers).
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from reference_scheduler import ReferencePool

SLOTS = 16  # max_concurrency of each instance
BUSY = SLOTS // 2  # attempts kept in flight on each instance while measuring

MODELS: dict[str, Callable[[PoolConfig], Any]] = {
    "rust": lambda cfg: Pool(cfg, 1),
    "reference": lambda cfg: ReferencePool(cfg, 1),
}


def busy_pool(model: str, instances: int) -> Any:
    """A pool of `instances` instances, each running BUSY of its SLOTS attempts."""
    pool = MODELS[model](PoolConfig())
    for _ in range(instances):
        pool.add_instance(SLOTS)
    for ticket in range(instances * BUSY):
        granted = pool.submit(ticket, Priority.HIGH, 0)
        assert granted is not None and granted >= 0
    assert pool.in_flight == instances * BUSY
    return pool


@pytest.mark.parametrize("instances", [2, 8, 64])
@pytest.mark.parametrize("model", ["rust", "reference"])
def test_submit_grant_release(benchmark: Any, model: str, instances: int) -> None:
    """One request's whole life in the scheduler, at the given pool size."""
    benchmark.group = f"submit->grant->release, {instances:>2} instances"  # sorts 2, 8, 64
    benchmark.extra_info["core"] = gateway._core.__file__
    pool = busy_pool(model, instances)
    tickets = itertools.count(instances * BUSY)
    high, success = Priority.HIGH, Outcome.SUCCESS

    def cycle() -> None:
        ticket = next(tickets)
        pool.submit(ticket, high, 1)
        pool.release(ticket, success, 1)

    benchmark(cycle)
    # the pool is exactly as busy as before: every cycle was granted and released
    assert (pool.in_flight, pool.waiting) == (instances * BUSY, 0)
