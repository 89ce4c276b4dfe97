"""OpenTelemetry traces of proxied requests: off by default, and free when off.

`setup(config)` returns `None` unless an OTLP endpoint is configured (`telemetry.otlp_endpoint`,
or the standard `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` / `OTEL_EXPORTER_OTLP_ENDPOINT`). Then,
and only then, the OpenTelemetry SDK is imported (the `otel` extra: `pip install gateway[otel]`)
and spans go out over OTLP/HTTP (protobuf) from a `BatchSpanProcessor`: a request only appends
its finished spans to an in-memory queue; export happens on the processor's thread and, when
the collector is slow or down, spans are dropped, never waited for.

Sampling: `sample_ratio` of the requests are kept, whatever the client sent. A client's
`traceparent` still makes the request span its child (same trace id), but its sampled flag
decides nothing — and neither does its trace id: for a request with a client parent the
decision is a fresh random draw, so a client cannot pick ids that always pass the ratio. An
operator whose clients are trusted sets `telemetry.respect_client_sampling: true`: then the
client's flag decides (`ParentBased(TraceIdRatioBased(sample_ratio))`), as W3C Trace Context
intends between parties that trust each other.

What the upstream receives (`traceparent` on every attempt, either way): the client's trace id
(or a new one), the gateway's span id, and the gateway's own decision as the flag — a sampled
request's attempt span with `01`; a request the gateway does not sample carries `00` and the id
of the gateway's (unrecorded) request span, so an upstream that samples by its parent does not
export either, and the trace id still ties the upstream's logs to the client's.

When tracing is off the request path pays one `is None` test per hook site and nothing else:
this module imports nothing from OpenTelemetry at import time, so `opentelemetry` is never
loaded.

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
import contextlib
import logging
import math
import os
import random
import re
import sys
import threading
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Final
from urllib.parse import urlsplit

import msgspec

from gateway import __version__

if TYPE_CHECKING:
    from gateway.config import Config
    from gateway.exchange import Exchange

__all__ = [
    "AttemptSpan",
    "QueueSpan",
    "RequestSpan",
    "Tracing",
    "TracingUnavailable",
    "describe",
    "finish_reasons",
    "otlp_settings",
    "setup",
]

log = logging.getLogger("gateway")

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


class TracingUnavailable(RuntimeError):
    """Tracing was asked for but the `otel` extra is not installed."""


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
    exporter: Any = None,
    schedule_delay_ms: int | None = None,
) -> Tracing | None:
    """The tracer for a gateway, or `None` when tracing is off (then nothing is imported).

    `exporter` replaces the OTLP exporter (tests, benchmarks). When an endpoint is set but the
    `otel` extra is missing, tracing stays off with one warning: observability never stops the
    gateway from serving.
    """
    settings = otlp_settings(config, env)
    if settings is None:
        return None
    url, service, ratio = settings
    try:
        return Tracing(
            url,
            service,
            ratio,
            exporter=exporter,
            schedule_delay_ms=schedule_delay_ms,
            respect_client_sampling=config.telemetry.respect_client_sampling,
        )
    except TracingUnavailable as exc:
        log.warning("tracing off", extra={"fields": {"reason": str(exc)}})
        return None


# ---------------------------------------------------------------------------------------------
# The hooks.


class Tracing:
    """The gateway's tracer: one `TracerProvider` of its own (never the global one, so several
    gateways in one process, as in tests, each export where they were told)."""

    def __init__(
        self,
        endpoint: str,
        service_name: str = _DEFAULT_SERVICE,
        sample_ratio: float = 1.0,
        *,
        exporter: Any = None,
        schedule_delay_ms: int | None = None,
        respect_client_sampling: bool = False,
    ) -> None:
        try:
            from opentelemetry.context import Context
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor
            from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
            from opentelemetry.trace import SpanKind, Status, StatusCode, set_span_in_context
            from opentelemetry.trace.propagation.tracecontext import (
                TraceContextTextMapPropagator,
            )

            if exporter is None:
                from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
                    OTLPSpanExporter,
                )

                exporter = OTLPSpanExporter(endpoint=endpoint)
        except ImportError as exc:
            raise TracingUnavailable(
                f"an OTLP endpoint is set but OpenTelemetry is not installed ({exc.name}); "
                "install the extra: pip install 'gateway[otel]'"
            ) from None
        self.endpoint = endpoint
        self.service_name = service_name
        self.sample_ratio = sample_ratio
        self.respect_client_sampling = respect_client_sampling
        resource = Resource.create({"service.name": service_name, "service.version": __version__})
        ratio = TraceIdRatioBased(sample_ratio)
        if respect_client_sampling:
            # The client's sampled flag decides for its requests; sample_ratio for the rest.
            sampler = ParentBased(ratio)
        else:
            # SPEC §9: sample_ratio rules — a client's sampled `traceparent` cannot force an
            # export (nor can its choice of trace id: a fresh draw decides those requests).
            chance = _chance_sampler(sample_ratio)
            sampler = ParentBased(
                ratio, remote_parent_sampled=chance, remote_parent_not_sampled=chance
            )
        self.provider = TracerProvider(sampler=sampler, resource=resource)
        batch: dict[str, Any] = {}
        if schedule_delay_ms is not None:
            batch["schedule_delay_millis"] = schedule_delay_ms
        self.provider.add_span_processor(BatchSpanProcessor(exporter, **batch))
        self.tracer = self.provider.get_tracer("gateway", __version__)
        self._extract = TraceContextTextMapPropagator().extract
        self._root = Context()
        self._in_context = set_span_in_context
        self.SERVER, self.CLIENT, self.INTERNAL = (
            SpanKind.SERVER,
            SpanKind.CLIENT,
            SpanKind.INTERNAL,
        )
        self._ok = Status(StatusCode.OK)
        self._error = Status(StatusCode.ERROR)
        self._servers: dict[str, tuple[str, int]] = {}

    # ---- per request -----------------------------------------------------------------------

    def request(self, headers: Mapping[str, str], path: str) -> RequestSpan:
        """Starts the SERVER span of one proxied request (`path`: the route, e.g.
        `/v1/chat/completions`). A valid W3C `traceparent` (and `tracestate`) from the client
        makes it that span's child; anything else in those headers is ignored. `headers` is
        looked up case-insensitively when it is aiohttp's (plain dicts: lower-case keys)."""
        parent = self._extract(headers) if "traceparent" in headers else self._root
        op = OPERATIONS.get(path, "chat")
        span = self.tracer.start_span(
            op,
            context=parent,
            kind=self.SERVER,
            attributes={
                "gen_ai.operation.name": op,
                "http.request.method": "POST",
                "http.route": path if path in OPERATIONS else "other",
            },
        )
        return RequestSpan(self, span, op)

    def server_of(self, url: str) -> tuple[str, int]:
        """`(host, port)` of an instance's base URL (parsed once per URL)."""
        found = self._servers.get(url)
        if found is None:
            parts = urlsplit(url)
            port = parts.port or (443 if parts.scheme.lower() == "https" else 80)
            found = self._servers[url] = (parts.hostname or "", port)
        return found

    # ---- lifecycle -------------------------------------------------------------------------

    def force_flush(self, timeout_ms: int = 30_000) -> bool:
        """Exports every finished span now (blocking: from a coroutine, run it in a thread,
        e.g. `await asyncio.to_thread(tracing.force_flush)`)."""
        return bool(self.provider.force_flush(timeout_ms))

    def shutdown(self) -> None:
        """Flushes and stops the export thread (blocking; see `close()`). Idempotent."""
        self.provider.shutdown()

    async def close(self, timeout_s: float = 5.0) -> None:
        """`shutdown()` off the event loop, waited for at most `timeout_s`: the last export to
        a collector that is down retries up to the exporter's timeout
        (`OTEL_EXPORTER_OTLP_TIMEOUT`, 10 s), which must not hold up the gateway's exit.
        The shutdown goes on in a daemon thread; its spans are lost if the process ends."""
        loop = asyncio.get_running_loop()
        done: asyncio.Future[None] = loop.create_future()

        def finished() -> None:
            if not done.done():
                done.set_result(None)

        def run() -> None:
            try:
                self.shutdown()
            except Exception:
                log.debug("tracer shutdown failed", exc_info=True)
            finally:
                with contextlib.suppress(RuntimeError):  # the loop may be closed by now
                    loop.call_soon_threadsafe(finished)

        threading.Thread(target=run, name="gateway-otel-shutdown", daemon=True).start()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(done), timeout_s)


