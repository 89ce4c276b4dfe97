"""The Batch API (SPEC §14) end to end: the official openai client against real servers on
127.0.0.1, a `kill -9` of a real `gateway serve`, bad files of every kind, fairness to realtime
traffic, cancel, expiry, retries, ownership, and the store's guarantees."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterable
from pathlib import Path
from typing import Any, Final

import aiohttp
import openai
import orjson
import pytest
import yaml
from openai import AsyncOpenAI
from openai.types import Batch

from gateway.batch import api as batch_api
from gateway.batch import runner as batch_runner
from gateway.batch.records import answer_record, inspect
from gateway.batch.runner import Verdict, verdict
from gateway.config import parse_config
from gateway.errors import (
    Draining,
    InvalidRequest,
    ModelNotFound,
    NoHealthyInstance,
    Overloaded,
    QueueFull,
    QueueTimeout,
    RateLimited,
    UpstreamFailed,
    UpstreamRateLimited,
)
from gateway.events import GatewayEvent, RequestFinished
from gateway.outcome import Answered, Outcome, Refused
from gateway.server import Server
from gateway.sim.mock import MockServer
from support import GatewayFactory, MockFactory, RunningGateway, eventually, pool_config

CHAT: Final = "/v1/chat/completions"
FINAL = ("completed", "failed", "cancelled", "expired")


def line(cid: str, text: str | None = None, model: str = "m", **over: Any) -> dict[str, Any]:
    body = {"model": model, "messages": [{"role": "user", "content": text or f"q {cid}"}]}
    return {"custom_id": cid, "method": "POST", "url": CHAT, "body": body, **over}


def jsonl(lines: Iterable[Any]) -> bytes:
    return b"".join(orjson.dumps(x) + b"\n" for x in lines)


def config(pool: dict[str, Any], store: Path, **batch: Any) -> dict[str, Any]:
    return {
        "pools": {"p": pool},
        "models": {"m": {"pool": "p"}},
        "batch": {"store": str(store), **batch},
    }


Clients = Callable[..., AsyncOpenAI]


@pytest.fixture
async def client() -> AsyncIterator[Clients]:
    """`client(gw_or_base_url, key="none")`: an AsyncOpenAI client, closed after the test."""
    made: list[AsyncOpenAI] = []

    def make(gw: RunningGateway | str, key: str = "none") -> AsyncOpenAI:
        base = gw if isinstance(gw, str) else gw.base_url
        c = AsyncOpenAI(base_url=base, api_key=key, max_retries=0, timeout=30)
        made.append(c)
        return c

    yield make
    for c in made:
        await c.close()


async def submit(c: AsyncOpenAI, data: bytes, endpoint: str = CHAT, **kw: Any) -> Batch:
    f = await c.files.create(file=("in.jsonl", data), purpose="batch")
    return await c.batches.create(
        input_file_id=f.id,
        endpoint=endpoint,  # type: ignore[arg-type]
        completion_window="24h",
        **kw,
    )


async def wait_batch(
    c: AsyncOpenAI, batch_id: str, until: Iterable[str] = FINAL, within: float = 20.0
) -> Batch:
    wanted = set(until)
    deadline = time.monotonic() + within
    while True:
        b = await c.batches.retrieve(batch_id)
        if b.status in wanted:
            return b
        assert time.monotonic() < deadline, f"batch still {b.status}: {b}"
        await asyncio.sleep(0.02)


async def records(c: AsyncOpenAI, file_id: str | None) -> list[dict[str, Any]]:
    if file_id is None:
        return []
    content = await c.files.content(file_id)
    return [orjson.loads(x) for x in content.content.splitlines()]


async def metric(gw: RunningGateway, name: str) -> float:
    # SPEC §9: with auth on, /metrics asks for the metrics key or the admin key
    headers = {"Authorization": f"Bearer {gw.admin_key}"} if gw.admin_key else {}
    async with gw.session.get(gw.url + "/metrics", headers=headers) as resp:
        text = await resp.text()
    for row in text.splitlines():
        series, _, value = row.rpartition(" ")
        if series == name:
            return float(value)
    raise AssertionError(f"{name} not in /metrics")


def chat_requests(mock: MockServer) -> list[str]:
    """The custom ids (the prompt is `q <custom_id>`) of the chat requests the mock saw."""
    return [
        e["body"]["messages"][0]["content"].removeprefix("q ")
        for e in mock.requests
        if e["path"] == CHAT and isinstance(e["body"], dict)
    ]


# ---- the openai client, end to end -----------------------------------------------------------


async def test_round_trip_with_the_openai_client(
    mocks: MockFactory, gateway_factory: GatewayFactory, tmp_path: Path, client: Clients
) -> None:
    m = await mocks(latency_ms=5, log_size=1000)
    gw = await gateway_factory(config(pool_config(m), tmp_path / "b.db"))
    seen: list[GatewayEvent] = []
    gw.gateway.events.subscribe(seen.append)
    c = client(gw)
    data = jsonl(line(f"c{i}") for i in range(30))
    f = await c.files.create(file=("judge.jsonl", data), purpose="batch")
    assert (f.object, f.purpose, f.bytes, f.filename) == ("file", "batch", len(data), "judge.jsonl")
    assert (await c.files.retrieve(f.id)).id == f.id
    assert (await c.files.content(f.id)).content == data
    assert f.id in [x.id async for x in c.files.list()]

    b = await c.batches.create(
        input_file_id=f.id,
        endpoint=CHAT,
        completion_window="24h",
        metadata={"job": "rejudge"},
    )
    assert b.status == "validating" and b.object == "batch" and b.input_file_id == f.id
    assert b.expires_at == b.created_at + 24 * 3600
    b = await wait_batch(c, b.id)
    assert b.status == "completed", b
    assert b.request_counts is not None
    assert (b.request_counts.total, b.request_counts.completed, b.request_counts.failed) == (
        30,
        30,
        0,
    )
    assert b.metadata == {"job": "rejudge"} and b.model == "m" and b.errors is None
    assert b.error_file_id is None and b.output_file_id is not None
    assert b.in_progress_at and b.finalizing_at and b.completed_at
    assert b.created_at <= b.in_progress_at <= b.finalizing_at <= b.completed_at

    out = await records(c, b.output_file_id)
    assert sorted(r["custom_id"] for r in out) == sorted(f"c{i}" for i in range(30))
    for r in out:
        assert r["id"].startswith("batch_req_") and r["error"] is None
        assert r["response"]["status_code"] == 200 and r["response"]["request_id"]
        assert r["response"]["body"]["choices"][0]["message"]["role"] == "assistant"
    assert len({r["id"] for r in out}) == 30
    # usage: the sum of the lines' usage
    assert b.usage is not None
    assert b.usage.input_tokens == sum(r["response"]["body"]["usage"]["prompt_tokens"] for r in out)
    assert b.usage.output_tokens == sum(
        r["response"]["body"]["usage"]["completion_tokens"] for r in out
    )
    assert b.usage.total_tokens == b.usage.input_tokens + b.usage.output_tokens > 0

    output = await c.files.retrieve(b.output_file_id)
    assert output.purpose == "batch_output" and output.filename == f"{b.id}_output.jsonl"
    # every line went through the gateway as a batch request (access log / events)
    batch_events = [e for e in seen if isinstance(e, RequestFinished) and e.source == "batch"]
    assert len(batch_events) == 30
    assert {e.priority for e in batch_events} == {"low"}
    assert m.stats.requests_total == 30

    # observability: counts by status, lines done
    state = await gw.state()
    assert state["batches"]["completed"] == 1 and state["batches"]["in_progress"] == 0
    assert state["running_batches"] == []
    assert await metric(gw, 'gateway_batches{status="completed"}') == 1
    assert await metric(gw, 'gateway_batch_lines_total{result="completed"}') == 30

    deleted = await c.files.delete(f.id)
    assert deleted.deleted and deleted.id == f.id
    with pytest.raises(openai.NotFoundError):
        await c.files.retrieve(f.id)
    await gw.assert_quiet()


async def test_embeddings_and_completions_batches(
    mocks: MockFactory, gateway_factory: GatewayFactory, tmp_path: Path, client: Clients
) -> None:
    m = await mocks()
    gw = await gateway_factory(config(pool_config(m), tmp_path / "b.db"))
    c = client(gw)
    emb = [
        {**line(f"e{i}"), "url": "/v1/embeddings", "body": {"model": "m", "input": f"x{i}"}}
        for i in range(3)
    ]
    cmp = [
        {**line(f"t{i}"), "url": "/v1/completions", "body": {"model": "m", "prompt": "p"}}
        for i in range(3)
    ]
    b1 = await submit(c, jsonl(emb), "/v1/embeddings")
    b2 = await submit(c, jsonl(cmp), "/v1/completions")
    b1, b2 = await wait_batch(c, b1.id), await wait_batch(c, b2.id)
    assert (b1.status, b2.status) == ("completed", "completed")
    out1, out2 = await records(c, b1.output_file_id), await records(c, b2.output_file_id)
    assert all(r["response"]["body"]["object"] == "list" for r in out1)
    assert all(r["response"]["body"]["choices"][0]["text"] for r in out2)
    await gw.assert_quiet()


async def test_list_pages_like_openai(
    mocks: MockFactory, gateway_factory: GatewayFactory, tmp_path: Path, client: Clients
) -> None:
    m = await mocks()
    gw = await gateway_factory(config(pool_config(m), tmp_path / "b.db"))
    c = client(gw)
    made = [(await submit(c, jsonl([line(f"x{i}")]))).id for i in range(5)]
    newest_first = made[::-1]
    page = await c.batches.list(limit=2)
    assert [b.id for b in page.data] == newest_first[:2] and page.has_more
    page = await c.batches.list(limit=2, after=page.data[-1].id)
    assert [b.id for b in page.data] == newest_first[2:4] and page.has_more
    page = await c.batches.list(limit=2, after=page.data[-1].id)
    assert [b.id for b in page.data] == newest_first[4:] and not page.has_more
    assert [b.id async for b in c.batches.list(limit=2)] == newest_first  # auto-paging
    assert [b.id async for b in c.batches.list()] == newest_first  # default limit 20
    async with gw.session.get(gw.url + "/v1/batches?limit=3") as resp:
        doc = await resp.json()
    assert doc["object"] == "list" and doc["has_more"] is True
    assert (doc["first_id"], doc["last_id"]) == (newest_first[0], newest_first[2])
    for bad in ("0", "101", "x"):
        async with gw.session.get(gw.url + f"/v1/batches?limit={bad}") as resp:
            assert resp.status == 400
            assert (await resp.json())["error"]["param"] == "limit"
    files_asc = [f.id async for f in c.files.list(limit=2, order="asc", purpose="batch")]
    files_desc = [f.id async for f in c.files.list(limit=2, purpose="batch")]
    assert len(files_asc) == 5 and files_asc == files_desc[::-1]
    for bid in made:
        assert (await wait_batch(c, bid)).status == "completed"
    await gw.assert_quiet()


async def test_cancel_mid_run_keeps_partial_results(
    mocks: MockFactory, gateway_factory: GatewayFactory, tmp_path: Path, client: Clients
) -> None:
    m = await mocks(latency_ms=150, log_size=1000)
    gw = await gateway_factory(
        config(pool_config((m, 2)), tmp_path / "b.db", in_flight_per_batch=2)
    )
    c = client(gw)
    b = await submit(c, jsonl(line(f"c{i}") for i in range(30)))

    async def some_done() -> bool:
        got = await c.batches.retrieve(b.id)
        return got.request_counts is not None and got.request_counts.completed >= 2

    await eventually(some_done, 10, "two lines done")
    cancelling = await c.batches.cancel(b.id)
    assert cancelling.status in ("cancelling", "cancelled") and cancelling.cancelling_at
    b = await wait_batch(c, b.id)
    assert b.status == "cancelled" and b.cancelled_at and b.request_counts is not None
    done = b.request_counts.completed
    assert 2 <= done < 30 and b.request_counts.failed == 0
    out = await records(c, b.output_file_id)
    err = await records(c, b.error_file_id)
    assert len(out) == done and all(r["response"]["status_code"] == 200 for r in out)
    assert {r["error"]["code"] for r in err} == {"batch_cancelled"}
    assert all(r["response"] is None for r in err)
    ids = [r["custom_id"] for r in out + err]
    assert sorted(ids) == sorted(f"c{i}" for i in range(30))
    # nothing started after the cancel: the upstream saw exactly the lines in the output
    assert sorted(chat_requests(m)) == sorted(r["custom_id"] for r in out)
    assert (await c.batches.cancel(b.id)).status == "cancelled"  # idempotent
    finished = await submit(c, jsonl([line("z")]))
    await wait_batch(c, finished.id)
    with pytest.raises(openai.BadRequestError):
        await c.batches.cancel(finished.id)
    await gw.assert_quiet()


async def test_cancel_right_after_create_and_the_counts_stay_exact(
    mocks: MockFactory, gateway_factory: GatewayFactory, tmp_path: Path, client: Clients
) -> None:
    m = await mocks(latency_ms=20)
    gw = await gateway_factory(config(pool_config((m, 2)), tmp_path / "b.db"))
    c = client(gw)
    made = [await submit(c, jsonl(line(f"v{n}-{i}") for i in range(3000))) for n in range(3)]
    for b in made:  # most likely while still validating: either way it ends `cancelled`
        assert (await c.batches.cancel(b.id)).status in ("cancelling", "cancelled")
    for b in made:
        done = await wait_batch(c, b.id)
        assert done.status == "cancelled" and done.request_counts is not None
        err = await records(c, done.error_file_id)
        assert len(err) + done.request_counts.completed == 3000
    state = await gw.state()
    assert state["batches"]["cancelled"] == 3
    assert sum(state["batches"].values()) == 3 and state["running_batches"] == []
    await gw.assert_quiet()


async def test_a_key_sees_only_its_own_files_and_batches(
    mocks: MockFactory, gateway_factory: GatewayFactory, tmp_path: Path, client: Clients
) -> None:
    m = await mocks()
    auth = {
        "keys": [{"key": "k-alice", "name": "alice"}, {"key": "k-bob", "name": "bob"}],
        "admin_key": "k-admin",
    }
    gw = await gateway_factory({**config(pool_config(m), tmp_path / "b.db"), "auth": auth})
    alice, bob, admin = client(gw, "k-alice"), client(gw, "k-bob"), client(gw, "k-admin")
    b = await submit(alice, jsonl([line("a1"), line("a2")]))
    b = await wait_batch(alice, b.id)
    assert b.status == "completed" and b.output_file_id
    for fid in (b.input_file_id, b.output_file_id):
        with pytest.raises(openai.NotFoundError):
            await bob.files.retrieve(fid)
        with pytest.raises(openai.NotFoundError):
            await bob.files.content(fid)
        with pytest.raises(openai.NotFoundError):
            await bob.files.delete(fid)
    with pytest.raises(openai.NotFoundError):
        await bob.batches.retrieve(b.id)
    with pytest.raises(openai.NotFoundError):
        await bob.batches.cancel(b.id)
    with pytest.raises(openai.NotFoundError):
        await bob.batches.create(
            input_file_id=b.input_file_id, endpoint=CHAT, completion_window="24h"
        )
    assert [x async for x in bob.batches.list()] == []
    assert [x async for x in bob.files.list()] == []
    mine = await bob.files.create(file=("b.jsonl", jsonl([line("b1")])), purpose="batch")
    assert [x.id async for x in bob.files.list()] == [mine.id]
    # alice sees hers, the admin key sees everyone's
    assert {x.id async for x in alice.files.list()} == {b.input_file_id, b.output_file_id}
    assert (await admin.batches.retrieve(b.id)).id == b.id
    assert {x.id async for x in admin.files.list()} >= {b.input_file_id, mine.id}
    assert (await admin.files.content(b.output_file_id)).content
    with pytest.raises(openai.AuthenticationError):
        await client(gw, "k-wrong").batches.list()
    await gw.assert_quiet()


# ---- validation: bad files fail, with line numbers, and nothing runs -----------------------

GOOD = line("ok")
BAD_FILES: list[tuple[str, bytes, list[tuple[str, int | None, str | None]]]] = [
    ("not json", jsonl([GOOD]) + b"{not json\n", [("invalid_json_line", 2, None)]),
    ("not an object", b"[1, 2]\n", [("invalid_json_line", 1, None)]),
    (
        "missing custom_id",
        jsonl([{k: v for k, v in GOOD.items() if k != "custom_id"}]),
        [("missing_required_parameter", 1, "custom_id")],
    ),
    ("empty custom_id", jsonl([line("")]), [("invalid_request", 1, "custom_id")]),
    (
        "duplicate custom_id",
        jsonl([line("a"), line("b"), line("a")]),
        [("duplicate_custom_id", 3, "custom_id")],
    ),
    ("wrong method", jsonl([line("a", method="GET")]), [("invalid_method", 1, "method")]),
    (
        "missing url",
        jsonl([{k: v for k, v in GOOD.items() if k != "url"}]),
        [("missing_required_parameter", 1, "url")],
    ),
    (
        "url is not the endpoint",
        jsonl([line("a", url="/v1/embeddings")]),
        [("url_mismatch", 1, "url")],
    ),
    (
        "missing body",
        jsonl([{k: v for k, v in GOOD.items() if k != "body"}]),
        [("missing_required_parameter", 1, "body")],
    ),
    (
        "invalid body",
        jsonl([{**GOOD, "body": {"model": "m", "messages": []}}]),
        [("invalid_request", 1, "body.messages")],
    ),
    (
        "bad temperature",
        jsonl([{**GOOD, "body": {**GOOD["body"], "temperature": 9}}]),
        [("invalid_request", 1, "body.temperature")],
    ),
    (
        "stream true",
        jsonl([{**GOOD, "body": {**GOOD["body"], "stream": True}}]),
        [("invalid_request", 1, "body.stream")],
    ),
    ("unknown model", jsonl([line("a", model="gpt-nope")]), [("model_not_found", 1, "body.model")]),
    ("too many lines", jsonl(line(f"l{i}") for i in range(6)), [("too_many_tasks", 6, None)]),
    ("empty file", b"", [("empty_file", None, None)]),
    ("only blank lines", b"\n  \n\n", [("empty_file", None, None)]),
    (
        "several errors, blank lines counted",
        jsonl([GOOD]) + b"\n" + jsonl([line("x", method="PUT"), GOOD]),
        [("invalid_method", 3, "method"), ("duplicate_custom_id", 4, "custom_id")],
    ),
]


async def test_bad_files_fail_with_line_numbers_and_nothing_runs(
    mocks: MockFactory, gateway_factory: GatewayFactory, tmp_path: Path, client: Clients
) -> None:
    m = await mocks()
    gw = await gateway_factory(
        config(pool_config(m), tmp_path / "b.db", max_lines=5, max_file_bytes=4096)
    )
    c = client(gw)
    made = {name: await submit(c, data) for name, data, _ in BAD_FILES}
    for name, _, expected in BAD_FILES:
        b = await wait_batch(c, made[name].id)
        assert b.status == "failed", (name, b)
        assert b.failed_at and b.output_file_id is None and b.error_file_id is None
        assert b.errors is not None and b.errors.data is not None
        got = [(e.code, e.line, e.param) for e in b.errors.data]
        assert got == expected, name
        assert all(e.message for e in b.errors.data)
    assert m.stats.requests_total == 0  # nothing of any bad file ran

    # refused at once, not as a failed batch
    f = await c.files.create(file=("ok.jsonl", jsonl([GOOD])), purpose="batch")
    with pytest.raises(openai.BadRequestError) as bad_purpose:
        await c.files.create(file=("x.jsonl", jsonl([GOOD])), purpose="fine-tune")
    assert bad_purpose.value.body["param"] == "purpose"  # type: ignore[index]
    with pytest.raises(openai.APIStatusError) as too_big:
        await c.files.create(file=("big.jsonl", b"x" * 100_000), purpose="batch")
    assert too_big.value.status_code == 413
    with pytest.raises(openai.APIStatusError) as streamed_too_big:  # within the header slack
        await c.files.create(file=("big.jsonl", b"x" * 5000), purpose="batch")
    assert streamed_too_big.value.status_code == 413
    with pytest.raises(openai.NotFoundError):
        await c.batches.create(input_file_id="file-nope", endpoint=CHAT, completion_window="24h")
    for kw, param in (
        ({"endpoint": "/v1/responses"}, "endpoint"),
        ({"completion_window": "1h"}, "completion_window"),
        ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
    ):
        args: dict[str, Any] = {"endpoint": CHAT, "completion_window": "24h", **kw}
        with pytest.raises(openai.BadRequestError) as refused:
            await c.batches.create(input_file_id=f.id, **args)
        assert refused.value.body["param"] == param  # type: ignore[index]
    # the temp files of refused uploads are gone
    leftovers = [p.name for p in (tmp_path / "b.db.files").iterdir() if p.name.startswith(".")]
    assert leftovers == []
    assert m.stats.requests_total == 0
    await gw.assert_quiet()


async def test_routes_methods_and_ids(
    mocks: MockFactory, gateway_factory: GatewayFactory, tmp_path: Path
) -> None:
    gw = await gateway_factory(config(pool_config(await mocks()), tmp_path / "b.db"))
    cases = [
        ("PUT", "/v1/files/file-x", 405),
        ("POST", "/v1/batches/batch_x", 405),
        ("GET", "/v1/batches/batch_x/cancel", 405),
        ("GET", "/v1/files/file-x/other", 404),
        ("GET", "/v1/files/bad%21id", 404),
        ("GET", "/v1/batches/batch_nope", 404),
        ("DELETE", "/v1/files", 405),
    ]
    for method, path, status in cases:
        async with gw.session.request(method, gw.url + path) as resp:
            assert resp.status == status, (method, path)
            body = await resp.json()
            assert body["error"]["code"] in ("not_found", "method_not_allowed")
            if status == 405:
                assert resp.headers["Allow"]
    async with gw.session.post(gw.url + "/v1/files", data=b"x") as resp:
        assert resp.status == 400  # not multipart
    json_type = {"Content-Type": "application/json"}
    async with gw.session.post(gw.url + "/v1/batches", data=b"{", headers=json_type) as resp:
        assert resp.status == 400
    # reads (and refused writes) never create the store: no file appears for a mere GET
    for path in ("/v1/files", "/v1/batches"):
        async with gw.session.get(gw.url + path) as resp:
            assert resp.status == 200 and (await resp.json())["data"] == []
    spec = {"input_file_id": "file-x", "endpoint": CHAT, "completion_window": "24h"}
    async with gw.session.post(gw.url + "/v1/batches", json=spec) as resp:
        assert resp.status == 404
    assert not (tmp_path / "b.db").exists()
    await gw.assert_quiet()


# ---- execution: retries, key limits, expiry ---------------------------------------------------


async def test_failed_lines_are_retried_then_written_to_the_error_file(
    mocks: MockFactory,
    gateway_factory: GatewayFactory,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    client: Clients,
) -> None:
    monkeypatch.setattr(batch_runner, "BACKOFF_BASE_S", 0.01)
    good = await mocks()
    bad = await mocks(fail_rate=1.0, fail_status=500)
    cfg = config(pool_config(good), tmp_path / "b.db")
    cfg["pools"]["broken"] = pool_config(bad)
    cfg["models"]["broken"] = {"pool": "broken"}
    gw = await gateway_factory(cfg)
    c = client(gw)
    lines = [line(f"g{i}") for i in range(4)] + [line(f"b{i}", model="broken") for i in range(2)]
    b = await wait_batch(c, (await submit(c, jsonl(lines))).id)
    assert b.status == "completed" and b.request_counts is not None
    assert (b.request_counts.completed, b.request_counts.failed) == (4, 2)
    out, err = await records(c, b.output_file_id), await records(c, b.error_file_id)
    assert sorted(r["custom_id"] for r in out) == [f"g{i}" for i in range(4)]
    assert sorted(r["custom_id"] for r in err) == ["b0", "b1"]
    for r in err:
        status = r["response"]["status_code"]
        assert status in (502, 503), r
        assert r["error"]["code"] == r["response"]["body"]["error"]["code"]
        assert r["error"]["code"] in ("upstream_error", "no_healthy_instance")
    # 3 line-level retries each, after the gateway's own attempts
    assert await metric(gw, "gateway_batch_line_retries_total") == 2 * batch_runner.MAX_LINE_RETRIES
    assert await metric(gw, 'gateway_batch_lines_total{result="failed"}') == 2
    await gw.assert_quiet()


async def test_the_keys_own_rate_limit_is_a_wait_not_a_failure(
    mocks: MockFactory, gateway_factory: GatewayFactory, tmp_path: Path, client: Clients
) -> None:
    m = await mocks()
    auth = {"keys": [{"key": "k", "name": "limited", "rpm": 60}], "admin_key": "adm"}
    gw = await gateway_factory({**config(pool_config(m), tmp_path / "b.db"), "auth": auth})
    c = client(gw, "k")
    # one line past the minute's 60: it waits for the bucket's next token (~1 s), not fails
    b = await submit(c, jsonl(line(f"r{i}") for i in range(61)))
    b = await wait_batch(c, b.id, within=20)
    assert b.status == "completed" and b.request_counts is not None
    assert (b.request_counts.completed, b.request_counts.failed) == (61, 0)
    assert await metric(gw, 'gateway_rejections_total{reason="rate_limited"}') >= 1
    assert m.stats.requests_total == 61
    await gw.assert_quiet()


async def test_a_batch_past_its_window_expires_with_partial_results(
    mocks: MockFactory,
    gateway_factory: GatewayFactory,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    client: Clients,
) -> None:
    monkeypatch.setattr(batch_api, "COMPLETION_WINDOW_S", 1)
    m = await mocks(latency_ms=150)
    gw = await gateway_factory(
        config(pool_config((m, 1)), tmp_path / "b.db", in_flight_per_batch=1)
    )
    c = client(gw)
    b = await submit(c, jsonl(line(f"e{i}") for i in range(40)))
    b = await wait_batch(c, b.id, within=10)
    assert b.status == "expired" and b.expired_at and b.request_counts is not None
    out, err = await records(c, b.output_file_id), await records(c, b.error_file_id)
    assert len(out) == b.request_counts.completed >= 1
    assert len(out) + len(err) == 40
    assert {r["error"]["code"] for r in err} == {"batch_expired"}
    await gw.assert_quiet()


# ---- durability ----------------------------------------------------------------------------


async def test_a_stopped_gateway_resumes_its_batch_on_the_same_store(
    mocks: MockFactory, tmp_path: Path, client: Clients
) -> None:
    m = await mocks(latency_ms=30, log_size=1000)
    cfg = parse_config(
        yaml.safe_dump(
            {
                **config(pool_config((m, 2)), tmp_path / "b.db", in_flight_per_batch=4),
                "health": {"probe": {"enabled": False}},
            }
        ),
        env={},
    )
    first = Server(cfg, host="127.0.0.1", port=0)
    await first.start()
    c = client(first.url + "/v1")
    b = await submit(c, jsonl(line(f"s{i}") for i in range(40)))
    await eventually(
        lambda: first.gateway.batch.counts["in_progress"] == 1 and len(chat_requests(m)) >= 8,
        10,
        "some lines done",
    )
    # a second gateway on the same store is refused while the first holds it: 503 with the
    # reason (SPEC §14: never a 500)
    second = Server(cfg, host="127.0.0.1", port=0)
    await second.start()
    async with aiohttp.ClientSession() as s, s.get(second.url + "/v1/batches") as resp:
        assert resp.status == 503 and resp.headers["Retry-After"]
        err = (await resp.json())["error"]
        assert err["code"] == "store_unavailable" and "postgresql://" in err["message"]
    await second.shutdown(drain=False)
    await first.shutdown(drain=False)
    sent_before = len(chat_requests(m))
    assert sent_before < 40

    again = Server(cfg, host="127.0.0.1", port=0)
    await again.start()
    try:
        c = client(again.url + "/v1")
        b = await wait_batch(c, b.id, within=15)
        assert b.status == "completed" and b.request_counts is not None
        assert b.request_counts.completed == 40
        out = await records(c, b.output_file_id)
        assert sorted(r["custom_id"] for r in out) == sorted(f"s{i}" for i in range(40))
        # lines cut off by the stop ran again, each at most once more
        counts = Counter(chat_requests(m))
        assert max(counts.values()) <= 2
        assert sum(1 for n in counts.values() if n == 2) <= 4
    finally:
        await again.shutdown(drain=False)


async def _serve(config_path: Path) -> tuple[asyncio.subprocess.Process, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "gateway.cli",
        "serve",
        "--config",
        str(config_path),
        "--no-access-log",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.DEVNULL,
        cwd=config_path.parent,
    )
    assert proc.stdout is not None
    async with asyncio.timeout(30):
        text = (await proc.stdout.readline()).decode()
    assert "listening on" in text, text
    return proc, text.rsplit(" ", 1)[1].strip()


@contextlib.asynccontextmanager
async def _killed_at_exit(procs: list[asyncio.subprocess.Process]) -> AsyncIterator[None]:
    try:
        yield
    finally:
        for p in procs:
            if p.returncode is None:
                p.kill()
                await p.wait()


@pytest.mark.parametrize("lines", [600, pytest.param(2000, marks=pytest.mark.slow)])
async def test_kill_9_mid_batch_then_restart_completes_it(
    mocks: MockFactory, tmp_path: Path, client: Clients, lines: int
) -> None:
    """SPEC §14: after `kill -9` (half-way) and a restart the batch completes; every custom_id
    is in the output exactly once; a line in flight at the kill was sent again at most once.
    600 lines by default; 2,000 in `make test-slow`."""
    m = await mocks(latency_ms=10, log_size=10_000)
    in_flight = 64
    cfg = config(pool_config((m, 16)), tmp_path / "b.db", in_flight_per_batch=in_flight)
    cfg["listen"] = {"host": "127.0.0.1", "port": 0}
    cfg["health"] = {"probe": {"enabled": False}}
    cfg["shutdown"] = {"drain_delay_ms": 0}  # no load balancer to wait for (SPEC §7)
    path = tmp_path / "gateway.yaml"
    path.write_text(yaml.safe_dump(cfg))
    procs: list[asyncio.subprocess.Process] = []
    async with _killed_at_exit(procs):
        proc, url = await _serve(path)
        procs.append(proc)
        c = client(url + "/v1")
        b = await submit(c, jsonl(line(f"k{i}") for i in range(lines)))
        while True:
            got = await c.batches.retrieve(b.id)
            assert got.status in ("validating", "in_progress"), got
            if got.request_counts and got.request_counts.completed >= lines // 2:
                break
            await asyncio.sleep(0.02)
        proc.send_signal(signal.SIGKILL)
        assert await proc.wait() == -signal.SIGKILL
        seen_at_kill = len(chat_requests(m))
        assert seen_at_kill < lines

        proc, url = await _serve(path)
        procs.append(proc)
        c = client(url + "/v1")
        b = await wait_batch(c, b.id, within=60)
        assert b.status == "completed" and b.request_counts is not None
        assert (b.request_counts.completed, b.request_counts.failed) == (lines, 0)
        assert b.error_file_id is None
        out = await records(c, b.output_file_id)
        ids = [r["custom_id"] for r in out]
        assert len(ids) == lines and set(ids) == {f"k{i}" for i in range(lines)}
        counts = Counter(chat_requests(m))
        assert set(counts) == set(ids)
        assert max(counts.values()) <= 2
        twice = sum(1 for n in counts.values() if n == 2)
        assert twice <= in_flight, twice
        async with aiohttp.ClientSession() as s, s.get(url + "/admin/state") as resp:
            state = await resp.json()
        assert state["pools"]["p"]["queued"] == {"high": 0, "low": 0}
        assert state["pools"]["p"]["in_flight"] == 0
        proc.send_signal(signal.SIGTERM)
        assert await proc.wait() == 0


# ---- fairness: realtime keeps its share while a big batch runs ---------------------------------


async def _realtime_waits(gw: RunningGateway, workers: int, each: int) -> list[float]:
    waits: list[float] = []
    body = {"model": "m", "messages": [{"role": "user", "content": "does this compile?"}]}

    async def worker() -> None:
        for _ in range(each):
            async with gw.session.post(
                gw.url + CHAT, json=body, headers={"X-Priority": "high"}
            ) as resp:
                assert resp.status == 200
                await resp.read()
                waits.append(float(resp.headers["X-Gateway-Queue-Ms"]))

    await asyncio.gather(*(worker() for _ in range(workers)))
    return waits


def _p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


async def _alone_then_beside_a_batch(
    gw: RunningGateway, c: AsyncOpenAI
) -> tuple[list[float], list[float], list[int]]:
    """Realtime queue waits with no batch, then beside a running 2,000-line batch (cancelled
    afterwards); and the low queue's depth sampled meanwhile."""
    alone = await _realtime_waits(gw, workers=32, each=12)
    b = await submit(c, jsonl(line(f"f{i}") for i in range(2000)))

    async def flowing() -> bool:
        got = await c.batches.retrieve(b.id)
        return got.request_counts is not None and got.request_counts.completed >= 20

    await eventually(flowing, 10, "batch lines flowing")
    depths: list[int] = []
    sampling = True

    async def sample() -> None:
        while sampling:
            depths.append((await gw.state())["pools"]["p"]["queued"]["low"])
            await asyncio.sleep(0.02)

    sampler = asyncio.create_task(sample())
    before = (await c.batches.retrieve(b.id)).request_counts
    beside = await _realtime_waits(gw, workers=32, each=12)
    sampling = False
    await sampler
    after = await c.batches.retrieve(b.id)
    assert after.status == "in_progress" and after.request_counts and before
    assert after.request_counts.completed > before.completed  # the batch kept moving
    await c.batches.cancel(b.id)
    assert (await wait_batch(c, b.id)).status == "cancelled"
    await gw.assert_quiet()
    return alone, beside, depths


