"""The two Lua scripts of cluster mode (SPEC §13), run by Redis atomically.

Each is one round trip, from the background sync only (SPEC §13: "No Redis round trip on the
per-request path"). Every key of a pool carries the hash tag `{gw:<pool>}`, and every key of
the rate limits `{gw:rl}`, so each call touches one Redis Cluster slot. Time is Redis's own
(`TIME`): one clock for every replica's expiries, whatever their hosts' clocks say.

`LEASE_SYNC` — one pool, one replica (Envoy's quota mode and Redis in Action 11.2.3 are the
models: a periodic report of demand against a global limit, answered with this replica's
share). Keys: `leases` (HASH replica → JSON {instance: [held, want, in_flight, target]}),
`alive` (ZSET replica → expiry ms), `meta` (HASH: `last` sync ms, `recover_until` ms),
`hints` (HASH instance → JSON {r: reporter, u: until ms}). Steps:

1. Recovery: if the pool's state is new (first start, or a restarted Redis that lost every key)
   or nobody synced for half a lease (Redis was paused or unreachable for everyone), open a
   recovery window of one lease: replicas still unregistered may be serving on their static
   share, so nobody grows past `max(held, floor(C / replicas))` in it, and every registered
   replica's expiry is pushed a lease ahead (nobody could renew meanwhile).
2. Reap replicas whose lease expired: their slots return ("a replica that dies frees its share
   within `lease_ms`").
3. Register the caller for one more lease.
4. Per instance of the caller (`[C, floor, want, in_flight]`, floor = what it may have in
   flight before this answer lands: max(in-flight, its current cap)):
   - others = Σ held of the other live replicas; free = C − others;
   - share = when the live replicas' demands exceed C, the max-min fair share (water-filling
     in whole slots); when they fit, the demand plus an even part of what is left (spare).
     So an idle cluster splits every instance evenly — the idle baseline, Σ = C: a burst on
     any replica is admitted at once — and a replica whose demand grows takes the others'
     spare as their next syncs give it back (SPEC §13 "a busy replica gets more of an idle
     one's share within about one renew period"; a replica whose lease shrank syncs again at
     once to hand it over). An idle replica demands nothing, so beside a busy one its share
     shrinks to its in-flight and the busy one can use the whole cap;
   - target = min(share, free) (≥ 0), clamped in a recovery window;
   - held = max(floor, target). Σ target ≤ C always (each is at most what the others hold
     left free), and so Σ held, unless a replica reports more in flight than its lease (a
     replica resumed from SIGSTOP with old requests still running): then nobody grows until
     that drains. A replica's cap rises only once Redis accounted for it, and falls locally
     first.
5. Hints: record the caller's new ejections with their TTL, drop expired ones, return the
   others' (SPEC §13 "An ejection seen by one replica is shared as a hint").
6. Every key expires four leases after the last sync of anyone: if every replica is gone, so
   is the state (each dead replica's own record is reaped within a lease by step 2; the keys
   outlive a lease so that a Redis paused or unreachable for longer than one keeps the
   records of replicas that were serving meanwhile — step 1 then extends them).

`RATE_SYNC` — every limited key of the caller at once: central token buckets (one minute's
worth of burst, refilled continuously, as the local limiter), from which replicas take chunks
(`delta > 0`) and to which they return unused ones (`delta < 0`). A missing bucket is a full
one, so the hash may expire after a minute of silence without changing anything.
"""

from __future__ import annotations

from typing import Final

__all__ = ["LEASE_SYNC", "RATE_KEY", "RATE_SYNC", "lease_keys"]


def lease_keys(pool: str) -> list[str]:
    """The keys of one pool's lease state, all under the hash tag `{gw:<pool>}`."""
    tag = f"{{gw:{pool}}}"
    return [f"{tag}:leases", f"{tag}:alive", f"{tag}:meta", f"{tag}:hints"]


RATE_KEY: Final = "{gw:rl}:buckets"

