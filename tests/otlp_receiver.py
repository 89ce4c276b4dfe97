"""A test OTLP/HTTP trace receiver: what a collector would see of the gateway's spans.

    with OtlpReceiver() as otlp:          # listening on 127.0.0.1, a free port
        config["telemetry"] = {"otlp_endpoint": otlp.url}
        ...
        await asyncio.to_thread(tracing.force_flush)
        spans = otlp.spans                # list[ReceivedSpan]

It serves `POST /v1/traces` with `ExportTraceServiceRequest` bodies (plain or gzip) in either
OTLP/HTTP encoding: JSON (`Content-Type: application/json`, what the gateway sends; decoded by
the OTLP JSON mapping: hex ids, 64-bit integers as strings or numbers) or protobuf (what the
official `OTLPSpanExporter` sends), and answers an empty `ExportTraceServiceResponse` in the
same encoding. It runs its own event loop in a thread: the gateway exports from its own thread
with a blocking HTTP client, so a `force_flush()` called on the test's loop (or a gateway
shutting down its tracer) can never deadlock against the receiver. `content_types` records the
encoding of every export.
"""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import json
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue

__all__ = ["OtlpReceiver", "ReceivedSpan"]

KINDS = {0: "UNSPECIFIED", 1: "INTERNAL", 2: "SERVER", 3: "CLIENT", 4: "PRODUCER", 5: "CONSUMER"}
STATUS = {0: "UNSET", 1: "OK", 2: "ERROR"}


@dataclass
class ReceivedSpan:
    name: str
    trace_id: str  # 32 hex digits
    span_id: str  # 16 hex digits
    parent_span_id: str  # "" for a root span
    kind: str  # "SERVER", "CLIENT", "INTERNAL", ...
    attributes: dict[str, Any]
    status: str  # "UNSET", "OK", "ERROR"
    status_message: str
    start_ns: int
    end_ns: int
    resource: dict[str, Any] = field(default_factory=dict)
    scope: str = ""
    events: list[tuple[str, dict[str, Any]]] = field(default_factory=list)


def _value(v: AnyValue) -> Any:
    kind = v.WhichOneof("value")
    if kind is None:
        return None
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    if kind == "kvlist_value":
        return {kv.key: _value(kv.value) for kv in v.kvlist_value.values}
    return getattr(v, kind)


def _attrs(kvs: Any) -> dict[str, Any]:
    return {kv.key: _value(kv.value) for kv in kvs}


def decode(body: bytes) -> list[ReceivedSpan]:
    """The spans of one `ExportTraceServiceRequest`."""
    req = ExportTraceServiceRequest()
    req.ParseFromString(body)
    out: list[ReceivedSpan] = []
    for rs in req.resource_spans:
        resource = _attrs(rs.resource.attributes)
        for ss in rs.scope_spans:
            for s in ss.spans:
                out.append(
                    ReceivedSpan(
                        name=s.name,
                        trace_id=s.trace_id.hex(),
                        span_id=s.span_id.hex(),
                        parent_span_id=s.parent_span_id.hex(),
                        kind=KINDS.get(s.kind, str(s.kind)),
                        attributes=_attrs(s.attributes),
                        status=STATUS.get(s.status.code, str(s.status.code)),
                        status_message=s.status.message,
                        start_ns=s.start_time_unix_nano,
                        end_ns=s.end_time_unix_nano,
                        resource=resource,
                        scope=ss.scope.name,
                        events=[(e.name, _attrs(e.attributes)) for e in s.events],
                    )
                )
    return out


def _json_value(v: dict[str, Any]) -> Any:
    if not v:
        return None
    ((kind, x),) = v.items()
    if kind == "arrayValue":
        return [_json_value(e) for e in x.get("values", [])]
    if kind == "kvlistValue":
        return {kv["key"]: _json_value(kv["value"]) for kv in x.get("values", [])}
    if kind == "intValue":
        return int(x)
    if kind == "doubleValue":
        return float(x)
    if kind in ("stringValue", "boolValue"):
        return x
    raise ValueError(f"unknown AnyValue {kind}")


def _json_attrs(kvs: list[dict[str, Any]]) -> dict[str, Any]:
    return {kv["key"]: _json_value(kv.get("value", {})) for kv in kvs}


