"""Policy benchmark: the four balancers on mixed jobs, and weighted vs strict at 3× overload.

All in this process, on one event loop and 127.0.0.1: simulated backends (`MockServer`), the
gateway (`Gateway`, configured from YAML) and an open-loop, seeded Poisson load generator, so
every policy sees the same arrival times and job sizes. Job lengths are scaled by `--scale`
(default 1/20: a 2 s answer takes 100 ms, a 30 s one 1.5 s). A job's length belongs to the
request, not the instance: it asks for `max_tokens` tokens, which the mock generates at a
fixed pace (`tokens_per_s`).

1. Balancers: one gateway, four pools (least_connections, round_robin, random, p2c) of
   4 instances × 4 slots, sent the same jobs at the same moments: 4 in 5 short (~2 s), 1 in 5
   long (~30 s), at 75 % of capacity. Per balancer: end-to-end latency and queue wait
   (X-Gateway-Queue-Ms) p50/p99, service time over full-speed length ("stretch"), and the
   spread of load over the instances (requests, busy time, in-flight gap). Run (A) with
   fixed-speed backends and (B) with load-sensitive ones: a generation that starts next to n
   others is paced at 1/(1 + 0.2·n) of full speed (a crude batching model), at 75 % of the
   capacity left when every slot is busy.
2. Priority: two gateways, `weighted` (7:3) and `strict`, each one pool of 2 × 4 slots, sent
   the same high and low arrivals, each class at 1.5× capacity (3× in all) for a window, then
   drained. Queues hold 1000 high / 2000 low (scheduling, not rejection); the starvation guard
   has its defaults. Per class: wait p50/p99/max and requests not answered 200; per policy:
   the split of grants made while both classes waited (per grant, from the access log, as the
   demo does) and forced low grants (`/admin/state` counters, sampled every 200 ms).

    .venv/bin/python benches/policies.py [--seed 1] [--quick] [--scale 0.05] [--report PATH]

About 2.5 minutes by default (proportional to --scale), ~40 s with --quick. Prints tables and
writes an HTML report (default policies-report.html). Not a pytest test.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import sys
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

import aiohttp
import orjson
import uvloop

from _harness import serving
from gateway import __version__
from gateway.app import Gateway
from gateway.sim import report
from gateway.sim.analysis import (
    Wait,
    answered_waits,
    both_waiting,
    contended_grants,
    grant_buckets,
)
from gateway.sim.mock import MockBehavior, MockServer
from gateway.sim.report import fmt_ms, percentile
from gateway.sim.run import LogCapture, Snapshot, snapshot_of
from gateway.sim.summary import CLASS_COLOR

BALANCERS: Final = ("least_connections", "round_robin", "random", "p2c")
SHORT: Final = {"least_connections": "lc", "round_robin": "rr", "random": "random", "p2c": "p2c"}
BALANCER_COLOR: Final = dict(
    zip(BALANCERS, ("#0072B2", "#D55E00", "#009E73", "#CC79A7"), strict=True)
)
POLICIES: Final = ("weighted", "strict")

SIM_TPS: Final = 10.0  # simulated tokens per second: a 30 s job asks for 300 tokens
SHORT_S, LONG_S, LONG_SHARE, JITTER = 2.0, 30.0, 0.2, 0.25  # lengths ± 25 %
MEAN_JOB_S: Final = (1 - LONG_SHARE) * SHORT_S + LONG_SHARE * LONG_S  # 7.6 s
INSTANCES, SLOTS, LOAD = 4, 4, 0.75  # the balancer pools
SLOWDOWN: Final = 0.2  # (B) pace ÷ (1 + SLOWDOWN × others in flight on the instance)
PRIO_INSTANCES, OVERLOAD = 2, 1.5  # the priority pool; each class arrives at 1.5× capacity
PROMPT: Final = "Explain why this submission exceeds the time limit."


@dataclass(frozen=True, slots=True)
class Options:
    seed: int = 1
    quick: bool = False
    scale: float = 0.05  # wall seconds per simulated second
    report: str = "policies-report.html"

    @property
    def windows(self) -> tuple[float, float]:
        """Simulated seconds of arrivals: (each balancer run, the priority run)."""
        return (200.0, 100.0) if self.quick else (1000.0, 300.0)


@dataclass(frozen=True, slots=True)
class Job:
    at: float  # wall seconds from the start of the phase
    cls: str  # high | low
    long: bool
    tokens: int  # max_tokens
    length: float  # the wall seconds the mock takes to generate them at full speed


@dataclass(slots=True)
class Sample:
    job: Job
    sent: float
    done: float | None = None
    status: int = 0
    queue_ms: float | None = None
    instance: str | None = None

    @property
    def e2e_ms(self) -> float | None:
        return None if self.done is None or self.status != 200 else (self.done - self.sent) * 1000

    @property
    def service_ms(self) -> float | None:  # end-to-end minus queue wait
        e2e = self.e2e_ms
        return None if e2e is None or self.queue_ms is None else e2e - self.queue_ms


def plan(rng: random.Random, rate: float, window: float, scale: float, cls: str) -> list[Job]:
    """Poisson arrivals at `rate` per simulated second for `window` simulated seconds."""
    jobs, t = [], 0.0
    while (t := t + rng.expovariate(rate)) < window:
        long = rng.random() < LONG_SHARE
        length = (LONG_S if long else SHORT_S) * rng.uniform(1 - JITTER, 1 + JITTER)
        # The mock waits (tokens - 1) / tokens_per_s: one token more than the length asks.
        tokens = round(length * SIM_TPS) + 1
        jobs.append(Job(t * scale, cls, long, tokens, (tokens - 1) / SIM_TPS * scale))
    return jobs


# ---- backends and gateways ---------------------------------------------------------------------


class LoadSensitiveMock(MockServer):
    """(B) A mock whose pace falls with its own load: a generation that starts while n others
    run on this instance is paced at tokens_per_s / (1 + SLOWDOWN·n) for its whole length."""

    def __init__(self, behavior: MockBehavior) -> None:
        super().__init__(behavior)
        self.full_speed = behavior

    def before_generation(self) -> None:
        pace = self.full_speed.tokens_per_s / (1 + SLOWDOWN * self.stats.in_flight)
        self.configure(tokens_per_s=pace)


def config_yaml(policy: str, pools: dict[str, tuple[str, list[str]]], seed: int) -> str:
    """`pools`: name → (balancer, instance URLs); each pool is served as the alias `name`."""
    out = [
        "listen: {host: 127.0.0.1, port: 0}",
        "scheduler:",
        f"  policy: {policy}",
        "  high: {capacity: 1000, weight: 7, max_wait_ms: 600000}",
        "  low: {capacity: 2000, weight: 3, max_wait_ms: 600000}",
        "  max_consecutive_high: 20",
        "  max_low_wait_ms: 5000",
        "timeouts: {connect_ms: 1000, first_byte_ms: 600000, total_ms: 600000}",
        f"seed: {seed}",
        "pools:",
    ]
    for name, (balancer, urls) in pools.items():
        out += [f"  {name}:", f"    balancer: {balancer}", "    instances:"]
        out += [
            f'      - {{name: {name}-{i}, url: "{u}", model: m, max_concurrency: {SLOTS}}}'
            for i, u in enumerate(urls, 1)
        ]
    out.append("models:")
    out += [f"  {name}: {{pool: {name}}}" for name in pools]
    return "\n".join(out) + "\n"


@contextlib.asynccontextmanager
async def mocks(n: int, scale: float, sensitive: bool = False) -> AsyncIterator[list[MockServer]]:
    b = MockBehavior(model="m", tokens_per_s=SIM_TPS / scale, log_size=0)
    servers = [LoadSensitiveMock(b) if sensitive else MockServer(b) for _ in range(n)]
    try:
        for m in servers:
            await m.start()
        yield servers
    finally:
        for m in servers:
            await m.stop()


# ---- the load generator --------------------------------------------------------------------


@dataclass(slots=True)
class Target:
    """One policy under test: where its requests go and what came back."""

    name: str
    base: str
    model: str
    samples: list[Sample] = field(default_factory=list)


@dataclass(slots=True)
class Phase:
    """What one phase observed; times are seconds from its start."""

    targets: dict[str, Target]
    snapshots: dict[str, list[Snapshot]]  # per gateway
    capture: LogCapture
    end: float = 0.0
    unfinished: int = 0
    config: str = ""


async def send(session: aiohttp.ClientSession, target: Target, sample: Sample, t0: float) -> None:
    loop = asyncio.get_running_loop()
    body = {
        "model": target.model,
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": sample.job.tokens,
    }
    headers = {"Content-Type": "application/json", "X-Priority": sample.job.cls}
    try:
        url = target.base + "/v1/chat/completions"
        async with session.post(url, data=orjson.dumps(body), headers=headers) as resp:
            await resp.read()
            sample.done = loop.time() - t0
            sample.status = resp.status
            queue_ms = resp.headers.get("X-Gateway-Queue-Ms")
            sample.queue_ms = float(queue_ms) if queue_ms else None
            sample.instance = resp.headers.get("X-Gateway-Instance")
    except (aiohttp.ClientError, OSError):
        sample.status = -1  # no answer


async def drive(
    targets: Sequence[Target],
    gateways: dict[str, Gateway],
    jobs: Sequence[Job],
    drain_s: float,
    label: str,
) -> Phase:
    """Sends every job to every target at its time (open loop), samples each gateway's state
    every 200 ms, then waits at most `drain_s` for the answers still owed."""
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    phase = Phase({t.name: t for t in targets}, {g: [] for g in gateways}, LogCapture(time.time()))
    finished = asyncio.Event()

    async def sampler() -> None:
        while True:
            for name, gw in gateways.items():
                phase.snapshots[name].append(snapshot_of(loop.time() - t0, gw.admin.state()))
            if finished.is_set():
                return
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(finished.wait(), 0.2)

    pending: set[asyncio.Task[None]] = set()
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=None)
    # The gateways' RequestFinished events give each request's wait, for the grant shares.
    unsubscribe = [gw.events.subscribe(phase.capture.on_event) for gw in gateways.values()]
    try:
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
            sampling = asyncio.create_task(sampler())
            for job in jobs:
                if (delay := t0 + job.at - loop.time()) > 0:
                    await asyncio.sleep(delay)
                for target in targets:
                    sample = Sample(job, loop.time() - t0)
                    target.samples.append(sample)
                    task = asyncio.create_task(send(session, target, sample, t0))
                    pending.add(task)
                    task.add_done_callback(pending.discard)
            sent_at = loop.time() - t0
            print(f"  {label}: {len(jobs)} arrivals sent in {sent_at:.0f} s, draining", flush=True)
            if pending:
                await asyncio.wait(set(pending), timeout=drain_s)
            phase.unfinished = len(pending)
            for task in list(pending):
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
            phase.end = loop.time() - t0
            finished.set()
            await sampling
    finally:
        for stop in unsubscribe:
            stop()
    return phase


# ---- the two benchmarks -------------------------------------------------------------------------


async def balancers(o: Options, sensitive: bool) -> tuple[Phase, float]:
    """(phase, arrival rate per simulated second)."""
    capacity = INSTANCES * SLOTS / MEAN_JOB_S
    if sensitive:  # the capacity left when every slot is busy
        capacity /= 1 + SLOWDOWN * (SLOTS - 1)
    rate = LOAD * capacity
    jobs = plan(random.Random(o.seed), rate, o.windows[0], o.scale, "high")
    n = INSTANCES * len(BALANCERS)
    async with mocks(n, o.scale, sensitive) as servers:
        pools = {
            SHORT[b]: (b, [m.url for m in servers[k * INSTANCES : (k + 1) * INSTANCES]])
            for k, b in enumerate(BALANCERS)
        }
        text = config_yaml("weighted", pools, o.seed)
        async with serving(text, "policies bench") as (gw, base):
            targets = [Target(b, base, SHORT[b]) for b in BALANCERS]
            label = "B load-sensitive" if sensitive else "A fixed-speed"
            phase = await drive(targets, {"gw": gw}, jobs, 200 * o.scale, label)
    phase.config = text
    return phase, rate


async def priority(o: Options) -> Phase:
    capacity = PRIO_INSTANCES * SLOTS / MEAN_JOB_S
    rng = random.Random(o.seed + 1)
    jobs = plan(rng, OVERLOAD * capacity, o.windows[1], o.scale, "high")
    jobs += plan(rng, OVERLOAD * capacity, o.windows[1], o.scale, "low")
    jobs.sort(key=lambda j: j.at)
    texts = []
    async with contextlib.AsyncExitStack() as stack:
        gws: dict[str, Gateway] = {}
        targets = []
        for policy in POLICIES:
            servers = await stack.enter_async_context(mocks(PRIO_INSTANCES, o.scale))
            pool = {policy: ("least_connections", [m.url for m in servers])}
            texts.append(config_yaml(policy, pool, o.seed))
            gws[policy], base = await stack.enter_async_context(
                serving(texts[-1], "policies bench")
            )
            targets.append(Target(policy, base, policy))
        drain = o.windows[1] * OVERLOAD * 4 * o.scale
        phase = await drive(targets, gws, jobs, drain, "priority")
    phase.config = "\n".join(texts)
    return phase


# ---- analysis ------------------------------------------------------------------------------------


def waits_of(capture: LogCapture, pool: str) -> list[Wait]:
    """Each queued request's wait in `pool`, from the gateway's events (as `gateway demo`
    computes it: `gateway.sim.analysis.answered_waits`)."""
    waits = answered_waits(capture.answered.values(), capture.wall_start)
    return [w for w in waits if w.pool == pool]


def _p(values: Sequence[float], q: float) -> str:
    return fmt_ms(percentile(values, q))


def _e2e(samples: Sequence[Sample]) -> list[float]:
    return [e for x in samples if (e := x.e2e_ms) is not None]


def _waits(samples: Sequence[Sample]) -> list[float]:
    return [x.queue_ms for x in samples if x.status == 200 and x.queue_ms is not None]


def spread(samples: Sequence[Sample], pool: str) -> tuple[list[int], list[float]]:
    """Requests and busy seconds (end-to-end minus queue wait) per instance of `pool`."""
    names = [f"{pool}-{i}" for i in range(1, INSTANCES + 1)]
    count, busy = dict.fromkeys(names, 0), dict.fromkeys(names, 0.0)
    for x in samples:
        if x.instance in count and (service := x.service_ms) is not None:
            count[x.instance] += 1
            busy[x.instance] += service / 1000
    return list(count.values()), list(busy.values())


def stretch(samples: Sequence[Sample]) -> float:
    """Mean service time (end-to-end minus queue wait) over the job's full-speed length."""
    r = [s / 1000 / x.job.length for x in samples if (s := x.service_ms) is not None]
    return sum(r) / len(r) if r else 0.0


