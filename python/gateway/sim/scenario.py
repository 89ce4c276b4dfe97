"""The demo's scenario: the pools, the judge workload, the scripted crash and the config.

All of it is a function of `Options` (seeded: one seed, one story). The sizes are chosen for a
2-core laptop; the times of the scripted events are fractions of `--duration`, so a short run
tells the same story.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

import orjson

__all__ = [
    "BACKLOG_COMPLEX_SHARE",
    "BACKLOG_PER_RATE_SECOND",
    "BATCH_TTFT_MS",
    "CHAT",
    "CLASS_NAME",
    "COMPLEXITY_BY",
    "COMPLEX_PROMPTS",
    "COMPLEX_SHARE",
    "CRASHED",
    "CRASH_AT",
    "DRAIN_LIMIT_S",
    "EJECTION_MS",
    "FAILURE_THRESHOLD",
    "HEAVY",
    "HEAVY_BEHAVIOR",
    "HEAVY_SLOTS",
    "LIGHT",
    "LIGHT_BALANCER",
    "LIGHT_BEHAVIOR",
    "LIGHT_KNEE",
    "LIGHT_SLOTS",
    "PINNED_SHARE",
    "PROBE_INTERVAL_MS",
    "REALTIME_SHARE",
    "REALTIME_TTFT_MS",
    "RECOVER_AT",
    "REJUDGE_CANCEL_WAIT_S",
    "REJUDGE_PER_RATE_SECOND",
    "REJUDGE_POLL_S",
    "SAMPLE_EVERY_S",
    "SIMPLE_PROMPTS",
    "STREAM_SHARE",
    "SURGE",
    "SURGE_EXTRA",
    "Job",
    "Options",
    "Script",
    "config_yaml",
    "plan_rejudge",
    "plan_workload",
]

# ---- the scenario --------------------------------------------------------------------------
# Sized for a 2-core laptop: at the default rate the light pool runs at ~half its capacity on
# live traffic alone, so the batch backlog keeps it saturated for the first part of the run
# (queues form, 7:3 shows), and the heavy pool is busy enough that losing one of its two
# instances is felt. Realtime waits stay short because realtime takes 7 of every 10 slots.

LIGHT: Final = (("qwen-a", "Qwen2.5-7B-Instruct"), ("qwen-b", "Qwen2.5-7B-Instruct"))
HEAVY: Final = (("gpt-4o", "gpt-4o"), ("ernie-4", "ernie-4.0-8k"))
CRASHED: Final = "ernie-4"
HEAVY_SLOTS: Final = 2
# Pool light's instances are continuous-batching engines (`gateway mock --engine`, SPEC §17's
# "a mock that behaves like an engine"): one step loop each, every running sequence slowing
# every other, and past LIGHT_KNEE running sequences each one more adds half a step's fixed
# cost to every step (a backend past its knee: more in flight, each answer slower, fewer
# answers a second). Their max_concurrency is a ceiling the gateway does not trust: it is
# adaptive (SPEC §17), and the gateway looks for the limit below it.
LIGHT_SLOTS: Final = 8
LIGHT_KNEE: Final = 3
LIGHT_BEHAVIOR: Final = {
    "engine": "h100-7b",
    "speed": 0.8,
    "knee": LIGHT_KNEE,
    "knee_ms": 3.0,
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
# SPEC §17: each class's latency objective (its default `slo_ttft_ms`): a student waits
# for a verdict (a non-streamed answer must be complete by then, a stream must have started);
# a re-judging request may take its time but not forever.
REALTIME_TTFT_MS: Final = 2000
BATCH_TTFT_MS: Final = 20000

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
# How a `judge` request's complexity is decided (SPEC §4: the `auto` route's classifier).
COMPLEXITY_BY: Final = "decided by the gateway's auto classifier from each prompt"


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
        specs: Sequence[tuple[str, str]], urls: Sequence[str], slots: str, extra: str = ""
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
        # SPEC §17: the classes' objectives; queues serve the earliest deadline first.
        "  high: {capacity: 200, weight: 7, max_wait_ms: 30000, "
        f"slo_ttft_ms: {REALTIME_TTFT_MS}}}\n"
        "  low: {capacity: 1000, weight: 3, max_wait_ms: 600000, "
        f"slo_ttft_ms: {BATCH_TTFT_MS}}}\n"
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
        # SPEC §17: an adaptive limit under a hard ceiling (the engines have a knee).
        f"{instances(LIGHT, light, f'{{max: {LIGHT_SLOTS}, adaptive: true}}', ', provider: vllm')}"
        "  heavy:\n"
        "    fallback: light\n"
        "    instances:\n"
        f"{instances(HEAVY, heavy, str(HEAVY_SLOTS))}"
        "models:\n"
        "  judge: {route: auto}\n"
        "  judge-lite: {pool: light}\n"
        "  judge-pro: {pool: heavy}\n"
        "routing:\n"
        "  complexity: {simple: light, complex: heavy}\n"
        "  default_complexity: simple\n"
        + (f"batch: {{store: {orjson.dumps(batch_store).decode()}}}\n" if batch_store else "")
    )
