"""`gateway demo` end to end (short), its workload and config, and report.py's charts."""

from __future__ import annotations

import asyncio
import io
import re
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from gateway.classify import ComplexityClassifier
from gateway.cli import build_parser
from gateway.config import DEFAULT_COMPLEX_KEYWORDS, DEFAULT_SIMPLE_KEYWORDS, parse_config
from gateway.sim import analysis, demo, scenario
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
    cdf_points,
    fmt_ms,
    line_chart,
    nice_ticks,
    page,
    percentile,
    timeline_chart,
)

# Anything that would make the page fetch something: scripts, styles, images, fonts.
_EXTERNAL = re.compile(
    r"""<script|<link|@import|(?:src|href|xlink:href)\s*=\s*["']?\s*(?:https?:)?//|"""
    r"""url\(\s*["']?\s*(?:https?:)?//""",
    re.IGNORECASE,
)
_NAN = re.compile(r"\b(nan|inf)\b", re.IGNORECASE)

CHART_TITLES = (
    "Queue wait per class (CDF",
    "Grants per second by class — pool light",
    "Grants per second by class — pool heavy",
    "Queue depth — pool light",
    "In flight per instance — pool heavy",
    "Instance state over time",
    "Service time by pool and instance",
    "Objective verdicts per second — realtime",
    "Objective verdicts per second — batch",
    "Adaptive concurrency limit — pool light",
)


# ---- the demo, end to end ------------------------------------------------------------------


async def test_short_demo_tells_the_whole_story(tmp_path: Path) -> None:
    report = tmp_path / "report.html"
    out = io.StringIO()
    options = scenario.Options(duration=6, rate=30, report=str(report), seed=3, progress=False)
    result = await asyncio.wait_for(demo.main(options, out=out), 60)

    text = out.getvalue()
    assert result.summary in text
    # Both classes, per pool, with their waits.
    assert "realtime (high)" in result.summary and "batch (low)" in result.summary
    assert "in light" in result.summary and "in heavy" in result.summary
    # The crash story: injected, ejected, and (given the drain) back.
    assert f"{scenario.CRASHED} crashed" in result.summary
    assert f"{scenario.CRASHED} ejected" in result.summary
    last = result.snapshots[-1]
    crashed = next(i for i in last.instances if i.name == scenario.CRASHED)
    assert crashed.ejections >= 1
    # Every request got an answer; the few a crash may cost are streams already started.
    assert all(s.done is not None for s in result.samples)
    lost = [s for s in result.samples if not s.ok]
    assert all(s.instance == scenario.CRASHED and s.error == "stream_error" for s in lost), lost
    # Realtime waits far less than batch: what the dual queue is for.
    high = analysis.wait_times(result.samples, "high")
    low = analysis.wait_times(result.samples, "low")
    assert percentile(high, 50) < percentile(low, 50)
    # A quiet gateway at the end: nothing queued, nothing in flight.
    assert all(p.queued_high == p.queued_low == 0 for p in last.pools.values())
    assert all(i.in_flight == 0 for i in last.instances)
    # SPEC §17 goodput per class: the gateway judged every client request against its class's
    # objective, and realtime (2 s, served first) mostly met it.
    verdicts = analysis.slo_verdicts(result)
    for cls in ("high", "low"):
        sent = sum(1 for s in result.samples if s.job.priority == cls)
        assert sum(verdicts[cls].values()) == sent, (cls, verdicts[cls], sent)
        line = rf"{scenario.CLASS_NAME[cls]} \({cls}\)\s+met\s+{verdicts[cls]['met']} · missed"
        assert re.search(line, result.summary), line
    realtime = analysis.goodput(verdicts["high"])
    assert realtime is not None and 0.5 <= realtime <= 1.0, verdicts["high"]
    assert f"goodput {realtime:.0%}" in result.summary
    # The adaptive limit over time: pool light's two engines, sampled all along, within
    # [1, ceiling] (its in-flight may lag a cut limit by the requests already running).
    limits = analysis.limit_series(result.snapshots, "light")
    assert set(limits) == {name for name, _ in scenario.LIGHT}
    for points in limits.values():
        assert len(points) == len(result.snapshots)
        assert all(1 <= lim <= scenario.LIGHT_SLOTS for _, lim, _ in points)
        assert all(n <= scenario.LIGHT_SLOTS for _, _, n in points)
    assert analysis.limit_series(result.snapshots, "heavy") == {}  # fixed caps there
    assert "adaptive limit qwen-a" in result.summary

    html = report.read_text(encoding="utf-8")
    assert str(report.resolve()) in text
    assert not _EXTERNAL.search(html), _EXTERNAL.search(html)
    for title in CHART_TITLES:
        assert title in html, title
    assert html.count("<svg") >= 9
    assert "What happened, in order" in html and "Configuration used" in html
    assert "judge: {route: auto}" in html
    assert not _NAN.search(html)


