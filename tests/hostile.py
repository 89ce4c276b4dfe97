"""A hostile upstream for tests: a raw asyncio HTTP/1.1 server that breaks the rules on purpose.

The gateway must treat its backends as untrusted (SPEC §16): a backend that breaks HTTP framing,
sends absurd headers, endless bodies or garbage may cost its own connection and request, never
another request's data, a slot, unbounded memory or the prober. `HostileServer` is that backend.

    server = await hostile("extra_after_cl")       # the `hostile` fixture of the test modules
    config = hostile_config(server)                 # one pool `p`, alias `m`
    server.set_mode("good")                         # every later request
    server.script("bad_status", "good")             # the next two requests, then the mode
    server.set_probe(("bad_status", {"line": b"HTTP/1.1 \xc2\xb200 OK"}))   # GET requests

It reads HTTP/1.1 requests (keep-alive, `Content-Length` or chunked bodies) and answers each
according to a *behaviour*: an async callable `(request, conn) -> KEEP | CLOSE | HOLD` that
writes whatever it likes on the connection. `MODES` names one behaviour factory per failure
class; a spec is a mode name, `(name, {options})` or a behaviour itself. POST requests get the
mode (or the next scripted behaviour); GET requests (health probes) get the probe behaviour.

**Tags.** A test puts a unique tag (`new_tag()`, `tag-<32 hex>`) in its prompt; every
well-behaved answer echoes the request's tag in the completion's content and in every SSE
content delta, so a test can check that each client got its own answer and nobody else's
(`tags_in(body) == {tag}`). Hostile answers that carry *another* answer (response crossing)
use `decoy_tag()`: the tag of an earlier request, which some other client is waiting for.

The second half of the module holds the client-side helpers shared by the hostile and fuzz
suites: `ask()` (one bounded request through the gateway), `Answer` and its checks, the
metrics reader, a bounded `poll()` and the RSS sampler.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import inspect
import itertools
import json
import re
import time
import urllib.parse
import uuid
from collections import Counter, deque
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, TypeAlias

import aiohttp

__all__ = [
    "CLOSE",
    "HOLD",
    "KEEP",
    "MODES",
    "UPSTREAM_KEY",
    "Answer",
    "Conn",
    "HostileFactory",
    "HostileServer",
    "Request",
    "RssSampler",
    "ask",
    "behaviour",
    "chunked",
    "completion_body",
    "count_status",
    "framed",
    "head",
    "hostile_config",
    "instance",
    "merge",
    "models_body",
    "new_tag",
    "poll",
    "rss_bytes",
    "settle",
    "sse_events",
    "tags_in",
]

KEEP = "keep"  # read the next request on this connection
CLOSE = "close"  # close the connection
HOLD = "hold"  # keep the connection open, read and ignore whatever comes, until the peer leaves

#: The upstream API key every instance of these suites is configured with. It must never reach
#: a client, a log line, /admin/state or /metrics (SPEC §7).
UPSTREAM_KEY = "sk-upstream-canary-5e1f0c9a7b"

TAG_RE = re.compile(rb"tag-[0-9a-f]{32}")
JSON_CT = b"application/json"
SSE_CT = b"text/event-stream"
MODEL = "up-model"


def new_tag() -> str:
    return f"tag-{uuid.uuid4().hex}"


def tags_in(data: bytes) -> set[str]:
    """Every tag in `data`."""
    return {m.decode() for m in TAG_RE.findall(data)}


# ---- requests and connections ----------------------------------------------------------------


@dataclass(eq=False)
class Request:
    """One request as the hostile server read it."""

    method: str
    target: str
    headers: dict[str, str]  # lower-case names, latin-1 decoded values
    body: bytes
    serial: int  # order of arrival at this server, from 0
    conn_id: int
    index_on_conn: int

    @property
    def path(self) -> str:
        return self.target.split("?", 1)[0]

    @property
    def tag(self) -> str:
        found = TAG_RE.search(self.body)
        return found.group().decode() if found else ""

    @property
    def data(self) -> Any:
        try:
            return json.loads(self.body)
        except ValueError:
            return None

    @property
    def stream(self) -> bool:
        data = self.data
        return isinstance(data, dict) and data.get("stream") is True

    @property
    def is_probe(self) -> bool:
        return self.method == "GET"

    @property
    def authorization(self) -> str:
        return self.headers.get("authorization", "")


class Conn:
    """The server side of one client connection."""

    def __init__(
        self,
        server: HostileServer,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        conn_id: int,
    ) -> None:
        self.server = server
        self.reader = reader
        self.writer = writer
        self.id = conn_id
        self.requests = 0

    @property
    def closing(self) -> bool:
        return self.writer.is_closing()

    async def send(self, *parts: bytes) -> None:
        """Writes `parts` as one write; raises ConnectionResetError once the peer is gone."""
        if self.writer.is_closing():
            raise ConnectionResetError("peer gone")
        self.writer.write(b"".join(parts))
        await self.writer.drain()

    async def send_pieces(self, pieces: Iterable[bytes], pause: float = 0.0) -> None:
        """One write per piece, `pause` seconds apart (0: just yield between them)."""
        for piece in pieces:
            await self.send(piece)
            await asyncio.sleep(pause)

    async def drip(self, data: bytes, interval: float) -> None:
        """One byte per `interval` seconds."""
        for i in range(len(data)):
            await self.send(data[i : i + 1])
            await asyncio.sleep(interval)

    async def stream(
        self, block: bytes, total: int, wrap: Callable[[bytes], bytes] | None = None
    ) -> None:
        """Sends `block` (wrapped, e.g. as a chunk) until `total` bytes of it went out or the
        peer left; honours back-pressure, so a reader that stops reading stops the sender."""
        out = wrap(block) if wrap else block
        sent = 0
        while sent < total:
            await self.send(out)
            sent += len(block)

    def half_close(self) -> None:
        """Shuts down the write side (FIN); the connection stays open for reading."""
        if not self.writer.is_closing() and self.writer.can_write_eof():
            self.writer.write_eof()

    def later(self, delay: float, data: bytes, event: str) -> None:
        """Writes `data` unsolicited `delay` seconds from now (if the connection is still
        open), then counts `event` in the server's events (`<event>_scheduled` when asked,
        `<event>_skipped` if the connection was gone by then)."""

        self.server.events[event + "_scheduled"] += 1

        async def job() -> None:
            await asyncio.sleep(delay)
            if not self.writer.is_closing():
                self.writer.write(data)
                self.server.events[event] += 1
            else:
                self.server.events[event + "_skipped"] += 1

        self.server.spawn(job())

    def abort(self) -> None:
        transport = self.writer.transport
        if not transport.is_closing():
            transport.abort()


Behaviour: TypeAlias = Callable[[Request, Conn], Awaitable[str]]
Spec: TypeAlias = "str | tuple[str, dict[str, Any]] | Behaviour"

#: mode name -> factory(**options) -> behaviour
MODES: dict[str, Callable[..., Behaviour]] = {}


def mode(name: str) -> Callable[[Callable[..., Behaviour]], Callable[..., Behaviour]]:
    def register(factory: Callable[..., Behaviour]) -> Callable[..., Behaviour]:
        MODES[name] = factory
        return factory

    return register


def behaviour(spec: Spec) -> Behaviour:
    """A behaviour from a spec: a mode name, `(name, {options})`, or a behaviour."""
    if isinstance(spec, str):
        return MODES[spec]()
    if isinstance(spec, tuple):
        name, options = spec
        return MODES[name](**options)
    return spec


# ---- the server ------------------------------------------------------------------------------


class HostileServer:
    """A raw HTTP/1.1 server on 127.0.0.1 answering by mode; see the module docstring."""

    def __init__(self, spec: Spec = "good", *, probe: Spec = "good") -> None:
        self._mode = behaviour(spec)
        self._probe = behaviour(probe)
        self._script: deque[Behaviour] = deque()
        self._server: asyncio.Server | None = None
        self._conns: set[Conn] = set()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._conn_ids = itertools.count()
        self._serial = itertools.count()
        self._recent_tags: deque[str] = deque(maxlen=64)
        self.port = 0
        self.log: deque[tuple[int, str, str, str, int]] = deque(maxlen=10_000)
        #: counters: requests, probes, chat (POST), connections, answered, plus what modes note
        self.events: Counter[str] = Counter()
        #: exceptions raised by behaviours (bugs in the test, reported at teardown)
        self.errors: list[BaseException] = []

    # lifecycle

    async def start(self) -> HostileServer:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0, limit=1 << 20)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def stop(self) -> None:
        if self._server is None:
            return
        self._server.close()
        for conn in list(self._conns):
            conn.abort()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._server.wait_closed()
        self._server = None

    async def __aenter__(self) -> HostileServer:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    @property
    def url(self) -> str:
        """The OpenAI base URL, an instance's `url`."""
        return f"http://127.0.0.1:{self.port}/v1"

    # programming

    def set_mode(self, spec: Spec) -> None:
        """The behaviour for every later POST request (after the script, if any)."""
        self._mode = behaviour(spec)

    def set_probe(self, spec: Spec) -> None:
        """The behaviour for GET requests (the gateway's health probes)."""
        self._probe = behaviour(spec)

    def script(self, *specs: Spec) -> None:
        """Behaviours for the next POST requests, one each, in order; then the mode again."""
        self._script.extend(behaviour(s) for s in specs)

    def decoy_tag(self, req: Request) -> str:
        """Another request's tag (the latest one seen that is not `req`'s), or a fresh one."""
        for tag in reversed(self._recent_tags):
            if tag and tag != req.tag:
                return tag
        return new_tag()

    def spawn(self, coro: Awaitable[Any]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    @property
    def open_connections(self) -> int:
        return len(self._conns)

    # serving

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        conn = Conn(self, reader, writer, next(self._conn_ids))
        self._conns.add(conn)
        self.events["connections"] += 1
        try:
            while True:
                req = await self._read_request(conn)
                if req is None:
                    break
                if req.is_probe:
                    self.events["probes"] += 1
                    run = self._probe
                else:
                    self.events["chat"] += 1
                    run = self._script.popleft() if self._script else self._mode
                try:
                    action = await run(req, conn)
                except (ConnectionError, asyncio.CancelledError):
                    raise
                except Exception as exc:  # a bug in a behaviour: the test must hear of it
                    self.errors.append(exc)
                    raise ConnectionResetError from exc
                self.events["answered"] += 1
                if action == CLOSE:
                    break
                if action == HOLD:
                    while await reader.read(65536):
                        pass
                    break
        except (
            ConnectionError,
            asyncio.IncompleteReadError,
            asyncio.LimitOverrunError,
            ValueError,
        ):
            pass
        except asyncio.CancelledError:
            pass  # stop(): end quietly (asyncio's stream callback would log a cancelled task)
        finally:
            conn.abort()
            self._conns.discard(conn)
            self._tasks.discard(task)

    async def _read_request(self, conn: Conn) -> Request | None:
        reader = conn.reader
        try:
            raw = await reader.readuntil(b"\r\n\r\n")
        except asyncio.IncompleteReadError:
            return None
        lines = raw[:-4].decode("latin-1").split("\r\n")
        method, target, _ = [*lines[0].split(" ", 2), "", ""][:3]
        headers: dict[str, str] = {}
        for line in lines[1:]:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        if "chunked" in headers.get("transfer-encoding", "").lower():
            parts = []
            while True:
                size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
                if size == 0:
                    while await reader.readuntil(b"\r\n") != b"\r\n":
                        pass
                    break
                parts.append((await reader.readexactly(size + 2))[:-2])
            body = b"".join(parts)
        else:
            length = int(headers.get("content-length") or 0)
            body = await reader.readexactly(length) if length else b""
        req = Request(method, target, headers, body, next(self._serial), conn.id, conn.requests)
        conn.requests += 1
        self.events["requests"] += 1
        self.log.append((req.serial, method, req.path, req.tag, conn.id))
        if req.tag:
            self._recent_tags.append(req.tag)
        return req


class HostileFactory:
    """Starts hostile servers and stops them all at the end (the `hostile` fixture)."""

    def __init__(self) -> None:
        self.started: list[HostileServer] = []

    async def __call__(self, spec: Spec = "good", *, probe: Spec = "good") -> HostileServer:
        server = await HostileServer(spec, probe=probe).start()
        self.started.append(server)
        return server

    async def close(self) -> None:
        for server in self.started:
            await server.stop()
        errors = [e for server in self.started for e in server.errors]
        assert not errors, f"hostile behaviours failed: {errors!r}"


# ---- building answers ------------------------------------------------------------------------


def _b(x: str | bytes) -> bytes:
    return x if isinstance(x, bytes) else x.encode("latin-1")


def head(
    status: int = 200,
    headers: Iterable[tuple[str | bytes, str | bytes]] = (),
    *,
    line: bytes | None = None,
    reason: str = "OK",
    eol: bytes = b"\r\n",
) -> bytes:
    """A response head: status line, headers, blank line (with `eol` as the line end)."""
    first = line if line is not None else f"HTTP/1.1 {status} {reason}".encode()
    out = [first]
    out += [_b(k) + b": " + _b(v) for k, v in headers]
    return eol.join(out) + eol + eol


def chunked(body: bytes, sizes: Iterable[int] = (), trailers: bytes = b"") -> bytes:
    """`body` in chunked framing, cut at `sizes` (the rest in one chunk), then the last
    chunk with `trailers` (header lines, each ending in CRLF)."""
    out = []
    pos = 0
    for size in sizes:
        if pos >= len(body):
            break
        piece = body[pos : pos + max(1, size)]
        out.append(b"%x\r\n%b\r\n" % (len(piece), piece))
        pos += len(piece)
    if pos < len(body):
        out.append(b"%x\r\n%b\r\n" % (len(body) - pos, body[pos:]))
    out.append(b"0\r\n" + trailers + b"\r\n")
    return b"".join(out)


def framed(
    status: int,
    body: bytes,
    ctype: bytes = JSON_CT,
    framing: str = "cl",
    headers: Iterable[tuple[str | bytes, str | bytes]] = (),
    *,
    sizes: Iterable[int] = (),
    reason: str = "OK",
) -> bytes:
    """A whole response: `framing` is `cl`, `chunked` or `close` (delimited by closing)."""
    hs: list[tuple[str | bytes, str | bytes]] = [(b"Content-Type", ctype), *headers]
    if framing == "cl":
        return head(status, [*hs, (b"Content-Length", b"%d" % len(body))], reason=reason) + body
    if framing == "chunked":
        return head(status, [*hs, (b"Transfer-Encoding", b"chunked")], reason=reason) + chunked(
            body, sizes
        )
    if framing == "close":
        return head(status, [*hs, (b"Connection", b"close")], reason=reason) + body
    raise ValueError(framing)


def completion_body(tag: str, *, text: str = "") -> bytes:
    """An OpenAI chat.completion whose content echoes `tag`."""
    content = f"echo {tag}{text}"
    return json.dumps(
        {
            "id": f"chatcmpl-{uuid.uuid4().hex[:12]}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": MODEL,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": content},
                    "logprobs": None,
                    "finish_reason": "stop",
                }
            ],
            "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5},
        }
    ).encode()


