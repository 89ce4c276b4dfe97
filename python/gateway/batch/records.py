"""The lines of a batch's output and error files, built the way OpenAI writes them.

SPEC §14: "Output and error files are JSONL as OpenAI writes them (`id`, `custom_id`,
`response` with `status_code`, `request_id`, `body`; or `error`)."

- a 2xx answer goes to the output file:
  `{"id": "batch_req_…", "custom_id", "response": {"status_code", "request_id", "body"},
  "error": null}`;
- a final non-2xx answer goes to the error file with the response *and* `error: {code,
  message}` read from its body (the upstream's status stays in `response.status_code`);
- a line never executed (the batch expired or was cancelled first) goes to the error file
  with `response: null` and `error.code` `batch_expired` / `batch_cancelled`.

A body is embedded as it came (`orjson.Fragment`, no re-encoding) once one msgspec pass has
proved it is JSON and read its `usage`; anything else is embedded as a JSON string, so a
line of an output file is always one valid JSON document.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import msgspec
import orjson

__all__ = [
    "CANCELLED",
    "EXPIRED",
    "Usage",
    "answer_record",
    "error_of",
    "inspect",
    "line_id",
    "unfinished_record",
]

#: (code, message) of the lines a batch never ran (error file, `response: null`).
EXPIRED = (
    "batch_expired",
    "This request could not be executed before the completion window expired.",
)
CANCELLED = ("batch_cancelled", "This request was not executed because the batch was cancelled.")


@dataclass(frozen=True, slots=True)
class Usage:
    """One answer's token usage, in the Batch object's terms (OpenAI's `usage`)."""

    input_tokens: int = 0
    output_tokens: int = 0
    total_tokens: int = 0
    cached_tokens: int = 0
    reasoning_tokens: int = 0


NO_USAGE = Usage()


class _PromptDetails(msgspec.Struct):
    cached_tokens: int | None = None


class _CompletionDetails(msgspec.Struct):
    reasoning_tokens: int | None = None


class _Usage(msgspec.Struct):
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    total_tokens: int | None = None
    prompt_tokens_details: _PromptDetails | None = None
    completion_tokens_details: _CompletionDetails | None = None


class _Outline(msgspec.Struct):
    """What a body is read for; every other field is skipped (but still checked as JSON)."""

    usage: _Usage | None = None
    # Present or not (kept raw, decoded only for a failure): Raw cannot be in a union.
    error: msgspec.Raw | msgspec.UnsetType = msgspec.UNSET


class _Error(msgspec.Struct):
    code: str | int | None = None
    message: str | None = None
    type: str | None = None


_outline = msgspec.json.Decoder(_Outline)
_error = msgspec.json.Decoder(_Error)


def line_id(batch_id: str, custom_id: str) -> str:
    """The `id` of a line's output record: stable, so a re-run writes the same line."""
    digest = hashlib.blake2b(f"{batch_id}\0{custom_id}".encode(), digest_size=12).hexdigest()
    return "batch_req_" + digest


def _n(value: int | None) -> int:
    return value if isinstance(value, int) and value > 0 else 0


def inspect(body: bytes) -> tuple[bool, Usage, msgspec.Raw | None]:
    """(is JSON, usage, raw `error` member) of a response body, in one pass."""
    try:
        outline = _outline.decode(body)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return False, NO_USAGE, None
    raw_error = None if outline.error is msgspec.UNSET else outline.error
    u = outline.usage
    if u is None:
        return True, NO_USAGE, raw_error
    prompt, completion = _n(u.prompt_tokens), _n(u.completion_tokens)
    usage = Usage(
        input_tokens=prompt,
        output_tokens=completion,
        total_tokens=_n(u.total_tokens) or prompt + completion,
        cached_tokens=_n(u.prompt_tokens_details.cached_tokens if u.prompt_tokens_details else 0),
        reasoning_tokens=_n(
            u.completion_tokens_details.reasoning_tokens if u.completion_tokens_details else 0
        ),
    )
    return True, usage, raw_error


def error_of(status: int, raw_error: msgspec.Raw | None) -> tuple[str, str]:
    """(code, message) of a non-2xx answer: from its OpenAI-shaped `error`, else the status."""
    code, message = f"http_{status}", f"The request failed with HTTP status {status}."
    if raw_error is None:
        return code, message
    try:
        err = _error.decode(raw_error)
    except (msgspec.DecodeError, msgspec.ValidationError):
        try:
            text = msgspec.json.decode(raw_error)
        except msgspec.DecodeError:
            return code, message
        return code, text if isinstance(text, str) and text else message
    return (
        str(err.code) if err.code not in (None, "") else (err.type or code),
        err.message or message,
    )


def answer_record(
    out_id: str, custom_id: str, status: int, request_id: str, body: bytes
) -> tuple[bool, Usage, bytes]:
    """(ok, usage, the JSONL record without its newline) of an executed line."""
    is_json, usage, raw_error = inspect(body)
    embedded: Any = orjson.Fragment(body) if is_json else body.decode("utf-8", "replace")
    response = {"status_code": status, "request_id": request_id, "body": embedded}
    ok = 200 <= status < 300
    error: dict[str, str] | None = None
    if not ok:
        code, message = error_of(status, raw_error)
        error = {"code": code, "message": message}
    record = {"id": out_id, "custom_id": custom_id, "response": response, "error": error}
    return ok, usage, orjson.dumps(record)


def unfinished_record(out_id: str, custom_id: str, why: tuple[str, str]) -> bytes:
    """The error-file record of a line the batch never ran."""
    error = {"code": why[0], "message": why[1]}
    return orjson.dumps({"id": out_id, "custom_id": custom_id, "response": None, "error": error})
