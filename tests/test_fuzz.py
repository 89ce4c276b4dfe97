"""Fuzzing the gateway's two edges with hypothesis, through the real path.

Upstream: one gateway and one `tests/hostile.py` server per test function; each example
programs the server's answer (status line, framing right/short/long/chunked/close-delimited,
chunk and write splits, junk header bytes, bytes past the message) and sends tagged requests.
Properties: never a 500, never another request's tag, OpenAI-shaped errors, a following
well-behaved answer is still the client's own, and every counter is back to 0.

Ingress: random methods, paths, headers and bodies (valid-ish JSON shapes, nesting up to 1024,
non-UTF-8 bytes), and raw malformed requests over a socket. Properties: never a 500, every
error is OpenAI-shaped JSON with `Content-Type: application/json`, and an error never echoes
the offending header (an Authorization canary).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import pytest
import yarl
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hostile import (
    CLOSE,
    KEEP,
    Answer,
    Conn,
    HostileFactory,
    HostileServer,
    Request,
    ask,
    chunked,
    completion_body,
    head,
    hostile_config,
    new_tag,
    poll,
    settle,
    sse_events,
    tags_in,
)
from support import GatewayFactory, RunningGateway

FUZZ = settings(
    deadline=None,
    database=None,
    suppress_health_check=[
        HealthCheck.function_scoped_fixture,
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
    ],
)

CLIENT_KEY = "sk-client-fuzz-1"
ADMIN_KEY = "sk-admin-fuzz-1"
CANARY = b"sk-canary-123"


@pytest.fixture
async def hostile() -> AsyncIterator[HostileFactory]:
    factory = HostileFactory()
    yield factory
    await factory.close()


def _fuzz_config(server: HostileServer, **extra: Any) -> dict[str, Any]:
    return hostile_config(
        server,
        health={"max_ejection_ms": 300, "ejection_ms": 100},
        timeouts={"first_byte_ms": 500, "stream_idle_ms": 500, "total_ms": 1500},
        retries={"max_attempts": 1},
        limits={"header_timeout_ms": 1000, "body_timeout_ms": 500},
        **extra,
    )


@pytest.fixture
async def upstream_rig(
    hostile: HostileFactory, gateway_factory: GatewayFactory
) -> tuple[RunningGateway, HostileServer]:
    server = await hostile("good")
    return await gateway_factory(_fuzz_config(server)), server


@pytest.fixture
async def ingress_rig(
    hostile: HostileFactory, gateway_factory: GatewayFactory
) -> tuple[RunningGateway, HostileServer]:
    server = await hostile("good")
    auth = {"keys": [{"key": CLIENT_KEY, "name": "fuzz"}], "admin_key": ADMIN_KEY}
    return await gateway_factory(_fuzz_config(server, auth=auth)), server


# ---- upstream fuzzing -------------------------------------------------------------------------

SUPERSCRIPT_200 = "HTTP/1.1 ²00 OK".encode()
VALID_STATUSES = [200] * 6 + [201, 204, 301, 304, 400, 401, 403, 404, 408, 422, 429, 500, 502, 503]
INVALID_LINES = [
    b"HTTP/1.1 099 X",
    b"HTTP/1.1 600 X",
    SUPERSCRIPT_200,
    b"HTTP/1.1 20 OK",
    b"HTTP/2 200",
    b"HTTP/1.1 2000 OK",
    b"HTTP/1.1 -200 OK",
    b"HTTP/1.1 +20 OK",
    b"http/1.1 200 ok",
    b"HTTP/1.1  200 OK",
    b"HTTP/1.1 200",
    b"\x00HTTP/1.1 200 OK",
    b"HTTP/1.1 200 OK\x00\xff",
    b"HTTP/1.1 0x20 OK",
    b"ICY 200 OK",
]


@dataclass(frozen=True)
class Program:
    """One upstream answer, rendered for each request (its tag)."""

    status: int | None  # None: `line` is an invalid status line
    line: bytes
    ctype: str  # auto (JSON or SSE by request), json, sse, html, none
    body_kind: str  # answer, error, garbage, empty
    framing: str  # cl, cl_short, cl_long, chunked, close
    chunk_sizes: tuple[int, ...]
    cuts: tuple[int, ...]  # per-mille positions where the bytes are split into writes
    junk: tuple[bytes, ...]  # raw header lines
    extra_headers: tuple[tuple[bytes, bytes], ...]
    extra: str  # past the message, in the same write: "", junk, response (this request's tag)
    keep: bool

    def clean(self) -> bool:
        """A well-formed 200 answer: the client must get it, with its own tag."""
        return (
            self.status == 200
            and self.ctype == "auto"
            and self.body_kind == "answer"
            and self.framing in ("cl", "chunked", "close")
            and not self.junk
            and not self.extra
            and not self.extra_headers
        )

    def render(self, req: Request, conn: Conn) -> tuple[list[bytes], str]:
        stream = req.stream
        if self.body_kind == "answer":
            body = b"".join(sse_events(req.tag)) if stream else completion_body(req.tag)
        elif self.body_kind == "error":
            body = json.dumps({"error": {"message": f"no {req.tag}", "code": "x"}}).encode()
        elif self.body_kind == "garbage":
            body = b"\x00\xff{garbage " + req.tag.encode()
        else:
            body = b""
        ctype = {
            "auto": "text/event-stream"
            if stream and self.body_kind == "answer"
            else "application/json",
            "json": "application/json",
            "sse": "text/event-stream",
            "html": "text/html",
            "none": "",
        }[self.ctype]
        headers: list[tuple[bytes, bytes]] = []
        if ctype:
            headers.append((b"Content-Type", ctype.encode()))
        headers += list(self.extra_headers)
        keep = self.keep and not self.junk and self.framing not in ("cl_long", "close")
        if self.framing == "cl":
            headers.append((b"Content-Length", b"%d" % len(body)))
            payload = body
        elif self.framing == "cl_short":
            # short of the tag: a reader that trusts the connection afterwards hands the
            # rest (this request's tag) to the next request
            cut = body.find(req.tag.encode()) if req.tag.encode() in body else len(body) - 7
            headers.append((b"Content-Length", b"%d" % max(0, cut)))
            payload = body
        elif self.framing == "cl_long":
            headers.append((b"Content-Length", b"%d" % (len(body) + 7)))
            payload = body
        elif self.framing == "chunked":
            headers.append((b"Transfer-Encoding", b"chunked"))
            payload = chunked(body, self.chunk_sizes)
        else:
            headers.append((b"Connection", b"close"))
            payload = body
        raw_head = head(line=self.line, headers=headers)
        if self.junk:
            first, _, rest = raw_head.partition(b"\r\n")
            raw_head = first + b"\r\n" + b"".join(j + b"\r\n" for j in self.junk) + rest
        tail = b""
        if self.extra == "junk":
            tail = b"\x00junk\xff"
        elif self.extra == "response":
            tail = head(200, [(b"Content-Length", b"%d" % len(body))]) + body
        data = raw_head + payload + tail
        marks = sorted({len(data) * c // 1000 for c in self.cuts} - {0, len(data)})
        writes = [data[a:b] for a, b in zip([0, *marks], [*marks, len(data)], strict=True)]
        return writes, KEEP if keep else CLOSE


_header_byte_line = st.binary(min_size=1, max_size=40).filter(lambda b: b"\r\n\r\n" not in b)
_retry_values = st.sampled_from(
    [b"1", b"0", b"-5", b"1e30", b"inf", b"nan", b"99999999999999999999", b"Wed, 21 Oct 2015"]
) | st.binary(max_size=12).filter(lambda b: b"\r" not in b and b"\n" not in b)


@st.composite
def programs(draw: st.DrawFn) -> Program:
    if draw(st.integers(0, 9)) < 8:
        status: int | None = draw(st.sampled_from(VALID_STATUSES))
        line = f"HTTP/1.1 {status} X".encode()
    else:
        status = None
        line = draw(
            st.sampled_from(INVALID_LINES)
            | st.binary(min_size=1, max_size=20).filter(lambda b: b"\r" not in b and b"\n" not in b)
        )
    extra_headers: tuple[tuple[bytes, bytes], ...] = ()
    if draw(st.booleans()) and draw(st.booleans()):
        name = draw(st.sampled_from([b"Retry-After", b"retry-after-ms"]))
        extra_headers = ((name, draw(_retry_values)),)
    return Program(
        status=status,
        line=line,
        ctype=draw(st.sampled_from(["auto"] * 6 + ["json", "sse", "html", "none"])),
        body_kind=draw(st.sampled_from(["answer"] * 6 + ["error", "garbage", "empty"])),
        framing=draw(
            st.sampled_from(["cl", "cl", "chunked", "chunked", "close", "cl_short", "cl_long"])
        ),
        chunk_sizes=tuple(draw(st.lists(st.integers(1, 80), max_size=8))),
        cuts=tuple(draw(st.lists(st.integers(1, 999), max_size=4))),
        junk=tuple(draw(st.lists(_header_byte_line, max_size=2)))
        if draw(st.integers(0, 4)) == 0
        else (),
        extra_headers=extra_headers,
        extra=draw(st.sampled_from(["", "", "", "", "junk", "response"])),
        keep=draw(st.booleans()),
    )


def _check_any(ans: Answer) -> None:
    """What every answer must be, however broken the upstream."""
    assert ans.status != 500, f"a 500: {ans.describe()}"
    assert ans.cut is None, f"the response broke off: {ans.describe()}"
    assert tags_in(ans.body) <= {ans.tag}, f"another request's tag: {ans.describe()}"
    assert ans.content_type != "text/html", f"served as HTML: {ans.describe()}"
    if ans.status >= 400:
        ans.assert_error()
    if ans.status == 200 and ans.content_type == "text/event-stream":
        events = ans.events
        ends = [
            i
            for i, e in enumerate(events)
            if e == b"data: [DONE]" or e.startswith(b'data: {"error"')
        ]
        assert ends, f"a stream that ends neither with [DONE] nor an error event: {ans.describe()}"
        assert ends[0] == len(events) - 1, (
            f"bytes relayed after the stream's end: {events[ends[0] :]!r}"
        )


@settings(FUZZ, max_examples=300)
@given(program=programs(), streams=st.tuples(st.booleans(), st.booleans(), st.booleans()))
async def test_fuzz_upstream_answers(
    upstream_rig: tuple[RunningGateway, HostileServer],
    program: Program,
    streams: tuple[bool, bool, bool],
) -> None:
    gw, server = upstream_rig
    server.set_mode(("raw", {"render": program.render, "pause": 0.001 if program.cuts else 0}))
    for stream in streams[:2]:
        ans = await ask(gw.session, gw.url, stream=stream, within=6)
        _check_any(ans)
        if program.clean():
            ans.check("ok")
    # whatever the program left on the connections, a good answer is the client's own (once
    # a cooling asked for by a Retry-After in the program, at most max_ejection_ms, is over)
    server.set_mode("good")

    async def own() -> bool:
        # while a 429's Retry-After cools the instance, SPEC §7's 429 answers at once
        ans = await ask(gw.session, gw.url, stream=streams[2], within=6)
        return ans.check("ok", "503", "429") == "ok"

    await poll(own, 3, "a good answer after the program", 0.05)
    await settle(gw, within=3)


@settings(FUZZ, max_examples=150)
@given(
    program=programs(),
    n=st.integers(2, 6),
    stream_mask=st.integers(0, 63),
)
async def test_fuzz_upstream_concurrent(
    upstream_rig: tuple[RunningGateway, HostileServer],
    program: Program,
    n: int,
    stream_mask: int,
) -> None:
    """The same, with several requests at once sharing the keep-alive pool."""
    gw, server = upstream_rig
    server.set_mode(("raw", {"render": program.render}))
    answers = await asyncio.gather(
        *(ask(gw.session, gw.url, stream=bool(stream_mask >> i & 1), within=6) for i in range(n))
    )
    for ans in answers:
        _check_any(ans)
    server.set_mode("good")

    async def own() -> bool:
        ans = await ask(gw.session, gw.url, within=6)
        return ans.check("ok", "503", "429") == "ok"

    await poll(own, 3, "a good answer after the program", 0.05)
    await settle(gw, within=3)


# ---- ingress fuzzing --------------------------------------------------------------------------

_leaf = (
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20)
)
_json = st.recursive(
    _leaf,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=20,
)


DEEP = "__deep__"  # replaced in the serialized body by a nested value (json.dumps would recurse)


def _nested(depth: int, kind: str) -> bytes:
    if kind == "list":
        return b"[" * depth + b'"x"' + b"]" * depth
    return b'{"k":' * depth + b'"x"' + b"}" * depth


_deep = st.just(DEEP)
_message = st.fixed_dictionaries(
    {
        "role": st.sampled_from(["user", "system", "assistant", "tool", "developer", "bogus"])
        | _leaf,
        "content": st.text(max_size=40) | _json | _deep,
    }
)
_bodies = st.fixed_dictionaries(
    {"model": st.sampled_from(["m", "m", "m", "auto", "nope", "", " m", "m\x00"]) | _leaf},
    optional={
        "messages": st.lists(_message, max_size=3) | _json,
        "prompt": st.text(max_size=20) | _json,
        "input": st.text(max_size=20) | _json,
        "stream": st.booleans() | _leaf,
        "stream_options": st.fixed_dictionaries({"include_usage": st.booleans() | _leaf}) | _leaf,
        "max_tokens": st.integers(-5, 2**40) | _leaf,
        "temperature": st.floats(-1, 3, allow_nan=False) | _leaf,
        "n": st.integers(-1, 200) | _leaf,
        "service_tier": st.sampled_from(["priority", "flex", "auto"]) | _leaf,
        "user": _leaf,
        "api_base": st.just("http://169.254.169.254/"),
        "metadata": _json | _deep,
    },
)
_token = st.text(
    alphabet=st.characters(min_codepoint=0x21, max_codepoint=0x7E), min_size=0, max_size=24
)
_headers = st.fixed_dictionaries(
    {},
    optional={
        "Content-Type": st.sampled_from(
            [
                "application/json",
                "application/json; charset=utf-8",
                "application/vnd.api+json",
                "text/plain",
                "application/x-www-form-urlencoded",
                "",
            ]
        ),
        "Authorization": st.sampled_from(
            [f"Bearer {CLIENT_KEY}", "Bearer wrong", "Basic Zm9vOmJhcg==", "Bearer", ""]
        )
        | _token.map(lambda t: f"Bearer {t}"),
        "X-Priority": st.sampled_from(["high", "low", "realtime", "batch", "urgent"]) | _token,
        "X-Complexity": st.sampled_from(["simple", "complex", "hard"]) | _token,
        "X-Request-Id": _token,
        "X-Session-Id": _token,
    },
)


@st.composite
def _payloads(draw: st.DrawFn) -> tuple[bytes, str]:
    """A request body and the tag in it (if any)."""
    tag = new_tag()
    kind = draw(st.sampled_from(["json"] * 5 + ["deep", "bytes", "mangled"]))
    if kind == "deep":
        depth = draw(st.integers(1, 1100))
        return ("[" * depth + "]" * depth).encode(), tag
    if kind == "bytes":
        return draw(st.binary(max_size=200)), tag
    body = draw(_bodies)
    if isinstance(body.get("messages"), list) and body["messages"]:
        first = body["messages"][0]
        if isinstance(first, dict) and isinstance(first.get("content"), str):
            first["content"] += f" {tag}"
    raw = json.dumps(body).encode()
    if DEEP.encode() in raw:
        depth = draw(st.integers(1, 1024))
        raw = raw.replace(
            b'"' + DEEP.encode() + b'"', _nested(depth, draw(st.sampled_from(["list", "dict"])))
        )
    if kind == "mangled":  # non-UTF-8 bytes inside the JSON
        pos = draw(st.integers(0, len(raw)))
        raw = (
            raw[:pos]
            + draw(st.sampled_from([b"\xff", b"\xc3\x28", b"\xed\xa0\x80", b"\x00"]))
            + raw[pos:]
        )
    return raw, tag


def _check_ingress(status: int, ctype: str, body: bytes, method: str = "POST") -> None:
    assert status != 500, f"a 500: {body[:300]!r}"
    if status >= 400 and method != "HEAD":
        assert ctype.split(";")[0].strip() == "application/json", (status, ctype, body[:200])
        data = json.loads(body)
        assert isinstance(data, dict) and isinstance(data.get("error"), dict), body[:200]
        assert set(data["error"]) >= {"message", "type", "param", "code"}, body[:200]


@settings(FUZZ, max_examples=500)
@given(
    payload=_payloads(),
    headers=_headers,
    path=st.sampled_from(["/v1/chat/completions"] * 4 + ["/v1/completions", "/v1/embeddings"]),
)
async def test_fuzz_ingress_bodies_and_headers(
    ingress_rig: tuple[RunningGateway, HostileServer],
    payload: tuple[bytes, str],
    headers: dict[str, str],
    path: str,
) -> None:
    gw, _ = ingress_rig
    body, tag = payload
    try:
        async with asyncio.timeout(6):
            async with gw.session.post(gw.url + path, data=body, headers=headers) as resp:
                data = await resp.read()
                status, ctype = resp.status, resp.headers.get("Content-Type", "")
    except TimeoutError:
        raise AssertionError(f"no answer (hang) to {body[:100]!r} {headers}") from None
    _check_ingress(status, ctype, data)
    assert tags_in(data) <= {tag}, data[:300]
    await settle(gw, within=3)


_methods = st.sampled_from(["GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "HEAD", "FOO"])
_paths = st.sampled_from(
    [
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/embeddings",
        "/v1/models",
        "/livez",
        "/healthz",
        "/readyz",
        "/metrics",
        "/admin/state",
        "/admin/reload",
        "/dashboard",
        "/",
        "/v1",
        "/v1/chat/completions/",
        "//v1/chat/completions",
        "/v1/../admin/state",
        "/%2e%2e/admin/state",
        "/v1/files",
        "/v1/batches",
    ]
) | _token.map(lambda t: "/" + t.replace("?", "").replace("#", ""))


@settings(FUZZ, max_examples=300)
@given(method=_methods, path=_paths, body=st.binary(max_size=64), query=_token)
async def test_fuzz_ingress_methods_and_paths(
    ingress_rig: tuple[RunningGateway, HostileServer],
    method: str,
    path: str,
    body: bytes,
    query: str,
) -> None:
    gw, _ = ingress_rig
    url = gw.url + path + ("?" + query.replace("#", "") if query else "")
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {CLIENT_KEY}"}
    async with asyncio.timeout(6):
        async with gw.session.request(
            method, yarl.URL(url, encoded=True), data=body or None, headers=headers
        ) as resp:
            data = await resp.read()
            _check_ingress(resp.status, resp.headers.get("Content-Type", ""), data, method)
    await settle(gw, within=3, counted=0)  # an unrouted request need not be counted


# ---- raw malformed requests -------------------------------------------------------------------


async def _raw_exchange(port: int, payload: bytes, within: float = 4.0) -> bytes | None:
    """Sends raw bytes; returns the first response (head + body) or None if the server
    closed without answering. Fails on a hang."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    data = b""
    try:
        writer.write(payload)
        await writer.drain()
        async with asyncio.timeout(within):
            while True:
                piece = await reader.read(65536)
                if not piece:
                    break
                data += piece
                if _complete(data):
                    break
    except TimeoutError:
        raise AssertionError(f"no answer (hang) to {payload[:200]!r}; got {data[:200]!r}") from None
    except ConnectionResetError:
        pass
    finally:
        writer.close()
    return data or None


