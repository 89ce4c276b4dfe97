"""`gateway demo`: the whole product doing its job, in about a minute, with nothing to set up.

Everything runs in this process, on one event loop:

1. four simulated backends (`MockServer`): pool `light` (two fast "Qwen" instances) and pool
   `heavy` (two slow, heavy-tailed "GPT-4o" / "ERNIE" instances, falling back to `light`);
2. the gateway over them, configured from YAML text like any deployment, with fast probes
   and short ejections so a crash and its recovery fit in the run;
3. an online-judge workload, open loop (arrivals do not wait for answers, as real students
   do not): a backlog of batch re-judging queued at the start, a Poisson stream of realtime
   and batch requests, simple ("does this compile?") and complex ("worst-case time
   complexity?") prompts in English and Chinese, and an exam-deadline surge of realtime;
4. a scripted failure: one heavy instance crashes mid-run and comes back later;
5. the overnight re-judging as a real batch (SPEC §14): a JSONL file uploaded with
   `POST /v1/files` and run with `POST /v1/batches` beside the backlog, its progress polled
   with `GET /v1/batches/{id}` like any Batch API client would.

While it runs, one progress line; the gateway's state is sampled every 200 ms (what
`GET /admin/state` serves). At the end: a plain-text summary and a self-contained HTML report
(`report.py` draws the charts). Seeded: two runs with one seed tell the same story.
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import contextlib
import html
import itertools
import logging
import math
import random
import shutil
import signal
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, TextIO
from urllib.parse import unquote

import aiohttp
import orjson

from gateway import __version__
from gateway.app import Gateway
from gateway.config import Batch, parse_config
from gateway.events import Events, GatewayEvent, ProbeFinished, RequestFinished
from gateway.server import Server
from gateway.sim.mock import MockBehavior, MockServer
from gateway.sim.report import (
    Band,
    Bars,
    BoxGroup,
    Marker,
    Series,
    Span,
    bar_chart,
    box_chart,
    cdf_chart,
    fmt_ms,
    fmt_seconds,
    line_chart,
    page,
    percentile,
    timeline_chart,
)

__all__ = [
    "DemoResult",
    "Job",
    "Options",
    "Script",
    "add_arguments",
    "main",
    "options_from_args",
    "plan_workload",
    "run",
]

# ---- the scenario --------------------------------------------------------------------------
# Sized for a 2-core laptop: at the default rate the light pool runs at ~half its capacity on
# live traffic alone, so the batch backlog keeps it saturated for the first part of the run
# (queues form, 7:3 shows), and the heavy pool is busy enough that losing one of its two
# instances is felt. Realtime waits stay short because realtime takes 7 of every 10 slots.

LIGHT: Final = (("qwen-a", "Qwen2.5-7B-Instruct"), ("qwen-b", "Qwen2.5-7B-Instruct"))
HEAVY: Final = (("gpt-4o", "gpt-4o"), ("ernie-4", "ernie-4.0-8k"))
CRASHED: Final = "ernie-4"
LIGHT_SLOTS: Final = 3
HEAVY_SLOTS: Final = 2
LIGHT_BEHAVIOR: Final = {
    "latency_ms": 80.0,
    "latency_dist": "lognormal",
    "latency_max_ms": 1500.0,
    "tokens_per_s": 150.0,
    # vLLM's prefix caching (SPEC §15): a cached prompt skips its prefill.
    "prefix_cache": 6,
    "prefill_us_per_char": 100.0,
}
# Pool light balances by prompt prefix (SPEC §15): the same judge question goes back to the
# Qwen instance that holds it in its KV cache, within (1 + ε) of the average load.
LIGHT_BALANCER: Final = "affinity"
HEAVY_BEHAVIOR: Final = {
    "latency_ms": 600.0,
    "latency_dist": "pareto",  # heavy tail: most answers quick, a few very slow
    "latency_max_ms": 5000.0,
    "tokens_per_s": 80.0,
}
# Health settings of the demo's config, quoted in the summary. Ejection is short so that
# the crash, the ejection and the recovery all fit in the run.
FAILURE_THRESHOLD: Final = 3
EJECTION_MS: Final = 2000
PROBE_INTERVAL_MS: Final = 500

# Fractions of --duration at which the scripted events happen (so a short test run keeps
# the same story). Three acts: the surge lands while the batch backlog still fills the
# pools (scheduling), then the crash (health), then recovery and a quiet drain.
SURGE: Final = (0.15, 0.30)
CRASH_AT: Final = 0.35
RECOVER_AT: Final = 0.60

REALTIME_SHARE: Final = 0.8  # of the live stream
COMPLEX_SHARE: Final = 0.1  # of the live stream
BACKLOG_COMPLEX_SHARE: Final = 0.12  # of the backlog
PINNED_SHARE: Final = 0.1  # sent to judge-lite / judge-pro instead of judge
STREAM_SHARE: Final = 0.5  # of realtime requests (a student watches the verdict appear)
BACKLOG_PER_RATE_SECOND: Final = 0.5  # backlog size = this × rate × duration
# Extra realtime arrivals in the surge, × rate: enough that realtime alone wants more than
# its 7 in 10 of light's slots for a while, so its queue grows and the split shows.
SURGE_EXTRA: Final = 1.0
DRAIN_LIMIT_S: Final = 40.0  # after the workload, wait at most this long for answers
# The overnight re-judging submitted through the Batch API: lines = this × rate × duration.
REJUDGE_PER_RATE_SECOND: Final = 0.3
REJUDGE_POLL_S: Final = 0.5
# After a stop, how long a cancelled re-judging batch may take to reach `cancelled`.
REJUDGE_CANCEL_WAIT_S: Final = 3.0
SAMPLE_EVERY_S: Final = 0.2

# Prompts an online judge sends. The complex ones carry the keywords SPEC §4's classifier
# looks for ("time complexity", "worst case", "prove", "optimize", 时间复杂度, 最坏情况,
# 动态规划, 优化); the simple ones are short compile / syntax questions.
SIMPLE_PROMPTS: Final = (
    "Does this compile?\n```c\n#include <stdio.h>\nint main(void) {\n    int n;\n"
    '    scanf("%d", &n)\n    printf("%d\\n", n * 2);\n    return 0;\n}\n```',
    "Is there a syntax error in this Python submission?\n```python\ndef solve(a, b)\n"
    "    return a + b\nprint(solve(*map(int, input().split())))\n```",
    "Quick check: does this Java code compile?\n```java\npublic class Main {\n"
    "  public static void main(String[] args) {\n"
    '    System.out.println("hello")\n  }\n}\n```',
    "这段代码能编译吗？\n```cpp\n#include <iostream>\nint main() {\n"
    '    std::cout << "Hello" << std::endl\n    return 0;\n}\n```',
    "帮我看看这段 C 代码有没有语法错误：\n```c\nint add(int a, int b) { return a + b; }\n"
    "int main() { return add(1, 2) }\n```",
)
COMPLEX_PROMPTS: Final = (
    "What is the worst-case time complexity of this code? Explain step by step.\n```python\n"
    "def count_pairs(a, k):\n    a.sort()\n    total = 0\n    for i in range(len(a)):\n"
    "        j = i + 1\n        while j < len(a) and a[j] - a[i] <= k:\n"
    "            total += 1\n            j += 1\n    return total\n```",
    "Prove that this greedy interval-scheduling solution is correct, or give a "
    "counterexample.\n```cpp\nsort(v.begin(), v.end(), [](auto& x, auto& y) "
    "{ return x.second < y.second; });\nint cnt = 0, end = INT_MIN;\n"
    "for (auto& [l, r] : v) if (l >= end) { ++cnt; end = r; }\n```",
    "This solution exceeds the limit for n = 200000. How would you optimize it?\n"
    "```python\nans = 0\nfor i in range(n):\n    for j in range(i):\n"
    "        if a[j] < a[i]:\n            ans += 1\n```",
    "这段代码的最坏情况时间复杂度是多少？请给出分析。\n```cpp\nvoid dfs(int u) {\n"
    "    for (int v : g[u]) if (!vis[v]) { vis[v] = 1; dfs(v); vis[v] = 0; }\n}\n```",
    "请分析这段动态规划代码的空间复杂度，并说明如何优化到 O(m)。\n```python\n"
    "dp = [[0] * (m + 1) for _ in range(n + 1)]\nfor i in range(1, n + 1):\n"
    "    for j in range(1, m + 1):\n"
    "        dp[i][j] = max(dp[i-1][j], dp[i][j-1]) + g[i][j]\n```",
)

CLASS_NAME: Final = {"high": "realtime", "low": "batch"}
CHAT: Final = "/v1/chat/completions"
CLASS_COLOR: Final = {"high": "#0072B2", "low": "#E69F00", "forced": "#CC79A7"}
STATE_COLOR: Final = {"healthy": "#009E73", "half_open": "#F0C419", "ejected": "#D55E00"}
INSTANCE_COLOR: Final = {
    "qwen-a": "#0072B2",
    "qwen-b": "#56B4E9",
    "gpt-4o": "#009E73",
    "ernie-4": "#D55E00",
}


# ---- options ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Options:
    """What `gateway demo` was asked for."""

    duration: float = 45.0
    rate: float = 16.0
    policy: str = "weighted"
    balancer: str = "least_connections"
    report: str = "demo-report.html"
    seed: int = 1
    progress: bool = True


def _positive(text: str) -> float:
    value = float(text)
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a positive number, not {text!r}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of `gateway demo`."""
    d = Options()
    a = parser.add_argument
    a(
        "--duration",
        type=_positive,
        default=d.duration,
        help="seconds of workload (default %(default)s); the answers still owed are then "
        f"awaited, at most {DRAIN_LIMIT_S:.0f} s",
    )
    a(
        "--rate",
        type=_positive,
        default=d.rate,
        help="mean arrivals per second of the live judge stream, Poisson (default %(default)s)",
    )
    a("--policy", choices=("weighted", "strict"), default=d.policy, help="scheduler.policy")
    a(
        "--balancer",
        choices=("least_connections", "round_robin", "random", "p2c", "affinity"),
        default=d.balancer,
        help=f"the load balancer of pool heavy (default %(default)s; pool light uses "
        f"{LIGHT_BALANCER})",
    )
    a("--report", default=d.report, metavar="PATH", help="HTML report (default %(default)s)")
    a("--seed", type=int, default=d.seed, help="seeds arrivals, prompts and backends")
    a("--no-progress", action="store_true", help="no live progress line")


