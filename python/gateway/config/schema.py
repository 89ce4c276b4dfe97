"""The configuration schema (SPEC §8): frozen msgspec structs with the SPEC's defaults.

Every struct forbids unknown fields (a typo is an error, not a silently ignored setting) and is
frozen. Their `repr()` masks every field typed `Secret` (see `secret.py`).
"""

from __future__ import annotations

import os
import socket
import types
import typing
from collections.abc import Iterator, Mapping
from typing import Annotated, Final, Literal, TypeAlias

import msgspec

from gateway._core import Priority
from gateway.config.secret import Secret, masked

__all__ = [
    "CLASS_DEFAULTS",
    "DEFAULT_COMPLEX_KEYWORDS",
    "DEFAULT_SIMPLE_KEYWORDS",
    "PRIORITIES",
    "PRIORITY_ALIASES",
    "Affinity",
    "ApiKey",
    "Auth",
    "BalancerName",
    "Batch",
    "ClassSettings",
    "Classifier",
    "Cluster",
    "ComplexityName",
    "ComplexityRouting",
    "Config",
    "Health",
    "InstanceSpec",
    "Limits",
    "Listen",
    "ModelAlias",
    "NonNegativeInt",
    "NonNegativeMs",
    "PolicyName",
    "PoolSpec",
    "PositiveInt",
    "PositiveMs",
    "PriorityName",
    "Probe",
    "ProviderName",
    "Retries",
    "Routing",
    "Scheduler",
    "Shutdown",
    "Telemetry",
    "Timeouts",
    "TlsSpec",
    "is_optional",
    "literal_args",
    "struct_fields",
    "unwrap",
]

# ---------------------------------------------------------------------------------------------
# Value types. The upper bounds are those of the Rust core's integer types (u32 counts, u64
# milliseconds), so a value accepted here never overflows when handed to `gateway._core`.

_U32_MAX: Final = 2**32 - 1
# 2**53 ms is ~285,000 years: "forever" for any timer, and still exact as a float.
_MS_MAX: Final = 2**53

PositiveInt: TypeAlias = Annotated[int, msgspec.Meta(ge=1, le=_U32_MAX)]
NonNegativeInt: TypeAlias = Annotated[int, msgspec.Meta(ge=0, le=_U32_MAX)]
PositiveMs: TypeAlias = Annotated[int, msgspec.Meta(ge=1, le=_MS_MAX)]
NonNegativeMs: TypeAlias = Annotated[int, msgspec.Meta(ge=0, le=_MS_MAX)]

PriorityName: TypeAlias = Literal["high", "low"]
PolicyName: TypeAlias = Literal["weighted", "strict"]
BalancerName: TypeAlias = Literal[
    "least_connections", "round_robin", "random", "p2c", "affinity", "predicted"
]
ProviderName: TypeAlias = Literal["openai", "vllm", "dashscope", "qianfan"]
ComplexityName: TypeAlias = Literal["simple", "complex"]

# SPEC §4: `realtime` and `batch` are accepted wherever a priority is.
PRIORITY_ALIASES: Final[Mapping[str, PriorityName]] = {
    "high": "high",
    "low": "low",
    "realtime": "high",
    "batch": "low",
}

#: Every priority name the spec accepts, as the core's enum (the one map from names).
PRIORITIES: Final[Mapping[str, Priority]] = {
    name: Priority.HIGH if label == "high" else Priority.LOW
    for name, label in PRIORITY_ALIASES.items()
}

# ---------------------------------------------------------------------------------------------
# The schema (SPEC §8). Every field has the default the SPEC shows.


