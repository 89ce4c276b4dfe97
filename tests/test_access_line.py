"""The access line built in one call (`gateway._core.LineBuffer.access`, issue 25) is byte for
byte the line the Python code builds (`AccessLog.line` of `AccessValues.values`), in text and
JSON, for every exchange it takes; what it cannot write exactly (a request id the client
chose, which is redacted; a string JSON must escape; an unexpected type) it leaves to Python
and appends nothing."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import types
from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway._core import LineBuffer, Priority
from gateway.access import AccessValues
from gateway.exchange import Attempt, Exchange
from gateway.logs import AccessLog, Sink, _text_stamp
from gateway.redact import Redactor
from gateway.router import Decision

PREFIX = "gw-1a2b-"
WALL = 1_764_644_810.0625  # a tie at the third decimal: rounded to even, as `round` does


def _exchange(**fields: Any) -> Exchange:
    ex = Exchange(f"{PREFIX}17", 100.0, None)  # type: ignore[arg-type]
    for name, value in fields.items():
        setattr(ex, name, value)
    return ex


def _python_line(ex: Exchange, mono: float, fmt: str, wall: float) -> bytes | None:
    """The line, or None where orjson refuses a value (a lone surrogate, an int beyond 64
    bits): the log drops that line and counts it."""
    log = AccessLog(Sink(2), fmt)
    try:
        return log.line(AccessValues(PREFIX, Redactor()).values(ex, mono), wall)
    except orjson.JSONEncodeError:
        return None


def _rust_line(ex: Exchange, mono: float, fmt: str, wall: float) -> bytes | None:
    buf = LineBuffer(_text_stamp)
    n = buf.access(ex, mono, PREFIX, fmt == "json", wall)
    taken = buf.take()
    if n < 0:
        assert taken is None  # nothing appended
        return None
    assert n == 1 and taken is not None and taken[1] == 1
    return taken[0]


DECISION = Decision("p", Priority.LOW, "default", "complex", "length>2000")
EXAMPLES: list[dict[str, Any]] = [
    {},
    {
        "decision": DECISION,
        "pool": "p",
        "instance": "a",
        "queue_ms": 0.25,
        "upstream_ms": 12.75,
        "status": 200,
        "attempts": 1,
        "key_name": "tenant-a",
        "attempt": Attempt(usage={"prompt_tokens": 12, "completion_tokens": 8}),
    },
    {
        "decision": DECISION,
        "waited_as": Priority.HIGH,
        "status": 502,
        "attempts": 3,
        "error": "upstream_error",
        "source": "batch",
        "affinity_key": 7,
        "affinity": "hit",
        "affinity_match": 4096,
        "slo_ttft_ms": 500,
        "slo_result": "met",
    },
    {"slo_tpot_ms": 40, "slo_result": ""},  # an empty verdict is "missed", as `or` makes it
    {"slo_ttft_ms": 40, "affinity_prefix": object(), "affinity": "spill"},
    {"attempt": Attempt(usage={"prompt_tokens": True, "completion_tokens": -1})},
    {"attempt": Attempt(usage={"prompt_tokens": 3.0, "completion_tokens": 2**70})},
    {"attempt": Attempt(usage={}), "instance": "ä-ünïcode-名前"},
    {"queue_ms": -0.04, "upstream_ms": 1e12 + 0.05, "status": 499, "error": "client_closed"},
]


@pytest.mark.parametrize("fmt", ["json", "text"])
@pytest.mark.parametrize("fields", EXAMPLES)
def test_the_line_built_in_one_call_is_the_python_line(fmt: str, fields: dict[str, Any]) -> None:
    ex = _exchange(**fields)
    ours = _rust_line(ex, 100.123456, fmt, WALL)
    if ours is None:  # left to Python: only the count beyond 64 bits among these
        assert fields.get("attempt") is not None and 2**70 in fields["attempt"].usage.values()
        return
    assert ours == _python_line(ex, 100.123456, fmt, WALL)


@pytest.mark.parametrize("fmt", ["json", "text"])
@pytest.mark.parametrize(
    "fields",
    [
        {"request_id": "client-id-1"},  # the client's: redacted by Python
        {"request_id": PREFIX},  # no ticket
        {"request_id": PREFIX + "12a"},
        {"request_id": PREFIX + "١٢"},  # digits, but not ASCII: Python's isdigit decides
        {"queue_ms": 1},  # an int where a float is kept: round() keeps it an int
        {"queue_ms": float("nan")},
        {"status": True},
        {"decision": "not a decision"},
        {"key_name": 7},
    ],
)
def test_what_it_cannot_write_exactly_is_left_to_python(fmt: str, fields: dict[str, Any]) -> None:
    assert _rust_line(_exchange(**fields), 100.5, fmt, WALL) is None


def test_an_object_of_another_type_is_read_by_name() -> None:
    """The exchange's fields are read through its type's slot descriptors; an object of
    another type (here a namespace of the same fields) by `getattr`, the same line — and a
    buffer that sees both, in turn, keeps telling them apart."""
    ex = _exchange(**EXAMPLES[2])
    other = types.SimpleNamespace(**{f.name: getattr(ex, f.name) for f in dataclasses.fields(ex)})
    want = _python_line(ex, 100.5, "json", WALL)
    assert want is not None
    buf = LineBuffer(_text_stamp)
    for item in (ex, other, ex, other):
        assert buf.access(item, 100.5, PREFIX, True, WALL) > 0
    taken = buf.take()
    assert taken is not None and taken == (want * 4, 4)


@pytest.mark.parametrize("text", ['a"b', "a\\b", "a\nb", "a\tb", "a\x01b"])
def test_a_string_json_escapes_is_left_to_orjson(text: str) -> None:
    ex = _exchange(error=text)
    assert _rust_line(ex, 100.5, "json", WALL) is None
    assert _rust_line(ex, 100.5, "text", WALL) == _python_line(ex, 100.5, "text", WALL)


def _surrogate(text: str) -> bool:
    return any(0xD800 <= ord(c) <= 0xDFFF for c in text)


def _escaped(text: str) -> bool:
    return any(c in '"\\' or ord(c) < 0x20 for c in text)


names = st.one_of(st.none(), st.text(max_size=12))
ms = st.one_of(
    st.floats(min_value=0, max_value=1e7, allow_nan=False),
    st.integers(0, 10**6).map(lambda n: n / 100),  # ties at the second decimal
)
counts = st.one_of(st.none(), st.integers(-5, 2**40), st.booleans(), st.just(2**64))


@settings(max_examples=400, deadline=None)
@given(
    fmt=st.sampled_from(["json", "text"]),
    pool=names,
    error=names,
    key=names,
    queue_ms=ms,
    upstream_ms=ms,
    elapsed=ms,
    status=st.integers(0, 599),
    prompt=counts,
    completion=counts,
    waited=st.sampled_from([None, Priority.HIGH, Priority.LOW]),
    decided=st.booleans(),
    wall=st.floats(min_value=1e9, max_value=2e9, allow_nan=False),
)
def test_any_exchange_it_takes_gives_the_python_line(
    fmt: str,
    pool: str | None,
    error: str | None,
    key: str | None,
    queue_ms: float,
    upstream_ms: float,
    elapsed: float,
    status: int,
    prompt: Any,
    completion: Any,
    waited: Priority | None,
    decided: bool,
    wall: float,
) -> None:
    usage = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": 3}
    ex = _exchange(
        pool=pool,
        error=error,
        key_name=key,
        queue_ms=queue_ms,
        upstream_ms=upstream_ms,
        status=status,
        attempt=Attempt(usage=usage),
        waited_as=waited,
        decision=DECISION if decided else None,
    )
    mono = ex.started + elapsed / 1000
    ours = _rust_line(ex, mono, fmt, wall)
    theirs = _python_line(ex, mono, fmt, wall)
    if ours is None:  # left to Python: only for a reason
        texts = [t for t in (pool, error, key) if t is not None]
        assert (
            any(_surrogate(t) for t in texts)
            or (fmt == "json" and any(_escaped(t) for t in texts))
            or 2**64 in (prompt, completion)
        )
        return
    assert ours == theirs
    if fmt == "json":
        assert orjson.loads(ours)["status"] == status


async def test_lines_keep_their_order_with_other_records() -> None:
    """Access lines built in one call and other records' lines share one buffer: the writer
    gets them in the order they came, and the count of lines is right for the drop count."""
    r, w = os.pipe()
    try:
        sink = Sink(w)
        access = AccessLog(sink, "json")
        source = AccessValues(PREFIX, Redactor())
        sink.write(b"first\n")  # binds the sink to this loop
        access.record(source, _exchange(status=200))
        access.record(source, _exchange(request_id="client-chosen", status=201))  # Python's
        sink.write(b"middle\n")
        access.record(source, _exchange(status=202))
        assert len(sink._lines) == 5
        sink.flush()
        await asyncio.sleep(0)
        sink.close()
        out = os.read(r, 1 << 16).splitlines()
    finally:
        os.close(r)
        os.close(w)
    assert out[0] == b"first" and out[3] == b"middle"
    assert [orjson.loads(out[i])["status"] for i in (1, 2, 4)] == [200, 201, 202]
    assert orjson.loads(out[2])["id"] == "client-chosen"