def models_body() -> bytes:
    return json.dumps(
        {"object": "list", "data": [{"id": MODEL, "object": "model", "created": 0}]}
    ).encode()


def error_body(message: str, *, code: str | None = "upstream_says_no", etype: str = "") -> bytes:
    return json.dumps(
        {
            "error": {
                "message": message,
                "type": etype or "server_error",
                "param": None,
                "code": code,
            }
        }
    ).encode()


def _chunk_event(tag: str, delta: dict[str, Any], finish: str | None = None) -> bytes:
    obj = {
        "id": "chatcmpl-hostile",
        "object": "chat.completion.chunk",
        "created": int(time.time()),
        "model": MODEL,
        "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}],
    }
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def sse_events(tag: str, n: int = 2, *, done: bool = True) -> list[bytes]:
    """An OpenAI chat stream as events: a role chunk, `n` content chunks each containing
    `tag`, a finish chunk and (if `done`) `[DONE]`."""
    events = [_chunk_event(tag, {"role": "assistant", "content": ""})]
    events += [_chunk_event(tag, {"content": f"{tag} part{i} "}) for i in range(n)]
    events.append(_chunk_event(tag, {}, "stop"))
    if done:
        events.append(b"data: [DONE]\n\n")
    return events


def good_answer(req: Request, framing: str = "auto", tag: str | None = None) -> tuple[bytes, str]:
    """The well-behaved answer to `req` (models list for a probe, an SSE stream for a stream
    request, else a completion) and what to do with the connection after it."""
    tag = req.tag if tag is None else tag
    if req.is_probe:
        body, ctype, auto = models_body(), JSON_CT, "cl"
    elif req.stream:
        body, ctype, auto = b"".join(sse_events(tag)), SSE_CT, "chunked"
    else:
        body, ctype, auto = completion_body(tag), JSON_CT, "cl"
    framing = auto if framing == "auto" else framing
    sizes = [len(e) for e in sse_events(tag)] if ctype == SSE_CT else ()
    data = framed(200, body, ctype, framing, sizes=sizes)
    return data, CLOSE if framing == "close" else KEEP


