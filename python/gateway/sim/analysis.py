"""What a demo run shows, computed from its `DemoResult`: waits per class, the grants the
policy chose, instance states over time, the crash story, retries, prefix-cache hits, the
latency objectives' verdicts and the adaptive limits (SPEC §17).

Pure functions of the observations (no I/O), so the summary, the report and the benchmarks
(`benches/policies.py`) compute them one way.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Final

from gateway.events import RequestFinished
from gateway.sim.report import Band, Span
from gateway.sim.run import DemoResult, InstanceView, Sample, Snapshot
from gateway.sim.scenario import CLASS_NAME, CRASHED, FAILURE_THRESHOLD

__all__ = [
    "Wait",
    "answered_waits",
    "both_waiting",
    "contended_grants",
    "crash_story",
    "goodput",
    "grant_buckets",
    "limit_series",
    "pool_names",
    "prefix_hit_rate",
    "queue_waits",
    "retried",
    "slo_verdicts",
    "state_bands",
    "transitions",
    "verdict_buckets",
    "wait_times",
]

# SPEC §17's verdicts of a request with an objective (`RequestFinished.slo`).
VERDICTS: Final = ("met", "missed", "shed")


def wait_times(samples: Sequence[Sample], cls: str, pool: str | None = None) -> list[float]:
    """The queue waits (ms, `X-Gateway-Queue-Ms`) of the requests sent as class `cls`, in
    `pool` or anywhere."""
    return [
        s.queue_ms
        for s in samples
        if s.job.priority == cls and s.queue_ms is not None and (pool is None or s.pool == pool)
    ]


def pool_names(result: DemoResult) -> list[str]:
    """The gateway's pools, in config order."""
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
    """Every queued request's wait, from the gateway's `RequestFinished` events.

    The event is published when a request ends, with `total_ms` since it arrived and
    `queue_ms` spent queued; queueing starts as soon as it is parsed and routed, so its wait
    is [end − total, end − total + queue] to well under a millisecond. The client's clock
    would do worse: it starts before the request has even reached the gateway, and under
    load that is milliseconds. Requests tried more than once (their waits summed) are left
    out, and so are classes other than the scenario's two.
    """
    cap = result.capture
    waits = answered_waits(cap.answered.values(), cap.wall_start)
    return [w for w in waits if w.cls in CLASS_NAME]


def answered_waits(answered: Iterable[RequestFinished], wall_start: float) -> list[Wait]:
    """The wait of each answered request that queued and was tried once, in seconds since
    `wall_start` (a `time.time()`); see `queue_waits`."""
    out: list[Wait] = []
    for ev in answered:
        if ev.queue_ms < _QUEUED_MS or ev.attempts != 1:
            continue
        start = ev.at - wall_start - ev.total_ms / 1000
        out.append(Wait(str(ev.pool), str(ev.priority), start, start + ev.queue_ms / 1000))
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


def crash_story(result: DemoResult) -> list[tuple[float, str]]:
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
    retried = [ev for ev in _retried_live(result) if ev.pool]
    if retried:
        first, last = min(cap.t(ev) for ev in retried), max(cap.t(ev) for ev in retried)
        ok = sum(1 for ev in retried if ev.status == 200)
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


def retried(result: DemoResult) -> tuple[int, int]:
    """(requests that needed more than one attempt, of which answered successfully)."""
    ok_ids = {s.request_id for s in result.samples if s.ok}
    again = _retried_live(result)
    return len(again), sum(1 for ev in again if ev.id in ok_ids)


def _retried_live(result: DemoResult) -> list[RequestFinished]:
    """The clients' requests (not the Batch API's lines) tried more than once."""
    answered = result.capture.answered.values()
    return [ev for ev in answered if ev.attempts > 1 and ev.source != "batch"]


def prefix_hit_rate(result: DemoResult) -> float | None:
    """Pool light's prefix-cache hit rate over its backends (None before any lookup)."""
    hits = sum(h for h, _ in result.prefix_cache.values())
    lookups = hits + sum(m for _, m in result.prefix_cache.values())
    return hits / lookups if lookups else None


# ---- SPEC §17: latency objectives -----------------------------------------------------------


def _judged(result: DemoResult) -> list[RequestFinished]:
    """The clients' requests (not the Batch API's lines) the gateway judged against an
    objective, in the scenario's two classes."""
    return [
        ev
        for ev in result.capture.answered.values()
        if ev.source != "batch" and ev.slo in VERDICTS and ev.priority in CLASS_NAME
    ]


def slo_verdicts(result: DemoResult, pool: str | None = None) -> dict[str, Counter[str]]:
    """Per class (high, low): how many of the clients' requests met, missed or were shed
    from their objective, as the gateway judged them (its access log's `slo` field), in
    `pool` or anywhere."""
    out: dict[str, Counter[str]] = {cls: Counter() for cls in CLASS_NAME}
    for ev in _judged(result):
        if pool is None or ev.pool == pool:
            out[str(ev.priority)][str(ev.slo)] += 1
    return out


def goodput(verdicts: Counter[str]) -> float | None:
    """Met ÷ all judged (shed and missed count against it); None when nothing was judged."""
    total = sum(verdicts[v] for v in VERDICTS)
    return verdicts["met"] / total if total else None


def verdict_buckets(
    result: DemoResult, cls: str, bucket: float = 1.0
) -> tuple[list[float], list[float], list[float]]:
    """(bucket starts, met, missed or shed) per `bucket` seconds for class `cls`, by the
    moment each request ended."""
    cap = result.capture
    judged = [(cap.t(ev), ev.slo == "met") for ev in _judged(result) if ev.priority == cls]
    end = max([result.end, *(t for t, _ in judged)], default=0.0)
    n = math.ceil(end / bucket) + 1
    met, missed = [0.0] * n, [0.0] * n
    for t, ok in judged:
        i = min(max(int(t / bucket), 0), n - 1)
        if ok:
            met[i] += 1
        else:
            missed[i] += 1
    return [i * bucket for i in range(n)], met, missed


def limit_series(
    snapshots: Sequence[Snapshot], pool: str
) -> dict[str, list[tuple[float, float, float]]]:
    """Each adaptive instance of `pool`: (t, its concurrency limit, its in-flight count) at
    every sample of the gateway's state."""
    out: dict[str, list[tuple[float, float, float]]] = {}
    for snap in snapshots:
        for inst in snap.instances:
            if inst.pool == pool and inst.adaptive:
                out.setdefault(inst.name, []).append(
                    (snap.t, float(inst.concurrency_limit), float(inst.in_flight))
                )
    return out