class RequestSpan:
    """The SERVER span of one request; see the module docstring for where each call goes.

    Every method is safe to call in any state and never raises into the request path.
    """

    __slots__ = (
        "_attempt",
        "_ctx",
        "_ended",
        "_op",
        "_provider",
        "_queue",
        "_request_attrs",
        "_upstream_model",
        "finish_reasons",
        "recording",
        "span",
        "t",
        "trace_id",
    )

    def __init__(self, tracing: Tracing, span: Any, op: str) -> None:
        self.t = tracing
        self.span = span
        self._op = op
        sc = span.get_span_context()
        #: Whether this request is sampled (recorded and exported).
        self.recording: bool = span.is_recording()
        #: The trace id in hex when sampled, for exemplars and log lines; else None.
        self.trace_id: str | None = format(sc.trace_id, "032x") if self.recording else None
        self._ctx: Any = None
        self._queue: QueueSpan | None = None
        self._attempt: AttemptSpan | None = None
        self._upstream_model: str | None = None
        self._provider: str | None = None
        self._request_attrs: dict[str, Any] = {}
        #: The answer's finish reasons, one per choice (set by the forwarder for a sampled
        #: request: `finish_reasons(body)`, or a stream's `SseChecker.finish_reasons`).
        self.finish_reasons: list[str] | None = None
        self._ended = False

    def _parent(self) -> Any:
        ctx = self._ctx
        if ctx is None:
            ctx = self._ctx = self.t._in_context(self.span)
        return ctx

    def routed(self, alias: str, request: Mapping[str, Any] | None = None) -> None:
        """The router accepted `alias` (a configured model alias): the span is renamed
        `{operation} {alias}` and gets `gen_ai.request.model`, and — from the parsed body
        `request` — `gen_ai.request.max_tokens` and `gen_ai.request.temperature` when they are
        numbers (the attempts get them too). Call it only after the router decided: an unknown
        model name never enters a span."""
        if self.recording:
            try:
                self.span.update_name(f"{self._op} {alias}")
                self._request_attrs = _request_attrs(request)
                self.span.set_attributes({"gen_ai.request.model": alias, **self._request_attrs})
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

    def end(self, ex: Exchange) -> None:
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
                self.span.end()
                return
            attrs: dict[str, Any] = {
                "http.response.status_code": status,
                "gateway.attempt": ex.attempts,
                "gateway.queue_ms": round(ex.queue_ms, 3),
                "gateway.upstream_ms": round(ex.upstream_ms, 3),
            }
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
            span = self.span
            # HTTP server spans: a 5xx is the gateway's failure, a 4xx the client's (an
            # `error.type` without ERROR status); a 200 stream that failed mid-way is one too.
            if error is not None:
                attrs["error.type"] = error
            span.set_attributes(attrs)
            if status >= 500 or (error is not None and status < 400):
                span.set_status(self.t._error)
            span.end()
        except Exception:  # never into the request path
            log.debug("request span failed", exc_info=True)


