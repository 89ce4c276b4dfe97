"""Upstream instances: one keep-alive connection pool each, requests built from config alone.

SPEC §7: "The upstream request is built from the config alone: the client's `Authorization`,
hop-by-hop headers and any URL-like field in the body never steer or reach the upstream;
upstream redirects are not followed."
"""

from __future__ import annotations

import asyncio
import email.utils
import time
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import msgspec
import orjson

from gateway import __version__
from gateway.config import InstanceSpec, Timeouts
from gateway.http1 import Client, ConnectError, Response

__all__ = [
    "AttemptError",
    "Upstream",
    "inspect_body",
    "normalize_error",
    "parse_retry_after_ms",
    "upstream_error_of",
]

#: Body fields that could steer a request elsewhere; never forwarded.
URL_FIELDS = ("api_base", "base_url", "api_key", "organization", "extra_headers")


@dataclass(slots=True)
class AttemptError(Exception):
    """An attempt that failed before any byte reached the client (so it may be retried).

    `timeout` marks timeouts (504 when it is the last); `retry_after_ms` comes from the
    upstream's Retry-After; `status` is the upstream status, 0 when none was received.
    """

    reason: str
    status: int = 0
    timeout: bool = False
    retry_after_ms: int = 0

    def __str__(self) -> str:
        return self.reason


def parse_retry_after_ms(headers: Any) -> int:
    """`retry-after-ms`, or `Retry-After` as seconds or an HTTP date; 0 when absent/invalid."""
    raw = headers.get("retry-after-ms")
    if raw:
        try:
            return max(0, int(float(raw)))
        except ValueError:
            pass
    raw = headers.get("Retry-After")
    if not raw:
        return 0
    raw = raw.strip()
    if raw.isdigit():
        return int(raw) * 1000
    try:
        when = email.utils.parsedate_to_datetime(raw)
    except (TypeError, ValueError):
        return 0
    return max(0, int((when.timestamp() - time.time()) * 1000))


class _Usage(msgspec.Struct):
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    total_tokens: int | None = None


class _Outline(msgspec.Struct):
    """The few fields of a response body the gateway reads; the rest is skipped unparsed."""

    usage: _Usage | None = None
    error_code: int | str | None = None
    error_msg: str | None = None
    error: Any = None
    # Present or not is all that matters: kept raw, never turned into Python objects.
    choices: msgspec.Raw | msgspec.UnsetType = msgspec.UNSET
    data: msgspec.Raw | msgspec.UnsetType = msgspec.UNSET


_outline = msgspec.json.Decoder(_Outline)


def inspect_body(body: bytes) -> tuple[str | None, dict[str, Any] | None]:
    """One parse of a complete upstream JSON body: the error it reports inside an HTTP 200,
    if any, and its `usage`.

    SPEC §6: "An upstream answering HTTP 200 with an error body (Qianfan v1 reports rate limits
    as 200 with `{"error_code": 336501}`) is treated as that error, not as success."
    """
    try:
        out = _outline.decode(body)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None, None
    usage = msgspec.structs.asdict(out.usage) if out.usage is not None else None
    if out.error_code:
        return f"error_code {out.error_code}: {out.error_msg or ''}"[:300], usage
    err = out.error
    if err and out.choices is msgspec.UNSET and out.data is msgspec.UNSET:
        msg = err.get("message", "") if isinstance(err, dict) else str(err)
        return f"upstream error: {msg}"[:300], usage
    return None, usage


def upstream_error_of(body: bytes) -> str | None:
    """The error an upstream reported inside an HTTP 200, if any; `None` for a real success."""
    if b'"error' not in body:
        return None
    return inspect_body(body)[0]


# SPEC §6 probes: the default path per provider when `health.probe.path` is left at its
# default, written from the server root like the spec's `/v1/models`.
DEFAULT_PROBE_PATH = "/v1/models"
PROVIDER_PROBE_PATHS = {
    "openai": "/v1/models",
    "vllm": "/v1/models",
    "dashscope": "/compatible-mode/v1/models",
    "qianfan": "/v2/models",
}


