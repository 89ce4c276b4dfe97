"""The replica's one Redis client and the calls of its two scripts (SPEC §13).

Client: redis-py (`redis>=5`, with the `hiredis` C parser): the client Redis itself maintains,
asyncio-native, with `Script` objects that run `EVALSHA` and reload the script on `NOSCRIPT`
(a restarted Redis has lost it), and Sentinel and Cluster clients for when `redis_url` grows
up. Every call here is bounded by a socket timeout and never retried by the client: the sync
loop is the retry, and a reply that arrives too late is worth nothing anyway (the lease it
renewed was measured from the moment the request was sent).

SPEC §13 "Redis is an external system: every call has a timeout, and replies are bounded (a
hostile or broken Redis answering `*2147483647` or `+OK` to everything cannot freeze or crash a
replica)". So replies are read by `BoundedParser`, not hiredis: hiredis preallocates a list of
the announced length (`*2147483647` is 16 GiB of pointers, freed one by one: ~18 s of a frozen
event loop measured here), while this parser refuses an announced length over a small bound
before reading anything of it. What a script answers is then checked for its shape
(`lease_reply` / `rate_reply`): `+OK` where JSON was expected is a failed call, like a timeout.
"""

from __future__ import annotations

from typing import Any

import orjson
from redis._parsers import _AsyncRESP2Parser
from redis.asyncio import BlockingConnectionPool, Redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError, InvalidResponse, RedisError
from redis.maint_notifications import MaintNotificationsConfig

from gateway.cluster.scripts import LEASE_SYNC, RATE_KEY, RATE_SYNC, lease_keys

__all__ = ["BoundedParser", "RedisState", "RedisUnavailable", "lease_reply", "rate_reply"]

# What a failed call may raise: Redis's own errors (connection, timeout, script errors), the
# socket's, and a reply that is not the JSON a script returns.
RedisUnavailable = (RedisError, OSError, ValueError, TypeError)

# The rate buckets' hash outlives a minute of silence: a missing bucket is a full one.
_RATE_TTL_MS = 120_000

# The largest reply this client reads. Every command it sends is answered by a status, an
# integer, an error, or one bulk string (a script's JSON: per replica and instance a few
# numbers, so kilobytes, or the 40 hex digits of SCRIPT LOAD); arrays only in the connection's
# handshake. Anything larger is a broken or hostile server: the call fails before the
# announced bytes are read or allocated.
MAX_BULK_BYTES = 8 << 20
MAX_ARRAY_LEN = 64
_MAX_DEPTH = 4


class BoundedParser(_AsyncRESP2Parser):
    """redis-py's RESP2 parser with every announced length bounded (see the module doc)."""

    async def _read_response(self, disable_decoding: bool = False, depth: int = 0) -> Any:
        raw = await self._readline()
        kind, rest = raw[:1], raw[1:]
        if kind == b"$" and rest != b"-1":
            if not (0 <= _length(rest) <= MAX_BULK_BYTES):
                raise InvalidResponse(f"bulk reply of {rest[:20]!r} bytes refused")
            data = await self._read(int(rest))
            return data if disable_decoding else self.encoder.decode(data)  # type: ignore[union-attr]
        if kind == b"*" and rest != b"-1":
            n = _length(rest)
            if not (0 <= n <= MAX_ARRAY_LEN) or depth >= _MAX_DEPTH:
                raise InvalidResponse(f"array reply of {rest[:20]!r} elements refused")
            return [await self._read_response(disable_decoding, depth + 1) for _ in range(n)]
        if kind in (b"$", b"*"):  # nil
            return None
        if kind == b"-":
            error = self.parse_error(rest.decode("utf-8", errors="replace"))  # type: ignore[no-untyped-call]
            if isinstance(error, ConnectionError):
                self._clear()  # type: ignore[no-untyped-call]
                raise error
            return error
        if kind == b":":
            return int(rest)
        if kind == b"+":
            return rest if disable_decoding else self.encoder.decode(rest)  # type: ignore[union-attr]
        raise InvalidResponse(f"Protocol Error: {raw[:40]!r}")


