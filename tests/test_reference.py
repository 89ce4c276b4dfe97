"""The Rust core against the SPEC (§3, §5, §6).

1. Random operation sequences drive `gateway._core.Pool` and the pure-Python `ReferencePool`
   (tests/reference_scheduler.py) side by side; every answer must be the same.
2. Each place where the core once departed from the SPEC has a deterministic test that
   replays the shortest sequence that showed it.
3. Properties a user would notice, checked on the real core alone: capacity, exactly-once
   endings, the 7:3 shares, both starvation bounds, counters back to zero, ejection.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway import _core
from gateway._core import (
    Affinity,
    Balancer,
    EventKind,
    GatewayError,
    InstanceState,
    NoHealthyInstance,
    Outcome,
    Policy,
    PoolConfig,
    Priority,
    QueueFull,
)
from reference_scheduler import EXPIRED, QUEUED, SPILLED, UNSERVABLE, ReferencePool

HIGH, LOW = Priority.HIGH, Priority.LOW
Events = list[tuple[int, int]]


class Pool:
    """The core's pool, its typed answers written in the reference's encoding so the two
    compare one to one: `submit` → index or QUEUED/SPILLED, events → (ticket, index or
    EXPIRED/UNSERVABLE). Everything else passes through."""

    def __init__(self, config: PoolConfig, seed: int = 0) -> None:
        self._pool = _core.Pool(config, seed)
        # where each ticket's latest grant landed relative to its affinity key, as the
        # reference keeps it
        self.placements: dict[int, Affinity] = {}

    def __getattr__(self, name: str) -> Any:
        return getattr(self._pool, name)

    def submit(
        self,
        ticket: int,
        priority: Priority,
        now: int,
        tenant: int = 0,
        excluded: int = 0,
        affinity_key: int = 0,
    ) -> int:
        granted = self._pool.submit(ticket, priority, now, tenant, excluded, affinity_key)
        if granted is not None:
            self.placements[ticket] = self._pool.last_affinity()
            return granted
        return QUEUED if self._pool.waiting_class(ticket) == priority else SPILLED

    def _codes(self, events: list[_core.Event]) -> Events:
        out = []
        for e in events:
            if e.kind is EventKind.GRANTED:
                assert e.instance is not None and e.retry_after_ms == 0
                out.append((e.ticket, e.instance))
                self.placements[e.ticket] = e.affinity
            else:
                assert e.instance is None and e.affinity is Affinity.NONE
                out.append((e.ticket, EXPIRED if e.kind is EventKind.EXPIRED else UNSERVABLE))
        return out

    def take_events(self) -> Events:
        return self._codes(self._pool.take_events())

    def release(self, ticket: int, outcome: Outcome, now: int, cool_ms: int = 0) -> Events:
        return self._codes(self._pool.release(ticket, outcome, now, cool_ms))

    def record_probe(self, index: int, ok: bool, now: int) -> Events:
        return self._codes(self._pool.record_probe(index, ok, now))

    def tick(self, now: int) -> Events:
        return self._codes(self._pool.tick(now))


Op = tuple[Any, ...]

INSTANCE_FIELDS = (
    "state",
    "in_flight",
    "max_concurrency",
    "consecutive_failures",
    "ejected_until_ms",
    "cool_until_ms",
    "next_try_ms",
    "ejections",
    "half_open_trials",
    "removed",
    "backend_waiting",
    "cache_permille",
)
STATS_FIELDS = (
    "granted_high",
    "granted_low",
    "forced_low",
    "expired",
    "cancelled",
    "rejected_full",
    "unservable",
    "affinity_hits",
    "affinity_spills",
)

# ---- strategies ------------------------------------------------------------------------------

# Small values, so queues fill, deadlines pass, bounds trip and instances get ejected often.
config_kwargs = st.fixed_dictionaries(
    {
        "policy": st.sampled_from([Policy.WEIGHTED, Policy.STRICT]),
        "high_capacity": st.integers(1, 6),
        "low_capacity": st.integers(1, 6),
        "high_weight": st.sampled_from([7, 7, 1, 2, 0]),
        "low_weight": st.sampled_from([3, 3, 1, 5]),
        "high_max_wait_ms": st.sampled_from([50, 500, 3_000, 30_000]),
        "low_max_wait_ms": st.sampled_from([100, 2_000, 20_000, 600_000]),
        "max_consecutive_high": st.integers(1, 5),
        "max_low_wait_ms": st.sampled_from([10, 300, 5_000]),
        "overflow_high_to_low": st.booleans(),
        "balancer": st.sampled_from(
            [
                Balancer.LEAST_CONNECTIONS,
                Balancer.ROUND_ROBIN,
                Balancer.RANDOM,
                Balancer.P2C,
                Balancer.AFFINITY,
                Balancer.AFFINITY,
            ]
        ),
        "affinity_epsilon": st.sampled_from([0.0, 0.25, 0.25, 1.0]),
        "failure_threshold": st.integers(1, 3),
        "ejection_ms": st.sampled_from([10, 1_000, 10_000]),
        "max_ejection_ms": st.sampled_from([10, 5_000, 40_000]),
        "half_open_max_requests": st.integers(1, 2),
        "success_threshold": st.integers(1, 2),
        "probing": st.booleans(),
    }
)
capacity_lists = st.lists(st.sampled_from([1, 1, 2, 3, 5]), min_size=1, max_size=4)
seeds = st.integers(0, 2**64 - 1)

# Time before an operation: often none, often a little, sometimes past every bound.
elapsed = st.one_of(st.just(0), st.integers(1, 40), st.integers(40, 600), st.integers(600, 15_000))

# One operation is (kind, k, flag, elapsed ms): `k` picks a ticket, an instance or a reload
# (modulo what there is), `flag` the small choice the kind needs — see `Twin.apply`. Flat
# tuples keep generation cheap; repeated kinds weight the mix (arrivals and releases dominate).
KINDS = ["submit"] * 5 + ["release"] * 5 + ["retry", "cancel", "cancel", "probe", "probe"]
KINDS += ["tick", "tick", "reload", "duplicate", "backend"]
operations = st.tuples(st.sampled_from(KINDS), st.integers(0, 15), st.integers(0, 7), elapsed)


def arrival(k: int, flag: int) -> tuple[Priority, int, int]:
    """A submit's (priority, tenant, how many arrive at once)."""
    return (HIGH, LOW)[k % 2], k // 2 % 3, flag % 4 + 1