class _Section(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """The base of every config struct: unknown fields refused, secrets masked in `repr()` (and
    in `rich`'s pretty printing). Subclasses repeat `frozen=True` (for type checkers) and pass
    `kw_only=True` (msgspec applies it per class)."""

    def __repr__(self) -> str:
        fields = ", ".join(f"{name}={value!r}" for name, value in masked(self))
        return f"{type(self).__name__}({fields})"

    def __rich_repr__(self) -> list[tuple[str, object]]:
        return masked(self)


class Listen(_Section, frozen=True, kw_only=True):
    """Where the gateway listens. Port 0 asks the OS for a free port (tests, demos)."""

    host: str = "127.0.0.1"
    port: Annotated[int, msgspec.Meta(ge=0, le=65535)] = 8080


class ClassSettings(_Section, frozen=True, kw_only=True):
    """One priority class's queue: bound, share of grants and deadline (SPEC §3)."""

    capacity: PositiveInt
    weight: NonNegativeInt
    max_wait_ms: PositiveMs
    # SPEC §17: the class's latency objectives (after the request's headers and its key's).
    slo_ttft_ms: PositiveMs | None = None
    slo_tpot_ms: PositiveMs | None = None


# SPEC §3 defaults per class; a partial `high:` / `low:` section keeps the rest of its own
# class's values (filled in before decoding, since the two classes share one struct).
CLASS_DEFAULTS: Final[Mapping[str, Mapping[str, int]]] = {
    "high": {"capacity": 200, "weight": 7, "max_wait_ms": 30_000},
    "low": {"capacity": 1000, "weight": 3, "max_wait_ms": 600_000},
}


def _high_class() -> ClassSettings:
    return ClassSettings(**CLASS_DEFAULTS["high"])


def _low_class() -> ClassSettings:
    return ClassSettings(**CLASS_DEFAULTS["low"])


class Scheduler(_Section, frozen=True, kw_only=True):
    """Per-pool dual-queue scheduling (SPEC §3)."""

    policy: PolicyName = "weighted"
    high: ClassSettings = msgspec.field(default_factory=_high_class)
    low: ClassSettings = msgspec.field(default_factory=_low_class)
    max_consecutive_high: PositiveInt = 20
    max_low_wait_ms: PositiveMs = 5000
    overflow_high_to_low: bool = True
    # SPEC §17: a request whose objective no instance it may use is predicted to meet is
    # answered at once 503 `slo_unattainable` (with Retry-After) instead of queueing.
    shed_unattainable: bool = False


class Probe(_Section, frozen=True, kw_only=True):
    """Active health probing (SPEC §6)."""

    interval_ms: PositiveMs = 5000
    timeout_ms: PositiveMs = 2000
    path: str = "/v1/models"
    enabled: bool = True


class Health(_Section, frozen=True, kw_only=True):
    """Passive ejection, half-open trials and probes, per instance (SPEC §6)."""

    failure_threshold: PositiveInt = 3
    ejection_ms: PositiveMs = 10_000
    max_ejection_ms: PositiveMs = 300_000
    half_open_max_requests: PositiveInt = 1
    success_threshold: PositiveInt = 2
    probe: Probe = msgspec.field(default_factory=Probe)


class Timeouts(_Section, frozen=True, kw_only=True):
    """Upstream timeouts (SPEC §6)."""

    connect_ms: PositiveMs = 5000
    first_byte_ms: PositiveMs = 120_000
    stream_idle_ms: PositiveMs = 60_000
    total_ms: PositiveMs = 600_000


class Retries(_Section, frozen=True, kw_only=True):
    """Attempts per request within its pool, the first one included (SPEC §6)."""

    max_attempts: PositiveInt = 3


class TlsSpec(_Section, frozen=True, kw_only=True):
    """SPEC §6: how an `https` instance's certificate is verified. Verification cannot be
    turned off: `ca_file` replaces the system store, `server_name` the name checked (and sent
    as SNI)."""

    ca_file: str | None = None
    server_name: str | None = None


class InstanceSpec(_Section, frozen=True, kw_only=True):
    """One backend endpoint. `url` is its OpenAI base URL (no trailing slash once loaded).

    `proxy` is an egress proxy URL (`http://host:port`) used for this instance instead of
    `HTTPS_PROXY` / `HTTP_PROXY` from the environment (SPEC §6)."""

    name: str
    url: str
    model: str
    api_key: Secret | None = None
    max_concurrency: PositiveInt
    # SPEC §17: `max_concurrency: {max: N, adaptive: true}` in the file (the loader splits it):
    # the gateway finds the instance's limit below `max_concurrency`, its hard ceiling.
    adaptive_concurrency: bool = False
    provider: ProviderName = "openai"
    # Header values are secrets too: they are where extra credentials usually go.
    headers: dict[str, Secret] = {}
    tls: TlsSpec | None = None
    # A proxy URL may carry credentials (user:password@host).
    proxy: Secret | None = None


class PoolSpec(_Section, frozen=True, kw_only=True):
    """A set of interchangeable instances; `balancer` overrides the top-level one."""

    instances: list[InstanceSpec]
    fallback: str | None = None
    balancer: BalancerName | None = None
    spill_to: str | None = None
    spill_queue_depth: NonNegativeInt = 0


class ModelAlias(_Section, frozen=True, kw_only=True):
    """A client-facing model name: a pool, or `route: auto` (complexity routing)."""

    pool: str | None = None
    route: Literal["auto"] | None = None


class ComplexityRouting(_Section, frozen=True, kw_only=True):
    """The pools `auto` aliases send simple and complex requests to."""

    simple: str | None = None
    complex: str | None = None


DEFAULT_COMPLEX_KEYWORDS: Final[tuple[str, ...]] = (
    "time complexity",
    "space complexity",
    "worst case",
    "worst-case",
    "prove",
    "proof",
    "optimize",
    "optimise",
    "dynamic programming",
    "amortized",
    "big-o",
    "dp",
    "tle",
    "时间复杂度",
    "空间复杂度",
    "复杂度",
    "复杂度分析",
    "最坏情况",
    "证明",
    "优化",
    "动态规划",
    "超时",
    "正解",
)
DEFAULT_SIMPLE_KEYWORDS: Final[tuple[str, ...]] = (
    "compile",
    "syntax",
    "typo",
    "does this compile",
    "编译",
    "语法",
    "能不能编译",
)


class Classifier(_Section, frozen=True, kw_only=True):
    """Rules of the `auto` complexity classifier (SPEC §4). Given lists replace the defaults."""

    complex_keywords: list[str] = msgspec.field(
        default_factory=lambda: list(DEFAULT_COMPLEX_KEYWORDS)
    )
    simple_keywords: list[str] = msgspec.field(
        default_factory=lambda: list(DEFAULT_SIMPLE_KEYWORDS)
    )
    long_prompt_chars: PositiveInt = 4000
    code_lines_complex: PositiveInt = 40


class Routing(_Section, frozen=True, kw_only=True):
    """Complexity routing for `auto` aliases."""

    complexity: ComplexityRouting = msgspec.field(default_factory=ComplexityRouting)
    classifier: Classifier = msgspec.field(default_factory=Classifier)
    default_complexity: ComplexityName = "simple"


class ApiKey(_Section, frozen=True, kw_only=True):
    """A client key, with its default priority, rate limits and allowed aliases.

    `routes` (SPEC §15 tier routes) maps an alias the client asks for to the alias this key
    is served as, e.g. a free tier's `{judge: judge-lite}`; applied once, before routing."""

    key: Secret
    name: str
    priority: PriorityName | None = None
    rpm: PositiveInt | None = None
    tpm: PositiveInt | None = None
    models: list[str] | None = None
    routes: dict[str, str] | None = None
    # SPEC §17: this key's latency objectives (after the request's headers, before the class's).
    slo_ttft_ms: PositiveMs | None = None
    slo_tpot_ms: PositiveMs | None = None


class Auth(_Section, frozen=True, kw_only=True):
    """Client authentication; absent from the config means no client auth."""

    keys: list[ApiKey]
    admin_key: Secret | None = None
    # SPEC §9/§18: with auth on, `/metrics` asks for this key (or the admin key) as a bearer
    # token; `public_metrics: true` is the explicit opt-out for a scraper on a private network.
    metrics_key: Secret | None = None
    public_metrics: bool = False


class Affinity(_Section, frozen=True, kw_only=True):
    """Prefix affinity (SPEC §15), for pools with `balancer: affinity`: the rendered prompt is
    cut into `block_bytes` blocks (at most `max_blocks`), chained hashes; a request goes to the
    instance holding the longest run of them (a session keeps one instance); an instance takes
    an affine request only while its load is at most `(1 + epsilon)` times the pool's average.
    The index remembers, per instance, about as many blocks as `cache_tokens` fill, within
    `index_mib` for all instances."""

    # Kept so that existing files load; the blocks replaced it (`max_blocks × block_bytes`).
    prefix_chars: Annotated[int, msgspec.Meta(ge=1, le=1_048_576)] = 2048
    epsilon: Annotated[float, msgspec.Meta(ge=0.01, le=100.0)] = 0.25
    # SPEC §15: "the rendered prompt is cut into blocks, each block's hash chained to the
    # previous one" — 64 bytes of UTF-8 are about one 16-token vLLM block.
    block_bytes: Annotated[int, msgspec.Meta(ge=16, le=4096)] = 64
    max_blocks: Annotated[int, msgspec.Meta(ge=1, le=4096)] = 512
    # "bounded by that instance's cache size": the KV-cache tokens of one instance.
    cache_tokens: Annotated[int, msgspec.Meta(ge=1, le=2**40)] = 131_072
    # Part of every block's hash: replicas and workers with the same seed agree.
    hash_seed: Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)] = 0
    index_mib: Annotated[int, msgspec.Meta(ge=1, le=65_536)] = 64


