"""`gateway check FILE` (SPEC §10, §18): every error of the file, or the resolved routing table
and a summary of every section.

Secrets are never shown: an instance's `api_key`, the admin, metrics and client keys appear
only as `set` / `unset`, headers by name only, proxies not at all; URLs that may carry a
password (`cluster.redis_url`, a PostgreSQL `batch.store`) are shown with it masked, the
telemetry endpoint as scheme, host and port.
"""

from __future__ import annotations

import socket
from collections.abc import Mapping
from urllib.parse import urlsplit, urlunsplit

from gateway import telemetry
from gateway.config import MASK, Config
from gateway.config.schema import default_replica_id
from gateway.errors import ConfigError

__all__ = ["describe", "describe_errors", "masked_url"]

_ON_OFF = {True: "on", False: "off"}


def describe(config: Config, env: Mapping[str, str] | None = None) -> str:
    """The resolved routing table and a summary of every section, as `gateway check` prints
    it. `env` (default: the process's) is read for the telemetry endpoint only."""
    lines = [
        *_policy(config),
        *_auth(config),
        *_operations(config, env),
        "",
        *_models(config),
        "",
        *_pools(config),
        "",
        *_routing(config),
    ]
    return "\n".join(lines) + "\n"


def describe_errors(error: ConfigError, source: str) -> str:
    """SPEC §18: every error of the file `source`, one per line with its field path, then
    how many."""
    count = len(error.errors)
    lines = [f"config error: {e}" for e in error.errors]
    lines.append(f"{count} error{'s' if count != 1 else ''} in {source}")
    return "\n".join(lines) + "\n"


def _policy(c: Config) -> list[str]:
    """Listening, request, scheduling, health, timeout and client-deadline settings."""
    s, h, t, lim = c.scheduler, c.health, c.timeouts, c.limits
    p = h.probe
    probe = (
        f"GET {p.path} every {p.interval_ms} ms (timeout {p.timeout_ms} ms)" if p.enabled else "off"
    )
    return [
        f"listen      {c.listen.host}:{c.listen.port}",
        f"requests    max_body_bytes={c.max_body_bytes} default_priority={c.default_priority} "
        f"seed={c.seed}",
        f"scheduler   {s.policy}  "
        f"high(capacity={s.high.capacity} weight={s.high.weight} "
        f"max_wait_ms={s.high.max_wait_ms})  "
        f"low(capacity={s.low.capacity} weight={s.low.weight} max_wait_ms={s.low.max_wait_ms})",
        f"            max_consecutive_high={s.max_consecutive_high} "
        f"max_low_wait_ms={s.max_low_wait_ms} "
        f"overflow_high_to_low={_ON_OFF[s.overflow_high_to_low]}",
        # SPEC §17: the classes' latency objectives and what an unattainable one gets.
        f"objectives  high(ttft_ms={s.high.slo_ttft_ms or '-'} tpot_ms={s.high.slo_tpot_ms or '-'})"
        f"  low(ttft_ms={s.low.slo_ttft_ms or '-'} tpot_ms={s.low.slo_tpot_ms or '-'})"
        f"  shed_unattainable={_ON_OFF[s.shed_unattainable]}",
        f"balancer    {c.balancer}"
        + (
            # SPEC §15: what workers and replicas must share to agree on placement
            f"  affinity(block_bytes={c.affinity.block_bytes} max_blocks={c.affinity.max_blocks}"
            f" cache_tokens={c.affinity.cache_tokens} hash_seed={c.affinity.hash_seed}"
            f" epsilon={c.affinity.epsilon})"
            if c.uses_affinity()
            else ""
        ),
        f"health      failure_threshold={h.failure_threshold} "
        f"ejection_ms={h.ejection_ms}..{h.max_ejection_ms} "
        f"half_open_max_requests={h.half_open_max_requests} "
        f"success_threshold={h.success_threshold}",
        f"probe       {probe}",
        f"timeouts    connect_ms={t.connect_ms} first_byte_ms={t.first_byte_ms} "
        f"stream_idle_ms={t.stream_idle_ms} total_ms={t.total_ms}",
        f"retries     max_attempts={c.retries.max_attempts}",
        f"limits      header_timeout_ms={lim.header_timeout_ms} "
        f"body_timeout_ms={lim.body_timeout_ms} keepalive_timeout_ms={lim.keepalive_timeout_ms}",
        f"            max_buffered_bytes={lim.max_buffered_bytes} "
        f"max_response_bytes={lim.max_response_bytes} max_event_bytes={lim.max_event_bytes}",
        f"shutdown    drain_delay_ms={c.shutdown.drain_delay_ms} "
        f"drain_timeout_ms={c.shutdown.drain_timeout_ms}",
    ]