def _complete(data: bytes) -> bool:
    head_, sep, body = data.partition(b"\r\n\r\n")
    if not sep:
        return False
    for line in head_.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return len(body) >= int(value.strip() or 0)
        if name.strip().lower() == b"transfer-encoding" and b"chunked" in value.lower():
            return body.endswith(b"0\r\n\r\n")
    return False


def _parse(data: bytes) -> tuple[int, dict[str, str], bytes]:
    head_, _, body = data.partition(b"\r\n\r\n")
    lines = head_.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ")
    assert len(parts) >= 2 and parts[1].isdigit(), f"not an HTTP response: {data[:200]!r}"
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    if "chunked" in headers.get("transfer-encoding", ""):
        out, rest = b"", body
        while rest:
            size_line, _, rest = rest.partition(b"\r\n")
            size = int(size_line.split(b";")[0], 16)
            if size == 0:
                break
            out, rest = out + rest[:size], rest[size + 2 :]
        body = out
    return int(parts[1]), headers, body


def _check_raw(answer: bytes | None, method: bytes = b"POST") -> None:
    if answer is None:
        return  # closed without an answer: acceptable for garbage
    assert CANARY not in answer, f"the offending header is echoed: {answer[:400]!r}"
    status, headers, body = _parse(answer)
    _check_ingress(status, headers.get("content-type", ""), body, method.decode("latin-1"))


