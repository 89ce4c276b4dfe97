"""msgspec's validation messages → `ConfigError(path, reason)`.

msgspec reports in English, e.g. "Expected `int`, got `str` - at `$.pools[...].instances[0].port`",
writing mapping keys as `[...]`. This module is the only place that reads that English: keys are
recovered from the data, unknown fields get a "did you mean", literal fields list their options.
"""

from __future__ import annotations

import difflib
import re
import typing

import msgspec

from gateway.config.schema import Config, literal_args, struct_fields, unwrap
from gateway.errors import ConfigError

__all__ = ["join_path", "translate"]

_SEGMENT = re.compile(r"\.([^.\[]+)|\[(\d+|\.\.\.)\]")
_UNKNOWN_FIELD = re.compile(r"Object contains unknown field `(.+)`")
_MISSING_FIELD = re.compile(r"Object missing required field `(.+)`")


def translate(exc: msgspec.ValidationError, data: object) -> ConfigError:
    """The `ConfigError` for msgspec's complaint about converting `data` into a `Config`."""
    return ConfigError(*_translate(str(exc), data))


def join_path(path: str, key: object) -> str:
    """`path.key`, or `key` at the top level."""
    return f"{path}.{key}" if path else str(key)


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
    if m := _UNKNOWN_FIELD.fullmatch(reason):
        field = m.group(1)
        known = list(struct_fields(tp))
        close = difflib.get_close_matches(field, known, n=1)
        hint = f"did you mean `{close[0]}`?" if close else f"expected one of: {', '.join(known)}"
        return join_path(path, field), f"unknown field; {hint}"
    if m := _MISSING_FIELD.fullmatch(reason):
        return join_path(path, m.group(1)), "required field is missing"
    if reason.startswith("Invalid enum value"):
        # Only literal-typed fields produce this; their values are never secrets.
        options = ", ".join(str(a) for a in literal_args(tp))
        got = reason.removeprefix("Invalid enum value").strip()
        return path, f"invalid value {got}; expected one of: {options}"
    return path, reason


def _resolve(msgspec_path: str, data: object) -> tuple[str, object]:
    """Walks a msgspec path over the data and the schema; returns (dotted path, field type)."""
    path = ""
    tp: object = Config
    for m in _SEGMENT.finditer(msgspec_path):
        attr, index = m.group(1), m.group(2)
        inner = unwrap(tp)
        if attr is not None:
            path = join_path(path, attr)
            tp = struct_fields(inner).get(attr)
            data = data.get(attr) if isinstance(data, dict) else None
        elif index == "...":
            value_tp = typing.get_args(inner)[1] if typing.get_origin(inner) is dict else object
            key = _failing_key(data, value_tp)
            path = join_path(path, "?" if key is None else key)
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
