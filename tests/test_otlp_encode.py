"""The exporter's OTLP/JSON batch written by the extension in one call (`_core.otlp_spans`,
issue 25) is byte for byte what the Python encoder (`Tracing._encode_py`, the reference)
writes; values outside its common case leave the batch to Python."""

from __future__ import annotations

import asyncio
import enum
import json
import math
import random
import struct
from typing import Any

import orjson
import pytest

from gateway._core import otlp_spans
from gateway.telemetry import Tracing
from otlp_receiver import OtlpReceiver
from support import GatewayFactory, MockFactory, chat, pool_config, simple_config

# Characters a string may be drawn from: JSON's escapes, every control character, DEL,
# separators JavaScript cares about, non-ASCII of 2, 3 and 4 bytes.
_CHARS = (
    [chr(i) for i in range(0x20)]
    + list('"\\/ abcXYZ019._-:{}[],')
    + ["\x7f", "\x80", "é", "ß", "\u2028", "\u2029", "中", "\ufeff", "😀", "\U0010ffff"]
)
_FLOATS = [
    0.0,
    -0.0,
    0.1,
    -0.1,
    1e-7,
    1e-5,
    1e-4,
    0.0001234,
    1e15,
    1e16,
    1e21,
    1e22,
    -1e300,
    5e-324,
    2.2250738585072014e-308,
    1.7976931348623157e308,
    0.30000000000000004,
    123456789012345678.0,
    9007199254740993.0,
    math.pi,
    math.nan,
    math.inf,
    -math.inf,
]


def _tracing() -> Tracing:
    # An exporter that is never called: these tests only encode.
    return Tracing("http://127.0.0.1:9/v1/traces", 'svc "quoted" é', exporter=lambda b: True)


def _text(rng: random.Random) -> str:
    return "".join(rng.choice(_CHARS) for _ in range(rng.randrange(0, 12)))


def _float(rng: random.Random) -> float:
    pick = rng.random()
    if pick < 0.3:
        return rng.choice(_FLOATS)
    if pick < 0.6:
        # any bit pattern: every exponent, subnormals, NaN payloads, infinities
        return float(struct.unpack("<d", rng.getrandbits(64).to_bytes(8, "little"))[0])
    if pick < 0.7:
        return round(rng.uniform(-1e4, 1e4), rng.randrange(0, 8))
    if pick < 0.8:  # subnormals: several shortest forms round-trip, repr takes the closest
        return float(
            struct.unpack("<d", rng.getrandbits(rng.randrange(1, 53)).to_bytes(8, "little"))[0]
        )
    return rng.uniform(-1, 1) * 10.0 ** rng.randrange(-30, 30)


def _value(rng: random.Random) -> Any:
    pick = rng.randrange(6)
    if pick == 0:
        return _text(rng)
    if pick == 5:  # an array of strings (`gen_ai.response.finish_reasons`)
        texts = [_text(rng) for _ in range(rng.randrange(0, 4))]
        return texts if rng.random() < 0.5 else tuple(texts)
    if pick == 1:
        return rng.random() < 0.5
    if pick == 2:
        return rng.choice(
            [0, 1, -1, 2**63 - 1, -(2**63), rng.randrange(-(2**63), 2**63), rng.randrange(1000)]
        )
    return _float(rng)


def _record(rng: random.Random, attrs: dict[str, Any] | None = None) -> tuple[Any, ...]:
    return (
        rng.getrandbits(128) or 1,
        rng.getrandbits(64) or 1,
        rng.choice([0, rng.getrandbits(64) or 1]),
        rng.choice(["POST /v1/chat/completions", "queue", "chat m", _text(rng)]),
        rng.choice([1, 2, 3]),
        rng.randrange(2**62),
        rng.randrange(2**62),
        attrs
        if attrs is not None
        else {_text(rng): _value(rng) for _ in range(rng.randrange(0, 40))},
        rng.choice([0, 0, 2]),
        rng.choice(["", "", "vendor=a,b@c=x", _text(rng)]),
    )


def test_random_batches_are_byte_identical() -> None:
    tracing = _tracing()
    rng = random.Random(25)
    rust = 0
    for _ in range(400):
        batch = [_record(rng) for _ in range(rng.randrange(0, 12))]
        want = tracing._encode_py(batch)
        got = otlp_spans(batch, tracing._prefix)
        assert got == want
        assert tracing._encode(batch) == want
        rust += got is not None
        body = json.loads(want)  # the reference is valid JSON
        assert len(body["resourceSpans"][0]["scopeSpans"][0]["spans"]) == len(batch)
    assert rust == 400  # every one of these written by the extension