def _auth(c: Config) -> list[str]:
    if c.auth is None:
        return ["auth        off (no client keys)"]
    a = c.auth
    lines = [
        f"auth        {len(a.keys)} client key(s), admin_key: {_set_or_unset(a.admin_key)}, "
        f"metrics_key: {_set_or_unset(a.metrics_key)}, public_metrics: {_ON_OFF[a.public_metrics]}"
    ]
    for k in c.auth.keys:
        extra = [f"priority={k.priority or c.default_priority}"]
        extra += [f"rpm={k.rpm}"] if k.rpm is not None else []
        extra += [f"tpm={k.tpm}"] if k.tpm is not None else []
        extra += [f"models={','.join(k.models)}"] if k.models is not None else []
        extra += [f"slo_ttft_ms={k.slo_ttft_ms}"] if k.slo_ttft_ms is not None else []
        extra += [f"slo_tpot_ms={k.slo_tpot_ms}"] if k.slo_tpot_ms is not None else []
        lines.append(f"              {k.name}: key: set  {' '.join(extra)}")
        # SPEC §15 tier routes: the alias asked → the alias served, and where that goes.
        for asked, served in (k.routes or {}).items():
            lines.append(f"                route {asked} → {served}  ({_target(c, served)})")
    return lines


def _target(c: Config, alias: str) -> str:
    """Where an alias goes: `pool NAME` or `auto`."""
    spec = c.models.get(alias)
    if spec is None:
        return "?"
    return "auto" if spec.route == "auto" else f"pool {spec.pool}"


def _models(c: Config) -> list[str]:
    lines = ["models"]
    width = max(len(a) for a in c.models) if c.models else 0
    cx = c.routing.complexity
    for alias, spec in c.models.items():
        if spec.route == "auto":
            target = (
                f"auto → simple:{cx.simple} / complex:{cx.complex} "
                f"(default {c.routing.default_complexity})"
            )
        else:
            target = f"pool {spec.pool}{_chain(c, spec.pool)}"
        lines.append(f"  {alias.ljust(width)}  → {target}")
    return lines


def _chain(cfg: Config, pool: str | None) -> str:
    """` (fallback → b → c)` for a pool with a fallback chain, else empty."""
    chain: list[str] = []
    current = cfg.pools[pool].fallback if pool in cfg.pools else None
    while current is not None and current not in chain:
        chain.append(current)
        current = cfg.pools[current].fallback if current in cfg.pools else None
    return f" (fallback → {' → '.join(chain)})" if chain else ""


