"""From YAML text to a validated `Config`: read, expand `${VAR}`, rewrite, decode, validate.

1. YAML → plain data (duplicate keys are refused: a silently shadowed pool is a typo);
2. `${VAR}` / `${VAR:-default}` expansion of string values, never of keys, in one pass; then
   small rewrites: an empty section means its defaults, `realtime`/`batch` become
   `high`/`low`, a partial `scheduler.high`/`low` is completed with its class's values;
3. `msgspec.convert(..., strict=False)` into the schema (types, unknown fields, per-field
   ranges; `strict=False` lets `"${PORT:-8080}"` become an int), errors via `errors.py`;
4. cross-field checks (`validate.py`).

SPEC §8/§18: every error of a file is reported in one run. Steps 2-4 go on past a mistake: a
value that cannot be expanded or rewritten is left out of decoding (it is reported already),
decoding reports every field that fails, and the cross-field checks run on whatever decoded.
A YAML error or an unreadable file stops at step 1: there is nothing to go on with. The
`ConfigError` raised lists them all (`errors`).
"""

from __future__ import annotations

import os
import re
from collections.abc import Hashable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import msgspec
import yaml

from gateway.config.errors import UNUSABLE, collect, join_path, translate
from gateway.config.schema import (
    CLASS_DEFAULTS,
    PRIORITY_ALIASES,
    ApiKey,
    Config,
    InstanceSpec,
    ModelAlias,
    PoolSpec,
    is_optional,
    struct_fields,
)
from gateway.config.validate import Parts, findings, validate
from gateway.errors import ConfigError

__all__ = ["expand_env", "load_config", "parse_config"]

T = TypeVar("T")


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
    errors: list[ConfigError] = []
    expanded = _expand(data, env, "", errors)
    _drop_null_sections(expanded, Config)
    _normalise_priorities(expanded, errors)
    _fill_class_defaults(expanded)
    _split_concurrency(expanded, errors)
    errors += collect(expanded, Config)
    if not errors:
        try:
            decoded = msgspec.convert(expanded, Config, strict=False)
        except msgspec.ValidationError as exc:  # `collect` said it converts: never expected
            raise translate(exc, expanded) from None
        return validate(decoded)
    # SPEC §18: the cross-field rules still run on what decoded, and report too.
    raise ConfigError.combine([*errors, *findings(_parts(expanded))])


def _parts(data: dict[Any, Any]) -> Parts:
    """`data` decoded section by section, and pool by pool, instance by instance, alias by
    alias and key by key where a section does not decode whole."""
    sections: dict[str, Any] = {}
    failed: set[str] = set()
    for name, tp in struct_fields(Config).items():
        if name not in data or name in ("pools", "models"):
            continue
        try:
            sections[name] = msgspec.convert(data[name], tp, strict=False)
        except msgspec.ValidationError:
            failed.add(name)
    raw_pools = data.get("pools")
    pools = _each_entry(raw_pools, PoolSpec)
    instances: dict[str, list[InstanceSpec | None]] = {}
    if pools is not None and isinstance(raw_pools, dict):
        for name, pool in raw_pools.items():
            if isinstance(pool, dict) and isinstance(pool.get("instances"), list):
                instances[name] = _each_item(pool["instances"], InstanceSpec)
    auth = data.get("auth")
    raw_keys = auth.get("keys") if isinstance(auth, dict) else None
    return Parts(
        config=Config(**sections, pools={}, models={}),
        failed=frozenset(failed),
        pools=pools,
        instances=instances,
        models=_each_entry(data.get("models"), ModelAlias),
        keys=_each_item(raw_keys, ApiKey) if isinstance(raw_keys, list) else None,
    )


def _each_entry(data: object, tp: type[T]) -> dict[str, T | None] | None:
    """Each value of the mapping `data` as a `tp`, `None` where it does not convert; `None`
    when `data` is not a mapping with string keys (its names are unknown)."""
    if not isinstance(data, dict) or not all(isinstance(k, str) for k in data):
        return None
    return {key: _convert(value, tp) for key, value in data.items()}


def _each_item(data: list[Any], tp: type[T]) -> list[T | None]:
    return [_convert(item, tp) for item in data]


def _convert(data: object, tp: type[T]) -> T | None:
    try:
        return msgspec.convert(data, tp, strict=False)
    except msgspec.ValidationError:
        return None


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
# Step 2: environment expansion, then the rewrites.

# `$${` is an escaped literal `${`; `${...}` a reference; a lone `${` is unterminated.
_REF = re.compile(r"\$\$\{|\$\{(?P<body>[^}]*)\}|\$\{")
_REF_BODY = re.compile(r"(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?::-(?P<default>.*))?", re.DOTALL)