def test_floats_as_repr_and_proto3_strings() -> None:
    tracing = _tracing()
    rng = random.Random(7)
    values = _FLOATS + [_float(rng) for _ in range(20_000)]
    batch = [_record(rng, {"x": v}) for v in values]
    got = otlp_spans(batch, tracing._prefix)
    assert got == tracing._encode_py(batch)
    spans = orjson.loads(got or b"")["resourceSpans"][0]["scopeSpans"][0]["spans"]
    assert spans[0]["attributes"] == [{"key": "x", "value": {"doubleValue": 0.0}}]
    assert b'"doubleValue":1e-07}' in (got or b"")
    assert b'"doubleValue":"NaN"' in (got or b"") and b'"doubleValue":"-Infinity"' in (got or b"")


class _Kind(enum.IntEnum):
    A = 1


class _Str(str):
    pass


@pytest.mark.parametrize(
    "value",
    [
        2**63,  # beyond 64 bits
        -(2**63) - 1,
        2**200,
        ["a", 1],  # an array of something else than strings
        ("a", None),
        [["a"]],
        {"nested": 1},
        None,
        _Kind.A,  # subclasses: not exactly an int, a str
        _Str("s"),
        b"bytes",
    ],
)
def test_values_outside_the_common_case_fall_back_to_python(value: Any) -> None:
    tracing = _tracing()
    rng = random.Random(3)
    batch = [_record(rng), _record(rng, {"a": "x", "odd": value, "n": 1}), _record(rng)]
    assert otlp_spans(batch, tracing._prefix) is None
    # ... and the batch is still exported, as Python writes it
    assert tracing._encode(batch) == tracing._encode_py(batch)


def test_a_string_that_is_not_utf8_fails_as_before() -> None:
    tracing = _tracing()
    rng = random.Random(4)
    batch = [_record(rng, {"k": "lone \ud800 surrogate"})]
    assert otlp_spans(batch, tracing._prefix) is None
    with pytest.raises(orjson.JSONEncodeError):
        tracing._encode(batch)


def test_an_empty_batch_and_the_prefix() -> None:
    tracing = _tracing()
    assert otlp_spans([], tracing._prefix) == tracing._encode_py([])
    body = orjson.loads(tracing._encode([]))
    resource = body["resourceSpans"][0]["resource"]["attributes"]
    assert {"key": "service.name", "value": {"stringValue": 'svc "quoted" é'}} in resource


async def test_a_traced_gateway_exports_batches_the_extension_wrote(
    mocks: MockFactory, gateway_factory: GatewayFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Through a real gateway: every batch of real spans (finish reasons as arrays, a client's
    tracestate, floats, ints) is written by the extension, equal to the Python encoder's, and
    the collector receives them."""
    written: list[tuple[bytes, bytes, bool]] = []
    encode = Tracing._encode

    def checked(self: Tracing, batch: list[Any]) -> bytes:
        body = encode(self, batch)
        written.append((body, self._encode_py(batch), otlp_spans(batch, self._prefix) is not None))
        return body

    monkeypatch.setattr(Tracing, "_encode", checked)
    up = await mocks()
    with OtlpReceiver() as otlp:
        gw = await gateway_factory(
            simple_config(pool_config(up), telemetry={"otlp_endpoint": otlp.url})
        )
        client = {
            "traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "tracestate": 'vendor=a"b,other=1',
        }
        for body, headers in [
            (chat(), {}),
            (chat(stream=True, max_tokens=5, temperature=0.25), {}),
            (chat(temperature=1), client),
        ]:
            async with await gw.post("/v1/chat/completions", body, headers=headers) as resp:
                assert resp.status == 200
                await resp.read()
        tracing = gw.gateway.tracing
        assert tracing is not None
        assert await asyncio.to_thread(tracing.force_flush, 10_000)
        spans = await otlp.wait_for(9)
    assert written and all(body == py and rust for body, py, rust in written)
    assert any(s.attributes.get("gen_ai.response.finish_reasons") == ["length"] for s in spans)
    assert any(s.trace_id == "4bf92f3577b34da6a3ce929d0e0e4736" for s in spans)