def inflight_spread(snapshots: Sequence[Snapshot], pool: str) -> float:
    """Mean over the state samples (of a busy pool) of max − min in flight per instance."""
    gaps = [
        max(f) - min(f)
        for s in snapshots
        if sum(f := [i.in_flight for i in s.instances if i.pool == pool])
    ]
    return sum(gaps) / len(gaps) if gaps else 0.0


def balancer_table(phase: Phase, title: str) -> list[str]:
    lines = [
        title,
        f"  {'balancer':<18}{'ok':>6}{'e2e p50':>9}{'e2e p99':>9}{'short p99':>10}"
        f"{'wait p50':>10}{'wait p99':>10}{'stretch':>9}{'req max/min':>13}{'busy max/min':>13}"
        f"{'in-flight gap':>14}",
    ]
    for name, t in phase.targets.items():
        counts, busy = spread(t.samples, SHORT[name])
        e2e, waits = _e2e(t.samples), _waits(t.samples)
        shorts = _e2e([x for x in t.samples if not x.job.long])
        ratio = f"{max(busy) / min(busy):.2f}×" if min(busy) > 0 else "-"
        gap = inflight_spread(phase.snapshots["gw"], SHORT[name])
        lines.append(
            f"  {name:<18}{len(e2e):>6}{_p(e2e, 50):>9}{_p(e2e, 99):>9}{_p(shorts, 99):>10}"
            f"{_p(waits, 50):>10}{_p(waits, 99):>10}{stretch(t.samples):>8.2f}×"
            f"{max(counts) / max(min(counts), 1):>12.2f}×{ratio:>13}{gap:>14.2f}"
        )
    if phase.unfinished:
        lines.append(f"  ({phase.unfinished} requests unanswered at the drain limit)")
    return lines