# Affinity keys as a request's prompt hash looks (0: no key); few, so keys repeat and pile up.
AFFINITY_KEYS = (0, 0x9E37_79B9_7F4A_7C15, 0x1234_5678_9ABC_DEF1, 0xFFFF_FFFF_FFFF_FFFF, 7)


def affinity_key(k: int, flag: int) -> int:
    """A submit's affinity key."""
    return AFFINITY_KEYS[(k + flag) % len(AFFINITY_KEYS)]


def backend_load(k: int, flag: int) -> tuple[int, int, float]:
    """A backend report: (instance, requests waiting, KV-cache usage)."""
    return k % 4, flag % 4, (k % 8) / 7


def ending(k: int, flag: int) -> tuple[Outcome, int]:
    """A release's outcome and Retry-After cooling (a quarter of releases cool)."""
    outcome = (Outcome.SUCCESS, Outcome.SUCCESS, Outcome.FAILURE, Outcome.NEUTRAL)[flag % 4]
    return outcome, (k + 1) * 150 if flag >= 6 else 0


RELOADS = ("add_instance", "set_max_concurrency", "remove_instance", "configure")
op_lists = st.lists(operations, min_size=10, max_size=60)
reconfigs = st.lists(config_kwargs, min_size=1, max_size=3)


# ---- the core and the reference in lockstep ----------------------------------------------------


@dataclass
class Request:
    """What a caller remembers of a ticket, to retry it as the gateway would."""

    priority: Priority
    tenant: int
    tried: int = 0  # bit set of the instances it was granted to
    key: int = 0  # affinity key


