"""Affinity benchmark (SPEC §15): prefix-cache hits, time to first token and load spread of
`least_connections`, `round_robin` and `affinity` on an online judge's workload.

All in this process, on one event loop and 127.0.0.1: four prefix-caching vLLM-like backends
(`MockServer` with `prefix_cache`, `provider: vllm` so the gateway reads their `/metrics`), the
gateway in front of them, and an open-loop, seeded Poisson load generator, so each balancer
sees the same arrivals. Each balancer gets fresh backends (cold caches) and the same requests.

- The workload: `--problems` judge problems, each a ~2,600-character statement (the system
  message: the shared prefix) followed by a student's submission (300-700 characters of code,
  different every time), streamed, a short verdict each. (A) uniform: every problem equally
  likely. (B) skewed: one hot problem takes half the traffic (a contest's first problem).
- The backends cache `--cache` prefixes each (LRU; 2,048 characters, the gateway's
  `affinity.prefix_chars`), charge 40 µs of prefill per uncached character (a miss ~105 ms, a
  hit ~25 ms before the first token) scaled by `1 + 0.03 × running` (prefills share the GPU
  with the running batch), and run at most 32 sequences at once; the gateway gives each
  instance `max_concurrency` 32.
- Measured per balancer: prefix-cache hit rate (hits / lookups, summed over the backends),
  time to first token at the client (mean, p50, p99: request sent → first SSE event), and the
  in-flight count of the instance each request was granted to, right after the grant, against
  the pool average then: the peak, the mean, and how many grants broke SPEC §15's bound
  `ceil((1 + ε) × average) + 1` (ε = 0.25).

    .venv/bin/python benches/affinity.py [--seed 1] [--quick] [--rate 80] [--duration 20]

About 2.5 minutes by default, ~50 s with --quick. Prints one table per workload. Not a pytest
test (tests/test_affinity.py checks the same property, fast and generously).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import random
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

import aiohttp
import orjson
import uvloop

from _harness import serving
from gateway import __version__
from gateway._core import Affinity
from gateway.app import Gateway
from gateway.sim.mock import MockBehavior, MockServer
from gateway.sim.report import percentile

BALANCERS: Final = ("least_connections", "round_robin", "affinity")
INSTANCES, SLOTS, EPSILON = 4, 32, 0.25
PREFIX_CHARS: Final = 2048
PREFILL_US: Final = 40.0  # per uncached prompt character
BATCH_SLOWDOWN: Final = 0.03  # prefill × (1 + this × sequences running)
TOKENS, TOKENS_PER_S = 8, 10.0  # a short verdict: ~0.7 s of generation after the first token
HOT_SHARE: Final = 0.5


@dataclass(frozen=True, slots=True)
class Options:
    seed: int = 1
    quick: bool = False
    rate: float = 80.0  # requests per second
    duration: float = 20.0  # seconds of arrivals per balancer and workload
    problems: int = 48
    cache: int = 12  # prefixes each backend keeps


# ---- the workload ------------------------------------------------------------------------------


def statement(problem: int) -> str:
    """A problem statement of ~2,600 characters, distinct from its first words."""
    rng = random.Random(problem)
    words = ("array", "integer", "subsequence", "modulo", "query", "tree", "edge", "weight")
    body = " ".join(rng.choice(words) for _ in range(420))
    return f"Problem {problem}: {body}. Input: n <= 2*10^5. Output one integer."[:2600]


def submission(rng: random.Random) -> str:
    """A student's code, 300-700 characters, different every time."""
    lines = [f"    x{k} = a[{rng.randrange(100)}] * {rng.randrange(1000)}" for k in range(30)]
    return "def solve(a):\n" + "\n".join(lines)[: rng.randrange(300, 700)] + "\n    return x0\n"


@dataclass(frozen=True, slots=True)
class Job:
    at: float  # seconds after the start
    problem: int
    body: bytes


def plan(o: Options, skewed: bool) -> list[Job]:
    rng = random.Random(o.seed * 2 + skewed)
    statements = [statement(p) for p in range(o.problems)]
    jobs: list[Job] = []
    t = 0.0
    while True:
        t += rng.expovariate(o.rate)
        if t >= o.duration:
            return jobs
        p = 0 if skewed and rng.random() < HOT_SHARE else rng.randrange(o.problems)
        body = {
            "model": "judge",
            "stream": True,
            "max_tokens": TOKENS,
            "messages": [
                {"role": "system", "content": statements[p]},
                {"role": "user", "content": "Judge this submission:\n" + submission(rng)},
            ],
        }
        jobs.append(Job(t, p, orjson.dumps(body)))


