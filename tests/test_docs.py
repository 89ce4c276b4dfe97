"""The documentation in the repository (README.md, docs/) cannot drift from the code.

1. `docs/configuration.md` documents every field of the config schema by its dotted path, and
   no field the schema lacks; each scalar field's documented default is the schema's.
2. Every YAML example in README.md and docs/*.md passes the real `gateway check`.
3. No document points outside the repository, and every link in them resolves to a file here.

The conventions the documents follow (tests 1 and 2 read them):

- **A documented field** is a row of a table whose header's first column is `field`, its first
  cell one code span holding the field's dotted path, or a heading that is one code span
  (a section, e.g. "### `health`"). Paths: `health.probe.interval_ms`; a map's key is written
  `<anything>` (`pools.<name>.fallback`), a list's entry `[]` (`auth.keys[].name`). The row's
  third column is the default: the first code span in it is the value (`5000`, `weighted`,
  `true`), `required` for a required field, `unset` for a field that defaults to nothing.
- **A YAML example**: a fence ```` ```yaml ```` holds a whole config and must pass
  `gateway check`; ```` ```yaml fragment ```` holds sections that are merged into a minimal
  config (one pool, one alias) and checked the same; ```` ```yaml not-config ```` is YAML of
  another program (a Kubernetes manifest) and must only parse. `${VAR}` references without a
  default get a dummy value.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import typing
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import pytest
import yaml

from gateway.config import parse_config
from gateway.config.schema import Config, struct_fields, unwrap

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
CONFIG_DOC = DOCS / "configuration.md"
GATEWAY = [sys.executable, "-m", "gateway.cli"]


def documents() -> list[Path]:
    return [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


# ---------------------------------------------------------------------------------------------
# 1. The configuration reference against the schema.

#: A minimal config: what a field reachable through sections only defaults to is read from it
#: (so `scheduler.low.capacity` is 1000, filled in by the loader, not the struct's nothing).
MINIMAL_YAML = """\
pools:
  demo: {instances: [{name: demo-a, url: "http://127.0.0.1:9001/v1", model: m, max_concurrency: 4}]}
models:
  demo-model: {pool: demo}
"""

_REQUIRED = object()  # no default: the user must give it
_UNCHECKED = object()  # computed default (e.g. host name + pid)


def _declared(info: msgspec.structs.FieldInfo) -> object:
    if info.required:
        return _REQUIRED
    if info.default_factory is not msgspec.NODEFAULT:
        return _UNCHECKED
    return info.default


def schema_fields(
    tp: object = Config, prefix: str = "", obj: object = None
) -> Iterator[tuple[str, object]]:
    """Every field of the schema as (dotted path, default), map keys as `<>`, list entries as
    `[]`. `obj` is the minimal config's value of `tp` where it is reachable, else None."""
    cls = unwrap(tp)
    assert isinstance(cls, type) and issubclass(cls, msgspec.Struct)
    info = {f.name: f for f in msgspec.structs.fields(cls)}
    for name, field_tp in struct_fields(cls).items():
        path = f"{prefix}.{name}" if prefix else name
        value = getattr(obj, name) if obj is not None else _declared(info[name])
        yield path, value
        inner = unwrap(field_tp)
        origin = typing.get_origin(inner)
        if origin is list:
            (elem,) = typing.get_args(inner)
            if struct_fields(elem):
                yield from schema_fields(elem, f"{path}[]")
        elif origin is dict:
            _, elem = typing.get_args(inner)
            if struct_fields(elem):
                yield from schema_fields(elem, f"{path}.<>")
        elif struct_fields(inner):
            yield from schema_fields(
                inner, path, value if isinstance(value, msgspec.Struct) else None
            )


@dataclass(frozen=True)
class Row:
    path: str
    default: str
    line: int


_CELL_SPLIT = re.compile(r"(?<!\\)\|")
_ONE_CODE_SPAN = re.compile(r"`([^`]+)`")
_PLACEHOLDER = re.compile(r"<[^>]*>")
_PATH = re.compile(r"[a-z_][a-z0-9_]*(?:\[\])?(?:\.(?:<>|[a-z_][a-z0-9_]*(?:\[\])?))*")


def _cells(line: str) -> list[str]:
    return [c.strip() for c in _CELL_SPLIT.split(line.strip().strip("|"))]


def _normalise(path: str) -> str:
    return _PLACEHOLDER.sub("<>", path)


