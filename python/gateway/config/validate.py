"""Cross-field validation (step 4 of loading): what the types alone cannot say.

Names, URLs, proxies, TLS settings, references between pools and aliases, fallback cycles,
auth keys, timeouts. Reasons never quote a secret, a URL or a proxy (either may carry
credentials): they say what is wrong, and name other entries by path or index.
"""

from __future__ import annotations

import difflib
import os
import re
from collections.abc import Mapping
from typing import Final
from urllib.parse import urlsplit

import msgspec

from gateway._core import MAX_INSTANCES
from gateway.config.schema import Auth, Cluster, Config, InstanceSpec, PoolSpec, TlsSpec
from gateway.errors import ConfigError

__all__ = ["validate"]

_NAME = re.compile(r"[A-Za-z0-9._-]+")
# RFC 9110 §5.6.2 token.
_HEADER_NAME = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")
# Set by the forwarder from the config and the request; an override would break framing or
# routing (hop-by-hop headers, RFC 9110 §7.6.1).
_RESERVED_HEADERS: Final = frozenset(
    {
        "host",
        "content-length",
        "transfer-encoding",
        "connection",
        "keep-alive",
        "proxy-connection",
        "te",
        "trailer",
        "upgrade",
        "proxy-authorization",
        "proxy-authenticate",
    }
)


def validate(cfg: Config) -> Config:
    """Checks what types alone cannot; returns the config with URLs normalised."""
    _check_sections(cfg)
    pools = _check_pools(cfg)
    cfg = msgspec.structs.replace(cfg, pools=pools)
    _check_models(cfg)
    _check_routing(cfg)
    if cfg.auth is not None:
        _check_auth(cfg.auth, cfg)
    if cfg.cluster is not None:
        _check_cluster(cfg.cluster)
    return cfg


def _check_sections(cfg: Config) -> None:
    if not cfg.listen.host.strip():
        raise ConfigError("listen.host", "must not be empty")
    s = cfg.scheduler
    if s.high.weight == 0 and s.low.weight == 0:
        raise ConfigError("scheduler.low.weight", "high.weight and low.weight cannot both be 0")
    h = cfg.health
    if h.max_ejection_ms < h.ejection_ms:
        raise ConfigError(
            "health.max_ejection_ms", f"must be at least health.ejection_ms ({h.ejection_ms})"
        )
    if not h.probe.path.startswith("/"):
        raise ConfigError("health.probe.path", "must start with `/`")
    if (
        _has_bad_chars(h.probe.path)
        or not h.probe.path.isascii()
        or any(c in h.probe.path for c in " ?#")
    ):
        raise ConfigError("health.probe.path", "must be a plain URL path (no spaces, `?` or `#`)")
    t = cfg.timeouts
    for name in ("connect_ms", "first_byte_ms", "stream_idle_ms"):
        if getattr(t, name) > t.total_ms:
            raise ConfigError(
                f"timeouts.{name}", f"must not exceed timeouts.total_ms ({t.total_ms})"
            )
    _check_batch(cfg)


def _check_batch(cfg: Config) -> None:
    """SPEC §14 `batch.store`: a usable file path (the file is created on first use)."""
    store = cfg.batch.store
    if not store.strip() or _has_bad_chars(store):
        raise ConfigError("batch.store", "must be a file path (non-empty, no control characters)")
    if store.endswith(("/", os.sep)):
        raise ConfigError("batch.store", "must name a file, not a directory")


# ---------------------------------------------------------------------------------------------
# Pools and instances.


def _check_pools(cfg: Config) -> dict[str, PoolSpec]:
    """Every pool checked in order; returns them with their instances' URLs normalised."""
    if not cfg.pools:
        raise ConfigError("pools", "at least one pool is required")
    seen_instances: dict[str, str] = {}
    pools = {name: _check_pool(cfg, name, pool, seen_instances) for name, pool in cfg.pools.items()}
    _check_fallback_cycles(cfg.pools)
    return pools