BAD_BYTES = [b"\xff", b"\x00", b"\x7f", b"\xc3\x28", b"\x01", b"\x1b[31m", b"\r", b"\xe2\x80\xae"]
GOOD_BODY = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]}).encode()


@pytest.mark.parametrize("bad", BAD_BYTES, ids=lambda b: b.hex())
@pytest.mark.parametrize("path", [b"/v1/chat/completions", b"/admin/state", b"/v1/models"])
async def test_malformed_authorization_is_not_echoed(
    ingress_rig: tuple[RunningGateway, HostileServer], bad: bytes, path: bytes
) -> None:
    gw, _ = ingress_rig
    port = int(gw.url.rsplit(":", 1)[1])
    method = b"POST" if path.endswith(b"completions") else b"GET"
    body = GOOD_BODY if method == b"POST" else b""
    payload = (
        method + b" " + path + b" HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Authorization: Bearer " + CANARY + bad + b"\r\n"
        b"Content-Length: %d\r\nConnection: close\r\n\r\n" % len(body)
    ) + body
    answer = await _raw_exchange(port, payload)
    _check_raw(answer, method)
    if answer is not None:
        status, _, _ = _parse(answer)
        assert status in (400, 401), answer[:300]
    await settle(gw, counted=0)


_raw_line = st.binary(max_size=40).filter(lambda b: b"\r\n" not in b)


