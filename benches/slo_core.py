"""SPEC §17's scheduling decisions alone, side by side, in virtual time (issue 22).

The same shape as `benches/slo.py` — two engine mocks (`h100-7b`, one fast, one 3x slower),
`max_concurrency: 16` each, open seeded Poisson arrivals, half realtime (streamed, a 2 s TTFT
objective) and half batch (not streamed), unique prompts of 200-1,800 tokens, 10-60 answer
tokens — but the engines are stepped in virtual milliseconds behind a `gateway._core.Pool`,
with no HTTP, event loop or machine load in the numbers: what is compared is only what the
core decides (who goes first, where, how many at once). `benches/slo.py` measures the whole
gateway through HTTP on this machine; this isolates the core's part, seed for seed.

Configurations: (a) least connections + weighted 7:3 (today's defaults); (s) least
connections + strict; (b) `predicted` + deadline order (every realtime request carries its
2 s deadline); (d) (b) + `scheduler.shed_unattainable` (a realtime request `attainable` says
cannot make its deadline is answered at once: a miss, counted); (c) (b) + adaptive limits
(ceiling 16). Loads are multiples of the capacity
measured by (a) closed loop (the pool's completions per second with its queue never empty).

    .venv/bin/python benches/slo_core.py [--seconds 60] [--loads 1,1.5,2] [--seeds 1,2,3]
"""

from __future__ import annotations

import argparse
import heapq
import math
import random
from dataclasses import dataclass, field

from gateway._core import (
    Balancer,
    EventKind,
    GatewayError,
    Outcome,
    Policy,
    Pool,
    PoolConfig,
    Priority,
)
from gateway.sim.engine import PROFILES, Engine, Sequence

SPEEDS = (1.0, 1.0 / 3.0)
SLOTS = 16
SLO_MS = 2_000
CONFIGS = {
    "a": dict(
        balancer=Balancer.LEAST_CONNECTIONS, policy=Policy.WEIGHTED, slo=False, adaptive=False
    ),
    "s": dict(balancer=Balancer.LEAST_CONNECTIONS, policy=Policy.STRICT, slo=False, adaptive=False),
    "b": dict(balancer=Balancer.PREDICTED, policy=Policy.WEIGHTED, slo=True, adaptive=False),
    "d": dict(
        balancer=Balancer.PREDICTED, policy=Policy.WEIGHTED, slo=True, adaptive=False, shed=True
    ),
    "c": dict(balancer=Balancer.PREDICTED, policy=Policy.WEIGHTED, slo=True, adaptive=True),
}


@dataclass
class Req:
    ticket: int
    high: bool
    prompt: int
    output: int
    arrived: float
    first: float = math.inf
    done: float = math.inf


@dataclass
class Result:
    high: list[Req] = field(default_factory=list)
    low: list[Req] = field(default_factory=list)
    per_instance_high: list[int] = field(default_factory=lambda: [0] * len(SPEEDS))
    limits: list[list[int]] = field(default_factory=lambda: [[] for _ in SPEEDS])
    completions: int = 0
    shed: int = 0