def priority_table(phase: Phase) -> list[str]:
    lines = [
        f"  {'policy':<9}{'class':<6}{'sent':>6}{'ok':>6}{'not ok':>9}{'wait p50':>10}"
        f"{'wait p99':>10}{'wait max':>10}{'grants while both waited':>26}{'forced low':>12}"
    ]
    for policy, t in phase.targets.items():
        h, lo = contended_grants(waits_of(phase.capture, policy), policy)
        snaps = phase.snapshots[policy]
        forced = snaps[-1].pools[policy].forced_low if snaps else 0
        for cls, n in (("high", h), ("low", lo)):
            mine = [x for x in t.samples if x.job.cls == cls]
            waits = _waits(mine)
            failed = sum(1 for x in mine if x.status != 200)
            share = f"{n} ({n / (h + lo):.0%})" if h + lo else "-"
            lines.append(
                f"  {policy if cls == 'high' else '':<9}{cls:<6}{len(mine):>6}{len(waits):>6}"
                f"{failed:>9}{_p(waits, 50):>10}{_p(waits, 99):>10}{_p(waits, 100):>10}"
                f"{share:>26}{forced if cls == 'low' else '':>12}"
            )
        last = max((x.done for x in t.samples if x.done is not None), default=0.0)
        lines.append(f"  {'':<15}(last answer at {last:.1f} s)")
    if phase.unfinished:
        lines.append(f"  ({phase.unfinished} requests unanswered at the drain limit)")
    return lines


