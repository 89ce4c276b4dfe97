"""The request path's metrics are counted in plain numbers and folded into their series when
the registry is read (issue 25): a scrape shows exactly what prometheus-client's own `inc` and
`observe` would have counted — every bucket, sum and count — however reads and counts
interleave, and a reload that drops keys loses no count."""

from __future__ import annotations

import random

import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from gateway.metrics import _LATENCY_BUCKETS, _WAIT_BUCKETS, Metrics


def _samples(m: Metrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """What a scrape shows of the counts this process keeps (its own registry: the core's
    gauges, read from a runtime, are not needed here)."""
    out = {}
    for family in text_string_to_metric_families(generate_latest(m._own).decode()):
        for s in family.samples:
            if not s.name.endswith("_created"):
                out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def _reference(
    name: str, buckets: tuple[float, ...], labels: dict[str, str], values: list[float]
) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """What prometheus-client's own `observe` makes of `values`."""
    h = Histogram(name, "ref", list(labels), buckets=buckets, registry=CollectorRegistry())
    child = h.labels(**labels)
    for v in values:
        child.observe(v)
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for s in h.collect()[0].samples
        if not s.name.endswith("_created")
    }


def test_a_scrape_shows_what_observe_and_inc_would_have_counted() -> None:
    rng = random.Random(25)
    m = Metrics(lambda: None)  # type: ignore[arg-type,return-value]
    waits: list[float] = []
    ttfbs: list[float] = []
    totals: list[float] = []
    # exactly on the bounds, between them, beyond the last, zero
    edges = [0.0, *_WAIT_BUCKETS, *_LATENCY_BUCKETS, 0.0011, 700.0]
    for i in range(3000):
        wait = rng.choice(edges) if i % 3 == 0 else rng.expovariate(50)
        ttfb = rng.choice(edges) if i % 5 == 0 else rng.expovariate(5)
        total = ttfb + rng.expovariate(2)
        waits.append(wait)
        ttfbs.append(ttfb)
        totals.append(total)
        m.waited("p", "low", wait)
        m.attempt("p", "a", ttfb, total)
        m.attempt("p", "a", None, 0.5)  # a stream that never started: no TTFB
        totals.append(0.5)
        m.used_tokens("p", "a", {"prompt_tokens": 3, "completion_tokens": i % 4}, "tenant-a")
        m.request_done("p", "low", 200 if i % 7 else 502, "tenant-a")
        if i % 997 == 0:
            _samples(m)  # reads in between fold what was counted so far, and only that
    got = _samples(m)
    want = _reference(
        "gateway_queue_wait_seconds", _WAIT_BUCKETS, {"pool": "p", "priority": "low"}, waits
    )
    want |= _reference(
        "gateway_time_to_first_byte_seconds",
        _LATENCY_BUCKETS,
        {"pool": "p", "instance": "a"},
        ttfbs,
    )
    want |= _reference(
        "gateway_upstream_latency_seconds", _LATENCY_BUCKETS, {"pool": "p", "instance": "a"}, totals
    )
    for key, value in want.items():
        if key[0].endswith("_sum"):  # added in another order: the last bits may differ
            assert got[key] == pytest.approx(value, rel=1e-12), key
        else:
            assert got[key] == value, key
    ok = sum(1 for i in range(3000) if i % 7)
    assert (
        got[("gateway_requests_total", (("code", "200"), ("pool", "p"), ("priority", "low")))] == ok
    )
    assert got[("gateway_key_requests_total", (("code", "502"), ("key", "tenant-a")))] == 3000 - ok
    tokens = ("gateway_tokens_total", (("instance", "a"), ("kind", "completion"), ("pool", "p")))
    assert got[tokens] == sum(i % 4 for i in range(3000))
    assert got[("gateway_key_tokens_total", (("key", "tenant-a"), ("kind", "prompt")))] == 9000


def test_a_reload_that_drops_keys_keeps_every_count() -> None:
    m = Metrics(lambda: None)  # type: ignore[arg-type,return-value]
    m.keep_keys(["tenant-a", "tenant-b"])
    for _ in range(5):
        m.request_done("p", "low", 200, "tenant-a")
        m.request_done("p", "low", 200, "tenant-b")
        m.waited("p", "low", 0.002)
    m.keep_keys(["tenant-a"])  # tenant-b's series go; the pool's keep all ten
    for _ in range(3):
        m.request_done("p", "low", 200, "tenant-a")
        m.waited("p", "low", 0.002)
    got = _samples(m)
    assert (
        got[("gateway_requests_total", (("code", "200"), ("pool", "p"), ("priority", "low")))] == 13
    )
    assert got[("gateway_key_requests_total", (("code", "200"), ("key", "tenant-a")))] == 8
    assert ("gateway_key_requests_total", (("code", "200"), ("key", "tenant-b"))) not in got
    assert got[("gateway_queue_wait_seconds_count", (("pool", "p"), ("priority", "low")))] == 8