def _length(text: bytes) -> int:
    """An announced length, or -2 when it is not a small decimal number."""
    return int(text) if 0 < len(text) <= 10 and text.isdigit() else -2


def lease_reply(raw: Any) -> dict[str, Any]:
    """`LEASE_SYNC`'s answer, checked for the shape the lease code relies on."""
    reply = _json_object(raw, "lease")
    targets, view = reply.get("t", {}), reply.get("v", {})
    ok = (
        isinstance(reply.get("n", 0), int)
        and isinstance(targets, dict)
        and all(isinstance(v, int) and v >= 0 for v in targets.values())
        and isinstance(view, dict)
        and all(
            isinstance(row, dict)
            and all(
                isinstance(e, list) and len(e) == 2 and all(isinstance(x, int) for x in e)
                for e in row.values()
            )
            for row in view.values()
        )
        and _hints_ok(reply.get("h", []))
    )
    if not ok:
        raise ValueError("unexpected lease script reply")
    return reply


def _hints_ok(hints: Any) -> bool:
    if hints == {}:  # cjson encodes {} for an empty list
        return True
    return isinstance(hints, list) and all(
        isinstance(h, list)
        and len(h) == 3
        and isinstance(h[0], str)
        and isinstance(h[1], str)
        and isinstance(h[2], int | float)  # cjson writes large numbers as 1.2e+15
        for h in hints
    )


def rate_reply(raw: Any) -> dict[str, Any]:
    """`RATE_SYNC`'s answer, checked for its shape."""
    reply = _json_object(raw, "rate")
    rows = reply.get("r", [])
    if rows == {}:  # cjson encodes {} for an empty list
        rows = reply["r"] = []
    ok = isinstance(rows, list) and all(
        isinstance(r, list) and len(r) == 2 and all(isinstance(x, int | float) for x in r)
        for r in rows
    )
    if not ok:
        raise ValueError("unexpected rate script reply")
    return reply


def _json_object(raw: Any, what: str) -> dict[str, Any]:
    if not isinstance(raw, bytes | str):
        raise ValueError(f"unexpected {what} script reply")
    reply = orjson.loads(raw)
    if not isinstance(reply, dict):
        raise ValueError(f"unexpected {what} script reply")
    return reply


class RedisState:
    """The lease and rate-limit scripts over one connection."""

    def __init__(self, url: str, *, replica: str, timeout_ms: int) -> None:
        timeout = timeout_ms / 1000
        # SPEC §12 "one Redis connection per host does the syncing": one connection, which
        # a sync's concurrent calls take in turn (a call waits for it at most its timeout).
        pool = BlockingConnectionPool.from_url(
            url,
            max_connections=1,
            timeout=timeout,
            socket_timeout=timeout,
            socket_connect_timeout=timeout,
            retry=Retry(NoBackoff(), 0),
            health_check_interval=0,
            client_name=f"gateway:{replica}",
            parser_class=BoundedParser,
            # Push notifications need RESP3 (and hiredis or its parser): not with this one.
            maint_notifications_config=MaintNotificationsConfig(enabled=False),
        )
        self.client: Redis = Redis.from_pool(pool)
        self._lease = self.client.register_script(LEASE_SYNC)
        self._rate = self.client.register_script(RATE_SYNC)

    async def lease_sync(
        self, pool: str, replica: str, lease_ms: int, known_replicas: int, payload: dict[str, Any]
    ) -> dict[str, Any]:
        """One run of `LEASE_SYNC` for `pool`: the decoded reply."""
        args: list[str | int | bytes] = [replica, lease_ms, known_replicas, orjson.dumps(payload)]
        return lease_reply(await self._lease(keys=lease_keys(pool), args=args))

    async def rate_sync(self, entries: list[tuple[str, int, float]]) -> dict[str, Any]:
        """One run of `RATE_SYNC`: `(field, limit per minute, delta)` per bucket."""
        raw = await self._rate(keys=[RATE_KEY], args=[orjson.dumps(entries), _RATE_TTL_MS])
        return rate_reply(raw)

    async def close(self) -> None:
        await self.client.aclose()
