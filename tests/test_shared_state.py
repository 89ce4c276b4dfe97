"""SPEC §12's one scheduling state per pool, in one process with a test clock.

A host is what `gateway serve --workers N` builds, without the processes: the supervisor's
region on a sealed memfd (`_core.Region(fd, workers)`), and per worker its own mapping of that
memfd (`_core.Region(fd)`) with a `_core.Pool` attached to it as that worker's slot. The core
takes time as an argument, so the clock is `Host.now`, moved by the test: a starvation guard,
a probe interval or an ejection is milliseconds of arithmetic, not of waiting. A unit a worker
frees that another worker's queue should take is announced by the core's wake mask; the host
delivers it at once, as the workers' eventfds do (`Host.deliver`).

What only processes show (SO_REUSEPORT, kill -9, reload and /metrics of the whole gateway, the
restart policy) stays in test_workers.py; the class order against the reference model is
test_workers_reference.py's; the core's own interleavings are rust/core/tests/shared.rs's.
"""

from __future__ import annotations

import fcntl
import itertools
import os
import random
from collections import Counter
from collections.abc import Callable, Iterator

import pytest

from gateway import _core
from gateway._core import InstanceState, Outcome, Policy, PoolConfig, Priority

HIGH, LOW = Priority.HIGH, Priority.LOW
POOL_ID = 7


class Host:
    """One pool over `caps` (one instance per cap) on `workers` workers sharing one region."""

    def __init__(self, workers: int, caps: list[int], **config: object) -> None:
        self.fd = os.memfd_create("test-region", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        os.ftruncate(self.fd, _core.REGION_BYTES)
        # As the supervisor seals it: nobody can shrink (a SIGBUS) or grow it.
        seals = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
        fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, seals)
        self.region = _core.Region(self.fd, workers)  # the supervisor's
        self.config = PoolConfig(**config)  # type: ignore[arg-type]
        self.caps = caps
        self.now = 0
        self.incarnation = [0] * workers
        #: worker slots killed and not yet replaced
        self.dead: set[int] = set()
        self.pools: list[_core.Pool] = []
        self.pools = [self.start(w) for w in range(workers)]
        #: ticket -> the worker that holds its unit
        self.holder: dict[int, int] = {}
        #: ticket -> the worker where it waits
        self.waiter: dict[int, int] = {}
        #: ticket -> the instance its unit is on
        self.instance: dict[int, int] = {}
        self._tickets = itertools.count(1)

    def close(self) -> None:
        os.close(self.fd)  # every mapping stays

    def start(self, w: int) -> _core.Pool:
        """Worker slot `w` (re)started: the supervisor marks it live, the worker maps the
        region itself and attaches its pool."""
        self.incarnation[w] += 1
        self.region.worker_start(w, self.incarnation[w], 10_000 + w)
        pool = _core.Pool(self.config)
        pool.attach(_core.Region(self.fd), POOL_ID, w)
        for k, cap in enumerate(self.caps):
            pool.add_instance(cap, ring_id=100 + k)
        if w < len(self.pools):
            self.pools[w] = pool
        self.dead.discard(w)
        return pool

    def kill(self, w: int) -> None:
        """kill -9 of worker `w`: its requests die with it; nothing it held is released."""
        self.dead.add(w)
        for table in (self.holder, self.waiter):
            for t in [t for t, k in table.items() if k == w]:
                del table[t]

    @property
    def live(self) -> list[_core.Pool]:
        return [p for w, p in enumerate(self.pools) if w not in self.dead]

    def submit(self, w: int, priority: Priority, tenant: int = 0) -> int:
        """A request arrives at worker `w`, a millisecond after the one before (the union's
        order within a class is the order of arrival on this clock): its ticket."""
        self.now += 1
        ticket = next(self._tickets)
        index = self.pools[w].submit(ticket, priority, self.now, tenant)
        if index is None:
            self.waiter[ticket] = w
        else:
            self.holder[ticket] = w
            self.instance[ticket] = index
        self.deliver(w, self.pools[w].take_events())
        return ticket

    def release(self, ticket: int, outcome: Outcome = Outcome.SUCCESS) -> list[int]:
        """The attempt of `ticket` ended: the tickets granted in consequence, anywhere."""
        w = self.holder.pop(ticket)
        return self.deliver(w, self.pools[w].release(ticket, outcome, self.now))

    def tick(self, w: int) -> list[int]:
        return self.deliver(w, self.pools[w].tick(self.now))

    def tick_all(self) -> list[int]:
        """Every worker's periodic tick (10 ms in `serve`): each reads what the others
        changed (their in-flight counts, ejections, probe results)."""
        return [t for w in range(len(self.pools)) if w not in self.dead for t in self.tick(w)]

    def deliver(self, w: int, events: list[_core.Event]) -> list[int]:
        """Worker `w`'s events, then the wakes it sent: each woken worker ticks at once."""
        granted: list[int] = []
        pending = [(w, events)]
        for _ in range(100):  # wakes die out: no two workers wake each other for ever
            if not pending:
                return granted
            w, events = pending.pop(0)
            for e in events:
                self.waiter.pop(e.ticket, None)
                if e.instance is not None:
                    self.holder[e.ticket] = w
                    self.instance[e.ticket] = e.instance
                    granted.append(e.ticket)
            wakes = self.pools[w].take_wakes()
            woken = [k for k in self.woken(wakes) if k not in self.dead]
            pending += [(k, self.pools[k].tick(self.now)) for k in woken]
        raise AssertionError("wake storm")

    def woken(self, mask: int) -> list[int]:
        return [k for k in range(len(self.pools)) if mask >> k & 1]

    def in_flight(self, index: int) -> int:
        """Instance `index`'s units held across every worker (a dead one's until reclaimed):
        after a tick, each worker sees them all (least-connections, /admin/state)."""
        self.tick_all()
        infos = [p.instance(index, self.now) for p in self.live]
        seen = {i.in_flight + i.peer_in_flight for i in infos}
        assert len(seen) == 1, seen  # every worker sees the same
        if not self.dead:  # and it is the sum of each worker's own
            assert seen == {sum(i.in_flight for i in infos)}
        return seen.pop()

    def quiet(self) -> bool:
        """What test_workers' assert_quiet asks of every worker: 0 in flight, 0 queued."""
        return all(
            p.in_flight == 0 and p.queued(HIGH) == 0 and p.queued(LOW) == 0 for p in self.live
        )