def documented(text: str) -> tuple[list[Row], set[str]]:
    """The field rows and the section headings of the configuration reference."""
    rows: list[Row] = []
    headings: set[str] = set()
    lines = text.splitlines()
    in_fence = False
    in_field_table = False
    for n, line in enumerate(lines, 1):
        if line.startswith("```"):
            in_fence = not in_fence
            continue
        if in_fence:
            continue
        if line.startswith("#"):
            title = line.lstrip("#").strip()
            m = _ONE_CODE_SPAN.fullmatch(title)
            if m:
                headings.add(_normalise(m.group(1)))
            continue
        if not line.startswith("|"):
            in_field_table = False
            continue
        cells = _cells(line)
        if not in_field_table:
            in_field_table = cells[0] == "field"
            continue
        if set(cells[0]) <= set("-: "):
            continue  # the header's rule
        m = _ONE_CODE_SPAN.fullmatch(cells[0])
        assert m, f"configuration.md:{n}: a field row starts with one `dotted.path`: {line}"
        rows.append(Row(_normalise(m.group(1)), cells[2] if len(cells) > 2 else "", n))
    return rows, headings


def _scalar(value: object) -> bool:
    return isinstance(value, (bool, int, float, str))


def test_every_schema_field_is_documented_and_nothing_else() -> None:
    minimal = parse_config(MINIMAL_YAML, env={})
    schema = dict(schema_fields(Config, "", minimal))
    rows, headings = documented(CONFIG_DOC.read_text(encoding="utf-8"))
    row_paths = [r.path for r in rows]
    for path in row_paths + sorted(headings):
        assert _PATH.fullmatch(path), f"not a dotted path: {path!r}"
    duplicates = sorted({p for p in row_paths if row_paths.count(p) > 1})
    assert not duplicates, f"documented twice in configuration.md: {duplicates}"
    missing = sorted(set(schema) - set(row_paths) - headings)
    assert not missing, f"schema fields missing from docs/configuration.md: {missing}"
    unknown = sorted((set(row_paths) | headings) - set(schema))
    assert not unknown, f"docs/configuration.md documents fields the schema lacks: {unknown}"
    # A value (not a section, list or map) needs a row: that is where its default is.
    no_row = sorted(
        p
        for p, v in schema.items()
        if (_scalar(v) or v is None or v is _REQUIRED) and p not in row_paths
    )
    assert not no_row, f"fields documented only by a heading (no default shown): {no_row}"


def test_every_documented_default_is_the_schema_default() -> None:
    minimal = parse_config(MINIMAL_YAML, env={})
    schema = dict(schema_fields(Config, "", minimal))
    rows, _ = documented(CONFIG_DOC.read_text(encoding="utf-8"))
    wrong: list[str] = []
    for row in rows:
        expected = schema.get(row.path, _UNCHECKED)
        spans = _ONE_CODE_SPAN.findall(row.default)
        where = f"configuration.md:{row.line} {row.path}"
        if expected is _REQUIRED:
            if "required" not in row.default:
                wrong.append(f"{where}: required, documented as {row.default!r}")
        elif expected is None:
            if "unset" not in row.default or spans:
                wrong.append(f"{where}: defaults to nothing (`unset`), not {row.default!r}")
        elif _scalar(expected):
            if not spans:
                wrong.append(f"{where}: default {expected!r} not shown as a `value`")
                continue
            shown = yaml.safe_load(spans[0])
            if shown != expected or type(shown) is not type(expected):
                wrong.append(f"{where}: documented {spans[0]!r}, the schema says {expected!r}")
    assert not wrong, "\n".join(wrong)


def test_the_walk_sees_nested_fields() -> None:
    """The walk itself can fail: it reaches into sections, maps and lists of sections."""
    minimal = parse_config(MINIMAL_YAML, env={})
    schema = dict(schema_fields(Config, "", minimal))
    assert schema["scheduler.low.capacity"] == 1000
    assert schema["health.probe.interval_ms"] == 5000
    assert schema["pools.<>.instances[].tls.ca_file"] is None
    assert schema["pools.<>.instances[].max_concurrency"] is _REQUIRED
    assert schema["auth.keys[].routes"] is None
    assert schema["cluster.replica_id"] is _UNCHECKED


# ---------------------------------------------------------------------------------------------
# 2. Every YAML example passes `gateway check`.


@dataclass(frozen=True)
class Example:
    doc: Path
    line: int
    kind: str  # "config" | "fragment" | "not-config"
    text: str

    @property
    def id(self) -> str:
        return f"{_rel(self.doc)}:{self.line}"


_FENCE = re.compile(r"^```(\S*)\s*(.*)$")
_KINDS = {"": "config", "fragment": "fragment", "not-config": "not-config"}


def yaml_examples() -> list[Example]:
    found: list[Example] = []
    for doc in documents():
        lines = doc.read_text(encoding="utf-8").splitlines()
        i = 0
        while i < len(lines):
            m = _FENCE.match(lines[i])
            if not m or not m.group(1):
                i += 1
                continue
            lang, info = m.group(1), m.group(2).strip()
            end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
            if lang in ("yaml", "yml"):
                assert info in _KINDS, f"{_rel(doc)}:{i + 1}: unknown yaml fence kind {info!r}"
                found.append(Example(doc, i + 1, _KINDS[info], "\n".join(lines[i + 1 : end])))
            i = end + 1
    return found