def options_from_args(args: argparse.Namespace) -> Options:
    """The `Options` the parsed flags describe."""
    return Options(
        duration=args.duration,
        rate=args.rate,
        policy=args.policy,
        balancer=args.balancer,
        report=args.report,
        seed=args.seed,
        progress=not getattr(args, "no_progress", False),
    )


# ---- the workload ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Job:
    """One request the workload will send, `at` seconds after the start."""

    at: float
    priority: str  # high | low
    complexity: str  # what the prompt really is: simple | complex
    alias: str  # judge | judge-lite | judge-pro
    prompt: str
    stream: bool
    max_tokens: int
    origin: str  # backlog | live | surge


@dataclass(frozen=True, slots=True)
class Script:
    """When the scripted events happen, in seconds from the start."""

    duration: float
    crash_at: float
    recover_at: float
    surge: tuple[float, float]


def plan_workload(options: Options) -> tuple[list[Job], Script]:
    """Every request of the run, sorted by time, and the script; a function of the options.

    The backlog is queued in the first half second; the live stream is Poisson at `rate`,
    plus `SURGE_EXTRA × rate` realtime arrivals during the surge (by thinning).
    """
    rng = random.Random(options.seed)
    d, rate = options.duration, options.rate
    script = Script(
        duration=d,
        crash_at=CRASH_AT * d,
        recover_at=RECOVER_AT * d,
        surge=(SURGE[0] * d, SURGE[1] * d),
    )
    jobs: list[Job] = []
    backlog = round(BACKLOG_PER_RATE_SECOND * rate * d)
    for _ in range(backlog):
        jobs.append(_job(rng, rng.uniform(0.0, 0.5), "low", "backlog", BACKLOG_COMPLEX_SHARE))
    peak = rate * (1.0 + SURGE_EXTRA)
    t = 0.0
    while True:
        t += rng.expovariate(peak)
        if t >= d:
            break
        in_surge = script.surge[0] <= t < script.surge[1]
        u = rng.random() * peak
        if u < rate:
            priority = "high" if rng.random() < REALTIME_SHARE else "low"
            jobs.append(_job(rng, t, priority, "live"))
        elif in_surge:
            # Before a deadline students mostly ask whether their code compiles.
            jobs.append(_job(rng, t, "high", "surge", complex_share=COMPLEX_SHARE / 2))
    jobs.sort(key=lambda j: j.at)
    return jobs, script


def _job(
    rng: random.Random, at: float, priority: str, origin: str, complex_share: float = COMPLEX_SHARE
) -> Job:
    complexity = "complex" if rng.random() < complex_share else "simple"
    prompt = rng.choice(COMPLEX_PROMPTS if complexity == "complex" else SIMPLE_PROMPTS)
    alias = "judge"
    if rng.random() < PINNED_SHARE:
        # Some clients pin a tier by name instead of letting the gateway decide.
        alias = "judge-pro" if complexity == "complex" else "judge-lite"
    stream = priority == "high" and rng.random() < STREAM_SHARE
    max_tokens = rng.randint(8, 24) if complexity == "simple" else rng.randint(24, 48)
    return Job(at, priority, complexity, alias, prompt, stream, max_tokens, origin)


def plan_rejudge(options: Options) -> bytes:
    """The overnight re-judging as a Batch API input file (JSONL): seeded like the rest,
    `REJUDGE_PER_RATE_SECOND × rate × duration` historical submissions to judge again."""
    rng = random.Random(options.seed * 7919 + 1)
    n = max(1, round(REJUDGE_PER_RATE_SECOND * options.rate * options.duration))
    out = []
    for i in range(n):
        job = _job(rng, 0.0, "low", "rejudge", BACKLOG_COMPLEX_SHARE)
        body = {
            "model": job.alias,
            "messages": [{"role": "user", "content": job.prompt}],
            "max_tokens": job.max_tokens,
        }
        line = {"custom_id": f"rejudge-{i:05d}", "method": "POST", "url": CHAT, "body": body}
        out.append(orjson.dumps(line) + b"\n")
    return b"".join(out)


# ---- the configuration -----------------------------------------------------------------------


def config_yaml(
    options: Options,
    light: Sequence[str],
    heavy: Sequence[str],
    batch_store: str | None = None,
) -> str:
    """The gateway's config, as an operator would write it; `light`/`heavy` are base URLs,
    `batch_store` the Batch API's SQLite file (SPEC §14; the default path when None)."""

    def instances(
        specs: Sequence[tuple[str, str]], urls: Sequence[str], slots: int, extra: str = ""
    ) -> str:
        return "".join(
            f'      - {{name: {name}, url: "{url}", model: {model}, max_concurrency: {slots}'
            f"{extra}}}\n"
            for (name, model), url in zip(specs, urls, strict=True)
        )

    return (
        "# Generated by `gateway demo`: in-process simulated backends on loopback.\n"
        "listen: {host: 127.0.0.1, port: 0}\n"
        "scheduler:\n"
        f"  policy: {options.policy}\n"
        "  high: {capacity: 200, weight: 7, max_wait_ms: 30000}\n"
        "  low: {capacity: 1000, weight: 3, max_wait_ms: 600000}\n"
        "  max_consecutive_high: 20\n"
        "  max_low_wait_ms: 5000\n"
        f"balancer: {options.balancer}\n"
        "health:\n"
        f"  failure_threshold: {FAILURE_THRESHOLD}\n"
        f"  ejection_ms: {EJECTION_MS}          # short, so crash and recovery fit in the demo\n"
        "  max_ejection_ms: 16000\n"
        "  half_open_max_requests: 1\n"
        "  success_threshold: 2\n"
        f"  probe: {{interval_ms: {PROBE_INTERVAL_MS}, timeout_ms: 400, path: /v1/models}}\n"
        "timeouts: {connect_ms: 1000, first_byte_ms: 20000, stream_idle_ms: 10000, "
        "total_ms: 60000}\n"
        "retries: {max_attempts: 3}\n"
        "shutdown: {drain_timeout_ms: 2000}\n"
        f"seed: {options.seed}\n"
        "pools:\n"
        "  light:\n"
        f"    balancer: {LIGHT_BALANCER}   # prefix affinity: vLLM's prefix cache hits\n"
        "    instances:\n"
        f"{instances(LIGHT, light, LIGHT_SLOTS, ', provider: vllm')}"
        "  heavy:\n"
        "    fallback: light\n"
        "    instances:\n"
        f"{instances(HEAVY, heavy, HEAVY_SLOTS)}"
        "models:\n"
        "  judge: {route: auto}\n"
        "  judge-lite: {pool: light}\n"
        "  judge-pro: {pool: heavy}\n"
        "routing:\n"
        "  complexity: {simple: light, complex: heavy}\n"
        "  default_complexity: simple\n"
        + (f"batch: {{store: {orjson.dumps(batch_store).decode()}}}\n" if batch_store else "")
    )


# ---- what is observed ------------------------------------------------------------------------


@dataclass(slots=True)
class Sample:
    """One request as its client saw it. Times are seconds from the start."""

    job: Job
    sent: float
    done: float | None = None
    status: int = 0
    ok: bool = False
    error: str | None = None  # error code, `stream_error`, `connection` or `cancelled`
    request_id: str | None = None
    pool: str | None = None
    instance: str | None = None
    waited_as: str | None = None
    decided: str | None = None  # X-Gateway-Complexity: "complex; rule"
    queue_ms: float | None = None
    affinity: str | None = None  # X-Gateway-Affinity: hit, spill or none

    @property
    def e2e_ms(self) -> float | None:
        return None if self.done is None else (self.done - self.sent) * 1000

    @property
    def service_ms(self) -> float | None:
        e2e = self.e2e_ms
        return None if e2e is None or self.queue_ms is None else max(e2e - self.queue_ms, 0.0)