HostFactory = Callable[..., Host]


@pytest.fixture
def hosts() -> Iterator[HostFactory]:
    made: list[Host] = []

    def make(workers: int, caps: list[int], **config: object) -> Host:
        host = Host(workers, caps, **config)
        made.append(host)
        return host

    yield make
    for host in made:
        host.close()


def _run_down(host: Host, running: int, step_ms: int = 1) -> list[int]:
    """One unit: release the running request and each one granted after it, `step_ms` apart,
    until nothing is waiting. The grant order."""
    order: list[int] = []
    while True:
        host.now += step_ms
        granted = host.release(running)
        if not granted:
            return order
        (running,) = granted  # one unit: exactly one grant per release
        order.append(running)


def test_a_high_in_one_worker_is_granted_before_lows_queued_in_another(hosts: HostFactory) -> None:
    # SPEC §12: one dual queue — a high request queued in worker 2 is granted before a low
    # request queued in worker 1.
    host = hosts(4, [1])
    running = host.submit(1, LOW)
    lows = [host.submit(1, LOW) for _ in range(10)]
    highs = [host.submit(w, HIGH) for w in (2, 3, 2, 3)]
    assert set(host.waiter) == {*lows, *highs}
    order = _run_down(host, running)
    # 7:3 while both wait: the four highs within the first five grants, most of the lows'
    # backlog after them; each class in its order of arrival across the workers.
    assert [t for t in order if t in highs] == highs
    assert [t for t in order if t in lows] == lows
    assert max(order.index(t) for t in highs) <= 4, order
    assert host.quiet()