def summarize(o: Options, a: Phase, b: Phase, rates: tuple[float, float], p: Phase) -> str:
    per_s = 1 / o.scale
    lines = [
        f"policy benchmark · seed {o.seed} · scale 1/{per_s:g} (a 2 s job takes "
        f"{SHORT_S * o.scale * 1000:.0f} ms, a 30 s one {LONG_S * o.scale:g} s) · "
        "times below are measured, i.e. scaled",
        "",
        f"1. balancers: {INSTANCES} instances × {SLOTS} slots per pool, {1 - LONG_SHARE:.0%} "
        f"short / {LONG_SHARE:.0%} long jobs, Poisson at {LOAD:.0%} of capacity, "
        f"{len(a.targets['p2c'].samples)} + {len(b.targets['p2c'].samples)} jobs",
    ]
    lines += balancer_table(a, f"A. fixed-speed backends, {rates[0] * per_s:.1f} arrivals/s")
    lines += balancer_table(
        b,
        f"B. load-sensitive backends (pace ÷ (1 + {SLOWDOWN:g}·others in flight)), "
        f"{rates[1] * per_s:.1f} arrivals/s",
    )
    cap = PRIO_INSTANCES * SLOTS / MEAN_JOB_S * per_s
    lines += [
        "",
        f"2. priority at 3× overload: one pool of {PRIO_INSTANCES} × {SLOTS} slots (capacity "
        f"≈ {cap:.1f}/s), high and low each at {OVERLOAD * cap:.1f}/s for "
        f"{o.windows[1] * o.scale:g} s, then drain",
    ]
    lines += priority_table(p)
    return "\n".join(lines) + "\n"


