"""The SSE checker's fast path (one complete one-line `data:` event per piece, the common
token-stream piece) decides exactly what the general path decides, and the event bound holds
for complete events too (SPEC §16)."""

from __future__ import annotations

import pytest

from gateway.sse import EventTooLarge, MalformedEvent, SseChecker

USAGE = b'data: {"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":5}}\n\n'
CHUNK = b'data: {"choices":[{"index":0,"delta":{"content":"hi"},"finish_reason":null}]}\n\n'
LAST = b'data: {"choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}\n\n'
ERROR = b'data: {"error":{"message":"boom","type":"server_error"}}\n\n'
DONE = b"data: [DONE]\n\n"


def _run(pieces: list[bytes], traced: bool = False) -> tuple[bytes, SseChecker]:
    checker = SseChecker(1 << 20)
    if traced:
        checker.finish_reasons = []
    out = b"".join(checker.feed(p) for p in pieces)
    return out + checker.finish(), checker


def _state(c: SseChecker) -> tuple[object, ...]:
    return (c.usage, c.upstream_error, c.done, c.data_events, c.finish_reasons)


@pytest.mark.parametrize("traced", [False, True])
def test_one_event_per_piece_reads_what_the_whole_stream_reads(traced: bool) -> None:
    events = [CHUNK, CHUNK, LAST, USAGE, ERROR, DONE, CHUNK]
    fast_out, fast = _run(events, traced)  # each piece one event: the fast path
    slow_out, slow = _run([b"".join(events)], traced)  # one piece: the general path
    assert fast_out == slow_out == b"".join(events[:-1])  # nothing after [DONE]
    assert _state(fast) == _state(slow)
    assert fast.usage == {"prompt_tokens": 3, "completion_tokens": 5}
    assert fast.upstream_error == "boom"
    assert fast.finish_reasons == (["stop"] if traced else None)


@pytest.mark.parametrize(
    "piece",
    [
        b"data: {not json}\n\n",
        b"data: {}\r\n\r\n data: 1\n\n",
        b"nonsense {}\n\n",
    ],
)
def test_malformed_pieces_are_refused(piece: bytes) -> None:
    with pytest.raises(MalformedEvent):
        SseChecker().feed(piece)


def test_crlf_and_multi_line_events_take_the_general_path() -> None:
    checker = SseChecker()
    assert checker.feed(b'data: {"a":1}\r\n\r\n') == b'data: {"a":1}\r\n\r\n'
    assert checker.feed(b': comment\ndata: {"b":2}\n\n') == b': comment\ndata: {"b":2}\n\n'
    assert checker.data_events == 2


@pytest.mark.parametrize("split", [False, True])
def test_a_complete_event_over_the_bound_is_refused(split: bool) -> None:
    """SPEC §16: one event is bounded by `limits.max_event_bytes`, also when it arrives
    complete in one piece (before, only an unfinished event was measured)."""
    big = b'data: {"x":"' + b"y" * 200 + b'"}\n\n'
    checker = SseChecker(max_event_bytes=100)
    with pytest.raises(EventTooLarge):
        if split:
            checker.feed(CHUNK[:-2])
            checker.feed(b"\n\n" + big)
        else:
            checker.feed(big)
    # At the bound itself it passes.
    exact = b'data: {"x":"' + b"y" * 86 + b'"}'
    assert len(exact) == 100
    assert SseChecker(max_event_bytes=100).feed(exact + b"\n\n") == exact + b"\n\n"
