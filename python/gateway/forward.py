"""Forwarding: one attempt of one request against one upstream instance.

The ingress (`app.py`) reads, routes, queues and answers; this module sends the request to the
instance the core granted and turns what comes back into either the response for the client
or an `AttemptError` (a failure before any byte reached the client, so it may be retried
elsewhere). It owns the rules that decide what an upstream answer *means*:

- SPEC §6: 5xx, 408 and 429 are the instance's failures, 4xx other than those pass through;
  a redirect is never followed (a misconfigured instance); an upstream 401/403 is the gateway's
  own upstream key being wrong (SPEC §7: 502 `upstream_error`, never the client's 401);
- SPEC §6: "An upstream answering HTTP 200 with an error body ... is treated as that error";
  a non-streamed success that is not a JSON object is garbage, not an answer;
- SPEC §16: a non-streamed body is bounded by `limits.max_response_bytes`, one SSE event by
  `limits.max_event_bytes`; `Retry-After` is clamped to `health.max_ejection_ms`;
- SPEC §6: a started stream is never retried; its failure ends it with an error event.

The slot is released exactly once whatever happens, and that release cannot raise.
"""

from __future__ import annotations

import asyncio
import contextlib
import email.utils
import itertools
import logging
import math
import os
import re
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any, TypeVar
from urllib.parse import urlsplit

import msgspec
import orjson
from aiohttp import web

from gateway import slo
from gateway._core import Outcome, PlainEvents
from gateway.deadline import Watchdog
from gateway.errors import (
    DEFAULT_RETRY_AFTER_MS,
    GatewayError,
    UpstreamFailed,
    UpstreamRateLimited,
    UpstreamTimedOut,
    UpstreamUnavailable,
)
from gateway.exchange import Attempt, Exchange
from gateway.http1 import BodyTooLarge, Response
from gateway.messages import Endpoint
from gateway.metrics import NO_KEY, Metrics
from gateway.pool import Pool
from gateway.redact import Redactor
from gateway.responses import NOSNIFF, sse_error_event
from gateway.runtime import Runtime
from gateway.scheduler import now_ms
from gateway.sse import MalformedEvent, SseChecker
from gateway.telemetry import finish_reasons
from gateway.upstream import AttemptError, Upstream

__all__ = [
    "AttemptError",
    "Cooling",
    "Forwarder",
    "UpstreamBody",
    "exhausted",
    "inspect_body",
    "is_instance_failure",
    "normalize_error",
    "parse_retry_after_ms",
    "upstream_error_of",
]

T = TypeVar("T")
log = logging.getLogger("gateway")

_JSON = "application/json"
# A client whose unsent stream bytes exceed this pauses the upstream (SPEC §16: bounded).
_CLIENT_HIGH_WATER = 256 * 1024
_STALLED = "upstream stream stalled"
#: How much of an upstream's 429/503 message is quoted to the client.
_SAID_CHARS = 300
# A request id the upstream may be sent as `X-Request-Id` (the ingress's own ids all are).
_HEADER_SAFE = re.compile(r"[A-Za-z0-9._:\-]{1,128}")
# Unique suffixes of the ids sent upstream: this process's, then a count of its attempts.
_PROC = os.urandom(4).hex()
_ATTEMPTS = itertools.count(1)

#: Body fields that could steer a request elsewhere; never forwarded (SPEC §7).
URL_FIELDS = frozenset(("api_base", "base_url", "api_key", "organization", "extra_headers"))


class UpstreamBody:
    """The upstream request body, encoded once per request rather than once per attempt: the
    client's JSON without URL-like fields, with each instance's `model` spliced in front.

    Holding this instead of the raw body and its parsed form keeps one copy of a queued
    request's bytes (SPEC §16 counts them against `limits.max_buffered_bytes`).
    Raises `orjson.JSONEncodeError` for what cannot be re-encoded (nesting deeper than 254).
    """

    __slots__ = ("_rest", "size", "stream")

    def __init__(self, data: dict[str, Any]) -> None:
        self.stream = bool(data.get("stream"))
        rest = orjson.dumps({k: v for k, v in data.items() if k not in URL_FIELDS and k != "model"})
        self._rest = rest[1:]  # after the `{`: `"k":v,...}` or just `}`
        self.size = len(rest)

    def for_model(self, model: str) -> bytes:
        rest = self._rest
        head = b'{"model":' + orjson.dumps(model)
        return head + b"}" if rest == b"}" else head + b"," + rest


def parse_retry_after_ms(headers: Any, cap_ms: int) -> int:
    """`retry-after-ms`, or `Retry-After` as seconds or an HTTP date, in ms within
    [0, cap_ms]; 0 when absent or not a number. SPEC §16: clamped to `health.max_ejection_ms`
    (an absurd value must neither overflow into the core nor pause an instance for a day)."""
    raw = headers.get("retry-after-ms")
    value: float | None = None
    if raw:
        with contextlib.suppress(ValueError):
            value = float(raw)
    if value is None:
        raw = headers.get("Retry-After")
        if not raw:
            return 0
        raw = raw.strip()
        if raw.isascii() and raw.isdigit():
            value = float(raw) * 1000 if len(raw) < 16 else math.inf
        else:
            try:
                when = email.utils.parsedate_to_datetime(raw)
                value = (when.timestamp() - time.time()) * 1000
            except (TypeError, ValueError, OverflowError, IndexError):
                return 0
    if math.isnan(value) or value <= 0:
        return 0
    return int(min(value, cap_ms))


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