@dataclass
class Twin:
    """The core and the reference, driven in lockstep by one well-behaved caller.

    The caller ticks at every `next_wakeup`, as the gateway's event loop does.
    """

    core: Pool
    ref: ReferencePool
    config: PoolConfig
    reconfigs: list[dict[str, Any]]
    now: int = 0
    next_ticket: int = 1
    requests: dict[int, Request] = field(default_factory=dict)
    waiting: dict[int, Priority] = field(default_factory=dict)  # ticket -> class it waits in
    granted: list[int] = field(default_factory=list)
    retryable: list[int] = field(default_factory=list)

    @classmethod
    def build(
        cls, kwargs: dict[str, Any], capacities: list[int], seed: int, reconfigs: list[Any]
    ) -> Twin:
        """A pool with these settings and instances, twice; `reconfigs` are its reloads."""
        config = PoolConfig(**kwargs)
        twin = cls(Pool(config, seed), ReferencePool(config, seed), config, reconfigs)
        for capacity in capacities:
            twin.both("add_instance", capacity)
        return twin

    def both(self, method: str, *args: Any) -> Any:
        """Calls `method` on both; they must answer alike, or raise alike."""
        core, ref = _call(self.core, method, args), _call(self.ref, method, args)
        if isinstance(core, GatewayError) or isinstance(ref, GatewayError):
            assert type(core).__name__ == type(ref).__name__, (method, args, core, ref)
            if isinstance(core, NoHealthyInstance):
                # SPEC §6: Retry-After is "the time until the earliest instance may be tried"
                assert core.retry_after_ms == ref.retry_after_ms, (method, args, core, ref)
            raise core if isinstance(core, GatewayError) else ref
        if isinstance(core, list):
            assert _canonical(core) == _canonical(ref), (method, args, core, ref)
        else:
            assert core == ref, (method, args, core, ref)
        return core

    # -- what the caller does --

    def advance(self, dt: int) -> None:
        """Lets `dt` ms pass, ticking at every wakeup on the way."""
        until = self.now + dt
        for _ in range(1_000):
            wakeups = (self.core.next_wakeup(self.now), self.ref.next_wakeup(self.now))
            due = [w for w in wakeups if w is not None and w <= until]
            if not due:
                break
            self.now = max(self.now, min(due))
            self.deliver(self.both("tick", self.now))
        else:
            pytest.fail("next_wakeup keeps reporting deadlines that tick does not clear")
        self.now = until

    def deliver(self, events: Events) -> None:
        """Moves tickets along as the events say; an event is only ever for a waiting ticket."""
        for ticket, code in events:
            assert ticket in self.waiting, f"event {code} for ticket {ticket} that is not waiting"
            del self.waiting[ticket]
            if code >= 0:
                self.granted.append(ticket)
                self.requests[ticket].tried |= 1 << code
            else:
                assert code in (EXPIRED, UNSERVABLE)

    def submit(self, ticket: int, excluded: int = 0) -> None:
        """Submits `ticket`: fresh, or a retry excluding what it tried."""
        req = self.requests[ticket]
        try:
            code = self.both(
                "submit", ticket, req.priority, self.now, req.tenant, excluded, req.key
            )
        except GatewayError:
            return
        if code >= 0:
            self.granted.append(ticket)
            req.tried |= 1 << code
        else:
            assert code in (QUEUED, SPILLED)
            self.waiting[ticket] = req.priority if code == QUEUED else LOW
        self.deliver(self.both("take_events"))

    def retry(self, k: int) -> None:
        """Resubmits a failed ticket with the instances it tried excluded (SPEC §6)."""
        ticket = self.retryable[k % len(self.retryable)]
        req = self.requests[ticket]
        self.retryable.remove(ticket)
        self.submit(ticket, excluded=req.tried)

    def apply(self, op: Op) -> None:
        """Runs one generated operation on both (see `operations`)."""
        kind, k, flag, dt = op
        if kind in ("reload", "duplicate"):
            dt = 0  # these happen between the other operations
        self.advance(dt)
        if kind == "submit":
            priority, tenant, burst = arrival(k, flag)
            for _ in range(burst):
                ticket = self.next_ticket
                self.next_ticket += 1
                self.requests[ticket] = Request(priority, tenant, key=affinity_key(k, flag))
                self.submit(ticket)
        elif kind == "release" and self.granted:
            outcome, cool_ms = ending(k, flag)
            ticket = self.granted.pop(k % len(self.granted))
            self.deliver(self.both("release", ticket, outcome, self.now, cool_ms))
            if outcome == Outcome.FAILURE:
                self.retryable.append(ticket)
        elif kind == "retry" and self.retryable:
            self.retry(k)
        elif kind == "cancel":
            self.cancel(k, of_waiting=flag < 6)
        elif kind == "probe":
            self.probe(k % 4, ok=flag % 2 == 0)
        elif kind == "tick":
            self.deliver(self.both("tick", self.now))
        elif kind == "reload":
            self.reload(RELOADS[flag % 4], k)
        elif kind == "backend":
            index, waiting, usage = backend_load(k, flag)
            with contextlib.suppress(GatewayError):  # no such instance, on both
                self.both("set_backend_load", index, waiting, usage)
        elif kind == "duplicate" and (self.waiting or self.granted):
            tickets = [*self.waiting, *self.granted]
            ticket = tickets[k % len(tickets)]
            req = self.requests[ticket]
            with pytest.raises(GatewayError):
                self.both("submit", ticket, req.priority, self.now, req.tenant)

    def probe(self, index: int, ok: bool) -> None:
        """An active probe of instance `index` ends."""
        try:
            self.deliver(self.both("record_probe", index, ok, self.now))
        except GatewayError:
            return

    def cancel(self, k: int, of_waiting: bool) -> None:
        """A client leaves: a waiting ticket goes; a granted (or unknown) one is refused."""
        tickets = list(self.waiting) if of_waiting else self.granted
        ticket = tickets[k % len(tickets)] if tickets else self.next_ticket + 1_000
        if self.both("cancel", ticket):
            del self.waiting[ticket]

    def reload(self, kind: str, k: int) -> None:
        """A hot reload (SPEC §8), then the tick the core asks for after one."""
        index, capacity = k % 4, k % 5 + 1
        if kind == "configure":
            # Probing stays as built: configure() takes no time, so the moment an instance
            # turned half-open under the old setting is not defined.
            kwargs = dict(self.reconfigs[k % len(self.reconfigs)], probing=self.config.probing)
            self.config = PoolConfig(**kwargs)
            args: tuple[Any, ...] = (self.config,)
        else:
            args = {
                "add_instance": (capacity,),
                "remove_instance": (index,),
                "set_max_concurrency": (index, capacity),
            }[kind]
        try:
            self.both(kind, *args)
        except GatewayError:
            return
        self.deliver(self.both("tick", self.now))

    def check(self) -> None:
        """Every view agrees, and the caller's own books match the pool's."""
        for priority in (HIGH, LOW):
            self.both("queued", priority)
        self.both("free_slots", self.now)
        for attr in ("waiting", "in_flight", "outstanding", "consecutive_high"):
            assert getattr(self.core, attr) == getattr(self.ref, attr), attr
        core_stats, ref_stats = self.core.stats(), self.ref.stats()
        for name in STATS_FIELDS:
            assert getattr(core_stats, name) == getattr(ref_stats, name), name
        assert self.core.waiting == len(self.waiting)
        assert self.core.outstanding == len(self.waiting) + len(self.granted)
        for index in range(self.core.instance_count):
            core, ref = self.core.instance(index, self.now), self.ref.instance(index, self.now)
            for name in INSTANCE_FIELDS:
                assert getattr(core, name) == getattr(ref, name), (index, name)
        # SPEC §15: every grant landed where the reference says relative to its affinity key
        assert self.core.placements == self.ref.placements
        assert self.core.last_affinity() == self.ref.last_affinity()
        core_wakeup, ref_wakeup = self.core.next_wakeup(self.now), self.ref.next_wakeup(self.now)
        assert (core_wakeup is None) == (ref_wakeup is None)
        if core_wakeup is not None and ref_wakeup is not None:
            # early is allowed (a cancelled entry's deadline lingers), late is not
            assert core_wakeup <= ref_wakeup


