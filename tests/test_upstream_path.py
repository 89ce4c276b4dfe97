"""Regression tests for the upstream path's findings that are not about a hostile backend's
bytes (those live in test_hostile.py): secrets in logs, ingress polish, the buffered-bytes
bound, bugs that must still be answered, counted and leave no slot behind."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
from pathlib import Path
from typing import Any

import openai
import orjson
import pytest

from gateway import forward, http1
from gateway.metrics import Metrics
from gateway.redact import REDACTOR, RedactingFilter, Redactor
from gateway.sse import SseChecker
from support import (
    GatewayFactory,
    MockFactory,
    RunningGateway,
    chat,
    free_port,
    pool_config,
    simple_config,
)

CANARY_CLIENT = "sk-client-canary-7f3a9c1e5b"
CANARY_ADMIN = "sk-admin-canary-2d8e4f6a1c"
CANARY_UP = "sk-upstream-canary-9b1d3f5e7a"


async def _raw(port: int, payload: bytes, within: float = 5.0) -> bytes:
    """Sends raw bytes, returns everything the server answers until it closes."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(payload)
        await writer.drain()
        chunks = []
        async with asyncio.timeout(within):
            while data := await reader.read(65536):
                chunks.append(data)
                if b"\r\n\r\n" in b"".join(chunks) and _complete(b"".join(chunks)):
                    break
        return b"".join(chunks)
    finally:
        writer.close()


def _complete(data: bytes) -> bool:
    head, _, body = data.partition(b"\r\n\r\n")
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            return len(body) >= int(line.split(b":", 1)[1])
    return False


def _split(answer: bytes) -> tuple[int, dict[str, str], bytes]:
    head, _, body = answer.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    return int(lines[0].split(" ")[1]), headers, body


def _port(gw: RunningGateway) -> int:
    return int(gw.url.rsplit(":", 1)[1])


MALFORMED = [
    # a control character after the key
    b"Authorization: Bearer " + CANARY_CLIENT.encode() + b"\x0b\r\n",
    # a bare LF ending the header line
    b"Authorization: Bearer " + CANARY_CLIENT.encode() + b"\n",
    # a space before the colon
    b"Authorization : Bearer " + CANARY_CLIENT.encode() + b"\r\n",
    # obs-fold (a continuation line)
    b"Authorization: Bearer\r\n " + CANARY_CLIENT.encode() + b"\r\n",
]


@pytest.mark.parametrize("bad", MALFORMED, ids=["ctl", "bare-lf", "space-colon", "obs-fold"])
async def test_malformed_header_is_an_openai_400_that_echoes_nothing(
    bad: bytes, mocks: MockFactory, gateway_factory: GatewayFactory
) -> None:
    m = await mocks()
    gw = await gateway_factory(simple_config(pool_config(m)))
    body = orjson.dumps(chat())
    payload = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
        + bad
        + b"Content-Type: application/json\r\nContent-Length: "
        + str(len(body)).encode()
        + b"\r\n\r\n"
        + body
    )
    status, headers, answer = _split(await _raw(_port(gw), payload))
    assert status == 400
    assert headers["content-type"].startswith("application/json")
    assert headers["x-content-type-options"] == "nosniff"
    err = orjson.loads(answer)["error"]
    assert err["code"] == "invalid_request" and set(err) == {"message", "type", "param", "code"}
    assert CANARY_CLIENT.encode() not in answer
    assert b"Authorization" not in answer
    await gw.assert_quiet()


