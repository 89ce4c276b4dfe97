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

- Three more workloads on backends with vLLM's block cache instead (`prefix_block_chars` 48:
  an LRU of `--blocks` blocks each, keyed by the prompt up to each block's end, so a request
  reuses the longest cached run of its leading blocks, at whatever length): (C) the judge
  with statements of 400-1,800 characters after a shared 300-character instruction, (D)
  multi-turn chats of 2-8 turns (turn n+1 repeats turns 1..n and their answers, 1-2 s
  apart), (E) one 500-character system prompt and distinct questions. The hit rate there is
  the share of prompt characters found cached (what prefill saves), and an **oracle** runs
  too: a client that sees every mock's cache and sends each request straight to the mock
  holding the longest prefix of it, under the same load bound (ties: the least loaded).

    .venv/bin/python benches/affinity.py [--seed 1] [--quick] [--rate 80] [--duration 20]
        [--only A,C]

About 6 minutes by default, ~2.5 min with --quick. Prints one table per workload. Not a
pytest test (tests/test_affinity.py and tests/test_prefix_affinity.py check the same
properties, fast and generously).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import math
import random
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Sequence
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
# (C)-(E): the block-cache backends, and the oracle (no gateway: see `measure_oracle`)
BLOCK_BALANCERS: Final = ("least_connections", "affinity", "oracle")
BLOCK_CHARS: Final = 48  # the mock's block: ~12 tokens, deliberately not the gateway's 64 B
# Blocks each backend caches, per workload: about a third of what the workload keeps live, so
# one backend cannot hold it all and where a request goes decides whether it hits (a chat's
# history is several times a judge prompt: D gets more).
BLOCKS: Final = {"C": 400, "D": 1500, "E": 400}
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
    blocks: int = 0  # (C)-(E): blocks of BLOCK_CHARS each backend keeps; 0: BLOCKS
    only: str = "ABCDE"


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
    doc: dict[str, Any] = field(default_factory=dict, compare=False)  # the body (oracle)


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


INSTRUCTION: Final = (
    "You are an online judge. Read the problem statement, then the student's submission, and "
    "answer ACCEPTED or WRONG ANSWER with one sentence of explanation. Be strict about edge "
    "cases, time limits (2 s) and memory limits (256 MB). Never run the code; reason about it."
)
WORDS: Final = ("sort", "graph", "prime", "string", "window", "heap", "matrix", "query", "edge")