def _call(pool: Any, method: str, args: tuple[Any, ...]) -> Any:
    try:
        return getattr(pool, method)(*args)
    except GatewayError as exc:
        return exc


def _canonical(events: Events) -> tuple[Events, Events]:
    """Grants in order; expiries and evictions as a set (answered at once, in no order)."""
    return [e for e in events if e[1] >= 0], sorted(e for e in events if e[1] < 0)


def run_twin(
    kwargs: dict[str, Any],
    capacities: list[int],
    seed: int,
    ops: list[Op],
    reconfigs: list[dict[str, Any]],
) -> Twin:
    """Plays `ops` on a fresh twin, comparing after each."""
    twin = Twin.build(kwargs, capacities, seed, reconfigs)
    twin.check()
    for op in ops:
        twin.apply(op)
        twin.check()
    return twin


_TWIN = settings(
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


@settings(_TWIN, max_examples=400)
@given(
    kwargs=config_kwargs, capacities=capacity_lists, seed=seeds, ops=op_lists, reconfigs=reconfigs
)
def test_core_matches_reference(
    kwargs: dict[str, Any],
    capacities: list[int],
    seed: int,
    ops: list[Op],
    reconfigs: list[dict[str, Any]],
) -> None:
    """Every answer of the core is the SPEC's answer (400 random runs per test run, a new
    draw each time; the deep search below is `slow`)."""
    run_twin(kwargs, capacities, seed, ops, reconfigs)


@pytest.mark.slow
@settings(_TWIN, max_examples=2000)
@given(
    kwargs=config_kwargs, capacities=capacity_lists, seed=seeds, ops=op_lists, reconfigs=reconfigs
)
def test_core_matches_reference_deep(
    kwargs: dict[str, Any],
    capacities: list[int],
    seed: int,
    ops: list[Op],
    reconfigs: list[dict[str, Any]],
) -> None:
    """The same comparison over 2,000 random runs (~35 s; `make test-slow`)."""
    run_twin(kwargs, capacities, seed, ops, reconfigs)


# ---- places where the core once departed from the SPEC (regression tests) ----


def replay(config: PoolConfig, capacities: list[int], script: list[Op]) -> None:
    """Runs `script` (method name, args...) on both and demands the same answers."""
    core, ref = Pool(config), ReferencePool(config)
    for capacity in capacities:
        core.add_instance(capacity)
        ref.add_instance(capacity)
    for step, (method, *args) in enumerate(script):
        got, want = _call(core, method, tuple(args)), _call(ref, method, tuple(args))
        if method == "instance":
            got = (got.state, got.ejected_until_ms)
            want = (want.state, want.ejected_until_ms)
        elif isinstance(got, GatewayError) or isinstance(want, GatewayError):
            got, want = type(got).__name__, type(want).__name__
        assert got == want, f"step {step} {method}{tuple(args)}: core {got!r}, SPEC {want!r}"


def test_a_shortened_max_wait_still_expires() -> None:
    """SPEC §3 "Deadlines" after a SPEC §8 reload: a request that waits longer than its
    class's max_wait_ms is answered queue_timeout — even behind one admitted earlier under a
    longer max_wait."""
    replay(
        PoolConfig(high_max_wait_ms=10_000),
        [1],
        [
            ("submit", 1, HIGH, 0),  # granted
            ("submit", 2, HIGH, 0),  # waits until 10 000
            ("configure", PoolConfig(high_max_wait_ms=1_000)),
            ("submit", 3, HIGH, 0),  # waits until 1 000
            ("next_wakeup", 0),  # core: 10 000
            ("tick", 1_000),  # core: [] — ticket 3 is kept past its deadline
        ],
    )


def test_failed_probe_after_the_ejection_ejects_again() -> None:
    """SPEC §6: once the ejection has passed and the latest probe passed the instance is
    half-open, and "one failure (a request or a probe) ejects it again with the doubled
    time" — whether or not anyone looked at it in between."""
    replay(
        PoolConfig(failure_threshold=1),
        [1],
        [
            ("submit", 1, HIGH, 0),
            ("release", 1, Outcome.FAILURE, 0),  # ejected until 10 000
            ("record_probe", 0, True, 5_000),  # half-open from 10 000
            ("record_probe", 0, False, 12_000),  # SPEC: ejected again until 32 000
            ("instance", 0, 12_000),  # core: ejected until 10 000
            ("record_probe", 0, True, 13_000),
            ("submit", 2, HIGH, 13_000),  # core: granted to the failing instance
        ],
    )


def test_a_tenant_that_cancelled_goes_to_the_back() -> None:
    """Tenants take turns; one whose only waiter left has no turn to keep: when it comes back
    it queues behind the tenants that kept waiting (queue.rs: cancelled entries no longer
    count — here they still do)."""
    replay(
        PoolConfig(),
        [1],
        [
            ("submit", 1, HIGH, 0, 0),  # granted
            ("submit", 2, HIGH, 0, 1),  # tenant 1 waits
            ("submit", 3, HIGH, 0, 2),  # tenant 2 waits behind it
            ("cancel", 2),  # tenant 1 has nobody waiting
            ("submit", 4, HIGH, 0, 1),  # tenant 1 comes back
            ("release", 1, Outcome.SUCCESS, 0),  # SPEC: tenant 2's ticket 3; core: ticket 4
        ],
    )


def test_wait_bound_counts_from_the_oldest_low() -> None:
    """SPEC §3 (b): at most max_low_wait_ms "since the last low grant (or since the oldest low
    arrived, if later)" — ticket 3 has waited since 0, so at 1 100 a low must go first."""
    replay(
        PoolConfig(policy=Policy.STRICT, max_low_wait_ms=1_000),
        [1, 1],
        [
            ("submit", 1, LOW, 0),  # instance 0; the last low grant is at 0
            ("submit", 2, HIGH, 0),  # instance 1
            ("submit", 3, HIGH, 0),
            ("submit", 4, LOW, 0),  # the oldest low, waiting since 0
            ("release", 1, Outcome.FAILURE, 500),  # high 3 goes to instance 0
            ("submit", 1, LOW, 600, 0, 0b01),  # retry of 1 elsewhere: its place is before 4
            ("submit", 5, HIGH, 700),
            ("release", 2, Outcome.SUCCESS, 1_100),  # SPEC: low 1 (forced); core: high 5
        ],
    )


def test_an_overdue_request_is_never_granted() -> None:
    """SPEC §3 "Deadlines": a request waiting longer than max_wait_ms is answered
    queue_timeout, even if a slot frees before the caller's timer fires."""
    replay(
        PoolConfig(high_max_wait_ms=1_000),
        [1],
        [
            ("submit", 1, HIGH, 0),
            ("submit", 2, HIGH, 0),  # deadline 1 000
            ("release", 1, Outcome.SUCCESS, 1_500),  # SPEC: 2 expired; core: 2 granted
        ],
    )


# ---- properties of the real core ---------------------------------------------------------------


@dataclass
class Caller:
    """Drives the real core and keeps each ticket's life: every accepted attempt must end
    exactly once — released after a grant, expired, evicted or cancelled."""

    pool: Pool
    reconfigs: list[dict[str, Any]] = field(default_factory=list)
    now: int = 0
    next_ticket: int = 1
    priority: dict[int, Priority] = field(default_factory=dict)
    tenant: dict[int, int] = field(default_factory=dict)
    tried: dict[int, int] = field(default_factory=dict)
    waiting: set[int] = field(default_factory=set)
    running: dict[int, int] = field(default_factory=dict)  # ticket -> instance
    failed: list[int] = field(default_factory=list)
    endings: dict[str, int] = field(default_factory=dict)

    def end(self, how: str) -> None:
        """Counts one ending of `how` kind."""
        self.endings[how] = self.endings.get(how, 0) + 1

    def take(self, events: Events) -> None:
        """Applies the pool's events; each must be the one ending of a waiting ticket."""
        for ticket, code in events:
            assert ticket in self.waiting, f"ticket {ticket} ended twice or was never waiting"
            self.waiting.remove(ticket)
            if code >= 0:
                self.start(ticket, code)
            else:
                self.end("expired" if code == EXPIRED else "unservable")
        self.check_capacity()

    def start(self, ticket: int, instance: int) -> None:
        """A grant: the attempt now runs on `instance`."""
        assert ticket not in self.running
        self.running[ticket] = instance
        self.tried[ticket] = self.tried.get(ticket, 0) | 1 << instance

    def check_capacity(self) -> None:
        """SPEC §5: "An instance never exceeds its max_concurrency"."""
        for index in range(self.pool.instance_count):
            info = self.pool.instance(index, self.now)
            mine = sum(1 for i in self.running.values() if i == index)
            assert info.in_flight == mine <= info.max_concurrency

    def submit(self, ticket: int, priority: Priority, tenant: int = 0) -> None:
        """Submits `ticket`, excluding the instances it already tried."""
        self.priority[ticket], self.tenant[ticket] = priority, tenant
        try:
            code = self.pool.submit(ticket, priority, self.now, tenant, self.tried.get(ticket, 0))
        except NoHealthyInstance:
            self.end("refused_unhealthy")
            return
        except QueueFull:
            self.end("refused_full")
            return
        if code >= 0:
            self.start(ticket, code)
        else:
            self.waiting.add(ticket)
        self.take(self.pool.take_events())

    def release(self, ticket: int, outcome: Outcome, cool_ms: int = 0) -> None:
        """An attempt ends."""
        del self.running[ticket]
        self.end("released")
        self.take(self.pool.release(ticket, outcome, self.now, cool_ms))

    def apply(self, op: Op) -> None:
        """Runs one generated operation (see `operations`)."""
        kind, k, flag, dt = op
        self.now += dt
        if kind == "submit":
            priority, tenant, burst = arrival(k, flag)
            for _ in range(burst):
                self.next_ticket += 1
                self.submit(self.next_ticket, priority, tenant)
        elif kind == "release" and self.running:
            outcome, cool_ms = ending(k, flag)
            ticket = list(self.running)[k % len(self.running)]
            self.release(ticket, outcome, cool_ms)
            if outcome == Outcome.FAILURE:
                self.failed.append(ticket)
        elif kind == "retry" and self.failed:
            ticket = self.failed.pop(k % len(self.failed))
            self.submit(ticket, self.priority[ticket], self.tenant[ticket])
        elif kind == "cancel" and self.waiting:
            ticket = sorted(self.waiting)[k % len(self.waiting)]
            assert self.pool.cancel(ticket)
            self.waiting.remove(ticket)
            self.end("cancelled")
        elif kind == "probe" and k % 4 < self.pool.instance_count:
            self.take(self.pool.record_probe(k % 4, flag % 2 == 0, self.now))
        elif kind == "tick":
            self.take(self.pool.tick(self.now))
        elif kind == "reload":
            self.reload(RELOADS[flag % 4], k)

    def reload(self, kind: str, k: int) -> None:
        """A hot reload (SPEC §8: nothing queued or in flight is dropped), then a tick."""
        index, capacity = k % 4, k % 5 + 1
        if kind == "configure":
            self.pool.configure(PoolConfig(**self.reconfigs[k % len(self.reconfigs)]))
        elif kind == "add_instance" and self.pool.instance_count < 60:
            self.pool.add_instance(capacity)
        elif kind == "remove_instance" and index < self.pool.instance_count:
            self.pool.remove_instance(index)
        elif kind == "set_max_concurrency" and index < self.pool.instance_count:
            # lowered no further than what runs there, so capacity stays checkable
            running_there = sum(1 for i in self.running.values() if i == index)
            self.pool.set_max_concurrency(index, max(capacity, running_there))
        self.take(self.pool.tick(self.now))

    def drain(self) -> None:
        """Everything running finishes and time runs past every deadline and ejection."""
        for _ in range(10_000):
            if not self.running and not self.waiting:
                return
            if self.running:
                self.release(next(iter(self.running)), Outcome.SUCCESS)
            else:
                self.now += 1_000_000
                self.take(self.pool.tick(self.now))
        pytest.fail("the pool never went quiet")


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    kwargs=config_kwargs, capacities=capacity_lists, seed=seeds, ops=op_lists, reconfigs=reconfigs
)
def test_capacity_holds_and_every_ticket_ends_once_and_counters_return_to_zero(
    kwargs: dict[str, Any],
    capacities: list[int],
    seed: int,
    ops: list[Op],
    reconfigs: list[dict[str, Any]],
) -> None:
    """SPEC §3 "Every counter is exact": after any mix of success, failure, timeout,
    cancellation and reload, a quiet pool shows 0 in flight and 0 queued; no ticket is lost."""
    pool = Pool(PoolConfig(**kwargs), seed)
    for capacity in capacities:
        pool.add_instance(capacity)
    caller = Caller(pool, reconfigs)
    for op in ops:
        caller.apply(op)
        assert pool.waiting == len(caller.waiting)
        assert pool.outstanding == len(caller.waiting) + len(caller.running)
    caller.drain()
    assert (pool.waiting, pool.in_flight, pool.outstanding) == (0, 0, 0)
    assert pool.queued(HIGH) == pool.queued(LOW) == 0
    assert pool.next_wakeup(caller.now) is None
    stats = pool.stats()
    released = caller.endings.get("released", 0)
    assert stats.granted_high + stats.granted_low == released
    assert stats.expired == caller.endings.get("expired", 0)
    assert stats.cancelled == caller.endings.get("cancelled", 0)
    assert stats.rejected_full == caller.endings.get("refused_full", 0)
    evicted_or_refused = caller.endings.get("unservable", 0)
    assert stats.unservable == evicted_or_refused + caller.endings.get("refused_unhealthy", 0)


