"""What a demo run tells: the plain-text summary printed at the end and the self-contained
HTML report (charts drawn by `gateway.sim.report`), both functions of a `DemoResult`."""

from __future__ import annotations

import html
import math
import time
from collections import Counter
from collections.abc import Sequence
from typing import Any, Final

from gateway import __version__
from gateway.config import Batch
from gateway.sim import report
from gateway.sim.analysis import (
    Wait,
    both_waiting,
    contended_grants,
    crash_story,
    goodput,
    grant_buckets,
    limit_series,
    pool_names,
    prefix_hit_rate,
    queue_waits,
    retried,
    slo_verdicts,
    state_bands,
    verdict_buckets,
    wait_times,
)
from gateway.sim.report import fmt_ms, percentile
from gateway.sim.run import DemoResult, Sample, Snapshot
from gateway.sim.scenario import (
    BATCH_TTFT_MS,
    CLASS_NAME,
    COMPLEXITY_BY,
    CRASHED,
    LIGHT_BALANCER,
    LIGHT_KNEE,
    LIGHT_SLOTS,
    REALTIME_TTFT_MS,
)

__all__ = ["CLASS_COLOR", "INSTANCE_COLOR", "STATE_COLOR", "render_report", "summarize"]

CLASS_COLOR: Final = {"high": "#0072B2", "low": "#E69F00", "forced": "#CC79A7"}
VERDICT_COLOR: Final = {"met": "#009E73", "missed": "#D55E00"}
OBJECTIVE_MS: Final = {"high": REALTIME_TTFT_MS, "low": BATCH_TTFT_MS}
STATE_COLOR: Final = {"healthy": "#009E73", "half_open": "#F0C419", "ejected": "#D55E00"}
INSTANCE_COLOR: Final = {
    "qwen-a": "#0072B2",
    "qwen-b": "#56B4E9",
    "gpt-4o": "#009E73",
    "ernie-4": "#D55E00",
}


# ---- the summary ---------------------------------------------------------------------------------


def _class_row(label: str, samples: Sequence[Sample], cls: str) -> str:
    """count, ok, failed, p50/p99 queue wait, p50/p99 end-to-end latency. Requests the demo
    itself cancelled (stopped early) are neither ok nor failed."""
    finished = [x for x in samples if x.error != "cancelled" and (x.done is not None or x.error)]
    ok = [x for x in samples if x.ok]
    waits = wait_times(samples, cls)
    e2e = [x.e2e_ms for x in ok if x.e2e_ms is not None]
    return (
        f"{label:<16}{len(samples):>6}{len(ok):>7}{len(finished) - len(ok):>8}"
        f"{fmt_ms(percentile(waits, 50)):>11}{fmt_ms(percentile(waits, 99)):>11}"
        f"{fmt_ms(percentile(e2e, 50)):>10}{fmt_ms(percentile(e2e, 99)):>10}"
    )


def summarize(result: DemoResult) -> str:
    """The plain-text summary printed at the end (and shown in the report)."""
    o, s = result.options, result.samples
    span = f"{o.duration:g} s"
    if result.stopped_early:
        last_sent = max((x.sent for x in s), default=0.0)
        span = f"stopped early after {last_sent:.0f} of {o.duration:g} s"
    lines = [
        f"gateway demo: {span} of judge traffic at {o.rate:g}/s · policy {o.policy} · "
        f"balancer {o.balancer} · seed {o.seed} · {result.wall_s:.0f} s wall",
        "",
        *_class_lines(result),
        "",
        *_instance_lines(result),
        "",
        *_affinity_lines(result),
        *_scheduling_lines(result),
        "",
        *_slo_lines(result),
        "",
        *_routing_lines(result),
        "",
    ]
    rejudge = _rejudge_summary(result)
    if rejudge:
        lines.extend([*rejudge, ""])
    lines.extend(_crash_lines(result))
    warnings = result.capture.warnings
    if warnings:
        lines.extend(["", f"gateway warnings ({len(warnings)}):"])
        lines.extend("  " + w for w in warnings[:10])
    return "\n".join(lines) + "\n"