async def test_realtime_keeps_its_wait_while_a_2000_line_batch_runs(
    mocks: MockFactory, gateway_factory: GatewayFactory, tmp_path: Path, client: Clients
) -> None:
    """Realtime saturates the pool by itself (32 clients, 4 slots), so it waits in both runs;
    beside the batch it gets 7 of 10 contested slots (weighted policy): its p99 grows by about
    1/0.7, well within 2x. A CPU stall of the shared test machine lands on every client at
    once and moves a p99 alone, so a run is tried again (fresh alone/beside pair) up to 3 times.
    """
    m = await mocks(latency_ms=20)
    gw = await gateway_factory(config(pool_config((m, 4)), tmp_path / "b.db"))
    c = client(gw)
    tries: list[tuple[float, float]] = []
    for _ in range(3):
        alone, beside, depths = await _alone_then_beside_a_batch(gw, c)
        # fed gradually: never more than in_flight_per_batch of it waiting
        assert 0 < max(depths) <= 64
        tries.append((_p99(alone), _p99(beside)))
        if _p99(beside) <= 2 * _p99(alone):
            break
    else:
        raise AssertionError(f"realtime p99 (alone, beside a batch) in ms: {tries}")


@pytest.mark.parametrize("n", [600, pytest.param(2000, marks=pytest.mark.slow)])
async def test_a_batch_keeps_the_pools_slots_busy(
    mocks: MockFactory, gateway_factory: GatewayFactory, tmp_path: Path, client: Clients, n: int
) -> None:
    """Throughput floor: 4 slots answering in 20 ms allow ~200 lines/s (benches/README.md,
    "Batch API throughput": ~170-180 lines/s measured, the same as plain low requests). The
    lines must finish at >= 50 lines/s (2,000 within 40 s) — 30 lines/s would need 67 s; the
    test machine, which also runs the mock and this client on the same loop, takes ~12-15 s
    for 2,000. 600 lines by default (within 12 s: a runner sending one line at a time cannot
    pass 50 lines/s, each takes 20 ms), 2,000 in `make test-slow`. The client polls once
    every 100 ms, as a client of a long batch would (not every 20 ms)."""
    m = await mocks(latency_ms=20)
    gw = await gateway_factory(config(pool_config((m, 4)), tmp_path / "b.db"))
    c = client(gw)
    budget = n / 50
    t0 = time.monotonic()
    b = await submit(c, jsonl(line(f"c{i}") for i in range(n)))
    while b.status not in FINAL:
        assert time.monotonic() - t0 < budget, f"{b.request_counts} after {budget:.0f} s"
        await asyncio.sleep(0.1)
        b = await c.batches.retrieve(b.id)
    took = time.monotonic() - t0
    print(f"\n{n} lines in {took:.1f} s: {n / took:.0f} lines/s (4 slots x 20 ms)")
    assert b.status == "completed" and b.request_counts is not None
    assert (b.request_counts.completed, b.request_counts.failed) == (n, 0)
    out = await records(c, b.output_file_id)
    assert sorted(r["custom_id"] for r in out) == sorted(f"c{i}" for i in range(n))
    assert m.stats.requests_total == n  # each line sent once: nothing retried or re-leased
    await gw.assert_quiet()