def _check_pool(cfg: Config, name: str, pool: PoolSpec, seen: dict[str, str]) -> PoolSpec:
    """`seen` maps instance names (unique across pools) to the path that first used them."""
    path = f"pools.{name}"
    _check_name(path, name, "pool name")
    if not pool.instances:
        raise ConfigError(f"{path}.instances", "a pool needs at least one instance")
    if len(pool.instances) > MAX_INSTANCES:
        raise ConfigError(
            f"{path}.instances",
            f"a pool holds at most {MAX_INSTANCES} instances (has {len(pool.instances)})",
        )
    instances: list[InstanceSpec] = []
    for i, inst in enumerate(pool.instances):
        ipath = f"{path}.instances[{i}]"
        _check_name(f"{ipath}.name", inst.name, "instance name")
        if inst.name in seen:
            raise ConfigError(
                f"{ipath}.name", f"duplicate instance name {inst.name!r} (also {seen[inst.name]})"
            )
        seen[inst.name] = f"{ipath}.name"
        instances.append(_check_instance(ipath, inst))
    for ref in ("fallback", "spill_to"):
        target = getattr(pool, ref)
        if target is None:
            continue
        if target == name:
            raise ConfigError(f"{path}.{ref}", "must name another pool, not the pool itself")
        if target not in cfg.pools:
            raise ConfigError(f"{path}.{ref}", _unknown("pool", target, cfg.pools))
    if pool.spill_queue_depth > 0 and pool.spill_to is None:
        raise ConfigError(f"{path}.spill_queue_depth", "is set but `spill_to` is not")
    return msgspec.structs.replace(pool, instances=instances)


def _check_instance(path: str, inst: InstanceSpec) -> InstanceSpec:
    """Checks one instance; returns it with its URL normalised."""
    url = _check_url(f"{path}.url", inst.url)
    if not inst.model.strip():
        raise ConfigError(f"{path}.model", "must not be empty")
    if inst.api_key is not None and (not inst.api_key or _has_bad_chars(inst.api_key)):
        # Never quote the key; say only what is wrong with it.
        raise ConfigError(
            f"{path}.api_key",
            "must be a non-empty string without control characters (omit it for no key)",
        )
    _check_headers(f"{path}.headers", inst.headers)
    if inst.api_key is not None and not inst.api_key.isascii():
        raise ConfigError(f"{path}.api_key", "must be ASCII")
    if inst.tls is not None:
        _check_tls(f"{path}.tls", inst.tls, url)
    if inst.proxy is not None:
        _check_proxy(f"{path}.proxy", inst.proxy)
    return msgspec.structs.replace(inst, url=url) if url != inst.url else inst


def _check_headers(path: str, headers: Mapping[str, str]) -> None:
    """Extra upstream headers; reasons never quote a value."""
    for header, value in headers.items():
        hpath = f"{path}.{header}"
        if not _HEADER_NAME.fullmatch(header):
            raise ConfigError(hpath, "not a valid HTTP header name")
        if header.lower() in _RESERVED_HEADERS:
            raise ConfigError(hpath, "is set by the gateway and cannot be configured")
        if _has_bad_chars(value):
            raise ConfigError(hpath, "header value must not contain control characters")
        if not value.isascii():
            # A request head is bytes: a non-ASCII value could not be sent (and would kill
            # the prober, which sends the same head).
            raise ConfigError(hpath, "header value must be ASCII")


def _check_tls(path: str, tls: TlsSpec, url: str) -> None:
    if not url.lower().startswith("https:"):
        raise ConfigError(path, "is only for https:// instances")
    ca = tls.ca_file
    if ca is not None and not os.access(ca, os.R_OK):
        raise ConfigError(f"{path}.ca_file", "is not a readable file")
    name = tls.server_name
    if name is not None and (not name or not name.isascii() or _has_bad_chars(name)):
        raise ConfigError(f"{path}.server_name", "must be a non-empty ASCII host name")


