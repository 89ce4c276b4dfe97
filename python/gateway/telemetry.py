"""OpenTelemetry traces of proxied requests: off by default, and free when off.

`setup(config)` returns `None` unless an OTLP endpoint is configured (`telemetry.otlp_endpoint`,
or the standard `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` / `OTEL_EXPORTER_OTLP_ENDPOINT`). Then
spans go out over OTLP/HTTP in its JSON encoding (`Content-Type: application/json`, part of the
OTLP specification; every collector accepts it) from an exporter thread of this module's own:
no OpenTelemetry package is needed or imported. A sampled request's spans are recorded as
plain tuples (ids, name, kind, times, one attribute dict built once at the span's end) into a
bounded queue; the thread encodes them with orjson and POSTs them in batches (a kept-alive
stdlib HTTP connection, retries with back-off). When the collector is slow or down, spans are
dropped and counted (`Tracing.dropped`, the metric `gateway_trace_spans_dropped_total`), never
waited for. Why not the OpenTelemetry SDK: its per-span machinery and its protobuf encoding
cost ~200 µs of CPU per traced request (benches/README.md), more than the request itself.
`OTEL_EXPORTER_OTLP_HEADERS` / `OTEL_EXPORTER_OTLP_TRACES_HEADERS` (`k=v,k2=v2`, URL-encoded
values) are sent with every export, as the SDK's exporter does.

Sampling: `sample_ratio` of the requests are kept, whatever the client sent. A client's
`traceparent` still makes the request span its child (same trace id), but its sampled flag
decides nothing — and neither does its trace id: every decision is a fresh random draw, so a
client cannot pick ids that always pass the ratio. An operator whose clients are trusted sets
`telemetry.respect_client_sampling: true`: then the client's flag decides (`sample_ratio`
for requests without a valid `traceparent`), as W3C Trace Context intends between parties
that trust each other.

What the upstream receives (`traceparent` on every attempt, either way): the client's trace id
(or a new one), the gateway's span id, and the gateway's own decision as the flag — a sampled
request's attempt span with `01`; a request the gateway does not sample carries `00` and the id
of the gateway's (unrecorded) request span, so an upstream that samples by its parent does not
export either, and the trace id still ties the upstream's logs to the client's.

When tracing is off the request path pays one `is None` test per hook site and nothing else
(no thread is started).

The span tree of one request (names and attributes after the OpenTelemetry GenAI and HTTP
semantic conventions):

    chat {alias}                SERVER   the whole request, from the handler's start
      queue                     INTERNAL one per slot acquisition (retries acquire again)
      attempt                   CLIENT   one per upstream attempt; its context is what the
      queue                              upstream receives as `traceparent`
      attempt ...

Never a key, a prompt, a header value or any other client-chosen free text in a span: names
and attributes are built from the config (pool, instance, alias, upstream model and host,
provider), the router's decision, counts, times, status codes, fixed error codes, the
request's numeric `max_tokens` / `temperature` and the upstream's finish reasons (short
identifiers). The alias enters the span name only once the router accepted it (an unknown
model name is never recorded).

GenAI attributes (semantic conventions): `gen_ai.operation.name`, `gen_ai.provider.name` (the
instance's `provider`), `gen_ai.request.model`, `gen_ai.request.max_tokens`,
`gen_ai.request.temperature`, `gen_ai.response.model`, `gen_ai.response.finish_reasons` (from
the answer's choices, streamed or not), `gen_ai.usage.input_tokens` / `output_tokens`.

How the gateway uses it (each call behind `if ... is not None`):

    tracing = telemetry.setup(config)                      # Gateway.__init__, once
    span = tracing.request(request.headers, request.path)  # start of Gateway.proxy
    span.routed(alias, data)                               # after the router's decision
    q = span.queue(pool_name)                              # before pool.acquire
    q.fail("no_healthy_instance")                          # in the branch that `break`s
    q.end(priority_label, waited_s)                        # in the acquisition's `finally`
    a = span.attempt(n, pool, instance, upstream_model, base_url, provider)  # before forwarding
    upstream.open(path, body, a.header)                    # traceparent to the upstream
    span.finish_reasons = finish_reasons(raw)              # a sampled answer (a stream's: the
                                                           # SSE checker's `finish_reasons`)
    a.end(result, ex)                                      # after Forwarder.attempt
    span.end(ex)                                           # with the request's metrics
    await tracing.close()                                  # Gateway.close (flushes)

`span.trace_id` is the trace id in hex when the request is sampled, else `None`: with
`telemetry.exemplars: true` the latency histograms carry it as an OpenMetrics exemplar
(`Metrics.attempt(..., trace_id=...)`).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import http.client
import logging
import math
import os
import random
import re
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Final, Protocol
from urllib.parse import unquote, urlsplit

import msgspec
import orjson

from gateway import __version__
from gateway._core import otlp_spans

if TYPE_CHECKING:
    from gateway._core import Priority
    from gateway.config import Config
    from gateway.router import Decision

__all__ = [
    "AttemptSpan",
    "QueueSpan",
    "RequestSpan",
    "Tracing",
    "describe",
    "finish_reasons",
    "otlp_headers",
    "otlp_settings",
    "setup",
]

log = logging.getLogger("gateway")


# What a span reads of the request when it ends: the fields of `gateway.exchange.Exchange` it
# records, as a protocol, so tracing sits below the exchange (which holds its span) and imports
# nothing above it (issue 20: no import cycles; a module below never imports one above).
class _Tried(Protocol):
    @property
    def ttfb(self) -> float | None: ...


class Finished(Protocol):
    """The request's outcome as `RequestSpan.end` and `AttemptSpan.end` read it."""

    @property
    def status(self) -> int: ...
    @property
    def error(self) -> str | None: ...
    @property
    def attempts(self) -> int: ...
    @property
    def queue_ms(self) -> float: ...
    @property
    def upstream_ms(self) -> float: ...
    @property
    def decision(self) -> Decision | None: ...
    @property
    def pool(self) -> str | None: ...
    @property
    def waited_as(self) -> Priority | None: ...
    @property
    def spilled_from(self) -> str | None: ...
    @property
    def instance(self) -> str | None: ...
    @property
    def usage(self) -> dict[str, Any] | None: ...
    @property
    def attempt(self) -> _Tried | None: ...