class NotJson(ValueError):
    """A success body that is not a JSON object."""


def inspect_body(body: bytes) -> tuple[str | None, dict[str, Any] | None]:
    """One parse of a complete upstream JSON body: the error it reports inside an HTTP 200,
    if any, and its `usage`. Raises `NotJson` for a body that is not a JSON object.

    SPEC §6: "An upstream answering HTTP 200 with an error body (Qianfan v1 reports rate limits
    as 200 with `{"error_code": 336501}`) is treated as that error, not as success."
    """
    try:
        out = _outline.decode(body)
    except (msgspec.DecodeError, msgspec.ValidationError):
        raise NotJson("the upstream's answer was not a JSON object") from None
    usage = msgspec.structs.asdict(out.usage) if out.usage is not None else None
    if out.error_code:
        return f"error_code {out.error_code}: {out.error_msg or ''}"[:300], usage
    err = out.error
    if err and out.choices is msgspec.UNSET and out.data is msgspec.UNSET:
        msg = err.get("message", "") if isinstance(err, dict) else str(err)
        return f"upstream error: {msg}"[:300], usage
    return None, usage


def upstream_error_of(body: bytes) -> str | None:
    """The error an upstream reported inside a JSON body, if any; `None` otherwise."""
    if b'"error' not in body:
        return None
    with contextlib.suppress(NotJson):
        return inspect_body(body)[0]
    return None


def normalize_error(body: bytes, status: int) -> bytes:
    """An upstream's error body in OpenAI's shape `{"error": {message, type, param, code}}`.

    Providers differ: vLLM answers `{"object": "error", "message", "type", "code": 400}` (an
    integer code), Qianfan v1 `{"error_code": 336003, "error_msg": ...}`, DashScope's native
    API `{"code": "InvalidParameter", "message": ...}`. Clients of this gateway see one shape.
    """
    message, etype, param, code = _error_fields(body, status)
    return orjson.dumps(
        {
            "error": {
                "message": message or f"upstream answered HTTP {status}",
                "type": etype,
                "param": param,
                "code": code,
            }
        }
    )


def _error_fields(body: bytes, status: int) -> tuple[str | None, str, str | None, str | None]:
    """(message, type, param, code) of an upstream's error body, whatever its provider's
    shape (see `normalize_error`); the message is None when the body gives none."""
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
    return (
        message[:2000] if isinstance(message, str) and message else None,
        etype if isinstance(etype, str) else kind,
        param if isinstance(param, str) else None,
        None if code is None else str(code)[:200],
    )


class Cooling:
    """SPEC §7: "An upstream **429** (or 503) with `Retry-After` cools that instance (§6) and
    the request is retried on another; when none is left the client gets **429
    `rate_limited`** (an upstream quota, e.g. OpenAI's) or 503 with the computed `Retry-After`
    — never a 502 without one, so SDKs back off."

    Remembers, per pool, which instances an upstream paused this way and with which status
    (the core keeps only the pause's end). A request that finds every instance it may still
    use paused (or ejected) is answered at once: the upstream said when to come back, and the
    queue is for saturation, not for sitting out a quota the client can wait out itself (a
    long pause would otherwise hold it until its `max_wait_ms`, then answer `queue_timeout`).
    Checked before each attempt: one dict look-up unless a pause is running in the pool, then
    a look at its free slots, and only when there is none (or on a retry) at its instances.
    """

    def __init__(self) -> None:
        # pool → instance → (upstream status, end of the pause in the core's monotonic ms)
        self._paused: dict[str, dict[str, tuple[int, int]]] = {}
        # pool → the latest end of a pause there
        self._until: dict[str, int] = {}

    def note(self, pool: str, instance: str, status: int, pause_ms: int) -> None:
        """An attempt on `instance` ended with `status` (429/503) asking for `pause_ms`
        (already clamped to `health.max_ejection_ms`, as the core clamps it)."""
        now = now_ms()
        until = now + pause_ms
        paused = self._paused.setdefault(pool, {})
        for name in [n for n, (_, end) in paused.items() if end <= now]:
            del paused[name]  # bounded: only pauses still running stay
        paused[instance] = (status, max(until, paused.get(instance, (0, 0))[1]))
        self._until[pool] = max(self._until.get(pool, 0), until)

    def blocked(self, pool: Pool, excluded: int) -> AttemptError | None:
        """When every instance of `pool` outside `excluded` is paused (cooling), or — on a
        retry — paused or ejected with at least one paused: the failure that stands for the
        attempt not made (status 429 when any of them answered 429, else 503). None
        otherwise: an instance is up (perhaps busy: the request queues for it), or none is
        left (the core answers that)."""
        until = self._until.get(pool.name)
        if until is None:
            return None
        now = now_ms()
        if until <= now:
            del self._until[pool.name]
            self._paused.pop(pool.name, None)
            return None
        if not excluded and not pool.saturated(0):
            return None  # a slot is free on an instance that admits requests now
        paused = self._paused.get(pool.name, {})
        statuses: list[int] = []
        others = False
        for index, upstream in pool.live_upstreams():
            if excluded >> index & 1:
                continue
            status, end = paused.get(upstream.name, (0, 0))
            if end > now:
                statuses.append(status)
            else:
                others = True
        if not statuses:
            return None
        if others:
            # Some are not paused: up (the request waits for them) or ejected. Only a retry,
            # which follows an upstream's answer anyway, pays for the look at their state
            # (a snapshot, ~50 us); an arrival in a busy pool does not.
            if not excluded:
                return None
            for inst in pool.snapshot(now).instances:
                if inst.removed or excluded >> inst.index & 1:
                    continue
                if inst.state not in ("cooling", "ejected"):
                    return None
        status = 429 if 429 in statuses else 503
        return AttemptError(
            f"every instance of pool {pool.name!r} left to try is cooling after an upstream "
            f"HTTP {status} with Retry-After",
            status=status,
            retry_after_ms=DEFAULT_RETRY_AFTER_MS,
        )


