"""A pure-Python reference model of one pool's scheduler (SPEC §3, §5, §6).

`ReferencePool` has the API and return codes of `gateway._core.Pool`, and is written from the
SPEC's rules as plainly as possible — lists and loops, no tombstones, no counters kept for
speed — so `tests/test_reference.py` can drive it and the Rust core with the same operations
and demand the same answers. It is the executable specification, not a second implementation:
clarity wins over speed everywhere.

Where the SPEC leaves room it takes the core's documented choices:

- weighted selection is smooth weighted round-robin whose credits move only when both classes
  wait and the policy (not the starvation guard) chose; ties go to high;
- within a class, tenants take turns (a served tenant goes to the back of the ring; a tenant
  whose list empties leaves the ring and re-enters at the back); within a tenant, waiters stand
  in ticket order, so a retry resubmitted with its ticket goes back to its place;
- a waiter passed over because every free instance is one it already tried does not block the
  waiters behind it;
- a waiter that no instance it may use can serve (all ejected or removed) is evicted as
  `UNSERVABLE` at once, rather than held until its deadline; an instance cooling off for an
  upstream's Retry-After is busy, not down (SPEC §6 names only ejection);
- ejection doubling decays by one step per `ejection_ms` of healthy time (health.rs), and an
  attempt granted before the latest ejection no longer speaks for the instance (epochs);
- `random` and `p2c` draw from SplitMix64 exactly as rust/core/src/rng.rs and balancer.rs do;
- an instance's load is `(in_flight + backend waiting) / max_concurrency`, equal loads told
  apart by the backend's KV-cache usage (SPEC §15 "Backend load");
- `affinity` (SPEC §15) is consistent hashing with bounded loads: every instance in the config
  has 160 points on a u64 ring (the first outputs of SplitMix64 seeded with its ring id); a
  keyed request takes the first instance clockwise from its key that may take it and whose
  load (in flight + backend waiting) is below ceil((1 + ε)(total + 1) / n) over the instances
  that are up, else the least loaded one that may take it; a request without a key is placed
  as by least connections;
- a new instance takes the slot of a removed one that has drained, else a new index.

Where the SPEC speaks it follows the SPEC (places where the core once read differently are
marked `SPEC over core`; test_reference.py keeps a regression test for each).

QueueFull's retry-after (the core's drain meter) is not modelled: the reference raises
`QueueFull` with a fixed 1000 ms.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Protocol

from gateway._core import (
    MAX_INSTANCES,
    Affinity,
    Balancer,
    DuplicateTicket,
    InstanceState,
    InvalidPoolConfig,
    NoHealthyInstance,
    Outcome,
    Policy,
    Priority,
    QueueFull,
    UnknownTicket,
)
from gateway.errors import with_retry_after

# The reference's own answer encoding (the test adapts the core's typed answers to it):
# `submit` gives an instance index or QUEUED/SPILLED, an event (ticket, code) gives an
# instance index or EXPIRED/UNSERVABLE.
QUEUED, SPILLED, EXPIRED, UNSERVABLE = -1, -2, -3, -4

Event = tuple[int, int]
"""(ticket, code): code >= 0 is the granted instance, else `EXPIRED` or `UNSERVABLE`."""

U64 = (1 << 64) - 1

#: Points per instance on the affinity ring.
VNODES = 160


class PoolConfigLike(Protocol):
    """The fields of `gateway._core.PoolConfig` the scheduler reads."""

    @property
    def policy(self) -> Policy: ...
    @property
    def high_capacity(self) -> int: ...
    @property
    def low_capacity(self) -> int: ...
    @property
    def high_weight(self) -> int: ...
    @property
    def low_weight(self) -> int: ...
    @property
    def high_max_wait_ms(self) -> int: ...
    @property
    def low_max_wait_ms(self) -> int: ...
    @property
    def max_consecutive_high(self) -> int: ...
    @property
    def max_low_wait_ms(self) -> int: ...
    @property
    def overflow_high_to_low(self) -> bool: ...
    @property
    def balancer(self) -> Balancer: ...
    @property
    def affinity_epsilon(self) -> float: ...
    @property
    def failure_threshold(self) -> int: ...
    @property
    def ejection_ms(self) -> int: ...
    @property
    def max_ejection_ms(self) -> int: ...
    @property
    def half_open_max_requests(self) -> int: ...
    @property
    def success_threshold(self) -> int: ...
    @property
    def probing(self) -> bool: ...


def validate(cfg: PoolConfigLike) -> None:
    """Refuses the values the core refuses."""
    if cfg.high_weight == 0 and cfg.low_weight == 0:
        raise InvalidPoolConfig("scheduler weights: high and low cannot both be 0")
    for name in (
        "max_consecutive_high",
        "max_low_wait_ms",
        "failure_threshold",
        "success_threshold",
        "half_open_max_requests",
        "ejection_ms",
    ):
        if getattr(cfg, name) == 0:
            raise InvalidPoolConfig(f"{name} must be at least 1")


# ---- randomness ---------------------------------------------------------------------------


class SplitMix64:
    """SplitMix64 (Steele, Lea, Flood 2014), bit for bit as rust/core/src/rng.rs."""

    def __init__(self, seed: int) -> None:
        self.state = seed & U64

    def next_u64(self) -> int:
        """The next 64-bit output."""
        self.state = (self.state + 0x9E37_79B9_7F4A_7C15) & U64
        z = self.state
        z = ((z ^ (z >> 30)) * 0xBF58_476D_1CE4_E5B9) & U64
        z = ((z ^ (z >> 27)) * 0x94D0_49BB_1331_11EB) & U64
        return z ^ (z >> 31)

    def below(self, n: int) -> int:
        """An index in `0..n`, by modulo like the core."""
        return self.next_u64() % n


# ---- the waiting room ---------------------------------------------------------------------


@dataclass
class Waiter:
    """A request waiting in a class queue."""

    ticket: int
    tenant: int
    enqueued_at: int
    excluded: int  # bit set of instances it already tried
    affinity_key: int = 0  # 0: none


class ClassQueue:
    """One class's bounded queue: tenants take turns; each tenant's list is in ticket order."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.ring: list[int] = []  # tenants with waiters, whose turn comes first first
        self.lists: dict[int, list[Waiter]] = {}

    def __len__(self) -> int:
        return sum(len(waiters) for waiters in self.lists.values())

    def waiters(self) -> list[Waiter]:
        """Every waiter, in ring order then ticket order."""
        return [w for tenant in self.ring for w in self.lists[tenant]]

    def push(self, waiter: Waiter) -> None:
        """SPEC §3 "Retries keep their place": insert before every later ticket."""
        if waiter.tenant not in self.lists:
            self.ring.append(waiter.tenant)
            self.lists[waiter.tenant] = []
        waiters = self.lists[waiter.tenant]
        at = len([w for w in waiters if w.ticket < waiter.ticket])
        waiters.insert(at, waiter)

    def remove(self, ticket: int) -> None:
        """Takes a waiter out; a tenant left with nobody leaves the ring."""
        for tenant in self.ring:
            waiters = self.lists[tenant]
            for w in waiters:
                if w.ticket == ticket:
                    waiters.remove(w)
                    if not waiters:
                        self.ring.remove(tenant)
                        del self.lists[tenant]
                    return
        raise KeyError(ticket)

    def pop_first_fitting(
        self, instance_for: Callable[[Waiter], tuple[int, Affinity] | None]
    ) -> tuple[Waiter, tuple[int, Affinity]] | None:
        """The first waiter, in fair order, that `instance_for(waiter)` finds an instance for.

        The served tenant goes to the back of the ring; tenants passed over keep their turn.
        """
        for tenant in self.ring:
            for w in self.lists[tenant]:
                inst = instance_for(w)
                if inst is not None:
                    self.lists[tenant].remove(w)
                    self.ring.remove(tenant)
                    if self.lists[tenant]:
                        self.ring.append(tenant)
                    else:
                        del self.lists[tenant]
                    return w, inst
        return None