@dataclass(slots=True)
class Rejudge:
    """The overnight re-judging, one Batch API batch, as its client saw it (times are
    seconds from the start)."""

    lines: int
    batch_id: str | None = None
    status: str = "not submitted"
    submitted: float | None = None
    finished: float | None = None
    progress: list[tuple[float, int, int]] = field(default_factory=list)  # t, done, failed
    output_lines: int = 0
    error_lines: int = 0
    error: str | None = None

    @property
    def done(self) -> bool:
        return self.status in ("completed", "failed", "cancelled", "expired") or bool(self.error)


@dataclass(frozen=True, slots=True)
class InstanceView:
    """One instance in one sample of the gateway's state."""

    name: str
    pool: str
    state: str
    in_flight: int
    max_concurrency: int
    consecutive_failures: int
    ejections: int


@dataclass(frozen=True, slots=True)
class PoolView:
    """One pool in one sample of the gateway's state (counters are cumulative)."""

    queued_high: int
    queued_low: int
    granted_high: int
    granted_low: int
    forced_low: int


@dataclass(frozen=True, slots=True)
class Snapshot:
    """The gateway's state (`GET /admin/state`) at time `t`."""

    t: float
    pools: dict[str, PoolView]
    instances: tuple[InstanceView, ...]


def snapshot_of(t: float, state: dict[str, Any]) -> Snapshot:
    """Reads the /admin/state document; counters beyond SPEC §7's shape default to 0."""
    pools: dict[str, PoolView] = {}
    instances: list[InstanceView] = []
    for name, p in state.get("pools", {}).items():
        queued = p.get("queued", {})
        granted = p.get("granted", {})
        pools[name] = PoolView(
            queued_high=int(queued.get("high", 0)),
            queued_low=int(queued.get("low", 0)),
            granted_high=int(granted.get("high", 0)),
            granted_low=int(granted.get("low", 0)),
            forced_low=int(p.get("forced_low_grants", 0)),
        )
        for inst in p.get("instances", []):
            if inst.get("removed"):
                continue
            instances.append(
                InstanceView(
                    name=str(inst["name"]),
                    pool=name,
                    state=str(inst["state"]),
                    in_flight=int(inst.get("in_flight", 0)),
                    max_concurrency=int(inst.get("max_concurrency", 1)),
                    consecutive_failures=int(inst.get("consecutive_failures", 0)),
                    ejections=int(inst.get("ejections", 0)),
                )
            )
    return Snapshot(t, pools, tuple(instances))


@dataclass(frozen=True, slots=True)
class Event:
    """Something that happened, at `t` seconds from the start."""

    t: float
    what: str


class LogCapture(logging.Handler):
    """What the run observed of the gateway, for the report: each answered request and every
    probe result and instance change from the gateway's typed event stream
    (`gateway.events`), and any warning it logged (shown, not parsed, instead of printed
    over the progress line)."""

    def __init__(self, wall_start: float) -> None:
        super().__init__(logging.WARNING)
        self.wall_start = wall_start
        self.access: dict[str, dict[str, Any]] = {}
        self.probe_failures: list[tuple[float, str]] = []  # (t, instance)
        self.probe_changes: list[tuple[float, str, str]] = []  # (t, instance, new state)
        self.warnings: list[str] = []

    def on_event(self, event: GatewayEvent) -> None:
        t = event.at - self.wall_start
        if isinstance(event, RequestFinished):
            self.access[event.id] = {**event.fields(), "t": t}
        elif isinstance(event, ProbeFinished):
            if not event.ok:
                self.probe_failures.append((t, event.instance))
        else:
            self.probe_changes.append((t, event.instance, event.state))

    def emit(self, record: logging.LogRecord) -> None:
        t = record.created - self.wall_start
        self.warnings.append(f"{t:6.1f}s {record.name}: {record.getMessage()}")


@contextlib.contextmanager
def _captured_logs(capture: LogCapture, events: Events) -> Iterator[None]:
    """Subscribes `capture` to the gateway's events and routes the `gateway` and `aiohttp`
    loggers' warnings to it for the run (the access log stays quiet), then restores."""
    saved: list[tuple[logging.Logger, int, bool, list[logging.Handler]]] = []
    for name in ("gateway", "aiohttp"):
        logger = logging.getLogger(name)
        saved.append((logger, logger.level, logger.propagate, logger.handlers[:]))
        logger.handlers = [capture]
        logger.propagate = False
        logger.setLevel(logging.WARNING)
    unsubscribe = events.subscribe(capture.on_event)
    try:
        yield
    finally:
        unsubscribe()
        for logger, level, propagate, handlers in saved:
            logger.handlers = handlers
            logger.propagate = propagate
            logger.setLevel(level)


@dataclass(slots=True)
class DemoResult:
    """Everything one run observed; the summary and the report are functions of it."""

    options: Options
    script: Script
    config_text: str
    classifier: str  # how complexity was decided: "classifier" or "header"
    samples: list[Sample] = field(default_factory=list)
    snapshots: list[Snapshot] = field(default_factory=list)
    events: list[Event] = field(default_factory=list)
    capture: LogCapture | None = None
    rejudge: Rejudge | None = None
    stopped_early: bool = False
    end: float = 0.0  # seconds from the start when the last answer came
    wall_s: float = 0.0
    summary: str = ""
    report_path: Path | None = None
    # Pool light's backends at the end: instance name → (prefix-cache hits, misses).
    prefix_cache: dict[str, tuple[int, int]] = field(default_factory=dict)


# ---- running it ------------------------------------------------------------------------------


async def main(
    options: Options, *, out: TextIO | None = None, stop: asyncio.Event | None = None
) -> DemoResult:
    """Runs the demo: starts everything, sends the workload, stops everything, writes the
    report. `stop` set early ends the workload (Ctrl-C); the report is written all the same.
    """
    out = out if out is not None else sys.stdout
    stop = stop if stop is not None else asyncio.Event()
    wall0 = time.monotonic()
    jobs, script = plan_workload(options)
    mocks = [
        MockServer(_behavior(model, LIGHT_BEHAVIOR, options.seed * 100 + i))
        for i, (_, model) in enumerate(LIGHT)
    ] + [
        MockServer(_behavior(model, HEAVY_BEHAVIOR, options.seed * 100 + 10 + i))
        for i, (_, model) in enumerate(HEAVY)
    ]
    crashed = mocks[len(LIGHT) + [n for n, _ in HEAVY].index(CRASHED)]
    server: Server | None = None
    # The Batch API's store lives as long as the run (SPEC §14; nothing left behind).
    store_dir = tempfile.TemporaryDirectory(prefix="gateway-demo-")
    try:
        for m in mocks:
            await m.start()
        text = config_yaml(
            options,
            [m.url for m in mocks[: len(LIGHT)]],
            [m.url for m in mocks[len(LIGHT) :]],
            batch_store=str(Path(store_dir.name) / "batches.db"),
        )
        config = parse_config(text, env={}, source="demo config")
        server = Server(config, host="127.0.0.1", port=0)
        await server.start()
        gateway = server.gateway
        port = server.port
        mode = "classifier" if _classifier_wired(gateway) else "header"
        result = DemoResult(options, script, text, mode)
        rejudge = plan_rejudge(options)
        result.rejudge = Rejudge(lines=rejudge.count(b"\n"))
        _print_intro(out, options, script, jobs, port, mode, result.rejudge.lines)
        await _drive(result, gateway, server.url, jobs, crashed, out, stop, rejudge)
        result.prefix_cache = {
            name: (m.stats.prefix_hits, m.stats.prefix_misses)
            for (name, _), m in zip(LIGHT, mocks, strict=False)
        }
    finally:
        if server is not None:
            await server.shutdown()
        for m in mocks:
            await m.stop()
        store_dir.cleanup()
    result.wall_s = time.monotonic() - wall0
    result.summary = summarize(result)
    print(result.summary, file=out)
    result.report_path = await asyncio.to_thread(
        _write, Path(options.report), render_report(result)
    )
    print(f"report: {result.report_path}  (open it in a browser)", file=out)
    print(f"demo took {result.wall_s:.0f} s", file=out, flush=True)
    return result