def answer_body(req: Request, tag: str | None = None) -> tuple[bytes, bytes]:
    """(body, content type) of the good answer to `req`."""
    tag = req.tag if tag is None else tag
    if req.is_probe:
        return models_body(), JSON_CT
    if req.stream:
        return b"".join(sse_events(tag)), SSE_CT
    return completion_body(tag), JSON_CT


# ---- modes: one per failure class ------------------------------------------------------------


@mode("good")
def _good(framing: str = "auto") -> Behaviour:
    """A correct answer (`framing`: auto, cl, chunked or close)."""

    async def run(req: Request, conn: Conn) -> str:
        data, action = good_answer(req, framing)
        await conn.send(data)
        return action

    return run


@mode("raw")
def _raw(
    render: Callable[[Request, Conn], tuple[list[bytes], str]], pause: float = 0.0
) -> Behaviour:
    """Whatever `render(req, conn)` returns: the writes to make, then the action."""

    async def run(req: Request, conn: Conn) -> str:
        writes, action = render(req, conn)
        await conn.send_pieces(writes, pause)
        return action

    return run


@mode("extra_after_cl")
def _extra_after_cl(extra: str = "completion", status: int = 200) -> Behaviour:
    """A correct response followed, in the same write, by extra bytes: a complete second
    response carrying another request's tag (`completion`), a 200 models list (`models`, what
    a probe would take for a pass) or junk (`junk`). The classic response-crossing attack."""

    async def run(req: Request, conn: Conn) -> str:
        if status == 200:
            data, _ = good_answer(req, "cl" if not req.stream else "chunked")
        else:
            data = framed(status, error_body(f"status {status}"), reason="Nope")
        if extra == "completion":
            tail = framed(200, completion_body(conn.server.decoy_tag(req)))
        elif extra == "models":
            tail = framed(200, models_body())
        elif extra == "sse":
            events = b"".join(sse_events(conn.server.decoy_tag(req)))
            tail = framed(200, events, SSE_CT, "chunked")
        else:
            tail = b"\x00\xffjunk after the message\r\n\r\n" * 4
        conn.server.events["extra_sent"] += 1
        await conn.send(data + tail)
        return KEEP

    return run


_GARBAGE = {
    "408": b"HTTP/1.1 408 Request Timeout\r\nContent-Length: 0\r\nConnection: close\r\n\r\n",
    "junk": b"\x16\x03\x01garbage on an idle connection\r\n\r\n",
}


@mode("idle_garbage")
def _idle_garbage(garbage: str = "408", delay: float = 0.02) -> Behaviour:
    """Answers correctly, then `delay` s later sends unsolicited bytes on the idle keep-alive
    connection: a 408 (`408`), junk (`junk`) or a whole 200 completion carrying another
    request's tag (`200`); the connection stays open (and keeps serving)."""

    async def run(req: Request, conn: Conn) -> str:
        data, _ = good_answer(req, "cl" if not req.stream else "chunked")
        if garbage == "200":
            unsolicited = framed(200, completion_body(conn.server.decoy_tag(req)))
        else:
            unsolicited = _GARBAGE[garbage]
        await conn.send(data)
        conn.later(delay, unsolicited, "garbage_sent")
        return KEEP

    return run


