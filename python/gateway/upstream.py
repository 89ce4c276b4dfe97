"""Upstream instances: one keep-alive connection pool each, requests built from config alone.

SPEC §7: "The upstream request is built from the config alone: the client's `Authorization`,
hop-by-hop headers and any URL-like field in the body never steer or reach the upstream;
upstream redirects are not followed."
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from urllib.parse import urlsplit

from gateway import __version__
from gateway.config import InstanceSpec, Timeouts
from gateway.http1 import (
    DEFAULT_MAX_CHUNK,
    DEFAULT_MAX_IDLE,
    MAX_IDLE_CEILING,
    Client,
    ConnectError,
    Response,
)

__all__ = ["AttemptError", "Upstream"]


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


# SPEC §6 probes: the default path per provider when `health.probe.path` is left at its
# default, written from the server root like the spec's `/v1/models`.
DEFAULT_PROBE_PATH = "/v1/models"
#: A probe reads at most this much of its answer (SPEC §16: nothing grows without limit).
PROBE_MAX_BYTES = 1 << 20
PROVIDER_PROBE_PATHS = {
    "openai": "/v1/models",
    "vllm": "/v1/models",
    "dashscope": "/compatible-mode/v1/models",
    "qianfan": "/v2/models",
}


class Upstream:
    """One instance: its keep-alive connections, prebuilt request heads and the scrubber for
    its key."""

    def __init__(self, spec: InstanceSpec, timeouts: Timeouts) -> None:
        self.provider = spec.provider
        self.base_url = spec.url.rstrip("/")
        self._base_path = urlsplit(self.base_url).path.rstrip("/")
        self._client = self._new_client(spec, timeouts)
        self.spec = spec
        self.update(spec, timeouts)

    def _new_client(self, spec: InstanceSpec, timeouts: Timeouts) -> Client:
        """SPEC §6: the instance's TLS verification and egress proxy (the environment's
        `HTTPS_PROXY` / `HTTP_PROXY` / `NO_PROXY` are read now, when no `proxy:` is set)."""
        tls = spec.tls
        return Client(
            self.base_url,
            timeouts.connect_ms / 1000,
            ca_file=tls.ca_file if tls is not None else None,
            server_name=tls.server_name if tls is not None else None,
            proxy=spec.proxy,
        )

    @property
    def client(self) -> Client:
        """The keep-alive connections in use (a new `Client` after an `update` that changed
        the TLS or proxy settings)."""
        return self._client

    def update(self, spec: InstanceSpec, timeouts: Timeouts) -> None:
        """Applies a reloaded spec of the same endpoint (model, key, headers, timeouts); the
        keep-alive connections stay, unless the TLS or proxy settings changed: then a new
        client connects anew and the old one's idle connections close (its in-flight ones
        close when their responses are done)."""
        assert spec.url.rstrip("/") == self.base_url, "a new URL is a new instance"
        if spec.tls != self.spec.tls or spec.proxy != self.spec.proxy:
            old, self._client = self._client, self._new_client(spec, timeouts)
            old.close_idle()
        # SPEC §16 bounded: no more idle connections than the instance may have in flight
        # (one request each), at least the client's default, at most the ceiling.
        self._client.max_idle = max(DEFAULT_MAX_IDLE, min(spec.max_concurrency, MAX_IDLE_CEILING))
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

    async def open(
        self,
        path: str,
        body: bytes,
        extra_headers: bytes = b"",
        *,
        request_id: str | None = None,
        max_chunk: int = DEFAULT_MAX_CHUNK,
    ) -> Response:
        """Sends the request (`path` below the base URL); returns once the response head
        arrived. Raises `AttemptError` on connect errors and resets (the caller bounds the
        time; a cancellation cuts the connection).

        `request_id` goes upstream as `X-Request-Id` (vLLM with request-id headers echoes
        it, as the mock does); SPEC §16: "where the backend echoes the request id [...] the
        gateway checks it and treats a mismatch as a framing error". `max_chunk`: SPEC §16,
        "a chunk larger than the response bound is a framing error"."""
        # `extra_headers`: whole `Name: value\r\n` lines (the W3C trace context) after the
        # prebuilt head, which ends before Content-Length.
        head = self._head("POST", self._base_path + path)
        if request_id is not None:
            head += b"X-Request-Id: %b\r\n" % request_id.encode("latin-1")
        if extra_headers:
            head += extra_headers
        try:
            return await self._client.request(
                head, body, request_id=request_id, max_chunk=max_chunk
            )
        except TimeoutError:
            raise AttemptError("connecting to the upstream timed out", timeout=True) from None
        except ConnectError as exc:
            why = exc.strerror or type(exc).__name__
            raise AttemptError(f"cannot connect to upstream ({why})") from None
        except OSError as exc:
            raise AttemptError(f"upstream connection failed ({exc})") from None

    @property
    def secret_bytes(self) -> bytes:
        """The key `scrub` removes, as bytes (empty: none): for a check without a call."""
        return self._secret

    def scrub(self, data: bytes) -> bytes:
        """Removes this instance's key from bytes about to leave the gateway."""
        if self._secret and self._secret in data:
            return data.replace(self._secret, b"[redacted]")
        return data

    async def probe(self, path: str, timeout_s: float) -> bool:
        """A zero-token health probe: `GET path` (from the server root) answered 2xx within the
        timeout, its body read up to `PROBE_MAX_BYTES`.

        Never raises (but for its own cancellation): whatever goes wrong, a probe that cannot
        tell the instance is healthy is a failed one. Its connection returns to the pool only
        when its answer ended cleanly (the client's rule), so a probe can never leave bytes
        behind for a real request."""
        if path == DEFAULT_PROBE_PATH:
            path = PROVIDER_PROBE_PATHS.get(self.provider, path)
        try:
            async with asyncio.timeout(timeout_s):
                resp = await self._client.request(self._head("GET", path), b"")
                try:
                    await resp.read(PROBE_MAX_BYTES)
                finally:
                    resp.release()  # cuts the connection unless the body ended cleanly
                return 200 <= resp.status < 300
        except Exception:  # any failure is a failed probe; nothing is logged
            return False

    async def fetch(self, path: str, max_bytes: int, timeout_s: float) -> bytes | None:
        """`GET path` (from the server root) off the request path, e.g. vLLM's `/metrics`
        (gateway.backend_load): the body of a 2xx answer of at most `max_bytes`, else `None`.
        Never raises (but for its own cancellation); the connection is reused only when the
        answer ended cleanly, as for a probe."""
        try:
            async with asyncio.timeout(timeout_s):
                resp = await self._client.request(self._head("GET", path), b"")
                try:
                    body = await resp.read(max_bytes)
                finally:
                    resp.release()
                return body if 200 <= resp.status < 300 else None
        except Exception:  # unreachable, too large, cut: no reading this time
            return None

    @property
    def closed(self) -> bool:
        return self._client.closed

    async def close(self) -> None:
        await self._client.close()