def _write(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path.resolve()


def _behavior(model: str, shape: dict[str, Any], seed: int) -> MockBehavior:
    # log_size 0: the demo reads what the gateway says, not the mock's request log.
    return MockBehavior(model=model, seed=seed, log_size=0, **shape)


def _classifier_wired(gateway: Gateway) -> bool:
    """True when `route: auto` classifies our complex prompts by content.

    Until the classifier lands, `auto` answers `routing.default_complexity` for everything
    and the heavy pool would see only `judge-pro` traffic; the demo then states each prompt's
    complexity with `X-Complexity` (SPEC §4's first rule) so the story stays the same.
    """
    router = gateway.runtime.router
    for prompt in COMPLEX_PROMPTS:
        body = {"model": "judge", "messages": [{"role": "user", "content": prompt}]}
        decision = router.decide("judge", {}, body)
        if decision.complexity_rule != "default" and decision.complexity == "complex":
            return True
    return False


async def _drive(
    result: DemoResult,
    gateway: Gateway,
    base: str,
    jobs: Sequence[Job],
    crashed: MockServer,
    out: TextIO,
    stop: asyncio.Event,
    rejudge_file: bytes = b"",
) -> None:
    """Sends the workload, runs the script and samples the state until every answer is in
    (and the re-judging batch, submitted through the Batch API at the start, is finished)."""
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    capture = LogCapture(time.time())
    result.capture = capture

    def now() -> float:
        return loop.time() - t0

    pending: set[asyncio.Task[None]] = set()
    finished = asyncio.Event()
    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=30)
    timeout = aiohttp.ClientTimeout(total=120)
    progress = _Progress(out, result, enabled=result.options.progress)
    with _captured_logs(capture, gateway.events):
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
            sampler = asyncio.create_task(
                _sample(gateway, result, now, progress, finished), name="demo-sampler"
            )
            script = asyncio.create_task(
                _run_script(result, crashed, now, stop), name="demo-script"
            )
            rejudge = result.rejudge if result.rejudge is not None else Rejudge(0, error="off")
            batch = asyncio.create_task(
                _rejudge(session, base, rejudge, rejudge_file, now), name="demo-rejudge"
            )
            try:
                for job in jobs:
                    delay = job.at - now()
                    if delay > 0:
                        with contextlib.suppress(TimeoutError):
                            await asyncio.wait_for(stop.wait(), delay)
                    if stop.is_set():
                        break
                    sample = Sample(job, now())
                    result.samples.append(sample)
                    task = asyncio.create_task(
                        _send(session, base, sample, now, result.classifier == "header")
                    )
                    pending.add(task)
                    task.add_done_callback(pending.discard)
                else:
                    # The workload is sent; wait (boundedly) for the answers still owed.
                    result.events.append(Event(now(), "workload sent; waiting for answers"))
                    deadline = now() + DRAIN_LIMIT_S
                    while (pending or not rejudge.done) and not stop.is_set() and now() < deadline:
                        with contextlib.suppress(TimeoutError):
                            await asyncio.wait_for(stop.wait(), 0.1)
                    if pending:
                        result.events.append(
                            Event(now(), f"stopped waiting: {len(pending)} answers still owed")
                        )
                result.stopped_early = stop.is_set()
            finally:
                for task in list(pending):
                    task.cancel()
                await asyncio.gather(*pending, return_exceptions=True)
                if not script.done():
                    script.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await script
                await _end_rejudge(session, base, rejudge, batch)
                result.end = now()
                finished.set()
                await sampler
                progress.clear()
            if crashed.refusing:
                await crashed.set_down(False)


async def _run_script(
    result: DemoResult, crashed: MockServer, now: Callable[[], float], stop: asyncio.Event
) -> None:
    """The scripted failure: crash one heavy instance, bring it back."""
    script = result.script
    for at, down in ((script.crash_at, True), (script.recover_at, False)):
        delay = at - now()
        if delay > 0:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), delay)
        if stop.is_set():
            return
        if down:
            dropped = crashed.stats.in_flight
            await crashed.set_down(True)
            result.events.append(
                Event(
                    now(),
                    f"{CRASHED} crashed: listener closed, {dropped} request(s) in flight dropped",
                )
            )
        else:
            await crashed.set_down(False)
            result.events.append(Event(now(), f"{CRASHED} restarted: accepting connections"))


async def _send(
    session: aiohttp.ClientSession,
    base: str,
    sample: Sample,
    now: Callable[[], float],
    complexity_header: bool,
) -> None:
    """One request, timed; the result goes into `sample`."""
    job = sample.job
    headers = {"Content-Type": "application/json", "X-Priority": job.priority}
    if complexity_header and job.alias == "judge":
        headers["X-Complexity"] = job.complexity
    body: dict[str, Any] = {
        "model": job.alias,
        "messages": [{"role": "user", "content": job.prompt}],
        "max_tokens": job.max_tokens,
    }
    if job.stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    try:
        async with session.post(
            base + "/v1/chat/completions", data=orjson.dumps(body), headers=headers
        ) as resp:
            h = resp.headers
            sample.status = resp.status
            sample.request_id = h.get("X-Request-Id")
            sample.pool = h.get("X-Gateway-Pool")
            sample.instance = h.get("X-Gateway-Instance")
            sample.waited_as = h.get("X-Gateway-Priority")
            sample.affinity = h.get("X-Gateway-Affinity")
            decided = h.get("X-Gateway-Complexity")
            # A rule naming a Chinese keyword arrives percent-encoded (headers are latin-1).
            sample.decided = None if decided is None else unquote(decided)
            queue_ms = h.get("X-Gateway-Queue-Ms")
            if queue_ms is not None:
                with contextlib.suppress(ValueError):
                    sample.queue_ms = float(queue_ms)
            raw = await resp.read()
            sample.done = now()
            if resp.status != 200:
                sample.error = _error_code(raw) or f"http_{resp.status}"
            elif job.stream and b'data: {"error"' in raw:
                # SPEC §6: a started stream that fails ends with an error event.
                sample.error = "stream_error"
            elif job.stream and not raw.rstrip().endswith(b"data: [DONE]"):
                sample.error = "stream_cut"
            else:
                sample.ok = True
    except asyncio.CancelledError:
        sample.error = "cancelled"
        raise
    except (aiohttp.ClientError, OSError) as exc:
        sample.done = now()
        sample.error = f"connection ({type(exc).__name__})"


def _error_code(raw: bytes) -> str | None:
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None
    err = data.get("error") if isinstance(data, dict) else None
    code = err.get("code") if isinstance(err, dict) else None
    return code if isinstance(code, str) else None


class _ApiError(Exception):
    """A Batch API call the demo makes answered with an error."""


async def _api(session: aiohttp.ClientSession, method: str, url: str, **kw: Any) -> dict[str, Any]:
    async with session.request(method, url, **kw) as resp:
        raw = await resp.read()
        if resp.status != 200:
            raise _ApiError(f"{method} {url.split('/v1', 1)[-1]}: HTTP {resp.status}")
    doc: dict[str, Any] = orjson.loads(raw)
    return doc


async def _rejudge(
    session: aiohttp.ClientSession,
    base: str,
    rejudge: Rejudge,
    data: bytes,
    now: Callable[[], float],
) -> None:
    """Submits the re-judging file as a batch (SPEC §14), then follows it to its end with
    `GET /v1/batches/{id}` as an OpenAI Batch API client does."""
    if rejudge.error:
        return
    try:
        form = aiohttp.FormData()
        form.add_field("purpose", "batch")
        form.add_field("file", data, filename="rejudge.jsonl", content_type="application/jsonl")
        f = await _api(session, "POST", base + "/v1/files", data=form)
        spec = {
            "input_file_id": f["id"],
            "endpoint": CHAT,
            "completion_window": "24h",
            "metadata": {"job": "overnight re-judging"},
        }
        b = await _api(session, "POST", base + "/v1/batches", json=spec)
        rejudge.batch_id, rejudge.submitted = b["id"], now()
        while True:
            _progress(rejudge, b, now())
            if rejudge.done:
                break
            await asyncio.sleep(REJUDGE_POLL_S)
            b = await _api(session, "GET", f"{base}/v1/batches/{rejudge.batch_id}")
        rejudge.output_lines = await _count_lines(session, base, b.get("output_file_id"))
        rejudge.error_lines = await _count_lines(session, base, b.get("error_file_id"))
    except (aiohttp.ClientError, OSError, _ApiError, orjson.JSONDecodeError, KeyError) as exc:
        rejudge.error = str(exc) or type(exc).__name__


def _progress(rejudge: Rejudge, batch: dict[str, Any], t: float) -> None:
    rejudge.status = str(batch.get("status"))
    counts = batch.get("request_counts") or {}
    rejudge.progress.append((t, int(counts.get("completed", 0)), int(counts.get("failed", 0))))
    if rejudge.done and rejudge.finished is None:
        rejudge.finished = t


async def _count_lines(session: aiohttp.ClientSession, base: str, file_id: Any) -> int:
    if not isinstance(file_id, str):
        return 0
    async with session.get(f"{base}/v1/files/{file_id}/content") as resp:
        return (await resp.read()).count(b"\n") if resp.status == 200 else 0


async def _end_rejudge(
    session: aiohttp.ClientSession,
    base: str,
    rejudge: Rejudge,
    task: asyncio.Task[None],
) -> None:
    """A run stopped before the batch finished cancels it (SPEC §14: `cancelling` →
    `cancelled`, partial results kept) and gives it a moment to get there."""
    if not rejudge.done and rejudge.batch_id is not None:
        with contextlib.suppress(aiohttp.ClientError, OSError, _ApiError):
            await _api(session, "POST", f"{base}/v1/batches/{rejudge.batch_id}/cancel")
        await asyncio.wait([task], timeout=REJUDGE_CANCEL_WAIT_S)
    if not task.done():
        task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