#: The GenAI operation of each proxied route (`gen_ai.operation.name`).
OPERATIONS: Final[Mapping[str, str]] = {
    "/v1/chat/completions": "chat",
    "/v1/completions": "text_completion",
    "/v1/embeddings": "embeddings",
}

#: Exceptions that end a slot acquisition, by class name (no import of the core needed), to
#: the error code a client gets for them (SPEC §7).
_QUEUE_ERRORS: Final[Mapping[str, str]] = {
    "QueueFull": "queue_full",
    "QueueTimeout": "queue_timeout",
    "Draining": "draining",
    "NoHealthyInstance": "no_healthy_instance",
    "Unservable": "no_healthy_instance",
    "CancelledError": "cancelled",
}

_TRACES_PATH: Final = "/v1/traces"
_DEFAULT_SERVICE: Final = "gateway"


# ---------------------------------------------------------------------------------------------
# Settings.


def otlp_settings(
    config: Config, env: Mapping[str, str] | None = None
) -> tuple[str, str, float] | None:
    """`(traces_url, service_name, sample_ratio)` when tracing is on, else `None`.

    The endpoint: `telemetry.otlp_endpoint` in the config, else
    `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` (used as is), else `OTEL_EXPORTER_OTLP_ENDPOINT`.
    Like the latter, a configured endpoint is the collector's base URL
    (`http://collector:4318`); `/v1/traces` is appended unless the path already ends so.
    `OTEL_SDK_DISABLED=true` turns tracing off whatever is set. The service name:
    `telemetry.service_name`, else `OTEL_SERVICE_NAME`, else `gateway`.
    """
    env = os.environ if env is None else env
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return None
    tel = config.telemetry
    endpoint = (tel.otlp_endpoint or "").strip()
    if endpoint:
        url = _traces_url(endpoint)
    elif traces := env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "").strip():
        url = traces
    elif base := env.get("OTEL_EXPORTER_OTLP_ENDPOINT", "").strip():
        url = _traces_url(base)
    else:
        return None
    service = tel.service_name or env.get("OTEL_SERVICE_NAME", "").strip() or _DEFAULT_SERVICE
    return url, service, tel.sample_ratio


def _traces_url(base: str) -> str:
    base = base.rstrip("/")
    return base if base.endswith(_TRACES_PATH) else base + _TRACES_PATH


def describe(config: Config, env: Mapping[str, str] | None = None) -> str:
    """One line for `gateway check`: `off`, or where spans go (scheme, host and port only:
    a collector URL may carry a token in its path or query)."""
    settings = otlp_settings(config, env)
    if settings is None:
        return "off"
    url, service, ratio = settings
    parts = urlsplit(url)
    where = f"{parts.scheme}://{parts.hostname or '?'}" + (f":{parts.port}" if parts.port else "")
    return f"OTLP/HTTP {where} service={service} sample_ratio={ratio:g}"


def setup(
    config: Config,
    env: Mapping[str, str] | None = None,
    *,
    exporter: Callable[[bytes], bool] | None = None,
    schedule_delay_ms: int | None = None,
) -> Tracing | None:
    """The tracer for a gateway, or `None` when tracing is off (then nothing is imported).

    `exporter` replaces the HTTP POST of each encoded batch (benchmarks): a callable taking
    the OTLP/JSON body and answering whether it was accepted.
    """
    settings = otlp_settings(config, env)
    if settings is None:
        return None
    url, service, ratio = settings
    return Tracing(
        url,
        service,
        ratio,
        exporter=exporter,
        schedule_delay_ms=schedule_delay_ms,
        respect_client_sampling=config.telemetry.respect_client_sampling,
        headers=otlp_headers(os.environ if env is None else env),
    )


def otlp_headers(env: Mapping[str, str]) -> dict[str, str]:
    """The headers of every export: `OTEL_EXPORTER_OTLP_TRACES_HEADERS`, else
    `OTEL_EXPORTER_OTLP_HEADERS` (`key=value` pairs, comma-separated, values URL-encoded).
    A pair that is not `key=value`, or holds CR/LF, is ignored."""
    raw = env.get("OTEL_EXPORTER_OTLP_TRACES_HEADERS") or env.get("OTEL_EXPORTER_OTLP_HEADERS")
    out: dict[str, str] = {}
    for pair in (raw or "").split(","):
        key, eq, value = pair.partition("=")
        key, value = unquote(key.strip()), unquote(value.strip())
        if eq and key and "\r" not in key + value and "\n" not in key + value:
            out[key] = value
    return out


# ---------------------------------------------------------------------------------------------
# The hooks.