def expand_env(data: object, env: Mapping[str, str], path: str = "") -> Any:
    """Returns `data` with `${VAR}` / `${VAR:-default}` expanded in every string value.

    Keys are left alone, and substituted text is never expanded again (one pass). `:-` uses
    the default when the variable is unset or empty, as the shell does. `$${` writes `${`.
    Raises one `ConfigError` for every value that cannot be expanded.
    """
    errors: list[ConfigError] = []
    expanded = _expand(data, env, path, errors)
    if errors:
        raise ConfigError.combine(errors)
    return expanded


def _expand(data: object, env: Mapping[str, str], path: str, errors: list[ConfigError]) -> Any:
    """`expand_env`, appending to `errors` instead of raising; a value that cannot be expanded
    becomes `UNUSABLE`."""
    if isinstance(data, str):
        try:
            return _expand_str(data, env, path)
        except ConfigError as exc:
            errors.append(exc)
            return UNUSABLE
    if isinstance(data, dict):
        return {k: _expand(v, env, join_path(path, k), errors) for k, v in data.items()}
    if isinstance(data, list):
        return [_expand(v, env, f"{path}[{i}]", errors) for i, v in enumerate(data)]
    return data


def _expand_str(value: str, env: Mapping[str, str], path: str) -> str:
    if "${" not in value:
        return value
    return _REF.sub(lambda m: _substitute(m, env, path), value)


def _substitute(m: re.Match[str], env: Mapping[str, str], path: str) -> str:
    """The text replacing one `_REF` match of the string at `path`."""
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


def _drop_null_sections(data: dict[Any, Any], tp: object) -> None:
    """Treats an empty section (`health:` with everything under it commented out) as omitted,
    so it keeps its defaults instead of failing as `null`; in place."""
    fields = struct_fields(tp)
    for key in list(data):
        field_tp = fields.get(key)
        if field_tp is None or not struct_fields(field_tp):
            continue
        if data[key] is None and not is_optional(field_tp):
            del data[key]
        elif isinstance(data[key], dict):
            _drop_null_sections(data[key], field_tp)


def _normalise_priorities(data: dict[Any, Any], errors: list[ConfigError]) -> None:
    """Maps `realtime`/`batch` to `high`/`low` where a priority is expected, in place; an
    unknown priority is appended to `errors` and becomes `UNUSABLE`."""
    _normalise_priority(data, "default_priority", "default_priority", errors)
    auth = data.get("auth")
    keys = auth.get("keys") if isinstance(auth, dict) else None
    if isinstance(keys, list):
        for i, entry in enumerate(keys):
            if isinstance(entry, dict):
                _normalise_priority(entry, "priority", f"auth.keys[{i}].priority", errors)


def _normalise_priority(
    container: dict[Any, Any], key: str, path: str, errors: list[ConfigError]
) -> None:
    value = container.get(key)
    if isinstance(value, str):
        if value in PRIORITY_ALIASES:
            container[key] = PRIORITY_ALIASES[value]
        else:
            errors.append(
                ConfigError(
                    path,
                    f"invalid priority {value!r}; expected one of: high, low, realtime, batch",
                )
            )
            container[key] = UNUSABLE


def _fill_class_defaults(data: dict[Any, Any]) -> None:
    """Completes partial `scheduler.high` / `scheduler.low` sections with their class defaults."""
    sched = data.get("scheduler")
    if isinstance(sched, dict):
        for cls, defaults in CLASS_DEFAULTS.items():
            section = sched.get(cls)
            if isinstance(section, dict):
                sched[cls] = {**defaults, **section}


def _split_concurrency(data: dict[Any, Any], errors: list[ConfigError]) -> None:
    """SPEC §17: an instance's `max_concurrency: {max: N, adaptive: true}` becomes
    `max_concurrency: N` (the hard ceiling) and `adaptive_concurrency: true`, in place; a plain
    integer stays as it is. An unknown or missing key is appended to `errors`."""
    pools = data.get("pools")
    if not isinstance(pools, dict):
        return
    for name, pool in pools.items():
        instances = pool.get("instances") if isinstance(pool, dict) else None
        if not isinstance(instances, list):
            continue
        for i, inst in enumerate(instances):
            value = inst.get("max_concurrency") if isinstance(inst, dict) else None
            if not isinstance(value, dict):
                continue
            path = f"pools.{name}.instances[{i}].max_concurrency"
            unknown = [k for k in value if k not in ("max", "adaptive")]
            for key in unknown:
                errors.append(ConfigError(f"{path}.{key}", "unknown field; expected max, adaptive"))
            if "max" not in value:
                errors.append(ConfigError(f"{path}.max", "required: the hard ceiling"))
                inst["max_concurrency"] = UNUSABLE
                continue
            inst["max_concurrency"] = value["max"]
            if "adaptive" in value:
                if "adaptive_concurrency" in inst:
                    errors.append(
                        ConfigError(
                            f"pools.{name}.instances[{i}].adaptive_concurrency",
                            "given twice (also as max_concurrency.adaptive)",
                        )
                    )
                inst["adaptive_concurrency"] = value["adaptive"]