def _words(rng: random.Random, lo: int, hi: int) -> str:
    """Between `lo` and `hi` characters of words."""
    size = rng.randrange(lo, hi + 1)
    return " ".join(rng.choice(WORDS) for _ in range(size // 5 + 1))[:size]


def _job(at: float, key: int, messages: list[dict[str, Any]]) -> Job:
    doc = {"model": "judge", "stream": True, "max_tokens": TOKENS, "messages": messages}
    return Job(at, key, orjson.dumps(doc), doc)


def plan_statements(o: Options) -> list[Job]:
    """(C): the judge, a shared instruction, statements of 400-1,800 characters (uniform)."""
    rng = random.Random(o.seed * 7 + 3)
    sizes = [random.Random(p).randrange(400, 1801) for p in range(o.problems)]
    statements = [statement(p)[: sizes[p]] for p in range(o.problems)]
    jobs: list[Job] = []
    t = 0.0
    while (t := t + rng.expovariate(o.rate)) < o.duration:
        p = rng.randrange(o.problems)
        messages = [
            {"role": "system", "content": INSTRUCTION},
            {"role": "user", "content": statements[p] + "\n\nSubmission:\n" + submission(rng)},
        ]
        jobs.append(_job(t, p, messages))
    return jobs


def plan_chats(o: Options) -> list[Job]:
    """(D): conversations of 2-8 turns starting at random (a third of the rate), each turn
    1-2 s after the one before and repeating every earlier turn and answer."""
    rng = random.Random(o.seed * 7 + 4)
    jobs: list[Job] = []
    t, c = 0.0, 0
    while (t := t + rng.expovariate(o.rate / 5)) < o.duration:
        c += 1
        messages: list[dict[str, Any]] = [{"role": "system", "content": f"Chat {c}. Help."}]
        at = t
        for turn in range(rng.randrange(2, 9)):
            messages = [*messages, {"role": "user", "content": _words(rng, 80, 400)}]
            jobs.append(_job(at, c, messages))
            messages = [*messages, {"role": "assistant", "content": _words(rng, 150, 700)}]
            at += rng.uniform(1.0, 2.0)
            del turn
    jobs.sort(key=lambda j: j.at)
    return jobs


def plan_system_prompt(o: Options) -> list[Job]:
    """(E): one 500-character system prompt, then a distinct question every time."""
    rng = random.Random(o.seed * 7 + 5)
    system = (INSTRUCTION + " " + _words(random.Random(0), 500, 500))[:500]
    jobs: list[Job] = []
    t = 0.0
    while (t := t + rng.expovariate(o.rate)) < o.duration:
        messages = [
            {"role": "system", "content": system},
            {"role": "user", "content": _words(rng, 100, 400)},
        ]
        jobs.append(_job(t, 0, messages))
    return jobs


# ---- the backends and the gateway ----------------------------------------------------------------


class BatchedPrefillMock(MockServer):
    """A prefix-caching mock whose prefill slows with its running batch (the GPU is shared):
    a request arriving while n sequences run prefills at PREFILL_US × (1 + BATCH_SLOWDOWN·n)."""

    def before_generation(self) -> None:
        scaled = PREFILL_US * (1 + BATCH_SLOWDOWN * self.stats.in_flight)
        self.configure(prefill_us_per_char=scaled)


@contextlib.asynccontextmanager
async def backends(o: Options, blocks: bool = False) -> AsyncIterator[list[MockServer]]:
    behavior = MockBehavior(
        model="qwen",
        latency_ms=15.0,
        tokens_per_s=TOKENS_PER_S,
        default_tokens=TOKENS,
        max_num_seqs=SLOTS,
        prefix_cache=o.blocks if blocks else o.cache,
        prefix_chars=PREFIX_CHARS,
        prefix_block_chars=BLOCK_CHARS if blocks else 0,
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


def config_yaml(balancer: str, urls: Sequence[str], seed: int, cache_tokens: int = 131072) -> str:
    instances = "\n".join(
        f'      - {{name: vllm-{k}, url: "{u}", model: qwen, provider: vllm, '
        f"max_concurrency: {SLOTS}}}"
        for k, u in enumerate(urls)
    )
    return f"""\
listen: {{host: 127.0.0.1, port: 0}}
seed: {seed}
balancer: {balancer}
affinity: {{epsilon: {EPSILON}, cache_tokens: {cache_tokens}}}
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

    async def watched(*args: Any, **kwargs: Any) -> tuple[int, Any, Affinity, int]:
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


async def measure(o: Options, balancer: str, jobs: Sequence[Job], blocks: bool = False) -> Run:
    if balancer == "oracle":
        return await measure_oracle(o, jobs)
    run = Run(balancer)
    # SPEC §15: the gateway's cache_tokens is the backend's cache, in tokens (4 chars each)
    tokens = o.blocks * BLOCK_CHARS // 4 if blocks else 131072
    async with (
        backends(o, blocks) as mocks,
        serving(
            config_yaml(balancer, [m.url for m in mocks], o.seed, tokens), "affinity bench"
        ) as (gateway, base),
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
        count(run, mocks, blocks)
    return run


def count(run: Run, mocks: Sequence[MockServer], blocks: bool) -> None:
    """The hit rate: requests whose prefix was cached, or (block caches) cached characters."""
    if blocks:
        run.hits = sum(m.stats.prefix_cached_chars for m in mocks)
        run.lookups = sum(m.stats.prefix_prompt_chars for m in mocks)
    else:
        run.hits = sum(m.stats.prefix_hits for m in mocks)
        run.lookups = run.hits + sum(m.stats.prefix_misses for m in mocks)


async def measure_oracle(o: Options, jobs: Sequence[Job]) -> Run:
    """The oracle: each request straight to the mock whose cache holds the longest prefix of
    it now, among those under the bound `ceil((1 + ε)(total + 1) / n)` (ties: the least
    loaded; none under it: the least loaded). No gateway in between."""
    run = Run("oracle")
    loads = [0] * INSTANCES
    async with backends(o, blocks=True) as mocks:
        loop = asyncio.get_running_loop()
        connector = aiohttp.TCPConnector(limit=0)
        timeout = aiohttp.ClientTimeout(total=120)
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:

            async def one(job: Job) -> None:
                total = sum(loads)
                cap = math.ceil((1 + EPSILON) * (total + 1) / INSTANCES)
                under = [k for k in range(INSTANCES) if loads[k] < cap] or range(INSTANCES)
                k = max(under, key=lambda k: (mocks[k].cached_chars(job.doc), -loads[k]))
                loads[k] += 1
                run.grants.append((loads[k], (total + 1) / INSTANCES))
                try:
                    await send(session, mocks[k].url + "/chat/completions", job, run)
                finally:
                    loads[k] -= 1

            tasks = []
            t0 = loop.time()
            for job in jobs:
                if (delay := t0 + job.at - loop.time()) > 0:
                    await asyncio.sleep(delay)
                tasks.append(asyncio.create_task(one(job)))
            await asyncio.gather(*tasks)
            run.wall_s = loop.time() - t0
        count(run, mocks, True)
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
        if r.balancer == "oracle":
            placed = "(direct)"
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
    oracle = next((r for r in runs if r.balancer == "oracle"), None)
    if oracle is not None:
        lines.append(
            f"affinity vs the oracle: hit rate {af.hit_rate / max(oracle.hit_rate, 1e-9):.2f}x"
        )
    return lines


async def main_async(o: Options) -> str:
    out = [
        f"gateway {__version__} · affinity bench · seed {o.seed} · {o.rate:g} req/s for "
        f"{o.duration:g} s per run · {o.problems} problems · {INSTANCES} backends × "
        f"{SLOTS} slots, {o.cache} cached prefixes each ((C)-(E): "
        f"{o.blocks or 'C 400 / D 1500 / E 400'} blocks of {BLOCK_CHARS} characters) "
        f"· ε = {EPSILON}",
        "",
    ]
    workloads: tuple[tuple[str, str, Callable[[], list[Job]]], ...] = (
        ("A", "(A) uniform: every problem equally likely", lambda: plan(o, False)),
        ("B", f"(B) skewed: problem 0 takes {HOT_SHARE:.0%} of the traffic", lambda: plan(o, True)),
        (
            "C",
            "(C) statements of 400-1,800 characters after a shared instruction "
            "(hit rate: cached share of prompt characters)",
            lambda: plan_statements(o),
        ),
        ("D", "(D) multi-turn chats of 2-8 turns (cached share)", lambda: plan_chats(o)),
        (
            "E",
            "(E) one 500-character system prompt, distinct questions (cached share)",
            lambda: plan_system_prompt(o),
        ),
    )
    for name, title, make in workloads:
        if name not in o.only:
            continue
        jobs = make()
        blocks = name in "CDE"
        wo = dataclasses.replace(o, blocks=o.blocks or BLOCKS[name]) if blocks else o
        runs = []
        for balancer in BLOCK_BALANCERS if blocks else BALANCERS:
            print(f"  {title[:3]} {balancer}: {len(jobs)} requests ...", flush=True)
            runs.append(await measure(wo, balancer, jobs, blocks))
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
    parser.add_argument("--blocks", type=int, default=d.blocks, help="(C)-(E): blocks kept")
    parser.add_argument("--only", default=d.only, help="workloads to run, e.g. A,C")
    a = parser.parse_args(argv)
    duration = 8.0 if a.quick else a.duration
    only = a.only.replace(",", "").upper()
    return Options(a.seed, a.quick, a.rate, duration, a.problems, a.cache, a.blocks, only)


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