async def _sample(
    gateway: Gateway,
    result: DemoResult,
    now: Callable[[], float],
    progress: _Progress,
    finished: asyncio.Event,
) -> None:
    """Samples the gateway's state every 200 ms (and once more at the end)."""
    while True:
        result.snapshots.append(snapshot_of(now(), gateway.admin.state()))
        progress.update(result.snapshots[-1], now())
        if finished.is_set():
            return
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(finished.wait(), SAMPLE_EVERY_S)


class _Progress:
    """One live status line: rewritten in place on a terminal, every 5 s otherwise."""

    def __init__(self, out: TextIO, result: DemoResult, enabled: bool) -> None:
        self.out = out
        self.result = result
        self.enabled = enabled
        self.tty = enabled and out.isatty()
        self.last = 0.0  # the first line once there is something to say
        self.width = 0

    def update(self, snap: Snapshot, t: float) -> None:
        if not self.enabled:
            return
        every = 0.5 if self.tty else 5.0
        if t - self.last < every:
            return
        self.last = t
        if self.tty:
            # A line wider than the terminal would wrap, and `\r` would then rewrite only
            # its last row: drop the least important parts until it fits.
            cols = shutil.get_terminal_size((120, 24)).columns - 1
            line = self.line(snap, t, cols)[:cols]
            self.out.write("\r" + line.ljust(self.width))
            self.width = len(line)
        else:
            self.out.write(self.line(snap, t) + "\n")
        self.out.flush()

    def line(self, snap: Snapshot, t: float, width: int = 1_000) -> str:
        """`t  done/sent failed | wait p50/p99 per class | queued per pool | instances`."""
        samples = self.result.samples
        done = [s for s in samples if s.done is not None]
        failed = sum(1 for s in done if not s.ok)
        head = f"{t:5.1f}s done {len(done)}/{len(samples)} failed {failed}"
        waits = "wait p50/p99"
        for cls, short in (("high", "rt"), ("low", "batch")):
            w = [s.queue_ms for s in done if s.job.priority == cls and s.queue_ms is not None]
            waits += f" {short} {_compact(percentile(w, 50))}/{_compact(percentile(w, 99))}"
        queues = "queued rt+batch " + " ".join(
            f"{name} {p.queued_high}+{p.queued_low}" for name, p in snap.pools.items()
        )
        instances = " ".join(
            f"{i.name} {i.in_flight}/{i.max_concurrency}"
            + ("" if i.state == "healthy" else f" {i.state.upper()}")
            for i in snap.instances
        )
        unwell = " ".join(
            f"{i.name} {i.state.upper()}" for i in snap.instances if i.state != "healthy"
        )
        states = unwell or "all instances healthy"
        r = self.result.rejudge
        rejudge = ""
        if r is not None and r.progress:
            _, done_n, failed_n = r.progress[-1]
            rejudge = f"rejudge {done_n + failed_n}/{r.lines} {r.status}"
        # From the richest to the leanest; a narrow terminal gets the first that fits.
        variants = (
            (head, waits, queues, instances, rejudge),
            (head, waits, instances, rejudge),
            (head, waits, instances),
            (head, waits, states),
            (head, states),
        )
        lines = [" | ".join(x for x in v if x) for v in variants]
        return next((line for line in lines if len(line) <= width), lines[-1])

    def clear(self) -> None:
        if self.tty and self.width:
            self.out.write("\r" + " " * self.width + "\r")
            self.out.flush()
            self.width = 0


def _compact(ms: float) -> str:
    return fmt_ms(ms).replace(" ", "")


def _print_intro(
    out: TextIO,
    options: Options,
    script: Script,
    jobs: Sequence[Job],
    port: int,
    mode: str,
    rejudge_lines: int = 0,
) -> None:
    backlog = sum(1 for j in jobs if j.origin == "backlog")
    policy = "weighted 7:3" if options.policy == "weighted" else "strict"
    light = ", ".join(n for n, _ in LIGHT)
    heavy = ", ".join(n for n, _ in HEAVY)
    a, b = script.surge
    lines = [
        f"gateway {__version__} demo — backends, gateway and clients all in this process",
        f"  gateway   http://127.0.0.1:{port}  (GET /admin/state or open /dashboard meanwhile)",
        f"  pools     light: {light} ({LIGHT_SLOTS} slots each, ~80 ms)",
        f"            heavy: {heavy} ({HEAVY_SLOTS} slots each, ~600 ms heavy-tailed),"
        " fallback light",
        f"  policy    {policy} · balancer {options.balancer} · seed {options.seed}",
        f"  workload  {len(jobs)} requests in {options.duration:g} s: {backlog} batch queued at "
        f"once, a live stream at {options.rate:g}/s",
        f"            ({REALTIME_SHARE:.0%} realtime), an exam-deadline surge at {a:.3g}–{b:.3g} s",
        f"  failure   {CRASHED} crashes at {script.crash_at:.3g} s, restarts at "
        f"{script.recover_at:.3g} s",
        f"  routing   complexity {_mode_text(mode)}",
    ]
    if rejudge_lines:
        lines.append(
            f"  batch API the overnight re-judging: {rejudge_lines} lines in one batch "
            "(POST /v1/files, /v1/batches), run at low priority beside the backlog"
        )
    if options.progress:
        lines.append(
            "  progress  wait = queue wait p50/p99 per class · queued = realtime+batch per pool"
            " · in flight/slots per instance"
        )
    print("\n".join(lines), file=out, flush=True)


def _mode_text(mode: str) -> str:
    if mode == "classifier":
        return "decided by the gateway's auto classifier from each prompt"
    return (
        "sent as X-Complexity on `judge` requests (the auto\n"
        "            classifier is not wired in yet: `auto` answers routing.default_complexity)"
    )


# ---- analysis --------------------------------------------------------------------------------


def _waits(samples: Sequence[Sample], cls: str, pool: str | None = None) -> list[float]:
    return [
        s.queue_ms
        for s in samples
        if s.job.priority == cls and s.queue_ms is not None and (pool is None or s.pool == pool)
    ]


def _pool_names(result: DemoResult) -> list[str]:
    return list(result.snapshots[0].pools) if result.snapshots else ["light", "heavy"]


def grant_buckets(
    snapshots: Sequence[Snapshot], pool: str, bucket: float = 1.0
) -> tuple[list[float], list[float], list[float], list[float]]:
    """Grants per `bucket` seconds: (bucket starts, high, low by turn, low forced by the
    starvation guard), from the differences of the cumulative counters between samples."""
    n = math.ceil(snapshots[-1].t / bucket) + 1 if snapshots else 0
    high, low, forced = [0.0] * n, [0.0] * n, [0.0] * n
    for a, b in itertools.pairwise(snapshots):
        pa, pb = a.pools.get(pool), b.pools.get(pool)
        if pa is None or pb is None:
            continue
        i = min(int(b.t / bucket), n - 1)
        f = pb.forced_low - pa.forced_low
        high[i] += pb.granted_high - pa.granted_high
        low[i] += pb.granted_low - pa.granted_low - f
        forced[i] += f
    return [i * bucket for i in range(n)], high, low, forced


def both_waiting(snapshots: Sequence[Snapshot], pool: str) -> list[Span]:
    """The stretches of time when both of `pool`'s queues were non-empty (at both ends of a
    sampling interval): where the scheduler had to choose between the classes."""
    spans: list[Span] = []
    for a, b in itertools.pairwise(snapshots):
        pa, pb = a.pools.get(pool), b.pools.get(pool)
        if pa is None or pb is None:
            continue
        if min(pa.queued_high, pa.queued_low, pb.queued_high, pb.queued_low) == 0:
            continue
        if spans and abs(spans[-1].end - a.t) < 1e-9:
            spans[-1] = Span(spans[-1].start, b.t, spans[-1].label, spans[-1].color)
        else:
            spans.append(Span(a.t, b.t, "both classes waiting", "#dde7f3"))
    return spans


@dataclass(frozen=True, slots=True)
class Wait:
    """One request's stay in a pool's queue, in seconds from the start; `end` is its grant."""

    pool: str
    cls: str  # the class it waited in
    start: float
    end: float


# A request dispatched at once still spends a few microseconds in `acquire`.
_QUEUED_MS: Final = 0.2


def queue_waits(result: DemoResult) -> list[Wait]:
    """Every queued request's wait, from the gateway's access log.

    The log line is written when a request ends, with `total_ms` since it arrived and
    `queue_ms` spent queued; queueing starts as soon as it is parsed and routed, so its wait
    is [end − total, end − total + queue] to well under a millisecond. The client's clock
    would do worse: it starts before the request has even reached the gateway, and under
    load that is milliseconds. Requests tried more than once (their waits summed) are left
    out. Without usable access lines the client's view stands in.
    """
    cap = result.capture
    entries = list(cap.access.values()) if cap is not None else []
    out: list[Wait] = []
    if entries and all("total_ms" in f and "queue_ms" in f and "t" in f for f in entries):
        for f in entries:
            queue_ms = float(f["queue_ms"] or 0.0)
            cls, pool = f.get("priority"), f.get("pool")
            if queue_ms < _QUEUED_MS or f.get("attempts") != 1 or cls not in CLASS_NAME:
                continue
            start = float(f["t"]) - float(f["total_ms"]) / 1000
            out.append(Wait(str(pool), str(cls), start, start + queue_ms / 1000))
        return out
    for x in result.samples:
        if x.pool is None or x.queue_ms is None or x.queue_ms < _QUEUED_MS:
            continue
        cls = x.waited_as if x.waited_as in CLASS_NAME else x.job.priority
        out.append(Wait(x.pool, cls, x.sent, x.sent + x.queue_ms / 1000))
    return out


