"""Hostile backends through the real path (SPEC §6, §7, §16): a backend that breaks HTTP
framing, sends absurd headers, endless bodies or garbage costs at most its own connection and
request — never another request's data, a slot, unbounded memory, a 500, or the prober.

Every test starts the gateway in process over `tests/hostile.py` servers, sends real requests
with a unique tag each, checks what the client got (`Answer.check`: never a 500, never a hang,
never another request's tag, OpenAI-shaped errors), and ends with `settle()`: 0 queued, 0 in
flight, and no 500 counted in /metrics.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import gc
import json
import logging
import math
import time
import urllib.parse
from collections import Counter
from collections.abc import AsyncIterator
from typing import Any

import openai
import pytest

from hostile import (
    UPSTREAM_KEY,
    Answer,
    HostileFactory,
    HostileServer,
    RssSampler,
    ask,
    hostile_config,
    new_tag,
    poll,
    settle,
    tags_in,
)
from support import GatewayFactory, RunningGateway


@pytest.fixture
async def hostile() -> AsyncIterator[HostileFactory]:
    factory = HostileFactory()
    yield factory
    await factory.close()


async def _ask(gw: RunningGateway, **kw: Any) -> Answer:
    return await ask(gw.session, gw.url, **kw)


def _inst(state: dict[str, Any], server: HostileServer) -> dict[str, Any]:
    for inst in state["pools"]["p"]["instances"]:
        if inst["name"] == f"h{server.port}":
            return inst  # type: ignore[no-any-return]
    raise KeyError(server.port)


async def _garbage_landed(server: HostileServer) -> None:
    """Waits until every unsolicited write the server scheduled went out."""
    await poll(
        lambda: (
            server.events["garbage_sent"] + server.events["garbage_sent_skipped"]
            >= server.events["garbage_sent_scheduled"]
        ),
        2.0,
        "the unsolicited bytes to go out",
    )


async def _follow_ups(gw: RunningGateway, server: HostileServer, n: int = 3) -> None:
    """With the server good again, the next requests get their own answers: nothing the
    hostile answer left behind (bytes past a message, a smuggled response) reaches them."""
    server.set_mode("good")
    await _garbage_landed(server)
    for i in range(n):
        (await _ask(gw, stream=i == 1)).check("ok")


# ---- one hostile answer, then good ones -------------------------------------------------------

SUPERSCRIPT_200 = "HTTP/1.1 ²00 OK".encode()

# (id, mode spec, allowed outcomes, max seconds for the hostile answer)
NON_STREAMED: list[tuple[str, Any, set[str], float]] = [
    ("good-cl", "good", {"ok"}, 1.0),
    ("good-chunked", ("good", {"framing": "chunked"}), {"ok"}, 1.0),
    ("good-close", ("good", {"framing": "close"}), {"ok"}, 1.0),
    ("trailers", "trailers", {"ok"}, 1.0),
    ("split_status", "split_status", {"ok"}, 1.5),
    ("gzip_lie", "gzip_lie", {"ok", "502"}, 1.0),
    ("extra_after_cl", "extra_after_cl", {"ok", "502"}, 1.0),
    ("extra_after_cl-junk", ("extra_after_cl", {"extra": "junk"}), {"ok", "502"}, 1.0),
    ("idle_garbage-408", ("idle_garbage", {"garbage": "408"}), {"ok"}, 1.0),
    ("idle_garbage-200", ("idle_garbage", {"garbage": "200"}), {"ok"}, 1.0),
    ("idle_garbage-junk", ("idle_garbage", {"garbage": "junk"}), {"ok"}, 1.0),
    ("loose_chunk-0x2", ("loose_chunk", {"token": b"0x2"}), {"502"}, 1.0),
    ("loose_chunk-plus2", ("loose_chunk", {"token": b"+2"}), {"502"}, 1.0),
    ("loose_chunk-2_0", ("loose_chunk", {"token": b"2_0"}), {"502"}, 1.0),
    ("huge_chunk", "huge_chunk", {"502"}, 2.0),
    ("huge_chunk-overflow", ("huge_chunk", {"token": b"1" + b"0" * 16}), {"502"}, 2.0),
    # SPEC §16: a chunk declared over the response bound fails at once, not at total_ms
    ("huge_chunk-held", ("huge_chunk", {"follow": 100}), {"502"}, 0.5),
    ("duplicate", "duplicate", {"ok"}, 1.0),
    ("bad_status-099", ("bad_status", {"line": b"HTTP/1.1 099 X"}), {"502"}, 1.0),
    ("bad_status-600", ("bad_status", {"line": b"HTTP/1.1 600 X"}), {"502"}, 1.0),
    ("bad_status-superscript", ("bad_status", {"line": SUPERSCRIPT_200}), {"502"}, 1.0),
    ("bad_status-20", ("bad_status", {"line": b"HTTP/1.1 20 OK"}), {"502"}, 1.0),
    ("bad_status-http2", ("bad_status", {"line": b"HTTP/2 200"}), {"502"}, 1.0),
    ("garbage", "garbage", {"502"}, 1.0),
    ("bare_lf", ("bad_headers", {"kind": "bare_lf"}), {"ok", "502"}, 1.0),
    ("obs_fold", ("bad_headers", {"kind": "obs_fold"}), {"ok", "502"}, 1.0),
    ("space_before_colon", ("bad_headers", {"kind": "space_colon"}), {"ok", "502"}, 1.0),
    ("non_latin1_header", ("bad_headers", {"kind": "non_latin1"}), {"ok", "502"}, 1.0),
    ("headers_200KiB", ("bad_headers", {"kind": "huge"}), {"502"}, 1.0),
    ("headers_10000", ("bad_headers", {"kind": "many"}), {"ok", "502"}, 2.0),
    ("cl_te", ("cl_te", {"kind": "cl_te"}), {"ok", "502"}, 1.0),
    ("two_cl", ("cl_te", {"kind": "two_cl"}), {"502"}, 1.0),
    ("upstream_401", "upstream_401", {"502"}, 1.0),
    ("upstream_403", "upstream_403", {"502"}, 1.0),
    ("huge_body-cl", "huge_body", {"502"}, 2.0),
    ("huge_body-close", ("huge_body", {"framing": "close"}), {"502"}, 2.0),
    ("endless_body", "endless_body", {"502"}, 2.0),
    ("flood_1xx", "flood_1xx", {"ok", "502"}, 2.0),
    (
        "flood_103",
        ("flood_1xx", {"line": b"HTTP/1.1 103 Early Hints\r\nLink: </x>; rel=preload\r\n\r\n"}),
        {"ok", "502"},
        2.0,
    ),
    ("half_close", "half_close", {"502"}, 1.0),
    # first_byte_ms is 1 s: the head alone would take seconds at one byte per 100 ms
    ("slow_drip", "slow_drip", {"504"}, 2.5),
    # the body drips: the total deadline (1.5 s here, see ENDED_BY_TOTAL) ends it
    ("slow_drip-body", ("slow_drip", {"head_fast": True}), {"504"}, 2.5),
    ("hang", "hang", {"504"}, 2.5),
]


# Answers only the total deadline ends: theirs is 1.5 s instead of hostile_config's 3 s (the
# other deadlines, 1 s, stay below it), so each costs half the wait.
ENDED_BY_TOTAL = {"slow_drip-body", "endless_sse"}


def _config_for(request: pytest.FixtureRequest, server: HostileServer) -> dict[str, Any]:
    if request.node.callspec.id in ENDED_BY_TOTAL:
        return hostile_config(server, timeouts={"total_ms": 1500})
    return hostile_config(server)


@pytest.mark.parametrize(
    ("spec", "allowed", "max_s"),
    [pytest.param(*case[1:], id=case[0]) for case in NON_STREAMED],
)
async def test_non_streamed(
    hostile: HostileFactory,
    gateway_factory: GatewayFactory,
    request: pytest.FixtureRequest,
    spec: Any,
    allowed: set[str],
    max_s: float,
) -> None:
    server = await hostile(spec)
    gw = await gateway_factory(_config_for(request, server))
    ans = await _ask(gw)
    ans.check(*allowed)
    assert ans.elapsed < max_s, f"took {ans.elapsed:.2f}s: {ans.describe()}"
    await _follow_ups(gw, server)
    await settle(gw)


STREAMED: list[tuple[str, Any, set[str], float]] = [
    ("good", "good", {"ok"}, 1.0),
    ("good-close", ("good", {"framing": "close"}), {"ok"}, 1.0),
    ("trailers", "trailers", {"ok"}, 1.0),
    ("split_status", "split_status", {"ok"}, 1.5),
    ("extra_after_cl", ("extra_after_cl", {"extra": "sse"}), {"ok", "502", "stream_error"}, 1.0),
    ("idle_garbage-200", ("idle_garbage", {"garbage": "200"}), {"ok"}, 1.0),
    ("sse_garbage", "sse_garbage", {"stream_error"}, 1.0),
    ("sse_garbage-first", ("sse_garbage", {"first": True}), {"502", "stream_error"}, 1.0),
    ("sse_no_separator", "sse_no_separator", {"stream_error"}, 2.0),
    (
        "sse_no_separator-nolead",
        ("sse_no_separator", {"lead": False}),
        {"502", "stream_error"},
        2.0,
    ),
    # valid events forever: the total deadline (1.5 s here) ends it with an error event
    ("endless_sse", "endless_body", {"stream_error"}, 2.5),
    ("half_close", "half_close", {"502", "stream_error"}, 1.0),
    ("loose_chunk-2_0", ("loose_chunk", {"token": b"2_0"}), {"502", "stream_error"}, 1.0),
    ("huge_chunk", "huge_chunk", {"502", "stream_error"}, 2.0),
    ("huge_chunk-held", ("huge_chunk", {"follow": 100}), {"502"}, 0.5),
    ("duplicate", "duplicate", {"ok"}, 1.0),
    ("bad_status-superscript", ("bad_status", {"line": SUPERSCRIPT_200}), {"502"}, 1.0),
    ("cl_te", ("cl_te", {"kind": "cl_te"}), {"ok", "502", "stream_error"}, 1.0),
    ("gzip_lie", "gzip_lie", {"ok", "502", "stream_error"}, 1.0),
    ("flood_1xx", "flood_1xx", {"ok", "502"}, 2.0),
    ("upstream_401", "upstream_401", {"502"}, 1.0),
    ("slow_drip", "slow_drip", {"504"}, 2.5),
    ("slow_drip-body", ("slow_drip", {"head_fast": True}), {"504", "stream_error"}, 2.5),
    # found by test_fuzz: nothing may follow [DONE]; a stream with no event is no success
    ("junk_after_done", ("sse_tail", {"kind": "junk_after_done"}), {"ok", "stream_error"}, 1.0),
    ("cut_after_done", ("sse_tail", {"kind": "cut_after_done"}), {"ok", "stream_error"}, 1.0),
    ("not_events", ("sse_tail", {"kind": "not_events"}), {"502", "stream_error"}, 1.0),
]


@pytest.mark.parametrize(
    ("spec", "allowed", "max_s"),
    [pytest.param(*case[1:], id=case[0]) for case in STREAMED],
)
async def test_streamed(
    hostile: HostileFactory,
    gateway_factory: GatewayFactory,
    request: pytest.FixtureRequest,
    spec: Any,
    allowed: set[str],
    max_s: float,
) -> None:
    server = await hostile(spec)
    gw = await gateway_factory(_config_for(request, server))
    ans = await _ask(gw, stream=True)
    ans.check(*allowed)
    assert ans.elapsed < max_s, f"took {ans.elapsed:.2f}s: {ans.describe()}"
    # the garbage is never relayed
    assert b"not json" not in ans.body and b"xxxxxxxx" not in ans.body, ans.describe()
    await _follow_ups(gw, server)
    await settle(gw)


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
async def test_html_200_is_never_served_as_html(
    hostile: HostileFactory, gateway_factory: GatewayFactory, stream: bool
) -> None:
    server = await hostile("html_200")
    gw = await gateway_factory(hostile_config(server))
    ans = await _ask(gw, stream=stream)
    assert ans.status in (200, 502), ans.describe()
    assert ans.content_type != "text/html", ans.describe()
    assert ans.headers.get("x-content-type-options") == "nosniff", ans.describe()
    if ans.status == 200:
        assert ans.content_type == "application/json", ans.describe()
    else:
        ans.assert_error("upstream_error")
    await _follow_ups(gw, server)
    await settle(gw)


async def test_an_endless_sse_event_costs_linear_time(
    hostile: HostileFactory, gateway_factory: GatewayFactory
) -> None:
    """SPEC §16 with a large `max_event_bytes` (16 MiB) and the event arriving in 4 KiB
    pieces: ~4,000 reads before the bound is hit. A parser that re-scans or re-copies the
    pending event on every read does ~32 GB of work here; a linear one ~20 MB."""
    server = await hostile(("sse_no_separator", {"size": 20 << 20, "piece": 4096}))
    config = hostile_config(
        server,
        limits={"max_event_bytes": 16 << 20},
        timeouts={"stream_idle_ms": 20_000, "first_byte_ms": 20_000, "total_ms": 30_000},
    )
    gw = await gateway_factory(config)
    ans = await _ask(gw, stream=True, within=30)
    ans.check("stream_error")
    assert ans.elapsed < 6, f"took {ans.elapsed:.1f}s for a 16 MiB event: quadratic?"
    await _follow_ups(gw, server)
    await settle(gw)


# ---- the official client ----------------------------------------------------------------------


@pytest.mark.parametrize("spec", ["trailers", "split_status", "extra_after_cl", "idle_408"])
async def test_official_client_gets_its_own_answer(
    hostile: HostileFactory, gateway_factory: GatewayFactory, spec: str
) -> None:
    server = await hostile(spec)
    gw = await gateway_factory(hostile_config(server))
    async with openai.AsyncOpenAI(
        base_url=gw.base_url, api_key="k", max_retries=0, timeout=10
    ) as client:
        for _ in range(3):
            tag = new_tag()
            out = await client.chat.completions.create(
                model="m", messages=[{"role": "user", "content": f"say {tag}"}]
            )
            assert tags_in((out.choices[0].message.content or "").encode()) == {tag}
            tag = new_tag()
            stream = await client.chat.completions.create(
                model="m", messages=[{"role": "user", "content": f"say {tag}"}], stream=True
            )
            text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
            assert tag in text and tags_in(text.encode()) == {tag}
            await _garbage_landed(server)
    await settle(gw)


@pytest.mark.parametrize("status", [401, 403])
async def test_upstream_auth_failure_is_a_502_not_the_clients_fault(
    hostile: HostileFactory, gateway_factory: GatewayFactory, status: int
) -> None:
    server = await hostile(("upstream_status", {"status": status}))
    gw = await gateway_factory(hostile_config(server))
    async with openai.AsyncOpenAI(
        base_url=gw.base_url, api_key="k", max_retries=0, timeout=10
    ) as client:
        for stream in (False, True):
            with pytest.raises(openai.APIStatusError) as info:
                await client.chat.completions.create(
                    model="m", messages=[{"role": "user", "content": "x"}], stream=stream
                )
            err = info.value
            assert not isinstance(err, openai.AuthenticationError | openai.PermissionDeniedError), (
                f"the client was told its own key is wrong: {err.status_code} {err.body}"
            )
            assert err.status_code == 502, (err.status_code, err.body)
            assert isinstance(err.body, dict) and err.body.get("code") == "upstream_error"
    await settle(gw)


# ---- response crossing ------------------------------------------------------------------------


async def _crowd(gw: RunningGateway, n: int, width: int, *allowed: str) -> list[str]:
    sem = asyncio.Semaphore(width)

    async def one(i: int) -> str:
        async with sem:
            return (await _ask(gw, stream=i % 3 == 0)).check(*allowed)

    return list(await asyncio.gather(*(one(i) for i in range(n))))


async def test_extra_bytes_after_a_message_never_reach_another_request(
    hostile: HostileFactory, gateway_factory: GatewayFactory
) -> None:
    """Each answer (probes' too) is followed in the same write by a whole second response
    carrying another request's tag. Sequential and concurrent clients, probes every 20 ms on
    the same keep-alive pool: every 200 carries its own tag only."""
    bad = await hostile("extra_after_cl", probe=("extra_after_cl", {"extra": "completion"}))
    good = await hostile("good")
    config = hostile_config(
        bad, good, balancer="round_robin", health={"probe": {"interval_ms": 20}}
    )
    gw = await gateway_factory(config, probes=True)
    outcomes = [(await _ask(gw, stream=i % 4 == 0)).check("ok", "502") for i in range(40)]
    outcomes += await _crowd(gw, 120, 16, "ok", "502")
    assert outcomes.count("ok") >= 0.9 * len(outcomes), outcomes
    assert bad.events["extra_sent"] >= 10 and bad.events["probes"] >= 2, bad.events
    await settle(gw)


@pytest.mark.parametrize("garbage", ["408", "200", "junk"])
async def test_unsolicited_bytes_on_an_idle_connection_never_reach_another_request(
    hostile: HostileFactory, gateway_factory: GatewayFactory, garbage: str
) -> None:
    """After each answer the backend sends, 20 ms later, an unsolicited response (a 408, a
    200 carrying another request's tag) or junk on the idle keep-alive connection. The next
    request is sent once it has landed: it must get its own answer, not the stale bytes."""
    bad = await hostile(("idle_garbage", {"garbage": garbage}))
    good = await hostile("good")
    gw = await gateway_factory(hostile_config(bad, good, balancer="round_robin"))
    for i in range(30):
        (await _ask(gw, stream=i % 4 == 0)).check("ok")
        await _garbage_landed(bad)
    assert bad.events["garbage_sent"] >= 10, bad.events
    if garbage != "200":
        # concurrently (garbage may now race a reused connection; a 408 or junk read as an
        # answer is a failed attempt, retried elsewhere — never someone else's data)
        await _crowd(gw, 100, 16, "ok")
    await settle(gw)


@pytest.mark.parametrize("kind", ["cl_te", "two_cl"])
async def test_smuggled_response_never_reaches_another_request(
    hostile: HostileFactory, gateway_factory: GatewayFactory, kind: str
) -> None:
    bad = await hostile(("cl_te", {"kind": kind}))
    good = await hostile("good")
    gw = await gateway_factory(hostile_config(bad, good, balancer="round_robin"))
    for i in range(20):
        (await _ask(gw, stream=i % 4 == 0)).check("ok", "502", "stream_error")
    await _crowd(gw, 60, 12, "ok", "502", "stream_error")
    await settle(gw)


async def test_probe_never_passes_on_a_shifted_response(
    hostile: HostileFactory, gateway_factory: GatewayFactory
) -> None:
    """Every probe of `bad` is answered 503 followed by a stale `200 OK` models list in the
    same write. A gateway that reuses that connection reads the stale 200 for the next probe
    and lets the instance into half-open; a correct one sees only failed probes, so the
    ejected instance stays out and no real request reaches it."""
    bad = await hostile("good", probe=("extra_after_cl", {"status": 503, "extra": "models"}))
    good = await hostile("good")
    config = hostile_config(
        bad,
        good,
        health={
            "failure_threshold": 1,
            "ejection_ms": 100,
            "success_threshold": 1,
            "probe": {"interval_ms": 20},
        },
    )
    gw = await gateway_factory(config, probes=True)
    await poll(
        lambda: _state_of(gw, bad, "ejected"), 3.0, "the failing probes to eject the instance"
    )
    chat_before = bad.events["chat"]
    probes_before = bad.events["probes"]
    seen = set()
    deadline = time.monotonic() + 1.5
    while time.monotonic() < deadline:
        (await _ask(gw)).check("ok")
        seen.add(_inst(await gw.state(), bad)["state"])
    assert bad.events["probes"] >= probes_before + 10, "the prober stopped"
    assert seen == {"ejected"}, f"a probe passed on a stale response: states seen {seen}"
    assert bad.events["chat"] == chat_before, "an instance whose probes all fail got traffic"
    await settle(gw)


async def _state_of(gw: RunningGateway, server: HostileServer, state: str) -> bool:
    return bool(_inst(await gw.state(), server)["state"] == state)


# ---- the prober survives hostile probe answers ------------------------------------------------


@pytest.mark.parametrize(
    "probe",
    [
        pytest.param(("bad_status", {"line": SUPERSCRIPT_200}), id="superscript-200"),
        pytest.param(("bad_status", {"line": b"HTTP/2 200"}), id="http2"),
        pytest.param(("bad_status", {"line": b"HTTP/1.1 20 OK"}), id="status-20"),
        pytest.param("garbage", id="garbage"),
        pytest.param(("loose_chunk", {"token": b"0x2"}), id="loose-chunk"),
        pytest.param(("bad_headers", {"kind": "huge"}), id="headers-200KiB"),
        pytest.param("half_close", id="half-close"),
    ],
)
async def test_prober_survives_hostile_probe_answers(
    hostile: HostileFactory, gateway_factory: GatewayFactory, probe: Any
) -> None:
    """The probe answer is garbage: the probe fails (the instance is ejected); once the
    server turns good, the instance comes back — the prober did not die on the garbage."""
    server = await hostile("good", probe=probe)
    config = hostile_config(
        server,
        health={
            "failure_threshold": 2,
            "ejection_ms": 200,
            "success_threshold": 1,
            "probe": {"interval_ms": 20, "timeout_ms": 300},
        },
    )
    gw = await gateway_factory(config, probes=True)
    await poll(lambda: _state_of(gw, server, "ejected"), 3.0, "failed probes to eject it")
    server.set_probe("good")
    probes = server.events["probes"]

    async def healthy_again() -> bool:
        ans = await _ask(gw)
        ans.check("ok", "503")
        return await _state_of(gw, server, "healthy")

    await poll(healthy_again, 5.0, "the instance to come back after the probes pass", 0.02)
    assert server.events["probes"] > probes, "the prober died"
    await settle(gw)


# ---- Retry-After clamping: no leaked slot, honest cooling -------------------------------------

MAX_EJECTION_MS = 1000


@pytest.mark.parametrize(
    ("status", "header", "cools"),
    [
        pytest.param(503, ("Retry-After", "99999999999999999999"), True, id="20-digits"),
        pytest.param(503, ("retry-after-ms", "1e30"), True, id="ms-1e30"),
        pytest.param(503, ("retry-after-ms", "inf"), None, id="ms-inf"),
        pytest.param(503, ("retry-after-ms", "nan"), None, id="ms-nan"),
        pytest.param(503, ("Retry-After", "-5"), None, id="negative"),
        pytest.param(503, ("Retry-After", "86400"), True, id="a-day"),
        pytest.param(429, ("Retry-After", "86400"), True, id="429-a-day"),
    ],
)
async def test_retry_after_is_clamped_and_the_instance_comes_back(
    hostile: HostileFactory,
    gateway_factory: GatewayFactory,
    status: int,
    header: tuple[str, str],
    cools: bool | None,
) -> None:
    server = await hostile("good")
    server.script(("retry_after", {"status": status, "header": header}))
    config = hostile_config(
        (server, 1), health={"max_ejection_ms": MAX_EJECTION_MS, "ejection_ms": 300}
    )
    gw = await gateway_factory(config)
    limit_s = math.ceil(MAX_EJECTION_MS / 1000)

    # SPEC §7: a 429 (with or without a usable Retry-After) reaches the client as 429
    # `rate_limited`; a 503 that paused the instance as 503; both with a computed Retry-After
    first = await _ask(gw)
    first.check("502", "503", "4xx")
    if status == 429:
        first.assert_error("rate_limited")
    if first.status in (429, 503):
        assert 1 <= int(first.headers["retry-after"]) <= limit_s, first.describe()
    state = await gw.state()
    inst = _inst(state, server)
    if cools:
        assert inst["state"] == "cooling", inst
    if inst["state"] == "cooling":
        left = inst["cooling_until"] - state["now"]
        assert 0 < left <= MAX_EJECTION_MS / 1000 + 0.05, (left, inst)
        during = await _ask(gw)
        during.check("503", "ok", "4xx")
        if during.status in (429, 503):
            assert 1 <= int(during.headers["retry-after"]) <= limit_s, during.describe()

    async def served() -> bool:
        return (await _ask(gw)).check("ok", "503", "4xx") == "ok"

    await poll(served, MAX_EJECTION_MS / 1000 + 2.5, "the instance to serve again", 0.05)
    assert _inst(await gw.state(), server)["state"] in ("healthy", "half_open")
    await settle(gw)


# ---- the upstream key never leaks -------------------------------------------------------------


def _decoded_texts(ans: Answer) -> list[str]:
    """The body as a client's JSON decoder sees it (escapes resolved), event by event."""
    out = []
    pieces = [e[6:] for e in ans.events if e.startswith(b"data: ")] if ans.stream else [ans.body]
    for piece in pieces:
        try:
            out.append(json.dumps(json.loads(piece), ensure_ascii=False))
        except ValueError:
            out.append(piece.decode("utf-8", "replace"))
    return out


@pytest.mark.parametrize(
    ("where", "stream", "allowed"),
    [
        pytest.param(where, stream, allowed, id=where)
        for where, stream, allowed in [
            ("400", False, {"4xx"}),
            ("404", False, {"4xx"}),
            ("401", False, {"502"}),
            ("429", False, {"4xx"}),  # SPEC §7: 429 `rate_limited`, the message scrubbed
            ("500", False, {"502"}),
            ("503", False, {"502"}),
            ("200err", False, {"502"}),
            ("qianfan", False, {"502"}),
            ("text500", False, {"502"}),
            ("header", False, {"ok"}),
            ("escaped", False, {"4xx"}),
            ("sse_event", True, {"stream_error"}),
            ("sse_first", True, {"502", "stream_error"}),
            ("sse_split", True, {"stream_error"}),
        ]
    ],
)
async def test_upstream_key_never_reaches_a_client_a_log_or_a_metric(
    hostile: HostileFactory,
    gateway_factory: GatewayFactory,
    caplog: pytest.LogCaptureFixture,
    where: str,
    stream: bool,
    allowed: set[str],
) -> None:
    server = await hostile(("echo_key", {"where": where}))
    gw = await gateway_factory(hostile_config(server))
    secret = UPSTREAM_KEY.encode()
    with caplog.at_level(logging.INFO):
        ans = await _ask(gw, stream=stream)
        ans.check(*allowed)
    assert server.events["answered"] >= 1
    assert secret not in ans.body, ans.describe()
    for text in _decoded_texts(ans):
        assert UPSTREAM_KEY not in text, f"the key, once decoded: {text[:300]}"
    for name, value in ans.raw_headers:
        assert secret not in name + value, (name, value)
    async with gw.session.get(gw.url + "/admin/state") as resp:
        assert secret not in await resp.read(), "the key is in /admin/state"
    async with gw.session.get(gw.url + "/metrics") as resp:
        assert secret not in await resp.read(), "the key is in /metrics"
    formatter = logging.Formatter()
    for record in caplog.records:
        line = formatter.format(record) + repr(getattr(record, "fields", ""))
        assert UPSTREAM_KEY not in line, f"the key is in a log line: {line[:300]}"
    await settle(gw)


@pytest.mark.parametrize(
    ("special", "allowed"),
    [
        ("none", "ok"),
        ("key", "ok"),
        ("error", "ok"),
        ("garbage", "stream_error"),
        ("array", "ok"),
        ("usage", "ok"),
        ("done", "ok"),
    ],
)
async def test_paced_stream_events_are_each_checked(
    hostile: HostileFactory, gateway_factory: GatewayFactory, special: str, allowed: str
) -> None:
    """A stream paced like vLLM's (each event its own chunk, its own read: the relay's
    fastest path, where a chunk goes to the client with its framing as it came): every event
    is still checked. A key quoted in a content delta is redacted, an error event ends the
    stream in the gateway's words, a `data:` line that is not JSON ends it too, JSON that is
    not an object passes, a usage chunk counts its tokens, nothing after `[DONE]` is relayed.
    (An upstream's error event mid-stream reaches the client rewritten; the stream goes on
    as the upstream sends it.)"""
    server = await hostile(("paced_sse", {"special": special}))
    gw = await gateway_factory(hostile_config(server))
    ans = await _ask(gw, stream=True)
    # (`check` wants every event an object: the array passes as the upstream sent it)
    outcome = ans.outcome() if special == "array" else ans.check("ok", "stream_error")
    assert outcome == allowed, ans.describe()
    assert UPSTREAM_KEY.encode() not in ans.body, ans.describe()
    for text in _decoded_texts(ans):
        assert UPSTREAM_KEY not in text, text
    content = b"".join(e for e in ans.events if b'"content"' in e)
    relayed = 2 if special in ("garbage", "done") else 3  # the content events after it: cut
    assert content.count(b" part") == relayed, ans.describe()
    if special == "error":
        errors = [e for e in ans.events if b'"error"' in e]
        assert len(errors) == 1 and b"[redacted]" in errors[0], ans.describe()
    if special == "key":
        assert b"said Bearer [redacted]" in ans.body, ans.describe()
    if special == "array":
        assert b"data: [1, 2, 3]\n\n" in ans.body
    if special == "done":
        assert b"after done" not in ans.body
        assert ans.body.endswith(b"data: [DONE]\n\n")
    async with gw.session.get(gw.url + "/metrics") as resp:
        metrics = (await resp.read()).decode()
    completion = [
        float(line.rsplit(" ", 1)[1])
        for line in metrics.splitlines()
        if line.startswith("gateway_tokens_total{") and 'kind="completion"' in line
    ]
    assert completion == ([777.0] if special == "usage" else []), completion
    await settle(gw)


@pytest.mark.parametrize("where", ["base64", "urlencoded"])
async def test_an_encoded_upstream_key_never_reaches_the_client(
    hostile: HostileFactory, gateway_factory: GatewayFactory, where: str
) -> None:
    """SPEC §7: the key never appears in an error — not base64'd inside `user:key`, not
    URL-encoded (an upstream's 400, which passes through, quoting the credential it got)."""
    server = await hostile(("echo_key", {"where": where}))
    gw = await gateway_factory(hostile_config(server))
    ans = await _ask(gw, stream=False)
    ans.check("4xx")
    assert server.events["answered"] >= 1
    forms = {
        base64.b64encode(f"gw:{UPSTREAM_KEY}".encode()),
        urllib.parse.quote(f"{UPSTREAM_KEY}/", safe="").encode(),
    }
    for text in _decoded_texts(ans):
        assert "bad credential" in text, text  # the upstream's message itself still arrives
        for word in text.replace('"', " ").split():
            for form in forms:
                assert form.decode()[4:-4] not in word, f"the key, encoded: {text[:300]}"
            with contextlib.suppress(ValueError):
                assert UPSTREAM_KEY.encode() not in base64.b64decode(word + "==")
            assert UPSTREAM_KEY not in urllib.parse.unquote(word)
    await settle(gw)


# ---- answers sent twice ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("delay", "echo", "clients"),
    [
        # Inside the 5 ms rest after a response. Without the echo the guarantee is one of
        # timing (docs/http.md), and this test's backend shares the gateway's event loop: a
        # few clients keep the loop's lag well under the 3 ms margin.
        pytest.param(0.002, False, 4, id="2ms"),
        pytest.param(0.002, True, 12, id="2ms-echo"),
        pytest.param(0.03, True, 12, id="30ms-echo"),  # past the rest: the echo check
        # every client names its requests alike: the ids sent upstream still differ
        pytest.param(0.03, True, 12, id="30ms-echo-same-client-ids"),
    ],
)
async def test_an_answer_sent_twice_never_reaches_another_tenant(
    request: pytest.FixtureRequest,
    hostile: HostileFactory,
    gateway_factory: GatewayFactory,
    delay: float,
    echo: bool,
    clients: int,
) -> None:
    """SPEC §16: a backend that sends its answer twice, a few ms apart. The duplicate lands
    on a connection resting after its response (unsolicited bytes: it is lost), or — later,
    from a backend that echoes the request id — is recognised as another request's answer
    (a framing error; the request is sent again on a fresh connection). Nobody ever gets
    another request's answer (on main: 5 crossings in 144 attempts)."""
    server = await hostile(("duplicate", {"delay": delay, "echo": echo}))
    gw = await gateway_factory(hostile_config((server, 16)))

    same_ids = "same-client-ids" in request.node.callspec.id
    headers = {"X-Request-Id": "req-1"} if same_ids else None

    async def client(n: int) -> list[Answer]:
        return [await _ask(gw, stream=i % 3 == 2, headers=headers) for i in range(n)]

    batches = await asyncio.gather(*(client(12) for _ in range(clients)))
    answers = [ans for batch in batches for ans in batch]
    for ans in answers:
        ans.check("ok")  # its own tag and nobody else's
    assert server.events["duplicate_sent"] + server.events["duplicate_sent_skipped"] > 0
    await _garbage_landed(server)
    await settle(gw, counted=len(answers))


# ---- slow and unfinished uploads ----------------------------------------------------------------


async def test_unfinished_uploads_are_counted_while_they_are_read(
    hostile: HostileFactory, gateway_factory: GatewayFactory
) -> None:
    """SPEC §16: request bytes count toward `limits.max_buffered_bytes` while they are read.
    60 connections each send 9 MB of a 9.5 MB body and stop: against a 40 MB bound the
    gateway answers the ones past it 503 `overloaded` at once and the rest 408 at the body
    deadline, and its RSS grows by a fraction of the 540 MB sent (on main: 453 MB)."""
    server = await hostile("good")
    config = hostile_config(
        server,
        max_body_bytes=16 << 20,
        limits={"max_buffered_bytes": 40 << 20, "body_timeout_ms": 1500},
    )
    gw = await gateway_factory(config)
    (await _ask(gw)).check("ok")
    gc.collect()
    host, port = gw.url.split("://")[1].split(":")
    block = b" " * (1 << 20)

    async def upload() -> int:
        reader, writer = await asyncio.open_connection(host, int(port))
        try:
            writer.write(
                b"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\n"
                b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % (19 << 19)
            )
            for _ in range(9):
                writer.write(block)
                await writer.drain()
            line = await asyncio.wait_for(reader.readline(), 10.0)
            return int(line.split()[1])
        except (ConnectionError, asyncio.IncompleteReadError):
            return 0  # cut after a 503 while still sending
        finally:
            writer.close()

    sampler = RssSampler()
    async with sampler.running():
        statuses = await asyncio.gather(*(upload() for _ in range(60)))
    grown = (sampler.peak - sampler.start) / 2**20
    counted = Counter(statuses)
    print(f"unfinished uploads: {dict(counted)}, RSS +{grown:.0f} MiB")
    assert set(counted) <= {503, 408, 0}, counted
    assert counted[503] + counted[0] >= 50, counted  # 40 MB holds four 9 MB uploads
    assert counted[408] >= 1, counted
    assert grown < 200, f"RSS grew by {grown:.0f} MiB"
    assert gw.gateway.buffered_bytes == 0
    (await _ask(gw)).check("ok")
    await settle(gw)


# ---- memory stays bounded ---------------------------------------------------------------------


async def test_huge_and_endless_answers_do_not_grow_memory(
    hostile: HostileFactory, gateway_factory: GatewayFactory
) -> None:
    """200 MB bodies, endless chunked bodies and an endless SSE event, each a few times: the
    gateway stops reading at `limits.max_response_bytes` / `max_event_bytes` (1 MiB / 64 KiB
    here), so its RSS never grows anywhere near the bodies' size."""
    server = await hostile("good")
    gw = await gateway_factory(hostile_config(server))
    (await _ask(gw)).check("ok")  # warm: connections, code paths
    gc.collect()
    runs = [
        ("huge_body", False),
        ("endless_body", False),
        (("sse_no_separator", {"lead": True}), True),
        (("sse_no_separator", {"lead": False}), True),
    ] * 2
    sampler = RssSampler()
    async with sampler.running():
        for spec, stream in runs:
            server.set_mode(spec)
            ans = await _ask(gw, stream=stream)
            ans.check("502", "504", "stream_error")
    grown = (sampler.peak - sampler.start) / 2**20
    assert grown < 100, f"RSS grew by {grown:.0f} MiB"
    await _follow_ups(gw, server)
    await settle(gw)