def backlog(config: PoolConfig, capacities: list[int], highs: int, lows: int) -> Caller:
    """A saturated pool with `highs` and `lows` waiting (tenants mixed), all at time 0."""
    pool = Pool(config)
    for capacity in capacities:
        pool.add_instance(capacity)
    caller = Caller(pool)
    for _ in range(sum(capacities)):
        caller.next_ticket += 1
        caller.submit(caller.next_ticket, HIGH)
    assert len(caller.running) == sum(capacities)
    for k in range(max(highs, lows)):
        for priority, count in ((HIGH, highs), (LOW, lows)):
            if k < count:
                caller.next_ticket += 1
                caller.submit(caller.next_ticket, priority, tenant=k % 3)
    assert pool.queued(HIGH) == highs and pool.queued(LOW) == lows
    return caller


def grants_while_both_wait(caller: Caller, step_ms: int = 0) -> Iterator[tuple[int, Priority]]:
    """Frees one slot at a time (the oldest attempt succeeds, `step_ms` apart) and yields
    (time, class) of each grant made while both classes waited."""
    pool = caller.pool
    while pool.queued(HIGH) and pool.queued(LOW):
        caller.now += step_ms
        before = set(caller.running)
        caller.release(next(iter(caller.running)), Outcome.SUCCESS)
        (ticket,) = set(caller.running) - before
        yield caller.now, caller.priority[ticket]