def earliest_try_ms(pools: Iterable[Pool], cap_ms: int) -> int:
    """SPEC §6: the time until the earliest instance of `pools` may be tried again, in ms: at
    least 1 s (0 would invite a hot retry loop), at most `cap_ms` (SPEC §16: an upstream
    Retry-After is clamped to `health.max_ejection_ms`)."""
    now = now_ms()
    lefts = [
        max(0, inst.next_try_ms - now)
        for pool in pools
        for inst in pool.snapshot(now).instances
        if not inst.removed
    ]
    wait = min(lefts, default=0)
    return max(DEFAULT_RETRY_AFTER_MS, min(wait, cap_ms))


def exhausted(last: AttemptError, wait_ms: Callable[[], int]) -> GatewayError:
    """The client's answer once every attempt failed (its pool's, then its fallback's) and
    `last` is the latest failure; `wait_ms()` computes the Retry-After (SPEC §6, §7).

    - a timeout: 504 `upstream_timeout`;
    - an upstream 429, with or without Retry-After (the upstream's quota, e.g. OpenAI's): 429
      `rate_limited` with the computed Retry-After — never a 502 SDKs would retry at once;
    - an upstream 503 with Retry-After: 503 `no_healthy_instance` with the computed
      Retry-After (the instances asked for a pause: none is up, as when all are ejected);
    - anything else: 502 `upstream_error`.
    """
    if last.timeout:
        return UpstreamTimedOut(f"Upstream timed out: {last}.")
    # "retry after Ns" as the gateway's own 429 says it (the Batch API reads it from there).
    said = str(last).rstrip(". ")
    if last.status == 429:
        wait = wait_ms()
        return UpstreamRateLimited(
            f"The upstream's rate limit was reached; retry after {math.ceil(wait / 1000)}s "
            f"({said}).",
            retry_after_ms=wait,
        )
    if last.status == 503 and last.retry_after_ms > 0:
        wait = wait_ms()
        return UpstreamUnavailable(
            f"The upstream asked for a pause; retry after {math.ceil(wait / 1000)}s ({said}).",
            wait,
        )
    return UpstreamFailed(f"Upstream failed: {last}.")


