"""`Secret`: the one way the config marks a credential, and `masked`, the one way it hides it.

A `Secret` field is a plain `str` at runtime (the forwarder sends it as is, auth compares it
with `hmac`); only its type says it is a secret. `masked(struct)` reads that type and lists a
struct's fields with every secret replaced by `***`: the structs' `repr()` is built from it.
"""

from __future__ import annotations

import functools
import types
import typing
from typing import Annotated, Final, TypeAlias

import msgspec

__all__ = ["MASK", "Secret", "masked", "secret_values"]

MASK: Final = "***"


class _SecretTag:
    """The `Annotated` metadata that makes a `str` a `Secret` (msgspec ignores it)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "SECRET"


_SECRET: Final = _SecretTag()

#: A credential: decoded and used as a `str`, shown by `masked` (hence `repr`) as `***`.
#: `Secret | None` and `dict[str, Secret]` (secret values, visible keys) are understood too.
Secret: TypeAlias = Annotated[str, _SECRET]


def masked(struct: msgspec.Struct) -> list[tuple[str, object]]:
    """`struct`'s fields in order as (name, value), each `Secret` replaced by `MASK`."""
    hints = _hints(type(struct))
    return [(name, _mask(getattr(struct, name), hints[name])) for name in struct.__struct_fields__]


def secret_values(value: object, tp: object = None) -> list[str]:
    """Every `Secret` held by `value` (a struct, walked through nested structs, dicts and
    lists): what the log redactor must never let through."""
    if value is None:
        return []
    if isinstance(value, msgspec.Struct):
        hints = _hints(type(value))
        out: list[str] = []
        for name in value.__struct_fields__:
            out += secret_values(getattr(value, name), hints[name])
        return out
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Annotated:
        if any(meta is _SECRET for meta in args[1:]) and isinstance(value, str):
            return [value]
        return secret_values(value, args[0])
    if origin is typing.Union or origin is types.UnionType:
        arms = [arm for arm in args if arm is not type(None)]
        return secret_values(value, arms[0]) if len(arms) == 1 else []
    if isinstance(value, dict):
        return [
            s for item in value.values() for s in secret_values(item, args[1] if args else None)
        ]
    if isinstance(value, list):
        return [s for item in value for s in secret_values(item, args[0] if args else None)]
    return []


@functools.cache
def _hints(cls: type[msgspec.Struct]) -> dict[str, object]:
    return typing.get_type_hints(cls, include_extras=True)


def _mask(value: object, tp: object) -> object:
    """`value` with what `tp` types as `Secret` masked; `None` stays `None` (an unset secret)."""
    if value is None:
        return None
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin is Annotated:
        return MASK if any(meta is _SECRET for meta in args[1:]) else _mask(value, args[0])
    if origin is typing.Union or origin is types.UnionType:
        arms = [arm for arm in args if arm is not type(None)]
        return _mask(value, arms[0]) if len(arms) == 1 else value
    if origin is dict and isinstance(value, dict):
        return {key: _mask(item, args[1]) for key, item in value.items()}
    if origin is list and isinstance(value, list):
        return [_mask(item, args[0]) for item in value]
    return value