def simulate(name: str, rate: float, seconds: float, seed: int, closed: int = 0) -> Result:
    """Arrivals at `rate` per second for `seconds` (or `closed` clients in a closed loop of
    batch requests), then until everything admitted is done."""
    cfg = CONFIGS[name]
    rng = random.Random(seed)
    engines = [
        Engine(PROFILES["h100-7b"], speed=s, seed=seed * 10 + k) for k, s in enumerate(SPEEDS)
    ]
    pool = Pool(PoolConfig(balancer=cfg["balancer"], policy=cfg["policy"]), seed)
    for _ in engines:
        pool.add_instance(SLOTS, None, bool(cfg["adaptive"]))
    reqs: dict[int, Req] = {}
    events: list[tuple[float, int, str, int]] = []
    order = 0
    end_ms = seconds * 1000

    def new(t: float, high: bool) -> None:
        nonlocal order
        order += 1
        reqs[order] = Req(order, high, rng.randint(200, 1800), rng.randint(10, 60), t)
        heapq.heappush(events, (t, order, "arrive", order))

    if closed:
        for _ in range(closed):
            new(0.0, False)
    else:
        t = 0.0
        while True:
            t += rng.expovariate(rate) * 1000
            if t >= end_ms:
                break
            new(t, rng.random() < 0.5)
    out = Result()
    seqs: dict[int, tuple[Req, Sequence]] = {}
    stepping = [False] * len(engines)
    plans: list[list[tuple[Sequence, int]]] = [[] for _ in engines]

    def step(k: int, now: float) -> None:
        nonlocal order
        if stepping[k]:
            return
        plan = engines[k].schedule()
        if plan is None:
            return
        stepping[k] = True
        plans[k] = plan[0]
        order += 1
        heapq.heappush(events, (now + engines[k].step_ms(*plan[1:]), order, "step", k))

    def start(req: Req, k: int, now: float) -> None:
        seq = Sequence(req.prompt, req.output, [])
        seq.target = seq.prompt_tokens
        engines[k].waiting.append(seq)
        seqs[id(seq)] = (req, seq)
        if req.high:
            out.per_instance_high[k] += 1
        step(k, now)

    def deliver(evs: list, now: float) -> None:  # type: ignore[type-arg]
        for e in evs:
            if e.kind == EventKind.GRANTED:
                start(reqs[e.ticket], e.instance, now)

    next_sample = 0.0
    while events:
        now, _, kind, x = heapq.heappop(events)
        ms = int(now)
        if cfg["adaptive"] and now >= next_sample:
            for k in range(len(engines)):
                out.limits[k].append(pool.instance(k, ms).concurrency_limit)
            next_sample = now + 500
            deliver(pool.tick(ms), now)
        if kind == "arrive":
            req = reqs[x]
            prio = Priority.HIGH if req.high else Priority.LOW
            deadline = int(req.arrived) + SLO_MS if (cfg["slo"] and req.high) else 0
            (out.high if req.high else out.low).append(req)
            if deadline and cfg.get("shed") and pool.attainable(prio, deadline, req.prompt, ms):
                out.shed += 1
                continue  # answered 503 slo_unattainable at once: a miss
            try:
                k = pool.submit(x, prio, ms, deadline_ms=deadline, prompt_tokens=req.prompt)
            except GatewayError:
                continue  # queue full: a miss
            if k is not None:
                start(req, k, now)
            deliver(pool.take_events(), now)
            continue
        if kind == "tick":
            deliver(pool.tick(ms), now)
            continue
        stepping[x] = False
        work = plans[x]
        engines[x].apply(work)
        for seq, _ in work:
            got = seqs.get(id(seq))
            if got is None:
                continue
            req, _ = got
            if seq.produced >= 1 and req.first == math.inf:
                req.first = now
                if req.high:  # a stream: the gateway sees its first token
                    pool.first_token(req.ticket, ms)
            if seq.finished:
                del seqs[id(seq)]
                req.done = now
                out.completions += now <= end_ms
                deliver(pool.release(req.ticket, Outcome.SUCCESS, ms, 0, seq.produced), now)
                if closed and now < end_ms:
                    new(now, False)
        step(x, now)
        wake = pool.next_wakeup(ms)
        if wake is not None and wake > ms:
            order += 1
            heapq.heappush(events, (float(wake), order, "tick", 0))
    return out


def pct(values: list[float], q: float) -> float:
    v = sorted(values)
    return v[min(len(v) - 1, max(0, math.ceil(q * len(v)) - 1))] if v else math.nan


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--loads", default="1,1.5,2")
    ap.add_argument("--seeds", default="1,2,3")
    ap.add_argument("--configs", default="a,s,b,d,c")
    args = ap.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    cap = simulate("a", 0, args.seconds, seeds[0], closed=int(1.5 * SLOTS * len(SPEEDS)))
    capacity = cap.completions / args.seconds
    print(f"capacity (a, closed loop, {args.seconds:.0f} s): {capacity:.1f} requests/s")
    for load in (float(x) for x in args.loads.split(",")):
        for name in args.configs.split(","):
            rows = []
            for seed in seeds:
                r = simulate(name, load * capacity, args.seconds, seed)
                ttft = [q.first - q.arrived for q in r.high]
                good = sum(1 for t in ttft if t <= SLO_MS) / max(1, len(ttft))
                batch = sum(1 for q in r.low if q.done <= args.seconds * 1000) / args.seconds
                answered = [t for t in ttft if t != math.inf]
                rows.append((good, batch, pct(answered, 0.5), pct(ttft, 0.99), r))
            n = len(rows)
            good = sum(x[0] for x in rows) / n
            batch = sum(x[1] for x in rows) / n
            p50 = sum(x[2] for x in rows) / n
            p99 = [x[3] for x in rows]
            split = rows[0][4].per_instance_high
            shed = sum(x[4].shed for x in rows) / n
            limits = rows[0][4].limits
            lim = (
                " · limits (seed 1, median of samples) "
                + "/".join(str(int(pct([float(v) for v in ls], 0.5))) for ls in limits)
                if limits[0]
                else ""
            )
            print(
                f"{load:.1f}x ({name}) realtime goodput {good:.2f} · batch {batch:.1f}/s · "
                f"realtime TTFT p50 {p50:.0f} ms, p99 "
                + "/".join("inf" if v == math.inf else f"{v:.0f}" for v in p99)
                + f" ms · realtime fast/slow {split[0]}/{split[1]}{lim}"
                + (f" · shed {shed:.0f}" if shed else "")
            )


if __name__ == "__main__":
    main()