class Forwarder:
    """Runs attempts for the ingress; see the module docstring."""

    def __init__(self, runtime: Runtime, metrics: Metrics, redactor: Redactor) -> None:
        # Values handed down, not callbacks up into the ingress: the runtime (reloaded in
        # place), and the drain's verdict, which the ingress sets here (`hard_stopped`).
        self._runtime = runtime
        self._metrics = metrics
        self._redactor = redactor
        #: SPEC §7: the drain deadline passed: a stream cut now ends with an error event.
        self.hard_stopped = False
        #: SPEC §7: the instances upstreams paused with a 429/503 and Retry-After.
        self.cooling = Cooling()

    def _scrub(self, upstream: Upstream, text: str) -> str:
        """Upstream-derived text about to leave the gateway, without any secret in it."""
        return self._redactor.redact(upstream.scrub(text.encode("utf-8", "replace")).decode())

    async def attempt(
        self,
        request: web.BaseRequest | None,
        ex: Exchange,
        endpoint: Endpoint,
        body: UpstreamBody,
        pool: Pool,
        idx: int,
        ticket: int,
    ) -> web.StreamResponse | AttemptError:
        """One try on one instance. Returns the response sent to the client, or the error
        when the attempt failed before any byte reached the client (so it may be retried).
        The slot is released exactly once, with the outcome, whatever happens."""
        upstream = pool.upstream(idx)
        config = self._runtime.config
        watchdog = ex.watchdog
        t0 = watchdog.loop.time()
        att = ex.attempt = Attempt()
        outcome = Outcome.NEUTRAL
        cool_ms = 0
        resp_up: Response | None = None
        try:
            deadline = t0 + config.timeouts.total_ms / 1000
            resp_up = await self._open(ex, att, endpoint, body, upstream, t0, deadline)
            result, outcome = await self._answer(
                request, ex, att, body.stream, upstream, resp_up, t0, deadline, pool, ticket
            )
            return result
        except AttemptError as err:
            outcome, cool_ms = Outcome.FAILURE, err.retry_after_ms
            if cool_ms > 0:
                self.cooling.note(pool.name, upstream.name, err.status, cool_ms)
            return err
        finally:
            # Nothing below may keep the slot from going back: the release comes first and
            # each step is on its own.
            watchdog.disarm()
            # SPEC §17: the answer's tokens teach the instance's latency model its TPOT.
            pool.release(ticket, outcome, cool_ms, _output_tokens(att))
            if resp_up is not None:
                # An unfinished body means the upstream is still working: closing the
                # connection cancels it there (client gone, stream failed).
                resp_up.close() if not resp_up.is_eof() else resp_up.release()
            self._after(ex, att, pool, upstream, idx, outcome, watchdog.loop.time() - t0)

    async def _open(
        self,
        ex: Exchange,
        att: Attempt,
        endpoint: Endpoint,
        body: UpstreamBody,
        upstream: Upstream,
        t0: float,
        deadline: float,
    ) -> Response:
        """Sends the request and reads the response head. SPEC §6 timeouts: the head within
        the first-byte timeout; from then on the attempt's total (`deadline`) is armed."""
        watchdog = ex.watchdog
        config = self._runtime.config
        first_byte_ms = config.timeouts.first_byte_ms
        watchdog.arm(min(t0 + first_byte_ms / 1000, deadline))
        # SPEC §16: the id the upstream may echo, unique to this attempt — the request's id
        # (for the upstream's logs) and a suffix no other attempt has, so that a client that
        # names its request like another's cannot make their answers look alike.
        rid = ex.request_id
        rid = f"{rid if _HEADER_SAFE.fullmatch(rid) else 'req'}.{_PROC}{next(_ATTEMPTS)}"
        resp_up = await _guarded(
            upstream.open(
                endpoint.path,
                body.for_model(upstream.model),
                ex.trace_headers,
                request_id=rid,
                # SPEC §16: "a chunk larger than the response bound is a framing error".
                max_chunk=config.limits.max_response_bytes,
            ),
            watchdog,
            f"{upstream.name} sent no response head in time",
            "upstream connection failed",
        )
        watchdog.arm(deadline)
        att.ttfb = watchdog.loop.time() - t0
        return resp_up

    async def _answer(
        self,
        request: web.BaseRequest | None,
        ex: Exchange,
        att: Attempt,
        stream: bool,
        upstream: Upstream,
        resp_up: Response,
        t0: float,
        deadline: float,
        pool: Pool,
        ticket: int,
    ) -> tuple[web.StreamResponse, Outcome]:
        """What the upstream's answer means (its status decides, SPEC §6): the response for
        the client and the attempt's outcome. Raises `AttemptError` for the instance's
        failures."""
        status = resp_up.status
        if is_instance_failure(status):
            raise await self._instance_failure(ex, upstream, resp_up)
        if status >= 400:
            # SPEC §6: "4xx other than 408/429 is the client's fault and passes through".
            return await self._client_error(ex, upstream, resp_up), Outcome.NEUTRAL
        if stream and request is not None and resp_up.content_type == "text/event-stream":
            return await self._relay_stream(
                request, ex, att, resp_up, upstream, t0, deadline, pool, ticket
            )
        return await self._json_answer(ex, att, upstream, resp_up), Outcome.SUCCESS

    async def _instance_failure(
        self, ex: Exchange, upstream: Upstream, resp_up: Response
    ) -> AttemptError:
        """The error for an answer that is the instance's failure (`is_instance_failure`),
        with the pause a 429/503 asked for (its body is read and dropped)."""
        config = self._runtime.config
        status = resp_up.status
        raw = await _read_all(resp_up, ex.watchdog, config.limits.max_response_bytes)
        cool_ms = 0
        why = "rejected the gateway's credentials" if status in (401, 403) else "answered"
        reason = f"upstream {upstream.name} {why} HTTP {status}"
        if status in (429, 503):
            cool_ms = parse_retry_after_ms(resp_up.headers, config.health.max_ejection_ms)
            # SPEC §7: a quota answer reaches the client (429 `rate_limited`); what the upstream
            # said (which limit, a quota exhausted for good) helps it, once no secret and no
            # address of the instance is in it.
            said = _error_fields(raw, status)[0]
            if said:
                said = self._scrub(upstream, said)
                for where in (upstream.base_url, urlsplit(upstream.base_url).netloc):
                    said = said.replace(where, "[upstream]") if where else said
                # Scrubbed whole, then cut: a cut could split a secret past recognition.
                reason += ": " + said[:_SAID_CHARS]
        return AttemptError(reason, status=status, retry_after_ms=cool_ms)

    async def _client_error(
        self, ex: Exchange, upstream: Upstream, resp_up: Response
    ) -> web.Response:
        """An upstream 4xx that is the client's fault, passed through in OpenAI's shape."""
        limit = self._runtime.config.limits.max_response_bytes
        raw = await _read_all(resp_up, ex.watchdog, limit)
        # Scrubbed after decoding: a key spelled with JSON escapes is caught too.
        shaped = normalize_error(raw, resp_up.status).decode()
        return web.Response(
            status=resp_up.status,
            body=self._scrub(upstream, shaped).encode(),
            content_type=_JSON,
            headers=ex.headers(),
        )

    async def _json_answer(
        self, ex: Exchange, att: Attempt, upstream: Upstream, resp_up: Response
    ) -> web.Response:
        """A complete (non-streamed) success, unless its body says otherwise (SPEC §6: an
        error inside an HTTP 200, or not a JSON object at all: `AttemptError`)."""
        status = resp_up.status
        limit = self._runtime.config.limits.max_response_bytes
        raw = await _read_all(resp_up, ex.watchdog, limit)
        try:
            err, att.usage = inspect_body(raw)
        except NotJson as exc:
            raise AttemptError(f"{upstream.name}: {exc}", status=status) from None
        if err is not None:
            raise AttemptError(f"{upstream.name}: {self._scrub(upstream, err)}", status=status)
        if ex.has_objective:
            # SPEC §17: met iff the whole answer came within the objectives, from arrival.
            tokens = _count(att.usage.get("completion_tokens")) if att.usage else None
            ex.slo = ex.slo_result = slo.judge_answer(
                ex.slo_ttft_ms, ex.slo_tpot_ms, time.monotonic() - ex.started, tokens
            )
        if ex.span is not None and ex.span.recording:
            ex.span.finish_reasons = finish_reasons(raw)  # gen_ai.response.finish_reasons
        # Always JSON, whatever the upstream labelled it: the gateway's origin never serves
        # an upstream's text/html.
        return web.Response(status=status, body=raw, content_type=_JSON, headers=ex.headers())

    def _after(
        self,
        ex: Exchange,
        att: Attempt,
        pool: Pool,
        upstream: Upstream,
        idx: int,
        outcome: Outcome,
        elapsed: float,
    ) -> None:
        """Bookkeeping of a finished attempt (never raises: it runs in a `finally`)."""
        try:
            if outcome is Outcome.FAILURE and att.error is not None:
                # A failure after the response started (the others are noted by the caller).
                pool.note_error(idx, att.error)
            ex.upstream_ms += elapsed * 1000
            self._metrics.attempt(pool.name, upstream.name, att.ttfb, elapsed, ex.trace_id)
            if att.usage is not None and outcome is Outcome.SUCCESS:
                self._metrics.used_tokens(
                    pool.name, upstream.name, att.usage, ex.key_name or NO_KEY
                )
        except Exception:
            log.exception("attempt bookkeeping failed")

    async def _relay_stream(
        self,
        request: web.BaseRequest,
        ex: Exchange,
        att: Attempt,
        resp_up: Response,
        upstream: Upstream,
        started: float,
        deadline: float,
        pool: Pool,
        ticket: int,
    ) -> tuple[web.StreamResponse, Outcome]:
        """SSE passed through event by event. Until the first event is written the attempt
        may still be retried (`AttemptError`); after it, a failure ends the stream with an
        error event. The head and the first events go out with the first content token
        (SPEC §17: the instance's TTFT sample, and the TTFT verdict in `X-Gateway-SLO`)."""
        config = self._runtime.config
        checker = SseChecker(config.limits.max_event_bytes)
        if ex.span is not None and ex.span.recording:
            checker.finish_reasons = []  # gen_ai.response.finish_reasons, read as events pass
        idle = config.timeouts.stream_idle_ms / 1000
        src = _Source(resp_up, upstream, checker, ex.watchdog, idle, deadline)
        try:
            out, ended = await self._first_events(src, att, started)
            # The events before the first content one (the role chunk): not tokens.
            held = checker.data_events - (1 if att.first_token_at is not None else 0)
        except MalformedEvent as err:
            raise AttemptError(f"{upstream.name}: {err}") from None
        first_at = att.first_token_at
        if first_at is not None:
            pool.first_token(ticket)
            if ex.has_objective:
                ex.slo = slo.judge_first_token(
                    ex.slo_ttft_ms, ex.slo_tpot_ms, first_at - ex.started
                )
        resp = _EventStream(status=200, headers=_stream_headers(ex))
        failure: tuple[str, str] | None = None
        last = b""  # the stream's last events, written with its end in one piece
        try:
            # Inside the `try`: a client that left while its first token was awaited is gone
            # by the time the head is written ("Cannot write to closing transport").
            await resp.prepare(request)
            if ended:
                last = self._scrub_events(upstream, out, checker)
            else:
                await resp.write(self._scrub_events(upstream, out, checker))
                last = await self._relay_after_first(request, src, resp)
        except asyncio.CancelledError:
            if self.hard_stopped:
                with contextlib.suppress(Exception):
                    await resp.write(sse_error_event("draining", "The gateway shut down."))
                    await resp.write_eof()
            raise
        except ConnectionResetError:
            # The client left mid-stream (or before its head went out): nothing to tell it;
            # the upstream is closed after.
            return resp, _client_left(ex)
        except Exception as exc:
            failure = _stream_failure(ex, exc)
        att.usage = checker.usage
        # The content events, where no `usage` says the tokens: every data event after the
        # held ones but the `[DONE]` (one token each, as vLLM and OpenAI stream them).
        att.tokens = max(0, checker.data_events - held - (1 if checker.done else 0))
        if ex.span is not None and checker.finish_reasons:
            ex.span.finish_reasons = checker.finish_reasons
        outcome = await _end_stream(ex, att, resp, checker, failure, last)
        if outcome is Outcome.SUCCESS and ex.has_objective and first_at is not None:
            # SPEC §17: the stream's whole verdict (TTFT and TPOT), for the metric and the log.
            tokens = _output_tokens(att)
            ex.slo_result = slo.final_verdict(
                ex.slo_ttft_ms,
                ex.slo_tpot_ms,
                first_at - ex.started,
                time.monotonic() - first_at,
                tokens,
            )
        return resp, outcome

    async def _relay_after_first(
        self, request: web.BaseRequest, src: _Source, resp: web.StreamResponse
    ) -> bytes:
        """The rest of a stream after its first event: spliced when the client's response is
        HTTP/1.1 chunked and uncompressed, read piece by piece otherwise. Returns the last
        events (those with `[DONE]`, or left at the body's end), not yet written: they go
        out with the stream's end."""
        transport = request.transport
        # aiohttp frames the body as chunks on HTTP/1.1 (its writer says so): the splice
        # writes the same framing itself; anything else takes the plain loop.
        writer = getattr(resp, "_payload_writer", None)
        chunked = writer is not None and getattr(writer, "chunked", False) is True
        if chunked and transport is not None and not resp.compression:
            return await self._splice_rest(src, resp, transport)
        return await self._relay_rest(src, resp)

    async def _first_events(self, src: _Source, att: Attempt, started: float) -> tuple[bytes, bool]:
        """Reads until the stream's first content token (nothing is sent to the client
        before, so a stream that fails here is retried like any attempt): (the events, whether
        the stream already ended). Raises `AttemptError` or `MalformedEvent`.

        SPEC §17: a role-only first chunk is held until the first content delta, which is
        when the instance's first token came (vLLM may send its head and role at once: that
        is not the TTFT); `att.first_token_at` records it. What is held is bounded by
        `limits.max_event_bytes`; an error event, the stream's end or an event of another
        shape ends the hold too."""
        resp_up, upstream, checker = src.resp, src.upstream, src.checker
        watchdog, idle, deadline = src.watchdog, src.idle, src.deadline
        first = True
        held: list[bytes] = []
        size = 0
        while True:
            chunk = await _read_chunk(resp_up, watchdog, idle, deadline)
            if first:
                # For a stream, the first byte a user feels is the first chunk, not the head.
                att.ttfb = watchdog.loop.time() - started
                first = False
                reported = upstream_error_of(chunk) if chunk.lstrip()[:1] == b"{" else None
                if reported is not None:
                    reason = self._scrub(upstream, reported)
                    raise AttemptError(f"{upstream.name}: {reason}")
            if not chunk:
                return b"".join(held) + checker.finish(), True
            out = checker.feed(chunk)
            if out:
                held.append(out)
                size += len(out)
                content = _has_content(out)
                if content:
                    att.first_token_at = time.monotonic()
                if (
                    content
                    or checker.done
                    or checker.upstream_error is not None
                    or size > checker.max_event_bytes
                ):
                    return b"".join(held), checker.done

    async def _relay_rest(self, src: _Source, resp: web.StreamResponse) -> bytes:
        """A token stream after its first event, read piece by piece (a client the splice
        cannot serve: not HTTP/1.1 chunked). Ends at `[DONE]` (nothing after it is relayed)
        or the body's end; returns the last events, unwritten."""
        resp_up, upstream, checker = src.resp, src.upstream, src.checker
        watchdog, idle, deadline = src.watchdog, src.idle, src.deadline
        write, scrub = resp.write, self._scrub_events
        while True:
            chunk = await _read_chunk(resp_up, watchdog, idle, deadline)
            if not chunk:
                out = checker.finish()
                return scrub(upstream, out, checker) if out else b""
            out = checker.feed(chunk)
            if checker.done:
                return scrub(upstream, out, checker) if out else b""
            if out:
                await write(scrub(upstream, out, checker))

    async def _splice_rest(
        self, src: _Source, resp: web.StreamResponse, transport: asyncio.Transport
    ) -> bytes:
        """The token stream's hot path, after its first event (the headers went out with it):
        the upstream connection's callback checks each piece's events and writes them, framed
        as HTTP chunks, straight to the client's transport — no task switch, future or write
        coroutine per event. The task only waits for the end, a failure, or the client to
        drain (flow control: the upstream is paused while the client's buffer is over
        `_CLIENT_HIGH_WATER`). Same checks and endings as `_relay_rest`; returns the last
        events, unwritten."""
        resp_up, upstream, checker = src.resp, src.upstream, src.checker
        watchdog, idle, deadline = src.watchdog, src.idle, src.deadline
        clock = watchdog.loop.time
        write, buffered = transport.write, transport.get_write_buffer_size
        is_closing = transport.is_closing
        scrub, feed = self._scrub_events, checker.feed
        secret = upstream.secret_bytes
        scrub_key = upstream.scrub if secret else None
        # The token stream's common read: one whole chunk holding one one-line `data:` event
        # (`N\r\ndata: {...}\n\n\r\n`) with nothing the gateway acts on (JSON, no usage, no
        # error, not `[DONE]`, no key), checked in one call (`gateway._core.PlainEvents`, a
        # strict subset of what `sink` relays unchanged). It goes to the client with its
        # framing as it came: no Python per field, no copy. Anything else is `sink`'s.
        events = PlainEvents(resp_up.max_chunk, checker.max_event_bytes, secret)
        plain = events.plain
        last = b""

        def whole(read: bytes) -> bool:
            if checker.pending or is_closing() or not plain(read):
                return False
            watchdog.deadline = min(clock() + idle, deadline)
            write(read)
            if buffered() > _CLIENT_HIGH_WATER:
                resp_up.pause_reading()
            return True

        def sink(data: bytes) -> bool:
            nonlocal last
            if is_closing():
                return False  # the client left; the task learns it from its cancellation
            # `watchdog.arm`, inline: the stream's idle deadline only ever moves later, and
            # the timer armed before the relay re-arms itself for it when it fires.
            watchdog.deadline = min(clock() + idle, deadline)
            out = feed(data)
            if checker.done:
                # `[DONE]`: kept for the stream's end, written with the last chunk in one
                # piece (one send for both, not two).
                last = scrub(upstream, out, checker) if out else b""
                return False
            if out:
                # `_scrub_events`, its common case (no error event) inline
                if checker.error_seen:
                    out = scrub(upstream, out, checker)
                elif scrub_key is not None:
                    out = scrub_key(out)
                write(b"%x\r\n%b\r\n" % (len(out), out))
                if buffered() > _CLIENT_HIGH_WATER:
                    resp_up.pause_reading()
            return True

        writer = getattr(resp, "_payload_writer", None)  # aiohttp's StreamWriter

        async def drain() -> None:
            # aiohttp's writer waits while the client's transport has paused writing (its
            # buffer over the transport's high-water mark) and returns once it resumed.
            if writer is not None:
                await writer.drain()

        watchdog.arm(min(clock() + idle, deadline))
        # A traced stream's events are all read (their finish reasons): `sink` only.
        fast = whole if checker.finish_reasons is None else None
        try:
            ended = await _guarded(
                resp_up.relay(sink, drain, fast), watchdog, _STALLED, "upstream cut the stream"
            )
        finally:
            checker.data_events += events.passed  # the token count, whatever ended the relay
        if is_closing():
            raise ConnectionResetError("the client left")
        if ended:
            out = checker.finish()
            return scrub(upstream, out, checker) if out else b""
        return last

    def _scrub_events(self, upstream: Upstream, out: bytes, checker: SseChecker) -> bytes:
        """Events about to reach the client, without the upstream's key: the raw key is
        replaced wherever it appears; an error event (upstream text that may quote the key in
        any JSON spelling) is rewritten in our own words from its decoded message."""
        if checker.error_seen:
            out = _rewrite_error_events(out, lambda text: self._scrub(upstream, text))
        return upstream.scrub(out)


