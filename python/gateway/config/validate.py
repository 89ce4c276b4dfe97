"""Cross-field validation (step 4 of loading): what the types alone cannot say.

Names, URLs, proxies, TLS settings, references between pools and aliases, fallback cycles,
auth keys, timeouts. Every rule runs and every finding is reported (SPEC §18: one run shows
all the errors of a file); each field gets at most one reason, the first rule it breaks.

The rules read `Parts`, the config as far as it decoded: when a section, a pool, an instance,
an alias or a key failed to decode (its errors are already reported), the rules that need it
are skipped rather than report noise about it, and the others still run.

Reasons never quote a secret, a URL or a proxy (either may carry credentials): they say what
is wrong, and name other entries by path or index.
"""

from __future__ import annotations

import difflib
import os
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Final
from urllib.parse import urlsplit

import msgspec

from gateway._core import MAX_INSTANCES
from gateway.config.schema import (
    ApiKey,
    Auth,
    Cluster,
    Config,
    InstanceSpec,
    ModelAlias,
    PoolSpec,
    TlsSpec,
)
from gateway.errors import ConfigError

__all__ = ["Parts", "findings", "validate"]

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


@dataclass(frozen=True, kw_only=True)
class Parts:
    """A config as far as it decoded: what the cross-field rules read.

    - `config`: the top-level sections; one named in `failed` did not decode and holds its
      default (its rules are skipped). Its `pools`, `models` and `auth.keys` are not read:
    - `pools` / `models`: every entry of the file, `None` for one that did not decode; the
      whole is `None` when the section is unusable (missing, not a mapping, a key that is not a
      string): then nothing is said about references to it;
    - `instances`: per pool whose `instances` is a list, each instance or `None`;
    - `keys`: `auth.keys`, each key or `None`; `None` when there is no usable list.
    """

    config: Config
    failed: frozenset[str] = frozenset()
    pools: Mapping[str, PoolSpec | None] | None
    instances: Mapping[str, Sequence[InstanceSpec | None]] = field(default_factory=dict)
    models: Mapping[str, ModelAlias | None] | None
    keys: Sequence[ApiKey | None] | None = None

    @classmethod
    def of(cls, cfg: Config) -> Parts:
        """The parts of a config that decoded whole."""
        return cls(
            config=cfg,
            pools=cfg.pools,
            instances={name: pool.instances for name, pool in cfg.pools.items()},
            models=cfg.models,
            keys=cfg.auth.keys if cfg.auth is not None else None,
        )

    def ok(self, section: str) -> bool:
        """Whether the top-level `section` decoded (or was left to its default)."""
        return section not in self.failed

    def pool_names(self) -> Mapping[str, object] | None:
        """The pools a reference may name; `None` when nothing can be said of a reference (no
        usable `pools`, or none at all: that is reported on its own)."""
        return self.pools or None

    def aliases(self) -> Mapping[str, object] | None:
        """The model aliases a reference may name, as `pool_names`."""
        return self.models or None


def validate(cfg: Config) -> Config:
    """Checks what types alone cannot; returns the config with URLs normalised, or raises one
    `ConfigError` listing every finding."""
    if errors := findings(Parts.of(cfg)):
        raise ConfigError.combine(errors)
    return _normalised(cfg)


def findings(parts: Parts) -> list[ConfigError]:
    """Every cross-field rule `parts` breaks, in the order of the file's sections."""
    return [
        *_sections(parts),
        *_pools(parts),
        *_models(parts),
        *_routing(parts),
        *_auth(parts),
        *_cluster(parts),
    ]


def _normalised(cfg: Config) -> Config:
    """`cfg` with every instance URL without its trailing slash."""
    pools = {
        name: msgspec.structs.replace(
            pool,
            instances=[
                msgspec.structs.replace(i, url=i.url.rstrip("/")) if i.url.endswith("/") else i
                for i in pool.instances
            ],
        )
        for name, pool in cfg.pools.items()
    }
    return msgspec.structs.replace(cfg, pools=pools)


