"""SPEC §17 latency objectives, the gateway's side: where a request's objectives come from, its
deadline, and whether it met them.

- **Objectives**: the request's `x-slo-ttft-ms` / `x-slo-tpot-ms` headers (or llm-d's newer
  `x-llm-d-slo-ttft-ms` / `x-llm-d-slo-tpot-ms`), else its key's `slo_ttft_ms` / `slo_tpot_ms`,
  else its class's (`scheduler.high.slo_ttft_ms`); a Batch API line's TTFT objective is the time
  left in its batch's `completion_window`.
- **Deadline**: arrival (when the gateway got the request) + the TTFT objective, on the core's
  clock; time queued counts, and retries keep it. The core orders queues by it and predicts
  whether an instance can meet it.
- **Verdict** (`X-Gateway-SLO`, `gateway_slo_requests_total`): a non-streamed answer met its
  objectives when all of it came within the TTFT objective (+ the TPOT objective × its
  completion tokens) of arrival. A stream's head goes out with its first content token, so its
  header judges TTFT; the final verdict (TTFT and TPOT over the whole stream, and a failure
  after it started) is the metric's and the access log's.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Final

from gateway.config import ClassSettings
from gateway.errors import InvalidRequest
from gateway.limits import prompt_tokens

__all__ = [
    "TPOT_HEADERS",
    "TTFT_HEADERS",
    "final_verdict",
    "header_objective",
    "judge_answer",
    "judge_first_token",
    "objectives",
    "prompt_tokens",  # the per-key tpm limit's estimate, without the completion budget
]

# SPEC §17: "the header names llm-d's endpoint picker reads (it now also reads
# `x-llm-d-slo-ttft-ms` / `x-llm-d-slo-tpot-ms`: accept both)".
TTFT_HEADERS: Final = ("x-slo-ttft-ms", "x-llm-d-slo-ttft-ms")
TPOT_HEADERS: Final = ("x-slo-tpot-ms", "x-llm-d-slo-tpot-ms")
# An objective longer than this (about 285,000 years) is no objective a clock can hold.
_MAX_MS: Final = 2**53


def header_objective(headers: Mapping[str, str], names: tuple[str, ...]) -> int | None:
    """The objective the request's headers give in ms (the first of `names` present), or
    None. A value that is not a positive number of milliseconds is 400 `invalid_request`
    (SPEC §7 "bad header values"), whichever of the names carries it."""
    found: int | None = None
    for name in names:
        raw = headers.get(name)
        if raw is None:
            continue
        try:
            value = float(raw.strip())
        except ValueError:
            value = math.nan
        if not (0 < value <= _MAX_MS):  # NaN fails too
            raise InvalidRequest(f"{name} must be a positive number of milliseconds.", param=name)
        if found is None:
            found = max(1, math.ceil(value))
    return found


def objectives(
    headers: Mapping[str, str],
    key: tuple[int | None, int | None],
    cls: ClassSettings,
) -> tuple[int | None, int | None]:
    """(TTFT, TPOT) objectives in ms. SPEC §17 precedence: header, key, class."""
    ttft = header_objective(headers, TTFT_HEADERS)
    tpot = header_objective(headers, TPOT_HEADERS)
    if ttft is None:
        ttft = key[0] if key[0] is not None else cls.slo_ttft_ms
    if tpot is None:
        tpot = key[1] if key[1] is not None else cls.slo_tpot_ms
    return ttft, tpot


def _within(ttft_ms: int | None, tpot_ms: int | None, elapsed_ms: float, tokens: int) -> bool:
    budget = float(ttft_ms or 0) + (tpot_ms or 0) * max(0, tokens)
    return elapsed_ms <= budget


def judge_answer(
    ttft_ms: int | None, tpot_ms: int | None, elapsed_s: float, completion_tokens: int | None
) -> str:
    """A non-streamed answer complete `elapsed_s` after arrival: `met` iff it came within the
    TTFT objective (+ the TPOT objective × its completion tokens, when one is set)."""
    if ttft_ms is None and tpot_ms is None:
        return "none"
    if ttft_ms is None:
        # TPOT alone: the whole answer within TPOT × tokens (the prefill is not excused).
        return "met" if _within(0, tpot_ms, elapsed_s * 1000, completion_tokens or 1) else "missed"
    tokens = completion_tokens or 0
    return "met" if _within(ttft_ms, tpot_ms, elapsed_s * 1000, tokens) else "missed"


def judge_first_token(ttft_ms: int | None, tpot_ms: int | None, ttft_s: float) -> str:
    """A stream's head, sent with its first content token `ttft_s` after arrival: the TTFT
    verdict (a stream with a TPOT objective alone says `none` there: nothing is known yet)."""
    if ttft_ms is None:
        return "none"
    return "met" if ttft_s * 1000 <= ttft_ms else "missed"


def final_verdict(
    ttft_ms: int | None,
    tpot_ms: int | None,
    ttft_s: float,
    decode_s: float,
    tokens: int,
) -> str:
    """A stream that ended well: `met` iff its first token came within the TTFT objective and
    its later tokens within the TPOT objective on average (`decode_s` from the first token to
    the end, over `tokens` - 1 intervals)."""
    if ttft_ms is None and tpot_ms is None:
        return "none"
    if ttft_ms is not None and ttft_s * 1000 > ttft_ms:
        return "missed"
    if tpot_ms is not None and tokens > 1 and decode_s * 1000 / (tokens - 1) > tpot_ms:
        return "missed"
    return "met"