def test_seven_to_three_over_the_union_of_the_workers_queues(hosts: HostFactory) -> None:
    # SPEC §3 × §12: 7:3 while both classes wait, though every high waits in worker 0 and
    # every low in worker 1 (each worker alone would see one class only).
    host = hosts(2, [1], max_low_wait_ms=10**6)
    running = host.submit(0, HIGH)
    highs = {host.submit(0, HIGH) for _ in range(35)}
    lows = [host.submit(1, LOW) for _ in range(15)]
    order = _run_down(host, running)
    assert [t for t in order if t not in highs] == lows
    classes = ["H" if t in highs else "L" for t in order]
    assert Counter(classes[:50]) == {"H": 35, "L": 15}
    for start in range(0, 50, 10):  # every window of ten grants: seven highs, three lows
        assert classes[start : start + 10].count("H") == 7, classes
    assert host.quiet()


def test_the_starvation_guard_counts_a_low_waiting_in_another_worker(hosts: HostFactory) -> None:
    # SPEC §3: strict priority, yet a low that waited max_low_wait_ms goes next — measured on
    # the region's clock, though the highs keep coming in another worker.
    host = hosts(2, [1], policy=Policy.STRICT, max_low_wait_ms=100)
    running = host.submit(0, HIGH)
    low = host.submit(1, LOW)
    arrived = host.now
    granted_at = None
    for _ in range(40):  # a steady stream of highs in worker 0, one grant every 10 ms
        host.submit(0, HIGH)
        host.now += 10
        (running,) = host.release(running)
        if running == low:
            granted_at = host.now
            break
    assert granted_at is not None, "the low starved"
    waited = granted_at - arrived
    assert 100 <= waited <= 111, waited  # not before its wait, and at the next grant after


def test_the_cap_holds_across_workers_and_least_connections_sees_every_worker(
    hosts: HostFactory,
) -> None:
    host = hosts(4, [3, 3])
    # One request through each worker in turn: least-connections counts every worker's, so
    # the two instances fill alike (a worker blind to the others would send all to one).
    first = [host.submit(w % 4, HIGH) for w in range(4)]
    assert (host.in_flight(0), host.in_flight(1)) == (2, 2)
    rest = [host.submit(w % 4, HIGH) for w in range(2, 22)]
    assert (host.in_flight(0), host.in_flight(1)) == (3, 3)  # the cap of each, and no more
    assert len(host.waiter) == 18
    # Released in an order across workers; whatever frees where, the cap is never exceeded
    # and every waiter is served.
    served = 0
    todo = first + rest
    while host.holder:
        host.now += 1
        ticket = min(host.holder, key=lambda t: (t * 7919) % 97)
        host.release(ticket)
        served += 1
        assert host.in_flight(0) <= 3 and host.in_flight(1) <= 3
    assert served == len(todo)
    assert host.quiet()


def test_queue_capacity_is_the_pools_across_workers(hosts: HostFactory) -> None:
    # SPEC §3 capacity is the pool's, not each worker's: 1 running + 3 queued, the rest refused.
    host = hosts(3, [1], high_capacity=3, overflow_high_to_low=False)
    running = host.submit(0, HIGH)
    queued = [host.submit(w, HIGH) for w in (1, 2, 0)]
    for w in range(3):
        with pytest.raises(_core.QueueFull) as full:
            host.pools[w].submit(1000 + w, HIGH, host.now)
        assert full.value.retry_after_ms > 0  # the 503 says when to retry
    assert _run_down(host, running) == queued
    again = host.submit(1, HIGH)  # places freed: the queue takes requests again
    assert _run_down(host, again) == []
    assert host.quiet()


def test_an_ejection_by_one_worker_holds_for_all(hosts: HostFactory) -> None:
    # SPEC §6 × §12: one health state per instance.
    host = hosts(4, [4, 4], failure_threshold=2, ejection_ms=60_000, probing=False)
    sent = [host.submit(0, HIGH) for _ in range(4)]  # least-connections: two on each
    for t in sent:  # instance 0 fails both of worker 0's
        host.now += 1
        host.release(t, Outcome.FAILURE if host.instance[t] == 0 else Outcome.SUCCESS)
    host.tick_all()
    assert [p.instance(0, host.now).state for p in host.pools] == [InstanceState.EJECTED] * 4
    # The other three never send it anything: every grant goes to instance 1.
    for w in (1, 2, 3):
        for _ in range(3):
            t = host.submit(w, HIGH)
            assert host.instance[t] == 1
            host.release(t)
    assert host.quiet()


