"""How good the core's latency model is (SPEC §17 "Prediction"), on the engine mock, in virtual
time.

Two instances of `gateway.sim.engine.Engine` (the `gateway mock --engine` step loop, h100-7b;
one at speed 1, one 3x slower) are stepped in virtual milliseconds — no event loop, HTTP or
machine load in the numbers — behind one `gateway._core.Pool` with `balancer: predicted`. Open
Poisson arrivals at a share of the pair's capacity, prompts 200-3000 tokens, answers 20-300
tokens. Every request is a stream: the core is told its first token (`first_token`) and its
end with its output tokens (`release`), exactly as the gateway tells it.

For every request granted to an instance whose model was calibrated, the p90 TTFT and TPOT the
core predicted for it there just before the grant (for a queued one: just before the release
that granted it) are kept beside what it then took. Printed per load: the share
of requests within their predicted p90 (coverage: 0.9 is exact), percentiles of the ratio
actual / predicted-p90, the models' own mean absolute errors (scored before each sample was
learnt) and how the grants split between the instances.

    .venv/bin/python benches/latency_model.py [--seconds 120] [--loads 0.3,0.6,0.9] [--seed 1]
"""

from __future__ import annotations

import argparse
import heapq
import math
import random
from dataclasses import dataclass, field

from gateway._core import Balancer, EventKind, Outcome, Pool, PoolConfig, Priority
from gateway.sim.engine import CHARS_PER_TOKEN, PROFILES, Engine, Sequence

SPEEDS = (1.0, 1.0 / 3.0)


@dataclass
class Request:
    ticket: int
    prompt: int
    output: int
    arrived: float
    instance: int = -1
    granted: float = 0.0
    first: float = 0.0
    seq: Sequence | None = None
    predicted: tuple[float, float] | None = None  # p90 TTFT, p90 TPOT at the grant


@dataclass
class Run:
    ttft: list[tuple[float, float]] = field(default_factory=list)  # (actual, predicted p90)
    tpot: list[tuple[float, float]] = field(default_factory=list)
    per_instance: list[int] = field(default_factory=lambda: [0] * len(SPEEDS))
    mae: list[tuple[float, float, float, bool]] = field(default_factory=list)


def submit_to(engine: Engine, req: Request) -> Sequence:
    """`Engine.submit` without its asyncio loop (this driver steps the engine itself)."""
    text = f"{req.ticket}:" + "x" * (req.prompt * CHARS_PER_TOKEN)
    seq = Sequence(req.prompt, req.output, [])  # unique prompts: no prefix cache hits
    del text
    seq.target = seq.prompt_tokens
    engine.waiting.append(seq)
    return seq


