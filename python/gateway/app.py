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
import dataclasses
import functools
import logging
import os
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, Any

import orjson
from aiohttp import web
from aiohttp.web_protocol import RequestHandler
from multidict import istr

from gateway import logs, slo, telemetry
from gateway._core import Priority
from gateway.access import AccessValues
from gateway.affinity import affinity_placement
from gateway.auth import KeyRing, Tenant
from gateway.batch import BATCH_PATHS, BatchApi, BatchService
from gateway.batch.ports import BatchPorts
from gateway.batch.relay import BatchRelay, is_batch_path
from gateway.clock import LOOP_CLOCK, Clock
from gateway.config import Config
from gateway.deadline import Watchdog
from gateway.errors import (
    DEFAULT_RETRY_AFTER_MS,
    Draining,
    GatewayError,
    InternalError,
    InvalidRequest,
    MethodNotAllowed,
    ModelNotFound,
    NoHealthyInstance,
    NotFound,
    Overloaded,
    QueueFull,
    QueueTimeout,
    RequestError,
    RequestTimeout,
    RequestTooLarge,
    SloUnattainable,
    retry_after_ms,
    with_retry_after,
)
from gateway.events import Events, RequestFinished
from gateway.exchange import Exchange
from gateway.forward import AttemptError, Forwarder, UpstreamBody, earliest_try_ms, exhausted
from gateway.limits import Buffered, HostLimits, estimate_tokens
from gateway.messages import ENDPOINTS, Endpoint, parse_request
from gateway.metrics import NO_KEY, Metrics
from gateway.outcome import Answered, Outcome, Refused
from gateway.pool import Pool
from gateway.redact import REDACTOR, secrets_of
from gateway.responses import NOSNIFF, answer_of, error_response
from gateway.runtime import Runtime
from gateway.topology import Topology

if TYPE_CHECKING:
    from gateway.admin import Admin

__all__ = ["Gateway"]

log = logging.getLogger("gateway")
access_log = logging.getLogger("gateway.access")

Handler = Callable[[web.BaseRequest], Awaitable[web.StreamResponse]]

