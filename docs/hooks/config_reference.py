"""The configuration reference, generated from the configuration model (``aggregator/config.py``).

Every key an operator can set is a field of a pydantic dataclass reachable from ``Config``. Its meaning
is the ``#:`` comment block right above the field, or the trailing ``# ...`` comment on the field's line,
or a pydantic ``Field(description=...)``: whichever the model uses, this module reads it, so the page
cannot fall behind the model. The type and range come from pydantic's JSON schema of the field, the
default from the dataclass itself.

Used two ways: as a mkdocs hook (``mkdocs.yml`` ``hooks:``), which replaces the marker line
``<!-- rsagg:config-reference -->`` in ``docs/configuration.md`` with the tables and fails the build
when a key has no meaning; and by ``tests/test_docs.py``, which fails on the same condition.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import io
import json
import math
import tokenize
import typing
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

MARKER = "<!-- rsagg:config-reference -->"

#: Fields of ``Config`` that are not keys of the file (``file`` is where the configuration was read from).
NOT_KEYS = frozenset({"file"})


@dataclass(frozen=True)
class Key:
    """One configuration key: its path as written in the file, type, default and meaning."""

    section: str  # "[server]", "[[sources]]", or "" for top-level tables
    key: str  # "server.listen", "sources[].name"
    type: str
    default: str
    meaning: str


def _comments(cls: type) -> dict[str, str]:
    """Field name -> its ``#:`` block above, else its trailing comment, read from the class's source."""
    source = inspect.getsource(cls)
    lines = source.splitlines()
    trailing: dict[int, str] = {}  # line (1-based) -> trailing comment text
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT and not tok.line[: tok.start[1]].strip() == "":
            text = tok.string[1:].strip()
            if not text.startswith(("fmt:", "noqa", "type:")):
                trailing[tok.start[0]] = text
    out: dict[str, str] = {}
    for node in ast.parse(source).body[0].body:  # type: ignore[attr-defined]
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        block: list[str] = []
        i = node.lineno - 2  # the line above, 0-based
        while i >= 0 and lines[i].strip().startswith("#:"):
            block.insert(0, lines[i].strip()[2:].strip())
            i -= 1
        after = [
            trailing[n] for n in range(node.lineno, (node.end_lineno or node.lineno) + 1) if n in trailing
        ]
        text = " ".join(block) or " ".join(after)
        if text:
            out[node.target.id] = text
    return out


def _schema_type(prop: dict[str, Any], defs: dict[str, Any]) -> str:
    """A short, operator-facing type from one JSON-schema property."""
    if "$ref" in prop:
        return "table"
    if "anyOf" in prop:
        kinds = [_schema_type(p, defs) for p in prop["anyOf"] if p.get("type") != "null"]
        return " or ".join(dict.fromkeys(kinds))
    if "enum" in prop:
        return "one of " + ", ".join(f"`{json.dumps(v)}`" for v in prop["enum"])
    if "const" in prop:
        return f"`{json.dumps(prop['const'])}`"
    kind = prop.get("type", "any")
    if kind == "array":
        items = prop.get("items", {})
        if "$ref" in items:
            return "array of tables"
        return f"array of {_schema_type(items, defs)}" if items else "array"
    if kind == "object":
        return "table"
    name = {"number": "number", "integer": "integer", "string": "string", "boolean": "boolean"}.get(
        kind, kind
    )
    bounds = []
    for word, sign in (
        ("minimum", "≥"),
        ("exclusiveMinimum", ">"),
        ("maximum", "≤"),
        ("exclusiveMaximum", "<"),
    ):
        if word in prop:
            bounds.append(f"{sign} {_number(prop[word])}")
    if prop.get("minLength"):
        bounds.append("not empty")
    return f"{name} ({', '.join(bounds)})" if bounds else name


