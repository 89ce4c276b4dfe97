"""The gateway's configuration (SPEC §8): typed, defaulted, environment-expanded, validated.

`load_config(path)` / `parse_config(text)` turn YAML into a frozen `Config` or raise
`ConfigError(path, reason)` naming the offending field, e.g. `pools.light.instances[0].url`.
`describe(config)` renders the resolved routing table for `gateway check FILE`.

Loading runs in four steps, each with its own error paths:

1. YAML → plain data (duplicate keys are refused: a silently shadowed pool is a typo);
2. `${VAR}` / `${VAR:-default}` expansion of string values, never of keys, in one pass;
   then small rewrites of the data: an empty section means its defaults, `realtime`/`batch`
   become `high`/`low`, a partial `scheduler.high`/`low` is completed with its class's values;
3. `msgspec.convert(..., strict=False)` into the structs below (types, unknown fields,
   per-field ranges; `strict=False` lets `"${PORT:-8080}"` become an int);
4. cross-field checks (`_validate`): names, URLs, references between pools, cycles.

Secrets (instance `api_key`, header values, client `key`, `admin_key`) never appear in an
error, a `repr` or `describe()`: the structs holding them mask them in `__repr__`.
"""

from __future__ import annotations

import difflib
import os
import re
import types
import typing
from collections.abc import Callable, Hashable, Iterator, Mapping
from pathlib import Path
from typing import Annotated, Any, Final, Literal, TypeAlias
from urllib.parse import urlsplit

import msgspec
import yaml

from gateway._core import MAX_INSTANCES, Priority
from gateway.errors import ConfigError