async def test_stopping_early_still_writes_the_report(tmp_path: Path) -> None:
    report = tmp_path / "early.html"
    stop = asyncio.Event()
    options = scenario.Options(duration=30, rate=20, report=str(report), seed=1, progress=False)
    loop = asyncio.get_running_loop()
    loop.call_later(1.5, stop.set)  # what the first Ctrl-C does
    t0 = loop.time()
    result = await asyncio.wait_for(demo.main(options, out=io.StringIO(), stop=stop), 30)
    assert loop.time() - t0 < 15
    assert result.stopped_early
    assert "stopped early" in result.summary
    assert report.exists() and "<svg" in report.read_text(encoding="utf-8")
    # Cancelled requests are accounted for, not lost.
    assert all(s.done is not None or s.error == "cancelled" for s in result.samples)


# ---- workload, prompts, config, flags ----------------------------------------------------


def test_workload_is_a_function_of_the_seed() -> None:
    a_jobs, a_script = scenario.plan_workload(scenario.Options(seed=7))
    b_jobs, _ = scenario.plan_workload(scenario.Options(seed=7))
    c_jobs, _ = scenario.plan_workload(scenario.Options(seed=8))
    assert a_jobs == b_jobs
    assert a_jobs != c_jobs
    o = scenario.Options()
    backlog = [j for j in a_jobs if j.origin == "backlog"]
    assert len(backlog) == round(scenario.BACKLOG_PER_RATE_SECOND * o.rate * o.duration)
    assert all(j.priority == "low" and j.at < 0.5 for j in backlog)
    assert all(a_script.surge[0] <= j.at < a_script.surge[1] for j in a_jobs if j.origin == "surge")
    assert a_script.surge[1] < a_script.crash_at < a_script.recover_at < o.duration
    assert [j.at for j in a_jobs] == sorted(j.at for j in a_jobs)
    live = [j for j in a_jobs if j.origin == "live"]
    # Poisson at --rate: the count is within a few standard deviations of rate × duration.
    expected = o.rate * o.duration
    assert abs(len(live) - expected) < 4 * expected**0.5
    # Both classes, both complexities, all aliases, streaming, English and Chinese.
    assert {j.priority for j in a_jobs} == {"high", "low"}
    assert {j.complexity for j in a_jobs} == {"simple", "complex"}
    assert {j.alias for j in a_jobs} == {"judge", "judge-lite", "judge-pro"}
    assert any(j.stream for j in a_jobs) and not any(j.stream for j in backlog)
    assert any(re.search("[\u4e00-\u9fff]", j.prompt) for j in a_jobs)
    assert all(
        j.alias == "judge" or (j.alias == "judge-pro") == (j.complexity == "complex")
        for j in a_jobs
    )


@pytest.mark.parametrize("prompt", scenario.COMPLEX_PROMPTS)
def test_complex_prompts_carry_a_complex_keyword_only(prompt: str) -> None:
    text = prompt.lower()
    assert any(k in text for k in DEFAULT_COMPLEX_KEYWORDS)
    assert not any(k in text for k in DEFAULT_SIMPLE_KEYWORDS)


@pytest.mark.parametrize("prompt", scenario.SIMPLE_PROMPTS)
def test_simple_prompts_carry_a_simple_keyword_only(prompt: str) -> None:
    text = prompt.lower()
    assert any(k in text for k in DEFAULT_SIMPLE_KEYWORDS)
    assert not any(k in text for k in DEFAULT_COMPLEX_KEYWORDS)