class QueueSpan:
    """The INTERNAL `queue` span of one slot acquisition."""

    __slots__ = ("_req", "ended", "error", "span")

    def __init__(self, req: RequestSpan, pool: str) -> None:
        self._req = req
        self.ended = False
        #: Set by `fail()` for an error the caller handles without raising.
        self.error: str | None = None
        self.span: Any = None
        if req.recording:
            self.span = req.t.tracer.start_span(
                "queue",
                context=req._parent(),
                kind=req.t.INTERNAL,
                attributes={"gateway.pool": pool},
            )

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
        span = self.span
        if span is None:
            return
        try:
            attrs: dict[str, Any] = {}
            if priority is not None:
                attrs["gateway.priority"] = priority
            if waited_s is not None:
                attrs["gateway.queue_ms"] = round(waited_s * 1000, 3)
            if error is not None:
                attrs["error.type"] = error
                span.set_status(self._req.t._error)
            if attrs:
                span.set_attributes(attrs)
            span.end()
        except Exception:
            log.debug("queue span failed", exc_info=True)


class AttemptSpan:
    """The CLIENT `attempt` span of one upstream attempt.

    `header` is the W3C trace context for the upstream request, ready to append to a request
    head: `b"traceparent: 00-<trace>-<span>-<flags>\\r\\n"` (and a `tracestate:` line when the
    client sent one). `headers()` gives the same as a dict.
    """

    __slots__ = ("_req", "ended", "header", "span")

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
        t = req.t
        span: Any
        self.span: Any
        if req.recording:
            host, port = t.server_of(url)
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
            span = self.span = t.tracer.start_span(
                "attempt", context=req._parent(), kind=t.CLIENT, attributes=attrs
            )
        else:
            # Not sampled: no child span; the upstream still learns the trace and that it is
            # not sampled (flags 00), from the request span's own context.
            self.span = None
            span = req.span
        self.header: bytes = _trace_header(span.get_span_context())

    def headers(self) -> dict[str, str]:
        """`header` as a dict (for an HTTP client that takes one)."""
        out: dict[str, str] = {}
        for line in self.header.decode("ascii").split("\r\n"):
            if line:
                name, _, value = line.partition(": ")
                out[name] = value
        return out

    def end(self, result: Any, ex: Exchange) -> None:
        """Ends the span with what `Forwarder.attempt` returned: an `AttemptError` (failed
        before any byte reached the client; it has `.status`, `.timeout`) or the response
        (then `ex.error` tells a stream that failed after it started)."""
        if self.ended:
            return
        self.ended = True
        span = self.span
        if span is None:
            return
        try:
            attrs: dict[str, Any] = {}
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
            if error is None:
                _add_usage(attrs, ex.usage)
                attrs["gen_ai.response.model"] = self._req._upstream_model
                if self._req.finish_reasons:
                    attrs["gen_ai.response.finish_reasons"] = self._req.finish_reasons
            else:
                attrs["error.type"] = error
                span.set_status(self._req.t._error)
            span.set_attributes(attrs)
            span.end()
        except Exception:
            log.debug("attempt span failed", exc_info=True)

    def _finish(self, error: str) -> None:
        """Ends a span its request left open (cancelled, or a bug past the attempt)."""
        self.ended = True
        span = self.span
        if span is None:
            return
        try:
            span.set_attribute("error.type", error)
            span.set_status(self._req.t._error)
            span.end()
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