def _class_lines(result: DemoResult) -> list[str]:
    """Per class, and per pool within it: sent, ok, failed, waits and latencies."""
    s = result.samples
    lines = [
        f"{'class':<16}{'sent':>6}{'ok':>7}{'failed':>8}{'wait p50':>11}{'wait p99':>11}"
        f"{'e2e p50':>10}{'e2e p99':>10}"
    ]
    for cls in ("high", "low"):
        mine = [x for x in s if x.job.priority == cls]
        lines.append(_class_row(f"{CLASS_NAME[cls]} ({cls})", mine, cls))
        for pool in pool_names(result):
            lines.append(_class_row(f"  in {pool}", [x for x in mine if x.pool == pool], cls))
    failures = Counter(x.error for x in s if x.error not in (None, "cancelled"))
    if failures:
        lines.append("  failures: " + ", ".join(f"{n} {why}" for why, n in failures.most_common()))
    cancelled = sum(1 for x in s if x.error == "cancelled")
    if cancelled:
        lines.append(f"  cancelled: {cancelled} (the demo stopped before they were answered)")
    return lines


def _instance_lines(result: DemoResult) -> list[str]:
    """Per pool and instance: answers served, ejections, peak and mean use of its slots."""
    s = result.samples
    last = result.snapshots[-1] if result.snapshots else None
    lines = [f"{'pool / instance':<18}{'served':>8}{'ejections':>11}{'peak':>7}{'busy':>7}"]
    served = Counter(x.instance for x in s if x.ok)
    for pool in pool_names(result):
        pool_served = sum(1 for x in s if x.ok and x.pool == pool)
        lines.append(f"{pool:<18}{pool_served:>8}")
        for inst in last.instances if last else ():
            if inst.pool != pool:
                continue
            series = [i for snap in result.snapshots for i in snap.instances if i.name == inst.name]
            peak = max(i.in_flight for i in series)
            busy = sum(i.in_flight for i in series) / (len(series) * inst.max_concurrency)
            lines.append(
                f"  {inst.name:<16}{served[inst.name]:>8}{inst.ejections:>11}"
                f"{f'{peak}/{inst.max_concurrency}':>7}{busy:>7.0%}"
            )
    again, again_ok = retried(result)
    lines.append(f"  retried on another instance: {again} request(s), {again_ok} of them answered")
    return lines


def _scheduling_lines(result: DemoResult) -> list[str]:
    """SPEC §3: the split of the grants made while both classes waited, per pool."""
    last = result.snapshots[-1] if result.snapshots else None
    lines = ["scheduling — grants made while both classes waited (the policy's choice):"]
    waits = queue_waits(result)
    for pool in pool_names(result):
        high, low = contended_grants(waits, pool)
        total = high + low
        forced = last.pools[pool].forced_low if last and pool in last.pools else 0
        if total:
            lines.append(
                f"  {pool:<6} high {high:>4} : low {low:>4} = {high / total:4.0%} : "
                f"{low / total:4.0%} · forced low grants (starvation guard) {forced}"
            )
        else:
            lines.append(
                f"  {pool:<6} the two classes never waited at once · forced low grants {forced}"
            )
    all_forced = sum(p.forced_low for p in last.pools.values()) if last else 0
    if result.options.policy == "weighted" and all_forced == 0:
        lines.append(
            "  (weighted 7:3 keeps batch moving by itself, so the starvation guard never had"
        )
        lines.append("   to act; run with --policy strict to see it force low grants)")
    low_waits = wait_times(result.samples, "low")
    high_waits = wait_times(result.samples, "high")
    lines.append(
        f"  longest batch wait {fmt_ms(max(low_waits, default=math.nan))} · longest realtime "
        f"wait {fmt_ms(max(high_waits, default=math.nan))}"
    )
    return lines


def _pct_text(value: float | None) -> str:
    return "-" if value is None else f"{value:.0%}"


def _slo_lines(result: DemoResult) -> list[str]:
    """SPEC §17: goodput per class (and per pool), and each adaptive limit's range."""
    lines = [
        f"latency objectives (SPEC §17) — realtime {REALTIME_TTFT_MS / 1000:g} s, batch "
        f"{BATCH_TTFT_MS / 1000:g} s (the whole answer, or a stream's first token):"
    ]
    overall = slo_verdicts(result)
    per_pool = {pool: slo_verdicts(result, pool) for pool in pool_names(result)}
    for cls in ("high", "low"):
        v = overall[cls]
        pools = ", ".join(f"{pool} {_pct_text(goodput(p[cls]))}" for pool, p in per_pool.items())
        lines.append(
            f"  {CLASS_NAME[cls] + f' ({cls})':<16} met {v['met']:>4} · missed {v['missed']:>4} · "
            f"shed {v['shed']:>3} · goodput {_pct_text(goodput(v))} ({pools})"
        )
    for name, points in limit_series(result.snapshots, "light").items():
        limits = sorted(limit for _, limit, _ in points)
        lines.append(
            f"  adaptive limit {name}: {limits[0]:.0f}–{limits[-1]:.0f} "
            f"(median {limits[len(limits) // 2]:.0f}; ceiling {LIGHT_SLOTS}, the engine's knee "
            f"at {LIGHT_KNEE} running)"
        )
    return lines