# ---- the report ----------------------------------------------------------------------------------


def balancer_charts(a: Phase, b: Phase) -> list[tuple[str, str]]:
    captions = (
        "The share of requests (y) answered within x. The four curves lie on top of each "
        "other: every balancer picks only among instances with a free slot and the gateway "
        "queues centrally, so a slot is granted at the same moment whichever instance owns it, "
        "and a fixed-speed backend then takes the same time. Only which instance served which "
        "request differs (the table's spread columns).",
        "Here an instance slows as it fills up, so where a request lands changes how long it "
        "takes: a balancer that keeps the instances evenly filled keeps every request closer "
        "to full speed. Few requests queue at this load; the difference is in service time.",
    )
    figures = []
    for phase, tag, caption in zip(
        (a, b), ("A, fixed", "B, load-sensitive"), captions, strict=True
    ):
        es = {n: _e2e(t.samples) for n, t in phase.targets.items()}
        groups = [
            (f"{n}: p50 {_p(e, 50)}, p99 {_p(e, 99)}", e, BALANCER_COLOR[n]) for n, e in es.items()
        ]
        title = f"End-to-end latency per balancer ({tag} backends)"
        svg = report.cdf_chart(title, groups, x_label="client-measured latency (log)", floor=50.0)
        figures.append((svg, caption))
    return figures