def run(load: float, seconds: float, seed: int) -> Run:
    rng = random.Random(seed)
    engines = [
        Engine(PROFILES["h100-7b"], speed=s, seed=seed * 10 + k) for k, s in enumerate(SPEEDS)
    ]
    pool = Pool(PoolConfig(balancer=Balancer.PREDICTED), seed)
    for _ in engines:
        pool.add_instance(32)
    # 1x: about what the pair completes when saturated. A mean request (1,600 prompt tokens,
    # 160 out) costs the fast engine ~56 ms of prefill and a share of ~160 decode steps of
    # ~9 ms at 32 running: ~14 requests a second, the slow one a third of that.
    capacity = 14.0 * sum(SPEEDS)
    reqs: dict[int, Request] = {}
    events: list[tuple[float, int, str, int]] = []  # (time ms, order, kind, ticket/instance)
    order = 0
    t = 0.0
    while t < seconds * 1000:
        t += rng.expovariate(load * capacity) * 1000
        order += 1
        reqs[order] = Request(order, rng.randint(200, 3000), rng.randint(20, 300), t)
        heapq.heappush(events, (t, order, "arrive", order))
    stepping = [False] * len(engines)
    waiting: list[int] = []  # queued tickets, in arrival order (FIFO: no objectives)
    out = Run()
    by_seq: dict[int, Request] = {}

    def start(req: Request, k: int, now: float) -> None:
        req.instance, req.granted = k, now
        req.seq = submit_to(engines[k], req)
        by_seq[id(req.seq)] = req
        out.per_instance[k] += 1
        step(k, now)

    def step(k: int, now: float) -> None:
        nonlocal order
        if stepping[k]:
            return
        plan = engines[k].schedule()
        if plan is None:
            return
        stepping[k] = True
        order += 1
        ms = engines[k].step_ms(*plan[1:])
        heapq.heappush(events, (now + ms, order, "step", k))
        plans[k] = plan[0]

    plans: list[list[tuple[Sequence, int]]] = [[] for _ in engines]

    def predictions(req_prompt: int, ms: int) -> list[tuple[float, float] | None]:
        """Each instance's p90 TTFT and TPOT for a request now (None where its model is not
        calibrated: only calibrated predictions are judged)."""
        return [
            pool.predict(k, req_prompt, ms) if pool.instance(k, ms).calibrated else None
            for k in range(len(engines))
        ]

    def deliver(evs: list, now: float, before: dict[int, list[tuple[float, float] | None]]) -> None:  # type: ignore[type-arg]
        for e in evs:
            if e.kind == EventKind.GRANTED:
                req = reqs[e.ticket]
                got = before.get(e.ticket)
                if got is not None:
                    req.predicted = got[e.instance]
                start(req, e.instance, now)

    while events:
        now, _, kind, x = heapq.heappop(events)
        ms = int(now)
        if kind == "arrive":
            req = reqs[x]
            before = predictions(req.prompt, ms)
            k = pool.submit(x, Priority.HIGH, ms, prompt_tokens=req.prompt)
            if k is not None:
                req.predicted = before[k]
                start(req, k, now)
            else:
                waiting.append(x)
            deliver(pool.take_events(), now, {})
            continue
        # a step of engine x ended
        stepping[x] = False
        work = plans[x]
        engines[x].apply(work)
        for seq, _ in work:
            req = by_seq.get(id(seq))
            if req is None:
                continue
            if seq.produced >= 1 and req.first == 0.0:
                req.first = now
                pool.first_token(req.ticket, ms)
            if seq.finished:
                del by_seq[id(seq)]
                if req.predicted is not None:
                    out.ttft.append((req.first - req.granted, req.predicted[0]))
                    if seq.produced > 1:
                        tpot = (now - req.first) / (seq.produced - 1)
                        out.tpot.append((tpot, req.predicted[1]))
                # the grants this release makes: predicted just before it (its own request
                # still counted on its instance: one running too many, conservative)
                head = {t: predictions(reqs[t].prompt, ms) for t in waiting[:4]}
                events_ = pool.release(req.ticket, Outcome.SUCCESS, ms, 0, seq.produced)
                for e in events_:
                    if e.ticket in waiting:
                        waiting.remove(e.ticket)
                deliver(events_, now, head)
        step(x, now)
    end = int(now)
    for k in range(len(engines)):
        info = pool.instance(k, end)
        out.mae.append((info.ttft_mae_ms, info.tpot_mae_ms, info.ttft_coverage, info.calibrated))
    assert (pool.in_flight, pool.waiting) == (0, 0)
    return out


def pct(values: list[float], q: float) -> float:
    v = sorted(values)
    return v[min(len(v) - 1, max(0, math.ceil(q * len(v)) - 1))] if v else math.nan


def describe(name: str, pairs: list[tuple[float, float]]) -> str:
    if not pairs:
        return f"{name}: no samples"
    ratios = [a / p for a, p in pairs if p > 0]
    covered = sum(1 for a, p in pairs if a <= p) / len(pairs)
    mape = sum(abs(a - p) / a for a, p in pairs if a > 0) / len(pairs)
    return (
        f"{name}: n={len(pairs)} coverage of p90 {covered:.2f} · actual/p90 "
        f"p10 {pct(ratios, 0.1):.2f} p50 {pct(ratios, 0.5):.2f} p90 {pct(ratios, 0.9):.2f} "
        f"p99 {pct(ratios, 0.99):.2f} · |actual-p90|/actual mean {mape:.2f}"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=120.0)
    ap.add_argument("--loads", default="0.3,0.6,0.9")
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    for load in (float(x) for x in args.loads.split(",")):
        r = run(load, args.seconds, args.seed)
        print(f"load {load:.1f}x · grants per instance (fast, 3x slower) {r.per_instance}")
        print("  " + describe("TTFT", r.ttft))
        print("  " + describe("TPOT", r.tpot))
        for k, (ttft_mae, tpot_mae, cov, cal) in enumerate(r.mae):
            print(
                f"  instance {k}: model MAE TTFT {ttft_mae:.1f} ms, TPOT {tpot_mae:.2f} ms, "
                f"TTFT coverage {cov:.2f}, calibrated {cal}"
            )


if __name__ == "__main__":
    main()
