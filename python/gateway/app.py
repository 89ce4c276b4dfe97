"""The ingress: an aiohttp low-level server speaking the OpenAI API.

Request flow (SPEC §2): ingress (parse, authenticate, size-limit, validate) → classify →
route → admit/queue (the core) → balance (the core) → forward over the instance's keep-alive
pool → observe (the outcome feeds health; the slot goes to the next waiter).

The low-level `web.Server` is used instead of `web.Application`: one dict lookup routes a
request, and there is no middleware chain on the hot path.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import orjson
from aiohttp import web
from aiohttp.web_protocol import RequestHandler

from gateway import __version__
from gateway._core import Outcome, Priority
from gateway.auth import KeyRing
from gateway.config import Config, load_config
from gateway.dashboard import render as render_dashboard
from gateway.deadline import Watchdog
from gateway.errors import ConfigError, NoHealthyInstance, QueueFull, retry_after_ms
from gateway.http1 import Response
from gateway.limits import RateLimited, estimate_tokens
from gateway.messages import ENDPOINTS, Endpoint, parse_request
from gateway.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from gateway.metrics import Metrics
from gateway.responses import HttpError, error_response, sse_error_event
from gateway.router import Decision
from gateway.runtime import PoolRuntime, Runtime
from gateway.scheduler import Draining, QueueTimeout
from gateway.sse import MalformedEvent, SseChecker
from gateway.upstream import (
    AttemptError,
    Upstream,
    inspect_body,
    normalize_error,
    parse_retry_after_ms,
    upstream_error_of,
)

__all__ = ["Gateway"]

T = TypeVar("T")

log = logging.getLogger("gateway")
access_log = logging.getLogger("gateway.access")

Handler = Callable[[web.BaseRequest], Awaitable[web.StreamResponse]]

_SAFE_ID = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_.:")
_JSON = "application/json"


@dataclass(slots=True)
class Exchange:
    """What is known about one request so far; becomes its response headers and log line."""

    request_id: str
    started: float
    watchdog: Watchdog
    decision: Decision | None = None
    pool: str | None = None
    instance: str | None = None
    queue_ms: float = 0.0
    upstream_ms: float = 0.0
    attempts: int = 0
    waited_as: Priority | None = None
    status: int = 0
    error: str | None = None
    usage: dict[str, Any] | None = None
    # The current attempt's time to first byte (head, or first stream chunk), seconds.
    ttfb: float | None = None
    limit_headers: dict[str, str] | None = None
    spilled_from: str | None = None
    # Why the current attempt failed after the response started (for /admin/state).
    attempt_error: str | None = None

    def headers(self) -> dict[str, str]:
        h = {"X-Request-Id": self.request_id}
        d = self.decision
        if d is not None:
            h["X-Gateway-Pool"] = self.pool or d.pool
            h["X-Gateway-Priority"] = (self.waited_as or d.priority).label
            h["X-Gateway-Complexity"] = d.complexity_header
        if self.instance is not None:
            h["X-Gateway-Instance"] = self.instance
            h["X-Gateway-Queue-Ms"] = f"{self.queue_ms:.1f}"
        if self.spilled_from is not None:
            h["X-Gateway-Spilled-From"] = self.spilled_from
        if self.limit_headers:
            h.update(self.limit_headers)
        return h


class _Protocol(RequestHandler):
    """aiohttp's request handler plus a deadline on the first request's head (slowloris).

    aiohttp's keep-alive timer already closes idle connections and connections whose later
    requests stall in their headers; this adds the same bound, shorter, before the first.
    """

    header_timeout: float = 10.0
    started: bool = False
    _head_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self._head_timer = asyncio.get_running_loop().call_later(
            self.header_timeout, self._head_deadline
        )

    def _head_deadline(self) -> None:
        self._head_timer = None
        if not self.started:
            self.force_close()

    def connection_lost(self, exc: BaseException | None) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None
        super().connection_lost(exc)


class _Server(web.Server):
    def __init__(self, handler: Handler, header_timeout: float, **kwargs: Any) -> None:
        super().__init__(handler, **kwargs)
        self._header_timeout = header_timeout

    def __call__(self) -> RequestHandler:
        proto = _Protocol(self, loop=self._loop, **self._kwargs)
        proto.header_timeout = self._header_timeout
        return proto


class Gateway:
    """The HTTP surface of SPEC §7 over one `Runtime`."""

    def __init__(self, config: Config, *, config_path: str | None = None) -> None:
        self.runtime = Runtime(config)
        self.config_path = config_path
        self.draining = False
        # Set when the drain deadline passed: in-flight work is cancelled and answered 503
        # (or, for a started stream, an error event) instead of being cut silently.
        self._hard_stopped = False
        self._active: set[asyncio.Task[Any]] = set()
        # Set by the last request to finish once draining started.
        self._idle: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._boot = os.urandom(4).hex()
        self._routes: dict[tuple[str, str], Handler] = {
            ("GET", "/livez"): self.livez,
            ("GET", "/healthz"): self.livez,
            ("GET", "/readyz"): self.readyz,
            ("GET", "/v1/models"): self.models,
            ("GET", "/admin/state"): self.admin_state,
            ("GET", "/dashboard"): self.dashboard,
            ("POST", "/admin/reload"): self.admin_reload,
        }
        for path, endpoint in ENDPOINTS.items():
            self._routes[("POST", path)] = self._proxy_handler(endpoint)
        self.keys = KeyRing(config)
        self.metrics = Metrics(lambda: self.runtime)
        self._routes[("GET", "/metrics")] = self.metrics_endpoint

    # ---- server plumbing -----------------------------------------------------------------

    def server(self) -> web.Server:
        limits = self.runtime.config.limits
        return _Server(
            self.handle,
            header_timeout=limits.header_timeout_ms / 1000,
            handler_cancellation=True,
            keepalive_timeout=limits.keepalive_timeout_ms / 1000,
            access_log=None,
            max_line_size=16384,
            max_field_size=16384,
        )

    async def handle(self, request: web.BaseRequest) -> web.StreamResponse:
        proto = request.protocol
        if isinstance(proto, _Protocol):
            proto.started = True
        handler = self._routes.get((request.method, request.path))
        if handler is None:
            status = 405 if any(p == request.path for _, p in self._routes) else 404
            code = "method_not_allowed" if status == 405 else "not_found"
            return error_response(
                HttpError(status, code, f"No route {request.method} {request.path}")
            )
        try:
            return await handler(request)
        except HttpError as err:
            return error_response(err)
        except (asyncio.CancelledError, ConnectionResetError):
            raise
        except Exception:
            # Never a traceback to the client; the log has it.
            log.exception("unhandled error on %s %s", request.method, request.path)
            return error_response(HttpError(500, "internal_error", "Internal gateway error."))

    async def close(self) -> None:
        await self.runtime.close()

    async def drain(self, site: web.BaseSite) -> None:
        """SPEC §7 "SIGTERM drains": `/readyz` turns 503, new connections stop, in-flight and
        queued requests finish within the drain deadline, then the rest get 503 or a stream
        error event."""
        self.draining = True
        await site.stop()
        self._idle = asyncio.Event()
        if not self._active:
            return
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self.runtime.config.shutdown.drain_timeout_ms / 1000):
                await self._idle.wait()
        if not self._active:
            return
        self._hard_stopped = True
        log.warning("drain deadline passed", extra={"fields": {"unfinished": len(self._active)}})
        for pool in self.runtime.pools.values():
            pool.scheduler.fail_all_waiting(Draining)
        for task in list(self._active):
            task.cancel()
        # The cancelled handlers answer 503 or end their stream with an error event.
        self._idle.clear()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(2.0):
                await self._idle.wait()

    # ---- small endpoints -----------------------------------------------------------------

    async def livez(self, request: web.BaseRequest) -> web.StreamResponse:
        return web.Response(body=b'{"status":"ok"}', content_type=_JSON)

    def ready(self) -> tuple[bool, str]:
        """SPEC §7: ready once config is loaded, at least one instance per pool is not
        ejected, and not draining."""
        if self.draining:
            return False, "draining"
        now = _now_ms()
        for name, pool in self.runtime.pools.items():
            core = pool.scheduler.core
            if not any(
                (info := core.instance(i, now)).state.label != "ejected" and not info.removed
                for i in range(core.instance_count)
            ):
                return False, f"every instance of pool {name} is ejected"
        return True, "ready"

    async def readyz(self, request: web.BaseRequest) -> web.StreamResponse:
        ok, reason = self.ready()
        body = orjson.dumps({"status": "ready" if ok else "not_ready", "reason": reason})
        return web.Response(status=200 if ok else 503, body=body, content_type=_JSON)

    async def models(self, request: web.BaseRequest) -> web.StreamResponse:
        tenant = self.keys.authenticate(request.headers)
        data = [
            {"id": alias, "object": "model", "created": 0, "owned_by": "gateway"}
            for alias in self.runtime.router.aliases()
            if tenant.models is None or alias in tenant.models
        ]
        return web.Response(body=orjson.dumps({"object": "list", "data": data}), content_type=_JSON)

    def state(self) -> dict[str, Any]:
        """The /admin/state document (SPEC §7 shape, plus counters)."""
        now = _now_ms()
        unix_offset = time.time() - now / 1000
        pools: dict[str, Any] = {}
        for name, pool in self.runtime.pools.items():
            core = pool.scheduler.core
            stats = core.stats()
            instances = []
            for i, up in enumerate(pool.upstreams):
                info = core.instance(i, now)
                if info.removed and info.in_flight == 0:
                    continue  # removed by a reload and drained: gone
                until = info.ejected_until_ms
                instances.append(
                    {
                        "name": up.name,
                        "state": info.state.label,
                        "in_flight": info.in_flight,
                        "max_concurrency": info.max_concurrency,
                        "consecutive_failures": info.consecutive_failures,
                        "ejected_until": None
                        if until is None
                        else round(until / 1000 + unix_offset, 3),
                        "next_try_at": round(info.next_try_ms / 1000 + unix_offset, 3),
                        "ejections": info.ejections,
                        "removed": info.removed,
                        "last_error": last[1] if (last := pool.last_errors.get(i)) else None,
                        "last_error_at": round(last[0], 3) if last else None,
                    }
                )
            sched = self.runtime.config.scheduler
            pools[name] = {
                "queued": {"high": core.queued(Priority.HIGH), "low": core.queued(Priority.LOW)},
                "queue_capacity": {"high": sched.high.capacity, "low": sched.low.capacity},
                "in_flight": core.in_flight,
                "granted": {"high": stats.granted_high, "low": stats.granted_low},
                "forced_low_grants": stats.forced_low,
                "expired": stats.expired,
                "cancelled": stats.cancelled,
                "rejected_full": stats.rejected_full,
                "drain_rate_per_s": round(core.drain_rate(now), 3),
                "fallback": pool.spec.fallback,
                "instances": instances,
            }
        return {
            "pools": pools,
            "draining": self.draining,
            "version": __version__,
            "now": round(time.time(), 3),
        }

    async def admin_state(self, request: web.BaseRequest) -> web.StreamResponse:
        self.keys.authenticate_admin(request.headers)
        return web.Response(body=orjson.dumps(self.state()), content_type=_JSON)

    async def reload(self) -> tuple[bool, str, list[str]]:
        """Re-reads the config file; applies it only if it is entirely valid (SPEC §8).
        Returns (applied, message, notes); on failure the running config stays."""
        if self.config_path is None:
            return False, "the gateway was not started from a config file", []
        try:
            config = await asyncio.to_thread(load_config, self.config_path)
        except ConfigError as exc:
            self.metrics.reloaded(False)
            log.error("config reload failed", extra={"fields": {"reason": str(exc)}})
            return False, str(exc), []
        notes = self.runtime.reload(config)
        self.keys = KeyRing(config)
        self.metrics.reloaded(True)
        await self.runtime.collect()
        log.info(
            "config reloaded",
            extra={"fields": {"pools": ",".join(config.pools), "notes": "; ".join(notes) or None}},
        )
        return True, "reloaded", notes

    async def admin_reload(self, request: web.BaseRequest) -> web.StreamResponse:
        self.keys.authenticate_admin(request.headers)
        ok, message, notes = await self.reload()
        if not ok:
            raise HttpError(400, "invalid_config", f"Config not reloaded: {message}")
        body = orjson.dumps({"status": "reloaded", "notes": notes})
        return web.Response(body=body, content_type=_JSON)

    async def metrics_endpoint(self, request: web.BaseRequest) -> web.StreamResponse:
        resp = web.Response(body=self.metrics.render())
        resp.headers["Content-Type"] = METRICS_CONTENT_TYPE
        return resp

    async def dashboard(self, request: web.BaseRequest) -> web.StreamResponse:
        # The page itself holds no data; it asks /admin/state (with the admin key, when
        # auth is on) from the browser.
        return web.Response(
            body=render_dashboard(),
            content_type="text/html",
            charset="utf-8",
            headers={"Cache-Control": "no-store"},
        )

    # ---- the proxy -----------------------------------------------------------------------

    def _proxy_handler(self, endpoint: Endpoint) -> Handler:
        async def handler(request: web.BaseRequest) -> web.StreamResponse:
            return await self.proxy(request, endpoint)

        return handler

    def _request_id(self, request: web.BaseRequest, ticket: int) -> str:
        given = request.headers.get("X-Request-Id")
        if given and len(given) <= 128 and _SAFE_ID.issuperset(given):
            return given
        return f"gw-{self._boot}-{ticket}"

    async def proxy(self, request: web.BaseRequest, endpoint: Endpoint) -> web.StreamResponse:
        runtime = self.runtime
        ticket = runtime.next_ticket()
        loop = self._loop
        if loop is None:
            loop = self._loop = asyncio.get_running_loop()
        task = asyncio.current_task(loop)
        assert task is not None
        ex = Exchange(self._request_id(request, ticket), time.monotonic(), Watchdog(loop, task))
        self._active.add(task)
        try:
            if self.draining:
                raise HttpError(
                    503, "draining", "The gateway is shutting down.", retry_after_ms=1000
                )
            tenant = self.keys.authenticate(request.headers)
            body = await self._read_body(request, ex.watchdog)
            data = parse_request(body, endpoint)
            if tenant.models is not None and data["model"] not in tenant.models:
                # Like OpenAI: an alias this key may not use does not exist for it.
                raise HttpError(
                    404,
                    "model_not_found",
                    "The model does not exist or this API key has no access to it.",
                    param="model",
                )
            ex.decision = runtime.router.decide(
                data["model"], request.headers, data, tenant.priority
            )
            limits = tenant.limits
            if limits is None:
                resp = await self._dispatch(request, ex, endpoint, data, ticket, tenant.index)
            else:
                charged, ex.limit_headers = limits.admit(estimate_tokens(data))
                try:
                    resp = await self._dispatch(request, ex, endpoint, data, ticket, tenant.index)
                finally:
                    usage = ex.usage.get("total_tokens") if ex.usage else None
                    limits.reconcile(charged, usage if isinstance(usage, int) else None)
        except HttpError as err:
            ex.status, ex.error = err.status, err.code
            self.metrics.rejected(err.code)
            headers = ex.headers()
            if isinstance(err, RateLimited):
                headers.update(err.headers)
            resp = error_response(err, headers)
        except asyncio.CancelledError:
            if not self._hard_stopped:
                ex.status, ex.error = 499, "client_closed"
                self._observe(ex)
                self._log(ex)
                raise
            # Cancelled by the drain deadline, not by the client: answer it.
            task.uncancel()
            stop = HttpError(
                503,
                "draining",
                "The gateway shut down before the request finished.",
                retry_after_ms=1000,
            )
            ex.status, ex.error = stop.status, stop.code
            resp = error_response(stop, ex.headers())
        finally:
            self._active.discard(task)
            if not self._active and self._idle is not None:
                self._idle.set()
        ex.status = ex.status or resp.status
        self._observe(ex)
        self._log(ex)
        return resp

    async def _read_body(self, request: web.BaseRequest, watchdog: Watchdog) -> bytes:
        cfg = self.runtime.config
        ctype = request.headers.get("Content-Type", "")
        mime = ctype.split(";", 1)[0].strip().lower()
        if mime != _JSON and not mime.endswith("+json"):
            raise HttpError(
                400,
                "invalid_request",
                f"Content-Type must be application/json, not {mime or 'missing'!r}.",
            )
        limit = cfg.max_body_bytes
        too_large = HttpError(413, "request_too_large", f"The request body exceeds {limit} bytes.")
        if request.content_length is not None and request.content_length > limit:
            raise too_large
        content = request.content
        if content.is_eof():
            # The whole body came with the head (the usual case): no waiting, no timer.
            body = await content.read()
            if len(body) > limit:
                raise too_large
            return body
        chunks: list[bytes] = []
        size = 0
        # SPEC §7: "a deadline on reading request headers and body (slowloris)".
        watchdog.arm_in(cfg.limits.body_timeout_ms / 1000)
        try:
            while chunk := await content.readany():
                size += len(chunk)
                if size > limit:
                    raise too_large
                chunks.append(chunk)
        except asyncio.CancelledError:
            if watchdog.absorb():
                raise HttpError(
                    408, "request_timeout", "The request body arrived too slowly."
                ) from None
            raise
        finally:
            watchdog.disarm()
        return b"".join(chunks)

    async def _dispatch(
        self,
        request: web.BaseRequest,
        ex: Exchange,
        endpoint: Endpoint,
        data: dict[str, Any],
        ticket: int,
        tenant: int,
    ) -> web.StreamResponse:
        """Admit, queue, balance and forward, retrying and falling back (SPEC §3, §6)."""
        assert ex.decision is not None
        runtime = self.runtime
        max_attempts = runtime.config.retries.max_attempts
        priority = ex.decision.priority
        pool_name: str | None = self._spill(ex, ex.decision.pool)
        visited: set[str] = set()
        last_error: AttemptError | None = None
        unavailable_ms = 1000
        while pool_name is not None and pool_name not in visited:
            visited.add(pool_name)
            found = runtime.pools.get(pool_name)
            if found is None:  # removed by a reload while this request was on its way
                break
            pool = found
            ex.pool = pool_name
            excluded = 0
            for _ in range(max_attempts):
                t_queue = time.monotonic()
                try:
                    idx, ex.waited_as = await pool.scheduler.acquire(
                        ticket, priority, tenant, excluded
                    )
                except QueueFull as exc:
                    raise HttpError(
                        503,
                        "queue_full",
                        f"Pool {pool_name!r} is saturated and its queue is full; retry later.",
                        retry_after_ms=retry_after_ms(exc),
                    ) from None
                except QueueTimeout as exc:
                    raise HttpError(
                        503,
                        "queue_timeout",
                        f"Waited longer than the {(ex.waited_as or priority).label} queue "
                        f"allows in pool {pool_name!r}; retry later.",
                        retry_after_ms=retry_after_ms(exc),
                    ) from None
                except Draining:
                    raise HttpError(
                        503,
                        "draining",
                        "The gateway shut down before the request was served.",
                        retry_after_ms=1000,
                    ) from None
                except NoHealthyInstance as exc:
                    # SPEC §6: none of this pool's instances may be tried: the fallback.
                    unavailable_ms = retry_after_ms(exc)
                    break
                finally:
                    waited = time.monotonic() - t_queue
                    ex.queue_ms += waited * 1000
                self.metrics.waited(pool_name, (ex.waited_as or priority).label, waited)
                if ex.attempts:
                    self.metrics.retry(pool_name)
                ex.attempts += 1
                upstream = pool.upstreams[idx]
                ex.instance = upstream.name
                result = await self._attempt(request, ex, endpoint, data, pool, idx, ticket)
                if not isinstance(result, AttemptError):
                    return result
                last_error = result
                pool.last_errors[idx] = (time.time(), str(result))
                # SPEC §6: retried "on another instance of its pool".
                excluded |= 1 << idx
            pool_name = pool.spec.fallback
        if last_error is not None:
            if last_error.timeout:
                raise HttpError(504, "upstream_timeout", f"Upstream timed out: {last_error}.")
            raise HttpError(502, "upstream_error", f"Upstream failed: {last_error}.")
        ex.instance = None
        raise HttpError(
            503,
            "no_healthy_instance",
            f"No healthy instance in pool {ex.decision.pool!r} or its fallback; retry later.",
            retry_after_ms=unavailable_ms,
        )

    def _spill(self, ex: Exchange, name: str) -> str:
        """Tier spill (off unless a pool sets `spill_to`): when this pool has no free slot and
        at least `spill_queue_depth` requests waiting while the spill-to pool has a free slot,
        the request is served there now instead of queueing (e.g. simple → heavy when light is
        saturated; never the reverse unless configured)."""
        pool = self.runtime.pools.get(name)
        if pool is None or pool.spec.spill_to is None:
            return name
        target = self.runtime.pools.get(pool.spec.spill_to)
        if target is None:
            return name
        now = _now_ms()
        core = pool.scheduler.core
        if (
            core.waiting >= pool.spec.spill_queue_depth
            and core.free_slots(now) == 0
            and target.scheduler.core.waiting == 0
            and target.scheduler.core.free_slots(now) > 0
        ):
            ex.spilled_from = name
            return target.name
        return name

    async def _attempt(
        self,
        request: web.BaseRequest,
        ex: Exchange,
        endpoint: Endpoint,
        data: dict[str, Any],
        pool: PoolRuntime,
        idx: int,
        ticket: int,
    ) -> web.StreamResponse | AttemptError:
        """One try on one instance. Returns the response sent to the client, or the error
        when the attempt failed before any byte reached the client (so it may be retried).
        The slot is released exactly once, with the outcome, whatever happens."""
        upstream = pool.upstreams[idx]
        timeouts = self.runtime.config.timeouts
        outcome = Outcome.NEUTRAL
        cool_ms = 0
        resp_up: Response | None = None
        watchdog = ex.watchdog
        loop = watchdog.loop
        t0 = loop.time()
        deadline = t0 + timeouts.total_ms / 1000
        ex.ttfb = None
        ex.usage = None
        ex.attempt_error = None
        try:
            # SPEC §6 timeouts: first byte, then the attempt's total.
            watchdog.arm(min(t0 + timeouts.first_byte_ms / 1000, deadline))
            resp_up = await _guarded(
                upstream.open(endpoint.path, upstream.body_for(data)),
                watchdog,
                f"{upstream.name} sent no response head in time",
                "upstream connection failed",
            )
            watchdog.arm(deadline)
            status = resp_up.status
            ex.ttfb = loop.time() - t0
            if status >= 500 or status in (408, 429) or 300 <= status < 400:
                # SPEC §6: 5xx/429 (and 408) are the instance's failures; a redirect is not
                # followed and means a misconfigured instance.
                await _read_all(resp_up, watchdog)
                if status in (429, 503):
                    cool_ms = parse_retry_after_ms(resp_up.headers)
                outcome = Outcome.FAILURE
                return AttemptError(
                    f"upstream {upstream.name} answered HTTP {status}",
                    status=status,
                    retry_after_ms=cool_ms,
                )
            if status >= 400:
                # SPEC §6: "4xx other than 408/429 is the client's fault and passes through".
                raw = await _read_all(resp_up, watchdog)
                return web.Response(
                    status=status,
                    body=normalize_error(upstream.scrub(raw), status),
                    content_type=_JSON,
                    headers=ex.headers(),
                )
            if data.get("stream") and resp_up.content_type == "text/event-stream":
                result, outcome = await self._relay_stream(
                    request, ex, resp_up, upstream, watchdog, t0, deadline
                )
                return result
            raw = await _read_all(resp_up, watchdog)
            err, ex.usage = inspect_body(raw)
            if err is not None:
                outcome = Outcome.FAILURE
                return AttemptError(f"{upstream.name}: {err}", status=status)
            outcome = Outcome.SUCCESS
            return web.Response(
                status=status,
                body=raw,
                content_type=resp_up.content_type or _JSON,
                headers=ex.headers(),
            )
        except AttemptError as err:
            outcome = Outcome.FAILURE
            return err
        finally:
            watchdog.disarm()
            if outcome is Outcome.FAILURE and ex.attempt_error is not None:
                # A failure after the response started (the others are noted by _dispatch).
                pool.last_errors[idx] = (time.time(), ex.attempt_error)
            elapsed = loop.time() - t0
            ex.upstream_ms += elapsed * 1000
            self.metrics.attempt(pool.name, upstream.name, ex.ttfb, elapsed)
            if ex.usage is not None and outcome is Outcome.SUCCESS:
                self.metrics.used_tokens(pool.name, upstream.name, ex.usage)
            if resp_up is not None:
                # An unfinished body means the upstream is still working: closing the
                # connection cancels it there (client gone, stream failed).
                resp_up.close() if not resp_up.content.is_eof() else resp_up.release()
            pool.scheduler.release(ticket, outcome, cool_ms)

    async def _relay_stream(
        self,
        request: web.BaseRequest,
        ex: Exchange,
        resp_up: Response,
        upstream: Upstream,
        watchdog: Watchdog,
        started: float,
        deadline: float,
    ) -> tuple[web.StreamResponse | AttemptError, Outcome]:
        """SSE passed through chunk by chunk. Until the first byte is written the attempt may
        still be retried; after it, a failure ends the stream with an error event."""
        idle = self.runtime.config.timeouts.stream_idle_ms / 1000
        content = resp_up.content
        try:
            first = await _read_chunk(content, watchdog, idle, deadline)
        except AttemptError as err:
            return err, Outcome.FAILURE
        # For a stream, the first byte a user feels is the first chunk, not the head.
        ex.ttfb = watchdog.loop.time() - started
        if not first:
            return AttemptError(
                f"{upstream.name} closed the stream before any data"
            ), Outcome.FAILURE
        reported = upstream_error_of(first) if first.lstrip()[:1] == b"{" else None
        if reported is not None:
            return AttemptError(f"{upstream.name}: {reported}"), Outcome.FAILURE
        checker = SseChecker()
        try:
            out = checker.feed(first)
        except MalformedEvent as err:
            return AttemptError(f"{upstream.name}: {err}"), Outcome.FAILURE
        headers = ex.headers()
        headers.update(
            {
                "Content-Type": "text/event-stream; charset=utf-8",
                "Cache-Control": "no-cache",
                "X-Accel-Buffering": "no",
            }
        )
        resp = web.StreamResponse(status=200, headers=headers)
        await resp.prepare(request)
        failure: tuple[str, str] | None = None
        try:
            if out:
                await resp.write(out)
            while chunk := await _read_chunk(content, watchdog, idle, deadline):
                out = checker.feed(chunk)
                if out:
                    await resp.write(out)
            out = checker.finish()
            if out:
                await resp.write(out)
        except asyncio.CancelledError:
            if self._hard_stopped:
                with contextlib.suppress(Exception):
                    await resp.write(sse_error_event("draining", "The gateway shut down."))
                    await resp.write_eof()
            raise
        except ConnectionResetError:
            # The client left mid-stream: nothing to tell it; the upstream is closed below.
            return resp, Outcome.NEUTRAL
        except AttemptError as err:
            failure = ("upstream_timeout" if err.timeout else "upstream_error", str(err))
        except MalformedEvent as err:
            failure = ("upstream_error", str(err))
        ex.usage = checker.usage
        if failure is not None:
            # SPEC §6: "its failure ends the stream with an error event ... never a silent
            # cut, never a fake [DONE]".
            code, why = failure
            ex.error = code
            ex.attempt_error = f"stream failed: {why}"
            with contextlib.suppress(ConnectionResetError):
                await resp.write(sse_error_event(code, f"The upstream stream failed: {why}."))
                await resp.write_eof()
            return resp, Outcome.FAILURE
        await resp.write_eof()
        if checker.upstream_error is not None:
            # The upstream itself reported an error inside the stream (vLLM does): the
            # client already has that event; the instance failed this request.
            ex.error = "upstream_error"
            ex.attempt_error = "the upstream sent an error event mid-stream"
            return resp, Outcome.FAILURE
        return resp, Outcome.SUCCESS

    def _observe(self, ex: Exchange) -> None:
        d = ex.decision
        priority = (ex.waited_as or d.priority).label if d is not None else None
        self.metrics.request_done(ex.pool or (d.pool if d else None), priority, ex.status)

    def _log(self, ex: Exchange) -> None:
        if not access_log.isEnabledFor(logging.INFO):
            return
        d = ex.decision
        access_log.info(
            "request",
            extra={
                "fields": {
                    "id": ex.request_id,
                    "pool": ex.pool,
                    "instance": ex.instance,
                    "priority": (ex.waited_as or d.priority).label if d else None,
                    "complexity": d.complexity if d else None,
                    "rule": d.complexity_rule if d else None,
                    "queue_ms": round(ex.queue_ms, 1),
                    "upstream_ms": round(ex.upstream_ms, 1),
                    "status": ex.status,
                    "attempts": ex.attempts,
                    "error": ex.error,
                    "total_ms": round((time.monotonic() - ex.started) * 1000, 1),
                }
            },
        )


def _now_ms() -> int:
    return time.monotonic_ns() // 1_000_000


async def _guarded(aw: Awaitable[T], watchdog: Watchdog, late: str, broken: str) -> T:
    """Awaits `aw` within the deadline the watchdog holds: its expiry becomes a timeout
    `AttemptError`, a connection error a failure one; anyone else's cancellation passes."""
    try:
        return await aw
    except asyncio.CancelledError:
        if watchdog.absorb():
            raise AttemptError(late, timeout=True) from None
        raise
    except OSError as exc:
        raise AttemptError(f"{broken} ({exc})") from None


async def _read_all(resp: Response, watchdog: Watchdog) -> bytes:
    """The whole upstream body, within the attempt's deadline."""
    return await _guarded(
        resp.read(), watchdog, "upstream body did not arrive in time", "upstream connection failed"
    )


async def _read_chunk(content: Response, watchdog: Watchdog, idle: float, deadline: float) -> bytes:
    """The next piece of a stream, within the idle timeout and the attempt's total deadline."""
    watchdog.arm(min(watchdog.loop.time() + idle, deadline))
    return await _guarded(
        content.readany(), watchdog, "upstream stream stalled", "upstream cut the stream"
    )