def _pools(c: Config) -> list[str]:
    lines = ["pools"]
    for name, pool in c.pools.items():
        slots = sum(i.max_concurrency for i in pool.instances)
        bits = [
            f"balancer={c.pool_balancer(name)}",
            f"fallback={pool.fallback or '-'}",
            f"{len(pool.instances)} instance(s), {slots} slots",
        ]
        if pool.spill_to is not None:
            bits.append(f"spill_to={pool.spill_to} at depth {pool.spill_queue_depth}")
        lines.append(f"  {name}  ({', '.join(bits)})")
        name_w = max((len(i.name) for i in pool.instances), default=0)
        url_w = max((len(i.url) for i in pool.instances), default=0)
        for inst in pool.instances:
            line = (
                f"    {inst.name.ljust(name_w)}  {inst.url.ljust(url_w)}  model={inst.model}  "
                f"max_concurrency={inst.max_concurrency}"
                # SPEC §17: an adaptive limit below it, found at run time.
                f"{' (adaptive)' if inst.adaptive_concurrency else ''}  provider={inst.provider}  "
                f"api_key: {_set_or_unset(inst.api_key)}"
            )
            if inst.headers:
                line += f"  headers: {', '.join(inst.headers)}"
            lines.append(line)
    return lines


def _routing(c: Config) -> list[str]:
    cx, cl = c.routing.complexity, c.routing.classifier
    return [
        f"routing     complexity simple={cx.simple or '-'} complex={cx.complex or '-'} "
        f"default={c.routing.default_complexity}",
        f"classifier  long_prompt_chars={cl.long_prompt_chars} "
        f"code_lines_complex={cl.code_lines_complex} "
        f"complex_keywords={len(cl.complex_keywords)} simple_keywords={len(cl.simple_keywords)}",
    ]


def _operations(c: Config, env: Mapping[str, str] | None) -> list[str]:
    """Telemetry, the Batch API and cluster mode."""
    t, b = c.telemetry, c.batch
    tracing = telemetry.describe(c, env)
    if tracing != "off":
        tracing += (
            f" respect_client_sampling={_ON_OFF[t.respect_client_sampling]}"
            f" exemplars={_ON_OFF[t.exemplars]}"
        )
    lines = [
        f"telemetry   {tracing}",
        f"batch       store={_store(b.store)} max_file_bytes={b.max_file_bytes} "
        f"max_lines={b.max_lines} in_flight_per_batch={b.in_flight_per_batch}",
    ]
    if c.cluster is None:
        lines.append("cluster     off (one node)")
        return lines
    cl = c.cluster
    # The default id is "host name + pid" of the serving process (with --workers, of the
    # supervisor): this check's own pid would name a replica that never runs.
    replica = cl.replica_id
    if replica == default_replica_id():
        replica = f"{socket.gethostname()}-<pid of serve>"
    lines.append(
        f"cluster     redis={masked_url(cl.redis_url)} replica_id={replica} "
        f"lease_ms={cl.lease_ms} renew_ms={cl.renew_ms}"
    )
    if not _is_postgres(b.store):
        # SPEC §14: `cluster:` with a SQLite store serves batches per host and says so.
        lines.append(
            "            note: batch.store is SQLite: batches are served per host "
            "(a postgresql:// store shares them across replicas)"
        )
    return lines


def _is_postgres(store: str) -> bool:
    return store.lower().startswith(("postgresql://", "postgres://"))


def _store(store: str) -> str:
    """`batch.store` as shown: a PostgreSQL URL with its password masked."""
    return masked_url(store) if _is_postgres(store) else store


def masked_url(url: str) -> str:
    """`url` with its password and query (where a password may also go) replaced by `***`;
    a URL that does not parse is shown as `***` whole."""
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        return MASK
    host = parts.hostname or ""
    if ":" in host:  # IPv6
        host = f"[{host}]"
    netloc = host + (f":{port}" if port is not None else "")
    if parts.password is not None:
        netloc = f"{parts.username or ''}:{MASK}@{netloc}"
    elif parts.username is not None:
        # `redis://secret@host`: a lone user part is the password for Redis.
        netloc = f"{MASK}@{netloc}"
    query = MASK if parts.query else ""
    return urlunsplit((parts.scheme, netloc, parts.path, query, ""))


def _set_or_unset(secret: str | None) -> str:
    """How `gateway check` shows a secret: whether it is configured, never its value."""
    return "unset" if secret is None else "set"
