"""Validation of client requests (SPEC §7 "Bad input gets a clear OpenAI-shaped error").

Only the fields the gateway relies on, or that an upstream would reject obscurely, are typed;
every other field passes through untouched (unknown fields are allowed, as OpenAI adds them).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
import orjson

from gateway.errors import InvalidRequest

__all__ = ["ENDPOINTS", "Endpoint", "message_chars", "parse_request"]

PositiveInt = Annotated[int, msgspec.Meta(ge=1)]
Role = Literal["system", "developer", "user", "assistant", "tool", "function"]


class StreamOptions(msgspec.Struct):
    include_usage: bool | None = None


class ChatMessage(msgspec.Struct):
    role: Role
    content: str | list[Any] | None = None


class _Common(msgspec.Struct, kw_only=True):
    model: str
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    service_tier: str | None = None
    max_tokens: PositiveInt | None = None
    n: Annotated[int, msgspec.Meta(ge=1, le=128)] | None = None
    temperature: Annotated[float, msgspec.Meta(ge=0, le=2)] | None = None
    top_p: Annotated[float, msgspec.Meta(ge=0, le=1)] | None = None
    user: str | None = None


class ChatRequest(_Common, kw_only=True):
    messages: Annotated[list[ChatMessage], msgspec.Meta(min_length=1)]
    max_completion_tokens: PositiveInt | None = None


class CompletionRequest(_Common, kw_only=True):
    prompt: str | list[Any]


class EmbeddingRequest(msgspec.Struct):
    model: str
    input: str | Annotated[list[Any], msgspec.Meta(min_length=1)]
    user: str | None = None


class Endpoint(msgspec.Struct, frozen=True):
    """A proxied OpenAI endpoint: its path below the base URL and its request schema."""

    path: str
    schema: type[msgspec.Struct]
    streams: bool


ENDPOINTS = {
    "/v1/chat/completions": Endpoint("/chat/completions", ChatRequest, True),
    "/v1/completions": Endpoint("/completions", CompletionRequest, True),
    "/v1/embeddings": Endpoint("/embeddings", EmbeddingRequest, False),
}


def _has_nul(value: Any) -> bool:
    if isinstance(value, str):
        return "\x00" in value
    if isinstance(value, dict):
        return any(_has_nul(k) or _has_nul(v) for k, v in value.items())
    if isinstance(value, list):
        return any(_has_nul(v) for v in value)
    return False


def _param_of(path: str) -> str | None:
    """`$.messages[0].role` → `messages[0].role` (OpenAI's `param`)."""
    return path[2:] if path.startswith("$.") else None


def parse_request(body: bytes, endpoint: Endpoint) -> dict[str, Any]:
    """Parses and validates a request body; returns it as a dict to forward."""
    if not body.strip():
        raise InvalidRequest("The request body is empty; send a JSON object.")
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise InvalidRequest(f"The request body is not valid JSON: {exc.msg}") from None
    if not isinstance(data, dict):
        raise InvalidRequest("The request body must be a JSON object.")
    try:
        msgspec.convert(data, endpoint.schema)
    except msgspec.ValidationError as exc:
        text = str(exc)
        message, _, where = text.partition(" - at `")
        param = _param_of(where.rstrip("`")) if where else None
        raise InvalidRequest(
            f"Invalid request: {message}" + (f" (at '{param}')" if param else ""),
            param=param,
        ) from None
    if not data["model"].strip() or any(ord(c) < 0x20 for c in data["model"]):
        raise InvalidRequest("'model' must be a plain name.", param="model")
    # A NUL can only arrive as the escape \u0000; check the parsed strings only when the
    # escape appears at all, so ordinary bodies pay one bytes search.
    if b"\\u0000" in body and _has_nul(data):
        raise InvalidRequest("Strings must not contain NUL (U+0000).")
    if data.get("stream") and not endpoint.streams:
        raise InvalidRequest("This endpoint does not stream.", param="stream")
    return data


def message_chars(messages: object) -> int:
    """The characters of text in a chat request's `messages` (string contents and the `text`
    of content parts): what token estimates count, ~4 to a token. Anything else is 0."""
    chars = 0
    if isinstance(messages, list):
        for m in messages:
            content = m.get("content") if isinstance(m, dict) else None
            if isinstance(content, str):
                chars += len(content)
            elif isinstance(content, list):
                for part in content:
                    if isinstance(part, dict) and isinstance(part.get("text"), str):
                        chars += len(part["text"])
    return chars