class _EventStream(web.StreamResponse):
    """A relayed token stream's response: its head goes out with the first events, in one
    write (aiohttp's `StreamResponse` writes the head alone at `prepare`, then each event:
    one more send, and one more wake-up of the client, before its first token)."""

    _send_headers_immediately = False


@dataclass(slots=True)
class _Source:
    """The upstream side of one relayed stream: its response, its instance, the checker of
    its events, and its timeouts. Made once per stream; the relay loops copy what they use
    into locals, so nothing is looked up per event."""

    resp: Response
    upstream: Upstream
    checker: SseChecker
    watchdog: Watchdog
    idle: float
    deadline: float


def _has_content(events: bytes) -> bool:
    """SPEC §17: whether `events` (complete SSE events) hold a content token — a chat delta
    with anything but its role (content, reasoning, tool calls) or a completion's text — or
    anything the hold should not wait past (an error, a shape other than OpenAI's)."""
    for line in events.split(b"\n"):
        if not line.startswith(b"data:"):
            continue
        payload = line[5:].strip()
        if payload == b"[DONE]":
            continue
        try:
            obj = orjson.loads(payload)
        except orjson.JSONDecodeError:
            return True
        if not isinstance(obj, dict) or "error" in obj:
            return True
        choices = obj.get("choices")
        if not isinstance(choices, list):
            return True
        for choice in choices:
            if not isinstance(choice, dict):
                return True
            delta = choice.get("delta")
            if isinstance(delta, dict) and any(v for k, v in delta.items() if k != "role"):
                return True
            if choice.get("text"):
                return True
    return False