def contended_grants(waits: Sequence[Wait], pool: str) -> tuple[int, int]:
    """(high, low) grants in `pool` made while a request of the other class was waiting.

    Only there does the policy choose (SPEC §3 "Selection"), so only there should the split
    be 7:3. A grant is contended when its moment falls inside another class's wait. Counted
    per grant, where sampling the state's counters every 200 ms would blur the moments one
    queue ran empty.
    """
    margin = 0.001
    by_class: dict[str, list[tuple[float, float]]] = {"high": [], "low": []}
    for w in waits:
        if w.pool == pool and w.cls in by_class:
            by_class[w.cls].append((w.start, w.end))
    unions = {cls: _union(iv) for cls, iv in by_class.items()}
    counts = {"high": 0, "low": 0}
    for cls, other in (("high", "low"), ("low", "high")):
        starts, ends = unions[other]
        for _, granted in by_class[cls]:
            i = bisect.bisect_right(starts, granted - margin) - 1
            if i >= 0 and ends[i] > granted + margin:
                counts[cls] += 1
    return counts["high"], counts["low"]


def _union(intervals: list[tuple[float, float]]) -> tuple[list[float], list[float]]:
    """Sorted, merged intervals as (starts, ends)."""
    starts: list[float] = []
    ends: list[float] = []
    for a, b in sorted(intervals):
        if ends and a <= ends[-1]:
            ends[-1] = max(ends[-1], b)
        else:
            starts.append(a)
            ends.append(b)
    return starts, ends


def state_bands(snapshots: Sequence[Snapshot]) -> dict[str, list[Band]]:
    """Each instance's states over time, consecutive samples in one state merged."""
    bands: dict[str, list[Band]] = {}
    for a, b in itertools.pairwise(snapshots):
        for inst in a.instances:
            lane = bands.setdefault(inst.name, [])
            if lane and lane[-1].state == inst.state and abs(lane[-1].end - a.t) < 1e-9:
                lane[-1] = Band(lane[-1].start, b.t, inst.state)
            else:
                lane.append(Band(a.t, b.t, inst.state))
    return bands


def transitions(snapshots: Sequence[Snapshot]) -> list[tuple[float, InstanceView, str]]:
    """(time first seen, the instance then, its previous state) for every state change."""
    out: list[tuple[float, InstanceView, str]] = []
    last: dict[str, str] = {}
    for snap in snapshots:
        for inst in snap.instances:
            prev = last.get(inst.name, "healthy")
            if inst.state != prev:
                out.append((snap.t, inst, prev))
            last[inst.name] = inst.state
    return out


def _timeline(result: DemoResult) -> list[tuple[float, str]]:
    """The crash story, in order: scripted events, state changes seen by sampling, probes."""
    cap = result.capture
    entries: list[tuple[float, str]] = [(e.t, e.what) for e in result.events if "crash" in e.what]
    entries += [(e.t, e.what) for e in result.events if "restarted" in e.what]
    for t, inst, prev in transitions(result.snapshots):
        if inst.state == "ejected":
            why = (
                "its half-open trial failed; the ejection time doubles"
                if prev == "half_open"
                else f"{FAILURE_THRESHOLD} consecutive failures"
            )
            entries.append((t, f"{inst.name} ejected ({why}); ejection #{inst.ejections or 1}"))
        elif inst.state == "half_open":
            entries.append(
                (
                    t,
                    f"{inst.name} half-open: ejection over, a probe passed; trials one at a time",
                )
            )
        else:
            entries.append((t, f"{inst.name} healthy again (trial requests succeeded)"))
    if cap is not None:
        retried = [
            f
            for f in cap.access.values()
            if int(f.get("attempts") or 0) > 1 and f.get("pool") and f.get("source") != "batch"
        ]
        if retried:
            first, last = min(f["t"] for f in retried), max(f["t"] for f in retried)
            ok = sum(1 for f in retried if f.get("status") == 200)
            entries.append(
                (
                    first,
                    f"{len(retried)} request(s) failed before any byte reached the client:\n"
                    f"retried on another instance, {ok} answered (the last at {last:.1f} s)",
                )
            )
        fails = [t for t, name in cap.probe_failures if name == CRASHED]
        if fails:
            entries.append(
                (
                    fails[0],
                    f"{CRASHED} probes fail ({len(fails)} until {fails[-1]:.1f} s; "
                    "each counts as a failure)",
                )
            )
    entries.sort(key=lambda e: e[0])
    return entries


def _story_lines(story: Sequence[tuple[float, str]]) -> list[str]:
    """`  12.3 s  what happened`, continuation lines indented under the text."""
    out = []
    for t, what in story:
        first, *more = what.split("\n")
        out.append(f"  {t:6.1f} s  {first}")
        out.extend(" " * 12 + line for line in more)
    return out


def _retried(result: DemoResult) -> tuple[int, int]:
    """(requests that needed more than one attempt, of which answered successfully)."""
    cap = result.capture
    if cap is None:
        return 0, 0
    ok_ids = {s.request_id for s in result.samples if s.ok}
    retried = [
        rid
        for rid, f in cap.access.items()
        if int(f.get("attempts") or 0) > 1 and f.get("source") != "batch"
    ]
    return len(retried), sum(1 for rid in retried if rid in ok_ids)


# ---- the summary -----------------------------------------------------------------------------


def _class_row(label: str, samples: Sequence[Sample], cls: str) -> str:
    """count, ok, failed, p50/p99 queue wait, p50/p99 end-to-end latency. Requests the demo
    itself cancelled (stopped early) are neither ok nor failed."""
    finished = [x for x in samples if x.error != "cancelled" and (x.done is not None or x.error)]
    ok = [x for x in samples if x.ok]
    waits = _waits(samples, cls)
    e2e = [x.e2e_ms for x in ok if x.e2e_ms is not None]
    return (
        f"{label:<16}{len(samples):>6}{len(ok):>7}{len(finished) - len(ok):>8}"
        f"{fmt_ms(percentile(waits, 50)):>11}{fmt_ms(percentile(waits, 99)):>11}"
        f"{fmt_ms(percentile(e2e, 50)):>10}{fmt_ms(percentile(e2e, 99)):>10}"
    )