@pytest.mark.timeout(60)
async def test_no_key_reaches_the_log_even_from_aiohttp_and_tracebacks(
    tmp_path: Path, mocks: MockFactory
) -> None:
    """A real `gateway serve` with JSON logs: malformed requests carrying a client key, an
    upstream that echoes the gateway's key in its errors, and the admin key: none of the three
    appears anywhere on stderr, and no traceback is logged for a client's bad bytes."""
    m = await mocks(fail_rate=1.0, fail_status=500)
    port = free_port()
    cfg = tmp_path / "gw.yaml"
    cfg.write_text(
        orjson.dumps(
            {
                "listen": {"host": "127.0.0.1", "port": port},
                "health": {"probe": {"enabled": False}},
                "shutdown": {"drain_delay_ms": 0},  # no load balancer to wait for (SPEC §7)
                "retries": {"max_attempts": 1},
                "pools": {
                    "p": {
                        "instances": [
                            {
                                "name": "a",
                                "url": m.url,
                                "model": "x",
                                "api_key": CANARY_UP,
                                "max_concurrency": 2,
                            }
                        ]
                    }
                },
                "models": {"m": {"pool": "p"}},
                "auth": {
                    "keys": [{"key": CANARY_CLIENT, "name": "k"}],
                    "admin_key": CANARY_ADMIN,
                },
            }
        ).decode()
    )
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "gateway.cli",
        "--log-format",
        "json",
        "serve",
        "--config",
        str(cfg),
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        for _ in range(200):
            try:
                _, w = await asyncio.open_connection("127.0.0.1", port)
                w.close()
                break
            except OSError:
                await asyncio.sleep(0.05)
        body = orjson.dumps(chat())
        for bad in MALFORMED:
            payload = (
                b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                + bad
                + b"Content-Type: application/json\r\nContent-Length: "
                + str(len(body)).encode()
                + b"\r\n\r\n"
                + body
            )
            assert _split(await _raw(port, payload))[0] == 400
        client = openai.AsyncOpenAI(
            base_url=f"http://127.0.0.1:{port}/v1", api_key=CANARY_CLIENT, max_retries=0
        )
        with pytest.raises(openai.APIStatusError) as caught:
            await client.chat.completions.create(
                model="m", messages=[{"role": "user", "content": "hi"}]
            )
        assert caught.value.status_code == 502
        await client.close()
        admin = f"GET /admin/state HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {CANARY_ADMIN}"
        status, _, state = _split(await _raw(port, (admin + "\r\n\r\n").encode()))
        assert status == 200
        assert CANARY_UP.encode() not in state
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = await asyncio.wait_for(proc.communicate(), 30)
    text = err.decode("utf-8", "replace")
    assert '"msg":"request"' in text  # the access log ran
    for canary in (CANARY_CLIENT, CANARY_ADMIN, CANARY_UP):
        assert canary not in text
    assert "Traceback" not in text


def test_redacting_filter_masks_messages_arguments_fields_and_tracebacks() -> None:
    redactor = Redactor()
    redactor.update({"topsecret-value-123"})
    try:
        raise ValueError("header line b'Authorization: Bearer sk-zzzzzzzzzzzz\\x0b'")
    except ValueError:
        record = logging.LogRecord(
            "aiohttp.server",
            logging.ERROR,
            __file__,
            1,
            "saw %s",
            ("topsecret-value-123",),
            sys.exc_info(),
        )
    record.fields = {"why": "Bearer abcdefghijkl", "n": 3}
    assert RedactingFilter(redactor).filter(record)
    rendered = record.getMessage() + str(record.exc_text) + str(record.fields)
    assert "topsecret-value-123" not in rendered
    assert "sk-zzzzzzzzzzzz" not in rendered
    assert "abcdefghijkl" not in rendered
    assert "[redacted]" in rendered and "ValueError" in rendered


async def test_405_names_the_allowed_methods_and_every_answer_is_nosniff(
    mocks: MockFactory, gateway_factory: GatewayFactory
) -> None:
    m = await mocks()
    gw = await gateway_factory(simple_config(pool_config(m)))
    async with gw.session.get(gw.url + "/v1/chat/completions") as resp:
        assert resp.status == 405
        assert resp.headers["Allow"] == "POST"
        assert (await resp.json())["error"]["code"] == "method_not_allowed"
        assert resp.headers["X-Content-Type-Options"] == "nosniff"
    for path in ("/livez", "/readyz", "/metrics", "/dashboard", "/admin/state", "/nope"):
        async with gw.session.get(gw.url + path) as resp:
            assert resp.headers["X-Content-Type-Options"] == "nosniff", path
    async with gw.session.post(gw.url + "/v1/chat/completions", json=chat()) as resp:
        assert resp.status == 200
        assert resp.headers["X-Content-Type-Options"] == "nosniff"
        assert resp.content_type == "application/json"


async def test_a_non_utf8_key_is_401_not_500(
    mocks: MockFactory, gateway_factory: GatewayFactory
) -> None:
    m = await mocks()
    gw = await gateway_factory(
        simple_config(pool_config(m), auth={"keys": [{"key": "sk-good-key-1234", "name": "k"}]})
    )
    body = orjson.dumps(chat())
    payload = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer sk-\xff\xfe\r\n"
        b"Content-Type: application/json\r\nContent-Length: "
        + str(len(body)).encode()
        + b"\r\n\r\n"
        + body
    )
    status, _, answer = _split(await _raw(_port(gw), payload))
    assert status == 401
    assert orjson.loads(answer)["error"]["code"] == "invalid_api_key"