def _count(value: Any) -> int | None:
    """A token count from an upstream's `usage`, if it is one (a non-negative int)."""
    ok = isinstance(value, int) and not isinstance(value, bool) and value >= 0
    return value if ok else None


def _output_tokens(att: Attempt) -> int:
    """SPEC §17: the attempt's completion tokens — `usage.completion_tokens`, else the
    stream's counted content events (0: unknown)."""
    if att.usage is not None:
        n = _count(att.usage.get("completion_tokens"))
        if n is not None:
            return n
    return att.tokens


def is_instance_failure(status: int) -> bool:
    """Whether an upstream status is the instance's failure (retried elsewhere, counted
    against it). SPEC §6: 5xx, 408 and 429 are; a redirect is not followed and means a
    misconfigured instance; SPEC §7: an upstream 401/403 means the gateway's key for it is
    wrong, which is not the client's fault."""
    return status >= 500 or status in (401, 403, 408, 429) or 300 <= status < 400


def _stream_headers(ex: Exchange) -> dict[str, str]:
    """The head of a relayed token stream: the exchange's headers and SSE's own."""
    headers = ex.headers()
    headers.update(
        {
            "Content-Type": "text/event-stream; charset=utf-8",
            "Cache-Control": "no-cache",
            "X-Accel-Buffering": "no",
            "X-Content-Type-Options": NOSNIFF,
        }
    )
    return headers