def _sections(parts: Parts) -> Iterator[ConfigError]:
    cfg = parts.config
    if parts.ok("listen") and not cfg.listen.host.strip():
        yield ConfigError("listen.host", "must not be empty")
    s = cfg.scheduler
    if parts.ok("scheduler") and s.high.weight == 0 and s.low.weight == 0:
        yield ConfigError("scheduler.low.weight", "high.weight and low.weight cannot both be 0")
    if parts.ok("health"):
        h = cfg.health
        if h.max_ejection_ms < h.ejection_ms:
            yield ConfigError(
                "health.max_ejection_ms", f"must be at least health.ejection_ms ({h.ejection_ms})"
            )
        if not h.probe.path.startswith("/"):
            yield ConfigError("health.probe.path", "must start with `/`")
        elif (
            _has_bad_chars(h.probe.path)
            or not h.probe.path.isascii()
            or any(c in h.probe.path for c in " ?#")
        ):
            yield ConfigError(
                "health.probe.path", "must be a plain URL path (no spaces, `?` or `#`)"
            )
    if parts.ok("timeouts"):
        t = cfg.timeouts
        for name in ("connect_ms", "first_byte_ms", "stream_idle_ms"):
            if getattr(t, name) > t.total_ms:
                yield ConfigError(
                    f"timeouts.{name}", f"must not exceed timeouts.total_ms ({t.total_ms})"
                )
    if parts.ok("batch"):
        yield from _batch(cfg.batch.store)
    if parts.ok("affinity") and cfg.affinity.block_bytes % 16:
        # SPEC §15: the core hashes blocks in 16-byte words.
        yield ConfigError("affinity.block_bytes", "must be a multiple of 16")


def _batch(store: str) -> Iterator[ConfigError]:
    """SPEC §14 `batch.store`: a usable file path (the file is created on first use), or a
    PostgreSQL URL ("Across hosts") — never a URL taken for a file name."""
    if not store.strip() or _has_bad_chars(store):
        yield ConfigError("batch.store", "must be a file path (non-empty, no control characters)")
    elif store.startswith(("postgresql://", "postgres://")):
        url = urlsplit(store)
        if not url.hostname and "host=" not in url.query:
            yield ConfigError("batch.store", "a PostgreSQL URL must name a host")
    elif "://" in store:
        yield ConfigError(
            "batch.store", "must be a file path or a postgresql:// URL (no other database)"
        )
    elif store.endswith(("/", os.sep)):
        yield ConfigError("batch.store", "must name a file, not a directory")


# ---------------------------------------------------------------------------------------------
# Pools and instances.


def _pools(parts: Parts) -> Iterator[ConfigError]:
    """Every pool and every instance that decoded; references to pools that did not decode are
    still checked by name."""
    if parts.pools is None:
        return
    if not parts.pools:
        yield ConfigError("pools", "at least one pool is required")
    seen: dict[str, str] = {}  # instance names (unique across pools) → the path that used it
    for name, pool in parts.pools.items():
        path = f"pools.{name}"
        yield from _name(path, name, "pool name")
        instances = parts.instances.get(name)
        if instances is not None:
            yield from _instances(f"{path}.instances", instances, seen)
        if pool is not None:
            yield from _pool_refs(path, name, pool, parts.pools)
    decoded = {name: pool for name, pool in parts.pools.items() if pool is not None}
    yield from _fallback_cycles(decoded)


def _instances(
    path: str, instances: Sequence[InstanceSpec | None], seen: dict[str, str]
) -> Iterator[ConfigError]:
    if not instances:
        yield ConfigError(path, "a pool needs at least one instance")
    if len(instances) > MAX_INSTANCES:
        yield ConfigError(
            path, f"a pool holds at most {MAX_INSTANCES} instances (has {len(instances)})"
        )
    for i, inst in enumerate(instances):
        if inst is None:
            continue
        ipath = f"{path}[{i}]"
        if not _NAME.fullmatch(inst.name):
            yield from _name(f"{ipath}.name", inst.name, "instance name")
        elif inst.name in seen:
            yield ConfigError(
                f"{ipath}.name", f"duplicate instance name {inst.name!r} (also {seen[inst.name]})"
            )
        else:
            seen[inst.name] = f"{ipath}.name"
        yield from _instance(ipath, inst)