# ---- pieces ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("outcome", "expected"),
    [
        (Answered(200, b"{}"), Verdict.DONE),
        (Answered(400, b'{"error":{"code":"invalid_request"}}'), Verdict.DONE),
        (Refused.of(ModelNotFound("no such model")), Verdict.DONE),
        (Refused.of(InvalidRequest("bad")), Verdict.DONE),
        (Refused.of(RateLimited("over", retry_after_ms=850)), Verdict.LATER),
        (Refused.of(UpstreamRateLimited("quota", retry_after_ms=7000)), Verdict.LATER),
        (Refused.of(QueueFull("full")), Verdict.LATER),
        (Refused.of(Overloaded("busy")), Verdict.LATER),
        (Refused.of(Draining("bye")), Verdict.STOP),
        (Refused.of(NoHealthyInstance("none")), Verdict.RETRY),
        # SPEC §14: never failed with queue_timeout while the window is open: queued again
        (Refused.of(QueueTimeout("waited")), Verdict.LATER),
        (Refused.of(UpstreamFailed("bad gateway")), Verdict.RETRY),
        (Answered(502, b"not json"), Verdict.RETRY),
        (Answered(504, b"{}"), Verdict.RETRY),
        (Answered(408, b"{}"), Verdict.RETRY),
        (Answered(429, b"{}"), Verdict.RETRY),
    ],
)
def test_verdicts(outcome: Outcome, expected: Verdict) -> None:
    assert verdict(outcome)[0] is expected


def test_the_limiters_wait_is_read_from_the_refusal_not_its_text() -> None:
    # The wait comes from the domain error's `retry_after_ms`, whatever its message says.
    limited = Refused.of(RateLimited("Rate limit reached; retry after 2s.", retry_after_ms=850))
    assert verdict(limited) == (Verdict.LATER, 0.85)
    assert limited.status == 429 and limited.code == "rate_limited"
    assert b'"code":"rate_limited"' in limited.body
    assert verdict(Refused.of(RateLimited("no wait named"))) == (Verdict.LATER, 1.0)


def test_records_are_json_whatever_the_body() -> None:
    ok, usage, rec = answer_record(
        "batch_req_1", "c", 200, "r", b'{"usage":{"prompt_tokens":3,"completion_tokens":4}}'
    )
    assert ok and usage.total_tokens == 7 and orjson.loads(rec)["response"]["body"]["usage"]
    ok, _, rec = answer_record("batch_req_1", "c", 502, "r", b"<html>bad gateway</html>")
    doc = orjson.loads(rec)
    assert not ok and doc["response"]["body"] == "<html>bad gateway</html>"
    assert doc["error"]["code"] == "http_502"
    assert inspect(b"{broken")[0] is False
