"""SPEC §12: several workers sharing one region grant in the order one pool would.

Each worker's `_core.Pool` is attached to one region (a memfd, as the supervisor makes it) and
holds only the requests that arrived through that worker. Units are freed one at a time; a
worker that frees a unit its own queue should not take wakes the workers the core names, and
only they look (no periodic tick here: a lost wake-up would show as a release granting
nothing). The classes granted must be exactly those the pure-Python reference model grants
with every request in one queue — 7:3 (or strict with its max_consecutive_high) and the
starvation guard applied to the union.
"""

from __future__ import annotations

import os

from hypothesis import given, settings
from hypothesis import strategies as st

from gateway import _core
from gateway._core import Outcome, Policy, PoolConfig, Priority
from reference_scheduler import ReferencePool

HIGH, LOW = Priority.HIGH, Priority.LOW


def _region(workers: int) -> _core.Region:
    fd = os.memfd_create("test-region", os.MFD_ALLOW_SEALING)  # Region seals it (SPEC §12)
    os.ftruncate(fd, _core.REGION_BYTES)
    region = _core.Region(fd, workers)
    os.close(fd)  # the mapping stays
    return region


def _shared_pools(config: PoolConfig, workers: int) -> list[_core.Pool]:
    region = _region(workers)
    pools = []
    for w in range(workers):
        pool = _core.Pool(config)
        pool.attach(region, 7, w)
        pool.add_instance(1, ring_id=99)
        pools.append(pool)
    return pools


arrivals = st.lists(
    st.tuples(st.integers(0, 2), st.sampled_from([HIGH, LOW])), min_size=12, max_size=80
)


@settings(max_examples=200, deadline=None)
@given(
    arrived=arrivals,
    weights=st.tuples(st.integers(1, 9), st.integers(1, 9)),
    strict=st.booleans(),
    max_consecutive_high=st.integers(1, 6),
    max_low_wait_ms=st.sampled_from([15, 45, 10_000]),
)
def test_workers_grant_the_classes_one_pool_would(
    arrived: list[tuple[int, Priority]],
    weights: tuple[int, int],
    strict: bool,
    max_consecutive_high: int,
    max_low_wait_ms: int,
) -> None:
    config = PoolConfig(
        policy=Policy.STRICT if strict else Policy.WEIGHTED,
        high_weight=weights[0],
        low_weight=weights[1],
        max_consecutive_high=max_consecutive_high,
        max_low_wait_ms=max_low_wait_ms,
        high_capacity=500,
        low_capacity=500,
        high_max_wait_ms=10**9,
        low_max_wait_ms=10**9,
        probing=False,
    )
    reference = ReferencePool(config)
    reference.add_instance(1)
    workers = _shared_pools(config, 3)
    priority: dict[int, Priority] = {}
    holder: dict[int, int] = {}  # ticket -> worker holding its unit
    for ticket, (w, p) in enumerate(arrived, start=1):
        priority[ticket] = p
        code = reference.submit(ticket, p, 0)  # an index, or a negative code (queued)
        assert (code is not None and code >= 0) == (ticket == 1)
        if workers[w].submit(ticket, p, 0) is not None:
            holder[ticket] = w
        workers[w].take_wakes()  # nothing is free: no wake has anything to find
    assert list(holder) == [1]

    now = 0
    ref_running, running = 1, 1
    ref_classes, classes = [], []
    while True:
        now += 10  # time passes: the starvation guard's clock runs in both
        ref_events = reference.release(ref_running, Outcome.SUCCESS, now)
        w = holder.pop(running)
        moved = [(w, e) for e in workers[w].release(running, Outcome.SUCCESS, now)]
        wakes = workers[w].take_wakes()
        for k in range(len(workers)):
            if wakes & (1 << k):
                moved += [(k, e) for e in workers[k].tick(now)]
                workers[k].take_wakes()
        events = [e for _, e in moved]
        holder.update({e.ticket: k for k, e in moved if e.instance is not None})
        ref_granted = [t for t, code in ref_events if code >= 0]  # (ticket, instance | code)
        granted = [e.ticket for e in events if e.instance is not None]
        assert len(granted) == len(ref_granted), (ref_classes, classes)
        if not granted:
            break
        (ref_running,), (running,) = ref_granted, granted
        ref_classes.append(priority[ref_running])
        classes.append(priority[running])
    assert classes == ref_classes
    assert len(classes) == len(arrived) - 1
    assert all(p.waiting == 0 and p.in_flight == 0 for p in workers)
