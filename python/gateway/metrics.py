"""Prometheus metrics (SPEC §9; the names are part of the contract).

Counters and histograms are counted on the request path in plain Python numbers per series
(`_Tally`: one dict lookup and an addition each, no lock and no prometheus-client call), folded
into their prometheus-client series whenever the registry is read — a scrape, a workers'
snapshot — so every read sees every request counted. Gauges that mirror the core's state —
queue depths, in-flight, instance states, ejections — are read from the core only when
Prometheus scrapes, so they cost nothing per request and can never drift from the scheduler's
own counters.

Labels are bounded: pool and instance names come from the config, priority and state from
the core's enums, `code` is an HTTP status, `reason` one of a fixed set, `kind` prompt or
completion, `key` a configured client key's *name* (`auth.keys[].name`) or `none`. No key,
prompt, URL or client-chosen string ever becomes a label.

When tracing is on (`gateway.telemetry`) and `telemetry.exemplars: true`, the latency
histograms — queue wait, upstream latency, time to first byte — carry the sampled request's
trace id as an OpenMetrics exemplar (`{trace_id="..."}`); they show in the OpenMetrics
exposition, which `exposition(accept)` answers to a scraper that asks for
`application/openmetrics-text` (Prometheus does when exemplar storage is on). Off by default:
an exemplar is some tenant's trace id, readable by whoever scrapes. The classic text format
has no exemplars and stays the default.

SPEC §12 (`--workers N`): every worker answers `/metrics` for the whole gateway. The state
gauges already do (each worker reads the shared region). Counters and histograms stay
in-process on the request path (no cost per request: prometheus-client's multiprocess mode was
measured at +6-12 µs per request, and has no exemplars); each worker writes a snapshot of its
own to the supervisor's metrics directory every second and before each scrape it answers, and a
scrape sums this worker's live values with every other worker's latest snapshot. A dead
worker's snapshot stays, so its counts stay in the totals and counters never go backwards; a
gauge is read from live workers only.
"""

from __future__ import annotations

import contextlib
import os
from bisect import bisect_left
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

import orjson
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.openmetrics import exposition as openmetrics
from prometheus_client.registry import Collector

from gateway import __version__
from gateway.logs import dropped_lines

if TYPE_CHECKING:
    from gateway.runtime import Runtime

__all__ = ["CONTENT_TYPE", "NO_KEY", "OPENMETRICS_CONTENT_TYPE", "Metrics"]

#: The `key` label of requests no configured key made (auth off, or a key missing or unknown).
NO_KEY = "none"


CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
OPENMETRICS_CONTENT_TYPE = openmetrics.CONTENT_TYPE_LATEST
_openmetrics_latest: Callable[[CollectorRegistry], bytes] = openmetrics.generate_latest

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

_STATES = ("healthy", "half_open", "ejected", "cooling")
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
    "overloaded",
    "slo_unattainable",
    "malformed_request",
    "internal_error",
)