def summarize(result: DemoResult) -> str:
    """The plain-text summary printed at the end (and shown in the report)."""
    o, s = result.options, result.samples
    lines: list[str] = []
    add = lines.append
    span = f"{o.duration:g} s"
    if result.stopped_early:
        last_sent = max((x.sent for x in s), default=0.0)
        span = f"stopped early after {last_sent:.0f} of {o.duration:g} s"
    add(
        f"gateway demo: {span} of judge traffic at {o.rate:g}/s · policy {o.policy} · "
        f"balancer {o.balancer} · seed {o.seed} · {result.wall_s:.0f} s wall"
    )
    add("")
    add(
        f"{'class':<16}{'sent':>6}{'ok':>7}{'failed':>8}{'wait p50':>11}{'wait p99':>11}"
        f"{'e2e p50':>10}{'e2e p99':>10}"
    )
    for cls in ("high", "low"):
        mine = [x for x in s if x.job.priority == cls]
        add(_class_row(f"{CLASS_NAME[cls]} ({cls})", mine, cls))
        for pool in _pool_names(result):
            add(_class_row(f"  in {pool}", [x for x in mine if x.pool == pool], cls))
    failures = Counter(x.error for x in s if x.error not in (None, "cancelled"))
    if failures:
        add("  failures: " + ", ".join(f"{n} {why}" for why, n in failures.most_common()))
    cancelled = sum(1 for x in s if x.error == "cancelled")
    if cancelled:
        add(f"  cancelled: {cancelled} (the demo stopped before they were answered)")
    add("")
    last = result.snapshots[-1] if result.snapshots else None
    add(f"{'pool / instance':<18}{'served':>8}{'ejections':>11}{'peak':>7}{'busy':>7}")
    served = Counter(x.instance for x in s if x.ok)
    for pool in _pool_names(result):
        pool_served = sum(1 for x in s if x.ok and x.pool == pool)
        add(f"{pool:<18}{pool_served:>8}")
        for inst in last.instances if last else ():
            if inst.pool != pool:
                continue
            series = [i for snap in result.snapshots for i in snap.instances if i.name == inst.name]
            peak = max(i.in_flight for i in series)
            busy = sum(i.in_flight for i in series) / (len(series) * inst.max_concurrency)
            add(
                f"  {inst.name:<16}{served[inst.name]:>8}{inst.ejections:>11}"
                f"{f'{peak}/{inst.max_concurrency}':>7}{busy:>7.0%}"
            )
    retried, retried_ok = _retried(result)
    add(f"  retried on another instance: {retried} request(s), {retried_ok} of them answered")
    add("")
    lines.extend(_affinity_lines(result))
    add("scheduling — grants made while both classes waited (the policy's choice):")
    waits = queue_waits(result)
    for pool in _pool_names(result):
        high, low = contended_grants(waits, pool)
        total = high + low
        forced = last.pools[pool].forced_low if last and pool in last.pools else 0
        if total:
            add(
                f"  {pool:<6} high {high:>4} : low {low:>4} = {high / total:4.0%} : "
                f"{low / total:4.0%} · forced low grants (starvation guard) {forced}"
            )
        else:
            add(f"  {pool:<6} the two classes never waited at once · forced low grants {forced}")
    all_forced = sum(p.forced_low for p in last.pools.values()) if last else 0
    if o.policy == "weighted" and all_forced == 0:
        add("  (weighted 7:3 keeps batch moving by itself, so the starvation guard never had")
        add("   to act; run with --policy strict to see it force low grants)")
    low_waits = _waits(s, "low")
    high_waits = _waits(s, "high")
    add(
        f"  longest batch wait {fmt_ms(max(low_waits, default=math.nan))} · longest realtime "
        f"wait {fmt_ms(max(high_waits, default=math.nan))}"
    )
    add("")
    add(f"routing — complexity {_mode_text(result.classifier)}")
    routed = Counter((x.job.complexity, x.pool) for x in s if x.pool is not None)
    for cx in ("simple", "complex"):
        where = ", ".join(
            f"{n} → {pool}" for (c, pool), n in sorted(routed.items(), key=str) if c == cx
        )
        add(f"  {cx:<8} {where or '-'}")
    rules = Counter((x.decided or "").split(";", 1)[-1].strip() for x in s if x.decided)
    if rules:
        add("  decided by: " + ", ".join(f"{r} ×{n}" for r, n in rules.most_common()))
    if result.classifier == "classifier":
        auto = [x for x in s if x.job.alias == "judge" and x.decided]
        agree = sum(1 for x in auto if (x.decided or "").split(";", 1)[0] == x.job.complexity)
        add(f"  the classifier agreed with the prompt's real complexity on {agree}/{len(auto)}")
    add("")
    rejudge = _rejudge_summary(result)
    if rejudge:
        lines.extend([*rejudge, ""])
    add(f"crash timeline ({CRASHED}):")
    story = _timeline(result)
    lines.extend(_story_lines(story))
    if not story:
        add("  (the run ended before the crash)")
    hit = [x for x in s if x.instance == CRASHED and x.error not in (None, "cancelled")]
    if hit:
        why = Counter(x.error for x in hit)
        add(
            f"  lost to the crash: {len(hit)} request(s) "
            f"({', '.join(f'{n} {e}' for e, n in why.items())})"
        )
        add("    (a stream that has started is never retried: it ends with an error event)")
    if result.capture is not None and result.capture.warnings:
        add("")
        add(f"gateway warnings ({len(result.capture.warnings)}):")
        lines.extend("  " + w for w in result.capture.warnings[:10])
    return "\n".join(lines) + "\n"


def prefix_hit_rate(result: DemoResult) -> float | None:
    """Pool light's prefix-cache hit rate over its backends (None before any lookup)."""
    hits = sum(h for h, _ in result.prefix_cache.values())
    lookups = hits + sum(m for _, m in result.prefix_cache.values())
    return hits / lookups if lookups else None


def _rate_text(rate: float | None) -> str:
    return "-" if rate is None else f"{rate:.0%}"


def _affinity_lines(result: DemoResult) -> list[str]:
    """SPEC §15: where pool light's requests landed relative to their prompt's instance, and
    how often its backends' prefix caches hit."""
    placed = Counter(x.affinity for x in result.samples if x.pool == "light" and x.affinity)
    rate = prefix_hit_rate(result)
    per = ", ".join(
        f"{name} {h / (h + m):.0%}" for name, (h, m) in result.prefix_cache.items() if h + m
    )
    return [
        f"affinity — pool light balances by prompt prefix ({LIGHT_BALANCER}, SPEC §15):",
        f"  X-Gateway-Affinity: hit {placed['hit']} · spill {placed['spill']} "
        f"(first choice full or over (1 + ε) × average)",
        f"  prefix-cache hit rate {_rate_text(rate)}" + (f" ({per})" if per else ""),
        "",
    ]


# ---- the report ------------------------------------------------------------------------------


def _markers(result: DemoResult) -> list[Marker]:
    out = []
    for e in result.events:
        if "crashed" in e.what:
            out.append(Marker(e.t, f"{CRASHED} crashes", "#D55E00"))
        elif "restarted" in e.what:
            out.append(Marker(e.t, f"{CRASHED} restarts", "#009E73"))
        elif e.what.startswith("workload sent"):
            out.append(Marker(e.t, "arrivals end", "#777"))
    return out


def _depth_series(snapshots: Sequence[Snapshot], pool: str, cls: str) -> Series:
    points = [
        (x.t, float(x.pools[pool].queued_high if cls == "high" else x.pools[pool].queued_low))
        for x in snapshots
        if pool in x.pools
    ]
    peak = max((y for _, y in points), default=0.0)
    label = f"{CLASS_NAME[cls]} ({cls}) queued, peak {peak:.0f}"
    return Series(label, points, CLASS_COLOR[cls], width=2.5 if cls == "high" else 2.0)


def _surge_span(result: DemoResult) -> Span:
    a, b = result.script.surge
    return Span(a, b, "exam-deadline surge", "#fbeee0")


