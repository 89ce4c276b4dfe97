"""Prefix affinity keys (SPEC §15): which requests should land on the same instance.

A request's key is a 64-bit hash of its session — the `X-Session-Id` header, else the body's
`user` — or, without one, of the first `affinity.prefix_chars` characters of its rendered
prompt: every message's role and text content in order (`role\\ncontent\\n`), the `prompt` of a
completion, the `input` of an embedding. Requests sharing a key share a prompt prefix, so the
instance that served one already holds its KV cache (vLLM's automatic prefix caching). The
core places keyed requests by consistent hashing with bounded loads (rust/core/src/affinity.rs).

Only as much of the prompt as the prefix needs is read; the hash is BLAKE2b (stdlib, keyed to
nothing, stable across processes and restarts, so a reload or a second worker agrees).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

__all__ = ["affinity_key", "render_prefix", "stable_id"]

_SESSION = b"session\0"
_PREFIX = b"prefix\0"


def _hash64(tag: bytes, text: str) -> int:
    digest = hashlib.blake2b(tag + text.encode("utf-8", "surrogatepass"), digest_size=8).digest()
    # 0 means "no key" to the core: the one colliding value moves to 1.
    return int.from_bytes(digest, "little") or 1


def stable_id(name: str) -> int:
    """An instance's place on the affinity ring: a hash of its name, so a reload that keeps the
    name keeps the instance's keys (the core's indexes are reused; names are not)."""
    return _hash64(b"instance\0", name)


def _text(content: Any) -> str:
    """The text of a message's content: a string, or the text parts of a list of parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(
            p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str)
        )
    return ""


def render_prefix(body: Mapping[str, Any], limit: int) -> str:
    """The first `limit` characters of the request's rendered prompt ("" when it has none)."""
    messages = body.get("messages")
    if isinstance(messages, list):
        parts: list[str] = []
        size = 0
        for msg in messages:
            if not isinstance(msg, dict):
                continue
            role = msg.get("role")
            piece = f"{role if isinstance(role, str) else ''}\n{_text(msg.get('content'))}\n"
            parts.append(piece)
            size += len(piece)
            if size >= limit:
                break
        return "".join(parts)[:limit]
    prompt = body.get("prompt", body.get("input"))
    if isinstance(prompt, list):
        prompt = prompt[0] if prompt and isinstance(prompt[0], str) else None
    return prompt[:limit] if isinstance(prompt, str) else ""


def affinity_key(headers: Mapping[str, str], body: Mapping[str, Any], prefix_chars: int) -> int:
    """The request's affinity key: its session's, else its prompt prefix's; 0 for none."""
    session = headers.get("X-Session-Id")
    if not session:
        user = body.get("user")
        session = user if isinstance(user, str) else None
    if session:
        return _hash64(_SESSION, session)
    prefix = render_prefix(body, prefix_chars)
    return _hash64(_PREFIX, prefix) if prefix else 0