@settings(max_examples=40, deadline=None)
@given(capacities=capacity_lists, highs=st.integers(30, 120), lows=st.integers(30, 120))
def test_weighted_policy_grants_seven_high_to_three_low(
    capacities: list[int], highs: int, lows: int
) -> None:
    """SPEC §3 "Selection": while both classes wait, 7 high : 3 low — within ±1 in every run
    of 10 grants."""
    config = PoolConfig(high_capacity=200, low_capacity=200)
    classes_granted = [
        p for _, p in grants_while_both_wait(backlog(config, capacities, highs, lows))
    ]
    assert len(classes_granted) >= 10
    for start in range(len(classes_granted) - 9):
        lows_in_ten = classes_granted[start : start + 10].count(LOW)
        assert 2 <= lows_in_ten <= 4, classes_granted[start : start + 10]


@settings(max_examples=30, deadline=None)
@given(capacities=capacity_lists, limit=st.integers(1, 8))
def test_strict_policy_forces_one_low_per_max_consecutive_high(
    capacities: list[int], limit: int
) -> None:
    """SPEC §3: under `strict`, high goes first, but never more than max_consecutive_high in a
    row while low waits — then exactly one low, not a run of them."""
    config = PoolConfig(
        policy=Policy.STRICT, max_consecutive_high=limit, high_capacity=200, low_capacity=200
    )
    granted = "".join(
        "H" if p == HIGH else "L"
        for _, p in grants_while_both_wait(backlog(config, capacities, 60, 30))
    )
    pattern = ("H" * limit + "L") * 60
    assert granted == pattern[: len(granted)]