def normalize_error(body: bytes, status: int) -> bytes:
    """An upstream's error body in OpenAI's shape `{"error": {message, type, param, code}}`.

    Providers differ: vLLM answers `{"object": "error", "message", "type", "code": 400}` (an
    integer code), Qianfan v1 `{"error_code": 336003, "error_msg": ...}`, DashScope's native
    API `{"code": "InvalidParameter", "message": ...}`. Clients of this gateway see one shape.
    """
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError:
        data = None
    kind = "invalid_request_error" if status < 500 else "server_error"
    message: Any = None
    code: Any = None
    etype: Any = kind
    param: Any = None
    if isinstance(data, dict):
        err = data.get("error")
        if isinstance(err, dict):
            message, etype = err.get("message"), err.get("type") or kind
            param, code = err.get("param"), err.get("code")
        elif "error_code" in data:
            message, code = data.get("error_msg"), data.get("error_code")
        elif "message" in data:
            message, code = data.get("message"), data.get("code")
            etype = data.get("type") or kind
        elif isinstance(err, str):
            message = err
    if not isinstance(message, str) or not message:
        message = f"upstream answered HTTP {status}"
    return orjson.dumps(
        {
            "error": {
                "message": message,
                "type": etype if isinstance(etype, str) else kind,
                "param": param if isinstance(param, str) else None,
                "code": None if code is None else str(code),
            }
        }
    )


class Upstream:
    """One instance: its keep-alive connections, prebuilt request heads and the scrubber for
    its key."""

    def __init__(self, spec: InstanceSpec, timeouts: Timeouts) -> None:
        self.provider = spec.provider
        self.base_url = spec.url.rstrip("/")
        self._base_path = urlsplit(self.base_url).path.rstrip("/")
        self._client = Client(self.base_url, timeouts.connect_ms / 1000)
        self.update(spec, timeouts)

    def update(self, spec: InstanceSpec, timeouts: Timeouts) -> None:
        """Applies a reloaded spec of the same endpoint (model, key, headers, timeouts); the
        keep-alive connections stay."""
        assert spec.url.rstrip("/") == self.base_url, "a new URL is a new instance"
        self.spec = spec
        self.name = spec.name
        self.model = spec.model
        headers = {
            "Content-Type": "application/json",
            # Relay bytes as the upstream sent them, never decompress and re-encode.
            "Accept-Encoding": "identity",
            "User-Agent": f"gateway/{__version__}",
        }
        headers.update(spec.headers)
        if spec.api_key:
            headers["Authorization"] = f"Bearer {spec.api_key}"
        self._header_block = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        self._heads: dict[tuple[str, str], bytes] = {}
        self._secret = spec.api_key.encode() if spec.api_key else b""
        self._client.connect_timeout = timeouts.connect_ms / 1000

    def _head(self, method: str, path: str) -> bytes:
        head = self._heads.get((method, path))
        if head is None:
            head = self._client.head(method, path, self._header_block)
            self._heads[(method, path)] = head
        return head

    def body_for(self, request: dict[str, Any]) -> bytes:
        """The upstream body: the client's JSON with `model` set to this instance's model and
        URL-like fields removed."""
        out = {k: v for k, v in request.items() if k not in URL_FIELDS}
        out["model"] = self.model
        return orjson.dumps(out)

    async def open(self, path: str, body: bytes) -> Response:
        """Sends the request (`path` below the base URL); returns once the response head
        arrived. Raises `AttemptError` on connect errors and resets (the caller bounds the
        time; a cancellation cuts the connection)."""
        try:
            return await self._client.request(self._head("POST", self._base_path + path), body)
        except TimeoutError:
            raise AttemptError("connecting to the upstream timed out", timeout=True) from None
        except ConnectError as exc:
            raise AttemptError(f"cannot connect to upstream ({exc.strerror})") from None
        except OSError as exc:
            raise AttemptError(f"upstream connection failed ({exc})") from None

    def scrub(self, data: bytes) -> bytes:
        """Removes this instance's key from bytes about to leave the gateway."""
        if self._secret and self._secret in data:
            return data.replace(self._secret, b"[redacted]")
        return data

    async def probe(self, path: str, timeout_s: float) -> bool:
        """A zero-token health probe: `GET path` (from the server root) answered 2xx within the
        timeout."""
        if path == DEFAULT_PROBE_PATH:
            path = PROVIDER_PROBE_PATHS.get(self.provider, path)
        try:
            async with asyncio.timeout(timeout_s):
                resp = await self._client.request(self._head("GET", path), b"")
                try:
                    await resp.read()
                finally:
                    resp.release()
                return 200 <= resp.status < 300
        except (TimeoutError, OSError):
            return False

    @property
    def closed(self) -> bool:
        return self._client.closed

    async def close(self) -> None:
        await self._client.close()
