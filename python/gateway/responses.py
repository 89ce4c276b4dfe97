"""Every error the gateway answers, built in one place so each has OpenAI's shape.

SPEC §7: `{"error": {"message", "type", "param", "code"}}` — `ErrorResponse` in OpenAI's
published OpenAPI description.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import orjson
from aiohttp import web

__all__ = ["HttpError", "error_body", "error_response", "sse_error_event"]

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
}


def _type_of(status: int) -> str:
    return _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")


class HttpError(Exception):
    """Raised anywhere on the request path; the ingress turns it into an error response."""

    def __init__(
        self,
        status: int,
        code: str,
        message: str,
        *,
        param: str | None = None,
        retry_after_ms: int | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.param = param
        self.retry_after_ms = retry_after_ms


def error_body(status: int, code: str, message: str, param: str | None = None) -> bytes:
    return orjson.dumps(
        {"error": {"message": message, "type": _type_of(status), "param": param, "code": code}}
    )


def retry_after_seconds(ms: int) -> str:
    """`Retry-After` in whole seconds, at least 1 (0 would invite a hot retry loop)."""
    return str(max(1, math.ceil(ms / 1000)))


def error_response(err: HttpError, headers: Mapping[str, str] | None = None) -> web.Response:
    out = dict(headers or {})
    if err.retry_after_ms is not None:
        out["Retry-After"] = retry_after_seconds(err.retry_after_ms)
    return web.Response(
        status=err.status,
        body=error_body(err.status, err.code, err.message, err.param),
        content_type="application/json",
        headers=out,
    )


def sse_error_event(code: str, message: str) -> bytes:
    """SPEC §6: a stream that fails after it started ends with `data: {"error": {...}}`."""
    return b"data: " + error_body(502, code, message) + b"\n\n"