class _Tally(Collector):
    """The request path's counts not yet in their series (issue 25: prometheus-client's
    `inc` and `observe` take a lock and a few Python calls each, ~2-4 µs a request for the
    nine of them). A counter cell is a list of counts, each with the `inc`s it is folded
    into; a histogram cell is its child's bucket counts (not cumulative, as prometheus-client
    keeps them) and its sum. Registered first in its registry, so every read of it (`collect`)
    folds them before any series is read. Everything that counts runs on the event loop's
    thread, as every read does."""

    def __init__(self) -> None:
        self._counters: list[tuple[list[int], tuple[tuple[Callable[[float], None], ...], ...]]]
        self._counters = []
        self._histograms: list[tuple[list[float], Any]] = []

    def counter(self, *incs: tuple[Callable[[float], None], ...]) -> list[int]:
        """A cell of one count per entry of `incs`, each folded into that entry's `inc`s."""
        cell = [0] * len(incs)
        self._counters.append((cell, incs))
        return cell

    def histogram(self, child: Any) -> tuple[list[float], list[float]]:
        """(upper bounds, cell) of histogram series `child`: observing `v` is
        `cell[bisect_left(bounds, v)] += 1; cell[-1] += v` (the bucket `observe` picks: the
        first bound not below `v`)."""
        bounds: list[float] = list(child._upper_bounds)
        cell: list[float] = [0] * len(bounds) + [0.0]
        self._histograms.append((cell, child))
        return bounds, cell

    def fold(self) -> None:
        for cell, incs in self._counters:
            for i, n in enumerate(cell):
                if n:
                    cell[i] = 0
                    for inc in incs[i]:
                        inc(n)
        for hcell, child in self._histograms:
            buckets = child._buckets
            for i in range(len(buckets)):
                count = hcell[i]
                if count:
                    hcell[i] = 0
                    buckets[i].inc(count)
            total = hcell[-1]
            if total:
                hcell[-1] = 0.0
                child._sum.inc(total)

    def reset(self) -> None:
        """Folds, then forgets every cell (their holders drop them too)."""
        self.fold()
        self._counters.clear()
        self._histograms.clear()

    def collect(self) -> Iterator[Metric]:
        self.fold()
        return iter(())


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
        # SPEC §17: the cap in force per instance (an adaptive instance's current limit), and
        # the latency model's p90 predictions for a typical request now and their errors.
        limit = GaugeMetricFamily(
            "gateway_instance_concurrency_limit",
            "Concurrency cap in force per instance (the adaptive limit, else max_concurrency)",
            labels=["pool", "instance"],
        )
        predicted = GaugeMetricFamily(
            "gateway_instance_predicted_seconds",
            "Predicted p90 time to first token (ttft) and per output token (tpot) of a typical "
            "request sent to the instance now",
            labels=["pool", "instance", "kind"],
        )
        error = GaugeMetricFamily(
            "gateway_instance_prediction_error_seconds",
            "Mean absolute error of the instance's latency predictions (ttft, tpot)",
            labels=["pool", "instance", "kind"],
        )
        calibrated = GaugeMetricFamily(
            "gateway_instance_prediction_calibrated",
            "1 while the instance's latency predictions are calibrated (used to place and shed)",
            labels=["pool", "instance"],
        )
        for name, pool in runtime.pools.items():
            snap = pool.snapshot()
            depth.add_metric([name, "high"], snap.queued_high)
            depth.add_metric([name, "low"], snap.queued_low)
            grants.add_metric([name, "high"], snap.granted_high)
            grants.add_metric([name, "low"], snap.granted_low)
            forced.add_metric([name], snap.forced_low)
            for inst in snap.instances:
                labels = [name, inst.name]
                in_flight.add_metric(labels, inst.in_flight)
                capacity.add_metric(labels, inst.max_concurrency)
                ejections.add_metric(labels, inst.ejections)
                for s in _STATES:
                    state.add_metric([*labels, s], 1.0 if s == inst.state else 0.0)
                limit.add_metric(labels, inst.concurrency_limit)
                predicted.add_metric([*labels, "ttft"], inst.predicted_ttft_ms / 1000)
                predicted.add_metric([*labels, "tpot"], inst.predicted_tpot_ms / 1000)
                error.add_metric([*labels, "ttft"], inst.ttft_mae_ms / 1000)
                error.add_metric([*labels, "tpot"], inst.tpot_mae_ms / 1000)
                calibrated.add_metric(labels, 1.0 if inst.calibrated else 0.0)
        yield from (depth, in_flight, capacity, state, ejections, grants, forced)
        yield from (limit, predicted, error, calibrated)


class _LogDropsCollector(Collector):
    """`gateway_log_lines_dropped_total`: log lines (access lines included) dropped because
    stderr could not take them as fast as they came (SPEC §16: the log's buffer is bounded)."""

    def collect(self) -> Iterator[Any]:
        yield CounterMetricFamily(
            "gateway_log_lines_dropped",
            "Log lines dropped because the log output could not keep up",
            value=dropped_lines(),
        )


