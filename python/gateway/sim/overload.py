"""Issue 22's overload scenario replayed on the scheduling core in virtual time.

One pool of 2 instances × 4 slots; service times lognormal with a mean of 100 ms (σ 0.5, the
mock's `lognormal`); realtime (high) arrivals Poisson at 0.5× capacity and batch (low) at 2×;
the scheduler's defaults (weighted 7:3, queues 200 / 1000, starvation guard 20 / 5 s). Each
arrival is `submit`ted to a `gateway._core.Pool` at its virtual millisecond, each completion
`release`d at its own: the queue wait is grant time minus arrival time, exactly, with no
event loop, HTTP or machine load in it. A wall-clock load test of the same scenario measures
the core plus the gateway's Python path plus whatever else the machine runs; this measures the
core's decisions alone, so two commits can be compared on it seed for seed.

    python -m gateway.sim.overload [--seeds 1-20] [--duration 60] [--warm-up 2]

Prints one line per seed and the spread of realtime p99 over the seeds.
"""

from __future__ import annotations

import argparse
import heapq
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

from gateway import _core
from gateway._core import Outcome, Priority

__all__ = ["Result", "main", "percentile", "run"]

INSTANCES, SLOTS = 2, 4
MEAN_MS, SIGMA = 100.0, 0.5
HIGH_LOAD, LOW_LOAD = 0.5, 2.0  # × capacity


@dataclass(frozen=True, slots=True)
class Result:
    seed: int
    high_waits: list[int]  # ms, arrivals after the warm-up
    low_waits: list[int]
    high_rejected: int
    low_rejected: int
    quiet: bool  # nothing in flight or queued once every arrival was served


def percentile(values: Sequence[float], q: float) -> float:
    """The nearest-rank percentile (q in 0..1) of `values`; NaN for none."""
    if not values:
        return math.nan
    v = sorted(values)
    return float(v[min(len(v) - 1, math.ceil(q * len(v)) - 1 if q > 0 else 0)])


def run(seed: int, duration_s: float = 60.0, warm_up_s: float = 2.0) -> Result:
    """One seeded run: arrivals for `duration_s`, then until every admitted request is done."""
    pool = _core.Pool(_core.PoolConfig(), seed)
    for _ in range(INSTANCES):
        pool.add_instance(SLOTS)
    capacity = INSTANCES * SLOTS / (MEAN_MS / 1000)  # requests per second
    arrivals = random.Random(seed)
    service = random.Random(seed * 7 + 1)
    # (time ms, order, is_completion, ticket)
    events: list[tuple[int, int, bool, int]] = []
    klass: dict[int, Priority] = {}
    ticket = 0
    for cls, load in ((Priority.HIGH, HIGH_LOAD), (Priority.LOW, LOW_LOAD)):
        t = 0.0
        while True:
            t += arrivals.expovariate(load * capacity)
            if t >= duration_s:
                break
            ticket += 1
            klass[ticket] = cls
            heapq.heappush(events, (int(t * 1000), ticket, False, ticket))
    order = ticket
    arrived: dict[int, int] = {}
    waits: dict[Priority, list[int]] = {Priority.HIGH: [], Priority.LOW: []}
    rejected = {Priority.HIGH: 0, Priority.LOW: 0}
    warm_ms = int(warm_up_s * 1000)
    mu = math.log(MEAN_MS) - SIGMA**2 / 2

    def granted(t: int, now: int) -> None:
        nonlocal order
        if arrived[t] >= warm_ms:
            waits[klass[t]].append(now - arrived[t])
        order += 1
        took = max(1, round(service.lognormvariate(mu, SIGMA)))
        heapq.heappush(events, (now + took, order, True, t))

    def deliver(moved: list[_core.Event], now: int) -> None:
        for e in moved:
            if e.instance is not None:
                granted(e.ticket, now)

    while events:
        now, _, done, t = heapq.heappop(events)
        if done:
            deliver(pool.release(t, Outcome.SUCCESS, now), now)
            continue
        arrived[t] = now
        try:
            if pool.submit(t, klass[t], now) is not None:
                granted(t, now)
        except _core.QueueFull:
            rejected[klass[t]] += 1
            continue
        deliver(pool.take_events(), now)
    quiet = pool.in_flight == 0 and pool.waiting == 0
    return Result(
        seed,
        waits[Priority.HIGH],
        waits[Priority.LOW],
        rejected[Priority.HIGH],
        rejected[Priority.LOW],
        quiet,
    )


def _seeds(text: str) -> list[int]:
    out: list[int] = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        out.extend(range(int(lo), int(hi or lo) + 1))
    return out


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m gateway.sim.overload", description=__doc__)
    p.add_argument("--seeds", default="1-20", help="e.g. 1-20 or 1,4,9 (default %(default)s)")
    p.add_argument("--duration", type=float, default=60.0, help="seconds of arrivals")
    p.add_argument("--warm-up", type=float, default=2.0, help="seconds not counted")
    args = p.parse_args(argv)
    p99s = []
    for seed in _seeds(args.seeds):
        r = run(seed, args.duration, args.warm_up)
        p99 = percentile(r.high_waits, 0.99)
        p99s.append(p99)
        print(
            f"seed {seed:3d}  realtime n={len(r.high_waits)} wait p50 "
            f"{percentile(r.high_waits, 0.5):.0f} ms p99 {p99:.0f} ms max "
            f"{max(r.high_waits, default=0)} ms · batch p50 "
            f"{percentile(r.low_waits, 0.5) / 1000:.1f} s, {r.low_rejected} rejected"
        )
    s = sorted(p99s)
    print(
        f"realtime p99 over {len(s)} seeds: min {s[0]:.0f} · median "
        f"{percentile(s, 0.5):.0f} · max {s[-1]:.0f} ms"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