def _pool_refs(
    path: str, name: str, pool: PoolSpec, pools: Mapping[str, object]
) -> Iterator[ConfigError]:
    for ref in ("fallback", "spill_to"):
        target = getattr(pool, ref)
        if target is None:
            continue
        if target == name:
            yield ConfigError(f"{path}.{ref}", "must name another pool, not the pool itself")
        elif target not in pools:
            yield ConfigError(f"{path}.{ref}", _unknown("pool", target, pools))
    if pool.spill_queue_depth > 0 and pool.spill_to is None:
        yield ConfigError(f"{path}.spill_queue_depth", "is set but `spill_to` is not")


def _instance(path: str, inst: InstanceSpec) -> Iterator[ConfigError]:
    """One instance's fields, each on its own."""
    url_reason = _url_reason(inst.url)
    if url_reason is not None:
        yield ConfigError(f"{path}.url", url_reason)
    if not inst.model.strip():
        yield ConfigError(f"{path}.model", "must not be empty")
    if inst.api_key is not None:
        if not inst.api_key or _has_bad_chars(inst.api_key):
            # Never quote the key; say only what is wrong with it.
            yield ConfigError(
                f"{path}.api_key",
                "must be a non-empty string without control characters (omit it for no key)",
            )
        elif not inst.api_key.isascii():
            yield ConfigError(f"{path}.api_key", "must be ASCII")
    yield from _headers(f"{path}.headers", inst.headers)
    # The TLS settings of a URL that is itself wrong would only add noise.
    if inst.tls is not None and url_reason is None:
        yield from _tls(f"{path}.tls", inst.tls, inst.url)
    if inst.proxy is not None and (reason := _proxy_reason(inst.proxy)) is not None:
        yield ConfigError(f"{path}.proxy", reason)


def _headers(path: str, headers: Mapping[str, str]) -> Iterator[ConfigError]:
    """Extra upstream headers; reasons never quote a value."""
    for header, value in headers.items():
        hpath = f"{path}.{header}"
        if not _HEADER_NAME.fullmatch(header):
            yield ConfigError(hpath, "not a valid HTTP header name")
        elif header.lower() in _RESERVED_HEADERS:
            yield ConfigError(hpath, "is set by the gateway and cannot be configured")
        elif _has_bad_chars(value):
            yield ConfigError(hpath, "header value must not contain control characters")
        elif not value.isascii():
            # A request head is bytes: a non-ASCII value could not be sent (and would kill
            # the prober, which sends the same head).
            yield ConfigError(hpath, "header value must be ASCII")


def _tls(path: str, tls: TlsSpec, url: str) -> Iterator[ConfigError]:
    if not url.lower().startswith("https:"):
        yield ConfigError(path, "is only for https:// instances")
        return
    ca = tls.ca_file
    if ca is not None and not os.access(ca, os.R_OK):
        yield ConfigError(f"{path}.ca_file", "is not a readable file")
    name = tls.server_name
    if name is not None and (not name or not name.isascii() or _has_bad_chars(name)):
        yield ConfigError(f"{path}.server_name", "must be a non-empty ASCII host name")


def _proxy_reason(url: str) -> str | None:
    """What is wrong with an egress proxy URL, `http://[user:password@]host:port`, if anything;
    the reason never quotes it."""
    if _has_bad_chars(url) or " " in url:
        return "must not contain spaces or control characters"
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - raises on a bad port
    except ValueError:
        return "not a valid URL (bad host or port)"
    if parts.scheme.lower() != "http":
        return "must be an http:// proxy URL (HTTP CONNECT)"
    if not parts.hostname:
        return "must name a host"
    return None