def test_config_is_valid_and_follows_the_flags() -> None:
    options = scenario.Options(policy="strict", balancer="p2c", seed=9)
    light = ["http://127.0.0.1:1001/v1", "http://127.0.0.1:1002/v1"]
    heavy = ["http://127.0.0.1:1003/v1", "http://127.0.0.1:1004/v1"]
    cfg = parse_config(scenario.config_yaml(options, light, heavy), env={})
    assert cfg.scheduler.policy == "strict"
    assert cfg.balancer == "p2c"
    assert cfg.seed == 9
    assert cfg.pools["heavy"].fallback == "light"
    assert [i.url for i in cfg.pools["light"].instances] == light
    assert cfg.models["judge"].route == "auto"
    assert cfg.models["judge-lite"].pool == "light"
    assert cfg.models["judge-pro"].pool == "heavy"
    assert (cfg.routing.complexity.simple, cfg.routing.complexity.complex) == ("light", "heavy")
    assert cfg.health.probe.interval_ms == scenario.PROBE_INTERVAL_MS
    assert cfg.health.ejection_ms == scenario.EJECTION_MS
    # SPEC §17: the classes' objectives and pool light's adaptive limits under a ceiling.
    assert cfg.scheduler.high.slo_ttft_ms == scenario.REALTIME_TTFT_MS
    assert cfg.scheduler.low.slo_ttft_ms == scenario.BATCH_TTFT_MS
    light_specs = cfg.pools["light"].instances
    assert all(
        i.adaptive_concurrency and i.max_concurrency == scenario.LIGHT_SLOTS for i in light_specs
    )
    assert not any(i.adaptive_concurrency for i in cfg.pools["heavy"].instances)


def test_flags() -> None:
    args = build_parser().parse_args(
        ["demo", "--duration", "5", "--rate", "9.5", "--policy", "strict", "--report", "x.html"]
    )
    options = demo.options_from_args(args)
    assert (options.duration, options.rate, options.policy) == (5.0, 9.5, "strict")
    assert options.report == "x.html" and options.balancer == "least_connections"
    assert options.progress
    with pytest.raises(SystemExit):
        build_parser().parse_args(["demo", "--duration", "0"])


def test_contended_grants_counts_only_grants_while_the_other_class_waited() -> None:
    waits = [
        analysis.Wait("light", "low", 0.0, 10.0),
        analysis.Wait("light", "high", 1.0, 1.5),  # granted while low waited: contended
        analysis.Wait("light", "high", 11.0, 11.5),  # nothing else waiting
        analysis.Wait("light", "low", 3.0, 4.0),  # granted while only low waited
        analysis.Wait("light", "high", 3.9, 4.5),  # ... but this high was waiting then: contended
        analysis.Wait("heavy", "high", 2.0, 3.0),  # another pool's queue
    ]
    assert analysis.contended_grants(waits, "light") == (2, 1)
    assert analysis.contended_grants(waits, "heavy") == (0, 0)


# ---- report.py ----------------------------------------------------------------------------


def _xml(svg: str) -> ET.Element:
    """The chart parses as XML: every label is escaped, every element closed."""
    return ET.fromstring(svg)


HOSTILE = "<script>alert(\"x\")</script> & 'q'"


def test_charts_with_no_data_say_so() -> None:
    charts = [
        line_chart("empty lines", []),
        line_chart("empty series", [Series("a", [])]),
        cdf_chart("empty cdf", [("a", [], "#000")], x_label="ms"),
        bar_chart("empty bars", [], []),
        timeline_chart("empty timeline", [], {"healthy": "#0f0"}),
        box_chart("empty boxes", []),
        box_chart("empty group", [BoxGroup("g", [])]),
    ]
    for svg in charts:
        _xml(svg)
        assert "no data" in svg
        assert not _NAN.search(svg)


