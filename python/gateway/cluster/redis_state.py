"""The replica's one Redis client and the calls of its two scripts (SPEC §13).

Client: redis-py (`redis>=5`, with the `hiredis` C parser): the client Redis itself maintains,
asyncio-native, with `Script` objects that run `EVALSHA` and reload the script on `NOSCRIPT`
(a restarted Redis has lost it), and Sentinel and Cluster clients for when `redis_url` grows
up. Every call here is bounded by a socket timeout and never retried by the client: the sync
loop is the retry, and a reply that arrives too late is worth nothing anyway (the lease it
renewed was measured from the moment the request was sent).
"""

from __future__ import annotations

from typing import Any

import orjson
from redis.asyncio import Redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

from gateway.cluster.scripts import LEASE_SYNC, RATE_KEY, RATE_SYNC, lease_keys

__all__ = ["RedisState", "RedisUnavailable"]

# What a failed call may raise: Redis's own errors (connection, timeout, script errors), the
# socket's, and a reply that is not the JSON a script returns.
RedisUnavailable = (RedisError, OSError, ValueError, TypeError)

# The rate buckets' hash outlives a minute of silence: a missing bucket is a full one.
_RATE_TTL_MS = 120_000


class RedisState:
    """The lease and rate-limit scripts over one connection pool."""

    def __init__(self, url: str, *, replica: str, timeout_ms: int) -> None:
        timeout = timeout_ms / 1000
        self.client: Redis = Redis.from_url(
            url,
            socket_timeout=timeout,
            socket_connect_timeout=timeout,
            retry=Retry(NoBackoff(), 0),
            health_check_interval=0,
            max_connections=64,
            client_name=f"gateway:{replica}",
        )
        self._lease = self.client.register_script(LEASE_SYNC)
        self._rate = self.client.register_script(RATE_SYNC)

    async def lease_sync(
        self, pool: str, replica: str, lease_ms: int, known_replicas: int, payload: dict[str, Any]
    ) -> dict[str, Any]:
        """One run of `LEASE_SYNC` for `pool`: the decoded reply."""
        args: list[str | int | bytes] = [replica, lease_ms, known_replicas, orjson.dumps(payload)]
        raw = await self._lease(keys=lease_keys(pool), args=args)
        reply = orjson.loads(raw)
        if not isinstance(reply, dict):
            raise ValueError("unexpected lease script reply")
        return reply

    async def rate_sync(self, entries: list[tuple[str, int, float]]) -> dict[str, Any]:
        """One run of `RATE_SYNC`: `(field, limit per minute, delta)` per bucket."""
        raw = await self._rate(keys=[RATE_KEY], args=[orjson.dumps(entries), _RATE_TTL_MS])
        reply = orjson.loads(raw)
        if not isinstance(reply, dict):
            raise ValueError("unexpected rate script reply")
        return reply

    async def close(self) -> None:
        await self.client.aclose()