@mode("duplicate")
def _duplicate(delay: float = 0.002, echo: bool = False) -> Behaviour:
    """A backend that sends its answer twice: a correct answer, then the very same bytes
    again `delay` s later on the same connection (which stays open and keeps serving). With
    `echo`, each answer carries the request's `X-Request-Id` (vLLM with request-id headers)."""

    async def run(req: Request, conn: Conn) -> str:
        body, ctype = answer_body(req)
        rid = req.headers.get("x-request-id")
        extra = [(b"X-Request-Id", rid)] if echo and rid is not None else []
        framing = "chunked" if req.stream else "cl"
        sizes = [len(e) for e in sse_events(req.tag)] if req.stream else ()
        data = framed(200, body, ctype, framing, extra, sizes=sizes)
        await conn.send(data)
        if not req.is_probe:
            conn.later(delay, data, "duplicate_sent")
        return KEEP

    return run


@mode("loose_chunk")
def _loose_chunk(token: bytes = b"0x2") -> Behaviour:
    """Chunked framing whose first chunk size is a token a lax parser reads as a number
    (`0x2`, `+2`, `2_0` all parse with Python's `int(..., 16)`), with exactly that many
    bytes, so a lax parser succeeds."""

    async def run(req: Request, conn: Conn) -> str:
        body, ctype = answer_body(req)
        n = int(token, 16)
        rest = body[n:]
        data = head(200, [(b"Content-Type", ctype), (b"Transfer-Encoding", b"chunked")])
        data += token + b"\r\n" + body[:n] + b"\r\n"
        data += b"%x\r\n%b\r\n0\r\n\r\n" % (len(rest), rest)
        await conn.send(data)
        return KEEP

    return run


@mode("huge_chunk")
def _huge_chunk(token: bytes = b"FFFFFFFFFFFFFFFF", follow: int = 2 << 20) -> Behaviour:
    """A chunk size of 2**64-1 (or `token`), then `follow` bytes, then the connection is
    held open."""

    async def run(req: Request, conn: Conn) -> str:
        ctype = SSE_CT if req.stream else JSON_CT
        await conn.send(
            head(200, [(b"Content-Type", ctype), (b"Transfer-Encoding", b"chunked")]),
            token + b"\r\n",
        )
        await conn.stream(b"x" * 65536, follow)
        return HOLD

    return run


@mode("bad_status")
def _bad_status(line: bytes = b"HTTP/1.1 600 X") -> Behaviour:
    """An invalid status line (e.g. `HTTP/1.1 099 X`, `HTTP/1.1 600 X`, `HTTP/1.1 ²00 OK`,
    `HTTP/1.1 20 OK`, `HTTP/2 200`) over an otherwise proper response."""

    async def run(req: Request, conn: Conn) -> str:
        body, ctype = answer_body(req)
        data = head(
            line=line, headers=[(b"Content-Type", ctype), (b"Content-Length", b"%d" % len(body))]
        )
        await conn.send(data + body)
        return KEEP

    return run


@mode("garbage")
def _garbage(data: bytes = b"\x00\x01\x02 not http at all \xff\xfe\r\n\r\n") -> Behaviour:
    """Bytes that are not HTTP, then the connection closes."""

    async def run(req: Request, conn: Conn) -> str:
        await conn.send(data)
        return CLOSE

    return run


@mode("bad_headers")
def _bad_headers(kind: str = "bare_lf") -> Behaviour:
    """A head that bends the header grammar, then the connection closes (so a reader that
    falls back to close-delimited framing also ends): `bare_lf` (LF line ends), `obs_fold`
    (a folded header), `space_colon` (`Content-Length : N`), `non_latin1` (UTF-8 and 0xFF
    bytes in a value), `huge` (200 KiB of headers), `many` (10,000 headers)."""

    async def run(req: Request, conn: Conn) -> str:
        body, ctype = answer_body(req)
        cl = b"%d" % len(body)
        base: list[tuple[str | bytes, str | bytes]] = [(b"Content-Type", ctype)]
        if kind == "bare_lf":
            data = head(headers=[*base, (b"Content-Length", cl)], eol=b"\n")
        elif kind == "obs_fold":
            hs = [*base, (b"X-Folded", b"first\r\n  second"), (b"Content-Length", cl)]
            data = head(headers=hs)
        elif kind == "space_colon":
            data = head(headers=[*base, (b"Content-Length ", cl)])
        elif kind == "non_latin1":
            value = "café 中文 ".encode() + b"\xff\xfe\x80"
            data = head(headers=[*base, (b"X-Name", value), (b"Content-Length", cl)])
        elif kind == "huge":
            pad = [(b"X-Pad-%d" % i, b"a" * 1024) for i in range(200)]
            data = head(headers=[*base, *pad, (b"Content-Length", cl)])
        elif kind == "many":
            many = [(b"X-H%d" % i, b"v") for i in range(10_000)]
            data = head(headers=[*base, *many, (b"Content-Length", cl)])
        else:
            raise ValueError(kind)
        await conn.send(data + body)
        return CLOSE

    return run


@mode("cl_te")
def _cl_te(kind: str = "cl_te") -> Behaviour:
    """Ambiguous framing with a smuggled second response (another request's tag) behind the
    message: `cl_te` (Content-Length covering chunked body + smuggled response, and
    Transfer-Encoding: chunked) or `two_cl` (two different Content-Lengths)."""

    async def run(req: Request, conn: Conn) -> str:
        body, ctype = answer_body(req)
        smuggled = framed(200, completion_body(conn.server.decoy_tag(req)))
        if kind == "cl_te":
            encoded = chunked(body)
            hs = [
                (b"Content-Type", ctype),
                (b"Content-Length", b"%d" % (len(encoded) + len(smuggled))),
                (b"Transfer-Encoding", b"chunked"),
            ]
            data = head(headers=hs) + encoded + smuggled
        elif kind == "two_cl":
            hs = [
                (b"Content-Type", ctype),
                (b"Content-Length", b"%d" % len(body)),
                (b"Content-Length", b"%d" % (len(body) + len(smuggled))),
            ]
            data = head(headers=hs) + body + smuggled
        else:
            raise ValueError(kind)
        await conn.send(data)
        return KEEP

    return run