@settings(max_examples=30, deadline=None)
@given(
    capacities=capacity_lists,
    bound_ms=st.sampled_from([100, 1_000, 5_000]),
    grants_per_bound=st.integers(1, 40),
    jitter_ms=st.integers(0, 37),
)
def test_low_never_waits_past_max_low_wait_ms(
    capacities: list[int], bound_ms: int, grants_per_bound: int, jitter_ms: int
) -> None:
    """SPEC §3 (b): under `strict`, while lows wait, a low is granted once max_low_wait_ms has
    passed since the last low grant (or the oldest low's arrival) — and only then."""
    config = PoolConfig(
        policy=Policy.STRICT,
        max_low_wait_ms=bound_ms,
        max_consecutive_high=1_000,
        high_capacity=300,
        low_capacity=300,
        high_max_wait_ms=10**9,
        low_max_wait_ms=10**9,
    )
    step_ms = bound_ms // grants_per_bound + jitter_ms  # slots free this often
    caller = backlog(config, capacities, 250, 20)
    since = 0  # every low arrived at 0; no low granted yet
    lows = 0
    for now, priority in grants_while_both_wait(caller, step_ms):
        due = now - since >= bound_ms
        assert (priority == LOW) == due, (now, since)
        if priority == LOW:
            lows += 1
            since = now
    assert lows > 0