# ---- the instances ------------------------------------------------------------------------


@dataclass
class Health:
    """One instance's circuit (SPEC §6)."""

    state: InstanceState = InstanceState.HEALTHY
    consecutive_failures: int = 0
    consecutive_successes: int = 0
    level: int = 0  # the next ejection lasts ejection_ms * 2**level (capped)
    ejected_until: int = 0
    restored_at: int = 0
    trials: int = 0  # half-open trial requests in flight
    probe_ok: bool = False  # the latest probe since the last ejection passed
    cool_until: int = 0
    epoch: int = 0  # bumped on every ejection
    ejections: int = 0


@dataclass
class Instance:
    """An instance's slots and health."""

    max_concurrency: int
    ring_id: int = 0  # where its points lie on the affinity ring
    in_flight: int = 0
    removed: bool = False
    health: Health = field(default_factory=Health)
    backend_waiting: int = 0  # what the backend reports waiting (vLLM)
    cache_permille: int = 0  # the backend's KV-cache usage, in thousandths

    @property
    def active(self) -> int:
        """Requests on the instance: this pool's attempts and the backend's own queue."""
        return self.in_flight + self.backend_waiting

    def is_up(self, now: int) -> bool:
        """Up (not removed, not ejected): it could take traffic once a slot frees and any
        Retry-After cooling ends."""
        return not self.removed and self.health.state != InstanceState.EJECTED

    def next_try_at(self, now: int) -> int:
        """The earliest time it may be tried (SPEC §6 Retry-After)."""
        h = self.health
        t = max(now, h.cool_until)
        if h.state == InstanceState.EJECTED:
            t = max(t, h.ejected_until)
        return t