_VAR = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(:-[^}]*)?\}")


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def _check(text: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    for name, default in _VAR.findall(text):
        if default:
            env.pop(name, None)  # the example's own default applies
        else:
            env[name] = f"dummy-{name.lower()}"  # distinct per name: keys must differ
    path = tmp_path / "example.yaml"
    path.write_text(text, encoding="utf-8")
    return subprocess.run(
        [*GATEWAY, "check", str(path)], capture_output=True, text=True, env=env, timeout=60
    )


EXAMPLES = yaml_examples()


def test_there_are_examples_of_each_kind() -> None:
    kinds = {e.kind for e in EXAMPLES}
    assert {"config", "fragment", "not-config"} <= kinds
    assert any(e.doc.name == "README.md" and e.kind == "config" for e in EXAMPLES)


@pytest.mark.parametrize("example", EXAMPLES, ids=[e.id for e in EXAMPLES])
def test_yaml_example_passes_gateway_check(example: Example, tmp_path: Path) -> None:
    data = yaml.safe_load(example.text)
    if example.kind == "not-config":
        return  # parsed above; another program's file
    assert isinstance(data, dict), f"{example.id}: not a mapping of sections"
    text = example.text
    if example.kind == "fragment":
        text = yaml.safe_dump(_merge(yaml.safe_load(MINIMAL_YAML), data), allow_unicode=True)
    out = _check(text, tmp_path)
    assert out.returncode == 0, f"{example.id}: gateway check failed:\n{out.stderr}"
    assert "models" in out.stdout and "pools" in out.stdout


def test_an_invalid_example_would_fail(tmp_path: Path) -> None:
    """The check the examples go through can fail (a typo in a field is refused)."""
    out = _check(MINIMAL_YAML + "retries: {max_attemps: 3}\n", tmp_path)
    assert out.returncode != 0 and "max_attemps" in out.stderr


# ---------------------------------------------------------------------------------------------
# 3. Links stay in the repository.

_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
_OUTSIDE = [
    re.compile(r"\.\./shared"),
    re.compile(r"shared folder", re.IGNORECASE),
    re.compile(r"\bSPEC\b"),
    re.compile(r"SPEC\.md"),
    re.compile(r"/work/"),
]


def _prose(text: str) -> str:
    """The text outside fenced code blocks."""
    out, fenced = [], False
    for line in text.splitlines():
        if line.startswith("```"):
            fenced = not fenced
            continue
        if not fenced:
            out.append(line)
    return "\n".join(out)


def _slug(title: str) -> str:
    """A heading's anchor as GitHub renders it."""
    text = title.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(doc: Path) -> set[str]:
    seen: dict[str, int] = {}
    out: set[str] = set()
    for line in _prose(doc.read_text(encoding="utf-8")).splitlines():
        if line.startswith("#"):
            slug = _slug(line.lstrip("#"))
            n = seen.get(slug, 0)
            seen[slug] = n + 1
            out.add(slug if n == 0 else f"{slug}-{n}")
    return out


@pytest.mark.parametrize("doc", documents(), ids=_rel)
def test_document_points_only_into_the_repository(doc: Path) -> None:
    text = doc.read_text(encoding="utf-8")
    for pattern in _OUTSIDE:
        for n, line in enumerate(text.splitlines(), 1):
            assert not pattern.search(line), f"{_rel(doc)}:{n} points outside the repository"
    for target in _LINK.findall(_prose(text)):
        assert not re.match(r"[a-z]+:", target), f"{_rel(doc)}: link out of the repository {target}"
        file_part, _, anchor = target.partition("#")
        dest = (doc.parent / file_part).resolve() if file_part else doc
        assert dest.is_relative_to(ROOT), f"{_rel(doc)}: {target} leaves the repository"
        assert dest.exists(), f"{_rel(doc)}: {target} does not exist"
        if anchor:
            assert dest.suffix == ".md", f"{_rel(doc)}: anchor into a non-document {target}"
            assert anchor in anchors(dest), f"{_rel(doc)}: no heading #{anchor} in {dest.name}"


def test_the_docs_index_links_every_document() -> None:
    index = (DOCS / "README.md").read_text(encoding="utf-8")
    linked = {(DOCS / t.partition("#")[0]).resolve() for t in _LINK.findall(index)}
    for doc in sorted(DOCS.glob("*.md")):
        if doc.name != "README.md":
            assert doc.resolve() in linked, f"docs/README.md does not link {doc.name}"
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert "docs/README.md" in readme and "docs/install.md" in readme