@st.composite
def _raw_requests(draw: st.DrawFn) -> tuple[bytes, bytes]:
    method = draw(st.sampled_from([b"POST", b"GET", b"PUT", b"post", b"P\xd6ST", b""]) | _raw_line)
    target = draw(
        st.sampled_from(
            [b"/v1/chat/completions", b"/admin/state", b"*", b"http://x/v1/models", b"/\xff", b""]
        )
        | _raw_line
    )
    version = draw(st.sampled_from([b"HTTP/1.1", b"HTTP/1.0", b"HTTP/2", b"HTTP/1.1 x", b""]))
    lines = [b"Host: x"]
    lines += draw(
        st.lists(
            st.sampled_from(
                [
                    b"Content-Type: application/json",
                    b"Authorization: Bearer " + CANARY + b"\xff",
                    b"Authorization: Bearer " + CANARY + b"\x00",
                    b"Authorization : Bearer " + CANARY,
                    b"Authorization: Bearer " + CANARY + b"\r\n continued",
                    b"X-Priority: \xffhigh",
                    b"Transfer-Encoding: chunked",
                    b"Content-Length: 5",
                    b"Content-Length: -1",
                    b"Content-Length: 1, 2",
                    b"\x00: \x00",
                    b"no colon here",
                    b": empty name",
                    b"X-Long: " + b"a" * 20000,
                ]
            )
            | _raw_line,
            max_size=5,
        )
    )
    body = draw(st.sampled_from([GOOD_BODY, b"", b"{", b"\xff\xfe"]) | st.binary(max_size=64))
    payload = method + b" " + target + b" " + version + b"\r\n"
    payload += b"".join(line + b"\r\n" for line in lines)
    payload += b"Content-Length: %d\r\nConnection: close\r\n\r\n" % len(body) + body
    return payload, method


@settings(FUZZ, max_examples=400)
@given(request=_raw_requests())
async def test_fuzz_ingress_raw_malformed_requests(
    ingress_rig: tuple[RunningGateway, HostileServer], request: tuple[bytes, bytes]
) -> None:
    gw, _ = ingress_rig
    port = int(gw.url.rsplit(":", 1)[1])
    payload, method = request
    _check_raw(await _raw_exchange(port, payload), method)
    await settle(gw, within=3, counted=0)


async def test_rigs_serve(
    upstream_rig: tuple[RunningGateway, HostileServer],
    ingress_rig: tuple[RunningGateway, HostileServer],
) -> None:
    """The fuzz rigs themselves work: a plain request is served, with and without auth."""
    gw, _ = upstream_rig
    (await ask(gw.session, gw.url)).check("ok")
    gw, _ = ingress_rig
    (await ask(gw.session, gw.url)).check("4xx")
    auth = {"Authorization": f"Bearer {CLIENT_KEY}"}
    (await ask(gw.session, gw.url, headers=auth)).check("ok")
    await settle(gw)