def _client_left(ex: Exchange) -> Outcome:
    """A stream's client left while it was relayed — its head, an event or its end found the
    connection closing before the loop cancelled the request: answered as when the
    cancellation comes first, 499 `client_closed` (counted and logged once by the ingress, as
    the exchange's status), and the attempt is neutral (its slot goes back; the instance's
    model keeps the first token's TTFT and learns nothing from the cut answer). SPEC §3:
    "after any mix of success, failure, timeout, cancellation ... 0 in flight and 0 queued"."""
    ex.status, ex.error = 499, "client_closed"
    return Outcome.NEUTRAL


def _stream_failure(ex: Exchange, exc: Exception) -> tuple[str, str]:
    """A started stream's failure as (error code, reason) for its closing error event."""
    if isinstance(exc, AttemptError):
        return ("upstream_timeout" if exc.timeout else "upstream_error", str(exc))
    if isinstance(exc, MalformedEvent):
        return ("upstream_error", str(exc))
    # A bug of ours mid-stream: the client still gets a proper end, not a cut.
    log.error("stream relay failed", exc_info=exc, extra={"fields": {"id": ex.request_id}})
    return ("internal_error", "the gateway failed while relaying it")


async def _end_stream(
    ex: Exchange,
    att: Attempt,
    resp: web.StreamResponse,
    checker: SseChecker,
    failure: tuple[str, str] | None,
    last: bytes = b"",
) -> Outcome:
    """Ends a started stream (its `last` events written with the end) and says how the
    attempt went."""
    if failure is not None:
        # SPEC §6: "its failure ends the stream with an error event ... never a silent
        # cut, never a fake [DONE]".
        code, why = failure
        ex.error = code
        att.error = f"stream failed: {why}"
        with contextlib.suppress(ConnectionResetError):
            await resp.write(sse_error_event(code, f"The upstream stream failed: {why}."))
            await resp.write_eof()
        return Outcome.FAILURE
    try:
        await resp.write_eof(last)
    except ConnectionResetError:
        return _client_left(ex)  # it left before the stream's end reached it
    if checker.upstream_error is not None:
        # The upstream itself reported an error inside the stream (vLLM does): the client
        # already has that event; the instance failed this request.
        ex.error = "upstream_error"
        att.error = "the upstream sent an error event mid-stream"
        return Outcome.FAILURE
    return Outcome.SUCCESS