def test_charts_with_a_single_point() -> None:
    line = line_chart("one", [Series("a", [(3.0, 5.0)])])
    assert "<circle" in line  # a lone point draws no line: it gets a dot
    cdf = cdf_chart("one", [("a", [0.0], "#000")], x_label="ms")  # 0 is drawn at the floor
    bars = bar_chart("one", [0.0], [Bars("a", [4.0])])
    timeline = timeline_chart("one", [("i", [Band(1.0, 1.0, "ejected")])], {"ejected": "#f00"})
    box = box_chart("one", [BoxGroup("g", [42.0])], log_y=True)
    for svg in (line, cdf, bars, timeline, box):
        _xml(svg)
        assert not _NAN.search(svg)
        assert "no data" not in svg


def test_labels_are_escaped() -> None:
    charts = [
        line_chart(
            HOSTILE,
            [Series(HOSTILE, [(0, 1), (1, 2)])],
            x_label=HOSTILE,
            y_label=HOSTILE,
            markers=[Marker(0.5, HOSTILE)],
            spans=[Span(0.2, 0.4, HOSTILE)],
        ),
        bar_chart(HOSTILE, [0.0, 1.0], [Bars(HOSTILE, [1, 2])]),
        timeline_chart(HOSTILE, [(HOSTILE, [Band(0, 1, HOSTILE)])], {HOSTILE: "#000"}),
        box_chart(HOSTILE, [BoxGroup(HOSTILE, [1.0, 2.0, 3.0])]),
        cdf_chart(HOSTILE, [(HOSTILE, [1.0, 5.0], "#000")], x_label=HOSTILE),
    ]
    for svg in charts:
        assert "<script" not in svg
        assert "&lt;script&gt;" in svg
        root = _xml(svg)
        assert HOSTILE in "".join(root.itertext())
    doc = page(HOSTILE, HOSTILE, [(HOSTILE, [(charts[0], HOSTILE)])], [(HOSTILE, HOSTILE)], HOSTILE)
    assert "<script" not in doc
    assert not _EXTERNAL.search(doc)


def test_lines_stay_inside_their_axes() -> None:
    svg = line_chart("steps", [Series("a", [(0, 0), (1, 10), (2, 5)], step=True)], x_range=(0, 2))
    root = _xml(svg)
    polyline = next(e for e in root.iter() if e.tag.endswith("polyline"))
    points = [tuple(map(float, p.split(","))) for p in polyline.attrib["points"].split()]
    # A step holds each value until the next x: 3 points + 2 corners.
    assert len(points) == 5
    assert points[1][1] == points[0][1] and points[1][0] == points[2][0]


def test_numbers() -> None:
    assert percentile([], 50) != percentile([], 50)  # NaN
    assert percentile([1.0], 99) == 1.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert nice_ticks(0, 1) == [0, 0.2, 0.4, 0.6, 0.8, 1.0]
    assert nice_ticks(0, 47, 5) == [0, 10, 20, 30, 40]
    assert nice_ticks(5, 5) == [5]
    assert fmt_ms(0.04) == "0.0 ms" and fmt_ms(37.4) == "37 ms"
    assert fmt_ms(1500) == "1.5 s" and fmt_ms(19_000) == "19 s" and fmt_ms(2000) == "2 s"
    assert cdf_points([3.0, 1.0, 1.0, 0.0], floor=0.5) == [
        (0.5, 0.0),
        (0.5, 25.0),
        (1.0, 75.0),
        (3.0, 100.0),
    ]


def test_the_classifier_tells_the_scenarios_prompts_apart() -> None:
    """The story needs `route: auto` to send each prompt where its real complexity belongs:
    the demo's config classifies every complex prompt complex and every simple one simple."""
    urls = [f"http://127.0.0.1:{p}/v1" for p in (1001, 1002)]
    cfg = parse_config(scenario.config_yaml(scenario.Options(), urls, urls[::-1]), env={})
    classifier = ComplexityClassifier.from_config(cfg)
    for expected, prompts in (
        ("complex", scenario.COMPLEX_PROMPTS),
        ("simple", scenario.SIMPLE_PROMPTS),
    ):
        for prompt in prompts:
            body = {"model": "judge", "messages": [{"role": "user", "content": prompt}]}
            assert classifier.classify(body)[0] == expected, prompt


def test_a_missing_report_directory_fails_fast(tmp_path: Path) -> None:
    args = build_parser().parse_args(["demo", "--report", str(tmp_path / "nope" / "r.html")])
    assert demo.run(args) == 2