def _check_proxy(path: str, url: str) -> None:
    """An egress proxy is `http://[user:password@]host:port`; the reason never quotes it."""
    if _has_bad_chars(url) or " " in url:
        raise ConfigError(path, "must not contain spaces or control characters")
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - raises on a bad port
    except ValueError:
        raise ConfigError(path, "not a valid URL (bad host or port)") from None
    if parts.scheme.lower() != "http":
        raise ConfigError(path, "must be an http:// proxy URL (HTTP CONNECT)")
    if not parts.hostname:
        raise ConfigError(path, "must name a host")


def _check_url(path: str, url: str) -> str:
    """Validates an instance base URL; returns it without a trailing slash.

    Reasons never quote the URL: if it carried credentials, the error would leak them.
    """
    if _has_bad_chars(url) or " " in url:
        raise ConfigError(path, "must not contain spaces or control characters")
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        raise ConfigError(path, "not a valid URL (bad host or port)") from None
    if parts.scheme.lower() not in ("http", "https"):
        raise ConfigError(path, "must be an http:// or https:// URL")
    if not parts.hostname:
        raise ConfigError(path, "must name a host")
    if parts.username is not None or parts.password is not None:
        raise ConfigError(path, "must not embed credentials; use `api_key` or `headers`")
    if parts.query or parts.fragment or url.endswith(("?", "#")):
        raise ConfigError(path, "must not have a query or fragment")
    if port == 0:
        raise ConfigError(path, "port must be 1-65535")
    return url.rstrip("/")


def _check_fallback_cycles(pools: Mapping[str, PoolSpec]) -> None:
    for start in pools:
        chain = [start]
        current = pools[start].fallback
        while current is not None and current in pools:
            if current in chain:
                cycle = " → ".join([*chain[chain.index(current) :], current])
                raise ConfigError(f"pools.{start}.fallback", f"fallback cycle: {cycle}")
            chain.append(current)
            current = pools[current].fallback


# ---------------------------------------------------------------------------------------------
# Models, routing, auth.


def _check_models(cfg: Config) -> None:
    if not cfg.models:
        raise ConfigError("models", "at least one model alias is required")
    for alias, spec in cfg.models.items():
        path = f"models.{alias}"
        if not alias or alias != alias.strip() or _has_bad_chars(alias):
            raise ConfigError(path, "alias must be non-empty, without surrounding spaces")
        if (spec.pool is None) == (spec.route is None):
            raise ConfigError(path, "needs exactly one of `pool` or `route: auto`")
        if spec.pool is not None and spec.pool not in cfg.pools:
            raise ConfigError(f"{path}.pool", _unknown("pool", spec.pool, cfg.pools))


def _check_routing(cfg: Config) -> None:
    auto = [alias for alias, spec in cfg.models.items() if spec.route == "auto"]
    cx = cfg.routing.complexity
    for field in ("simple", "complex"):
        target = getattr(cx, field)
        path = f"routing.complexity.{field}"
        if target is None:
            if auto:
                raise ConfigError(path, f"must name a pool: models.{auto[0]} uses `route: auto`")
        elif target not in cfg.pools:
            raise ConfigError(path, _unknown("pool", target, cfg.pools))
    cl = cfg.routing.classifier
    for field in ("complex_keywords", "simple_keywords"):
        for i, word in enumerate(getattr(cl, field)):
            if not word.strip():
                raise ConfigError(f"routing.classifier.{field}[{i}]", "must not be empty")