__all__ = [
    "DEFAULT_COMPLEX_KEYWORDS",
    "DEFAULT_SIMPLE_KEYWORDS",
    "PRIORITIES",
    "ApiKey",
    "Auth",
    "BalancerName",
    "ClassSettings",
    "Classifier",
    "ComplexityName",
    "ComplexityRouting",
    "Config",
    "Health",
    "InstanceSpec",
    "Limits",
    "Listen",
    "ModelAlias",
    "PolicyName",
    "PoolSpec",
    "PriorityName",
    "Probe",
    "ProviderName",
    "Retries",
    "Routing",
    "Scheduler",
    "Shutdown",
    "Timeouts",
    "describe",
    "expand_env",
    "load_config",
    "parse_config",
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
BalancerName: TypeAlias = Literal["least_connections", "round_robin", "random", "p2c"]
ProviderName: TypeAlias = Literal["openai", "vllm", "dashscope", "qianfan"]
ComplexityName: TypeAlias = Literal["simple", "complex"]

# SPEC §4: `realtime` and `batch` are accepted wherever a priority is.
_PRIORITY_ALIASES: Final[Mapping[str, PriorityName]] = {
    "high": "high",
    "low": "low",
    "realtime": "high",
    "batch": "low",
}

#: Every priority name the spec accepts, as the core's enum (the one map from names).
PRIORITIES: Final[Mapping[str, Priority]] = {
    name: Priority.HIGH if label == "high" else Priority.LOW
    for name, label in _PRIORITY_ALIASES.items()
}

_MASK: Final = "***"


# ---------------------------------------------------------------------------------------------
# The schema (SPEC §8). Every field has the default the SPEC shows. Every struct forbids
# unknown fields (a typo is an error, not a silently ignored setting) and is frozen.


class Listen(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """Where the gateway listens. Port 0 asks the OS for a free port (tests, demos)."""

    host: str = "127.0.0.1"
    port: Annotated[int, msgspec.Meta(ge=0, le=65535)] = 8080


class ClassSettings(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """One priority class's queue: bound, share of grants and deadline (SPEC §3)."""

    capacity: PositiveInt
    weight: NonNegativeInt
    max_wait_ms: PositiveMs


# SPEC §3 defaults per class; a partial `high:` / `low:` section keeps the rest of its own
# class's values (filled in before decoding, since the two classes share one struct).
_CLASS_DEFAULTS: Final[Mapping[str, Mapping[str, int]]] = {
    "high": {"capacity": 200, "weight": 7, "max_wait_ms": 30_000},
    "low": {"capacity": 1000, "weight": 3, "max_wait_ms": 600_000},
}


def _high_class() -> ClassSettings:
    return ClassSettings(**_CLASS_DEFAULTS["high"])


def _low_class() -> ClassSettings:
    return ClassSettings(**_CLASS_DEFAULTS["low"])


class Scheduler(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """Per-pool dual-queue scheduling (SPEC §3)."""

    policy: PolicyName = "weighted"
    high: ClassSettings = msgspec.field(default_factory=_high_class)
    low: ClassSettings = msgspec.field(default_factory=_low_class)
    max_consecutive_high: PositiveInt = 20
    max_low_wait_ms: PositiveMs = 5000
    overflow_high_to_low: bool = True


class Probe(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """Active health probing (SPEC §6)."""

    interval_ms: PositiveMs = 5000
    timeout_ms: PositiveMs = 2000
    path: str = "/v1/models"
    enabled: bool = True


class Health(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """Passive ejection, half-open trials and probes, per instance (SPEC §6)."""

    failure_threshold: PositiveInt = 3
    ejection_ms: PositiveMs = 10_000
    max_ejection_ms: PositiveMs = 300_000
    half_open_max_requests: PositiveInt = 1
    success_threshold: PositiveInt = 2
    probe: Probe = msgspec.field(default_factory=Probe)


class Timeouts(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """Upstream timeouts (SPEC §6)."""

    connect_ms: PositiveMs = 5000
    first_byte_ms: PositiveMs = 120_000
    stream_idle_ms: PositiveMs = 60_000
    total_ms: PositiveMs = 600_000


class Retries(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """Attempts per request within its pool, the first one included (SPEC §6)."""

    max_attempts: PositiveInt = 3


class TlsSpec(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """SPEC §6: how an `https` instance's certificate is verified. Verification cannot be
    turned off: `ca_file` replaces the system store, `server_name` the name checked (and sent
    as SNI)."""

    ca_file: str | None = None
    server_name: str | None = None


class InstanceSpec(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """One backend endpoint. `url` is its OpenAI base URL (no trailing slash once loaded).

    `proxy` is an egress proxy URL (`http://host:port`) used for this instance instead of
    `HTTPS_PROXY` / `HTTP_PROXY` from the environment (SPEC §6)."""

    name: str
    url: str
    model: str
    api_key: str | None = None
    max_concurrency: PositiveInt
    provider: ProviderName = "openai"
    headers: dict[str, str] = {}
    tls: TlsSpec | None = None
    proxy: str | None = None

    def _masked(self) -> Iterator[tuple[str, object]]:
        yield "name", self.name
        yield "url", self.url
        yield "model", self.model
        yield "api_key", None if self.api_key is None else _MASK
        yield "max_concurrency", self.max_concurrency
        yield "provider", self.provider
        # Header values are masked too: they are where extra credentials usually go.
        yield "headers", dict.fromkeys(self.headers, _MASK)
        yield "tls", self.tls
        # A proxy URL may carry credentials (user:password@host).
        yield "proxy", None if self.proxy is None else _MASK

    def __repr__(self) -> str:
        return _repr(self, self._masked())

    def __rich_repr__(self) -> list[tuple[str, Any]]:
        return list(self._masked())


class PoolSpec(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """A set of interchangeable instances; `balancer` overrides the top-level one."""

    instances: list[InstanceSpec]
    fallback: str | None = None
    balancer: BalancerName | None = None
    spill_to: str | None = None
    spill_queue_depth: NonNegativeInt = 0


class ModelAlias(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """A client-facing model name: a pool, or `route: auto` (complexity routing)."""

    pool: str | None = None
    route: Literal["auto"] | None = None


class ComplexityRouting(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
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


class Classifier(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """Rules of the `auto` complexity classifier (SPEC §4). Given lists replace the defaults."""

    complex_keywords: list[str] = msgspec.field(
        default_factory=lambda: list(DEFAULT_COMPLEX_KEYWORDS)
    )
    simple_keywords: list[str] = msgspec.field(
        default_factory=lambda: list(DEFAULT_SIMPLE_KEYWORDS)
    )
    long_prompt_chars: PositiveInt = 4000
    code_lines_complex: PositiveInt = 40


class Routing(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """Complexity routing for `auto` aliases."""

    complexity: ComplexityRouting = msgspec.field(default_factory=ComplexityRouting)
    classifier: Classifier = msgspec.field(default_factory=Classifier)
    default_complexity: ComplexityName = "simple"


class ApiKey(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """A client key, with its default priority, rate limits and allowed aliases."""

    key: str
    name: str
    priority: PriorityName | None = None
    rpm: PositiveInt | None = None
    tpm: PositiveInt | None = None
    models: list[str] | None = None

    def _masked(self) -> Iterator[tuple[str, object]]:
        yield "key", _MASK
        yield "name", self.name
        yield "priority", self.priority
        yield "rpm", self.rpm
        yield "tpm", self.tpm
        yield "models", self.models

    def __repr__(self) -> str:
        return _repr(self, self._masked())

    def __rich_repr__(self) -> list[tuple[str, Any]]:
        return list(self._masked())


class Auth(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """Client authentication; absent from the config means no client auth."""

    keys: list[ApiKey]
    admin_key: str | None = None

    def _masked(self) -> Iterator[tuple[str, object]]:
        yield "keys", self.keys
        yield "admin_key", None if self.admin_key is None else _MASK

    def __repr__(self) -> str:
        return _repr(self, self._masked())

    def __rich_repr__(self) -> list[tuple[str, Any]]:
        return list(self._masked())


class Limits(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
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


class Shutdown(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """SIGTERM drain deadline (SPEC §7)."""

    drain_timeout_ms: NonNegativeMs = 25_000


class Telemetry(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """OpenTelemetry traces (off unless an endpoint is set here or in
    `OTEL_EXPORTER_OTLP_ENDPOINT`; needs the `otel` extra)."""

    otlp_endpoint: str | None = None
    service_name: str | None = None
    sample_ratio: Annotated[float, msgspec.Meta(ge=0.0, le=1.0)] = 1.0


class Config(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """The whole configuration. Build it with `load_config` / `parse_config` (they validate)."""

    listen: Listen = msgspec.field(default_factory=Listen)
    max_body_bytes: Annotated[int, msgspec.Meta(ge=1, le=2**63 - 1)] = 10_485_760
    default_priority: PriorityName = "high"
    scheduler: Scheduler = msgspec.field(default_factory=Scheduler)
    balancer: BalancerName = "least_connections"
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
    seed: Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)] = 0

    def pool_balancer(self, pool: str) -> BalancerName:
        """The balancer `pool` uses: its own override, else the top-level one."""
        return self.pools[pool].balancer or self.balancer

    def instances(self) -> Iterator[tuple[str, InstanceSpec]]:
        """Every instance with its pool's name, in config order."""
        for pool_name, pool in self.pools.items():
            for inst in pool.instances:
                yield pool_name, inst


def _repr(obj: object, fields: Iterator[tuple[str, object]]) -> str:
    return f"{type(obj).__name__}({', '.join(f'{k}={v!r}' for k, v in fields)})"


# ---------------------------------------------------------------------------------------------
# Public entry points.


def load_config(path: str | os.PathLike[str], env: Mapping[str, str] | None = None) -> Config:
    """Read, expand, decode and validate the YAML file at `path`."""
    try:
        text = Path(path).read_text(encoding="utf-8-sig")
    except UnicodeDecodeError as exc:
        raise ConfigError("", f"cannot read {os.fspath(path)}: not UTF-8 ({exc.reason})") from None
    except OSError as exc:
        raise ConfigError("", f"cannot read {os.fspath(path)}: {exc.strerror or exc}") from None
    return parse_config(text, env, source=os.fspath(path))


def parse_config(
    text: str, env: Mapping[str, str] | None = None, source: str = "<string>"
) -> Config:
    """Parse YAML `text` (named `source` in syntax errors) into a validated `Config`."""
    data = _parse_yaml(text, source)
    if data is None:
        raise ConfigError("", f"{source} is empty; `pools` and `models` are required")
    if not isinstance(data, dict):
        raise ConfigError("", f"{source}: the top level must be a mapping of sections")
    return _build(data, os.environ if env is None else env)


def _build(data: dict[Any, Any], env: Mapping[str, str]) -> Config:
    expanded = expand_env(data, env)
    _drop_null_sections(expanded, Config)
    _normalise_priorities(expanded)
    _fill_class_defaults(expanded)
    try:
        decoded = msgspec.convert(expanded, Config, strict=False)
    except msgspec.ValidationError as exc:
        path, reason = _translate(str(exc), expanded)
        raise ConfigError(path, reason) from None
    return _validate(decoded)


# ---------------------------------------------------------------------------------------------
# Step 1: YAML.


class _Loader(yaml.SafeLoader):
    """SafeLoader that refuses duplicate keys (PyYAML keeps the last one silently)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Hashable, Any]:
        seen: set[object] = set()
        for key_node, _ in node.value:
            # `<<` merge keys may legitimately be overridden by explicit ones.
            if not isinstance(key_node, yaml.ScalarNode) or key_node.tag.endswith(":merge"):
                continue
            key = self.construct_object(key_node)
            if not isinstance(key, Hashable):
                continue
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    "while constructing a mapping",
                    node.start_mark,
                    f"found duplicate key {key!r}",
                    key_node.start_mark,
                )
            seen.add(key)
        return super().construct_mapping(node, deep)


def _parse_yaml(text: str, source: str) -> object:
    try:
        return yaml.load(text, Loader=_Loader)
    except yaml.MarkedYAMLError as exc:
        # Built from the parts, not str(exc): that quotes the offending line, which may hold a
        # secret written inline.
        mark = exc.problem_mark or exc.context_mark
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        what = "; ".join(p for p in (exc.context, exc.problem) if p) or "syntax error"
        raise ConfigError("", f"invalid YAML in {source}{where}: {what}") from None
    except yaml.YAMLError as exc:
        # Reader errors (bad characters) name a character code and offset, never content.
        detail = str(exc) if isinstance(exc, yaml.reader.ReaderError) else type(exc).__name__
        raise ConfigError("", f"invalid YAML in {source}: {detail}") from None


# ---------------------------------------------------------------------------------------------
# Step 2: environment expansion.

# `$${` is an escaped literal `${`; `${...}` a reference; a lone `${` is unterminated.
_REF = re.compile(r"\$\$\{|\$\{(?P<body>[^}]*)\}|\$\{")
_REF_BODY = re.compile(r"(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?::-(?P<default>.*))?", re.DOTALL)


def expand_env(data: object, env: Mapping[str, str], path: str = "") -> Any:
    """Returns `data` with `${VAR}` / `${VAR:-default}` expanded in every string value.

    Keys are left alone, and substituted text is never expanded again (one pass). `:-` uses
    the default when the variable is unset or empty, as the shell does. `$${` writes `${`.
    """
    if isinstance(data, str):
        return _expand_str(data, env, path)
    if isinstance(data, dict):
        return {k: expand_env(v, env, _join(path, k)) for k, v in data.items()}
    if isinstance(data, list):
        return [expand_env(v, env, f"{path}[{i}]") for i, v in enumerate(data)]
    return data


def _expand_str(value: str, env: Mapping[str, str], path: str) -> str:
    if "${" not in value:
        return value

    def sub(m: re.Match[str]) -> str:
        if m.group(0) == "$${":
            return "${"
        body = m.group("body")
        # The reason never quotes the value: it may be a secret with a stray `${` in it.
        if body is None:
            raise ConfigError(path, "unterminated `${` (write `$${` for a literal `${`)")
        ref = _REF_BODY.fullmatch(body)
        if ref is None or "${" in (ref.group("default") or ""):
            raise ConfigError(
                path, "invalid variable reference; expected `${NAME}` or `${NAME:-default}`"
            )
        name, default = ref.group("name"), ref.group("default")
        found = env.get(name)
        if default is not None:
            return found if found else default
        if found is None:
            raise ConfigError(
                path,
                f"environment variable {name} is not set "
                f"(write `${{{name}:-default}}` to give a default)",
            )
        return found

    return _REF.sub(sub, value)


def _normalise_priorities(data: dict[Any, Any]) -> None:
    """Maps `realtime`/`batch` to `high`/`low` where a priority is expected, in place."""

    def norm(container: dict[Any, Any], key: str, path: str) -> None:
        value = container.get(key)
        if isinstance(value, str):
            if value not in _PRIORITY_ALIASES:
                raise ConfigError(
                    path, f"invalid priority {value!r}; expected one of: high, low, realtime, batch"
                )
            container[key] = _PRIORITY_ALIASES[value]

    norm(data, "default_priority", "default_priority")
    auth = data.get("auth")
    keys = auth.get("keys") if isinstance(auth, dict) else None
    if isinstance(keys, list):
        for i, entry in enumerate(keys):
            if isinstance(entry, dict):
                norm(entry, "priority", f"auth.keys[{i}].priority")


def _drop_null_sections(data: dict[Any, Any], tp: object) -> None:
    """Treats an empty section (`health:` with everything under it commented out) as omitted,
    so it keeps its defaults instead of failing as `null`; in place."""
    fields = _struct_fields(tp)
    for key in list(data):
        field_tp = fields.get(key)
        if field_tp is None or not _struct_fields(field_tp):
            continue
        if data[key] is None and not _is_optional(field_tp):
            del data[key]
        elif isinstance(data[key], dict):
            _drop_null_sections(data[key], field_tp)


def _fill_class_defaults(data: dict[Any, Any]) -> None:
    """Completes partial `scheduler.high` / `scheduler.low` sections with their class defaults."""
    sched = data.get("scheduler")
    if isinstance(sched, dict):
        for cls, defaults in _CLASS_DEFAULTS.items():
            section = sched.get(cls)
            if isinstance(section, dict):
                sched[cls] = {**defaults, **section}


# ---------------------------------------------------------------------------------------------
# Step 3: msgspec errors → field paths.

_SEGMENT = re.compile(r"\.([^.\[]+)|\[(\d+|\.\.\.)\]")


def _translate(message: str, data: object) -> tuple[str, str]:
    """Turns a msgspec error into (`pools.light.instances[0].url`, reason).

    msgspec writes mapping keys as `[...]`; they are recovered from the data by finding the
    entry that fails to convert, which is the one msgspec stopped at (it converts in order).
    """
    reason, _, where = message.partition(" - at `")
    where = where.rstrip("`")
    key_error = where.startswith("key` in `")
    if key_error:
        where = where.removeprefix("key` in `")
    path, tp = _resolve(where.removeprefix("$"), data)
    if key_error:
        return path, f"keys must be strings ({reason[0].lower()}{reason[1:]})"
    if m := re.fullmatch(r"Object contains unknown field `(.+)`", reason):
        field = m.group(1)
        known = list(_struct_fields(tp))
        close = difflib.get_close_matches(field, known, n=1)
        hint = f"did you mean `{close[0]}`?" if close else f"expected one of: {', '.join(known)}"
        return _join(path, field), f"unknown field; {hint}"
    if m := re.fullmatch(r"Object missing required field `(.+)`", reason):
        return _join(path, m.group(1)), "required field is missing"
    if reason.startswith("Invalid enum value"):
        # Only literal-typed fields produce this; their values are never secrets.
        options = ", ".join(str(a) for a in _literal_args(tp))
        got = reason.removeprefix("Invalid enum value").strip()
        return path, f"invalid value {got}; expected one of: {options}"
    return path, reason


def _resolve(msgspec_path: str, data: object) -> tuple[str, object]:
    """Walks a msgspec path over the data and the schema; returns (dotted path, field type)."""
    path = ""
    tp: object = Config
    for m in _SEGMENT.finditer(msgspec_path):
        attr, index = m.group(1), m.group(2)
        inner = _unwrap(tp)
        if attr is not None:
            path = _join(path, attr)
            tp = _struct_fields(inner).get(attr)
            data = data.get(attr) if isinstance(data, dict) else None
        elif index == "...":
            value_tp = typing.get_args(inner)[1] if typing.get_origin(inner) is dict else object
            key = _failing_key(data, value_tp)
            path = _join(path, "?" if key is None else key)
            tp = value_tp
            data = data.get(key) if isinstance(data, dict) and key is not None else None
        else:
            i = int(index)
            path = f"{path}[{i}]"
            args = typing.get_args(inner)
            tp = args[0] if args else object
            data = data[i] if isinstance(data, list) and i < len(data) else None
    return path, tp


def _failing_key(data: object, value_tp: object) -> str | None:
    if not isinstance(data, dict):
        return None
    for key, value in data.items():
        try:
            msgspec.convert(value, value_tp, strict=False)
        except msgspec.ValidationError:
            return str(key)
    return None


def _unwrap(tp: object) -> object:
    """Strips `Annotated[...]` and `| None`."""
    if typing.get_origin(tp) is Annotated:
        tp = typing.get_args(tp)[0]
    if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return _unwrap(args[0])
    return tp


def _is_optional(tp: object) -> bool:
    if typing.get_origin(tp) is Annotated:
        tp = typing.get_args(tp)[0]
    return type(None) in typing.get_args(tp)


def _struct_fields(tp: object) -> dict[str, object]:
    tp = _unwrap(tp)
    if isinstance(tp, type) and issubclass(tp, msgspec.Struct):
        hints = typing.get_type_hints(tp, include_extras=True)
        return {name: hints[name] for name in tp.__struct_fields__}
    return {}


def _literal_args(tp: object) -> tuple[object, ...]:
    tp = _unwrap(tp)
    return typing.get_args(tp) if typing.get_origin(tp) is Literal else ()


def _join(path: str, key: object) -> str:
    return f"{path}.{key}" if path else str(key)


# ---------------------------------------------------------------------------------------------
# Step 4: cross-field validation.

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


def _validate(cfg: Config) -> Config:
    """Checks what types alone cannot; returns the config with URLs normalised."""
    _check_sections(cfg)
    pools = _check_pools(cfg)
    cfg = msgspec.structs.replace(cfg, pools=pools)
    _check_models(cfg)
    _check_routing(cfg)
    if cfg.auth is not None:
        _check_auth(cfg.auth, cfg)
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


def _check_pools(cfg: Config) -> dict[str, PoolSpec]:
    if not cfg.pools:
        raise ConfigError("pools", "at least one pool is required")
    seen_instances: dict[str, str] = {}
    pools: dict[str, PoolSpec] = {}
    for pool_name, pool in cfg.pools.items():
        ppath = f"pools.{pool_name}"
        _check_name(ppath, pool_name, "pool name")
        if not pool.instances:
            raise ConfigError(f"{ppath}.instances", "a pool needs at least one instance")
        if len(pool.instances) > MAX_INSTANCES:
            raise ConfigError(
                f"{ppath}.instances",
                f"a pool holds at most {MAX_INSTANCES} instances (has {len(pool.instances)})",
            )
        instances: list[InstanceSpec] = []
        for i, inst in enumerate(pool.instances):
            ipath = f"{ppath}.instances[{i}]"
            _check_name(f"{ipath}.name", inst.name, "instance name")
            if inst.name in seen_instances:
                raise ConfigError(
                    f"{ipath}.name",
                    f"duplicate instance name {inst.name!r} (also {seen_instances[inst.name]})",
                )
            seen_instances[inst.name] = f"{ipath}.name"
            instances.append(_check_instance(ipath, inst))
        for ref in ("fallback", "spill_to"):
            target = getattr(pool, ref)
            if target is None:
                continue
            if target == pool_name:
                raise ConfigError(f"{ppath}.{ref}", "must name another pool, not the pool itself")
            if target not in cfg.pools:
                raise ConfigError(f"{ppath}.{ref}", _unknown("pool", target, cfg.pools))
        if pool.spill_queue_depth > 0 and pool.spill_to is None:
            raise ConfigError(f"{ppath}.spill_queue_depth", "is set but `spill_to` is not")
        pools[pool_name] = msgspec.structs.replace(pool, instances=instances)
    _check_fallback_cycles(cfg.pools)
    return pools


def _check_instance(path: str, inst: InstanceSpec) -> InstanceSpec:
    url = _check_url(f"{path}.url", inst.url)
    if not inst.model.strip():
        raise ConfigError(f"{path}.model", "must not be empty")
    if inst.api_key is not None and (not inst.api_key or _has_bad_chars(inst.api_key)):
        # Never quote the key; say only what is wrong with it.
        raise ConfigError(
            f"{path}.api_key",
            "must be a non-empty string without control characters (omit it for no key)",
        )
    for header, value in inst.headers.items():
        hpath = f"{path}.headers.{header}"
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
    if inst.api_key is not None and not inst.api_key.isascii():
        raise ConfigError(f"{path}.api_key", "must be ASCII")
    if inst.tls is not None:
        if not url.lower().startswith("https:"):
            raise ConfigError(f"{path}.tls", "is only for https:// instances")
        ca = inst.tls.ca_file
        if ca is not None and not os.access(ca, os.R_OK):
            raise ConfigError(f"{path}.tls.ca_file", "is not a readable file")
        name = inst.tls.server_name
        if name is not None and (not name or not name.isascii() or _has_bad_chars(name)):
            raise ConfigError(f"{path}.tls.server_name", "must be a non-empty ASCII host name")
    if inst.proxy is not None:
        _check_proxy(f"{path}.proxy", inst.proxy)
    return msgspec.structs.replace(inst, url=url) if url != inst.url else inst


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
    if auth.admin_key is not None:
        if not auth.admin_key or _has_bad_chars(auth.admin_key):
            raise ConfigError(
                "auth.admin_key", "must be non-empty, without control characters (or omitted)"
            )
        if auth.admin_key in keys:
            raise ConfigError(
                "auth.admin_key",
                f"must differ from every client key (equals auth.keys[{keys[auth.admin_key]}])",
            )


def _check_name(path: str, name: str, what: str) -> None:
    if not _NAME.fullmatch(name):
        raise ConfigError(path, f"{what} {name!r} must be non-empty and use only A-Z a-z 0-9 . _ -")


def _has_bad_chars(text: str) -> bool:
    return any(ord(c) < 0x20 or ord(c) == 0x7F for c in text)


def _unknown(what: str, name: str, known: Mapping[str, object]) -> str:
    close = difflib.get_close_matches(name, list(known), n=1)
    hint = f"; did you mean {close[0]!r}?" if close else f"; known: {', '.join(known) or 'none'}"
    return f"unknown {what} {name!r}{hint}"


# ---------------------------------------------------------------------------------------------
# `gateway check`.


def describe(config: Config) -> str:
    """The resolved routing table and policy summary, as `gateway check` prints it.

    Secrets are shown only as `set` / `unset`; header values are never shown.
    """
    c = config
    out: list[str] = []
    add: Callable[[str], None] = out.append
    onoff = {True: "on", False: "off"}

    add(f"listen      {c.listen.host}:{c.listen.port}")
    add(f"requests    max_body_bytes={c.max_body_bytes} default_priority={c.default_priority}")
    s = c.scheduler
    add(
        f"scheduler   {s.policy}  "
        f"high(capacity={s.high.capacity} weight={s.high.weight} "
        f"max_wait_ms={s.high.max_wait_ms})  "
        f"low(capacity={s.low.capacity} weight={s.low.weight} max_wait_ms={s.low.max_wait_ms})"
    )
    add(
        f"            max_consecutive_high={s.max_consecutive_high} "
        f"max_low_wait_ms={s.max_low_wait_ms} overflow_high_to_low={onoff[s.overflow_high_to_low]}"
    )
    add(f"balancer    {c.balancer}")
    h = c.health
    add(
        f"health      failure_threshold={h.failure_threshold} "
        f"ejection_ms={h.ejection_ms}..{h.max_ejection_ms} "
        f"half_open_max_requests={h.half_open_max_requests} "
        f"success_threshold={h.success_threshold}"
    )
    p = h.probe
    probe = (
        f"GET {p.path} every {p.interval_ms} ms (timeout {p.timeout_ms} ms)" if p.enabled else "off"
    )
    add(f"probe       {probe}")
    t = c.timeouts
    add(
        f"timeouts    connect_ms={t.connect_ms} first_byte_ms={t.first_byte_ms} "
        f"stream_idle_ms={t.stream_idle_ms} total_ms={t.total_ms}"
    )
    add(f"retries     max_attempts={c.retries.max_attempts}")
    lim = c.limits
    add(
        f"clients     header_timeout_ms={lim.header_timeout_ms} "
        f"body_timeout_ms={lim.body_timeout_ms} keepalive_timeout_ms={lim.keepalive_timeout_ms} "
        f"drain_timeout_ms={c.shutdown.drain_timeout_ms}"
    )
    if c.auth is None:
        add("auth        off (no client keys)")
    else:
        admin = "set" if c.auth.admin_key is not None else "unset"
        add(f"auth        {len(c.auth.keys)} client key(s), admin_key: {admin}")
        for k in c.auth.keys:
            extra = [f"priority={k.priority or c.default_priority}"]
            extra += [f"rpm={k.rpm}"] if k.rpm is not None else []
            extra += [f"tpm={k.tpm}"] if k.tpm is not None else []
            extra += [f"models={','.join(k.models)}"] if k.models is not None else []
            add(f"              {k.name}: key: set  {' '.join(extra)}")

    add("")
    add("models")
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
        add(f"  {alias.ljust(width)}  → {target}")

    add("")
    add("pools")
    for name, pool in c.pools.items():
        slots = sum(i.max_concurrency for i in pool.instances)
        bits = [
            f"balancer={c.pool_balancer(name)}",
            f"fallback={pool.fallback or '-'}",
            f"{len(pool.instances)} instance(s), {slots} slots",
        ]
        if pool.spill_to is not None:
            bits.append(f"spill_to={pool.spill_to} at depth {pool.spill_queue_depth}")
        add(f"  {name}  ({', '.join(bits)})")
        name_w = max((len(i.name) for i in pool.instances), default=0)
        url_w = max((len(i.url) for i in pool.instances), default=0)
        for inst in pool.instances:
            line = (
                f"    {inst.name.ljust(name_w)}  {inst.url.ljust(url_w)}  model={inst.model}  "
                f"max_concurrency={inst.max_concurrency}  provider={inst.provider}  "
                f"api_key: {'set' if inst.api_key is not None else 'unset'}"
            )
            if inst.headers:
                line += f"  headers: {', '.join(inst.headers)}"
            add(line)
    cl = c.routing.classifier
    add("")
    add(
        f"classifier  long_prompt_chars={cl.long_prompt_chars} "
        f"code_lines_complex={cl.code_lines_complex} "
        f"complex_keywords={len(cl.complex_keywords)} simple_keywords={len(cl.simple_keywords)}"
    )
    return "\n".join(out) + "\n"


def _chain(cfg: Config, pool: str | None) -> str:
    """` (fallback → b → c)` for a pool with a fallback chain, else empty."""
    chain: list[str] = []
    current = cfg.pools[pool].fallback if pool in cfg.pools else None
    while current is not None and current not in chain:
        chain.append(current)
        current = cfg.pools[current].fallback if current in cfg.pools else None
    return f" (fallback → {' → '.join(chain)})" if chain else ""