def render_report(result: DemoResult) -> str:
    """The HTML report: the charts, the summary and the config, in one self-contained page."""
    s = result.samples
    x_range = (0.0, max(result.end, 1.0))
    markers = _markers(result)
    # The crash concerns pool heavy; light's charts mark only when arrivals end.
    ends = [m for m in markers if m.label == "arrivals end"]
    surge = _surge_span(result)
    wait_groups = []
    heavy_only = []
    for cls in ("high", "low"):
        waits = _waits(s, cls)
        at_once = sum(1 for w in waits if w < 1.0) / len(waits) if waits else 0.0
        wait_groups.append(
            (
                f"{CLASS_NAME[cls]} ({cls}) n={len(waits)}, p99 {fmt_ms(percentile(waits, 99))}, "
                f"{at_once:.0%} under 1 ms",
                waits,
                CLASS_COLOR[cls],
            )
        )
    for cls in ("high", "low"):
        # The heavy pool alone: its few slots (and the crash) make its tail.
        waits = _waits(s, cls, "heavy")
        label = f"{CLASS_NAME[cls]} in pool heavy only, p99 {fmt_ms(percentile(waits, 99))}"
        wait_groups.append((label, waits, CLASS_COLOR[cls]))
        heavy_only.append(label)
    cdf = cdf_chart(
        "Queue wait per class (CDF, X-Gateway-Queue-Ms)",
        wait_groups,
        x_label="time spent queued in the gateway (log scale)",
        dashed=heavy_only,
    )
    scheduling: list[tuple[str, str]] = []
    queues: list[tuple[str, str]] = []
    balancing: list[tuple[str, str]] = []
    for pool in _pool_names(result):
        starts, high, low, forced = grant_buckets(result.snapshots, pool)
        h, lo = contended_grants(queue_waits(result), pool)
        spans = both_waiting(result.snapshots, pool)
        share = f"{h / (h + lo):.0%} : {lo / (h + lo):.0%}" if h + lo else "n/a"
        scheduling.append(
            (
                bar_chart(
                    f"Grants per second by class — pool {pool}",
                    starts,
                    [
                        Bars("realtime (high)", high, CLASS_COLOR["high"]),
                        Bars("batch (low)", low, CLASS_COLOR["low"]),
                        Bars(
                            f"batch forced by the starvation guard ({sum(forced):.0f})",
                            forced,
                            CLASS_COLOR["forced"],
                        ),
                    ],
                    x_label="seconds since start",
                    y_label="slots granted per second",
                    x_range=x_range,
                    x_fmt=fmt_seconds,
                    spans=spans,
                    markers=markers if pool == "heavy" else ends,
                ),
                f"Each bar is one second of slot grants in pool {pool}. Shaded: both queues were "
                f"waiting, so the scheduler had to choose — there the split is {share} "
                f"(high : low; policy {result.options.policy}). Outside the shading one class "
                "had the pool to itself (work-conserving: an empty class cedes its turns).",
            )
        )
        queues.append(
            (
                line_chart(
                    f"Queue depth — pool {pool}",
                    [
                        _depth_series(result.snapshots, pool, "high"),
                        _depth_series(result.snapshots, pool, "low"),
                    ],
                    x_label="seconds since start",
                    y_label="requests waiting",
                    x_range=x_range,
                    x_fmt=fmt_seconds,
                    spans=[surge],
                    markers=markers if pool == "heavy" else ends,
                    height=240,
                ),
                f"Requests waiting in pool {pool}'s dual queue, sampled every 200 ms from "
                "/admin/state. The batch backlog drains while realtime stays near zero.",
            )
        )
        insts = result.snapshots[0].instances if result.snapshots else ()
        members = [i for i in insts if i.pool == pool]
        series = [
            Series(
                i.name,
                [
                    # Nudged apart by a few pixels: equal lines would hide each other.
                    (x.t, v.in_flight + 0.04 * (k - (len(members) - 1) / 2))
                    for x in result.snapshots
                    for v in x.instances
                    if v.name == i.name
                ],
                INSTANCE_COLOR.get(i.name, "#000"),
                step=True,
            )
            for k, i in enumerate(members)
        ]
        cap = max((i.max_concurrency for i in insts if i.pool == pool), default=1)
        series.append(
            Series("max_concurrency", [(x_range[0], cap), (x_range[1], cap)], "#888", dashed=True)
        )
        balancing.append(
            (
                line_chart(
                    f"In flight per instance — pool {pool} "
                    f"({LIGHT_BALANCER if pool == 'light' else result.options.balancer})",
                    series,
                    x_label="seconds since start",
                    y_label="requests in flight",
                    x_range=x_range,
                    y_range=(0, cap + 0.5),
                    y_ticks=range(cap + 1),
                    x_fmt=fmt_seconds,
                    markers=markers if pool == "heavy" else ends,
                    height=240,
                ),
                "Slots in use on each instance; never above max_concurrency (dashed). "
                + (
                    f"When {CRASHED} crashes its line drops to zero and its load moves to the "
                    "other instance; after the restart it takes one half-open trial at a time "
                    "before it is trusted again."
                    if pool == "heavy"
                    else "Affinity sends each judge prompt back to the instance whose prefix "
                    "cache holds it, while no instance goes above (1 + ε) × the average load: "
                    f"prefix-cache hit rate {_rate_text(prefix_hit_rate(result))}."
                ),
            )
        )
    bands = state_bands(result.snapshots)
    timeline_svg = timeline_chart(
        "Instance state over time (sampled from /admin/state every 200 ms)",
        list(bands.items()),
        {
            "healthy": STATE_COLOR["healthy"],
            "half_open": STATE_COLOR["half_open"],
            "ejected": STATE_COLOR["ejected"],
        },
        x_range=x_range,
        x_label="seconds since start",
        x_fmt=fmt_seconds,
        markers=markers,
    )
    story = "\n".join(_story_lines(_timeline(result))) or "(the run ended before the crash)"
    groups = []
    for pool in _pool_names(result):
        vals = [x.service_ms for x in s if x.ok and x.pool == pool and x.service_ms is not None]
        groups.append(BoxGroup(f"pool {pool}", vals, "#555"))
        for name in sorted({x.instance for x in s if x.pool == pool and x.instance}):
            vals = [x.service_ms for x in s if x.ok and x.instance == name and x.service_ms]
            groups.append(BoxGroup(name, vals, INSTANCE_COLOR.get(name, "#000")))
    latency = box_chart(
        "Service time by pool and instance (end-to-end minus queue wait)",
        groups,
        y_label="milliseconds (log scale)",
        log_y=True,
        y_fmt=fmt_ms,
    )
    o = result.options
    intro = (
        "An online judge sends two kinds of requests through one gateway: realtime ones "
        "(a student is waiting for the verdict) and batch ones (re-judging history). Simple "
        "questions go to the fast, cheap pool light, complex ones to the strong pool heavy. "
        f"This run started {sum(1 for x in s if x.job.origin == 'backlog')} batch requests "
        f"at once, then a live stream at {o.rate:g} requests/s with an exam-deadline surge, "
        f"and crashed {CRASHED} (one of the two heavy instances) for a while."
        "\n\n"
        "What to look for: realtime keeps short waits while the batch backlog is worked off "
        "(7 of every 10 contested slots go to realtime, the other 3 keep batch moving); the "
        f"crashed instance is ejected within moments, its requests are retried on the other "
        "instance, and once it restarts it is probed, tried half-open and restored."
    )
    sections = [
        ("Realtime vs batch: time spent waiting", [(cdf, _cdf_caption())]),
        ("Scheduling: who gets each freed slot", scheduling),
        ("Queues", queues),
        *_rejudge_section(result, x_range, ends),
        ("Balancing across instances", balancing),
        (
            "Health: the crash and the recovery",
            [
                (
                    timeline_svg,
                    "Green: healthy · yellow: half-open (trial requests) · red: ejected. "
                    "What happened, in order:",
                ),
                (f'<pre class="story">{html.escape(story)}</pre>', ""),
            ],
        ),
        (
            "Latency by pool",
            [
                (
                    latency,
                    "light is lognormal around 80 ms; heavy is heavy-tailed (Pareto, mean "
                    "600 ms) plus its slower token stream. Retries around the crash add to "
                    "a few heavy requests.",
                )
            ],
        ),
    ]
    return page(
        "gateway demo report",
        intro,
        sections,
        appendix=[
            ("Summary", result.summary),
            ("Configuration used", result.config_text),
        ],
        meta=f"gateway {__version__} · {time.strftime('%Y-%m-%d %H:%M:%S')} · seed {o.seed}",
    )


def _rejudge_summary(result: DemoResult) -> list[str]:
    """The re-judging batch's part of the summary (SPEC §14)."""
    r = result.rejudge
    if r is None:
        return []
    out = ["Batch API — the overnight re-judging as one batch (POST /v1/files, /v1/batches):"]
    if r.error:
        return [*out, f"  not run: {r.error}"]
    done, failed = r.progress[-1][1:] if r.progress else (0, 0)
    took = ""
    if r.finished is not None and r.submitted is not None:
        took = f" after {r.finished - r.submitted:.1f} s"
    out.append(
        f"  {r.batch_id} · {r.lines} lines · completed {done}, failed {failed} · {r.status}{took}"
    )
    backlog = sum(1 for x in result.samples if x.job.origin == "backlog")
    out.append(
        f"  fed at most {Batch().in_flight_per_batch} lines at a time into the low queue, as a "
        f"tenant of its own beside the {backlog} backlog requests"
    )
    if r.output_lines or r.error_lines:
        out.append(f"  output file {r.output_lines} lines · error file {r.error_lines} lines")
    return out


def _rejudge_section(
    result: DemoResult, x_range: tuple[float, float], markers: Sequence[Marker]
) -> list[tuple[str, list[tuple[str, str]]]]:
    """The report's chart of the re-judging batch's progress (none if it never ran)."""
    r = result.rejudge
    if r is None or not r.progress:
        return []
    done = [(t, float(c)) for t, c, _ in r.progress]
    failed = [(t, float(f)) for t, _, f in r.progress]
    total = [(x_range[0], float(r.lines)), (x_range[1], float(r.lines))]
    chart = line_chart(
        "Batch API: overnight re-judging progress (GET /v1/batches/{id})",
        [
            Series(f"lines completed ({done[-1][1]:.0f})", done, CLASS_COLOR["low"], step=True),
            Series(f"lines failed ({failed[-1][1]:.0f})", failed, "#D55E00", step=True),
            Series(f"lines in the batch ({r.lines})", total, "#888", dashed=True),
        ],
        x_label="seconds since start",
        y_label="lines",
        x_range=x_range,
        y_range=(0, r.lines * 1.05 + 1),
        x_fmt=fmt_seconds,
        markers=markers,
        height=240,
    )
    caption = (
        f"The overnight re-judging as one Batch API batch ({r.lines} lines, status {r.status}): "
        "uploaded as JSONL, run line by line at low priority through the same queues, "
        "retries and health as live requests, at most "
        f"{Batch().in_flight_per_batch} lines at a time, as a tenant of its own in the low "
        "queue — so it shares the batch class with the backlog and never crowds out realtime."
    )
    return [("Batch API: the overnight re-judging", [(chart, caption)])]


def _cdf_caption() -> str:
    return (
        "For each class, the share of requests (y) that waited at most x in the gateway's "
        "queue before a slot was granted. The step at the left edge is the share dispatched "
        "at once (an idle pool adds no queueing delay). Realtime's curve rises far to the "
        "left of batch's: the dual queue keeps students from waiting behind the backlog."
    )


# ---- the command -----------------------------------------------------------------------------


def run(args: argparse.Namespace) -> int:
    """`gateway demo`: returns 0 when the demo ran and the report was written."""
    options = options_from_args(args)
    if not Path(options.report).resolve().parent.is_dir():
        # Say so now, not after a minute of demo.
        print(f"gateway demo: no directory for the report {options.report!r}", file=sys.stderr)
        return 2

    async def go() -> DemoResult:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()

        def first_interrupt() -> None:
            print("\nstopping early: waiting for nothing more, writing the report…", flush=True)
            stop.set()
            # A second Ctrl-C interrupts for real.
            loop.remove_signal_handler(signal.SIGINT)

        loop.add_signal_handler(signal.SIGINT, first_interrupt)
        loop.add_signal_handler(signal.SIGTERM, stop.set)
        return await main(options, stop=stop)

    try:
        asyncio.run(go())
    except OSError as exc:
        print(f"gateway demo: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\ngateway demo: interrupted", file=sys.stderr)
        return 130
    return 0