def _number(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


def _toml(value: Any) -> str:
    """A default as it would be written in the file."""
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return "`true`" if value else "`false`"
    if isinstance(value, int):
        text = f"`{value}`"
        for unit, size in (("GiB", 1024**3), ("MiB", 1024**2)):
            if value >= size and value % size == 0:
                return f"{text} ({value // size} {unit})"
        return text
    if isinstance(value, float):
        return f"`{_number(value)}`" if math.isfinite(value) else f"`{value}`"
    if isinstance(value, str):
        return f'`"{value}"`' if value else '`""`'
    if isinstance(value, dict | list | tuple) and not value:
        return "`{}`" if isinstance(value, dict) else "`[]`"
    return f"`{value!r}`"


def _default(cls: type, f: dataclasses.Field[Any]) -> str:
    """The default from pydantic's field table (a ``Field(default=...)`` included), else the dataclass's."""
    from pydantic_core import PydanticUndefined

    info = getattr(cls, "__pydantic_fields__", {}).get(f.name)
    if info is not None:
        if info.default is not PydanticUndefined:
            return _toml(info.default)
        if info.default_factory is not None:
            return _toml(info.default_factory())  # type: ignore[call-arg]
        return "required"
    if f.default is not dataclasses.MISSING:
        return _toml(f.default)
    if f.default_factory is not dataclasses.MISSING:
        return _toml(f.default_factory())
    return "required"


def _is_model(tp: Any) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def _walk(cls: type, section: str, prefix: str) -> Iterator[Key]:
    from pydantic import TypeAdapter

    schema = TypeAdapter(cls).json_schema()
    defs = schema.get("$defs", {})
    props = schema.get("properties", {})
    meanings = _comments(cls)
    hints = typing.get_type_hints(cls)
    nested: list[tuple[type, str, str]] = []
    for f in dataclasses.fields(cls):
        if cls.__name__ == "Config" and f.name in NOT_KEYS:
            continue
        hint = hints[f.name]
        args = typing.get_args(hint)
        if _is_model(hint):  # a [section]
            nested.append((hint, f"[{f.name}]", f"{f.name}."))
            continue
        if typing.get_origin(hint) is tuple and args and _is_model(args[0]):  # an array of tables
            nested.append((args[0], f"[[{f.name}]]", f"{f.name}[]."))
            continue
        meaning = meanings.get(f.name, "")
        info = getattr(cls, "__pydantic_fields__", {}).get(f.name)
        if not meaning and info is not None and info.description:
            meaning = info.description
        yield Key(
            section, prefix + f.name, _schema_type(props.get(f.name, {}), defs), _default(cls, f), meaning
        )
    for sub, sub_section, sub_prefix in nested:
        yield from _walk(sub, sub_section, sub_prefix)


def keys() -> list[Key]:
    """Every configuration key, in the model's order, sections after the top-level tables."""
    from aggregator.config import Config

    return list(_walk(Config, "", ""))


def undocumented() -> list[str]:
    """Keys without a meaning in the model: what the test and the docs build refuse."""
    return [k.key for k in keys() if not k.meaning.strip()]


def _md(text: str) -> str:
    """A model comment as Markdown: reStructuredText's double backticks become code spans."""
    return text.replace("``", "`").replace("|", "\\|").replace("\n", " ")


def _shown(k: Key) -> str:
    """The key as an operator finds it in a file: ``server.listen``, ``[[sources]] name``."""
    if k.key.count("[]."):
        array, name = k.key.split("[].", 1)
        return f"`[[{array}]]` `{name}`"
    if k.key == "plugins":
        return "`[plugins.NAME]`"
    return f"`{k.key}`"


def markdown() -> str:
    """The reference as Markdown: one table per section, each under its class's first docstring line."""
    from aggregator import config as model

    by_section: dict[str, list[Key]] = {}
    for k in keys():
        by_section.setdefault(k.section or "[plugins.NAME]", []).append(k)
    order = [s for s in by_section if s != "[plugins.NAME]"] + ["[plugins.NAME]"]
    out: list[str] = []
    for section in order:
        rows = by_section.get(section)
        if not rows:
            continue
        out.append(f"### `{section}`\n")
        cls = _hint(model.Config, section.strip("[]"))
        doc = inspect.getdoc(cls) if cls is not None else None
        if doc and cls is not None and doc.startswith(f"{cls.__name__}("):
            doc = None  # the signature dataclasses writes into a class without a docstring
        if doc:
            out.append(_md(doc.split("\n\n")[0]) + "\n")
        out.append("| key | type | default | meaning |")
        out.append("|---|---|---|---|")
        out.extend(f"| {_shown(k)} | {_md(k.type)} | {_md(k.default)} | {_md(k.meaning)} |" for k in rows)
        out.append("")
    return "\n".join(out)


def _hint(cls: type, name: str) -> type | None:
    """The dataclass of a section (``server``) or of an array of tables (``sources``), else None."""
    hint = typing.get_type_hints(cls).get(name)
    if _is_model(hint):
        return hint
    args = typing.get_args(hint)
    if args and _is_model(args[0]):
        return args[0]
    return None


# --- the mkdocs hook --------------------------------------------------------------------------------


def on_page_markdown(markdown_text: str, page: Any, config: Any, files: Any) -> str:
    """Replace the marker with the generated reference; refuse to build with an undocumented key."""
    if MARKER not in markdown_text:
        return markdown_text
    missing = undocumented()
    if missing:
        from mkdocs.exceptions import PluginError

        raise PluginError(
            "configuration keys without a meaning in aggregator/config.py (add a #: comment above the "
            f"field): {', '.join(missing)}"
        )
    return markdown_text.replace(MARKER, markdown())
