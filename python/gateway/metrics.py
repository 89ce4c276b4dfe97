"""Prometheus metrics (SPEC §9; the names are part of the contract).

Counters and histograms are updated on the request path through cached label children (one
dict lookup each). Gauges that mirror the core's state — queue depths, in-flight, instance
states, ejections — are read from the core only when Prometheus scrapes, so they cost nothing
per request and can never drift from the scheduler's own counters.

Labels are bounded: pool and instance names come from the config, priority and state from
the core's enums, `code` is an HTTP status, `reason` one of a fixed set, `kind` prompt or
completion. No key, prompt, URL or client-chosen string ever becomes a label.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from gateway import __version__
from gateway._core import Priority

if TYPE_CHECKING:
    from gateway.runtime import Runtime

__all__ = ["CONTENT_TYPE", "Metrics"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# Queue waits span 0 (idle gateway) to minutes (batch backlog); LLM latencies 50 ms to minutes.
_WAIT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1,
    2.5,
    5,
    10,
    30,
    60,
    120,
    300,
    600,
)
_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300, 600)

_STATES = ("healthy", "half_open", "ejected")
REASONS = (
    "queue_full",
    "queue_timeout",
    "no_healthy_instance",
    "rate_limited",
    "invalid_request",
    "invalid_api_key",
    "model_not_found",
    "request_too_large",
    "request_timeout",
    "draining",
)


class _CoreCollector(Collector):
    """Reads the schedulers' state at scrape time."""

    def __init__(self, runtime: Callable[[], Runtime]) -> None:
        self._runtime = runtime

    def collect(self) -> Iterator[Any]:
        runtime = self._runtime()
        depth = GaugeMetricFamily(
            "gateway_queue_depth",
            "Requests waiting, per pool and class",
            labels=["pool", "priority"],
        )
        in_flight = GaugeMetricFamily(
            "gateway_instance_in_flight",
            "Attempts in flight per instance",
            labels=["pool", "instance"],
        )
        capacity = GaugeMetricFamily(
            "gateway_instance_max_concurrency",
            "Configured max_concurrency per instance",
            labels=["pool", "instance"],
        )
        state = GaugeMetricFamily(
            "gateway_instance_state",
            "1 for the instance's current circuit state",
            labels=["pool", "instance", "state"],
        )
        ejections = CounterMetricFamily(
            "gateway_instance_ejections",
            "Ejections (all enforced) per instance",
            labels=["pool", "instance"],
        )
        grants = CounterMetricFamily(
            "gateway_grants",
            "Slots granted per pool and class (queued or immediate)",
            labels=["pool", "priority"],
        )
        forced = CounterMetricFamily(
            "gateway_forced_low_grants",
            "Low grants forced by the starvation guard",
            labels=["pool"],
        )
        now = time.monotonic_ns() // 1_000_000
        for name, pool in runtime.pools.items():
            core = pool.scheduler.core
            depth.add_metric([name, "high"], core.queued(Priority.HIGH))
            depth.add_metric([name, "low"], core.queued(Priority.LOW))
            stats = core.stats()
            grants.add_metric([name, "high"], stats.granted_high)
            grants.add_metric([name, "low"], stats.granted_low)
            forced.add_metric([name], stats.forced_low)
            for idx, up in enumerate(pool.upstreams):
                info = core.instance(idx, now)
                if info.removed and info.in_flight == 0:
                    continue
                in_flight.add_metric([name, up.name], info.in_flight)
                capacity.add_metric([name, up.name], info.max_concurrency)
                ejections.add_metric([name, up.name], info.ejections)
                label = info.state.label
                for s in _STATES:
                    state.add_metric([name, up.name, s], 1.0 if s == label else 0.0)
        yield from (depth, in_flight, capacity, state, ejections, grants, forced)


class Metrics:
    """The gateway's metrics in their own registry (one per gateway, so tests can run many)."""

    def __init__(self, runtime: Callable[[], Runtime]) -> None:
        r = self.registry = CollectorRegistry(auto_describe=False)
        self.requests = Counter(
            "gateway_requests",
            "Requests answered, per pool, class and HTTP status",
            ["pool", "priority", "code"],
            registry=r,
        )
        self.queue_wait = Histogram(
            "gateway_queue_wait_seconds",
            "Time from arrival to the slot grant (retries included)",
            ["pool", "priority"],
            buckets=_WAIT_BUCKETS,
            registry=r,
        )
        self.upstream_latency = Histogram(
            "gateway_upstream_latency_seconds",
            "Attempt duration, from sending to the last byte",
            ["pool", "instance"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.ttfb = Histogram(
            "gateway_time_to_first_byte_seconds",
            "Attempt start to the response head (or first stream chunk)",
            ["pool", "instance"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.retries = Counter(
            "gateway_retries", "Attempts after the first, per pool", ["pool"], registry=r
        )
        self.rejections = Counter(
            "gateway_rejections",
            "Requests refused by the gateway itself, per reason",
            ["reason"],
            registry=r,
        )
        self.tokens = Counter(
            "gateway_tokens",
            "Tokens reported by upstream usage",
            ["pool", "instance", "kind"],
            registry=r,
        )
        self.reloads = Counter(
            "gateway_config_reloads", "Config reloads by result", ["result"], registry=r
        )
        self.last_reload_success = Gauge(
            "gateway_config_last_reload_success",
            "1 if the last config (re)load succeeded",
            registry=r,
        )
        self.last_reload_success.set(1)
        self.last_reload_time = Gauge(
            "gateway_config_last_reload_success_timestamp_seconds",
            "When the running config was loaded",
            registry=r,
        )
        self.last_reload_time.set_to_current_time()
        build = Gauge("gateway_build_info", "Build information", ["version"], registry=r)
        build.labels(__version__).set(1)
        for reason in REASONS:  # present from the start, so rates work from zero
            self.rejections.labels(reason)
        r.register(_CoreCollector(runtime))
        self._children: dict[tuple[Any, ...], Any] = {}

    def _child(self, metric: Any, *labels: str) -> Any:
        key = (id(metric), *labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*labels)
        return child

    def request_done(self, pool: str | None, priority: str | None, status: int) -> None:
        self._child(self.requests, pool or "", priority or "", str(status)).inc()

    def waited(self, pool: str, priority: str, seconds: float) -> None:
        self._child(self.queue_wait, pool, priority).observe(seconds)

    def attempt(self, pool: str, instance: str, ttfb: float | None, total: float) -> None:
        if ttfb is not None:
            self._child(self.ttfb, pool, instance).observe(ttfb)
        self._child(self.upstream_latency, pool, instance).observe(total)

    def retry(self, pool: str) -> None:
        self._child(self.retries, pool).inc()

    def rejected(self, reason: str) -> None:
        if reason in REASONS:
            self._child(self.rejections, reason).inc()

    def used_tokens(self, pool: str, instance: str, usage: dict[str, Any]) -> None:
        for kind in ("prompt", "completion"):
            n = usage.get(f"{kind}_tokens")
            if isinstance(n, int) and n > 0:
                self._child(self.tokens, pool, instance, kind).inc(n)

    def reloaded(self, ok: bool) -> None:
        self.reloads.labels("success" if ok else "failure").inc()
        self.last_reload_success.set(1 if ok else 0)
        if ok:
            self.last_reload_time.set_to_current_time()

    def render(self) -> bytes:
        return generate_latest(self.registry)
