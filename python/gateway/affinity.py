"""Prefix affinity keys (SPEC §15): which requests should land on the same instance.

SPEC §15: a request goes "to the instance that most likely holds **the longest prefix of its
prompt** in its KV cache": the rendered prompt — every message's role and text content in
order (`role\\ncontent\\n`), the `prompt` of a completion, the `input` of an embedding — is cut
into `affinity.block_bytes` blocks of UTF-8, each block's hash chained to the previous one
(`_core.Prefix`, computed once per request, only as far as `max_blocks`); the core remembers
which blocks went to which instance and places the request where the longest leading run of
them is (rust/core/src/prefix.rs).

A session — the `X-Session-Id` header, else the body's `user` — keeps one instance instead:
its key is a 64-bit hash of the session, placed by consistent hashing with bounded loads
(rust/core/src/affinity.rs), as is a prompt shorter than one block (by a hash of all of it).

Hashes are stable across processes and restarts (BLAKE2b here, the core's own block hash
there), so a reload, a second worker or another replica agrees on where a new prefix goes.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Mapping
from typing import Any, Final

from gateway import _core
from gateway.config.schema import Affinity

__all__ = [
    "affinity_key",
    "affinity_placement",
    "prefix_capacity_blocks",
    "render_prefix",
    "stable_id",
]

_SESSION = b"session\0"
_PREFIX = b"prefix\0"

#: SPEC §15: about 4 bytes of UTF-8 per token, in English and in Qwen's Chinese.
BYTES_PER_TOKEN: Final = 4
#: The share of an instance's KV cache the index assumes its prompts may fill.
CACHE_SHARE: Final = 0.8
#: Bytes of core memory per remembered block (hash sets and the holders map, with slack).
ENTRY_BYTES: Final = 64


def _hash64(tag: bytes, text: str) -> int:
    digest = hashlib.blake2b(tag + text.encode("utf-8", "surrogatepass"), digest_size=8).digest()
    # 0 means "no key" to the core: the one colliding value moves to 1.
    return int.from_bytes(digest, "little") or 1


def stable_id(name: str) -> int:
    """An instance's place on the affinity ring: a hash of its name, so a reload that keeps the
    name keeps the instance's keys (the core's indexes are reused; names are not)."""
    return _hash64(b"instance\0", name)


@functools.lru_cache(maxsize=16)
def _seed(hash_seed: int) -> int:
    """h₀ of every chain: the same `affinity.hash_seed` gives the same blocks everywhere."""
    return _hash64(b"blocks\0", str(hash_seed))


def prefix_capacity_blocks(affinity: Affinity, instances: int, kv_tokens: int | None = None) -> int:
    """SPEC §15 "bounded by that instance's cache size": the blocks the index remembers per
    instance — `0.8 × kv_tokens × 4 bytes per token ÷ block_bytes` (`kv_tokens`: what vLLM
    reports, else `cache_tokens`), and no more than `index_mib` holds for all `instances`."""
    tokens = kv_tokens or affinity.cache_tokens
    by_cache = int(CACHE_SHARE * tokens * BYTES_PER_TOKEN / affinity.block_bytes)
    # the core holds between C and 2C blocks per instance (two generations of C)
    by_memory = affinity.index_mib * 2**20 // (2 * ENTRY_BYTES * max(1, instances))
    return max(2, min(by_cache, by_memory, 2**32 - 1))


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


def _session(headers: Mapping[str, str], body: Mapping[str, Any]) -> str | None:
    session = headers.get("X-Session-Id")
    if not session:
        user = body.get("user")
        session = user if isinstance(user, str) else None
    return session or None


def affinity_placement(
    headers: Mapping[str, str], body: Mapping[str, Any], affinity: Affinity
) -> tuple[int, _core.Prefix | None]:
    """What places the request in an affinity pool: (key, blocks). The key is its session's
    hash (0: none), or the whole prompt's when it is shorter than one block; the blocks are
    the prompt's chained block hashes (None when it has no full block)."""
    limit = affinity.block_bytes * affinity.max_blocks  # characters: at least as many bytes
    text = render_prefix(body, limit)
    prefix: _core.Prefix | None = None
    if len(text) * 4 >= affinity.block_bytes:  # else no full block, whatever the encoding
        blocks = _core.Prefix(
            text, affinity.block_bytes, affinity.max_blocks, _seed(affinity.hash_seed)
        )
        prefix = blocks if len(blocks) else None
    session = _session(headers, body)
    if session:
        return _hash64(_SESSION, session), prefix
    if prefix is None and text:
        return _hash64(_PREFIX, text), None
    return 0, prefix


def affinity_key(headers: Mapping[str, str], body: Mapping[str, Any], prefix_chars: int) -> int:
    """A single key for the request: its session's, else a hash of its first `prefix_chars`
    characters; 0 for none. (The pools place by `affinity_placement`; this stays for tools
    that want one key per request.)"""
    session = _session(headers, body)
    if session:
        return _hash64(_SESSION, session)
    prefix = render_prefix(body, prefix_chars)
    return _hash64(_PREFIX, prefix) if prefix else 0