def test_one_probe_per_instance_per_interval_across_workers(hosts: HostFactory) -> None:
    # SPEC §12: one probe per instance per interval, not N. Each worker's prober asks every
    # 10 ms; over two seconds of a 200 ms interval, ten probes per instance in all.
    host = hosts(4, [4, 4])
    claims: Counter[int] = Counter()
    by: set[int] = set()
    for host.now in range(0, 2000, 10):
        for w in random.Random(host.now).sample(range(4), 4):  # whoever asks first
            for k in range(2):
                if host.pools[w].claim_probe(k, host.now, 200):
                    claims[k] += 1
                    by.add(w)
                    host.pools[w].record_probe(k, True, host.now)
    assert claims == {0: 10, 1: 10}, claims
    assert len(by) > 1  # any worker may probe; one does per interval


def test_a_passing_probe_in_one_worker_readmits_the_instance_everywhere(
    hosts: HostFactory,
) -> None:
    host = hosts(3, [2, 2], failure_threshold=1, ejection_ms=1000, probing=True)
    t = host.submit(0, HIGH)
    k = host.instance[t]
    host.release(t, Outcome.FAILURE)
    host.tick_all()
    assert [p.instance(k, host.now).state for p in host.pools] == [InstanceState.EJECTED] * 3
    host.now = 1100  # past the ejection
    assert host.pools[2].claim_probe(k, host.now, 500)
    assert not host.pools[0].claim_probe(k, host.now, 500)  # worker 2 probes it this interval
    host.pools[2].record_probe(k, True, host.now)
    host.tick_all()
    assert [p.instance(k, host.now).state for p in host.pools] == [InstanceState.HALF_OPEN] * 3


def test_a_dead_workers_units_and_queue_places_are_reclaimed(hosts: HostFactory) -> None:
    # SPEC §12: the supervisor reclaims every slot and queue entry a dead worker held; the
    # others' requests are unaffected and its replacement starts from nothing.
    host = hosts(3, [2], high_capacity=3, overflow_high_to_low=False)
    host.region.heartbeat(2, 5)
    assert host.region.worker(2) == (1, 1, 10_002, 6)  # live, incarnation 1, its pid, beat+1
    for _ in range(5):  # 2 running, 3 queued: all of it
        host.submit(2, HIGH)
    with pytest.raises(_core.QueueFull):
        host.pools[0].submit(999, HIGH, host.now)
    ours = host.submit(0, LOW)  # worker 0's low waits (its class has room)
    assert ours in host.waiter
    host.kill(2)
    host.now += 3
    host.tick_all()
    assert host.in_flight(0) == 2, "until reclaimed, the dead worker's units stay held"
    assert ours in host.waiter
    # The supervisor reaps it (fenced: it writes nothing more), reclaims and wakes the others:
    # worker 0's waiter takes a freed unit, and the dead worker's queue places are free.
    assert host.region.reclaim(2) == 2
    assert host.tick(0) == [ours]
    assert host.in_flight(0) == 1
    assert host.pools[0].peers_waiting() == (0, 0)
    queued = [host.submit(1, HIGH) for _ in range(4)]
    assert [t in host.waiter for t in queued] == [False, True, True, True]
    # The replacement in slot 2: a fresh pool on the same region, counting from nothing but
    # seeing the others' queue (full again) and units.
    replacement = host.start(2)
    assert host.region.worker(2)[:3] == (1, 2, 10_002)
    assert replacement.in_flight == 0
    with pytest.raises(_core.QueueFull):
        replacement.submit(998, HIGH, host.now)
    assert host.in_flight(0) == 2
    while host.holder:
        host.now += 1
        host.release(next(iter(host.holder)))
    assert host.quiet()
