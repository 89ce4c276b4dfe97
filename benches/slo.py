"""Latency objectives side by side (SPEC §17, issue 22): realtime goodput, batch throughput and
realtime TTFT on two heterogeneous engine mocks, under today's scheduling and under §17's.

Two `gateway mock --engine h100-7b` processes on 127.0.0.1, one fast and one 3x slower
(`--speed 0.3` and `--speed 0.1`: the engine's shapes with steps slow enough that a 2-core
machine can carry the streams through a Python gateway and client), behind a gateway in this
process (a `Server` on an ephemeral port), `max_concurrency: 16` on each instance. The load is
open loop, seeded Poisson: half realtime (`X-Priority: high`, streamed; the objective is a 2 s
TTFT) and half batch (`X-Priority: low`, not streamed), every prompt unique (no prefix-cache
hits), 200-1,800 prompt tokens and 10-60 answer tokens, the same requests at the same moments
for every configuration.

**Capacity** (1x) is measured first: closed loop through configuration (a) with 1.5 x the
pool's slots of clients busy (so the gateway's queue never empties), the pair's completions
per second of this mix over a window after a warm-up. The loads are 1x, 1.5x and 2x of it.

Configurations, each its own gateway (warmed up at 0.5x, then the loads in order, each after
the last one's leftovers were cancelled and the gateway and both engines were quiet):

- (a) `least_connections` + `weighted` 7:3 — today's defaults;
- (s) `least_connections` + `strict` — the reference for realtime p99 TTFT;
- (b) `balancer: predicted` + deadline order (`scheduler.high.slo_ttft_ms: 2000`);
- (c) (b) + `max_concurrency: {max: 16, adaptive: true}` on both instances.

Per configuration and load: realtime goodput (offered realtime requests whose first content
token came within 2 s of sending; shed, failed and unanswered ones are misses), batch
throughput (batch answers completed by the cut, arrivals + 3 s, per second), realtime TTFT
p50/p99 over the answered ones and p99 over all offered ones (an unanswered one counts as
infinitely late), and how the realtime requests split between the instances. For (b) and (c),
the latency model's error: each request's TTFT after its grant (client TTFT minus
`X-Gateway-Queue-Ms`) against the p90 TTFT the core predicted for its prompt on its instance at
the grant (read in this process by wrapping `Pool.acquire`: `predict()` just after the grant,
i.e. with the request itself already counted in flight — conservative by one), and each
instance's own MAE and coverage from `/admin/state`. For (c), each instance's adaptive
`concurrency_limit` over the run (sampled from `/admin/state` every 0.5 s).

    .venv/bin/python benches/slo.py             # ~5 min
    .venv/bin/python benches/slo.py --quick     # ~2 min smoke run (short cells)
    .venv/bin/python benches/slo.py --seed 2 --duration 20 --configs a,b
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import random
import string
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final

import aiohttp
import orjson

from _harness import PY, Processes, free_port, serving, wait_port
from gateway.scheduler import now_ms

if TYPE_CHECKING:
    from gateway.app import Gateway

FAST_SPEED: Final = 0.3
SLOW_SPEED: Final = 0.1  # 3x slower
SLOTS: Final = 16  # max_concurrency per instance (today's operator's guess)
RT_SHARE: Final = 0.5
TTFT_SLO_MS: Final = 2000
PROMPT_TOKENS: Final = (200, 1800)
OUTPUT_TOKENS: Final = (10, 60)
GRACE_S: Final = 3.0  # after the last arrival, answers may still come this long (> the SLO)
SAMPLE_S: Final = 0.5
WARM_LOAD: Final = 0.7

# name: (label, balancer, policy, objective, adaptive, shed_unattainable)
CONFIGS: Final = {
    "a": ("least_connections + weighted (today)", "least_connections", "weighted", 0, 0, 0),
    "s": ("least_connections + strict (reference)", "least_connections", "strict", 0, 0, 0),
    "b": ("predicted + deadlines", "predicted", "weighted", 1, 0, 0),
    "c": ("predicted + deadlines + adaptive", "predicted", "weighted", 1, 1, 0),
    # not in the default run: (b) answering unattainable objectives 503 at once
    "d": ("predicted + deadlines + shed_unattainable", "predicted", "weighted", 1, 0, 1),
}

_FILLER: Final = "".join(random.Random(0).choices(string.ascii_lowercase + " ", k=8000))


def config_text(
    urls: Sequence[str], balancer: str, policy: str, slo: int, adaptive: int, shed: int
) -> str:
    cap = f"{{max: {SLOTS}, adaptive: true}}" if adaptive else str(SLOTS)
    objective = f", slo_ttft_ms: {TTFT_SLO_MS}" if slo else ""
    names = ("fast", "slow")
    instances = "".join(
        f'      - {{name: {n}, url: "{u}", model: m, max_concurrency: {cap}, provider: vllm}}\n'
        for n, u in zip(names, urls, strict=True)
    )
    return (
        "listen: {host: 127.0.0.1, port: 0}\n"
        "scheduler:\n"
        f"  policy: {policy}\n"
        f"  high: {{capacity: 2000, weight: 7, max_wait_ms: 30000{objective}}}\n"
        "  low: {capacity: 5000, weight: 3, max_wait_ms: 600000}\n"
        f"  shed_unattainable: {'true' if shed else 'false'}\n"
        f"balancer: {balancer}\n"
        "timeouts: {connect_ms: 1000, first_byte_ms: 120000, stream_idle_ms: 60000, "
        "total_ms: 300000}\n"
        "health: {probe: {interval_ms: 1000}}\n"
        "seed: 1\n"
        "pools:\n"
        "  p:\n"
        "    instances:\n"
        f"{instances}"
        "models:\n"
        "  m: {pool: p}\n"
    )


# ---- the workload ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Job:
    at: float
    realtime: bool
    prompt_tokens: int
    max_tokens: int
    tag: str


def plan(rate: float, duration: float, seed: int, tag: str) -> list[Job]:
    """Poisson arrivals at `rate`/s for `duration` s, a function of the seed."""
    rng = random.Random(seed)
    jobs: list[Job] = []
    t = 0.0
    while True:
        t += rng.expovariate(rate)
        if t >= duration:
            return jobs
        jobs.append(
            Job(
                t,
                rng.random() < RT_SHARE,
                rng.randint(*PROMPT_TOKENS),
                rng.randint(*OUTPUT_TOKENS),
                f"{tag}-{len(jobs)}",
            )
        )


def body_of(job: Job) -> bytes:
    # Unique first characters: no prefix-cache hit (the cache hashes blocks from the start).
    head = f"[{job.tag}] Judge this submission. "
    chars = max(0, job.prompt_tokens * 4 - len(head))
    filler = (_FILLER * (chars // len(_FILLER) + 1))[:chars]
    body: dict[str, Any] = {
        "model": "m",
        "messages": [{"role": "user", "content": head + filler}],
        "max_tokens": job.max_tokens,
    }
    if job.realtime:
        body["stream"] = True
    return orjson.dumps(body)


@dataclass(slots=True)
class Rec:
    job: Job
    sent: float = 0.0
    ttft: float | None = None  # s from sending to the first content token (realtime)
    done: float | None = None  # s since the cell's start when the answer completed
    ok: bool = False
    status: int = 0
    error: str | None = None
    instance: str | None = None
    queue_ms: float | None = None
    ticket: int | None = None


async def send(
    session: aiohttp.ClientSession, url: str, rec: Rec, now: Callable[[], float]
) -> None:
    job = rec.job
    headers = {"Content-Type": "application/json", "X-Priority": "high" if job.realtime else "low"}
    rec.sent = now()
    try:
        async with session.post(url, data=body_of(job), headers=headers) as resp:
            rec.status = resp.status
            rec.instance = resp.headers.get("X-Gateway-Instance")
            with contextlib.suppress(TypeError, ValueError):
                rec.queue_ms = float(resp.headers.get("X-Gateway-Queue-Ms", ""))
            rid = resp.headers.get("X-Request-Id", "")
            digits = rid[len(rid.rstrip("0123456789")) :]
            rec.ticket = int(digits) if digits else None
            if resp.status != 200:
                raw = await resp.read()
                rec.error = _code(raw) or f"http_{resp.status}"
                rec.done = now()
                return
            if not job.realtime:
                await resp.read()
                rec.ok, rec.done = True, now()
                return
            async for line in resp.content:
                if rec.ttft is None and line.startswith(b"data: {") and b'"content"' in line:
                    chunk = orjson.loads(line[6:])
                    choices = chunk.get("choices") or []
                    if choices and (choices[0].get("delta") or {}).get("content"):
                        rec.ttft = now() - rec.sent
                elif line.startswith(b'data: {"error"'):
                    rec.error = "stream_error"
                elif line.startswith(b"data: [DONE]"):
                    rec.ok = rec.error is None
            rec.done = now()
    except asyncio.CancelledError:
        # Cut by the bench at the end of the cell: before any token, or mid-stream.
        rec.error = rec.error or ("cut mid-stream" if rec.ttft is not None else "unanswered")
        raise
    except (aiohttp.ClientError, OSError) as exc:
        rec.error = f"connection ({type(exc).__name__})"
        rec.done = now()


def _code(raw: bytes) -> str | None:
    with contextlib.suppress(orjson.JSONDecodeError, AttributeError):
        err = orjson.loads(raw).get("error") or {}
        code = err.get("code") if isinstance(err, dict) else None
        return code if isinstance(code, str) else None
    return None


# ---- running a cell ---------------------------------------------------------------------------


@dataclass(slots=True)
class Cell:
    config: str
    load: float
    rate: float
    duration: float
    recs: list[Rec]
    late_s: float  # the client's worst lateness in sending
    quiet: bool
    leftover: str
    limits: dict[str, list[int]] = field(default_factory=dict)
    in_flight: dict[str, list[int]] = field(default_factory=dict)
    predictions: list[tuple[float, float, str]] = field(default_factory=list)  # actual, p90, inst
    model: dict[str, dict[str, Any]] = field(default_factory=dict)  # /admin/state at the end


async def open_loop(
    session: aiohttp.ClientSession, url: str, jobs: Sequence[Job], duration: float
) -> tuple[list[Rec], float]:
    """Sends `jobs` at their moments; after `duration + GRACE_S` cancels what is left."""
    loop = asyncio.get_running_loop()
    t0 = loop.time()

    def now() -> float:
        return loop.time() - t0

    recs: list[Rec] = []
    tasks: list[asyncio.Task[None]] = []
    late = 0.0
    for job in jobs:
        delay = job.at - now()
        if delay > 0:
            await asyncio.sleep(delay)
        late = max(late, now() - job.at)
        rec = Rec(job)
        recs.append(rec)
        tasks.append(asyncio.create_task(send(session, url, rec, now)))
    end = duration + GRACE_S - now()
    if tasks:
        _, pending = await asyncio.wait(tasks, timeout=max(0.0, end))
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    return recs, late


async def quiet(gw: Gateway, session: aiohttp.ClientSession, mocks: Sequence[str]) -> str:
    """Waits (at most 20 s) until the gateway has nothing queued or in flight and both engines
    nothing running or waiting; '' when so, else what was left."""
    end = time.monotonic() + 20
    what = ""
    while time.monotonic() < end:
        assert gw.admin is not None
        pools = gw.admin.state()["pools"]
        queued = sum(p["queued"]["high"] + p["queued"]["low"] for p in pools.values())
        flying = sum(p["in_flight"] for p in pools.values())
        engine = 0.0
        for m in mocks:
            async with session.get(m + "/metrics") as resp:
                text = await resp.text()
            for line in text.splitlines():
                if line.startswith(("vllm:num_requests_running", "vllm:num_requests_waiting")):
                    engine += float(line.rsplit(" ", 1)[1])
        what = f"gateway queued {queued} in flight {flying}, engines {engine:g}"
        if queued == flying == 0 and engine == 0:
            return ""
        await asyncio.sleep(0.2)
    return what


def hook_predictions(gw: Gateway, out: dict[int, tuple[float, bool]]) -> None:
    """Records, per ticket, the p90 TTFT the core predicts at its grant on the granted instance
    for its prompt (and whether the model was calibrated). Measurement only."""
    for pool in gw.pools().values():
        original = pool.acquire
        core = pool._core  # the bench reads the core's model (measurement only)

        async def acquire(
            *args: Any, _original: Any = original, _core: Any = core, **kw: Any
        ) -> Any:
            got = await _original(*args, **kw)
            prompt = kw.get("prompt_tokens", args[7] if len(args) > 7 else 0)
            t = now_ms()
            out[args[0]] = (
                _core.predict(got[0], prompt, t)[0],
                _core.instance(got[0], t).calibrated,
            )
            return got

        pool.acquire = acquire  # type: ignore[method-assign]


async def sampler(gw: Gateway, cell: Cell, stop: asyncio.Event) -> None:
    while not stop.is_set():
        assert gw.admin is not None
        for p in gw.admin.state()["pools"].values():
            for i in p["instances"]:
                cell.limits.setdefault(i["name"], []).append(int(i["concurrency_limit"]))
                cell.in_flight.setdefault(i["name"], []).append(int(i["in_flight"]))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), SAMPLE_S)


async def run_config(
    key: str,
    urls: Sequence[str],
    capacity: float,
    args: argparse.Namespace,
    session: aiohttp.ClientSession,
) -> list[Cell]:
    _, *how = CONFIGS[key]
    cells: list[Cell] = []
    async with serving(config_text(urls, *how), f"slo-{key}") as (
        gw,
        base,
    ):
        url = base + "/v1/chat/completions"
        preds: dict[int, tuple[float, bool]] = {}
        hook_predictions(gw, preds)
        # Warm-up: the latency models calibrate on TTFT samples, i.e. on streams (realtime).
        warm = plan(WARM_LOAD * capacity, args.warmup, args.seed + 1000, f"{key}-warm")
        await open_loop(session, url, warm, args.warmup)
        left = await quiet(gw, session, [u.removesuffix("/v1") for u in urls])
        if left:
            print(f"  ({key} warm-up: not quiet: {left})", flush=True)
        for n, load in enumerate(args.loads):
            rate = load * capacity
            jobs = plan(rate, args.duration, args.seed * 100 + n, f"{key}-{load:g}")
            cell = Cell(key, load, rate, args.duration, [], 0.0, True, "")
            stop = asyncio.Event()
            sampling = asyncio.create_task(sampler(gw, cell, stop))
            cell.recs, cell.late_s = await open_loop(session, url, jobs, args.duration)
            stop.set()
            await sampling
            cell.leftover = await quiet(gw, session, [u.removesuffix("/v1") for u in urls])
            cell.quiet = not cell.leftover
            assert gw.admin is not None
            for p in gw.admin.state()["pools"].values():
                for i in p["instances"]:
                    cell.model[i["name"]] = i["prediction"]
            for r in cell.recs:
                if r.job.realtime and r.ttft is not None and r.ticket in preds:
                    p90, calibrated = preds[r.ticket]
                    if calibrated and r.queue_ms is not None and r.instance:
                        actual = r.ttft * 1000 - r.queue_ms
                        cell.predictions.append((actual, p90, r.instance))
            cells.append(cell)
            print("  " + row(cell), flush=True)
    return cells


async def measure_capacity(
    urls: Sequence[str], seconds: float, warmup: float, session: aiohttp.ClientSession, seed: int
) -> float:
    """Completions per second of the mix with every slot of configuration (a) busy."""
    _, *how = CONFIGS["a"]
    async with serving(config_text(urls, *how), "slo-capacity") as (
        gw,
        base,
    ):
        url = base + "/v1/chat/completions"
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        done: list[float] = []
        rng = random.Random(seed + 7)
        stop_at = warmup + seconds

        def now() -> float:
            return loop.time() - t0

        async def client(c: int) -> None:
            k = 0
            while now() < stop_at:
                job = Job(
                    0.0,
                    rng.random() < RT_SHARE,
                    rng.randint(*PROMPT_TOKENS),
                    rng.randint(*OUTPUT_TOKENS),
                    f"cap-{c}-{k}",
                )
                k += 1
                rec = Rec(job)
                await send(session, url, rec, now)
                if rec.ok and rec.done is not None:
                    done.append(rec.done)

        clients = [asyncio.create_task(client(c)) for c in range(3 * SLOTS)]
        await asyncio.sleep(stop_at)
        for t in clients:
            t.cancel()
        await asyncio.gather(*clients, return_exceptions=True)
        await quiet(gw, session, [u.removesuffix("/v1") for u in urls])
        return sum(1 for d in done if warmup <= d < stop_at) / seconds


# ---- what a cell shows ------------------------------------------------------------------------


def pct(values: Sequence[float], q: float) -> float:
    v = sorted(values)
    if not v:
        return math.nan
    return v[min(len(v) - 1, max(0, math.ceil(q / 100 * len(v)) - 1))]


def fmt_s(x: float) -> str:
    if math.isinf(x):
        return "∞"
    if math.isnan(x):
        return "-"
    return f"{x * 1000:.0f} ms" if x < 1 else f"{x:.2f} s"


@dataclass(frozen=True, slots=True)
class Numbers:
    rt_offered: int
    rt_met: int
    goodput: float
    batch_offered: int
    batch_done: int
    batch_per_s: float
    ttft_p50: float
    ttft_p99: float
    ttft_p99_offered: float
    rt_answered: int
    rt_fast: int
    rt_slow: int
    met_fast: int
    met_slow: int
    late_answered: int  # realtime answered after the objective (TTFT > 2 s)
    errors: dict[str, int]


def numbers(cell: Cell) -> Numbers:
    rt = [r for r in cell.recs if r.job.realtime]
    batch = [r for r in cell.recs if not r.job.realtime]

    def made_it(r: Rec) -> bool:
        # Its first token in time, and no failure after it (a stream still running at the
        # cut was cut by the bench, not failed).
        in_time = r.ttft is not None and r.ttft <= TTFT_SLO_MS / 1000
        return in_time and (r.ok or r.error == "cut mid-stream")

    met = sum(1 for r in rt if made_it(r))
    answered = [r.ttft for r in rt if r.ttft is not None]
    all_ttft = [r.ttft if r.ttft is not None else math.inf for r in rt]
    # Completed by the cut (arrivals + grace): the leftovers are cancelled then.
    window = cell.duration + GRACE_S
    done = sum(1 for r in batch if r.ok and r.done is not None and r.done <= window)
    errors: dict[str, int] = {}
    for r in cell.recs:
        if r.error:
            errors[r.error] = errors.get(r.error, 0) + 1
    return Numbers(
        len(rt),
        met,
        met / len(rt) if rt else math.nan,
        len(batch),
        done,
        done / window,
        pct(answered, 50),
        pct(answered, 99),
        pct(all_ttft, 99),
        len(answered),
        sum(1 for r in rt if r.instance == "fast"),
        sum(1 for r in rt if r.instance == "slow"),
        sum(1 for r in rt if r.instance == "fast" and made_it(r)),
        sum(1 for r in rt if r.instance == "slow" and made_it(r)),
        sum(1 for r in rt if r.ttft is not None and r.ttft > TTFT_SLO_MS / 1000),
        errors,
    )


def row(cell: Cell) -> str:
    n = numbers(cell)
    errs = ", ".join(f"{v} {k}" for k, v in sorted(n.errors.items())) or "none"
    limits = ""
    if cell.config == "c":
        limits = " · limit fast/slow " + " / ".join(
            f"{min(v)}-{max(v)} (median {pct(v, 50):.0f})" for v in cell.limits.values() if v
        )
    return (
        f"{cell.config} {cell.load:g}x ({cell.rate:.1f}/s): realtime goodput {n.goodput:.2f} "
        f"({n.rt_met}/{n.rt_offered}) · batch {n.batch_per_s:.2f}/s ({n.batch_done}/"
        f"{n.batch_offered}) · rt TTFT p50 {fmt_s(n.ttft_p50)} p99 {fmt_s(n.ttft_p99)} "
        f"(answered {n.rt_answered}, {n.late_answered} of them late; p99 of offered "
        f"{fmt_s(n.ttft_p99_offered)}) · rt met/sent on fast {n.met_fast}/{n.rt_fast}, slow "
        f"{n.met_slow}/{n.rt_slow} · not ok: {errs} · client late "
        f"{cell.late_s * 1000:.0f} ms" + limits + ("" if cell.quiet else f" · LEFT {cell.leftover}")
    )


def report(cells: list[Cell], capacity: float, args: argparse.Namespace) -> None:
    by = {(c.config, c.load): numbers(c) for c in cells}
    print()
    print(
        "| config | load | realtime goodput | batch completed/s | realtime TTFT p50 · p99 "
        "(answered, late) | p99 of offered | realtime met/sent on fast · slow | not ok |"
    )
    print("|---|---|---:|---:|---|---:|---|---|")
    for c in cells:
        n = by[(c.config, c.load)]
        errs = ", ".join(f"{v} {k}" for k, v in sorted(n.errors.items())) or "-"
        print(
            f"| ({c.config}) {CONFIGS[c.config][0]} | {c.load:g}× ({c.rate:.1f}/s) | "
            f"{n.goodput:.2f} ({n.rt_met}/{n.rt_offered}) | {n.batch_per_s:.2f} | "
            f"{fmt_s(n.ttft_p50)} · {fmt_s(n.ttft_p99)} ({n.rt_answered}, {n.late_answered}) | "
            f"{fmt_s(n.ttft_p99_offered)} | {n.met_fast}/{n.rt_fast} · {n.met_slow}/{n.rt_slow} | "
            f"{errs} |"
        )
    top = max(args.loads)
    today, strict = by.get(("a", top)), by.get(("s", top))
    if today is not None:
        print(f"\ngoals at {top:g}× (issue 22):")
        for key in ("b", "c", "d"):
            n = by.get((key, top))
            if n is None:
                continue
            g = n.goodput / today.goodput if today.goodput else math.inf
            b = n.batch_per_s / today.batch_per_s if today.batch_per_s else math.inf
            line = (
                f"  ({key}) goodput {g:.2f}× today's "
                f"(goal ≥ 1.3: {'met' if g >= 1.3 else 'MISSED'})"
                f" · batch {b:.2f}× (goal ≥ 0.95: {'met' if b >= 0.95 else 'MISSED'})"
            )
            if strict is not None:
                ok = n.ttft_p99 <= strict.ttft_p99
                line += (
                    f" · rt p99 TTFT {fmt_s(n.ttft_p99)} vs strict {fmt_s(strict.ttft_p99)} "
                    f"(goal ≤: {'met' if ok else 'MISSED'}; of offered {fmt_s(n.ttft_p99_offered)}"
                    f" vs {fmt_s(strict.ttft_p99_offered)})"
                )
            print(line)
    print("\nthe latency model at the grant (realtime requests, calibrated predictions):")
    for c in cells:
        if not c.predictions and c.config not in ("b", "c", "d"):
            continue
        parts = []
        for inst in ("fast", "slow"):
            pairs = [(a, p) for a, p, i in c.predictions if i == inst and p > 0]
            m = c.model.get(inst, {})
            own = (
                f"model MAE {m.get('ttft_error_ms', math.nan):.0f} ms, coverage "
                f"{m.get('ttft_coverage', math.nan):.2f}, calibrated {m.get('calibrated')}"
            )
            if not pairs:
                parts.append(f"{inst}: no calibrated grants · {own}")
                continue
            ratios = [a / p for a, p in pairs]
            covered = sum(1 for a, p in pairs if a <= p) / len(pairs)
            parts.append(
                f"{inst}: n={len(pairs)} ≤p90 {covered:.2f} actual/p90 p10 {pct(ratios, 10):.2f}"
                f" p50 {pct(ratios, 50):.2f} p90 {pct(ratios, 90):.2f} p99 "
                f"{pct(ratios, 99):.2f} · {own}"
            )
        print(f"  ({c.config}) {c.load:g}×: " + " | ".join(parts))
    limits = [c for c in cells if c.config == "c"]
    if limits:
        print("\nadaptive limits (c), sampled every 0.5 s: min / median / max (in flight median)")
        for c in limits:
            parts = [
                f"{name} {min(v)} / {pct(v, 50):.0f} / {max(v)} "
                f"({pct(c.in_flight.get(name, [0]), 50):.0f})"
                for name, v in c.limits.items()
                if v
            ]
            print(f"  {c.load:g}×: " + " · ".join(parts))


# ---- main -------------------------------------------------------------------------------------


async def amain(args: argparse.Namespace, urls: list[str]) -> None:
    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=30)
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        t0 = time.monotonic()
        if args.capacity:
            capacity = args.capacity
            print(f"capacity given: {capacity:.2f} requests/s")
        else:
            capacity = await measure_capacity(
                urls, args.capacity_seconds, args.warmup, session, args.seed
            )
            print(
                f"capacity (closed loop, {3 * SLOTS} clients through (a), "
                f"{args.capacity_seconds:g} s after {args.warmup:g} s): {capacity:.2f} requests/s",
                flush=True,
            )
        cells: list[Cell] = []
        for key in args.configs:
            print(f"({key}) {CONFIGS[key][0]}", flush=True)
            cells += await run_config(key, urls, capacity, args, session)
        report(cells, capacity, args)
        print(f"\nwhole run {time.monotonic() - t0:.0f} s", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--duration", type=float, default=16.0, help="seconds of arrivals per cell")
    ap.add_argument("--warmup", type=float, default=12.0, help="warm-up seconds per gateway")
    ap.add_argument("--capacity-seconds", type=float, default=10.0)
    ap.add_argument("--capacity", type=float, default=0.0, help="skip measuring: requests/s")
    ap.add_argument("--loads", default="1,1.5,2")
    ap.add_argument("--configs", default="a,s,b,c")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--quick", action="store_true", help="short cells: a smoke run")
    args = ap.parse_args()
    if args.quick:
        args.duration, args.warmup, args.capacity_seconds = 5.0, 3.0, 4.0
    args.loads = [float(x) for x in args.loads.split(",")]
    args.configs = [c for c in args.configs.split(",") if c]
    if unknown := [c for c in args.configs if c not in CONFIGS]:
        ap.error(f"unknown configuration(s) {unknown}; known: {', '.join(CONFIGS)}")
    print(
        f"slo bench · seed {args.seed} · engines h100-7b at speed {FAST_SPEED} and {SLOW_SPEED} "
        f"· {SLOTS} slots each · realtime {RT_SHARE:.0%} (TTFT objective {TTFT_SLO_MS} ms) · "
        f"prompts {PROMPT_TOKENS[0]}-{PROMPT_TOKENS[1]} tokens, answers {OUTPUT_TOKENS[0]}-"
        f"{OUTPUT_TOKENS[1]} · {args.duration:g} s per cell",
        flush=True,
    )
    ports = [free_port(), free_port()]
    with Processes() as procs:
        for port, speed, seed in zip(ports, (FAST_SPEED, SLOW_SPEED), (11, 12), strict=True):
            p = procs.spawn(
                "0,1",
                PY,
                "-m",
                "gateway.cli",
                "mock",
                "--port",
                str(port),
                "--engine",
                "h100-7b",
                "--speed",
                str(speed),
                "--model",
                "m",
                "--seed",
                str(seed),
                output=subprocess.DEVNULL,
            )
            wait_port(port, proc=p)
        asyncio.run(amain(args, [f"http://127.0.0.1:{p}/v1" for p in ports]))


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main()
    sys.stdout.flush()
