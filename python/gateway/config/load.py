"""From YAML text to a validated `Config`: read, expand `${VAR}`, rewrite, decode, validate.

1. YAML → plain data (duplicate keys are refused: a silently shadowed pool is a typo);
2. `${VAR}` / `${VAR:-default}` expansion of string values, never of keys, in one pass; then
   small rewrites: an empty section means its defaults, `realtime`/`batch` become
   `high`/`low`, a partial `scheduler.high`/`low` is completed with its class's values;
3. `msgspec.convert(..., strict=False)` into the schema (types, unknown fields, per-field
   ranges; `strict=False` lets `"${PORT:-8080}"` become an int), errors via `errors.py`;
4. cross-field checks (`validate.py`).
"""

from __future__ import annotations

import os
import re
from collections.abc import Hashable, Mapping
from pathlib import Path
from typing import Any

import msgspec
import yaml

from gateway.config.errors import join_path, translate
from gateway.config.schema import (
    CLASS_DEFAULTS,
    PRIORITY_ALIASES,
    Config,
    is_optional,
    struct_fields,
)
from gateway.config.validate import validate
from gateway.errors import ConfigError

__all__ = ["expand_env", "load_config", "parse_config"]


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
        raise translate(exc, expanded) from None
    return validate(decoded)


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
    """
    if isinstance(data, str):
        return _expand_str(data, env, path)
    if isinstance(data, dict):
        return {k: expand_env(v, env, join_path(path, k)) for k, v in data.items()}
    if isinstance(data, list):
        return [expand_env(v, env, f"{path}[{i}]") for i, v in enumerate(data)]
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


def _normalise_priorities(data: dict[Any, Any]) -> None:
    """Maps `realtime`/`batch` to `high`/`low` where a priority is expected, in place."""
    _normalise_priority(data, "default_priority", "default_priority")
    auth = data.get("auth")
    keys = auth.get("keys") if isinstance(auth, dict) else None
    if isinstance(keys, list):
        for i, entry in enumerate(keys):
            if isinstance(entry, dict):
                _normalise_priority(entry, "priority", f"auth.keys[{i}].priority")


def _normalise_priority(container: dict[Any, Any], key: str, path: str) -> None:
    value = container.get(key)
    if isinstance(value, str):
        if value not in PRIORITY_ALIASES:
            raise ConfigError(
                path, f"invalid priority {value!r}; expected one of: high, low, realtime, batch"
            )
        container[key] = PRIORITY_ALIASES[value]


def _fill_class_defaults(data: dict[Any, Any]) -> None:
    """Completes partial `scheduler.high` / `scheduler.low` sections with their class defaults."""
    sched = data.get("scheduler")
    if isinstance(sched, dict):
        for cls, defaults in CLASS_DEFAULTS.items():
            section = sched.get(cls)
            if isinstance(section, dict):
                sched[cls] = {**defaults, **section}