def _routing_lines(result: DemoResult) -> list[str]:
    """SPEC §4: where each complexity went, the rules that decided, the classifier's score."""
    s = result.samples
    lines = [f"routing — complexity {COMPLEXITY_BY}"]
    routed = Counter((x.job.complexity, x.pool) for x in s if x.pool is not None)
    for cx in ("simple", "complex"):
        where = ", ".join(
            f"{n} → {pool}" for (c, pool), n in sorted(routed.items(), key=str) if c == cx
        )
        lines.append(f"  {cx:<8} {where or '-'}")
    rules = Counter((x.decided or "").split(";", 1)[-1].strip() for x in s if x.decided)
    if rules:
        lines.append("  decided by: " + ", ".join(f"{r} ×{n}" for r, n in rules.most_common()))
    auto = [x for x in s if x.job.alias == "judge" and x.decided]
    agree = sum(1 for x in auto if (x.decided or "").split(";", 1)[0] == x.job.complexity)
    lines.append(
        f"  the classifier agreed with the prompt's real complexity on {agree}/{len(auto)}"
    )
    return lines


def _crash_lines(result: DemoResult) -> list[str]:
    """SPEC §6/§9: the crash story, and the requests it cost."""
    lines = [f"crash timeline ({CRASHED}):"]
    story = crash_story(result)
    lines.extend(_story_lines(story))
    if not story:
        lines.append("  (the run ended before the crash)")
    hit = [
        x for x in result.samples if x.instance == CRASHED and x.error not in (None, "cancelled")
    ]
    if hit:
        why = Counter(x.error for x in hit)
        lines.append(
            f"  lost to the crash: {len(hit)} request(s) "
            f"({', '.join(f'{n} {e}' for e, n in why.items())})"
        )
        lines.append(
            "    (a stream that has started is never retried: it ends with an error event)"
        )
    return lines


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


def _story_lines(story: Sequence[tuple[float, str]]) -> list[str]:
    """`  12.3 s  what happened`, continuation lines indented under the text."""
    out = []
    for t, what in story:
        first, *more = what.split("\n")
        out.append(f"  {t:6.1f} s  {first}")
        out.extend(" " * 12 + line for line in more)
    return out


# ---- the report ----------------------------------------------------------------------------------


def _markers(result: DemoResult) -> list[report.Marker]:
    out = []
    for e in result.events:
        if "crashed" in e.what:
            out.append(report.Marker(e.t, f"{CRASHED} crashes", "#D55E00"))
        elif "restarted" in e.what:
            out.append(report.Marker(e.t, f"{CRASHED} restarts", "#009E73"))
        elif e.what.startswith("workload sent"):
            out.append(report.Marker(e.t, "arrivals end", "#777"))
    return out


def _depth_series(snapshots: Sequence[Snapshot], pool: str, cls: str) -> report.Series:
    points = [
        (x.t, float(x.pools[pool].queued_high if cls == "high" else x.pools[pool].queued_low))
        for x in snapshots
        if pool in x.pools
    ]
    peak = max((y for _, y in points), default=0.0)
    label = f"{CLASS_NAME[cls]} ({cls}) queued, peak {peak:.0f}"
    return report.Series(label, points, CLASS_COLOR[cls], width=2.5 if cls == "high" else 2.0)


def _surge_span(result: DemoResult) -> report.Span:
    a, b = result.script.surge
    return report.Span(a, b, "exam-deadline surge", "#fbeee0")