@mode("retry_after")
def _retry_after(
    header: tuple[str, str] = ("Retry-After", "99999999999999999999"), status: int = 503
) -> Behaviour:
    """`status` (503 or 429) with an absurd or invalid Retry-After / retry-after-ms."""

    async def run(req: Request, conn: Conn) -> str:
        body = error_body("slow down", code="overloaded")
        hs = [
            (b"Content-Type", JSON_CT),
            (header[0], header[1]),
            (b"Content-Length", b"%d" % len(body)),
        ]
        await conn.send(head(status, hs, reason="Busy") + body)
        return KEEP

    return run


@mode("upstream_status")
def _upstream_status(status: int = 401) -> Behaviour:
    """An OpenAI-style error answer with `status` (401/403: the gateway's key is wrong)."""

    async def run(req: Request, conn: Conn) -> str:
        body = error_body(
            "Incorrect API key provided.", code="invalid_api_key", etype="invalid_request_error"
        )
        await conn.send(framed(status, body, reason="No"))
        return KEEP

    return run


@mode("echo_key")
def _echo_key(where: str = "500") -> Behaviour:
    """Quotes the Authorization header the gateway sent (its upstream key) back: in an error
    body with status `where` (`400`, `401`, `404`, `429`, `500`, `503`), in a 200 error body
    (`200err`, `qianfan`), in a plain-text 500 (`text500`), in an SSE error event mid-stream
    (`sse_event`), as the first event (`sse_first`), split across two writes (`sse_split`),
    JSON-escaped so only a decoder sees it (`escaped`), in a response header (`header`), or
    encoded in a 400's message, which reaches the client (`base64` of `user:key`,
    `urlencoded`)."""

    async def run(req: Request, conn: Conn) -> str:
        auth = req.authorization  # "Bearer sk-..."
        msg = f"invalid credentials {auth!s} for key {auth.removeprefix('Bearer ')}"
        echo = [(b"X-Echo-Authorization", auth.encode("latin-1"))]
        if where.isdigit():
            body = json.dumps(
                {
                    "error": {
                        "message": msg,
                        "type": "invalid_request_error",
                        "param": auth,
                        "code": auth,
                    }
                }
            ).encode()
            await conn.send(framed(int(where), body, headers=echo, reason="Err"))
            return KEEP
        if where == "200err":
            await conn.send(
                framed(200, json.dumps({"error": {"message": msg, "code": auth}}).encode())
            )
            return KEEP
        if where == "qianfan":
            body = json.dumps({"error_code": 336501, "error_msg": msg}).encode()
            await conn.send(framed(200, body))
            return KEEP
        if where == "text500":
            await conn.send(framed(500, msg.encode(), b"text/plain", headers=echo, reason="Err"))
            return KEEP
        if where == "header":
            data, action = good_answer(req)
            first, sep, rest = data.partition(b"\r\n")
            await conn.send(
                first + sep + b"X-Echo-Authorization: " + auth.encode() + b"\r\n" + rest
            )
            return action
        if where in ("base64", "urlencoded"):
            # the key encoded, as a proxy or an API's debug field quotes a header: base64 of
            # `user:key` (the key at a byte offset inside the encoding), or URL-encoded
            key = auth.removeprefix("Bearer ")
            quoted = (
                base64.b64encode(f"gw:{key}".encode()).decode()
                if where == "base64"
                else urllib.parse.quote(f"{key}/", safe="")
            )
            body = json.dumps({"error": {"message": f"bad credential {quoted}"}}).encode()
            await conn.send(framed(400, body, reason="Err"))
            return KEEP
        if where == "escaped":
            # the key with every '-' as \u002d: raw bytes never contain it, decoded JSON does
            hidden = msg.replace("-", "\\u002d")
            body = b'{"error": {"message": "' + hidden.encode() + b'", "type": "x", "code": null}}'
            await conn.send(framed(400, body, reason="Err"))
            return KEEP
        error_event = (
            b"data: " + json.dumps({"error": {"message": msg, "code": auth}}).encode() + b"\n\n"
        )
        sse_head = head(200, [(b"Content-Type", SSE_CT), (b"Transfer-Encoding", b"chunked")])
        events = sse_events(req.tag, 1, done=False)[:2]
        if where == "sse_first":
            await conn.send(sse_head + chunked(error_event))
            return KEEP
        if where == "sse_event":
            await conn.send(
                sse_head + chunked(b"".join([*events, error_event]), [len(e) for e in events])
            )
            return KEEP
        if where == "sse_split":
            cut = error_event.index(b"canary") + 3  # in the middle of the key
            await conn.send(sse_head + b"".join(b"%x\r\n%b\r\n" % (len(e), e) for e in events))
            await asyncio.sleep(0.05)
            await conn.send(b"%x\r\n%b\r\n" % (cut, error_event[:cut]))
            await asyncio.sleep(0.05)
            await conn.send(b"%x\r\n%b\r\n0\r\n\r\n" % (len(error_event) - cut, error_event[cut:]))
            return KEEP
        raise ValueError(where)

    return run


@mode("huge_body")
def _huge_body(size: int = 200 << 20, framing: str = "cl") -> Behaviour:
    """A 200 whose body is `size` bytes (Content-Length announced up front), sent lazily with
    back-pressure; stops when the peer leaves."""

    async def run(req: Request, conn: Conn) -> str:
        block = b'{"pad": "' + b"x" * 65500 + b'"}\n'
        if framing == "cl":
            hs = [(b"Content-Type", JSON_CT), (b"Content-Length", b"%d" % size)]
            await conn.send(head(200, hs))
            await conn.stream(block, size)
        else:
            await conn.send(head(200, [(b"Content-Type", JSON_CT), (b"Connection", b"close")]))
            await conn.stream(block, size)
        return CLOSE

    return run


@mode("endless_body")
def _endless_body(cap: int = 256 << 20, interval: float = 0.01) -> Behaviour:
    """A chunked body that never ends (up to `cap` bytes): for a stream request, valid SSE
    events carrying the tag every `interval` s; otherwise 64 KiB chunks as fast as read."""

    async def run(req: Request, conn: Conn) -> str:
        if req.stream:
            await conn.send(
                head(200, [(b"Content-Type", SSE_CT), (b"Transfer-Encoding", b"chunked")])
            )
            sent = 0
            for event in itertools.cycle(sse_events(req.tag, 4, done=False)[1:-1]):
                await conn.send(b"%x\r\n%b\r\n" % (len(event), event))
                sent += len(event)
                if sent > cap:
                    break
                await asyncio.sleep(interval)
            return HOLD
        await conn.send(head(200, [(b"Content-Type", JSON_CT), (b"Transfer-Encoding", b"chunked")]))
        await conn.stream(b"[" * 65536, cap, lambda b: b"%x\r\n%b\r\n" % (len(b), b))
        return HOLD

    return run