def _url_reason(url: str) -> str | None:
    """What is wrong with an instance base URL, if anything.

    Reasons never quote the URL: if it carried credentials, the error would leak them.
    """
    if _has_bad_chars(url) or " " in url:
        return "must not contain spaces or control characters"
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        return "not a valid URL (bad host or port)"
    if parts.scheme.lower() not in ("http", "https"):
        return "must be an http:// or https:// URL"
    if not parts.hostname:
        return "must name a host"
    if parts.username is not None or parts.password is not None:
        return "must not embed credentials; use `api_key` or `headers`"
    if parts.query or parts.fragment or url.endswith(("?", "#")):
        return "must not have a query or fragment"
    if port == 0:
        return "port must be 1-65535"
    return None


def _fallback_cycles(pools: Mapping[str, PoolSpec]) -> Iterator[ConfigError]:
    """Each fallback cycle once, at the pool on it where the walk from the file's first pool
    leading into it enters it."""
    reported: set[str] = set()
    for start in pools:
        chain = [start]
        current = pools[start].fallback
        # A pool falling back to itself is reported as such, not as a cycle too.
        while current is not None and current in pools and current != chain[-1]:
            if current in chain:
                cycle = chain[chain.index(current) :]
                if not reported.intersection(cycle):
                    reported.update(cycle)
                    text = " → ".join([*cycle, current])
                    yield ConfigError(f"pools.{cycle[0]}.fallback", f"fallback cycle: {text}")
                break
            chain.append(current)
            current = pools[current].fallback


# ---------------------------------------------------------------------------------------------
# Models, routing, auth.


def _models(parts: Parts) -> Iterator[ConfigError]:
    if parts.models is None:
        return
    if not parts.models:
        yield ConfigError("models", "at least one model alias is required")
    pools = parts.pool_names()
    for alias, spec in parts.models.items():
        path = f"models.{alias}"
        if not alias or alias != alias.strip() or _has_bad_chars(alias):
            yield ConfigError(path, "alias must be non-empty, without surrounding spaces")
        if spec is None:
            continue
        if (spec.pool is None) == (spec.route is None):
            yield ConfigError(path, "needs exactly one of `pool` or `route: auto`")
        elif spec.pool is not None and pools is not None and spec.pool not in pools:
            yield ConfigError(f"{path}.pool", _unknown("pool", spec.pool, pools))


def _routing(parts: Parts) -> Iterator[ConfigError]:
    if not parts.ok("routing"):
        return
    models = parts.models or {}
    # An alias that names a pool too is reported as such: it does not ask for routing.
    auto = [
        alias
        for alias, spec in models.items()
        if spec is not None and spec.route == "auto" and spec.pool is None
    ]
    routing = parts.config.routing
    cx = routing.complexity
    pools = parts.pool_names()
    for name in ("simple", "complex"):
        target = getattr(cx, name)
        path = f"routing.complexity.{name}"
        if target is None:
            if auto:
                yield ConfigError(path, f"must name a pool: models.{auto[0]} uses `route: auto`")
        elif pools is not None and target not in pools:
            yield ConfigError(path, _unknown("pool", target, pools))
    cl = routing.classifier
    for name in ("complex_keywords", "simple_keywords"):
        for i, word in enumerate(getattr(cl, name)):
            if not word.strip():
                yield ConfigError(f"routing.classifier.{name}[{i}]", "must not be empty")


def _auth(parts: Parts) -> Iterator[ConfigError]:
    """Client keys that decoded, each on its own; the admin key when `auth` decoded whole."""
    if parts.keys is None:
        return
    auth = parts.config.auth
    if not parts.keys:
        yield ConfigError(
            "auth.keys", "auth is on but lists no keys; remove `auth` to turn client auth off"
        )
    keys: dict[str, int] = {}
    names: dict[str, int] = {}
    for i, entry in enumerate(parts.keys):
        if entry is not None:
            yield from _key(f"auth.keys[{i}]", i, entry, keys, names, parts.aliases())
    if parts.ok("auth") and auth is not None and auth.admin_key is not None:
        yield from _admin_key(auth, keys)


