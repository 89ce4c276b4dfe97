"""msgspec's validation messages → `ConfigError(path, reason)`, every one of them.

msgspec stops at the first problem and reports it in English, e.g. "Expected `int`, got `str` -
at `$.pools[...].instances[0].port`", writing mapping keys as `[...]`. `collect` finds them all
(SPEC §18: one run reports every error): it converts the whole, and only where that fails,
each part on its own — a struct field by field, a mapping entry by entry, a list item by item —
so a mistake in one instance does not hide another's. This module is the only place that reads
msgspec's English: keys are recovered from the data, unknown fields get a "did you mean",
literal fields list their options.
"""

from __future__ import annotations

import difflib
import re
import typing
from typing import Final

import msgspec

from gateway.config.schema import Config, literal_args, struct_fields, unwrap
from gateway.errors import ConfigError

__all__ = ["UNUSABLE", "collect", "join_path", "translate"]

_SEGMENT = re.compile(r"\.([^.\[]+)|\[(\d+|\.\.\.)\]")
_UNKNOWN_FIELD = re.compile(r"Object contains unknown field `(.+)`")
_MISSING_FIELD = re.compile(r"Object missing required field `(.+)`")


class _Unusable:
    """Stands in the data for a value already reported as wrong before decoding (an unset
    `${VAR}`, an unknown priority): `collect` says nothing more about it."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "UNUSABLE"


UNUSABLE: Final = _Unusable()


def collect(data: object, tp: object = Config, path: str = "") -> list[ConfigError]:
    """Every complaint about converting `data` (at `path`) into `tp`; `[]` if it converts.

    The whole is converted first (one call when all is well); only a part that fails is
    taken apart, down to the fields that fail."""
    try:
        msgspec.convert(data, tp, strict=False)
    except msgspec.ValidationError as exc:
        first = exc
    else:
        return []
    if data is UNUSABLE:
        return []
    inner = unwrap(tp)
    errors: list[ConfigError] = []
    fields = struct_fields(inner)
    if fields and isinstance(data, dict):
        for key, value in data.items():
            if key in fields:
                errors += collect(value, fields[key], join_path(path, key))
            else:
                errors.append(ConfigError(join_path(path, key), _unknown_field(str(key), inner)))
        errors += [
            ConfigError(join_path(path, name), "required field is missing")
            for name in _required(inner)
            if name not in data
        ]
    elif typing.get_origin(inner) is dict and isinstance(data, dict):
        key_tp, value_tp = typing.get_args(inner)
        for key, value in data.items():
            try:
                msgspec.convert(key, key_tp, strict=False)
            except msgspec.ValidationError as exc:
                errors.append(ConfigError(path, _key_reason(str(exc))))
                continue
            errors += collect(value, value_tp, join_path(path, key))
    elif typing.get_origin(inner) is list and isinstance(data, list):
        (item_tp,) = typing.get_args(inner)
        for i, item in enumerate(data):
            errors += collect(item, item_tp, f"{path}[{i}]")
    if errors or _holds_unusable(data):
        return errors
    # A leaf, or a complaint the parts do not show (none is known): msgspec's own words.
    return [translate(first, data, tp, path)]


def translate(
    exc: msgspec.ValidationError, data: object, tp: object = Config, path: str = ""
) -> ConfigError:
    """The `ConfigError` for msgspec's complaint about converting `data` (at `path`) into `tp`."""
    return ConfigError(*_translate(str(exc), data, tp, path))


def join_path(path: str, key: object) -> str:
    """`path.key`, or `key` at the top level."""
    return f"{path}.{key}" if path else str(key)


def _translate(message: str, data: object, root: object, prefix: str) -> tuple[str, str]:
    """Turns a msgspec error into (`pools.light.instances[0].url`, reason).

    msgspec writes mapping keys as `[...]`; they are recovered from the data by finding the
    entry that fails to convert, which is the one msgspec stopped at (it converts in order).
    """
    reason, _, where = message.partition(" - at `")
    where = where.rstrip("`")
    key_error = where.startswith("key` in `")
    if key_error:
        where = where.removeprefix("key` in `")
    path, tp = _resolve(where.removeprefix("$"), data, root, prefix)
    if key_error:
        return path, _key_reason(reason)
    if m := _UNKNOWN_FIELD.fullmatch(reason):
        return join_path(path, m.group(1)), _unknown_field(m.group(1), tp)
    if m := _MISSING_FIELD.fullmatch(reason):
        return join_path(path, m.group(1)), "required field is missing"
    if reason.startswith("Invalid enum value"):
        # Only literal-typed fields produce this; their values are never secrets.
        options = ", ".join(str(a) for a in literal_args(tp))
        got = reason.removeprefix("Invalid enum value").strip()
        return path, f"invalid value {got}; expected one of: {options}"
    return path, reason


def _unknown_field(field: str, tp: object) -> str:
    known = list(struct_fields(tp))
    close = difflib.get_close_matches(field, known, n=1)
    hint = f"did you mean `{close[0]}`?" if close else f"expected one of: {', '.join(known)}"
    return f"unknown field; {hint}"


def _key_reason(reason: str) -> str:
    reason = reason.partition(" - at `")[0]
    return f"keys must be strings ({reason[0].lower()}{reason[1:]})"


def _required(tp: object) -> list[str]:
    """The fields of struct type `tp` without a default."""
    if not (isinstance(tp, type) and issubclass(tp, msgspec.Struct)):
        return []
    return [
        f.name
        for f in msgspec.structs.fields(tp)
        if f.default is msgspec.NODEFAULT and f.default_factory is msgspec.NODEFAULT
    ]


def _holds_unusable(data: object) -> bool:
    if data is UNUSABLE:
        return True
    if isinstance(data, dict):
        return any(_holds_unusable(v) for v in data.values())
    if isinstance(data, list):
        return any(_holds_unusable(v) for v in data)
    return False


def _resolve(msgspec_path: str, data: object, root: object, prefix: str) -> tuple[str, object]:
    """Walks a msgspec path over the data and the schema from `root` at `prefix`; returns
    (dotted path, field type)."""
    path = prefix
    tp: object = root
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