def _rewrite_error_events(events: bytes, scrub: Callable[[str], str]) -> bytes:
    """Each `data:` event carrying an `error` becomes `data: {"error": {...}}` in OpenAI's
    shape, built from the decoded (so unescaped) message and scrubbed."""
    out = []
    for event in events.split(b"\n\n"):
        payload = event[5:].strip() if event.startswith(b"data:") else b""
        if payload.startswith(b"{") and b"error" in payload:
            with contextlib.suppress(orjson.JSONDecodeError):
                body = orjson.loads(normalize_error(payload, 502))
                err = body["error"]
                err["message"] = scrub(str(err.get("message") or ""))
                err["code"] = scrub(str(err["code"])) if err.get("code") is not None else None
                err["param"] = None
                event = b"data: " + orjson.dumps(body)
        out.append(event)
    return b"\n\n".join(out)


async def _guarded(aw: Awaitable[T], watchdog: Watchdog, late: str, broken: str) -> T:
    """Awaits `aw` within the deadline the watchdog holds: its expiry becomes a timeout
    `AttemptError`, a connection error a failure one; anyone else's cancellation passes."""
    try:
        return await aw
    except asyncio.CancelledError:
        if watchdog.absorb():
            raise AttemptError(late, timeout=True) from None
        raise
    except BodyTooLarge:
        raise AttemptError("the upstream's response exceeded limits.max_response_bytes") from None
    except OSError as exc:
        raise AttemptError(f"{broken} ({exc})") from None


async def _read_all(resp: Response, watchdog: Watchdog, limit: int) -> bytes:
    """The whole upstream body, within the attempt's deadline and SPEC §16's bound."""
    return await _guarded(
        resp.read(limit),
        watchdog,
        "upstream body did not arrive in time",
        "upstream connection failed",
    )


async def _read_chunk(content: Response, watchdog: Watchdog, idle: float, deadline: float) -> bytes:
    """The next piece of a stream, within the idle timeout and the attempt's total deadline."""
    watchdog.arm(min(watchdog.loop.time() + idle, deadline))
    return await _guarded(content.readany(), watchdog, _STALLED, "upstream cut the stream")