@pytest.mark.parametrize("depth", [200, 255, 600, 1024])
async def test_deep_json_is_a_400_not_a_500(
    depth: int, mocks: MockFactory, gateway_factory: GatewayFactory
) -> None:
    m = await mocks()
    gw = await gateway_factory(simple_config(pool_config(m)))
    nested = "[" * depth + "]" * depth
    raw = b'{"model":"m","messages":[{"role":"user","content":"hi"}],"extra":' + nested.encode()
    raw += b"}"
    async with gw.session.post(
        gw.url + "/v1/chat/completions", data=raw, headers={"Content-Type": "application/json"}
    ) as resp:
        assert resp.status in (200, 400), await resp.text()
        if resp.status == 400:
            assert (await resp.json())["error"]["code"] == "invalid_request"
    await gw.assert_quiet()


async def test_buffered_bytes_bound_answers_503_overloaded_and_frees_on_completion(
    mocks: MockFactory, gateway_factory: GatewayFactory
) -> None:
    m = await mocks(latency_ms=600)
    gw = await gateway_factory(
        simple_config(pool_config((m, 4)), limits={"max_buffered_bytes": 3000})
    )
    big = chat("x" * 2000)
    first = asyncio.create_task(gw.post("/v1/chat/completions", big))
    await gw.wait_in_flight(1)
    async with await gw.post("/v1/chat/completions", big) as resp:
        assert resp.status == 503
        assert (await resp.json())["error"]["code"] == "overloaded"
        assert int(resp.headers["Retry-After"]) >= 1
    async with await first as resp:
        assert resp.status == 200
    async with await gw.post("/v1/chat/completions", big) as resp:
        assert resp.status == 200
    assert (await gw.state())["buffered_bytes"] == 0
    await gw.assert_quiet()


class Boom(RuntimeError):
    pass


def _boom(*args: Any, **kwargs: Any) -> Any:
    raise Boom("injected")


async def _aboom(*args: Any, **kwargs: Any) -> Any:
    raise Boom("injected")


# Every step of an attempt, in order: send, read the head's body, inspect it, meter it, count
# tokens; for streams: read a chunk, check it.
STEPS: list[tuple[str, Any, str, Any]] = [
    ("open", forward.Upstream, "open", _aboom),
    ("read", http1.Response, "read", _aboom),
    ("readany", http1.Response, "readany", _aboom),
    ("inspect", forward, "inspect_body", _boom),
    ("metrics.attempt", Metrics, "attempt", _boom),
    ("metrics.tokens", Metrics, "used_tokens", _boom),
    ("sse.feed", SseChecker, "feed", _boom),
    ("body_for_model", forward.UpstreamBody, "for_model", _boom),
]


@pytest.mark.parametrize("step", STEPS, ids=[s[0] for s in STEPS])
@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
async def test_an_exception_at_any_step_is_answered_counted_and_leaks_nothing(
    step: tuple[str, Any, str, Any],
    stream: bool,
    mocks: MockFactory,
    gateway_factory: GatewayFactory,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    m = await mocks()
    gw = await gateway_factory(simple_config(pool_config((m, 1))))
    _, target, name, fake = step
    monkeypatch.setattr(target, name, fake)
    async with await gw.post("/v1/chat/completions", chat(stream=stream)) as resp:
        text = await resp.text()
        answered = resp.status
        if resp.status != 200:
            assert resp.status in (500, 502), text
            assert resp.content_type == "application/json"
            assert set(orjson.loads(text)["error"]) == {"message", "type", "param", "code"}
        elif stream:
            # The step failed after the stream started: it ends with an error event.
            assert '"error"' in text or "[DONE]" in text
    monkeypatch.undo()
    await gw.assert_quiet()
    # The slot came back: the single-slot instance serves again.
    async with await gw.post("/v1/chat/completions", chat()) as resp:
        assert resp.status == 200
    async with gw.session.get(gw.url + "/metrics") as resp:
        metrics = await resp.text()
    if answered != 200:
        # Every error answer is counted, a 500 included.
        assert f'code="{answered}"' in metrics
    await gw.assert_quiet()


def test_the_process_redactor_knows_configured_secrets() -> None:
    from gateway.app import Gateway
    from gateway.config import parse_config

    cfg = parse_config(
        orjson.dumps(
            simple_config(
                {
                    "instances": [
                        {
                            "name": "a",
                            "url": "http://127.0.0.1:1/v1",
                            "model": "x",
                            "api_key": "sk-known-to-redactor-42",
                            "max_concurrency": 1,
                        }
                    ]
                }
            )
        ).decode(),
        env={},
    )
    Gateway(cfg)
    assert "sk-known-to-redactor-42" not in REDACTOR.redact("key sk-known-to-redactor-42 here")