#: One finished span: trace id, span id, parent span id (0: none), name, kind (OTLP enum),
#: start and end (ns since the epoch), attributes, status (0 unset, 2 error), tracestate.
_Record = tuple[int, int, int, str, int, int, int, dict[str, Any], int, str]

_INTERNAL: Final = 1
_SERVER: Final = 2
_CLIENT: Final = 3
_ERROR: Final = 2
#: The exporter's bounds (the SDK's defaults): at most this many spans queued, this many per
#: export, one export at least every `_DELAY_MS`.
_MAX_QUEUE: Final = 2048
_BATCH: Final = 512
_DELAY_MS: Final = 2000
_EXPORT_TIMEOUT_S: Final = 10.0
_SHUTDOWN_S: Final = 5.0


class Tracing:
    """The gateway's tracer: its spans, its sampling and its exporter thread (one per gateway,
    so several gateways in one process, as in tests, each export where they were told).

    A finished span is one tuple appended to a bounded deque (`_record`): ids, name, kind,
    start and end times, one attribute dict built once at the span's end, its status. The
    exporter thread takes them in batches, encodes them as OTLP/JSON (orjson) and POSTs them.
    """

    def __init__(
        self,
        endpoint: str,
        service_name: str = _DEFAULT_SERVICE,
        sample_ratio: float = 1.0,
        *,
        exporter: Callable[[bytes], bool] | None = None,
        schedule_delay_ms: int | None = None,
        respect_client_sampling: bool = False,
        headers: Mapping[str, str] | None = None,
        max_queue: int = _MAX_QUEUE,
    ) -> None:
        self.endpoint = endpoint
        self.service_name = service_name
        self.sample_ratio = sample_ratio
        self.respect_client_sampling = respect_client_sampling
        self._servers: dict[str, tuple[str, int]] = {}
        self._queue: deque[_Record] = deque()
        self._max_queue = max_queue
        #: Spans dropped because the queue was full (counted on the event loop's thread) and
        #: because their export failed for good (counted on the exporter's thread): `dropped`.
        self._dropped_full = 0
        self._dropped_export = 0
        #: Spans a collector accepted.
        self.exported = 0
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._deadline = math.inf  # monotonic: retries stop here once shutting down
        self._lock = threading.Lock()  # one export at a time (the thread or a force_flush)
        self._thread: threading.Thread | None = None
        self._closed = False
        self._delay = (schedule_delay_ms if schedule_delay_ms is not None else _DELAY_MS) / 1000
        self._sender: _Sender | None = None
        if exporter is None:
            self._sender = _Sender(endpoint, headers or {})
            exporter = self._sender.post
        self._export: Callable[[bytes], bool] = exporter
        self._fragments: dict[tuple[str, Any], bytes] = {}
        self._prefix = orjson.dumps(
            {
                "resource": {
                    "attributes": _json_attrs(
                        {"service.name": service_name, "service.version": __version__}
                    )
                },
            }
        )[:-1] + b',"scopeSpans":[{"scope":{"name":"gateway","version":"%s"},"spans":' % (
            __version__.encode("ascii", "replace")
        )

    @property
    def dropped(self) -> int:
        """Spans lost: the queue was full (the collector could not keep up) or their batch
        could not be exported (for `gateway_trace_spans_dropped_total`)."""
        return self._dropped_full + self._dropped_export

    # ---- per request -----------------------------------------------------------------------

    def request(self, headers: Mapping[str, str], path: str) -> RequestSpan:
        """Starts the SERVER span of one proxied request (`path`: the route, e.g.
        `/v1/chat/completions`). A valid W3C `traceparent` (and `tracestate`) from the client
        makes it that span's child; anything else in those headers is ignored. `headers` is
        looked up case-insensitively when it is aiohttp's (plain dicts: lower-case keys)."""
        raw = headers.get("traceparent")
        parent = _parse_traceparent(raw) if raw is not None else None
        ratio = self.sample_ratio
        state = ""
        if parent is None:
            trace = random.getrandbits(128) or 1
            parent_id = 0
            sampled = ratio > 0.0 and (ratio >= 1.0 or random.random() < ratio)
        else:
            trace, parent_id, flags = parent
            if self.respect_client_sampling:
                # The client's sampled flag decides for its requests (trusted clients).
                sampled = bool(flags & 1)
            else:
                # SPEC §9: sample_ratio rules — a client's sampled `traceparent` cannot force
                # an export (nor can its choice of trace id: a fresh draw decides).
                sampled = ratio > 0.0 and (ratio >= 1.0 or random.random() < ratio)
            rawstate = headers.get("tracestate")
            if rawstate:
                state = _valid_tracestate(rawstate)
        return RequestSpan(self, trace, parent_id, state, sampled, path)

    def server_of(self, url: str) -> tuple[str, int]:
        """`(host, port)` of an instance's base URL (parsed once per URL)."""
        found = self._servers.get(url)
        if found is None:
            parts = urlsplit(url)
            port = parts.port or (443 if parts.scheme.lower() == "https" else 80)
            found = self._servers[url] = (parts.hostname or "", port)
        return found

    def _record(self, rec: _Record) -> None:
        """Queues one finished span (the event loop's only cost of export: never blocks)."""
        q = self._queue
        n = len(q)
        if n >= self._max_queue or self._closed:
            # SPEC §16: bounded — a collector that cannot keep up loses spans, counted.
            self._dropped_full += 1
            return
        q.append(rec)
        if self._thread is None:
            self._start()
        elif n + 1 >= _BATCH and not self._wake.is_set():
            self._wake.set()

    # ---- the exporter thread ---------------------------------------------------------------

    def _start(self) -> None:
        # Started on the first span (in the process that records: a worker, not a parent
        # that forks).
        self._thread = threading.Thread(target=self._run, name="gateway-otlp", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        last = time.monotonic()  # the last time the queue was exported to its end
        while not self._stopping.is_set():
            self._wake.wait(max(0.0, last + self._delay - time.monotonic()))
            self._wake.clear()
            if self._stopping.is_set():
                break
            now = time.monotonic()
            # Woken by a full batch: full batches only; what is left waits for the next full
            # one or for the delay. (Draining to the end on every wake exported whatever came
            # in while the last batch was being sent: under steady load a POST every few
            # spans — 1,843 POSTs of median 9 spans where 115 of 512 do — at ~15 µs of
            # exporter CPU per request, and the GIL taken from the loop as often.)
            whole = now - last >= self._delay
            with self._lock:
                self._drain(full_only=not whole)
            if whole:
                last = now
        with self._lock:
            self._drain()

    def _drain(self, full_only: bool = False) -> bool:
        """Exports what is queued, in batches of `_BATCH` (call with `_lock` held): all of it,
        or (`full_only`) only whole batches. True when every batch was accepted."""
        q = self._queue
        ok = True
        while q and (not full_only or len(q) >= _BATCH):
            batch = [q.popleft() for _ in range(min(len(q), _BATCH))]
            try:
                body = self._encode(batch)
            except Exception:  # a bug here must not kill the thread
                log.debug("span encoding failed", exc_info=True)
                self._dropped_export += len(batch)
                ok = False
                continue
            if self._send(body):
                self.exported += len(batch)
            else:
                self._dropped_export += len(batch)
                ok = False
        return ok

    def _send(self, body: bytes) -> bool:
        """POSTs one batch, retrying a collector that is down or busy with exponential
        back-off (0.25 s, 0.5 s, ... up to 8 s) for at most `_EXPORT_TIMEOUT_S`, and never past
        the shutdown deadline."""
        deadline = min(time.monotonic() + _EXPORT_TIMEOUT_S, self._deadline)
        backoff = 0.25
        while True:
            try:
                if self._export(body):
                    return True
            except _Permanent:
                return False
            except Exception:
                log.debug("span export failed", exc_info=True)
            now = time.monotonic()
            end = min(deadline, self._deadline)
            if now + backoff >= end:
                return False
            if self._stopping.is_set():
                time.sleep(backoff)  # shutting down: retry until its deadline
            else:
                self._stopping.wait(backoff)  # a shutdown cuts the wait short
            backoff = min(backoff * 2, 8.0)

    def _encode(self, batch: list[_Record]) -> bytes:
        """One OTLP/JSON `ExportTraceServiceRequest` of `batch`, written by the extension in
        one call (`_core.otlp_spans`: the same bytes as `_encode_py`, ~1/5 of its CPU), or by
        `_encode_py` when a value is outside the extension's common case (a value of another
        type than exactly str, bool, a 64-bit int, float, or a list or tuple of str)."""
        body = otlp_spans(batch, self._prefix)
        return body if body is not None else self._encode_py(batch)

    def _encode_py(self, batch: list[_Record]) -> bytes:
        """One OTLP/JSON `ExportTraceServiceRequest` (the OTLP/HTTP JSON encoding: ids in hex,
        64-bit integers as strings, enums as numbers), written straight as bytes: each
        attribute's `{"key":...,"value":...}` object is one cached fragment when its value
        is a string or a bool (names, pools, models: they repeat) and one `%` format for a
        number (orjson still escapes every string, once)."""
        parts = []
        cache = self._fragments
        for trace, sid, parent, name, kind, start, end, attrs, status, state in batch:
            fields = []
            for key, v in attrs.items():
                cls = type(v)
                if cls is int:
                    fields.append(_INT_ATTR % (_key(key), v))
                elif cls is float:
                    fields.append(_FLOAT_ATTR % (_key(key), _float(v)))
                elif cls is str or cls is bool:
                    frag = cache.get((key, v))
                    if frag is None:
                        frag = _fragment(key, v)
                        if len(cache) < _MAX_FRAGMENTS:
                            cache[(key, v)] = frag
                    fields.append(frag)
                else:
                    fields.append(_fragment(key, v))
            head = _SPAN_HEAD % (trace, sid, _key(name), kind, start, end)
            if parent:
                head += b',"parentSpanId":"%016x"' % parent
            if state:
                head += b',"traceState":' + orjson.dumps(state)
            if status:
                head += b',"status":{"code":%d}' % status
            parts.append(head + b',"attributes":[' + b",".join(fields) + b"]}")
        return b'{"resourceSpans":[' + self._prefix + b"[" + b",".join(parts) + b"]}]}]}"

    # ---- lifecycle -------------------------------------------------------------------------

    def force_flush(self, timeout_ms: int = 30_000) -> bool:
        """Exports every finished span now (blocking: from a coroutine, run it in a thread,
        e.g. `await asyncio.to_thread(tracing.force_flush)`). True when all were accepted."""
        if not self._lock.acquire(timeout=timeout_ms / 1000):
            return False
        try:
            saved = self._deadline
            self._deadline = min(saved, time.monotonic() + timeout_ms / 1000)
            try:
                return self._drain()
            finally:
                self._deadline = saved
        finally:
            self._lock.release()

    def shutdown(self, timeout_s: float = _SHUTDOWN_S) -> None:
        """Exports what is queued (retrying for at most `timeout_s`) and stops the exporter
        thread (blocking; see `close()`). Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._deadline = time.monotonic() + timeout_s
        self._stopping.set()
        self._wake.set()
        thread = self._thread
        if thread is not None:
            thread.join(timeout_s + 1.0)
        else:
            with self._lock:
                self._drain()
        if self._sender is not None:
            self._sender.close()

    async def close(self, timeout_s: float = 5.0) -> None:
        """`shutdown()` off the event loop, waited for at most `timeout_s`: the last export to
        a collector that is down retries until the shutdown deadline, which must not hold up
        the gateway's exit. The shutdown goes on in a daemon thread; its spans are lost if
        the process ends."""
        loop = asyncio.get_running_loop()
        done: asyncio.Future[None] = loop.create_future()

        def finished() -> None:
            if not done.done():
                done.set_result(None)

        def run() -> None:
            try:
                self.shutdown(timeout_s)
            except Exception:
                log.debug("tracer shutdown failed", exc_info=True)
            finally:
                with contextlib.suppress(RuntimeError):  # the loop may be closed by now
                    loop.call_soon_threadsafe(finished)

        threading.Thread(target=run, name="gateway-otlp-shutdown", daemon=True).start()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(done), timeout_s)


class _Permanent(Exception):
    """A collector's answer that a retry cannot change (4xx but 429)."""


class _Sender:
    """POSTs OTLP/JSON bodies to the collector over one kept-alive connection (stdlib
    `http.client`, on the exporter thread: no event loop involved)."""

    def __init__(self, url: str, headers: Mapping[str, str]) -> None:
        parts = urlsplit(url)
        self._https = parts.scheme.lower() == "https"
        self._host = parts.hostname or "127.0.0.1"
        self._port = parts.port or (443 if self._https else 80)
        self._path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        self._headers = {**headers, "Content-Type": "application/json"}
        if parts.username is not None and not any(
            k.lower() == "authorization" for k in self._headers
        ):
            # A collector URL with credentials (`https://user:token@host`): HTTP Basic, as
            # the SDK's exporter (requests) sent them.
            cred = f"{unquote(parts.username)}:{unquote(parts.password or '')}"
            self._headers["Authorization"] = "Basic " + base64.b64encode(cred.encode()).decode()
        self._conn: http.client.HTTPConnection | None = None

    def _connect(self) -> http.client.HTTPConnection:
        if self._https:
            import ssl

            return http.client.HTTPSConnection(
                self._host,
                self._port,
                timeout=_EXPORT_TIMEOUT_S,
                context=ssl.create_default_context(),
            )
        return http.client.HTTPConnection(self._host, self._port, timeout=_EXPORT_TIMEOUT_S)

    def post(self, body: bytes) -> bool:
        conn = self._conn
        if conn is None:
            conn = self._conn = self._connect()
        try:
            conn.request("POST", self._path, body, self._headers)
            resp = conn.getresponse()
            resp.read()
            status = resp.status
        except Exception:
            self.close()
            raise
        if resp.will_close:
            self.close()
        if 200 <= status < 300:
            return True
        if status in (429, 502, 503, 504):
            return False  # retried
        # OTLP/HTTP: other errors are not retryable; the batch is dropped (and counted).
        log.debug("collector refused spans", extra={"fields": {"status": status}})
        raise _Permanent(status)

    def close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(Exception):
                conn.close()


#: At most this many cached attribute fragments (`Tracing._encode`), so that values that
#: do not repeat cannot grow the cache.
_MAX_FRAGMENTS: Final = 4096
_SPAN_HEAD: Final = (
    b'{"traceId":"%032x","spanId":"%016x","name":%s,"kind":%d,'
    b'"startTimeUnixNano":"%d","endTimeUnixNano":"%d"'
)
_INT_ATTR: Final = b'{"key":%s,"value":{"intValue":"%d"}}'
_FLOAT_ATTR: Final = b'{"key":%s,"value":{"doubleValue":%s}}'
_keys: dict[str, bytes] = {}


def _key(text: str) -> bytes:
    """`text` as a JSON string (cached: attribute keys and span names repeat)."""
    found = _keys.get(text)
    if found is None:
        found = orjson.dumps(text)
        if len(_keys) < _MAX_FRAGMENTS:
            _keys[text] = found
    return found


def _float(v: float) -> bytes:
    # OTLP/JSON: a double is a JSON number; NaN and infinities as the strings proto3 uses.
    if math.isfinite(v):
        return repr(v).encode()
    return b'"NaN"' if v != v else (b'"Infinity"' if v > 0 else b'"-Infinity"')


def _fragment(key: str, v: Any) -> bytes:
    """One attribute's `{"key":...,"value":...}` object (`null` for a value of no OTLP type:
    never recorded, as the span's attributes are built by this module)."""
    found = _json_attrs({key: v})
    return orjson.dumps(found[0] if found else {"key": key, "value": {}})


def _json_attrs(attrs: Mapping[str, Any]) -> list[dict[str, Any]]:
    out = []
    for key, v in attrs.items():
        if isinstance(v, str):
            value: dict[str, Any] = {"stringValue": v}
        elif isinstance(v, bool):
            value = {"boolValue": v}
        elif isinstance(v, int):
            value = {"intValue": str(v)}
        elif isinstance(v, float):
            value = {"doubleValue": v}
        elif isinstance(v, (list, tuple)):
            value = {"arrayValue": {"values": [{"stringValue": str(x)} for x in v]}}
        else:
            continue
        out.append({"key": key, "value": value})
    return out


_TRACEPARENT = re.compile(r"([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-[^\r\n]*)?")
_TS_KEY = re.compile(
    r"[a-z][_0-9a-z\-*/]{0,255}|[a-z0-9][_0-9a-z\-*/]{0,240}@[a-z][_0-9a-z\-*/]{0,13}"
)
_TS_VALUE = re.compile(r"[\x20-\x2b\x2d-\x3c\x3e-\x7e]{0,255}[\x21-\x2b\x2d-\x3c\x3e-\x7e]")


def _parse_traceparent(header: str) -> tuple[int, int, int] | None:
    """`(trace id, parent span id, flags)` of a valid W3C `traceparent`, else None (version
    `ff`, a version 00 with more fields, an all-zero id, upper-case hex: all invalid)."""
    m = _TRACEPARENT.fullmatch(header.strip(" \t"))
    if m is None:
        return None
    version, trace, span, flags, rest = m.groups()
    if version == "ff" or (version == "00" and rest):
        return None
    t, s = int(trace, 16), int(span, 16)
    if not t or not s:
        return None
    return t, s, int(flags, 16)


def _valid_tracestate(header: str) -> str:
    """The client's `tracestate` when every member is valid (at most 32, keys unique), else
    "" — so nothing but printable `key=value` lists ever reaches a header line."""
    members = [m.strip(" \t") for m in header.split(",")]
    members = [m for m in members if m]
    if not members or len(members) > 32:
        return ""
    keys = set()
    for m in members:
        key, eq, value = m.partition("=")
        if not eq or key in keys or not _TS_KEY.fullmatch(key) or not _TS_VALUE.fullmatch(value):
            return ""
        keys.add(key)
    return ",".join(members)


class RequestSpan:
    """The SERVER span of one request; see the module docstring for where each call goes.

    Every method is safe to call in any state and never raises into the request path.
    """

    __slots__ = (
        "_alias",
        "_attempt",
        "_ended",
        "_op",
        "_path",
        "_provider",
        "_queue",
        "_request_attrs",
        "_start",
        "_upstream_model",
        "finish_reasons",
        "parent_id",
        "recording",
        "span_id",
        "state",
        "t",
        "trace",
        "trace_id",
    )

    def __init__(
        self, tracing: Tracing, trace: int, parent_id: int, state: str, sampled: bool, path: str
    ) -> None:
        self.t = tracing
        self.trace = trace
        self.parent_id = parent_id
        #: The client's (validated) `tracestate`, passed on to the upstream.
        self.state = state
        self.span_id = random.getrandbits(64) or 1
        self._path = path
        self._op = OPERATIONS.get(path, "chat")
        self._alias: str | None = None
        #: Whether this request is sampled (recorded and exported).
        self.recording = sampled
        #: The trace id in hex when sampled, for exemplars and log lines; else None.
        self.trace_id: str | None = f"{trace:032x}" if sampled else None
        self._start = time.time_ns()
        self._queue: QueueSpan | None = None
        self._attempt: AttemptSpan | None = None
        self._upstream_model: str | None = None
        self._provider: str | None = None
        self._request_attrs: dict[str, Any] = {}
        #: The answer's finish reasons, one per choice (set by the forwarder for a sampled
        #: request: `finish_reasons(body)`, or a stream's `SseChecker.finish_reasons`).
        self.finish_reasons: list[str] | None = None
        self._ended = False

    def routed(self, alias: str, request: Mapping[str, Any] | None = None) -> None:
        """The router accepted `alias` (a configured model alias): the span is renamed
        `{operation} {alias}` and gets `gen_ai.request.model`, and — from the parsed body
        `request` — `gen_ai.request.max_tokens` and `gen_ai.request.temperature` when they are
        numbers (the attempts get them too). Call it only after the router decided: an unknown
        model name never enters a span."""
        if self.recording:
            try:
                self._alias = alias
                self._request_attrs = _request_attrs(request)
            except Exception:  # never into the request path
                log.debug("request span failed", exc_info=True)

    def queue(self, pool: str) -> QueueSpan:
        """Starts the `queue` span of one slot acquisition in `pool`."""
        q = QueueSpan(self, pool)
        self._queue = q
        return q

    def attempt(
        self,
        n: int,
        pool: str,
        instance: str,
        upstream_model: str,
        url: str,
        provider: str | None = None,
    ) -> AttemptSpan:
        """Starts the CLIENT span of attempt `n` (1-based) on `instance` (base URL `url`,
        the instance's configured `provider`); its `header` goes to the upstream."""
        a = AttemptSpan(self, n, pool, instance, upstream_model, url, provider)
        self._attempt = a
        return a

    def end(self, ex: Finished) -> None:
        """Ends the request span with what the exchange learned (call it once the status is
        final: next to the request's metrics). Ends a queue or attempt span left open (a
        cancelled request). Idempotent."""
        if self._ended:
            return
        self._ended = True
        try:
            status, error = ex.status, ex.error
            for child in (self._queue, self._attempt):
                if child is not None and not child.ended:
                    child._finish(error or "cancelled")
            if not self.recording:
                return
            path = self._path
            attrs: dict[str, Any] = {
                "gen_ai.operation.name": self._op,
                "http.request.method": "POST",
                "http.route": path if path in OPERATIONS else "other",
            }
            alias = self._alias
            if alias is not None:
                attrs["gen_ai.request.model"] = alias
                attrs.update(self._request_attrs)
            attrs["http.response.status_code"] = status
            attrs["gateway.attempt"] = ex.attempts
            attrs["gateway.queue_ms"] = round(ex.queue_ms, 3)
            attrs["gateway.upstream_ms"] = round(ex.upstream_ms, 3)
            d = ex.decision
            pool = ex.pool or (d.pool if d is not None else None)
            if pool is not None:
                attrs["gateway.pool"] = pool
            if d is not None:
                attrs["gateway.priority"] = (ex.waited_as or d.priority).label
                attrs["gateway.priority_rule"] = d.priority_rule
                attrs["gateway.complexity"] = d.complexity
                attrs["gateway.complexity_rule"] = d.complexity_rule
            if ex.spilled_from is not None:
                attrs["gateway.spilled_from"] = ex.spilled_from
            if ex.instance is not None:
                attrs["gateway.instance"] = ex.instance
                if self._provider is not None:
                    attrs["gen_ai.provider.name"] = self._provider
                if self._upstream_model is not None and status < 400:
                    attrs["gen_ai.response.model"] = self._upstream_model
                if self.finish_reasons and status < 400:
                    attrs["gen_ai.response.finish_reasons"] = self.finish_reasons
            _add_usage(attrs, ex.usage)
            # HTTP server spans: a 5xx is the gateway's failure, a 4xx the client's (an
            # `error.type` without ERROR status); a 200 stream that failed mid-way is one too.
            if error is not None:
                attrs["error.type"] = error
            failed = status >= 500 or (error is not None and status < 400)
            name = self._op if alias is None else f"{self._op} {alias}"
            self.t._record(
                (
                    self.trace,
                    self.span_id,
                    self.parent_id,
                    name,
                    _SERVER,
                    self._start,
                    time.time_ns(),
                    attrs,
                    _ERROR if failed else 0,
                    self.state,
                )
            )
        except Exception:  # never into the request path
            log.debug("request span failed", exc_info=True)


class QueueSpan:
    """The INTERNAL `queue` span of one slot acquisition."""

    __slots__ = ("_pool", "_req", "_start", "ended", "error")

    def __init__(self, req: RequestSpan, pool: str) -> None:
        self._req = req
        self._pool = pool
        self.ended = False
        #: Set by `fail()` for an error the caller handles without raising.
        self.error: str | None = None
        self._start = time.time_ns() if req.recording else 0

    def fail(self, error: str) -> None:
        """Records why the acquisition ended without a slot when the caller does not raise
        (`except NoHealthyInstance: ... break`); `end()` still ends the span."""
        self.error = error

    def end(self, priority: str | None = None, waited_s: float | None = None) -> None:
        """Ends the span (call it in the `finally` of the acquisition). The error, if any, is
        the one `fail()` recorded or the exception in flight (an `HttpError`'s code, or the
        queue's own exceptions), so the `finally` needs no branch per outcome."""
        if self.ended:
            return
        error = self.error
        if error is None:
            exc = sys.exc_info()[1]
            if exc is not None:
                error = _error_code(exc)
        self._finish(error, priority, waited_s)

    def _finish(
        self, error: str | None, priority: str | None = None, waited_s: float | None = None
    ) -> None:
        self.ended = True
        req = self._req
        if not req.recording:
            return
        try:
            attrs: dict[str, Any] = {"gateway.pool": self._pool}
            if priority is not None:
                attrs["gateway.priority"] = priority
            if waited_s is not None:
                attrs["gateway.queue_ms"] = round(waited_s * 1000, 3)
            if error is not None:
                attrs["error.type"] = error
            req.t._record(
                (
                    req.trace,
                    random.getrandbits(64) or 1,
                    req.span_id,
                    "queue",
                    _INTERNAL,
                    self._start,
                    time.time_ns(),
                    attrs,
                    0 if error is None else _ERROR,
                    req.state,
                )
            )
        except Exception:
            log.debug("queue span failed", exc_info=True)


class AttemptSpan:
    """The CLIENT `attempt` span of one upstream attempt.

    `header` is the W3C trace context for the upstream request, ready to append to a request
    head: `b"traceparent: 00-<trace>-<span>-<flags>\\r\\n"` (and a `tracestate:` line when the
    client sent one). `headers()` gives the same as a dict.
    """

    __slots__ = ("_attrs", "_req", "_start", "ended", "header", "span_id")

    def __init__(
        self,
        req: RequestSpan,
        n: int,
        pool: str,
        instance: str,
        upstream_model: str,
        url: str,
        provider: str | None = None,
    ) -> None:
        self._req = req
        self.ended = False
        req._upstream_model = upstream_model
        req._provider = provider
        req.finish_reasons = None  # this attempt's answer, not a previous one's
        if req.recording:
            host, port = req.t.server_of(url)
            attrs: dict[str, Any] = {
                "gen_ai.operation.name": req._op,
                "gen_ai.request.model": upstream_model,
                **req._request_attrs,
                "server.address": host,
                "server.port": port,
                "gateway.attempt": n,
                "gateway.pool": pool,
                "gateway.instance": instance,
            }
            if provider is not None:
                attrs["gen_ai.provider.name"] = provider
            self._attrs: dict[str, Any] | None = attrs
            self.span_id = random.getrandbits(64) or 1
            self._start = time.time_ns()
            flags = b"01"
        else:
            # Not sampled: no child span; the upstream still learns the trace and that it is
            # not sampled (flags 00), from the request span's own (unrecorded) id.
            self._attrs = None
            self.span_id = req.span_id
            self._start = 0
            flags = b"00"
        line = b"traceparent: 00-%032x-%016x-%s\r\n" % (req.trace, self.span_id, flags)
        if req.state:
            # Validated on the way in (printable, no `,` or `=` but the separators, no
            # CR/LF): safe on a header line.
            line += b"tracestate: " + req.state.encode("ascii") + b"\r\n"
        self.header: bytes = line

    def headers(self) -> dict[str, str]:
        """`header` as a dict (for an HTTP client that takes one)."""
        out: dict[str, str] = {}
        for line in self.header.decode("ascii").split("\r\n"):
            if line:
                name, _, value = line.partition(": ")
                out[name] = value
        return out

    def end(self, result: Any, ex: Finished) -> None:
        """Ends the span with what `Forwarder.attempt` returned: an `AttemptError` (failed
        before any byte reached the client; it has `.status`, `.timeout`) or the response
        (then `ex.error` tells a stream that failed after it started)."""
        if self.ended:
            return
        self.ended = True
        attrs = self._attrs
        if attrs is None:
            return
        try:
            status = getattr(result, "status", 0)
            error: str | None = None
            if isinstance(result, Exception):
                error = (
                    "upstream_timeout" if getattr(result, "timeout", False) else "upstream_error"
                )
            elif ex.error is not None:
                error = ex.error
            elif isinstance(status, int) and status >= 400:
                error = str(status)
            if isinstance(status, int) and status > 0:
                attrs["http.response.status_code"] = status
            ttfb = ex.attempt.ttfb if ex.attempt is not None else None
            if ttfb is not None:
                attrs["gateway.ttfb_ms"] = round(ttfb * 1000, 3)
            req = self._req
            if error is None:
                _add_usage(attrs, ex.usage)
                attrs["gen_ai.response.model"] = req._upstream_model
                if req.finish_reasons:
                    attrs["gen_ai.response.finish_reasons"] = req.finish_reasons
            else:
                attrs["error.type"] = error
            self._emit(attrs, error)
        except Exception:
            log.debug("attempt span failed", exc_info=True)

    def _emit(self, attrs: dict[str, Any], error: str | None) -> None:
        req = self._req
        req.t._record(
            (
                req.trace,
                self.span_id,
                req.span_id,
                "attempt",
                _CLIENT,
                self._start,
                time.time_ns(),
                attrs,
                0 if error is None else _ERROR,
                req.state,
            )
        )

    def _finish(self, error: str) -> None:
        """Ends a span its request left open (cancelled, or a bug past the attempt)."""
        self.ended = True
        attrs = self._attrs
        if attrs is None:
            return
        try:
            attrs["error.type"] = error
            self._emit(attrs, error)
        except Exception:
            log.debug("attempt span failed", exc_info=True)


def _error_code(exc: BaseException) -> str:
    """The SPEC §7 code of an exception that ended a slot acquisition: the queue's own by
    name, else a `code` it carries, else its class name in snake case (`QueueFull` →
    `queue_full`), which is how the error classes are named after their codes."""
    name = type(exc).__name__
    known = _QUEUE_ERRORS.get(name)
    if known is not None:
        return known
    code = getattr(exc, "code", None)
    if isinstance(code, str) and code:
        return code
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()


def _add_usage(attrs: dict[str, Any], usage: Mapping[str, Any] | None) -> None:
    if not usage:
        return
    n = usage.get("prompt_tokens")
    if isinstance(n, int):
        attrs["gen_ai.usage.input_tokens"] = n
    n = usage.get("completion_tokens")
    if isinstance(n, int):
        attrs["gen_ai.usage.output_tokens"] = n


# ---------------------------------------------------------------------------------------------
# GenAI request and response attributes.

#: At most this many finish reasons (one per choice) of at most this many characters each: an
#: upstream's answer cannot make a span grow without bound.
_MAX_REASONS: Final = 16
_MAX_REASON_CHARS: Final = 64


class _Choice(msgspec.Struct):
    finish_reason: Any = None


class _Choices(msgspec.Struct):
    choices: list[_Choice] | None = None


_choices = msgspec.json.Decoder(_Choices)


def finish_reasons(body: bytes) -> list[str] | None:
    """The `finish_reason` of each choice of a complete (non-streamed) answer, or None when it
    has none (or is no JSON object of that shape). Parsed only for sampled requests."""
    try:
        doc = _choices.decode(body)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None
    return add_reasons(None, (c.finish_reason for c in doc.choices or ()))


def add_reasons(reasons: list[str] | None, found: Any) -> list[str] | None:
    """`reasons` with the string reasons in `found` appended (bounded; see `_MAX_REASONS`)."""
    for reason in found:
        if isinstance(reason, str) and reason:
            if reasons is None:
                reasons = []
            if len(reasons) < _MAX_REASONS:
                reasons.append(reason[:_MAX_REASON_CHARS])
    return reasons


def _request_attrs(data: Mapping[str, Any] | None) -> dict[str, Any]:
    """`gen_ai.request.max_tokens` / `temperature` of a request body, when they are numbers
    (nothing else of the body is read)."""
    out: dict[str, Any] = {}
    if data is None:
        return out
    limit = data.get("max_tokens")
    if limit is None:
        limit = data.get("max_completion_tokens")
    if isinstance(limit, int) and not isinstance(limit, bool) and 0 <= limit < 2**63:
        out["gen_ai.request.max_tokens"] = limit
    temp = data.get("temperature")
    if isinstance(temp, (int, float)) and not isinstance(temp, bool) and math.isfinite(temp):
        out["gen_ai.request.temperature"] = float(temp)
    return out