@dataclass(frozen=True)
class InstanceView:
    """What `Pool.instance` reports."""

    state: InstanceState
    in_flight: int
    max_concurrency: int
    consecutive_failures: int
    ejected_until_ms: int | None
    cool_until_ms: int
    next_try_ms: int
    ejections: int
    half_open_trials: int
    removed: bool
    backend_waiting: int
    cache_permille: int


@dataclass(frozen=True)
class StatsView:
    """What `Pool.stats` reports."""

    granted_high: int
    granted_low: int
    forced_low: int
    expired: int
    cancelled: int
    rejected_full: int
    unservable: int
    affinity_hits: int
    affinity_spills: int


@dataclass
class Grant:
    """Where a granted ticket runs, and what it means for the instance's health."""

    instance: int
    epoch: int
    trial: bool


# ---- the pool -----------------------------------------------------------------------------


class ReferencePool:
    """One pool's scheduler, as the SPEC describes it."""

    def __init__(self, config: PoolConfigLike, seed: int = 0) -> None:
        validate(config)
        self.cfg = config
        self.queues = {
            Priority.HIGH: ClassQueue(config.high_capacity),
            Priority.LOW: ClassQueue(config.low_capacity),
        }
        self.instances: list[Instance] = []
        self.granted: dict[int, Grant] = {}
        self.waiting_class: dict[int, Priority] = {}
        self.events: list[Event] = []
        # selector
        self.credit = {Priority.HIGH: 0, Priority.LOW: 0}
        self._consecutive_high = 0
        self.last_low_grant: int | None = None
        # balancer
        self.cursor = 0
        self.rng = SplitMix64(seed)
        # affinity: where each ticket's latest grant landed relative to its key
        self.placements: dict[int, Affinity] = {}
        self._last_affinity = Affinity.NONE
        self._rings: dict[tuple[tuple[int, int], ...], list[tuple[int, int]]] = {}
        # counters
        self.counts = dict.fromkeys(
            (
                "granted_high",
                "granted_low",
                "forced_low",
                "expired",
                "cancelled",
                "rejected_full",
                "unservable",
                "affinity_hits",
                "affinity_spills",
            ),
            0,
        )

    # ---- configuration ----------------------------------------------------------------------

    def configure(self, config: PoolConfigLike) -> None:
        """Applies new settings; waiting and in-flight requests stay."""
        validate(config)
        selector = [
            "policy",
            "high_weight",
            "low_weight",
            "max_consecutive_high",
            "max_low_wait_ms",
        ]
        if any(getattr(config, k) != getattr(self.cfg, k) for k in selector):
            # old credits would skew the new weights
            self.credit = {Priority.HIGH: 0, Priority.LOW: 0}
        self.queues[Priority.HIGH].capacity = config.high_capacity
        self.queues[Priority.LOW].capacity = config.low_capacity
        self.cfg = config

    def add_instance(self, max_concurrency: int, ring_id: int | None = None) -> int:
        """Adds an instance; returns its index. Its ring id defaults to that index."""
        if max_concurrency == 0:
            raise InvalidPoolConfig("max_concurrency must be at least 1")
        for index, inst in enumerate(self.instances):
            if inst.removed and inst.in_flight == 0:
                # a removed instance that has drained leaves a slot no attempt refers to
                rid = index if ring_id is None else ring_id
                self.instances[index] = Instance(max_concurrency, rid)
                return index
        if len(self.instances) >= MAX_INSTANCES:
            raise InvalidPoolConfig(f"a pool holds at most {MAX_INSTANCES} instances")
        index = len(self.instances)
        self.instances.append(Instance(max_concurrency, index if ring_id is None else ring_id))
        return index

    def set_backend_load(self, index: int, waiting: int, gpu_cache_usage: float) -> None:
        """SPEC §15: what the backend reports of itself; counted from the next decision."""
        inst = self._instance(index)
        usage = 0.0 if math.isnan(gpu_cache_usage) else min(1.0, max(0.0, gpu_cache_usage))
        inst.backend_waiting = waiting
        inst.cache_permille = math.floor(usage * 1000 + 0.5)

    def set_max_concurrency(self, index: int, max_concurrency: int) -> None:
        """Changes a capacity; nothing running is cut."""
        if max_concurrency == 0:
            raise InvalidPoolConfig("max_concurrency must be at least 1")
        self._instance(index).max_concurrency = max_concurrency

    def remove_instance(self, index: int) -> None:
        """The instance takes nothing new; what runs there finishes."""
        self._instance(index).removed = True

    def _instance(self, index: int) -> Instance:
        if not 0 <= index < len(self.instances):
            raise InvalidPoolConfig(f"no instance with index {index}")
        return self.instances[index]

    # ---- the operations ---------------------------------------------------------------------

    def submit(
        self,
        ticket: int,
        priority: Priority,
        now_ms: int,
        tenant: int = 0,
        excluded: int = 0,
        affinity_key: int = 0,
    ) -> int:
        """SPEC §2.4: dispatch at once if an instance is free and nothing waits, else queue."""
        if ticket in self.granted or ticket in self.waiting_class:
            raise DuplicateTicket(f"ticket {ticket} is already waiting or granted")
        self._pass_time(now_ms)
        # SPEC §6: nothing this request may use is up: answer now (fallback or 503).
        if not any(inst.is_up(now_ms) for inst in self._allowed(excluded)):
            self.counts["unservable"] += 1
            tries = [inst.next_try_at(now_ms) - now_ms for inst in self._allowed(excluded)]
            retry_after = min(tries, default=0)
            raise with_retry_after(NoHealthyInstance(f"retry after {retry_after} ms"), retry_after)
        if self.waiting == 0:
            placed = self._pick(excluded, affinity_key, now_ms)
            if placed is not None:
                self._commit("alone", priority, now_ms, low_was_waiting=False)
                self._grant(ticket, priority, *placed)
                return placed[0]
        # SPEC §3 "Overflow": a high request finding the high queue full spills into low.
        cls = priority
        if len(self.queues[priority]) >= self.queues[priority].capacity:
            low = self.queues[Priority.LOW]
            if (
                priority == Priority.HIGH
                and self.cfg.overflow_high_to_low
                and len(low) < (low.capacity)
            ):
                cls = Priority.LOW
            else:
                self.counts["rejected_full"] += 1
                raise with_retry_after(QueueFull("queue full"), 1000)
        self.queues[cls].push(Waiter(ticket, tenant, now_ms, excluded, affinity_key))
        self.waiting_class[ticket] = cls
        self._pump(now_ms)
        for event in self.events:
            if event[0] == ticket:
                self.events.remove(event)
                self._last_affinity = self.placements[ticket]
                return event[1]
        return QUEUED if cls == priority else SPILLED

    def last_affinity(self) -> Affinity:
        """Where the latest grant landed relative to its affinity key."""
        return self._last_affinity

    def take_events(self) -> list[Event]:
        """What `submit` decided for other tickets."""
        events, self.events = self.events, []
        return events

    def cancel(self, ticket: int) -> bool:
        """A waiting request leaves; `False` when it is not waiting."""
        cls = self.waiting_class.pop(ticket, None)
        if cls is None:
            return False
        self.queues[cls].remove(ticket)
        self.counts["cancelled"] += 1
        return True

    def release(
        self, ticket: int, outcome: Outcome, now_ms: int, retry_after_ms: int = 0
    ) -> list[Event]:
        """An attempt ended: free its slot, learn from its outcome, grant the slot on."""
        grant = self.granted.pop(ticket, None)
        if grant is None:
            raise UnknownTicket(f"ticket {ticket} is not waiting or granted")
        self._pass_time(now_ms)
        inst = self.instances[grant.instance]
        inst.in_flight -= 1
        self._on_outcome(inst.health, outcome, grant, now_ms)
        if retry_after_ms > 0:
            # SPEC §6: "An upstream 429 or 503 carrying Retry-After also cools the instance".
            # SPEC §16: "an upstream `Retry-After` is clamped to `health.max_ejection_ms`".
            pause = min(retry_after_ms, self.cfg.max_ejection_ms)
            inst.health.cool_until = max(inst.health.cool_until, now_ms + pause)
        self._pump(now_ms)
        return self.take_events()

    def record_probe(self, index: int, ok: bool, now_ms: int) -> list[Event]:
        """An active probe of instance `index` finished."""
        h = self._instance(index).health
        self._pass_time(now_ms)
        if ok:
            # SPEC §6: a passing probe "only lets the instance into half-open".
            h.probe_ok = True
            self._advance_health(now_ms)
        else:
            # SPEC §6: "a failed probe counts as a failure"; in half-open "one failure (a
            # request or a probe) ejects it again". SPEC over core: the state here is the one
            # time has made it — half-open once the ejection has passed and the latest probe
            # passed — whether or not anything looked at the instance since.
            h.probe_ok = False
            if h.state == InstanceState.HEALTHY:
                self._count_failure(h, now_ms)
            elif h.state == InstanceState.HALF_OPEN:
                self._eject(h, now_ms)
        self._pump(now_ms)
        return self.take_events()

    def tick(self, now_ms: int) -> list[Event]:
        """Time passed: expire overdue waiters, use instances that came back."""
        self._pass_time(now_ms)
        self._pump(now_ms)
        return self.take_events()

    def next_wakeup(self, now_ms: int) -> int | None:
        """The earliest deadline, or instance recovery while requests wait."""
        if self.waiting == 0:
            return None
        times = [
            w.enqueued_at + self._max_wait(cls)
            for cls, q in self.queues.items()
            for w in q.waiters()
        ]
        for inst in self.instances:
            t = inst.next_try_at(now_ms)
            if not inst.removed and t > now_ms:
                times.append(t)
        return min(times)

    # ---- views ------------------------------------------------------------------------------

    def queued(self, priority: Priority) -> int:
        """Waiters in one class."""
        return len(self.queues[priority])

    @property
    def waiting(self) -> int:
        """Waiters in both classes."""
        return len(self.waiting_class)

    def free_slots(self, now_ms: int) -> int:
        """Slots a new request could take now; a half-open instance offers its trial permits."""
        self._advance_health(now_ms)
        free = 0
        for index, inst in enumerate(self.instances):
            if self._admits(index, 0, now_ms):
                slots = inst.max_concurrency - inst.in_flight
                if inst.health.state == InstanceState.HALF_OPEN:
                    slots = min(slots, self.cfg.half_open_max_requests - inst.health.trials)
                free += slots
        return free

    @property
    def in_flight(self) -> int:
        """Attempts running on all instances."""
        return sum(inst.in_flight for inst in self.instances)

    @property
    def outstanding(self) -> int:
        """Tickets waiting or granted."""
        return len(self.waiting_class) + len(self.granted)

    @property
    def consecutive_high(self) -> int:
        """High grants in a row while low waited."""
        return self._consecutive_high

    def instance(self, index: int, now_ms: int) -> InstanceView:
        """One instance's state at `now_ms`."""
        inst = self._instance(index)
        self._advance_health(now_ms)
        h = inst.health
        ejected = h.state == InstanceState.EJECTED
        return InstanceView(
            state=h.state,
            in_flight=inst.in_flight,
            max_concurrency=inst.max_concurrency,
            consecutive_failures=h.consecutive_failures,
            ejected_until_ms=h.ejected_until if ejected else None,
            cool_until_ms=h.cool_until,
            next_try_ms=inst.next_try_at(now_ms),
            ejections=h.ejections,
            half_open_trials=h.trials,
            removed=inst.removed,
            backend_waiting=inst.backend_waiting,
            cache_permille=inst.cache_permille,
        )

    def stats(self) -> StatsView:
        """The cumulative counters."""
        return StatsView(**self.counts)

    # ---- time -------------------------------------------------------------------------------

    def _max_wait(self, cls: Priority) -> int:
        c = self.cfg
        return c.high_max_wait_ms if cls == Priority.HIGH else c.low_max_wait_ms

    def _pass_time(self, now: int) -> None:
        """Everything time does by `now`: ejections end, deadlines pass."""
        self._advance_health(now)
        # SPEC §3 "Deadlines": "a request waiting longer than its class's max_wait_ms is
        # answered 503 queue_timeout and removed". SPEC over core: this holds at every
        # operation, not only at `tick` — an overdue request is never granted. The class's
        # max_wait_ms is the current one: a reload changes it for those already waiting.
        for cls in (Priority.HIGH, Priority.LOW):
            for w in self.queues[cls].waiters():
                if w.enqueued_at + self._max_wait(cls) <= now:
                    self.queues[cls].remove(w.ticket)
                    del self.waiting_class[w.ticket]
                    self.counts["expired"] += 1
                    self.events.append((w.ticket, EXPIRED))

    def _advance_health(self, now: int) -> None:
        """SPEC §6: "an ejected instance turns half-open once its ejection time has passed
        *and* (where probing is on) its latest probe passed"."""
        for inst in self.instances:
            h = inst.health
            if (
                h.state == InstanceState.EJECTED
                and now >= h.ejected_until
                and (h.probe_ok or not self.cfg.probing)
            ):
                h.state = InstanceState.HALF_OPEN
                h.consecutive_successes = 0
                h.trials = 0

    # ---- health -----------------------------------------------------------------------------

    def _on_outcome(self, h: Health, outcome: Outcome, grant: Grant, now: int) -> None:
        if grant.epoch != h.epoch:
            # granted before the latest ejection: it no longer speaks for the instance
            return
        if grant.trial:
            h.trials -= 1
        if outcome == Outcome.NEUTRAL:
            return
        if h.state == InstanceState.HEALTHY:
            if outcome == Outcome.SUCCESS:
                h.consecutive_failures = 0
            else:
                self._count_failure(h, now)
        elif h.state == InstanceState.HALF_OPEN:
            if outcome == Outcome.SUCCESS:
                h.consecutive_successes += 1
                # SPEC §6: "success_threshold consecutive successes restore it"
                if h.consecutive_successes >= self.cfg.success_threshold:
                    h.state = InstanceState.HEALTHY
                    h.consecutive_failures = 0
                    h.restored_at = now
            else:
                # SPEC §6: "one failure ... ejects it again with the doubled time"
                self._eject(h, now)

    def _count_failure(self, h: Health, now: int) -> None:
        h.consecutive_failures += 1
        # SPEC §6: "After failure_threshold consecutive failures the instance is ejected"
        if h.consecutive_failures >= self.cfg.failure_threshold:
            self._eject(h, now)

    def _eject(self, h: Health, now: int) -> None:
        ejection_ms = self.cfg.ejection_ms
        if h.state == InstanceState.HEALTHY:
            # health.rs: each ejection_ms of healthy time forgives one doubling
            h.level = max(0, h.level - (now - h.restored_at) // ejection_ms)
        # SPEC §6: ejection_ms, "doubling on each repeated ejection up to max_ejection_ms"
        span = min(ejection_ms * 2 ** min(h.level, 32), U64)
        span = min(span, max(self.cfg.max_ejection_ms, ejection_ms))
        h.level += 1
        h.state = InstanceState.EJECTED
        h.ejected_until = now + span
        h.consecutive_failures = 0
        h.consecutive_successes = 0
        h.trials = 0
        h.probe_ok = False  # a probe that passed before the ejection is no evidence after it
        h.epoch += 1
        h.ejections += 1

    # ---- scheduling -------------------------------------------------------------------------

    def _pump(self, now: int) -> None:
        """Grants free slots to waiters until none fits; evicts waiters nothing can serve."""
        if self.waiting == 0:
            return
        self._evict_unservable(now)
        while self.waiting > 0:
            high_waiting = len(self.queues[Priority.HIGH]) > 0
            lows = self.queues[Priority.LOW].waiters()
            oldest_low = min((w.enqueued_at for w in lows), default=None)
            how, first = self._choose(high_waiting, oldest_low, now)
            second = Priority.LOW if first == Priority.HIGH else Priority.HIGH
            # work-conserving: if nothing of the chosen class fits a free instance, the other
            # class goes
            for cls in (first, second):
                found = self.queues[cls].pop_first_fitting(
                    lambda w: self._pick(w.excluded, w.affinity_key, now)
                )
                if found is not None:
                    break
            else:
                return
            waiter, (inst, placed) = found
            self._commit(how, cls, now, low_was_waiting=oldest_low is not None)
            if how == "forced" and cls == Priority.LOW:
                self.counts["forced_low"] += 1
            del self.waiting_class[waiter.ticket]
            self._grant(waiter.ticket, cls, inst, placed)
            self.events.append((waiter.ticket, inst))

    def _choose(self, high_waiting: bool, oldest_low: int | None, now: int) -> tuple[str, Priority]:
        """SPEC §3 "Selection" and "Starvation protection": which class goes next, and why."""
        if oldest_low is None:
            return "alone", Priority.HIGH
        if not high_waiting:
            return "alone", Priority.LOW
        sel = self.cfg
        # (a) "at most max_consecutive_high high grants in a row"
        too_many_high = self._consecutive_high >= sel.max_consecutive_high
        # (b) "at most max_low_wait_ms since the last low grant (or since the oldest low
        # arrived, if later)". SPEC over core: the oldest of all waiting lows, not only the
        # oldest at the head of a tenant's list (a retry at a head is younger than those behind).
        since = oldest_low if self.last_low_grant is None else max(self.last_low_grant, oldest_low)
        if too_many_high or now - since >= sel.max_low_wait_ms:
            return "forced", Priority.LOW
        if sel.policy == Policy.STRICT:
            return "policy", Priority.HIGH
        # smooth weighted round-robin (nginx): each class gains its weight, the richer wins
        high = self.credit[Priority.HIGH] + sel.high_weight
        low = self.credit[Priority.LOW] + sel.low_weight
        return "policy", Priority.HIGH if high >= low else Priority.LOW

    def _commit(self, how: str, granted: Priority, now: int, *, low_was_waiting: bool) -> None:
        """Books a grant of class `granted` with the selector."""
        if how == "policy" and self.cfg.policy == Policy.WEIGHTED:
            self.credit[Priority.HIGH] += self.cfg.high_weight
            self.credit[Priority.LOW] += self.cfg.low_weight
            self.credit[granted] -= self.cfg.high_weight + self.cfg.low_weight
        if granted == Priority.HIGH:
            # only high grants that passed over a waiting low count toward bound (a)
            self._consecutive_high = self._consecutive_high + 1 if low_was_waiting else 0
        else:
            # SPEC §3: "the next grant goes to low and both counts restart"
            self._consecutive_high = 0
            self.last_low_grant = now

    def _evict_unservable(self, now: int) -> None:
        """SPEC §6: a waiter that no instance it may use can serve is answered now."""
        for cls in (Priority.HIGH, Priority.LOW):
            for w in self.queues[cls].waiters():
                if not any(inst.is_up(now) for inst in self._allowed(w.excluded)):
                    self.queues[cls].remove(w.ticket)
                    del self.waiting_class[w.ticket]
                    self.counts["unservable"] += 1
                    self.events.append((w.ticket, UNSERVABLE))

    def _grant(self, ticket: int, cls: Priority, index: int, placed: Affinity) -> None:
        self.placements[ticket] = placed
        self._last_affinity = placed
        if placed == Affinity.HIT:
            self.counts["affinity_hits"] += 1
        elif placed == Affinity.SPILL:
            self.counts["affinity_spills"] += 1
        inst = self.instances[index]
        inst.in_flight += 1
        # SPEC §5: "An instance never exceeds its max_concurrency."
        assert inst.in_flight <= inst.max_concurrency
        trial = inst.health.state == InstanceState.HALF_OPEN
        if trial:
            inst.health.trials += 1
        self.granted[ticket] = Grant(index, inst.health.epoch, trial)
        self.counts["granted_high" if cls == Priority.HIGH else "granted_low"] += 1

    def _allowed(self, excluded: int) -> list[Instance]:
        """The instances a request may use: not removed, not already tried."""
        return [
            inst
            for i, inst in enumerate(self.instances)
            if not inst.removed and not excluded >> i & 1
        ]

    # ---- balancing (SPEC §5) ----------------------------------------------------------------

    def _admits(self, index: int, excluded: int, now: int) -> bool:
        """Whether a new attempt may start on instance `index` now."""
        inst = self.instances[index]
        h = inst.health
        if excluded >> index & 1 or inst.removed or inst.in_flight >= inst.max_concurrency:
            return False
        if now < h.cool_until:
            return False
        if h.state == InstanceState.HALF_OPEN:
            # SPEC §6: half-open "admits at most half_open_max_requests real trial requests"
            return h.trials < self.cfg.half_open_max_requests
        return h.state == InstanceState.HEALTHY

    def _load(self, index: int) -> tuple[Fraction, int]:
        """SPEC §15 "Backend load": (in flight + backend waiting) / max_concurrency, then the
        backend's KV-cache usage."""
        inst = self.instances[index]
        return Fraction(inst.active, inst.max_concurrency), inst.cache_permille

    def _pick(self, excluded: int, key: int, now: int) -> tuple[int, Affinity] | None:
        """The balancer's choice among the instances that admit this request now, and where
        it lands relative to the request's affinity key."""
        n = len(self.instances)
        candidates = [i for i in range(n) if self._admits(i, excluded, now)]
        if not candidates:
            return None
        kind = self.cfg.balancer
        if kind == Balancer.AFFINITY and key != 0:
            return self._place(key, candidates)
        from_cursor = [(self.cursor + k) % n for k in range(n)]
        if kind in (Balancer.LEAST_CONNECTIONS, Balancer.AFFINITY):
            # lowest in_flight / max_concurrency; the first from the cursor among equals
            chosen = min((i for i in from_cursor if i in candidates), key=self._load)
        elif kind == Balancer.ROUND_ROBIN:
            chosen = next(i for i in from_cursor if i in candidates)
        elif kind == Balancer.RANDOM:
            chosen = candidates[self.rng.below(len(candidates))]
        elif len(candidates) == 1:  # p2c with one choice draws nothing
            chosen = candidates[0]
        else:
            # p2c: two distinct uniform candidates, the less loaded wins, the first on a tie
            a = self.rng.below(len(candidates))
            b = self.rng.below(len(candidates) - 1)
            if b >= a:
                b += 1
            first, second = candidates[a], candidates[b]
            chosen = second if self._load(second) < self._load(first) else first
        self.cursor = (chosen + 1) % n
        return chosen, Affinity.NONE

    def _ring_order(self, key: int) -> list[int]:
        """The instances in the config, clockwise from `key` on the ring, each once."""
        members = tuple(
            (i, inst.ring_id) for i, inst in enumerate(self.instances) if not inst.removed
        )
        points = self._rings.get(members)
        if points is None:
            points = []
            for index, ring_id in members:
                rng = SplitMix64(ring_id)
                points += [(rng.next_u64(), index) for _ in range(VNODES)]
            points.sort()
            self._rings[members] = points
        start = bisect.bisect_left(points, (key, -1))
        order: list[int] = []
        for _, index in points[start:] + points[:start]:
            if index not in order:
                order.append(index)
        return order

    def _place(self, key: int, candidates: list[int]) -> tuple[int, Affinity]:
        """SPEC §15 (Mirrokni, Thorup, Zadimoghaddam): the first instance clockwise from the
        key whose load is below ceil((1 + ε)(total + 1) / n), n and total over the instances
        that are up; else the least loaded candidate (the first along the ring among equals).
        """
        order = self._ring_order(key)
        up = [inst for inst in self.instances if inst.is_up(0)]
        total = sum(inst.active for inst in up)
        epsilon = round(self.cfg.affinity_epsilon * 1000)
        cap = -(-(1000 + epsilon) * (total + 1) // (1000 * len(up)))
        first = order[0]

        def label(i: int) -> Affinity:
            return Affinity.HIT if i == first else Affinity.SPILL

        for i in order:
            if i in candidates and self.instances[i].active < cap:
                return i, label(i)
        fallback = min(
            (i for i in order if i in candidates), key=lambda i: self.instances[i].active
        )
        return fallback, label(fallback)