def _check_auth(auth: Auth, cfg: Config) -> None:
    if not auth.keys:
        raise ConfigError(
            "auth.keys", "auth is on but lists no keys; remove `auth` to turn client auth off"
        )
    keys: dict[str, int] = {}
    names: dict[str, int] = {}
    for i, entry in enumerate(auth.keys):
        path = f"auth.keys[{i}]"
        # Reasons name the other entry by index, never by its value.
        if not entry.key or _has_bad_chars(entry.key) or entry.key != entry.key.strip():
            raise ConfigError(
                f"{path}.key", "must be non-empty, without spaces around or control characters"
            )
        if entry.key in keys:
            raise ConfigError(f"{path}.key", f"duplicate key: same as auth.keys[{keys[entry.key]}]")
        keys[entry.key] = i
        if not entry.name.strip():
            raise ConfigError(f"{path}.name", "must not be empty")
        if entry.name in names:
            raise ConfigError(
                f"{path}.name",
                f"duplicate name {entry.name!r}: same as auth.keys[{names[entry.name]}]",
            )
        names[entry.name] = i
        for j, alias in enumerate(entry.models or ()):
            if alias not in cfg.models:
                raise ConfigError(f"{path}.models[{j}]", _unknown("model alias", alias, cfg.models))
        _check_routes(f"{path}.routes", entry.routes or {}, cfg)
    if auth.admin_key is not None:
        _check_admin_key(auth.admin_key, keys)


def _check_routes(path: str, routes: Mapping[str, str], cfg: Config) -> None:
    """SPEC §15 tier routes: an alias the client asks for → the alias it is served as; both
    must exist (a route is applied once, so chains are not followed)."""
    for asked, served in routes.items():
        if asked not in cfg.models:
            raise ConfigError(f"{path}.{asked}", _unknown("model alias", asked, cfg.models))
        if served not in cfg.models:
            raise ConfigError(f"{path}.{asked}", _unknown("model alias", served, cfg.models))


def _check_admin_key(admin_key: str, client_keys: Mapping[str, int]) -> None:
    """`client_keys` maps each client key to its index in `auth.keys`."""
    if not admin_key or _has_bad_chars(admin_key):
        raise ConfigError(
            "auth.admin_key", "must be non-empty, without control characters (or omitted)"
        )
    if admin_key in client_keys:
        raise ConfigError(
            "auth.admin_key",
            f"must differ from every client key (equals auth.keys[{client_keys[admin_key]}])",
        )


def _check_cluster(cluster: Cluster) -> None:
    """SPEC §13 `cluster:`. The reason never quotes `redis_url` (it may hold a password)."""
    if _has_bad_chars(cluster.redis_url) or " " in cluster.redis_url:
        raise ConfigError("cluster.redis_url", "must not contain spaces or control characters")
    try:
        parts = urlsplit(cluster.redis_url)
        parts.port  # noqa: B018 - raises on a bad port
    except ValueError:
        raise ConfigError("cluster.redis_url", "not a valid URL (bad host or port)") from None
    if parts.scheme.lower() not in ("redis", "rediss", "unix"):
        raise ConfigError("cluster.redis_url", "must be a redis://, rediss:// or unix:// URL")
    # The replica id names this replica in Redis keys, /admin/state and metric labels.
    _check_name("cluster.replica_id", cluster.replica_id, "replica id")
    if cluster.renew_ms * 3 > cluster.lease_ms:
        # A replica self-fences at 3/4 of the lease: it needs a few renewals before that.
        raise ConfigError(
            "cluster.renew_ms", f"must be at most a third of cluster.lease_ms ({cluster.lease_ms})"
        )


# ---------------------------------------------------------------------------------------------
# Helpers.


def _check_name(path: str, name: str, what: str) -> None:
    if not _NAME.fullmatch(name):
        raise ConfigError(path, f"{what} {name!r} must be non-empty and use only A-Z a-z 0-9 . _ -")


def _has_bad_chars(text: str) -> bool:
    return any(ord(c) < 0x20 or ord(c) == 0x7F for c in text)


def _unknown(what: str, name: str, known: Mapping[str, object]) -> str:
    close = difflib.get_close_matches(name, list(known), n=1)
    hint = f"; did you mean {close[0]!r}?" if close else f"; known: {', '.join(known) or 'none'}"
    return f"unknown {what} {name!r}{hint}"
