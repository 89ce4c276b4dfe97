"""Cluster mode (SPEC §13): several gateway replicas behind a load balancer share, through
Redis, leased shares of every instance's `max_concurrency`, per-key rate limits, and ejection
hints — all exchanged in the background, none on the request path.

- `local`: the pool's side of a lease (the core's caps and masks, self-fencing) — no Redis;
- `scripts`: the Lua scripts (one atomic call per pool per sync, one for all rate limits);
- `redis_state`: the Redis client and the script calls;
- `leases`: what a replica reports per pool and how it applies the answer or falls back to a
  static share;
- `ratelimit`: per-key limits spent from chunks leased from central buckets;
- `hints`: shared ejection hints, confirmed by local probes;
- `node`: the sync task, and the cluster's block in /admin/state, /readyz and /metrics;
- `host`: with `--workers N`, the host's one member (the worker that talks to Redis) and what
  it publishes to the others (SPEC §12 × §13).

Importing this package imports nothing of Redis: only `Server` imports `node` (and with it the
client), and only when the config has a `cluster:` section.
"""
