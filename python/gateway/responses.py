"""Every error the gateway answers, built in one place so each has OpenAI's shape.

SPEC §7: `{"error": {"message", "type", "param", "code"}}` — `ErrorResponse` in OpenAI's
published OpenAPI description. `ANSWERS` is the one table from a domain error (errors.py) to
its HTTP status, `code` and `type`; `Retry-After` and extra headers come from the error.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import orjson
from aiohttp import web

from gateway import errors as e

__all__ = ["ANSWERS", "NOSNIFF", "answer_of", "error_body", "error_response", "sse_error_event"]

#: Every response: a browser never sniffs a type (the dashboard shares the origin).
NOSNIFF = "nosniff"

#: SPEC §7's error table: domain error → (status, code, type).
ANSWERS: dict[type[e.GatewayError], tuple[int, str, str]] = {
    e.InvalidRequest: (400, "invalid_request", "invalid_request_error"),
    e.InvalidConfig: (400, "invalid_config", "invalid_request_error"),
    e.Unauthorized: (401, "invalid_api_key", "authentication_error"),
    e.ModelNotFound: (404, "model_not_found", "invalid_request_error"),
    e.NotFound: (404, "not_found", "invalid_request_error"),
    e.MethodNotAllowed: (405, "method_not_allowed", "invalid_request_error"),
    e.RequestTimeout: (408, "request_timeout", "invalid_request_error"),
    e.RequestTooLarge: (413, "request_too_large", "invalid_request_error"),
    e.RateLimited: (429, "rate_limited", "rate_limit_error"),
    # SPEC §7: an upstream's quota is answered like the gateway's own per-key limit.
    e.UpstreamRateLimited: (429, "rate_limited", "rate_limit_error"),
    e.InternalError: (500, "internal_error", "server_error"),
    e.UpstreamFailed: (502, "upstream_error", "server_error"),
    e.QueueFull: (503, "queue_full", "server_error"),
    e.QueueTimeout: (503, "queue_timeout", "server_error"),
    e.NoHealthyInstance: (503, "no_healthy_instance", "server_error"),
    # SPEC §7: upstreams that asked for a pause (503 Retry-After) are not up, as ejected ones.
    e.UpstreamUnavailable: (503, "no_healthy_instance", "server_error"),
    e.Overloaded: (503, "overloaded", "server_error"),
    # SPEC §17: answered at once instead of timing out in a queue.
    e.SloUnattainable: (503, "slo_unattainable", "server_error"),
    e.Draining: (503, "draining", "server_error"),
    e.Restarting: (503, "restarting", "server_error"),
    e.UpstreamTimedOut: (504, "upstream_timeout", "server_error"),
}

_INTERNAL = ANSWERS[e.InternalError]


def answer_of(err: e.GatewayError) -> tuple[int, str, str]:
    """(status, code, type) of an error: its class's row, or the nearest ancestor's."""
    for cls in type(err).__mro__:
        row = ANSWERS.get(cls)
        if row is not None:
            return row
    return _INTERNAL


def error_body(status: int, code: str, message: str, param: str | None = None) -> bytes:
    kind = "server_error" if status >= 500 else "invalid_request_error"
    for row in ANSWERS.values():
        if row[0] == status and row[1] == code:
            kind = row[2]
            break
    return orjson.dumps({"error": {"message": message, "type": kind, "param": param, "code": code}})


def retry_after_seconds(ms: int) -> str:
    """`Retry-After` in whole seconds, at least 1 (0 would invite a hot retry loop)."""
    return str(max(1, math.ceil(ms / 1000)))


def error_response(err: e.GatewayError, headers: Mapping[str, str] | None = None) -> web.Response:
    """The client's answer to `err`, with `headers` (the exchange's) and the error's own."""
    status, code, kind = answer_of(err)
    out = dict(headers or {})
    out["X-Content-Type-Options"] = NOSNIFF
    param: str | None = None
    message = str(err)
    if isinstance(err, e.RequestError):
        out.update(err.headers)
        param = err.param
        message = err.message
    elif status == 500:
        message = "Internal gateway error."
    wait = e.retry_after_ms(err) if status in (429, 503) else None
    if wait is not None:
        out["Retry-After"] = retry_after_seconds(wait)
    body = orjson.dumps({"error": {"message": message, "type": kind, "param": param, "code": code}})
    return web.Response(status=status, body=body, content_type="application/json", headers=out)


def sse_error_event(code: str, message: str) -> bytes:
    """SPEC §6: a stream that fails after it started ends with `data: {"error": {...}}`."""
    return b"data: " + error_body(502, code, message) + b"\n\n"