def priority_charts(p: Phase, window: float) -> list[tuple[str, str]]:
    figures = []
    x_range = (0.0, max(p.end, 1.0))
    end = [report.Marker(window, "arrivals end", "#777")]
    for policy in POLICIES:
        snaps = p.snapshots[policy]
        starts, high, low, forced = grant_buckets(snaps, policy)
        h, lo = contended_grants(waits_of(p.capture, policy), policy)
        layers = [
            report.Bars("high", high, CLASS_COLOR["high"]),
            report.Bars("low (by turn)", low, CLASS_COLOR["low"]),
            report.Bars(
                f"low forced by the guard ({sum(forced):.0f})", forced, CLASS_COLOR["forced"]
            ),
        ]
        svg = report.bar_chart(
            f"Grants per second by class — {policy}",
            starts,
            layers,
            x_label="seconds since start",
            y_label="slots granted per second",
            x_range=x_range,
            x_fmt=report.fmt_seconds,
            spans=both_waiting(snaps, policy),
            markers=end,
        )
        share = f"{h / (h + lo):.0%} : {lo / (h + lo):.0%}" if h + lo else "n/a"
        caption = (
            f"Slot grants per second under the {policy} policy, from the state's counters "
            "(sampled every 200 ms). Shaded: both queues were waiting, so the policy chose; "
            f"there the split was {share} (high : low, counted per grant from the access log)."
        )
        figures.append((svg, caption))
    series = [
        report.Series(
            f"{policy} {cls}",
            [(s.t, float(getattr(s.pools[policy], f"queued_{cls}"))) for s in p.snapshots[policy]],
            CLASS_COLOR[cls],
            dashed=policy == "strict",
        )
        for policy in POLICIES
        for cls in ("high", "low")
    ]
    depth = report.line_chart(
        "Queue depth per class (weighted solid, strict dashed)",
        series,
        x_label="seconds since start",
        y_label="requests waiting",
        x_range=x_range,
        x_fmt=report.fmt_seconds,
        markers=end,
        height=260,
    )
    figures.append((depth, "Requests waiting per class; after the arrivals end the pool drains."))
    cdfs = []
    for policy in POLICIES:
        for cls in ("high", "low"):
            w = _waits([x for x in p.targets[policy].samples if x.job.cls == cls])
            label = f"{policy} {cls}: p50 {_p(w, 50)}, p99 {_p(w, 99)}"
            pts = [(v / 1000, y) for v, y in report.cdf_points(w)]
            cdfs.append(report.Series(label, pts, CLASS_COLOR[cls], policy == "strict", True))
    cdf = report.line_chart(
        "Queue wait per class and policy (CDF; weighted solid, strict dashed)",
        cdfs,
        x_label="X-Gateway-Queue-Ms, in seconds",
        y_label="% of requests ≤ x",
        y_range=(0.0, 100.0),
        x_fmt=report.fmt_seconds,
        y_fmt=lambda v: f"{v:g}%",
    )
    caption = (
        "The share of each class's requests that waited at most x. Each class alone arrives "
        "faster than the pool serves, so both queues grow through the window. Both policies "
        "are work-conserving: the backlog ends at the same moment under either; the policy "
        "decides who waits meanwhile: weighted serves some early low arrivals at high's expense."
    )
    figures.append((cdf, caption))
    return figures