_SAFE_ID = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_.:")
_JSON = "application/json"
# Header names as aiohttp's case-insensitive headers keep them: a look-up with a plain str
# folds its case first (~70 ns each, per request).
_CONTENT_TYPE = istr("Content-Type")
_X_REQUEST_ID = istr("X-Request-Id")
_NOSNIFF_NAME = istr("X-Content-Type-Options")


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

    def handle_error(
        self,
        request: web.BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        """A request aiohttp's parser refused (or an error past our handler): an OpenAI-shaped
        answer that never echoes the request (the offending line may hold a key), and no
        traceback in the log (any client could flood it) — one counted, redacted line."""
        err: RequestError
        if status >= 500:
            err = InternalError("Internal gateway error.")
            log.error("request failed", extra={"fields": {"error": type(exc).__name__}})
        elif status == 413:
            err = RequestTooLarge("The request is too large.")
        else:
            err = InvalidRequest("Malformed HTTP request.")
        resp = error_response(err)
        if self.on_rejected is not None:
            self.on_rejected(resp.status, answer_of(err)[1])
        log.debug("malformed request", extra={"fields": {"error": type(exc).__name__}})
        resp.force_close()
        return resp

    on_rejected: Callable[[int, str], None] | None = None


class _Server(web.Server):
    def __init__(
        self,
        handler: Handler,
        header_timeout: float,
        on_rejected: Callable[[int, str], None],
        **kwargs: Any,
    ) -> None:
        super().__init__(handler, **kwargs)
        self._header_timeout = header_timeout
        self._on_rejected = on_rejected

    def __call__(self) -> RequestHandler:
        proto = _Protocol(self, loop=self._loop, **self._kwargs)
        proto.header_timeout = self._header_timeout
        proto.on_rejected = self._on_rejected
        return proto


class Gateway:
    """The HTTP surface of SPEC §7 over one `Runtime`."""

    def __init__(
        self,
        config: Config,
        *,
        config_path: str | None = None,
        topology: Topology | None = None,
        clock: Clock = LOOP_CLOCK,
    ) -> None:
        # One process, or one of N workers (SPEC §12), and the clock the pools run on: both
        # decided by the composition root.
        topology = topology if topology is not None else Topology.single()
        #: The public, typed event stream (requests answered, instance changes, probes).
        self.events = Events()
        self.runtime = Runtime(config, self.events, topology.link, clock, topology.capacity)
        self._now_ms = clock.now_ms
        self.config_path = config_path
        #: SPEC §7 drain, from the signal on: /readyz answers 503 (load balancers stop sending)
        #: while requests are still served for `shutdown.drain_delay_ms`.
        self.draining = False
        #: Set once the delay is over and the listener closed: a new request is answered 503
        #: `draining` (only in-flight and queued work still runs).
        self.refusing = False
        # Set when the drain deadline passed: in-flight work is cancelled and answered 503
        # (or, for a started stream, an error event) instead of being cut silently.
        self._hard_stopped = False
        self._active: set[asyncio.Task[Any]] = set()
        # Set by the last request to finish once draining started.
        self._idle: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._boot = os.urandom(4).hex()
        self._id_prefix = f"gw-{self._boot}-"  # the ids the gateway makes
        # The access line's values of a finished exchange, handed to the log as a value.
        self._access = AccessValues(self._id_prefix, REDACTOR)
        #: The admin routes, mounted by the composition root (`Server`), which owns reload.
        self.admin: Admin | None = None
        self._routes: dict[tuple[str, str], Handler] = {("GET", "/v1/models"): self.models}
        for path, endpoint in ENDPOINTS.items():
            self._routes[("POST", path)] = self._proxy_handler(endpoint)
        self.keys = KeyRing(config)
        self.metrics = Metrics(
            lambda: self.runtime,
            share_dir=topology.metrics_dir,
            restarts_path=topology.worker_restarts_path,
        )
        self.metrics.keep_keys(t.name for t in self.keys.tenants)
        self.metrics.exemplars = config.telemetry.exemplars
        # SPEC §14: the Batch API (`/v1/files`, `/v1/batches`; ids matched in `handle`).
        self.batch = BatchService(BatchPorts(self, lambda: self.keys, self.runtime, self.metrics))
        self.batch_api = BatchApi(self.batch)
        self._routes.update(self.batch_api.routes())
        # SPEC §12: in a worker other than the Batch API's home, its requests are relayed.
        self.batch_relay: BatchRelay | None = None
        self._allowed: dict[str, str] = {}
        self._index_routes()
        REDACTOR.add(secrets_of(config))
        # OpenTelemetry traces: None (and nothing imported) unless an OTLP endpoint is set.
        self.tracing = telemetry.setup(config)
        if self.tracing is not None:
            tracing = self.tracing
            self.metrics.watch_spans(lambda: tracing.dropped)
        self.forwarder = Forwarder(self.runtime, self.metrics, REDACTOR)
        # SPEC §16: request bytes held by queued and in-flight requests; SPEC §12: with
        # workers, counted per host in the region (so is every key's rpm/tpm).
        link = topology.link
        self.buffered = Buffered(link.region, link.slot) if link else Buffered()
        self.host_limits = HostLimits(link.region, link.slot) if link else HostLimits()

    @property
    def buffered_bytes(self) -> int:
        """Request bytes the whole gateway holds (SPEC §12: every worker's, with workers)."""
        return self.buffered.total

    def mount(self, admin: Admin) -> None:
        """Serves `admin`'s routes (/livez, /readyz, /admin/*, /metrics, /dashboard)."""
        self.admin = admin
        self._routes.update(admin.routes())
        self._index_routes()

    def _index_routes(self) -> None:
        self._allowed = {}
        for method, path in self._routes:
            self._allowed[path] = ", ".join(filter(None, (self._allowed.get(path), method)))

    # ---- what the admin routes read (`admin.Snapshots`) -------------------------------------

    def config(self) -> Config:
        return self.runtime.config

    def pools(self) -> Mapping[str, Pool]:
        return self.runtime.pools

    def batches(self) -> tuple[dict[str, int], list[dict[str, Any]]]:
        return self.batch.state()

    # ---- server plumbing -----------------------------------------------------------------

    def server(self) -> web.Server:
        limits = self.runtime.config.limits
        return _Server(
            self.handle,
            header_timeout=limits.header_timeout_ms / 1000,
            on_rejected=self._rejected_by_parser,
            handler_cancellation=True,
            keepalive_timeout=limits.keepalive_timeout_ms / 1000,
            access_log=None,
            max_line_size=16384,
            max_field_size=16384,
        )

    def _rejected_by_parser(self, status: int, code: str) -> None:
        self.metrics.rejected("malformed_request" if status < 500 else code)
        self.metrics.request_done(None, None, status)

    async def handle(self, request: web.BaseRequest) -> web.StreamResponse:
        proto = request.protocol
        if isinstance(proto, _Protocol):
            proto.started = True
        if self.batch_relay is not None and is_batch_path(request.path):
            return await self.batch_relay.relay(request)  # SPEC §12: worker 0 serves batches
        handler = self._routes.get((request.method, request.path))
        if handler is None and request.path.startswith(BATCH_PATHS):
            handler = self.batch_api.route(request.method, request.path)
        resp: web.StreamResponse
        if handler is None:
            allowed = self._allowed.get(request.path)
            if allowed is None:
                resp = error_response(NotFound("No such route."))
            else:
                wrong = MethodNotAllowed(
                    f"Use {allowed} on this route.", headers={"Allow": allowed}
                )
                resp = error_response(wrong)
            self.metrics.request_done(None, None, resp.status)
        else:
            try:
                resp = await handler(request)
            except RequestError as err:
                resp = error_response(err)
            except (asyncio.CancelledError, ConnectionResetError):
                raise
            except Exception:
                resp = self._internal_error(request)
        if not resp.prepared:
            resp.headers[_NOSNIFF_NAME] = NOSNIFF
            if self.draining:
                # SPEC §7 drain: a keep-alive client reconnects (through its load balancer, to
                # a ready replica) instead of holding on to this one. Only where the head is
                # still to be sent: closing after a head that promised keep-alive races the
                # client's next request.
                resp.force_close()
        return resp

    def _internal_error(self, request: web.BaseRequest) -> web.Response:
        """A bug: never a traceback to the client; the (redacted) log has it, and it is
        counted like every other answer."""
        log.exception("unhandled error", extra={"fields": {"route": request.path[:100]}})
        self.metrics.request_done(None, None, 500)
        return error_response(InternalError("Internal gateway error."))

    async def close(self) -> None:
        if self.batch_relay is not None:
            await self.batch_relay.close()
        await self.runtime.close()
        if self.tracing is not None:
            await self.tracing.close()

    async def drain(self, site: web.BaseSite, cut: asyncio.Event | None = None) -> None:
        """SPEC §7 "SIGTERM drains", once the delay is over (`Server.shutdown` waits it out
        with /readyz at 503 and the listener serving): new connections stop, in-flight and
        queued requests finish within the drain deadline (or until `cut` is set), then the
        rest get 503 or a stream error event."""
        self.draining = self.refusing = True
        await site.stop()
        self._idle = asyncio.Event()
        if not self._active:
            return
        idle = asyncio.ensure_future(self._idle.wait())
        waits: set[asyncio.Future[Any]] = {idle}
        if cut is not None:
            waits.add(asyncio.ensure_future(cut.wait()))
        timeout_s = self.runtime.config.shutdown.drain_timeout_ms / 1000
        await asyncio.wait(waits, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
        for waiting in waits:
            waiting.cancel()
        if not self._active:
            return
        self._hard_stopped = self.forwarder.hard_stopped = True
        log.warning("drain deadline passed", extra={"fields": {"unfinished": len(self._active)}})
        for pool in self.runtime.pools.values():
            pool.fail_all_waiting(
                lambda: _draining("The gateway shut down before the request was served.")
            )
        for task in list(self._active):
            task.cancel()
        # The cancelled handlers answer 503 or end their stream with an error event.
        self._idle.clear()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(2.0):
                await self._idle.wait()

    # ---- small endpoints -----------------------------------------------------------------

    async def models(self, request: web.BaseRequest) -> web.StreamResponse:
        tenant = self.keys.authenticate(request.headers)
        data = [
            {"id": alias, "object": "model", "created": 0, "owned_by": "gateway"}
            for alias in self.runtime.router.aliases()
            if tenant.models is None or alias in tenant.models
        ]
        return web.Response(body=orjson.dumps({"object": "list", "data": data}), content_type=_JSON)

    # ---- the proxy -----------------------------------------------------------------------

    def _proxy_handler(self, endpoint: Endpoint) -> Handler:
        # `proxy`'s own coroutine: no wrapping one to create and resume per request
        return functools.partial(self.proxy, endpoint=endpoint)

    def _task(self) -> asyncio.Task[Any]:
        loop = self._loop
        if loop is None:
            loop = self._loop = asyncio.get_running_loop()
        task = asyncio.current_task(loop)
        assert task is not None
        return task

    async def proxy(self, request: web.BaseRequest, endpoint: Endpoint) -> web.StreamResponse:
        """One proxied HTTP request (`_exchange`), answered whatever happens: an error is
        answered OpenAI-shaped. While it runs the drain waits for it (SPEC §7)."""
        task = self._task()
        self._active.add(task)
        try:
            ex, answer = await self._exchange(endpoint, request, _given_id(request), task)
        finally:
            self._active.discard(task)
            if not self._active and self._idle is not None:
                self._idle.set()
        # Not `isinstance(answer, web.StreamResponse)`: an ABC (MutableMapping), ~0.3 µs.
        if not isinstance(answer, GatewayError):
            return answer
        return error_response(answer, ex.headers())

    async def call(
        self,
        endpoint: Endpoint,
        raw: bytes,
        tenant: Tenant,
        *,
        request_id: str,
        priority: str = "low",
        seen: list[Exchange] | None = None,
        slo_ttft_ms: int | None = None,
    ) -> Outcome:
        """Serves one request from inside the process (a Batch API line, SPEC §14) through
        the same exchange as an HTTP request (`_exchange`: validation, routing, scheduling,
        retries, health, key limits and accounting), at `priority` (low: the key's default
        priority does not raise it), never streamed. Returns what happened as a value: the
        upstream's answer, or the gateway's refusal with its domain error (`Executor`).
        `slo_ttft_ms`: SPEC §17, a batch line's objective (the time left in its batch's
        `completion_window`). `seen` gets the exchange as it starts (SPEC §14 prompt cancel:
        the runner sees whether it was sent)."""
        line = _Line(raw, tenant, priority, slo_ttft_ms, seen)
        ex, answer = await self._exchange(endpoint, line, request_id, self._task())
        if isinstance(answer, GatewayError):
            return Refused.of(answer)
        body = answer.body if isinstance(answer, web.Response) else b""
        return Answered(answer.status, body if isinstance(body, bytes) else b"", ex.usage)

    async def _exchange(
        self,
        endpoint: Endpoint,
        incoming: web.BaseRequest | _Line,
        request_id: str | None,
        task: asyncio.Task[Any],
    ) -> tuple[Exchange, web.StreamResponse | GatewayError]:
        """One exchange's life, whichever way it came in (an HTTP request, or a batch line
        from inside the process): its ticket, its `Exchange` (`request_id`, or one made from
        the ticket) and tracing span, SPEC §2's path (`_serve` or `_serve_line`, then
        `_route`), what an error is answered (a refusal, the drain's 503, a bug's 500), then
        counted and logged once. Returns the exchange and its answer: the response, or the
        error the gateway answers (`ex.status` and `ex.error` say which already). A client
        that left (cancelled) is counted 499 and the cancellation goes on; an in-process line
        withdrawn by its runner is no request answered: it is neither counted nor logged."""
        ticket = self.runtime.next_ticket()
        line = incoming if isinstance(incoming, _Line) else None
        ex = Exchange(
            request_id or f"{self._id_prefix}{ticket}",
            time.monotonic(),
            Watchdog(task.get_loop(), task),
            source="http" if line is None else "batch",
        )
        if line is not None:
            # A batch line's key is known before anything (the batch's); an HTTP request's
            # once it authenticated.
            ex.key_name = line.tenant.name if line.tenant.index else None
            if line.seen is not None:
                line.seen.append(ex)
        if self.tracing is not None:  # a batch line is traced like the request it stands for
            if isinstance(incoming, web.BaseRequest):
                ex.span = self.tracing.request(incoming.headers, incoming.path)
            else:
                ex.span = self.tracing.request({}, "/v1" + endpoint.path)
            ex.trace_id = ex.span.trace_id
        answer: web.StreamResponse | GatewayError
        try:
            if self.refusing:
                raise _draining("The gateway is shutting down.")
            if isinstance(incoming, web.BaseRequest):
                answer = await self._serve(incoming, ex, endpoint, ticket)
            else:
                answer = await self._serve_line(incoming, ex, endpoint, ticket)
        except (RequestError, QueueFull, NoHealthyInstance) as err:
            ex.status, ex.error, _ = answer_of(err)
            self.metrics.rejected(ex.error)
            if isinstance(err, SloUnattainable):  # SPEC §17: shed at arrival or while queued
                ex.slo_result = "shed"
            # Kept as the answer without its traceback: its frames (this one included, a
            # cycle only the GC would break) hold what the request held, e.g. the body read
            # so far (SPEC §16: memory the bound no longer counts).
            answer = err.with_traceback(None)
        except asyncio.CancelledError:
            if not (self._hard_stopped and task in self._active):
                if line is None:
                    ex.status, ex.error = 499, "client_closed"
                    self._observe(ex)
                    self._log(ex)
                raise
            # Cancelled by the drain deadline, not by the client: answer it.
            task.uncancel()
            answer = _draining("The gateway shut down before the request finished.")
            ex.status, ex.error, _ = answer_of(answer)
        except Exception:
            # A bug, not the client's or the upstream's doing: answered, counted and logged
            # like every other request (the slot was given back by the attempt's `finally`).
            log.exception("unhandled error", extra={"fields": {"id": ex.request_id}})
            answer = InternalError("Internal gateway error.")
            ex.status, ex.error = 500, "internal_error"
        if not isinstance(answer, GatewayError):  # a response
            ex.status = ex.status or answer.status
        self._observe(ex)
        self._log(ex)
        return ex, answer

    async def _serve(
        self, request: web.BaseRequest, ex: Exchange, endpoint: Endpoint, ticket: int
    ) -> web.StreamResponse:
        """An HTTP request comes in — SPEC §2 in order: ingress (authenticate, size-limit,
        validate), then classify and route, admit, queue, balance and forward (`_route`)."""
        tenant = self.keys.authenticate(request.headers)
        ex.key_name = tenant.name if tenant.index else None  # index 0: no key (auth off)
        raw = await self._read_body(request, ex.watchdog)
        data = parse_request(raw, endpoint)
        del raw  # SPEC §16: a queued request holds one copy of its bytes, not three
        return await self._route(request, request.headers, ex, endpoint, ticket, tenant, data)

    async def _serve_line(
        self, line: _Line, ex: Exchange, endpoint: Endpoint, ticket: int
    ) -> web.StreamResponse:
        """A batch line comes in (SPEC §14): its key is the batch's, its priority the line's,
        and it is never streamed; then the same `_route` as an HTTP request."""
        tenant = line.tenant
        data = parse_request(line.raw, endpoint)
        if data.get("stream"):
            raise InvalidRequest("Batch requests cannot stream.", param="stream")
        headers = {"X-Priority": line.priority}
        return await self._route(None, headers, ex, endpoint, ticket, tenant, data, line.ttft_ms)

    async def _route(
        self,
        request: web.BaseRequest | None,
        headers: Mapping[str, str],
        ex: Exchange,
        endpoint: Endpoint,
        ticket: int,
        tenant: Tenant,
        data: dict[str, Any],
        line_ttft_ms: int | None = None,
    ) -> web.StreamResponse:
        """Classify and route (SPEC §4), then admit, queue, balance and forward."""
        alias = data["model"]
        if tenant.models is not None and alias not in tenant.models:
            # Like OpenAI: an alias this key may not use does not exist for it.
            raise ModelNotFound(
                "The model does not exist or this API key has no access to it.", param="model"
            )
        if tenant.routes is not None:
            # SPEC §15 tier routes, before routing: a free key's `judge` is served as `judge-lite`.
            alias = tenant.routes.get(alias, alias)
        router = self.runtime.router
        ex.decision = router.decide(alias, headers, data, tenant.priority)
        self._objectives(ex, headers, tenant, data, line_ttft_ms)
        if router.affinity_prefix_chars:
            # SPEC §15: what affinity pools place the request by (its session, its prompt's
            # chained block hashes).
            ex.affinity_key, ex.affinity_prefix = affinity_placement(
                headers, data, self.runtime.config.affinity
            )
        if ex.span is not None:
            ex.span.routed(alias, data)
        if ex.slo_deadline_ms:
            # SPEC §17 "Unattainable": before it queues (and before its tokens are charged).
            self._meet_objective(ex, tenant)
        body = _upstream_body(data)
        limits = self.host_limits.of(tenant.name, tenant.limits, self.keys)
        held = self._hold(body.size)
        try:
            if limits is None:
                del data
                return await self._dispatch(request, ex, endpoint, body, ticket, tenant.index)
            charged, ex.limit_headers = limits.admit(estimate_tokens(data))
            del data
            try:
                return await self._dispatch(request, ex, endpoint, body, ticket, tenant.index)
            finally:
                usage = ex.usage.get("total_tokens") if ex.usage else None
                limits.reconcile(charged, usage if isinstance(usage, int) else None)
        finally:
            self.buffered.give(held)

    def _objectives(
        self,
        ex: Exchange,
        headers: Mapping[str, str],
        tenant: Tenant,
        data: dict[str, Any],
        line_ttft_ms: int | None,
    ) -> None:
        """SPEC §17: the request's objectives ("header, key, class"; a batch line's is the
        time left in its window) and its deadline: "Time spent queued counts against it", so
        it runs from arrival, on the core's clock; the core keeps it across retries."""
        assert ex.decision is not None
        sched = self.runtime.config.scheduler
        cls = sched.high if ex.decision.priority is Priority.HIGH else sched.low
        ttft, tpot = slo.objectives(headers, tenant.slo, cls)
        if line_ttft_ms is not None:
            ttft = line_ttft_ms
        # The latency model's input (the per-key tpm limit's estimate, without the budget).
        ex.prompt_tokens = slo.prompt_tokens(data)
        ex.slo_ttft_ms, ex.slo_tpot_ms = ttft, tpot
        if ttft is not None:
            # Arrival on the pools' clock (the composition root's; `ex.started` is the
            # process's monotonic clock, which the real one is).
            waited_ms = int((time.monotonic() - ex.started) * 1000)
            ex.slo_deadline_ms = self._now_ms() - waited_ms + ttft

    def _meet_objective(self, ex: Exchange, tenant: Tenant) -> None:
        """SPEC §17: "when no instance of the pool, its spill or its fallback is predicted to
        meet the objective, the request goes to a faster pool where its key's routes allow
        it ... or — with `scheduler.shed_unattainable: true` — is answered at once 503
        `slo_unattainable` with a computed `Retry-After`". Otherwise it queues as usual."""
        assert ex.decision is not None
        priority, deadline, tokens = ex.decision.priority, ex.slo_deadline_ms, ex.prompt_tokens
        pools = self.runtime.pools
        chain: list[str] = []
        name: str | None = ex.decision.pool
        while name is not None and name not in chain and name in pools:
            chain.append(name)
            spill = pools[name].spec.spill_to
            if spill is not None and spill not in chain and spill in pools:
                chain.append(spill)
            name = pools[name].spec.fallback
        waits = []
        for name in chain:
            wait = pools[name].attainable(priority, deadline, tokens)
            if wait == 0:
                return
            waits.append(wait)
        # SPEC §17: "the request goes to a faster pool where its key's routes allow it" — one
        # whose calibrated model predicts it meets the objective. `attainable` fails open on
        # a model that cannot say yet (right for the request's own pool: it stays and
        # queues); a pool nobody has measured is not known to be faster, so it takes none.
        budget_ms = deadline - self._now_ms()
        faster = []
        for name in self._pools_of(tenant):
            if name in chain or name not in pools:
                continue
            other = pools[name]
            best_ms = other.best_ttft_ms(tokens)  # inf: no live calibrated instance
            if best_ms <= budget_ms and other.attainable(priority, deadline, tokens) == 0:
                faster.append((best_ms, name))
        if faster:
            target = min(faster)[1]
            ex.spilled_from = ex.decision.pool
            ex.decision = dataclasses.replace(ex.decision, pool=target)
            return
        if self.runtime.config.scheduler.shed_unattainable and waits:
            ex.slo_result = "shed"
            wait = min(waits)
            raise SloUnattainable(
                f"No instance is predicted to meet the request's latency objective "
                f"({ex.slo_ttft_ms} ms to the first token); retry after "
                f"{-(-wait // 1000)}s or with a longer objective.",
                retry_after_ms=wait,
            )

    def _pools_of(self, tenant: Tenant) -> list[str]:
        """The pools `tenant` may be served by: those of the aliases it may use, after its
        tier routes (SPEC §15; a free key routed to `judge-lite` is not upgraded past it)."""
        config = self.runtime.config
        out: list[str] = []
        for alias in config.models:
            if tenant.models is not None and alias not in tenant.models:
                continue
            served = tenant.routes.get(alias, alias) if tenant.routes else alias
            spec = config.models.get(served)
            if spec is None:
                continue
            cx = config.routing.complexity
            for name in (spec.pool,) if spec.pool else (cx.simple, cx.complex):
                if name is not None and name not in out:
                    out.append(name)
        return out

    def _hold(self, size: int) -> int:
        """SPEC §16: admits `size` more request bytes, or answers 503 `overloaded` when the
        gateway already holds `limits.max_buffered_bytes`."""
        limit = self.runtime.config.limits.max_buffered_bytes
        if not self.buffered.take(size, limit):
            raise _overloaded()
        return size

    async def _read_body(self, request: web.BaseRequest, watchdog: Watchdog) -> bytes:
        cfg = self.runtime.config
        ctype = request.headers.get(_CONTENT_TYPE, "")
        mime = ctype.split(";", 1)[0].strip().lower()
        if mime != _JSON and not mime.endswith("+json"):
            raise InvalidRequest(
                f"Content-Type must be application/json, not {mime or 'missing'!r}.",
            )
        limit = cfg.max_body_bytes
        length = request.content_length  # parsed from the header at each read
        if length is not None and length > limit:
            raise _too_large(limit)
        content = request.content
        if content.is_eof():
            # The whole body came with the head (the usual case): no waiting, no timer, and
            # no coroutine (`read()` runs two `readany()` to find the end it already knows).
            body = content.read_nowait()
            if len(body) > limit:
                raise _too_large(limit)
            return body
        chunks: list[bytes] = []
        size = 0
        # SPEC §16: "Request bytes count toward `limits.max_buffered_bytes` **while they are
        # read**, not only once a body is complete, so a thousand slow uploads cannot hold
        # memory the bound does not see." What is read is held here until the body is whole.
        bound = cfg.limits.max_buffered_bytes
        # SPEC §7: "a deadline on reading request headers and body (slowloris)".
        watchdog.arm_in(cfg.limits.body_timeout_ms / 1000)
        try:
            while chunk := await content.readany():
                n = len(chunk)
                size += n
                if size > limit:
                    raise _too_large(limit)
                if not self.buffered.take(n, bound):
                    raise _overloaded()
                chunks.append(chunk)
            # Joining copies the body once: that copy needs room under the bound too (the
            # pieces go as soon as it is made).
            if not self.buffered.fits(size, bound):
                raise _overloaded()
            return b"".join(chunks)
        except asyncio.CancelledError:
            if watchdog.absorb():
                raise RequestTimeout("The request body arrived too slowly.") from None
            raise
        finally:
            watchdog.disarm()
            self.buffered.give(sum(map(len, chunks)))

    async def _dispatch(
        self,
        request: web.BaseRequest | None,
        ex: Exchange,
        endpoint: Endpoint,
        body: UpstreamBody,
        ticket: int,
        tenant: int,
    ) -> web.StreamResponse:
        """Admit, queue, balance and forward, retrying and falling back (SPEC §3, §6)."""
        assert ex.decision is not None
        pool_name: str | None = self._spill(ex, ex.decision.pool)
        visited: dict[str, Pool | None] = {}
        last_error: AttemptError | None = None
        unavailable_ms = DEFAULT_RETRY_AFTER_MS
        while pool_name is not None and pool_name not in visited:
            pool = visited[pool_name] = self.runtime.pools.get(pool_name)
            if pool is None:  # removed by a reload while this request was on its way
                break
            ex.pool = pool_name
            result = await self._try_pool(request, ex, endpoint, body, ticket, tenant, pool)
            if isinstance(result, AttemptError):
                last_error = result
            elif isinstance(result, int):
                unavailable_ms = result
            else:
                return result
            # SPEC §6: "then on the pool's fallback pool".
            pool_name = pool.spec.fallback
        if last_error is not None:
            # SPEC §7: an upstream 429 (or 503) with Retry-After last: 429 `rate_limited` (or
            # 503) with the time until the earliest instance it could use may be tried.
            cap_ms = self.runtime.config.health.max_ejection_ms
            tried = [p for p in visited.values() if p is not None]
            raise exhausted(last_error, lambda: earliest_try_ms(tried, cap_ms))
        ex.instance = None
        raise with_retry_after(
            NoHealthyInstance(
                f"No healthy instance in pool {ex.decision.pool!r} or its fallback; retry later."
            ),
            unavailable_ms,
        )

    async def _try_pool(
        self,
        request: web.BaseRequest | None,
        ex: Exchange,
        endpoint: Endpoint,
        body: UpstreamBody,
        ticket: int,
        tenant: int,
        pool: Pool,
    ) -> web.StreamResponse | AttemptError | int:
        """Up to `retries.max_attempts` attempts in one pool, each on an instance not tried
        yet. Returns the response, the last attempt's error, or — when none of the pool's
        instances may be tried — the ms until one may (SPEC §6)."""
        last: AttemptError | int = DEFAULT_RETRY_AFTER_MS
        excluded = 0
        for _ in range(self.runtime.config.retries.max_attempts):
            # SPEC §7: all that is left cooling for an upstream's Retry-After: answered now.
            paused = self.forwarder.cooling.blocked(pool, excluded)
            if paused is not None:
                return paused
            try:
                idx = await self._acquire(ex, pool, ticket, tenant, excluded)
            except NoHealthyInstance as exc:
                return retry_after_ms(exc) if isinstance(last, int) else last
            if ex.attempts:
                self.metrics.retry(pool.name)
            ex.attempts += 1
            up = pool.upstream(idx)
            ex.instance = up.name
            aspan = None
            if ex.span is not None:
                aspan = ex.span.attempt(
                    ex.attempts, pool.name, up.name, up.model, up.base_url, up.provider
                )
                ex.trace_headers = aspan.header
            result = await self.forwarder.attempt(request, ex, endpoint, body, pool, idx, ticket)
            if aspan is not None:
                aspan.end(result, ex)
            if not isinstance(result, AttemptError):
                return result
            last = result
            pool.note_error(idx, str(result))
            # SPEC §6: retried "on another instance of its pool".
            excluded |= 1 << idx
        return last

    async def _acquire(
        self, ex: Exchange, pool: Pool, ticket: int, tenant: int, excluded: int
    ) -> int:
        """A slot of `pool` (queueing when saturated, SPEC §3): the granted instance.
        Raises `QueueFull`, `QueueTimeout` (worded for the client) or `NoHealthyInstance`."""
        assert ex.decision is not None
        priority = ex.decision.priority
        t_queue = time.monotonic()
        qspan = ex.span.queue(pool.name) if ex.span is not None else None
        try:
            key, prefix = (ex.affinity_key, ex.affinity_prefix) if pool.affine else (0, None)
            idx, ex.waited_as, placed, matched = await pool.acquire(
                ticket,
                priority,
                tenant,
                excluded,
                key,
                prefix,
                ex.slo_deadline_ms,
                ex.prompt_tokens,
            )
            ex.affinity = placed.label
            if prefix is not None:
                # SPEC §15: the matched length, in `X-Gateway-Affinity-Match` and the log.
                ex.affinity_match = matched * self.runtime.config.affinity.block_bytes
                self.metrics.affinity_placed(pool.name, placed.label, ex.affinity_match)
        except QueueFull as exc:
            raise with_retry_after(
                QueueFull(f"Pool {pool.name!r} is saturated and its queue is full; retry later."),
                retry_after_ms(exc),
            ) from None
        except QueueTimeout as exc:
            raise QueueTimeout(
                f"Waited longer than the {(ex.waited_as or priority).label} queue "
                f"allows in pool {pool.name!r}; retry later.",
                retry_after_ms=retry_after_ms(exc),
            ) from None
        finally:
            waited = time.monotonic() - t_queue
            ex.queue_ms += waited * 1000
            if qspan is not None:
                # the error in flight, if any (QueueFull, QueueTimeout, NoHealthyInstance,
                # a cancellation) is read by the span itself
                qspan.end((ex.waited_as or priority).label, waited)
        self.metrics.waited(pool.name, (ex.waited_as or priority).label, waited, ex.trace_id)
        return idx

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
        if pool.saturated(pool.spec.spill_queue_depth) and target.can_take_now():
            ex.spilled_from = name
            return target.name
        return name

    def _observe(self, ex: Exchange) -> None:
        d = ex.decision
        pool = ex.pool or (d.pool if d else None)
        label = ex.priority_label
        self.metrics.request_done(pool, label, ex.status, ex.key_name or NO_KEY)
        if ex.has_objective:
            # SPEC §17 goodput: every request with an objective counts once — met, missed
            # (late, failed, timed out, or its client left) or shed.
            result = ex.slo_result or "missed"
            self.metrics.slo_request(pool or "", label or "", result)
            served_by = self.runtime.pools.get(pool) if pool else None
            if served_by is not None:
                served_by.note_slo(result)  # the dashboard's goodput tile
        if ex.span is not None:
            ex.span.end(ex)

    def _log(self, ex: Exchange) -> None:
        """The request's access-log line and `RequestFinished` event (built only when someone
        reads either). The access line is built at once into the log's buffer
        (`logs.AccessLog.record`), from the finished exchange."""
        fast = logs.access_log()
        if fast is not None:
            fast.record(self._access, ex)
        logging_on = access_log.isEnabledFor(logging.INFO)
        events = self.events
        if not logging_on and not events:
            return
        values = self._access.values(ex, time.monotonic())
        if logging_on:
            fields = dict(zip(logs.ACCESS_FIELDS, values, strict=True))
            access_log.info("request", extra={"fields": fields})
        if events:
            events.publish(RequestFinished(*values))


@dataclasses.dataclass(frozen=True, slots=True)
class _Line:
    """A request from inside the process (a Batch API line): what comes in instead of an
    HTTP request."""

    raw: bytes
    tenant: Tenant
    priority: str
    ttft_ms: int | None
    seen: list[Exchange] | None


def _given_id(request: web.BaseRequest) -> str | None:
    """The client's `X-Request-Id` if it is one we may echo (else the gateway makes one)."""
    given = request.headers.get(_X_REQUEST_ID)
    if given and len(given) <= 128 and _SAFE_ID.issuperset(given):
        return given
    return None


def _overloaded() -> Overloaded:
    """SPEC §16: the answer when the gateway holds `limits.max_buffered_bytes` already."""
    return Overloaded(
        "The gateway holds as many request bytes as it may; retry later.",
        retry_after_ms=DEFAULT_RETRY_AFTER_MS,
    )


def _too_large(limit: int) -> RequestTooLarge:
    # Built only when raised: an exception and its message cost ~1 µs a request otherwise.
    return RequestTooLarge(f"The request body exceeds {limit} bytes.")


def _draining(message: str) -> Draining:
    """SPEC §7 "SIGTERM drains": what a request the drain leaves unserved is answered."""
    return Draining(message, retry_after_ms=DEFAULT_RETRY_AFTER_MS)


def _upstream_body(data: dict[str, Any]) -> UpstreamBody:
    try:
        return UpstreamBody(data)
    except orjson.JSONEncodeError:
        # orjson encodes at most 254 levels: deeper nesting is no chat request.
        raise InvalidRequest("The request body is nested too deeply.") from None