LEASE_SYNC: Final = r"""
local replica = ARGV[1]
local lease_ms = tonumber(ARGV[2])
local n_hint = tonumber(ARGV[3])
local req = cjson.decode(ARGV[4])
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)

-- 1. recovery window
local last = tonumber(redis.call('HGET', KEYS[3], 'last') or '-1')
local recover_until = tonumber(redis.call('HGET', KEYS[3], 'recover_until') or '0')
if last < 0 or now - last > lease_ms / 2 then
  recover_until = now + lease_ms
  redis.call('HSET', KEYS[3], 'recover_until', recover_until)
  for _, r in ipairs(redis.call('ZRANGE', KEYS[2], 0, -1)) do
    redis.call('ZADD', KEYS[2], 'GT', now + lease_ms, r)
  end
end
redis.call('HSET', KEYS[3], 'last', now)

-- 2. reap expired replicas (and any record left without a live registration)
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now)
for _, r in ipairs(redis.call('HKEYS', KEYS[1])) do
  if not redis.call('ZSCORE', KEYS[2], r) then
    redis.call('HDEL', KEYS[1], r)
  end
end

local function expire_all()
  for i = 1, 4 do
    redis.call('PEXPIRE', KEYS[i], lease_ms * 4)
  end
end

if req.leave then
  redis.call('ZREM', KEYS[2], replica)
  redis.call('HDEL', KEYS[1], replica)
  expire_all()
  return cjson.encode({left = true, now = now})
end

-- 3. register
redis.call('ZADD', KEYS[2], now + lease_ms, replica)
local n = redis.call('ZCARD', KEYS[2])
local n_known = math.max(n, n_hint)
local recovering = now < recover_until

local tables = {}
local raw = redis.call('HGETALL', KEYS[1])
for k = 1, #raw, 2 do
  tables[raw[k]] = cjson.decode(raw[k + 1])
end
local mine_before = tables[replica] or {}

-- This replica's share of `cap` in whole slots, over {replica, demand} pairs. Contended:
-- max-min fair (water-filling: everyone min(demand, floor(level)), the odd slots one each to
-- those still short). Uncontended: every demand, and what is left split evenly as spare.
-- Ties and odd slots go in replica-id order, so every replica computes the same split.
local function share_of(entries, cap, me)
  table.sort(entries, function(a, b) return a[1] < b[1] end)
  local sorted = {}
  for i, e in ipairs(entries) do sorted[i] = e[2] end
  table.sort(sorted)
  local remaining, count, level = cap, #sorted, nil
  for i = 1, count do
    local share = remaining / (count - i + 1)
    if sorted[i] > share then
      level = math.floor(share)
      break
    end
    remaining = remaining - sorted[i]
  end
  local alloc, left, mine = {}, cap, 0
  for i, e in ipairs(entries) do
    alloc[i] = e[2]
    if level then alloc[i] = math.min(e[2], level) end
    left = left - alloc[i]
    if e[1] == me then mine = i end
  end
  if level then
    for i, e in ipairs(entries) do
      if left > 0 and e[2] > alloc[i] then
        alloc[i] = alloc[i] + 1
        left = left - 1
      end
    end
  else
    local each = math.floor(left / count)
    for i = 1, count do
      alloc[i] = alloc[i] + each
      if i <= left - each * count then alloc[i] = alloc[i] + 1 end
    end
  end
  return alloc[mine]
end

-- 4. this replica's share of each instance
local targets, mine = {}, {}
for name, v in pairs(req.i) do
  local cap, floor_, want, inflight = v[1], v[2], v[3], v[4]
  local others, entries = 0, {}
  for r, tab in pairs(tables) do
    if r ~= replica then
      local e = tab[name]
      if e then
        others = others + e[1]
        entries[#entries + 1] = {r, e[2]}
      else
        entries[#entries + 1] = {r, 0}
      end
    end
  end
  entries[#entries + 1] = {replica, want}
  local target = math.min(share_of(entries, cap, replica), cap - others)
  if recovering then
    local before = 0
    if mine_before[name] then before = mine_before[name][1] end
    target = math.min(target, math.max(before, math.floor(cap / n_known)))
  end
  if target < 0 then target = 0 end
  mine[name] = {math.max(floor_, target), want, inflight, target}
  targets[name] = target
end
tables[replica] = mine
redis.call('HSET', KEYS[1], replica, cjson.encode(mine))

-- 5. hints
for name, ttl in pairs(req.h) do
  redis.call('HSET', KEYS[4], name, cjson.encode({r = replica, u = now + ttl}))
end
local hints = {}
local hraw = redis.call('HGETALL', KEYS[4])
for k = 1, #hraw, 2 do
  local h = cjson.decode(hraw[k + 1])
  if h.u <= now then
    redis.call('HDEL', KEYS[4], hraw[k])
  elseif h.r ~= replica then
    hints[#hints + 1] = {hraw[k], h.r, h.u - now}
  end
end

-- the view for /admin/state: each replica's lease and in-flight per instance
local view = {}
for r, tab in pairs(tables) do
  local row = {}
  for name, e in pairs(tab) do
    row[name] = {e[1], e[3]}
  end
  view[r] = row
end

-- 6.
expire_all()
local rec = 0
if recovering then rec = 1 end
return cjson.encode({t = targets, n = n, now = now, rec = rec, v = view, h = hints})
"""

RATE_SYNC: Final = r"""
local req = cjson.decode(ARGV[1])
local ttl = ARGV[2]
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local out = {}
for k, e in ipairs(req) do
  local field, limit, delta = e[1], tonumber(e[2]), tonumber(e[3])
  local level = limit
  local raw = redis.call('HGET', KEYS[1], field)
  if raw then
    local l, s, lim = string.match(raw, '^([^:]+):([^:]+):([^:]+)$')
    if tonumber(lim) == limit then
      level = math.min(limit, tonumber(l) + (now - tonumber(s)) * limit / 60000)
    end
  end
  local granted = 0
  if delta > 0 then
    granted = math.min(delta, math.max(0, level))
    level = level - granted
  elseif delta < 0 then
    level = math.min(limit, level - delta)
  end
  redis.call('HSET', KEYS[1], field, string.format('%.6f:%d:%d', level, now, limit))
  out[k] = {granted, level}
end
if #req > 0 then
  redis.call('PEXPIRE', KEYS[1], ttl)
end
return cjson.encode({now = now, r = out})
"""