def render(o: Options, summary: str, a: Phase, b: Phase, p: Phase) -> str:
    intro = (
        "(1) Do the balancers differ when LLM jobs of very different lengths share a pool? "
        "(2) How do the weighted (7:3) and strict policies split a pool between high and low "
        "when both arrive faster than the pool serves? Simulated backends, job lengths scaled "
        f"by {o.scale:g}; every policy received the same requests at the same moments."
    )
    sections = [
        ("Balancers on mixed jobs", balancer_charts(a, b)),
        ("Priority at 3× overload", priority_charts(p, o.windows[1] * o.scale)),
    ]
    return report.page(
        "gateway policy benchmark",
        intro,
        sections,
        appendix=[
            ("Summary", summary),
            ("Configuration (balancers)", a.config),
            ("Configuration (priority)", p.config),
        ],
        meta=f"gateway {__version__} · {time.strftime('%Y-%m-%d %H:%M:%S')} · seed {o.seed}",
    )


async def run(o: Options) -> tuple[str, str]:
    """Runs both benchmarks: (the plain-text summary, the HTML report)."""
    print(f"policy benchmark (seed {o.seed}, scale {o.scale:g}{', quick' if o.quick else ''})")
    a, rate_a = await balancers(o, sensitive=False)
    b, rate_b = await balancers(o, sensitive=True)
    p = await priority(o)
    summary = summarize(o, a, b, (rate_a, rate_b), p)
    return summary, render(o, summary, a, b, p)


def main(argv: Sequence[str] | None = None) -> int:
    o = parse_args(argv)
    wall0 = time.monotonic()
    summary, html = uvloop.run(run(o))
    print("\n" + summary)
    path = Path(o.report)
    path.write_text(html, encoding="utf-8")
    print(f"report: {path.resolve()}\nwall time {time.monotonic() - wall0:.0f} s")
    return 0


def parse_args(argv: Sequence[str] | None = None) -> Options:
    parser = argparse.ArgumentParser(description="Balancers and priority policies, measured.")
    add, d = parser.add_argument, Options()
    add("--seed", type=int, default=d.seed, help="seeds arrivals and job sizes")
    add("--quick", action="store_true", help="short windows (~40 s in all)")
    add("--scale", type=float, default=d.scale, help="wall s per simulated s (run time ∝ it)")
    add("--report", default=d.report, metavar="PATH", help="HTML report (default %(default)s)")
    args = parser.parse_args(argv)
    if not 0 < args.scale <= 1:
        parser.error("--scale must be within (0, 1]")
    return Options(seed=args.seed, quick=args.quick, scale=args.scale, report=args.report)


if __name__ == "__main__":
    sys.exit(main())