def _trace_header(sc: Any) -> bytes:
    line = b"traceparent: 00-%032x-%016x-%02x\r\n" % (sc.trace_id, sc.span_id, sc.trace_flags)
    state = sc.trace_state
    if state:
        # TraceState validated every key and value on extraction (printable, no `,` or `=`
        # but the separators, no CR/LF): safe on a header line.
        line += b"tracestate: " + state.to_header().encode("ascii") + b"\r\n"
    return line


def _add_usage(attrs: dict[str, Any], usage: Mapping[str, Any] | None) -> None:
    if not usage:
        return
    n = usage.get("prompt_tokens")
    if isinstance(n, int):
        attrs["gen_ai.usage.input_tokens"] = n
    n = usage.get("completion_tokens")
    if isinstance(n, int):
        attrs["gen_ai.usage.output_tokens"] = n


def _chance_sampler(ratio: float) -> Any:
    """A sampler keeping `ratio` of the spans it is asked about by a random draw, whatever the
    trace id (a client's `traceparent` chooses that one). Built on first use: OpenTelemetry is
    imported only when tracing is on."""
    from opentelemetry.sdk.trace.sampling import Decision, Sampler, SamplingResult
    from opentelemetry.trace import get_current_span

    class Chance(Sampler):
        def should_sample(
            self,
            parent_context: Any,
            trace_id: int,
            name: str,
            kind: Any = None,
            attributes: Any = None,
            links: Any = None,
            trace_state: Any = None,
        ) -> SamplingResult:
            keep = ratio > 0.0 and random.random() < ratio
            state = get_current_span(parent_context).get_span_context().trace_state
            if keep:
                return SamplingResult(Decision.RECORD_AND_SAMPLE, attributes, state)
            return SamplingResult(Decision.DROP, None, state)

        def get_description(self) -> str:
            return f"Chance{{{ratio}}}"

    return Chance()


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
