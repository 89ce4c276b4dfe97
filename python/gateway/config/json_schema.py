"""The config file's JSON Schema (SPEC §18: printed by the command line, for editors).

`gateway schema` prints it; a YAML language server given it (`# yaml-language-server:
$schema=gateway.schema.json` on a file's first line, or the editor's settings) completes field
names, shows defaults and flags typos and out-of-range values as one types.

It is `msgspec.json.schema(Config)` (the structs, their defaults and `Annotated` bounds),
loosened where the loader reads the file more loosely than the structs are typed, so that
every file `gateway check` accepts also passes the schema:

- `${VAR}` / `${VAR:-default}` may stand for any scalar: the loader expands references before
  decoding and turns `"8080"` into `8080`, so an editor checking the raw file would otherwise
  flag `port: ${PORT}`. Every number, boolean and enum also accepts a string holding a
  reference (string fields take one anyway). The checks of the value itself are then left to
  `gateway check`, which sees the environment;
- `realtime` / `batch` are accepted wherever a priority is (SPEC §4);
- an empty section (`health:` with all of it commented out) keeps its defaults, so `null` is
  allowed for every section;
- a partial `scheduler.high` / `low` keeps its class's defaults: no field of theirs is required;
- an instance's `max_concurrency` may be `{max: N, adaptive: true}` (SPEC §17; the loader
  splits it into `max_concurrency` and `adaptive_concurrency`).

Secrets (`Secret` fields: keys, header values, proxies, `cluster.redis_url`) are plain strings
marked `writeOnly`, with a description asking for a `${VAR}` reference.
"""

from __future__ import annotations

import types
import typing
from typing import Any, Final

import msgspec

from gateway.config.schema import (
    PRIORITY_ALIASES,
    ClassSettings,
    Config,
    InstanceSpec,
    struct_fields,
)
from gateway.config.secret import Secret

__all__ = ["ENV_REFERENCE", "SCHEMA_DIALECT", "json_schema"]

SCHEMA_DIALECT: Final = "https://json-schema.org/draft/2020-12/schema"

#: A string holding at least one `${NAME}` or `${NAME:-default}` (as `load.py` reads them).
ENV_REFERENCE: Final[dict[str, Any]] = {
    "type": "string",
    "pattern": r"\$\{[A-Za-z_][A-Za-z0-9_]*(:-[^}]*)?\}",
    "description": "an environment variable reference, expanded when the file is loaded",
}

_SECRET_NOTE: Final = "write it as a `${VAR}` reference rather than inline."
_SCALAR_TYPES: Final = frozenset({"integer", "number", "boolean"})
# What `Annotated` carries to make a `str` a `Secret`.
_SECRET_TAG: Final = typing.get_args(Secret)[1]


def json_schema() -> dict[str, Any]:
    """The JSON Schema of the config file, with `$schema` and a title."""
    generated = msgspec.json.schema(Config)
    defs: dict[str, Any] = generated["$defs"]
    for name, struct in _structs().items():
        _mark_secrets(defs[name], struct)
        _allow_null_sections(defs[name])
    # The loader completes a partial class from its own defaults (`CLASS_DEFAULTS`).
    defs[ClassSettings.__name__]["required"] = []
    _adaptive_form(defs[InstanceSpec.__name__]["properties"])
    defs = _loosen(defs)
    root = defs.pop(Config.__name__)
    return {
        "$schema": SCHEMA_DIALECT,
        "title": "gateway configuration",
        "description": "The gateway's YAML configuration (`gateway serve --config FILE`). "
        "Only `pools` and `models` are required. `gateway check FILE` validates a file "
        "completely (references between sections, URLs, environment variables).",
        **{k: v for k, v in root.items() if k not in ("title", "description")},
        "$defs": defs,
    }


def _structs() -> dict[str, type[msgspec.Struct]]:
    """Every struct reachable from `Config`, by name (as msgspec names them in `$defs`)."""
    found: dict[str, type[msgspec.Struct]] = {}

    def visit(tp: object) -> None:
        if isinstance(tp, type) and issubclass(tp, msgspec.Struct):
            if tp.__name__ in found:
                return
            found[tp.__name__] = tp
        for arg in typing.get_args(tp):
            visit(arg)
        for field_tp in struct_fields(tp).values():
            visit(field_tp)

    visit(Config)
    return found


def _mark_secrets(schema: dict[str, Any], struct: type[msgspec.Struct]) -> None:
    """`writeOnly` and a note on each property typed `Secret` (or `dict[str, Secret]`)."""
    for name, tp in struct_fields(struct).items():
        if _holds_secret(tp):
            prop = schema["properties"][name]
            prop["writeOnly"] = True
            whose = "Its values are secrets" if typing.get_origin(tp) is dict else "A secret"
            prop["description"] = f"{whose}: {_SECRET_NOTE}"


def _holds_secret(tp: object) -> bool:
    """Whether `tp` is `Secret`, `Secret | None` or `dict[str, Secret]`."""
    if typing.get_origin(tp) is typing.Annotated:
        return _SECRET_TAG in typing.get_args(tp)[1:]
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    if typing.get_origin(tp) is dict:
        return _holds_secret(args[1])
    union = typing.get_origin(tp) in (typing.Union, types.UnionType)
    return union and len(args) == 1 and _holds_secret(args[0])


def _allow_null_sections(schema: dict[str, Any]) -> None:
    """A property holding a (non-optional) section accepts `null`: an empty section."""
    for name, prop in schema.get("properties", {}).items():
        if set(prop) == {"$ref"}:
            schema["properties"][name] = {"anyOf": [prop, {"type": "null"}]}


def _loosen(node: Any) -> Any:
    """`node` with every scalar schema also accepting an environment reference, and every
    priority enum its aliases."""
    if isinstance(node, list):
        return [_loosen(item) for item in node]
    if not isinstance(node, dict):
        return node
    node = {key: _loosen(value) for key, value in node.items()}
    if "enum" in node and set(node["enum"]) == set(PRIORITY_ALIASES.values()):
        node["enum"] = list(PRIORITY_ALIASES)  # SPEC §4: realtime = high, batch = low
    if "enum" in node or node.get("type") in _SCALAR_TYPES:
        # Annotations stay outside the `anyOf`, where editors show them.
        outer = {k: node.pop(k) for k in ("default", "description", "title") if k in node}
        return {"anyOf": [node, ENV_REFERENCE], **outer}
    if "anyOf" in node:
        node["anyOf"] = _flatten(node["anyOf"])
    return node


def _flatten(options: list[Any]) -> list[Any]:
    """The options of an `anyOf`, with bare nested `anyOf`s spliced in, each once."""
    flat: list[Any] = []
    for option in options:
        for inner in option["anyOf"] if set(option) == {"anyOf"} else [option]:
            if inner not in flat:
                flat.append(inner)
    return flat


def _adaptive_form(props: dict[str, Any]) -> None:
    """SPEC §17: `max_concurrency: N` or `max_concurrency: {max: N, adaptive: true}`."""
    plain = props["max_concurrency"]
    props["max_concurrency"] = {
        "anyOf": [
            plain,
            {
                "type": "object",
                "properties": {"max": plain, "adaptive": {"type": "boolean", "default": False}},
                "required": ["max"],
                "additionalProperties": False,
            },
        ]
    }