@mode("sse_no_separator")
def _sse_no_separator(
    size: int = 64 << 20, lead: bool = True, pause: float = 0.05, piece: int = 0
) -> Behaviour:
    """An SSE stream of `data: xxxx` lines with no blank line between them (one endless
    event), `size` bytes; `lead` first sends one proper event and waits `pause` s (so the
    gateway has started relaying the stream when the endless event comes). `piece` > 0
    sends it `piece` bytes per write, yielding between writes, so the gateway reads it in
    many small pieces (what makes a re-scanning or re-copying parser quadratic)."""

    async def run(req: Request, conn: Conn) -> str:
        out = head(200, [(b"Content-Type", SSE_CT), (b"Transfer-Encoding", b"chunked")])
        if lead:
            first = sse_events(req.tag)[1]
            out += b"%x\r\n%b\r\n" % (len(first), first)
        await conn.send(out)
        if lead:
            await asyncio.sleep(pause)
        line = b"data: " + b"x" * 1017 + b"\n"  # 1 KiB
        if not piece:
            await conn.stream(line * 64, size, lambda b: b"%x\r\n%b\r\n" % (len(b), b))
            return CLOSE
        block = (line * (piece // len(line) + 1))[:piece]
        framed_block = b"%x\r\n%b\r\n" % (len(block), block)
        for _ in range(size // piece):
            await conn.send(framed_block)
            await asyncio.sleep(0)
        return CLOSE

    return run


@mode("sse_garbage")
def _sse_garbage(first: bool = False, pause: float = 0.05) -> Behaviour:
    """A stream with a non-JSON `data:` line after two good events (sent `pause` s before
    it, so the stream has started), then more events and `[DONE]`; or the garbage `first`."""

    async def run(req: Request, conn: Conn) -> str:
        events = sse_events(req.tag, 3)
        bad = b"data: {not json at all <html>\n\n"
        at = 0 if first else 2
        events.insert(at, bad)
        pieces = [b"%x\r\n%b\r\n" % (len(e), e) for e in events] + [b"0\r\n\r\n"]
        hs = [(b"Content-Type", SSE_CT), (b"Transfer-Encoding", b"chunked")]
        await conn.send(head(200, hs), *pieces[:at])
        if at:
            await asyncio.sleep(pause)
        await conn.send(*pieces[at:])
        return KEEP

    return run


@mode("paced_sse")
def _paced_sse(special: str = "none", pause: float = 0.005) -> Behaviour:
    """A stream sent the way vLLM paces tokens: every event its own chunk in its own write
    (`pause` s apart), the `special` event after the second content one: `key` (a content
    delta quoting the upstream key), `error` (an error event quoting it), `garbage` (a
    `data:` line that is not JSON), `array` (JSON, not an object), `usage` (a usage chunk
    with 777 completion tokens), `done` (`[DONE]` early, junk events after it) or `none`."""

    async def run(req: Request, conn: Conn) -> str:
        auth = req.authorization
        events = sse_events(req.tag, 3, done=False)
        extra = {
            "none": [],
            "key": [_chunk_event(req.tag, {"content": f"{req.tag} said {auth} "})],
            "error": [
                b"data: "
                + json.dumps({"error": {"message": f"failed for {auth}", "code": auth}}).encode()
                + b"\n\n"
            ],
            "garbage": [b"data: {not json <html>\n\n"],
            "array": [b"data: [1, 2, 3]\n\n"],
            "usage": [
                b'data: {"id":"chatcmpl-hostile","object":"chat.completion.chunk","choices":[],'
                b'"usage":{"prompt_tokens":5,"completion_tokens":777,"total_tokens":782}}\n\n'
            ],
            "done": [b"data: [DONE]\n\n", b'data: {"junk":"after done"}\n\n'],
        }[special]
        events[3:3] = extra
        if special != "done":
            events.append(b"data: [DONE]\n\n")
        hs = [(b"Content-Type", SSE_CT), (b"Transfer-Encoding", b"chunked")]
        pieces = [head(200, hs)] + [b"%x\r\n%b\r\n" % (len(e), e) for e in events]
        await conn.send_pieces([*pieces, b"0\r\n\r\n"], pause)
        return KEEP

    return run


@mode("sse_tail")
def _sse_tail(kind: str = "junk_after_done") -> Behaviour:
    """Streams that go wrong at their end (found by the fuzzer): `junk_after_done` (junk
    bytes after `[DONE]`, close-delimited), `cut_after_done` (Content-Length promises 7 bytes
    more than the events and `[DONE]`, then the connection closes), `not_events` (an SSE
    content type over a JSON error object and junk: no `data:` line, close-delimited)."""

    async def run(req: Request, conn: Conn) -> str:
        events = b"".join(sse_events(req.tag))
        hs: list[tuple[str | bytes, str | bytes]] = [(b"Content-Type", SSE_CT)]
        if kind == "junk_after_done":
            data = head(200, [*hs, (b"Connection", b"close")]) + events + b"\x00junk\xff"
        elif kind == "cut_after_done":
            data = head(200, [*hs, (b"Content-Length", b"%d" % (len(events) + 7))]) + events
        elif kind == "not_events":
            body = error_body(f"no {req.tag}") + b"\x00junk\xff"
            data = head(200, [*hs, (b"Connection", b"close")]) + body
        else:
            raise ValueError(kind)
        await conn.send(data)
        return CLOSE

    return run


@mode("html_200")
def _html_200() -> Behaviour:
    """A 200 `text/html` page (script included) instead of JSON."""

    async def run(req: Request, conn: Conn) -> str:
        page = (
            f"<!doctype html><html><body><script>alert(document.cookie)</script>"
            f"<p>{req.tag}</p></body></html>"
        ).encode()
        await conn.send(framed(200, page, b"text/html; charset=utf-8"))
        return KEEP

    return run


@mode("flood_1xx")
def _flood_1xx(count: int = 5000, line: bytes = b"HTTP/1.1 100 Continue\r\n\r\n") -> Behaviour:
    """`count` informational heads, then the real answer."""

    async def run(req: Request, conn: Conn) -> str:
        data, action = good_answer(req)
        await conn.send(line * count + data)
        return action

    return run


@mode("trailers")
def _trailers() -> Behaviour:
    """A correct chunked answer with trailer fields after the last chunk."""

    async def run(req: Request, conn: Conn) -> str:
        body, ctype = answer_body(req)
        hs = [
            (b"Content-Type", ctype),
            (b"Transfer-Encoding", b"chunked"),
            (b"Trailer", b"X-Checksum"),
        ]
        trailers = b"X-Checksum: abc123\r\nX-Other: yes\r\n"
        await conn.send(head(200, hs) + chunked(body, [7, 30], trailers))
        return KEEP

    return run


@mode("split_status")
def _split_status(pause: float = 0.005) -> Behaviour:
    """A correct answer whose status line goes out one byte per write, `pause` s apart."""

    async def run(req: Request, conn: Conn) -> str:
        data, action = good_answer(req)
        cut = data.index(b"\r\n") + 2
        await conn.send_pieces([data[i : i + 1] for i in range(cut)], pause)
        await conn.send(data[cut:])
        return action

    return run


@mode("gzip_lie")
def _gzip_lie() -> Behaviour:
    """`Content-Encoding: gzip` on a plain body."""

    async def run(req: Request, conn: Conn) -> str:
        body, ctype = answer_body(req)
        hs = [(b"Content-Encoding", b"gzip")]
        framing = "chunked" if req.stream else "cl"
        await conn.send(framed(200, body, ctype, framing, hs))
        return KEEP

    return run


@mode("half_close")
def _half_close() -> Behaviour:
    """Sends the head and part of the body, then shuts its write side down (FIN) and holds
    the connection open for reading."""

    async def run(req: Request, conn: Conn) -> str:
        if req.stream:
            first = sse_events(req.tag)[1]
            hs = [(b"Content-Type", SSE_CT), (b"Transfer-Encoding", b"chunked")]
            await conn.send(head(200, hs) + b"%x\r\n%b\r\n" % (len(first), first))
        else:
            body = completion_body(req.tag)
            hs = [(b"Content-Type", JSON_CT), (b"Content-Length", b"%d" % len(body))]
            await conn.send(head(200, hs) + body[: len(body) // 2])
        conn.half_close()
        return HOLD

    return run


@mode("slow_drip")
def _slow_drip(interval: float = 0.1, head_fast: bool = False) -> Behaviour:
    """The correct answer, one byte per `interval` seconds (`head_fast`: the head at once,
    then the body byte by byte)."""

    async def run(req: Request, conn: Conn) -> str:
        data, action = good_answer(req)
        if head_fast:
            cut = data.index(b"\r\n\r\n") + 4
            await conn.send(data[:cut])
            data = data[cut:]
        await conn.drip(data, interval)
        return action

    return run


@mode("hang")
def _hang() -> Behaviour:
    """Reads the request and never answers."""

    async def run(req: Request, conn: Conn) -> str:
        return HOLD

    return run


# ---- gateway config over hostile servers -----------------------------------------------------


def instance(
    server: HostileServer, name: str | None = None, max_concurrency: int = 4
) -> dict[str, Any]:
    return {
        "name": name or f"h{server.port}",
        "url": server.url,
        "model": MODEL,
        "api_key": UPSTREAM_KEY,
        "max_concurrency": max_concurrency,
    }


def merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    """`base` updated by `extra`, dicts merged recursively."""
    out = dict(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = value
    return out


def hostile_config(
    *servers: HostileServer | tuple[HostileServer, int], **extra: Any
) -> dict[str, Any]:
    """One pool `p` (alias `m`) over `servers`, small timeouts and limits (SPEC §16 knobs),
    a high failure threshold (a hostile answer fails its request, not the instance), probes
    off unless the test starts the gateway with `probes=True`."""
    instances = []
    for item in servers:
        server, maxc = item if isinstance(item, tuple) else (item, 4)
        instances.append(instance(server, max_concurrency=maxc))
    base: dict[str, Any] = {
        "pools": {"p": {"instances": instances}},
        "models": {"m": {"pool": "p"}},
        "health": {
            "failure_threshold": 1000,
            "ejection_ms": 500,
            "max_ejection_ms": 2000,
            "probe": {"interval_ms": 50, "timeout_ms": 300},
        },
        "timeouts": {
            "connect_ms": 1000,
            "first_byte_ms": 1000,
            "stream_idle_ms": 1000,
            "total_ms": 3000,
        },
        "retries": {"max_attempts": 2},
        "limits": {"max_response_bytes": 1 << 20, "max_event_bytes": 64 << 10},
    }
    return merge(base, extra)


# ---- the client side: bounded requests and checks --------------------------------------------


@dataclass
class Answer:
    """What a client got for one request."""

    status: int
    headers: dict[str, str]  # lower-case names
    body: bytes
    elapsed: float
    tag: str = ""
    stream: bool = False
    cut: str | None = None  # the client saw the connection break mid-response
    raw_headers: list[tuple[bytes, bytes]] = field(default_factory=list)

    @property
    def content_type(self) -> str:
        return self.headers.get("content-type", "").split(";", 1)[0].strip().lower()

    @property
    def json(self) -> Any:
        try:
            return json.loads(self.body)
        except ValueError:
            return None

    @property
    def events(self) -> list[bytes]:
        return [e for e in self.body.replace(b"\r\n", b"\n").split(b"\n\n") if e.strip()]

    @property
    def code(self) -> str | None:
        data = self.json
        if isinstance(data, dict) and isinstance(data.get("error"), dict):
            code = data["error"].get("code")
            return code if isinstance(code, str) else None
        return None

    def describe(self) -> str:
        body = self.body if len(self.body) <= 400 else self.body[:120] + b" ... " + self.body[-250:]
        took = f"{self.elapsed:.2f}s"
        return f"HTTP {self.status} {self.content_type} in {took} cut={self.cut} body={body!r}"

    # the checks

    def assert_error(self, *codes: str) -> None:
        """An OpenAI-shaped JSON error (SPEC §7), with one of `codes` if given."""
        assert self.content_type == "application/json", self.describe()
        data = self.json
        assert isinstance(data, dict) and isinstance(data.get("error"), dict), self.describe()
        err = data["error"]
        assert set(err) >= {"message", "type", "param", "code"}, self.describe()
        assert isinstance(err["message"], str) and isinstance(err["type"], str), self.describe()
        if codes:
            assert err["code"] in codes, self.describe()

    def assert_ok(self) -> None:
        """200 carrying its own tag and no other; a stream ends with [DONE]."""
        assert self.status == 200 and self.cut is None, self.describe()
        assert tags_in(self.body) == {self.tag}, f"own {self.tag}: {self.describe()}"
        if self.stream:
            assert self.content_type == "text/event-stream", self.describe()
            assert self.events[-1] == b"data: [DONE]", self.describe()
            for event in self.events[:-1]:
                assert event.startswith(b"data: {"), self.describe()
                json.loads(event[6:])
        else:
            assert self.content_type == "application/json", self.describe()
            content = self.json["choices"][0]["message"]["content"]
            assert self.tag in content, self.describe()

    def assert_stream_error(self) -> None:
        """A started stream ended with an error event: no [DONE], nothing else after it."""
        assert self.status == 200 and self.cut is None, self.describe()
        assert self.content_type == "text/event-stream", self.describe()
        events = self.events
        assert events and events[-1].startswith(b'data: {"error"'), self.describe()
        assert b"[DONE]" not in self.body, self.describe()
        err = json.loads(events[-1][6:])["error"]
        assert set(err) >= {"message", "code"}, self.describe()

    def outcome(self) -> str:
        """Classifies the answer: ok, stream_error, or the status (with the error code)."""
        if self.status == 200 and self.stream and b"[DONE]" not in self.body:
            return "stream_error"
        if self.status == 200:
            return "ok"
        return f"{self.status} {self.code}"

    def check(self, *allowed: str) -> str:
        """The properties every answer has (no 500, no hang, no break, no other request's
        tag, OpenAI-shaped errors) and that its outcome is one of `allowed`: `ok` (200, own
        tag), `stream_error` (a started stream ending in an error event), `502` (upstream_error),
        `504` (upstream_timeout), `503` (with Retry-After), `429` (rate_limited with
        Retry-After: an upstream quota), `4xx` (a passed-through client error, or a 429 where
        `429` is not named). Returns the outcome."""
        assert self.status != 500, f"a 500: {self.describe()}"
        assert self.cut is None, f"the response broke off: {self.describe()}"
        assert tags_in(self.body) <= {self.tag}, f"another request's tag: {self.describe()}"
        assert self.content_type != "text/html", f"served as HTML: {self.describe()}"
        outcome = self.outcome()
        if outcome == "ok":
            assert "ok" in allowed, f"unexpected success: {self.describe()}"
            self.assert_ok()
        elif outcome == "stream_error":
            assert "stream_error" in allowed, f"unexpected stream error: {self.describe()}"
            self.assert_stream_error()
        elif self.status == 502:
            assert "502" in allowed, f"unexpected 502: {self.describe()}"
            self.assert_error("upstream_error")
        elif self.status == 504:
            assert "504" in allowed, f"unexpected 504: {self.describe()}"
            self.assert_error("upstream_timeout")
        elif self.status == 503:
            assert "503" in allowed, f"unexpected 503: {self.describe()}"
            self.assert_error()
            assert int(self.headers.get("retry-after", "0")) >= 1, self.describe()
        elif self.status == 429 and "429" in allowed:
            # SPEC §7: an upstream quota reaches the client as 429 with the time to wait
            self.assert_error("rate_limited")
            assert int(self.headers.get("retry-after", "0")) >= 1, self.describe()
        elif 400 <= self.status < 500:
            assert "4xx" in allowed, f"unexpected {self.status}: {self.describe()}"
            self.assert_error()
        else:
            raise AssertionError(f"unexpected answer: {self.describe()}")
        return outcome


async def ask(
    session: aiohttp.ClientSession,
    base: str,
    tag: str | None = None,
    *,
    stream: bool = False,
    within: float = 10.0,
    model: str = "m",
    headers: dict[str, str] | None = None,
    body: Any = None,
    path: str = "/v1/chat/completions",
) -> Answer:
    """One chat request through the gateway at `base` with a fresh (or given) tag in the
    prompt, bounded by `within` seconds (a hang fails the test, naming it)."""
    tag = tag or new_tag()
    if body is None:
        body = {"model": model, "messages": [{"role": "user", "content": f"say {tag}"}]}
        if stream:
            body["stream"] = True
    t0 = time.monotonic()
    parts: list[bytes] = []
    cut = None
    try:
        async with asyncio.timeout(within):
            async with session.post(base + path, json=body, headers=headers) as resp:
                try:
                    async for piece in resp.content.iter_any():
                        parts.append(piece)
                except (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError) as exc:
                    cut = f"{type(exc).__name__}: {exc}"
                status = resp.status
                hdrs = {k.lower(): v for k, v in resp.headers.items()}
                raw = list(resp.raw_headers)
    except TimeoutError:
        got = b"".join(parts)[:200]
        raise AssertionError(f"no complete answer within {within}s (hang); got {got!r}") from None
    return Answer(status, hdrs, b"".join(parts), time.monotonic() - t0, tag, stream, cut, raw)


async def poll(
    predicate: Callable[[], Awaitable[bool]] | Callable[[], bool],
    within: float,
    what: str,
    every: float = 0.01,
) -> None:
    """Waits until `predicate()` holds, at most `within` seconds (then fails naming `what`)."""
    deadline = time.monotonic() + within
    while True:
        got = predicate()
        if inspect.isawaitable(got):
            got = await got
        if got:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {within}s waiting for {what}")
        await asyncio.sleep(every)


_STATUS_LINE = re.compile(r"^gateway_requests_total\{(?P<labels>[^}]*)\} (?P<value>\S+)$", re.M)


async def count_status(
    session: aiohttp.ClientSession, base: str, code: int | None, admin_key: str | None = None
) -> float:
    """The sum of `gateway_requests_total{...,code="<code>"}` in /metrics (every code: None)."""
    headers = {"Authorization": f"Bearer {admin_key}"} if admin_key else None
    async with session.get(base + "/metrics", headers=headers) as resp:
        assert resp.status == 200
        text = await resp.text()
    total = 0.0
    for m in _STATUS_LINE.finditer(text):
        if code is None or f'code="{code}"' in m.group("labels"):
            total += float(m.group("value"))
    return total


async def settle(gw: Any, within: float = 5.0, counted: int = 1) -> None:
    """After a test: every counter back to 0 (SPEC §3), no 500 ever counted in /metrics, and
    at least `counted` requests counted there at all (so "no 500" is not vacuous)."""
    await gw.assert_quiet(within=within)
    served_500 = await count_status(gw.session, gw.url, 500, gw.admin_key)
    assert served_500 == 0, f"the gateway answered {served_500:.0f} requests with a 500"
    total = await count_status(gw.session, gw.url, None, gw.admin_key)
    assert total >= counted, f"only {total:.0f} requests in gateway_requests_total"


# ---- memory ----------------------------------------------------------------------------------


def rss_bytes() -> int:
    """This process's resident set size (VmRSS)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


class RssSampler:
    """Samples VmRSS every few ms while running: `peak` is the highest seen."""

    def __init__(self, every: float = 0.005) -> None:
        self.every = every
        self.start = rss_bytes()
        self.peak = self.start
        self._task: asyncio.Task[None] | None = None

    async def _run(self) -> None:
        while True:
            self.peak = max(self.peak, rss_bytes())
            await asyncio.sleep(self.every)

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[RssSampler]:
        self._task = asyncio.create_task(self._run())
        try:
            yield self
        finally:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self.peak = max(self.peak, rss_bytes())


# ---- the brief's names for some modes ----------------------------------------------------------

MODES["retry_after_huge"] = _retry_after
MODES["upstream_401"] = lambda: _upstream_status(401)
MODES["upstream_403"] = lambda: _upstream_status(403)
MODES["bare_lf"] = lambda kind="bare_lf": _bad_headers(kind)
MODES["idle_408"] = lambda: _idle_garbage("408")