class Limits(_Section, frozen=True, kw_only=True):
    """Slow-client bounds (SPEC §7): header and body read deadlines, keep-alive idle time; and
    the buffer bounds of SPEC §16."""

    header_timeout_ms: PositiveMs = 10_000
    body_timeout_ms: PositiveMs = 30_000
    keepalive_timeout_ms: PositiveMs = 75_000
    # SPEC §16: request bytes held across queued and in-flight requests (503 `overloaded`).
    max_buffered_bytes: Annotated[int, msgspec.Meta(ge=1, le=2**63 - 1)] = 1 << 30
    # SPEC §16: one non-streamed upstream response (502 `upstream_error`).
    max_response_bytes: Annotated[int, msgspec.Meta(ge=1, le=2**63 - 1)] = 64 << 20
    # SPEC §16: one SSE event (the stream ends with an error event).
    max_event_bytes: Annotated[int, msgspec.Meta(ge=1, le=2**63 - 1)] = 1 << 20


class Shutdown(_Section, frozen=True, kw_only=True):
    """SIGTERM drain (SPEC §7): `/readyz` turns 503 while the listener keeps accepting and
    serving for `drain_delay_ms` (load balancers take seconds to stop sending), then new
    connections stop and in-flight and queued requests get `drain_timeout_ms` to finish."""

    drain_delay_ms: NonNegativeMs = 5_000
    drain_timeout_ms: NonNegativeMs = 25_000