def render_report(result: DemoResult) -> str:
    """The HTML report: the charts, the summary and the config, in one self-contained page."""
    x_range = (0.0, max(result.end, 1.0))
    markers = _markers(result)
    # The crash concerns pool heavy; light's charts mark only when arrivals end.
    ends = [m for m in markers if m.label == "arrivals end"]
    waits = queue_waits(result)
    scheduling: list[tuple[str, str]] = []
    queues: list[tuple[str, str]] = []
    balancing: list[tuple[str, str]] = []
    for pool in pool_names(result):
        pool_markers = markers if pool == "heavy" else ends
        scheduling.append(_grants_figure(result, pool, waits, x_range, pool_markers))
        queues.append(_depth_figure(result, pool, x_range, pool_markers))
        balancing.append(_in_flight_figure(result, pool, x_range, pool_markers))
    sections = [
        ("Realtime vs batch: time spent waiting", [(_wait_cdf(result), _cdf_caption())]),
        ("Scheduling: who gets each freed slot", scheduling),
        ("Queues", queues),
        *_rejudge_section(result, x_range, ends),
        ("Balancing across instances", balancing),
        ("Latency objectives: goodput and the adaptive limit", _slo_figures(result, x_range)),
        ("Health: the crash and the recovery", _health_figures(result, x_range, markers)),
        (
            "Latency by pool",
            [
                (
                    _latency_chart(result),
                    "light runs on continuous-batching engines: an answer takes its prefill "
                    "(skipped for a cached prompt prefix) and one engine step per token, and "
                    "every running sequence lengthens every step; heavy is heavy-tailed "
                    "(Pareto, mean 600 ms) plus its slower token stream. Retries around the "
                    "crash add to a few heavy requests.",
                )
            ],
        ),
    ]
    o = result.options
    return report.page(
        "gateway demo report",
        _intro(result),
        sections,
        appendix=[
            ("Summary", result.summary),
            ("Configuration used", result.config_text),
        ],
        meta=f"gateway {__version__} · {time.strftime('%Y-%m-%d %H:%M:%S')} · seed {o.seed}",
    )


def _time_axis(x_range: tuple[float, float], markers: Sequence[report.Marker]) -> dict[str, Any]:
    """What every chart over the run's time shares: its x axis, with the events marked."""
    return {
        "x_label": "seconds since start",
        "x_range": x_range,
        "x_fmt": report.fmt_seconds,
        "markers": markers,
    }


def _intro(result: DemoResult) -> str:
    o, s = result.options, result.samples
    return (
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
        "instance, and once it restarts it is probed, tried half-open and restored. "
        f"Each class has a latency objective ({REALTIME_TTFT_MS / 1000:g} s for realtime, "
        f"{BATCH_TTFT_MS / 1000:g} s for batch): the gateway judges every answer against it "
        "(goodput per class), serves each queue earliest deadline first, and finds pool "
        "light's concurrency limits from the engines' time per token instead of trusting a "
        "configured number."
    )


def _wait_cdf(result: DemoResult) -> str:
    """The queue wait's CDF per class, overall and in pool heavy alone."""
    s = result.samples
    wait_groups = []
    heavy_only = []
    for cls in ("high", "low"):
        waits = wait_times(s, cls)
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
        waits = wait_times(s, cls, "heavy")
        label = f"{CLASS_NAME[cls]} in pool heavy only, p99 {fmt_ms(percentile(waits, 99))}"
        wait_groups.append((label, waits, CLASS_COLOR[cls]))
        heavy_only.append(label)
    return report.cdf_chart(
        "Queue wait per class (CDF, X-Gateway-Queue-Ms)",
        wait_groups,
        x_label="time spent queued in the gateway (log scale)",
        dashed=heavy_only,
    )


def _grants_figure(
    result: DemoResult,
    pool: str,
    waits: Sequence[Wait],
    x_range: tuple[float, float],
    markers: Sequence[report.Marker],
) -> tuple[str, str]:
    """Grants per second by class in `pool`, shaded where both classes waited."""
    starts, high, low, forced = grant_buckets(result.snapshots, pool)
    h, lo = contended_grants(waits, pool)
    share = f"{h / (h + lo):.0%} : {lo / (h + lo):.0%}" if h + lo else "n/a"
    chart = report.bar_chart(
        f"Grants per second by class — pool {pool}",
        starts,
        [
            report.Bars("realtime (high)", high, CLASS_COLOR["high"]),
            report.Bars("batch (low)", low, CLASS_COLOR["low"]),
            report.Bars(
                f"batch forced by the starvation guard ({sum(forced):.0f})",
                forced,
                CLASS_COLOR["forced"],
            ),
        ],
        y_label="slots granted per second",
        spans=both_waiting(result.snapshots, pool),
        **_time_axis(x_range, markers),
    )
    caption = (
        f"Each bar is one second of slot grants in pool {pool}. Shaded: both queues were "
        f"waiting, so the scheduler had to choose — there the split is {share} "
        f"(high : low; policy {result.options.policy}). Outside the shading one class "
        "had the pool to itself (work-conserving: an empty class cedes its turns)."
    )
    return chart, caption


