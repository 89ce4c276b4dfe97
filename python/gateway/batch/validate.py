"""Validation of a batch's input file, line by line, before anything runs.

SPEC §14 with OpenAI's rules: a batch over a bad file ends `failed` with
`errors.data[{code, line, message, param}]` and nothing of it is executed. Every line must be a
JSON object with a unique string `custom_id`, `method: "POST"`, `url` equal to the batch's
`endpoint` and a `body` the live endpoint would accept (`messages.parse_request`, the very
check an HTTP request passes), without `stream: true` and naming a model alias the creating
key may use. The file as a whole must hold at least one and at most `batch.max_lines` requests.

Codes are OpenAI's where it documents one (`invalid_json_line`, `duplicate_custom_id`,
`url_mismatch`, `empty_file`, `too_many_tasks`), else named after the gateway's own error codes
(`missing_required_parameter`, `invalid_method`, `invalid_request`, `model_not_found`).
Line numbers are 1-based physical lines; blank lines are skipped (a trailing newline is
common). At most `MAX_ERRORS` errors are kept (SPEC §16: nothing grows without bound).

`check_file` runs in a worker thread (a 200 MB file is seconds of CPU, which must not stall the
event loop) and hands valid lines to `sink` in chunks as it goes, so memory stays bounded by
one chunk whatever the file's size.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, Final

import orjson

from gateway.errors import InvalidRequest
from gateway.messages import Endpoint, parse_request

__all__ = ["MAX_CUSTOM_ID", "MAX_ERRORS", "Checked", "LineError", "Rules", "check_file"]

MAX_ERRORS: Final = 100
MAX_CUSTOM_ID: Final = 512
CHUNK_LINES: Final = 1000


class LineError(Exception):
    """One entry of `errors.data`."""

    def __init__(self, code: str, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.param = param

    def doc(self, line: int | None) -> dict[str, Any]:
        return {"code": self.code, "line": line, "message": self.message, "param": self.param}


@dataclass(frozen=True, slots=True)
class Rules:
    """What a batch's lines are checked against."""

    url: str  # the batch's endpoint, e.g. /v1/chat/completions
    endpoint: Endpoint
    models: frozenset[str]  # aliases the creating key may use
    max_lines: int
    max_body_bytes: int


@dataclass(slots=True)
class Checked:
    """The outcome: the errors (empty if the file is good), the line count and the model of
    the first line (the Batch object's `model`)."""

    errors: list[dict[str, Any]] = field(default_factory=list)
    total: int = 0
    model: str | None = None
    aborted: bool = False


Sink = Callable[[list[tuple[int, str, bytes]]], None]


def check_file(path: Path, rules: Rules, sink: Sink, abort: threading.Event) -> Checked:
    """Checks every line of the file at `path`; while no error is found, valid lines go to
    `sink` as `(line_no, custom_id, body)` in chunks of `CHUNK_LINES`."""
    out = Checked()
    seen: set[str] = set()
    chunk: list[tuple[int, str, bytes]] = []
    with open(path, "rb") as f:
        for line_no, raw in _lines(f):
            if abort.is_set():
                out.aborted = True
                return out
            out.total += 1
            if out.total > rules.max_lines:
                message = f"The file holds more than {rules.max_lines} requests (batch.max_lines)."
                _note(out, LineError("too_many_tasks", message), line_no)
                break
            try:
                custom_id, body, model = check_line(raw, rules, seen)
            except LineError as err:
                if _note(out, err, line_no):
                    break
                continue
            if out.model is None:
                out.model = model
            if not out.errors:
                chunk.append((line_no, custom_id, body))
                if len(chunk) >= CHUNK_LINES:
                    sink(chunk)
                    chunk = []
    if out.total == 0:
        out.errors.append(LineError("empty_file", "The input file holds no requests.").doc(None))
    elif chunk and not out.errors:
        sink(chunk)
    return out


def _note(out: Checked, err: LineError, line_no: int) -> bool:
    """Records an error; True once `MAX_ERRORS` are recorded (stop reading)."""
    out.errors.append(err.doc(line_no))
    return len(out.errors) >= MAX_ERRORS


def _lines(f: BinaryIO) -> Iterator[tuple[int, bytes]]:
    for n, raw in enumerate(f, start=1):
        if raw.strip():
            yield n, raw


def check_line(raw: bytes, rules: Rules, seen: set[str]) -> tuple[str, bytes, str]:
    """(custom_id, the body to send, its model) of a valid line; raises `LineError`."""
    try:
        line = orjson.loads(raw)
    except orjson.JSONDecodeError:
        raise LineError("invalid_json_line", "This line is not parseable as valid JSON.") from None
    if not isinstance(line, dict):
        raise LineError("invalid_json_line", "This line is not a JSON object.")
    custom_id = _custom_id(line, seen)
    _method_and_url(line, rules)
    body = line.get("body")
    if body is None:
        raise _missing("body")
    if not isinstance(body, dict):
        raise LineError("invalid_request", "'body' must be a JSON object.", "body")
    raw_body = orjson.dumps(body)
    if len(raw_body) > rules.max_body_bytes:
        message = f"The request body exceeds {rules.max_body_bytes} bytes (max_body_bytes)."
        raise LineError("invalid_request", message, "body")
    try:
        data = parse_request(raw_body, rules.endpoint)
    except InvalidRequest as exc:
        param = f"body.{exc.param}" if exc.param else "body"
        raise LineError("invalid_request", exc.message, param) from None
    if data.get("stream"):
        raise LineError("invalid_request", "Batch requests cannot stream.", "body.stream")
    model = data["model"]
    if model not in rules.models:
        message = "The model does not exist or this API key has no access to it."
        raise LineError("model_not_found", message, "body.model")
    seen.add(custom_id)
    return custom_id, raw_body, model


def _custom_id(line: dict[str, Any], seen: set[str]) -> str:
    custom_id = line.get("custom_id")
    if custom_id is None:
        raise _missing("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        raise LineError("invalid_request", "'custom_id' must be a non-empty string.", "custom_id")
    if len(custom_id) > MAX_CUSTOM_ID:
        message = f"'custom_id' must be at most {MAX_CUSTOM_ID} characters."
        raise LineError("invalid_request", message, "custom_id")
    if custom_id in seen:
        message = "The custom_id of this line is used by an earlier line of the file."
        raise LineError("duplicate_custom_id", message, "custom_id")
    return custom_id


def _method_and_url(line: dict[str, Any], rules: Rules) -> None:
    method = line.get("method")
    if method is None:
        raise _missing("method")
    if method != "POST":
        raise LineError("invalid_method", "'method' must be \"POST\".", "method")
    url = line.get("url")
    if url is None:
        raise _missing("url")
    if url != rules.url:
        message = f"'url' must be the batch's endpoint {rules.url}."
        raise LineError("url_mismatch", message, "url")


def _missing(param: str) -> LineError:
    return LineError("missing_required_parameter", f"Missing required parameter '{param}'.", param)