class Telemetry(_Section, frozen=True, kw_only=True):
    """OpenTelemetry traces over OTLP/HTTP, exported by the gateway itself (off unless an
    endpoint is set here or in `OTEL_EXPORTER_OTLP_ENDPOINT`)."""

    otlp_endpoint: str | None = None
    service_name: str | None = None
    sample_ratio: Annotated[float, msgspec.Meta(ge=0.0, le=1.0)] = 1.0
    # A client's `traceparent` with the sampled flag decides only when this is true; by
    # default `sample_ratio` rules (a client cannot make the gateway export its traces).
    respect_client_sampling: bool = False
    # OpenMetrics exemplars (trace ids on histogram buckets) carry other tenants' trace ids to
    # whoever scrapes: off unless asked for.
    exemplars: bool = False


class Batch(_Section, frozen=True, kw_only=True):
    """The Batch API (SPEC §14): where files and batch progress live (SQLite in WAL mode, file
    bytes in the directory `<store>.files/` beside it; or a PostgreSQL URL shared by several
    replicas), and its bounds. `store` is read once, when the Batch API is first used (at
    start for PostgreSQL): changing it needs a restart."""

    store: str = "./gateway-batches.db"
    max_file_bytes: Annotated[int, msgspec.Meta(ge=1, le=2**63 - 1)] = 209_715_200
    max_lines: PositiveInt = 50_000
    # Lines of one batch queued or in flight at once (SPEC §14 "fed into the low queue
    # gradually").
    in_flight_per_batch: PositiveInt = 64
    # SPEC §14 "Quotas and expiry": bytes of files one key may keep (uploads and outputs;
    # 10 GiB), and how long output and error files are kept (seconds; 30 days) unless the
    # batch named its own `output_expires_after`.
    max_stored_bytes: Annotated[int, msgspec.Meta(ge=1, le=2**63 - 1)] = 10 * 2**30
    output_ttl: Annotated[int, msgspec.Meta(ge=3600, le=2**31 - 1)] = 30 * 86400