def _depth_figure(
    result: DemoResult, pool: str, x_range: tuple[float, float], markers: Sequence[report.Marker]
) -> tuple[str, str]:
    """The depth of `pool`'s two queues over time, the surge shaded."""
    chart = report.line_chart(
        f"Queue depth — pool {pool}",
        [
            _depth_series(result.snapshots, pool, "high"),
            _depth_series(result.snapshots, pool, "low"),
        ],
        y_label="requests waiting",
        spans=[_surge_span(result)],
        **_time_axis(x_range, markers),
        height=240,
    )
    caption = (
        f"Requests waiting in pool {pool}'s dual queue, sampled every 200 ms from "
        "/admin/state. The batch backlog drains while realtime stays near zero."
    )
    return chart, caption


def _in_flight_figure(
    result: DemoResult, pool: str, x_range: tuple[float, float], markers: Sequence[report.Marker]
) -> tuple[str, str]:
    """Slots in use per instance of `pool` over time, under its max_concurrency."""
    insts = result.snapshots[0].instances if result.snapshots else ()
    members = [i for i in insts if i.pool == pool]
    series = [
        report.Series(
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
    cap = max((i.max_concurrency for i in members), default=1)
    series.append(
        report.Series(
            "max_concurrency", [(x_range[0], cap), (x_range[1], cap)], "#888", dashed=True
        )
    )
    chart = report.line_chart(
        f"In flight per instance — pool {pool} "
        f"({LIGHT_BALANCER if pool == 'light' else result.options.balancer})",
        series,
        y_label="requests in flight",
        y_range=(0, cap + 0.5),
        y_ticks=range(cap + 1),
        **_time_axis(x_range, markers),
        height=240,
    )
    caption = "Slots in use on each instance; never above max_concurrency (dashed). " + (
        f"When {CRASHED} crashes its line drops to zero and its load moves to the "
        "other instance; after the restart it takes one half-open trial at a time "
        "before it is trusted again."
        if pool == "heavy"
        else "Affinity sends each judge prompt back to the instance whose prefix "
        "cache holds it, while no instance goes above (1 + ε) × the average load: "
        f"prefix-cache hit rate {_rate_text(prefix_hit_rate(result))}."
    )
    return chart, caption


def _slo_figures(result: DemoResult, x_range: tuple[float, float]) -> list[tuple[str, str]]:
    """SPEC §17: the verdicts per second of each class, and pool light's adaptive limits."""
    out = []
    for cls in ("high", "low"):
        starts, met, missed = verdict_buckets(result, cls)
        v = slo_verdicts(result)[cls]
        chart = report.bar_chart(
            f"Objective verdicts per second — {CLASS_NAME[cls]}",
            starts,
            [
                report.Bars(f"met ({v['met']})", met, VERDICT_COLOR["met"]),
                report.Bars(
                    f"missed or shed ({v['missed'] + v['shed']})", missed, VERDICT_COLOR["missed"]
                ),
            ],
            y_label="answers per second",
            spans=[_surge_span(result)],
            **_time_axis(x_range, _markers(result)),
            height=240,
        )
        caption = (
            f"{CLASS_NAME[cls].capitalize()} requests as the gateway judged them against their "
            f"class's objective ({OBJECTIVE_MS[cls] / 1000:g} s; X-Gateway-SLO, "
            f"gateway_slo_requests_total), by the second they ended: goodput "
            f"{_pct_text(goodput(v))}. Within a class the queue serves the earliest deadline "
            "first; a request already past its deadline goes back to arrival order, so the "
            "ones that can still make it go first."
        )
        out.append((chart, caption))
    series: list[report.Series] = []
    for name, points in limit_series(result.snapshots, "light").items():
        color = INSTANCE_COLOR.get(name, "#000")
        series.append(
            report.Series(f"{name} limit", [(t, lim) for t, lim, _ in points], color, step=True)
        )
        series.append(
            report.Series(
                f"{name} in flight",
                [(t, n) for t, _, n in points],
                color,
                step=True,
                dashed=True,
                width=1.0,
            )
        )
    series.append(
        report.Series(
            f"ceiling (max {LIGHT_SLOTS})",
            [(x_range[0], LIGHT_SLOTS), (x_range[1], LIGHT_SLOTS)],
            "#888",
            dashed=True,
        )
    )
    series.append(
        report.Series(
            f"the engines' knee ({LIGHT_KNEE} running)",
            [(x_range[0], LIGHT_KNEE), (x_range[1], LIGHT_KNEE)],
            "#CC79A7",
            dashed=True,
        )
    )
    chart = report.line_chart(
        "Adaptive concurrency limit — pool light",
        series,
        y_label="requests",
        y_range=(0, LIGHT_SLOTS + 0.5),
        y_ticks=range(LIGHT_SLOTS + 1),
        **_time_axis(x_range, _markers(result)),
        height=260,
    )
    caption = (
        "Each light instance's concurrency limit (solid) and its requests in flight (dashed), "
        "sampled from /admin/state every 200 ms. The instances are continuous-batching engines "
        f"that slow every running sequence once more than {LIGHT_KNEE} run; the gateway's "
        "gradient controller (SPEC §17) cuts an instance's limit when its time per output token "
        "climbs well above the uncongested one and probes upwards again when it falls back, "
        f"never above the ceiling ({LIGHT_SLOTS}). Requests beyond the limit wait in the "
        "gateway's queue, where priorities and deadlines apply."
    )
    out.append((chart, caption))
    return out


def _health_figures(
    result: DemoResult, x_range: tuple[float, float], markers: Sequence[report.Marker]
) -> list[tuple[str, str]]:
    """Each instance's state over time, and the crash story in words."""
    bands = state_bands(result.snapshots)
    timeline_svg = report.timeline_chart(
        "Instance state over time (sampled from /admin/state every 200 ms)",
        list(bands.items()),
        {
            "healthy": STATE_COLOR["healthy"],
            "half_open": STATE_COLOR["half_open"],
            "ejected": STATE_COLOR["ejected"],
        },
        **_time_axis(x_range, markers),
    )
    story = "\n".join(_story_lines(crash_story(result))) or "(the run ended before the crash)"
    return [
        (
            timeline_svg,
            "Green: healthy · yellow: half-open (trial requests) · red: ejected. "
            "What happened, in order:",
        ),
        (f'<pre class="story">{html.escape(story)}</pre>', ""),
    ]


def _latency_chart(result: DemoResult) -> str:
    """Service time (end-to-end minus queue wait) per pool and instance."""
    s = result.samples
    groups = []
    for pool in pool_names(result):
        vals = [x.service_ms for x in s if x.ok and x.pool == pool and x.service_ms is not None]
        groups.append(report.BoxGroup(f"pool {pool}", vals, "#555"))
        for name in sorted({x.instance for x in s if x.pool == pool and x.instance}):
            vals = [x.service_ms for x in s if x.ok and x.instance == name and x.service_ms]
            groups.append(report.BoxGroup(name, vals, INSTANCE_COLOR.get(name, "#000")))
    return report.box_chart(
        "Service time by pool and instance (end-to-end minus queue wait)",
        groups,
        y_label="milliseconds (log scale)",
        log_y=True,
        y_fmt=fmt_ms,
    )


def _rejudge_summary(result: DemoResult) -> list[str]:
    """The re-judging batch's part of the summary (SPEC §14)."""
    r = result.rejudge
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
    result: DemoResult, x_range: tuple[float, float], markers: Sequence[report.Marker]
) -> list[tuple[str, list[tuple[str, str]]]]:
    """The report's chart of the re-judging batch's progress (none if it never ran)."""
    r = result.rejudge
    if not r.progress:
        return []
    done = [(t, float(c)) for t, c, _ in r.progress]
    failed = [(t, float(f)) for t, _, f in r.progress]
    total = [(x_range[0], float(r.lines)), (x_range[1], float(r.lines))]
    chart = report.line_chart(
        "Batch API: overnight re-judging progress (GET /v1/batches/{id})",
        [
            report.Series(
                f"lines completed ({done[-1][1]:.0f})", done, CLASS_COLOR["low"], step=True
            ),
            report.Series(f"lines failed ({failed[-1][1]:.0f})", failed, "#D55E00", step=True),
            report.Series(f"lines in the batch ({r.lines})", total, "#888", dashed=True),
        ],
        y_label="lines",
        y_range=(0, r.lines * 1.05 + 1),
        **_time_axis(x_range, markers),
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