# ---- the backends and the gateway ----------------------------------------------------------------


class BatchedPrefillMock(MockServer):
    """A prefix-caching mock whose prefill slows with its running batch (the GPU is shared):
    a request arriving while n sequences run prefills at PREFILL_US × (1 + BATCH_SLOWDOWN·n)."""

    def before_generation(self) -> None:
        scaled = PREFILL_US * (1 + BATCH_SLOWDOWN * self.stats.in_flight)
        self.configure(prefill_us_per_char=scaled)


@contextlib.asynccontextmanager
async def backends(o: Options) -> AsyncIterator[list[MockServer]]:
    behavior = MockBehavior(
        model="qwen",
        latency_ms=15.0,
        tokens_per_s=TOKENS_PER_S,
        default_tokens=TOKENS,
        max_num_seqs=SLOTS,
        prefix_cache=o.cache,
        prefix_chars=PREFIX_CHARS,
        prefill_us_per_char=PREFILL_US,
        seed=o.seed,
        log_size=0,
    )
    servers: list[MockServer] = [BatchedPrefillMock(behavior) for _ in range(INSTANCES)]
    try:
        for m in servers:
            await m.start()
        yield servers
    finally:
        for m in servers:
            await m.stop()


def config_yaml(balancer: str, urls: Sequence[str], seed: int) -> str:
    instances = "\n".join(
        f'      - {{name: vllm-{k}, url: "{u}", model: qwen, provider: vllm, '
        f"max_concurrency: {SLOTS}}}"
        for k, u in enumerate(urls)
    )
    return f"""\
listen: {{host: 127.0.0.1, port: 0}}
seed: {seed}
balancer: {balancer}
affinity: {{prefix_chars: {PREFIX_CHARS}, epsilon: {EPSILON}}}
scheduler: {{high: {{capacity: 5000, weight: 7, max_wait_ms: 600000}}}}
health: {{probe: {{interval_ms: 250, timeout_ms: 1000}}}}
pools:
  judge:
    instances:
{instances}
models:
  judge: {{pool: judge}}
"""


# ---- one run -------------------------------------------------------------------------------------


@dataclass(slots=True)
class Run:
    """What one balancer did with one workload."""

    balancer: str
    ttft_ms: list[float] = field(default_factory=list)
    statuses: Counter[int] = field(default_factory=Counter)
    placed: Counter[str] = field(default_factory=Counter)  # X-Gateway-Affinity
    # At each grant: (in flight on the granted instance, pool average), right after it.
    grants: list[tuple[int, float]] = field(default_factory=list)
    hits: int = 0
    lookups: int = 0
    wall_s: float = 0.0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.lookups if self.lookups else 0.0

    def over_bound(self) -> int:
        return sum(1 for n, avg in self.grants if n > math.ceil((1 + EPSILON) * avg) + 1)


def watch_grants(gateway: Gateway, run: Run) -> None:
    """Records the granted instance's in-flight count and the pool average at each grant
    (wrapping this gateway's pool's `acquire`: instrumentation of the bench only)."""
    pool = gateway.runtime.pools["judge"]
    acquire = pool.acquire

    async def watched(*args: Any, **kwargs: Any) -> tuple[int, Any, Affinity]:
        got = await acquire(*args, **kwargs)
        loads = {i.index: i.in_flight for i in pool.snapshot().instances}
        run.grants.append((loads[got[0]], sum(loads.values()) / len(loads)))
        return got

    pool.acquire = watched  # type: ignore[method-assign]


async def send(session: aiohttp.ClientSession, url: str, job: Job, run: Run) -> None:
    loop = asyncio.get_running_loop()
    start = loop.time()
    headers = {"Content-Type": "application/json"}
    try:
        async with session.post(url, data=job.body, headers=headers) as resp:
            run.statuses[resp.status] += 1
            run.placed[resp.headers.get("X-Gateway-Affinity", "-")] += 1
            first = True
            async for _ in resp.content.iter_any():
                if first:
                    run.ttft_ms.append((loop.time() - start) * 1000)
                    first = False
    except (aiohttp.ClientError, OSError):
        run.statuses[-1] += 1