def default_replica_id() -> str:
    """SPEC §13 `replica_id` default: "host name + pid"."""
    return f"{socket.gethostname()}-{os.getpid()}"


class Cluster(_Section, frozen=True, kw_only=True):
    """SPEC §13 "Several hosts": replicas share leases, limits and ejection hints through
    Redis; absent = a single node, and nothing of `gateway.cluster` (or Redis) is imported.

    `redis_url` is a `Secret`: a URL may carry a password (`redis://:pw@host:6379/0`)."""

    redis_url: Secret
    replica_id: str = msgspec.field(default_factory=default_replica_id)
    # "a dead replica's share returns within this"
    lease_ms: PositiveMs = 2000
    renew_ms: PositiveMs = 200
    # "A replica that starts while Redis is unreachable serves on the static share (replica
    # count from `cluster.expected_replicas`, default 2)"
    expected_replicas: Annotated[int, msgspec.Meta(ge=1, le=1024)] = 2


class Config(_Section, frozen=True, kw_only=True):
    """The whole configuration. Build it with `load_config` / `parse_config` (they validate)."""

    listen: Listen = msgspec.field(default_factory=Listen)
    max_body_bytes: Annotated[int, msgspec.Meta(ge=1, le=2**63 - 1)] = 10_485_760
    default_priority: PriorityName = "high"
    scheduler: Scheduler = msgspec.field(default_factory=Scheduler)
    balancer: BalancerName = "least_connections"
    affinity: Affinity = msgspec.field(default_factory=Affinity)
    health: Health = msgspec.field(default_factory=Health)
    timeouts: Timeouts = msgspec.field(default_factory=Timeouts)
    retries: Retries = msgspec.field(default_factory=Retries)
    pools: dict[str, PoolSpec]
    models: dict[str, ModelAlias]
    routing: Routing = msgspec.field(default_factory=Routing)
    auth: Auth | None = None
    limits: Limits = msgspec.field(default_factory=Limits)
    shutdown: Shutdown = msgspec.field(default_factory=Shutdown)
    telemetry: Telemetry = msgspec.field(default_factory=Telemetry)
    batch: Batch = msgspec.field(default_factory=Batch)
    # SPEC §13: absent = off (one node, no Redis).
    cluster: Cluster | None = None
    seed: Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)] = 0

    def pool_balancer(self, pool: str) -> BalancerName:
        """The balancer `pool` uses: its own override, else the top-level one."""
        return self.pools[pool].balancer or self.balancer

    def uses_affinity(self) -> bool:
        """Whether any pool balances by affinity (requests then carry a key, SPEC §15)."""
        return any(self.pool_balancer(name) == "affinity" for name in self.pools)

    def instances(self) -> Iterator[tuple[str, InstanceSpec]]:
        """Every instance with its pool's name, in config order."""
        for pool_name, pool in self.pools.items():
            for inst in pool.instances:
                yield pool_name, inst


# ---------------------------------------------------------------------------------------------
# Reading the schema (for the loader's rewrites and the error translation).


def unwrap(tp: object) -> object:
    """Strips `Annotated[...]` and `| None`."""
    if typing.get_origin(tp) is Annotated:
        tp = typing.get_args(tp)[0]
    if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return unwrap(args[0])
    return tp


def is_optional(tp: object) -> bool:
    if typing.get_origin(tp) is Annotated:
        tp = typing.get_args(tp)[0]
    return type(None) in typing.get_args(tp)


def struct_fields(tp: object) -> dict[str, object]:
    """A struct type's fields and their types, in order; `{}` for any other type."""
    tp = unwrap(tp)
    if isinstance(tp, type) and issubclass(tp, msgspec.Struct):
        hints = typing.get_type_hints(tp, include_extras=True)
        return {name: hints[name] for name in tp.__struct_fields__}
    return {}


def literal_args(tp: object) -> tuple[object, ...]:
    tp = unwrap(tp)
    return typing.get_args(tp) if typing.get_origin(tp) is Literal else ()