def decode_json(body: bytes) -> list[ReceivedSpan]:
    """The spans of one `ExportTraceServiceRequest` in the OTLP/JSON encoding. Strict where
    a collector is: ids must be hex of the right length, kinds and status codes numbers."""
    doc = json.loads(body)
    out: list[ReceivedSpan] = []
    for rs in doc.get("resourceSpans", []):
        resource = _json_attrs(rs.get("resource", {}).get("attributes", []))
        for ss in rs.get("scopeSpans", []):
            scope = ss.get("scope", {}).get("name", "")
            for s in ss.get("spans", []):
                trace, span, parent = s["traceId"], s["spanId"], s.get("parentSpanId", "")
                assert len(trace) == 32 and len(span) == 16 and len(parent) in (0, 16)
                bytes.fromhex(trace + span + parent)  # hex, as OTLP/JSON requires
                kind, code = s.get("kind", 0), s.get("status", {}).get("code", 0)
                assert isinstance(kind, int) and isinstance(code, int)
                out.append(
                    ReceivedSpan(
                        name=s["name"],
                        trace_id=trace,
                        span_id=span,
                        parent_span_id=parent,
                        kind=KINDS.get(kind, str(kind)),
                        attributes=_json_attrs(s.get("attributes", [])),
                        status=STATUS.get(code, str(code)),
                        status_message=s.get("status", {}).get("message", ""),
                        start_ns=int(s["startTimeUnixNano"]),
                        end_ns=int(s["endTimeUnixNano"]),
                        resource=resource,
                        scope=scope,
                        events=[
                            (e["name"], _json_attrs(e.get("attributes", [])))
                            for e in s.get("events", [])
                        ],
                    )
                )
    return out


class OtlpReceiver:
    """See the module docstring. `status` makes it answer errors (an unhealthy collector)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._spans: list[ReceivedSpan] = []
        self.requests = 0
        self.raw: list[bytes] = []  # every decoded-from body, for "never in the bytes" checks
        self.status = 200
        self.fail_next = 0  # answer this many exports 503 (then `status` again)
        self.content_types: list[str] = []
        self.headers: list[dict[str, str]] = []  # of every export
        self.port = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._runner: web.AppRunner | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None

    # ---- lifecycle -------------------------------------------------------------------------

    @property
    def url(self) -> str:
        """The collector's base URL (what `telemetry.otlp_endpoint` takes)."""
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> OtlpReceiver:
        self._thread = threading.Thread(target=self._run, name="otlp-receiver", daemon=True)
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("the OTLP receiver did not start")
        if self._error is not None:
            raise RuntimeError("the OTLP receiver failed to start") from self._error
        return self

    def stop(self) -> None:
        loop, thread = self._loop, self._thread
        if loop is None or thread is None:
            return
        with contextlib.suppress(RuntimeError):  # the loop may be gone already
            asyncio.run_coroutine_threadsafe(self._cleanup(), loop).result(10)
            loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        self._loop = self._thread = None

    def __enter__(self) -> OtlpReceiver:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _run(self) -> None:
        loop = self._loop = asyncio.new_event_loop()
        try:
            loop.run_until_complete(self._serve())
        except BaseException as exc:  # reported to start()
            self._error = exc
            self._ready.set()
            return
        self._ready.set()
        try:
            loop.run_forever()
        finally:
            loop.close()

    async def _serve(self) -> None:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_post("/v1/traces", self._traces)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = int(self._runner.addresses[0][1])

    async def _cleanup(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def _traces(self, request: web.Request) -> web.Response:
        body = await request.read()
        if request.headers.get("Content-Encoding", "").lower() == "gzip":
            body = gzip.decompress(body)
        is_json = request.content_type == "application/json"
        with self._lock:
            self.requests += 1
            self.content_types.append(request.content_type)
            self.headers.append({k.lower(): v for k, v in request.headers.items()})
            if self.fail_next > 0:
                self.fail_next -= 1
                return web.Response(status=503)
            if self.status != 200:
                return web.Response(status=self.status)
        try:
            spans = decode_json(body) if is_json else decode(body)
        except Exception:  # a malformed export is a 400, as a collector answers
            return web.Response(status=400)
        with self._lock:
            self.raw.append(body)
            self._spans.extend(spans)
        if is_json:
            return web.Response(body=b"{}", content_type="application/json")
        return web.Response(
            body=ExportTraceServiceResponse().SerializeToString(),
            content_type="application/x-protobuf",
        )

    # ---- what was received -----------------------------------------------------------------

    @property
    def spans(self) -> list[ReceivedSpan]:
        with self._lock:
            return list(self._spans)

    def clear(self) -> None:
        with self._lock:
            self._spans.clear()
            self.raw.clear()

    async def wait_for(self, count: int, within: float = 10.0) -> list[ReceivedSpan]:
        """The spans once at least `count` arrived (raises `TimeoutError` after `within` s)."""
        deadline = time.monotonic() + within
        while True:
            spans = self.spans
            if len(spans) >= count:
                return spans
            if time.monotonic() > deadline:
                raise TimeoutError(f"{len(spans)} span(s) received, waited for {count}")
            await asyncio.sleep(0.02)