class _SpanDropsCollector(Collector):
    """`gateway_trace_spans_dropped_total`: spans lost because the trace exporter's bounded
    queue was full (the collector could not keep up) or their export failed for good
    (gateway.telemetry: tracing never blocks or grows without bound)."""

    def __init__(self, dropped: Callable[[], int]) -> None:
        self._dropped = dropped

    def collect(self) -> Iterator[Any]:
        yield CounterMetricFamily(
            "gateway_trace_spans_dropped",
            "Trace spans dropped because the OTLP exporter could not keep up or export them",
            value=self._dropped(),
        )


class _RestartsCollector(Collector):
    """SPEC §12 `gateway_worker_restarts_total`, read at scrape time from the supervisor's file
    (every worker sees every restart, its own included)."""

    def __init__(self, path: str) -> None:
        self._path = path

    def collect(self) -> Iterator[Any]:
        try:
            with open(self._path) as f:
                n = int(f.read())
        except (OSError, ValueError):
            n = 0
        yield CounterMetricFamily(
            "gateway_worker_restarts", "Worker processes replaced by the supervisor", value=n
        )


class _BatchCollector(Collector):
    """SPEC §14: batches per status, read at scrape time from the Batch API's counts."""

    def __init__(self, counts: Callable[[], Mapping[str, int]]) -> None:
        self._counts = counts

    def collect(self) -> Iterator[Any]:
        gauge = GaugeMetricFamily(
            "gateway_batches", "Batch API batches per status", labels=["status"]
        )
        for status, n in self._counts().items():
            gauge.add_metric([status], n)
        yield gauge