async def measure(o: Options, balancer: str, jobs: Sequence[Job]) -> Run:
    run = Run(balancer)
    async with (
        backends(o) as mocks,
        serving(config_yaml(balancer, [m.url for m in mocks], o.seed), "affinity bench") as (
            gateway,
            base,
        ),
    ):
        watch_grants(gateway, run)
        loop = asyncio.get_running_loop()
        connector = aiohttp.TCPConnector(limit=0)
        timeout = aiohttp.ClientTimeout(total=120)
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
            url = base + "/v1/chat/completions"
            tasks = []
            t0 = loop.time()
            for job in jobs:
                if (delay := t0 + job.at - loop.time()) > 0:
                    await asyncio.sleep(delay)
                tasks.append(asyncio.create_task(send(session, url, job, run)))
            await asyncio.gather(*tasks)
            run.wall_s = loop.time() - t0
        run.hits = sum(m.stats.prefix_hits for m in mocks)
        run.lookups = run.hits + sum(m.stats.prefix_misses for m in mocks)
    return run


# ---- the report ----------------------------------------------------------------------------------


def table(title: str, runs: Sequence[Run]) -> list[str]:
    lines = [
        title,
        "",
        "| balancer | cache hit rate | TTFT mean | TTFT p50 | TTFT p99 | in flight at grant: max "
        "| avg | grants over bound | affinity hit / spill | non-200 |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in runs:
        ttft = sorted(r.ttft_ms)
        peak = max((n for n, _ in r.grants), default=0)
        avg = sum(a for _, a in r.grants) / len(r.grants) if r.grants else 0.0
        placed = f"{r.placed['hit']} / {r.placed['spill']}" if r.balancer == "affinity" else "-"
        bad = sum(n for s, n in r.statuses.items() if s != 200)
        lines.append(
            f"| {r.balancer} | {r.hit_rate:.1%} | {sum(ttft) / len(ttft):.0f} ms "
            f"| {percentile(ttft, 50):.0f} ms | {percentile(ttft, 99):.0f} ms | {peak} "
            f"| {avg:.1f} | {r.over_bound()} of {len(r.grants)} | {placed} | {bad} |"
        )
    lc = next(r for r in runs if r.balancer == "least_connections")
    af = next(r for r in runs if r.balancer == "affinity")

    def mean(r: Run) -> float:
        return sum(r.ttft_ms) / len(r.ttft_ms)

    lines += [
        "",
        f"affinity vs least_connections: hit rate {af.hit_rate / max(lc.hit_rate, 1e-9):.2f}x, "
        f"mean TTFT {1 - mean(af) / mean(lc):.0%} lower, "
        f"p99 TTFT {percentile(sorted(af.ttft_ms), 99) / percentile(sorted(lc.ttft_ms), 99):.2f}x",
    ]
    return lines


async def main_async(o: Options) -> str:
    out = [
        f"gateway {__version__} · affinity bench · seed {o.seed} · {o.rate:g} req/s for "
        f"{o.duration:g} s per run · {o.problems} problems · {INSTANCES} backends × "
        f"{SLOTS} slots, {o.cache} cached prefixes each · ε = {EPSILON}",
        "",
    ]
    for skewed, title in (
        (False, "(A) uniform: every problem equally likely"),
        (True, f"(B) skewed: problem 0 takes {HOT_SHARE:.0%} of the traffic"),
    ):
        jobs = plan(o, skewed)
        runs = []
        for balancer in BALANCERS:
            print(f"  {title[:3]} {balancer}: {len(jobs)} requests ...", flush=True)
            runs.append(await measure(o, balancer, jobs))
        out += [*table(title, runs), ""]
    return "\n".join(out)


def parse_args(argv: Sequence[str] | None = None) -> Options:
    parser = argparse.ArgumentParser(description="Prefix affinity against the other balancers.")
    d = Options()
    parser.add_argument("--seed", type=int, default=d.seed)
    parser.add_argument("--quick", action="store_true", help="8 s of arrivals per run")
    parser.add_argument("--rate", type=float, default=d.rate, help="requests per second")
    parser.add_argument("--duration", type=float, default=d.duration, help="seconds per run")
    parser.add_argument("--problems", type=int, default=d.problems)
    parser.add_argument("--cache", type=int, default=d.cache, help="prefixes each backend keeps")
    a = parser.parse_args(argv)
    duration = 8.0 if a.quick else a.duration
    return Options(a.seed, a.quick, a.rate, duration, a.problems, a.cache)


def main(argv: Sequence[str] | None = None) -> int:
    o = parse_args(argv)
    t0 = time.monotonic()
    text = uvloop.run(main_async(o))
    print()
    print(text)
    print(f"({time.monotonic() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