def _key(
    path: str,
    i: int,
    entry: ApiKey,
    keys: dict[str, int],
    names: dict[str, int],
    models: Mapping[str, object] | None,
) -> Iterator[ConfigError]:
    """One client key; `keys` and `names` map those seen so far to their index."""
    # Reasons name the other entry by index, never by its value.
    if not entry.key or _has_bad_chars(entry.key) or entry.key != entry.key.strip():
        yield ConfigError(
            f"{path}.key", "must be non-empty, without spaces around or control characters"
        )
    elif entry.key in keys:
        yield ConfigError(f"{path}.key", f"duplicate key: same as auth.keys[{keys[entry.key]}]")
    else:
        keys[entry.key] = i
    if not entry.name.strip():
        yield ConfigError(f"{path}.name", "must not be empty")
    elif entry.name in names:
        yield ConfigError(
            f"{path}.name", f"duplicate name {entry.name!r}: same as auth.keys[{names[entry.name]}]"
        )
    else:
        names[entry.name] = i
    if models is None:
        return
    for j, alias in enumerate(entry.models or ()):
        if alias not in models:
            yield ConfigError(f"{path}.models[{j}]", _unknown("model alias", alias, models))
    # SPEC §15 tier routes: an alias the client asks for → the alias it is served as; both
    # must exist (a route is applied once, so chains are not followed).
    for asked, served in (entry.routes or {}).items():
        if asked not in models:
            yield ConfigError(f"{path}.routes.{asked}", _unknown("model alias", asked, models))
        elif served not in models:
            yield ConfigError(f"{path}.routes.{asked}", _unknown("model alias", served, models))


def _admin_key(auth: Auth, client_keys: Mapping[str, int]) -> Iterator[ConfigError]:
    """`client_keys` maps each client key to its index in `auth.keys`."""
    admin_key = auth.admin_key
    if admin_key is None:
        return
    if not admin_key or _has_bad_chars(admin_key):
        yield ConfigError(
            "auth.admin_key", "must be non-empty, without control characters (or omitted)"
        )
    elif admin_key in client_keys:
        yield ConfigError(
            "auth.admin_key",
            f"must differ from every client key (equals auth.keys[{client_keys[admin_key]}])",
        )


def _cluster(parts: Parts) -> Iterator[ConfigError]:
    """SPEC §13 `cluster:`. The reason never quotes `redis_url` (it may hold a password)."""
    cluster: Cluster | None = parts.config.cluster
    if cluster is None or not parts.ok("cluster"):
        return
    if (reason := _redis_reason(cluster.redis_url)) is not None:
        yield ConfigError("cluster.redis_url", reason)
    # The replica id names this replica in Redis keys, /admin/state and metric labels.
    yield from _name("cluster.replica_id", cluster.replica_id, "replica id")
    if cluster.renew_ms * 3 > cluster.lease_ms:
        # A replica self-fences at 3/4 of the lease: it needs a few renewals before that.
        yield ConfigError(
            "cluster.renew_ms", f"must be at most a third of cluster.lease_ms ({cluster.lease_ms})"
        )


def _redis_reason(url: str) -> str | None:
    if _has_bad_chars(url) or " " in url:
        return "must not contain spaces or control characters"
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - raises on a bad port
    except ValueError:
        return "not a valid URL (bad host or port)"
    if parts.scheme.lower() not in ("redis", "rediss", "unix"):
        return "must be a redis://, rediss:// or unix:// URL"
    return None


# ---------------------------------------------------------------------------------------------
# Helpers.


def _name(path: str, name: str, what: str) -> Iterator[ConfigError]:
    if not _NAME.fullmatch(name):
        yield ConfigError(path, f"{what} {name!r} must be non-empty and use only A-Z a-z 0-9 . _ -")


def _has_bad_chars(text: str) -> bool:
    return any(ord(c) < 0x20 or ord(c) == 0x7F for c in text)


def _unknown(what: str, name: str, known: Mapping[str, object]) -> str:
    close = difflib.get_close_matches(name, list(known), n=1)
    hint = f"; did you mean {close[0]!r}?" if close else f"; known: {', '.join(known) or 'none'}"
    return f"unknown {what} {name!r}{hint}"