class Metrics:
    """The gateway's metrics in their own registry (one per gateway, so tests can run many)."""

    def __init__(
        self,
        runtime: Callable[[], Runtime],
        *,
        share_dir: str | None = None,
        restarts_path: str | None = None,
    ) -> None:
        """`share_dir`: SPEC §12, where the workers' snapshots live (None: one process);
        `restarts_path`: the supervisor's count of replaced workers (it serves no HTTP). Both
        come from the topology the composition root decided (`Topology`)."""
        # What this process counts (snapshotted for the other workers), and what a scrape
        # reads: that plus the live state collectors.
        r = self._own = CollectorRegistry(auto_describe=False)
        # First in the registry: every read folds the request path's counts first.
        self._tally = _Tally()
        r.register(self._tally)
        self.registry = CollectorRegistry(auto_describe=False)
        self._share = _Shared(r, share_dir) if share_dir is not None else None
        self.registry.register(self._share if self._share is not None else r)
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
        # Per client key (operators bill and throttle by key): `key` is the configured key's
        # *name* (`auth.keys[].name`), `none` without auth or before a key was recognised —
        # never the key itself. Bounded: only configured names (`keep_keys` prunes the names
        # a reload removed).
        self.key_requests = Counter(
            "gateway_key_requests",
            "Requests answered, per client key name and HTTP status",
            ["key", "code"],
            registry=r,
        )
        self.key_tokens = Counter(
            "gateway_key_tokens",
            "Tokens reported by upstream usage, per client key name",
            ["key", "kind"],
            registry=r,
        )
        #: OpenMetrics exemplars (`telemetry.exemplars`): off unless asked for — a trace id on a
        #: bucket is another tenant's, readable by whoever scrapes.
        self.exemplars = False
        # SPEC §15 "The decision is ... in metrics": placements by prompt blocks, per pool —
        # hit (the best-ranked instance, holding part of the prompt), miss (the best-ranked,
        # holding none of it: a new prefix), spill (a lower-ranked one, the bound or a full
        # instance said no) — and the prompt bytes the chosen instances held.
        self.affinity = Counter(
            "gateway_affinity_placements",
            "Requests placed by prompt prefix blocks, per pool and result (hit, miss, spill)",
            ["pool", "result"],
            registry=r,
        )
        self.affinity_bytes = Counter(
            "gateway_affinity_matched_bytes",
            "Prompt bytes the chosen instance already held (leading blocks), per pool",
            ["pool"],
            registry=r,
        )
        # SPEC §17 goodput: requests with a latency objective, per result — met, missed (late,
        # failed or timed out) or shed (`slo_unattainable`). Goodput = met / all of them.
        self.slo = Counter(
            "gateway_slo_requests",
            "Requests with a latency objective, per pool, class and result (met, missed, shed)",
            ["pool", "priority", "result"],
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
        # SPEC §14: Batch API lines finished (output or error file) and line-level retries.
        self.batch_lines = Counter(
            "gateway_batch_lines",
            "Batch API lines finished, per result (completed: 2xx; failed: in the error file)",
            ["result"],
            registry=r,
        )
        self.batch_retries = Counter(
            "gateway_batch_line_retries",
            "Batch API line retries after a 408, 429 or 5xx answer (with backoff)",
            registry=r,
        )
        for reason in REASONS:  # present from the start, so rates work from zero
            self.rejections.labels(reason)
        for result in ("completed", "failed"):
            self.batch_lines.labels(result)
        for result in ("success", "failure"):  # a failed reload alerts from the first one on
            self.reloads.labels(result)
        # This process's access/log lines the writer could not keep up with (summed over the
        # workers through the snapshots).
        r.register(_LogDropsCollector())
        # Read at scrape time from the shared region: already the whole gateway's.
        self.registry.register(_CoreCollector(runtime))
        if restarts_path is not None:
            self.registry.register(_RestartsCollector(restarts_path))
        self._children: dict[tuple[Any, ...], Any] = {}
        # The per-request calls' tally cells (`_Tally`), by the call's own arguments: one
        # lookup and an addition a call. Bounded like `_children` (names from the config,
        # status codes); all dropped (after folding) when a reload removes keys (`keep_keys`).
        self._done: dict[tuple[Any, ...], list[int]] = {}
        self._timed: dict[tuple[str, str], tuple[list[float], list[float], list[float]]] = {}
        self._waits: dict[tuple[str, str], tuple[list[float], list[float]]] = {}
        self._used: dict[tuple[str, str, str], list[int]] = {}

    def _child(self, metric: Any, *labels: str) -> Any:
        key = (id(metric), *labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*labels)
        return child

    def request_done(
        self, pool: str | None, priority: str | None, status: int, key: str = NO_KEY
    ) -> None:
        """One answered request; `key` is the caller's key *name* (`NO_KEY` when none)."""
        cell = self._done.get((pool, priority, status, key))
        if cell is None:
            code = str(status)
            cell = self._done[(pool, priority, status, key)] = self._tally.counter(
                (
                    self._child(self.requests, pool or "", priority or "", code).inc,
                    self._child(self.key_requests, key, code).inc,
                )
            )
        cell[0] += 1

    def slo_request(self, pool: str, priority: str, result: str) -> None:
        """SPEC §17: one request with an objective, `met`, `missed` or `shed`."""
        self._child(self.slo, pool, priority, result).inc()

    def keep_keys(self, names: Iterable[str]) -> None:
        """The configured key names (at start and after each reload): their token series are
        there from the start (at 0, so rates work), and the series of names no longer
        configured are dropped — the `key` label stays bounded by the config."""
        keep = {*names, NO_KEY}
        for metric in (self.key_requests, self.key_tokens):
            for labels in _label_sets(metric):
                if labels[0] not in keep:
                    with contextlib.suppress(KeyError):
                        metric.remove(*labels)
                    self._children.pop((id(metric), *labels), None)
        self._tally.reset()
        self._done.clear()
        self._used.clear()
        self._waits.clear()
        self._timed.clear()
        for name in keep:
            for kind in ("prompt", "completion"):
                self._child(self.key_tokens, name, kind)

    def waited(self, pool: str, priority: str, seconds: float, trace_id: str | None = None) -> None:
        """A slot grant after `seconds` in the queue; `trace_id` (hex, of a sampled trace)
        becomes the bucket's exemplar."""
        if trace_id is None or not self.exemplars:
            tally = self._waits.get((pool, priority))
            if tally is None:
                child = self._child(self.queue_wait, pool, priority)
                tally = self._waits[(pool, priority)] = self._tally.histogram(child)
            bounds, cell = tally
            cell[bisect_left(bounds, seconds)] += 1
            cell[-1] += seconds
        else:
            self._child(self.queue_wait, pool, priority).observe(seconds, {"trace_id": trace_id})

    def attempt(
        self,
        pool: str,
        instance: str,
        ttfb: float | None,
        total: float,
        trace_id: str | None = None,
    ) -> None:
        """One finished attempt; `trace_id` (hex, of a sampled trace) becomes the exemplar of
        both histograms' buckets."""
        if trace_id is None or not self.exemplars:
            timed = self._timed.get((pool, instance))
            if timed is None:
                bounds, first = self._tally.histogram(self._child(self.ttfb, pool, instance))
                _, whole = self._tally.histogram(self._child(self.upstream_latency, pool, instance))
                timed = self._timed[(pool, instance)] = (bounds, first, whole)
            bounds, first, whole = timed
            if ttfb is not None:
                first[bisect_left(bounds, ttfb)] += 1
                first[-1] += ttfb
            whole[bisect_left(bounds, total)] += 1
            whole[-1] += total
            return
        exemplar = {"trace_id": trace_id}
        if ttfb is not None:
            self._child(self.ttfb, pool, instance).observe(ttfb, exemplar)
        self._child(self.upstream_latency, pool, instance).observe(total, exemplar)

    def affinity_placed(self, pool: str, label: str, matched_bytes: int) -> None:
        """SPEC §15: one placement by prompt blocks (`label`: the core's hit or spill)."""
        result = "spill" if label == "spill" else ("hit" if matched_bytes else "miss")
        self._child(self.affinity, pool, result).inc()
        if matched_bytes:
            self._child(self.affinity_bytes, pool).inc(matched_bytes)

    def retry(self, pool: str) -> None:
        self._child(self.retries, pool).inc()

    def rejected(self, reason: str) -> None:
        if reason in REASONS:
            self._child(self.rejections, reason).inc()

    def used_tokens(
        self, pool: str, instance: str, usage: dict[str, Any], key: str = NO_KEY
    ) -> None:
        """An attempt's upstream `usage`, counted per instance and per client key name."""
        cell = self._used.get((pool, instance, key))
        if cell is None:
            cell = self._used[(pool, instance, key)] = self._tally.counter(
                *(
                    (
                        self._child(self.tokens, pool, instance, kind).inc,
                        self._child(self.key_tokens, key, kind).inc,
                    )
                    for kind in ("prompt", "completion")
                )
            )
        n = usage.get("prompt_tokens")
        if n.__class__ is int and n > 0:
            cell[0] += n
        n = usage.get("completion_tokens")
        if n.__class__ is int and n > 0:
            cell[1] += n

    def watch_spans(self, dropped: Callable[[], int]) -> None:
        """Exposes `gateway_trace_spans_dropped_total` from `dropped()` (tracing on only;
        summed over the workers like the other counters)."""
        self._own.register(_SpanDropsCollector(dropped))

    def watch_batches(self, counts: Callable[[], Mapping[str, int]]) -> None:
        """Exposes `gateway_batches{status}` from `counts()` (read at scrape time; with
        workers, from the Batch API's worker: the others count none)."""
        self._own.register(_BatchCollector(counts))

    def flush(self) -> None:
        """SPEC §12: writes this worker's snapshot for the others' scrapes (no-op alone)."""
        if self._share is not None:
            self._share.flush()

    def batch_line_done(self, ok: bool) -> None:
        self._child(self.batch_lines, "completed" if ok else "failed").inc()

    def batch_line_retry(self) -> None:
        self.batch_retries.inc()

    def reloaded(self, ok: bool) -> None:
        self.reloads.labels("success" if ok else "failure").inc()
        self.last_reload_success.set(1 if ok else 0)
        if ok:
            self.last_reload_time.set_to_current_time()

    def _scraped(self) -> CollectorRegistry:
        self.flush()  # what this scrape shows is never newer than the snapshot the others read
        return self.registry

    def render(self) -> bytes:
        """The classic Prometheus text format (0.0.4)."""
        return generate_latest(self._scraped())

    def exposition(self, accept: str | None = None) -> tuple[bytes, str]:
        """`(body, content_type)` for a scrape with this `Accept` header: OpenMetrics 1.0
        (with exemplars) when the scraper lists `application/openmetrics-text`, else the
        classic text format."""
        if accept and "application/openmetrics-text" in accept:
            for item in accept.split(","):
                media, _, params = item.partition(";")
                if media.strip().lower() == "application/openmetrics-text" and not _q_zero(params):
                    return _openmetrics_latest(self._scraped()), OPENMETRICS_CONTENT_TYPE
        return generate_latest(self._scraped()), CONTENT_TYPE


class _Shared(Collector):
    """SPEC §12: this worker's own metrics summed with every other worker's latest snapshot."""

    def __init__(self, own: CollectorRegistry, directory: str) -> None:
        self._own = own
        self._dir = directory
        self._pid = os.getpid()
        self._path = os.path.join(directory, f"{self._pid}.json")

    def flush(self) -> None:
        doc = [
            [m.name, m.type, m.documentation, [[s.name, s.labels, s.value] for s in m.samples]]
            for m in self._own.collect()
        ]
        tmp = self._path + ".tmp"
        with contextlib.suppress(OSError):  # a full disk costs the others' view, not a request
            with open(tmp, "wb") as f:
                f.write(orjson.dumps(doc))
            os.replace(tmp, self._path)

    def _peers(self) -> Iterator[tuple[bool, list[Any]]]:
        """(alive, snapshot) of every other worker process that ever wrote one."""
        try:
            names = os.listdir(self._dir)
        except OSError:
            return
        for name in names:
            pid_text, _, ext = name.partition(".")
            if ext != "json" or not pid_text.isdigit() or int(pid_text) == self._pid:
                continue
            try:
                with open(os.path.join(self._dir, name), "rb") as f:
                    doc = orjson.loads(f.read())
            except (OSError, orjson.JSONDecodeError):
                continue
            yield _alive(int(pid_text)), doc

    def collect(self) -> Iterator[Metric]:
        own = list(self._own.collect())
        merged = {m.name: m for m in own}
        values: dict[tuple[str, str, tuple[tuple[str, str], ...]], float] = {}
        for m in own:
            for s in m.samples:
                values[(m.name, s.name, tuple(sorted(s.labels.items())))] = s.value
        for alive, doc in self._peers():
            for name, typ, doc_text, samples in doc:
                if name not in merged:
                    merged[name] = Metric(name, doc_text, typ)
                gauge = typ == "gauge"
                if gauge and not alive:
                    continue  # a dead worker's gauge says nothing of now
                for sname, labels, value in samples:
                    key = (name, sname, tuple(sorted(labels.items())))
                    _combine(values, key, value, gauge or sname.endswith("_created"))
        for name, metric in merged.items():
            out = Metric(name, metric.documentation, metric.type)
            exemplars = {
                (s.name, tuple(sorted(s.labels.items()))): s.exemplar for s in metric.samples
            }
            for (fam, sname, labels), value in values.items():
                if fam == name:
                    out.add_sample(
                        sname, dict(labels), value, exemplar=exemplars.get((sname, labels))
                    )
            yield out


def _combine(
    values: dict[tuple[str, str, tuple[tuple[str, str], ...]], float],
    key: tuple[str, str, tuple[tuple[str, str], ...]],
    value: float,
    pick: bool,
) -> None:
    """Counters and histograms add up; a gauge takes the highest, a `_created` the earliest."""
    old = values.get(key)
    if old is None:
        values[key] = value
    elif not pick:
        values[key] = old + value
    elif key[1].endswith("_created"):
        values[key] = min(old, value)
    else:
        values[key] = max(old, value)


def _label_sets(metric: Any) -> list[tuple[str, ...]]:
    """The label values of every child of a labelled metric (prometheus-client keeps them in
    `_metrics`, under its lock)."""
    with metric._lock:
        return list(metric._metrics)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _q_zero(params: str) -> bool:
    """Whether media-type parameters hold `q=0` (RFC 9110: "not acceptable")."""
    for param in params.split(";"):
        name, _, value = param.partition("=")
        if name.strip().lower() == "q":
            try:
                return float(value.strip()) == 0.0
            except ValueError:
                return False
    return False