def test_ejection_half_open_and_restore() -> None:
    """SPEC §6 as a user of two instances sees it: three failures eject one and traffic moves
    to the other; past the ejection, only after a passing probe, one trial at a time goes
    back; two successes restore it; flapping doubles the next ejection."""
    pool = Pool(PoolConfig(ejection_ms=1_000, max_ejection_ms=60_000))
    pool.add_instance(4)
    pool.add_instance(4)
    tickets = itertools.count(1)
    only_0 = 0b10  # a retry that already tried instance 1 may only go to instance 0

    def fail_on_0(now: int) -> None:
        ticket = next(tickets)
        assert pool.submit(ticket, HIGH, now, 0, only_0) == 0
        pool.release(ticket, Outcome.FAILURE, now)

    for _ in range(3):
        fail_on_0(0)
    info = pool.instance(0, 0)
    assert (info.state, info.ejected_until_ms) == (InstanceState.EJECTED, 1_000)
    held = [next(tickets) for _ in range(4)]
    assert [pool.submit(t, HIGH, 100) for t in held] == [1, 1, 1, 1]
    with pytest.raises(NoHealthyInstance) as refused:
        pool.submit(next(tickets), HIGH, 100, 0, only_0)
    assert refused.value.retry_after_ms == 900  # Retry-After: until the ejection ends
    for t in held:
        pool.release(t, Outcome.SUCCESS, 100)

    assert pool.instance(0, 1_500).state == InstanceState.EJECTED  # no passing probe yet
    pool.record_probe(0, True, 1_500)
    assert pool.instance(0, 1_500).state == InstanceState.HALF_OPEN
    first, second = next(tickets), next(tickets)
    assert pool.submit(first, HIGH, 1_500, 0, only_0) == 0
    assert pool.submit(second, HIGH, 1_500, 0, only_0) == QUEUED  # one trial at a time
    assert pool.release(first, Outcome.SUCCESS, 1_600) == [(second, 0)]
    pool.release(second, Outcome.SUCCESS, 1_700)
    assert pool.instance(0, 1_700).state == InstanceState.HEALTHY

    for _ in range(3):
        fail_on_0(1_800)
    assert pool.instance(0, 1_800).ejected_until_ms == 1_800 + 2_000
    pool.record_probe(0, True, 3_800)
    trial = next(tickets)
    assert pool.submit(trial, HIGH, 3_800, 0, only_0) == 0
    pool.release(trial, Outcome.FAILURE, 3_900)  # one trial failure ejects again
    assert pool.instance(0, 3_900).ejected_until_ms == 3_900 + 4_000
