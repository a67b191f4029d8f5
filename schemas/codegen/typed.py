"""Emitter of `schemas/records.py`: a TypedDict per Avro record and the schema's field groups.

Types: Avro int/long -> int (logical types too: timestamps stay integer milliseconds), float/double
-> float, a nullable union -> ``X | None``, an enum -> a ``Literal`` alias, array/map -> list/dict.
A field with a default is ``NotRequired`` (a writer may leave it out: Avro writes the default;
every decoded record has it). A named type defined twice alike is emitted once; defined
differently in another schema, its second form is prefixed with that schema's record name.
Groups: see :mod:`gpupipe_schemas.codegen.groups`. The annotations are evaluated (no ``from
__future__ import annotations``), so ``NotRequired`` shows at run time (``__required_keys__``) and
each type is emitted before its users.
"""

from __future__ import annotations

import json
import keyword
from typing import Any

from gpupipe_schemas.codegen import groups

PATH = "schemas/records.py"
WIDTH = 110  # the project's line length (pyproject: tool.ruff)

_PRIMITIVES = {
    "null": "None",
    "boolean": "bool",
    "int": "int",
    "long": "int",
    "float": "float",
    "double": "float",
    "string": "str",
    "bytes": "bytes",
}

_HEADER = '''"""The contract's records as types: a TypedDict per Avro record, and the schema's field groups.

Generated from schemas/*.avsc by gpupipe_schemas.codegen; do not edit by hand. Regenerate with
`.venv/bin/python -m gpupipe_schemas.codegen` (or `make contract`); `--check` fails on drift.
"""

from typing import Literal, NotRequired, TypeAlias, TypedDict
'''


def _sequence(prefix: str, items: list[str], suffix: str) -> list[str]:
    """``prefix + items + suffix`` on one line if it fits, else one item a line (ruff's layout)."""
    one = f"{prefix}{', '.join(items)}{suffix}"
    if len(one) <= WIDTH:
        return [one]
    return [prefix, *(f"    {x}," for x in items), suffix.removeprefix(",")]


def _canonical(t: Any) -> str:
    """A named type's definition without its docs: equal text, same type."""

    def strip(node: Any) -> Any:
        if isinstance(node, dict):
            return {k: strip(v) for k, v in node.items() if k != "doc"}
        if isinstance(node, list):
            return [strip(v) for v in node]
        return node

    return json.dumps(strip(t), sort_keys=True)


class _Emitter:
    def __init__(self) -> None:
        self.blocks: list[list[str]] = []
        self.defined: dict[str, str] = {}  # Python name -> canonical definition
        self.records: list[tuple[str, dict[str, Any]]] = []  # Python name, record schema
        self.top: list[str] = []
        self.namespace = ""

    def schema(self, schema: dict[str, Any]) -> None:
        scope: dict[str, str] = {}
        self.namespace = schema.get("namespace", "")
        self.top.append(self._type(schema, scope, schema["name"]))

    def _name(self, t: dict[str, Any], scope: dict[str, str], owner: str) -> tuple[str, bool]:
        """The Python name of a named type, and whether it still needs emitting."""
        canon = _canonical(t)
        name = t["name"].rsplit(".", 1)[-1]
        for candidate in (name, owner + name):
            if self.defined.get(candidate) == canon:
                scope[t["name"]] = scope[name] = candidate
                return candidate, False
            if candidate not in self.defined:
                self.defined[candidate] = canon
                scope[t["name"]] = scope[name] = candidate
                return candidate, True
        raise ValueError(f"{owner}: named type {name} clashes with two other definitions")

    def _type(self, t: Any, scope: dict[str, str], owner: str) -> str:
        if isinstance(t, str):
            if t in _PRIMITIVES:
                return _PRIMITIVES[t]
            if t in scope:
                return scope[t]
            raise ValueError(f"{owner}: unknown type {t!r}")
        if isinstance(t, list):
            parts = [self._type(x, scope, owner) for x in t if x != "null"]
            return " | ".join(parts + (["None"] if "null" in t else []))
        kind = t["type"]
        if kind in _PRIMITIVES:
            return _PRIMITIVES[kind]
        if kind == "array":
            return f"list[{self._type(t['items'], scope, owner)}]"
        if kind == "map":
            return f"dict[str, {self._type(t['values'], scope, owner)}]"
        if kind == "fixed":
            name, new = self._name(t, scope, owner)
            if new:
                self.blocks.append([f"{name}: TypeAlias = bytes"])
            return name
        if kind == "enum":
            name, new = self._name(t, scope, owner)
            if new:
                symbols = [json.dumps(s) for s in t["symbols"]]
                self.blocks.append(_sequence(f"{name}: TypeAlias = Literal[", symbols, "]"))
            return name
        if kind == "record":
            name, new = self._name(t, scope, owner)
            if new:
                self._record(name, t, scope, owner)
            return name
        raise ValueError(f"{owner}: unsupported type {kind!r}")

    def _record(self, name: str, t: dict[str, Any], scope: dict[str, str], owner: str) -> None:
        namespace = t.get("namespace") or self.namespace
        ns = f"{namespace}." if namespace else ""
        lines = [f"class {name}(TypedDict):", f'    """Avro record {ns}{t["name"]}."""', ""]
        for f in t["fields"]:
            if keyword.iskeyword(f["name"]) or not f["name"].isidentifier():
                raise ValueError(f"{owner}: field {f['name']!r} is no Python identifier")
            py = self._type(f["type"], scope, owner)
            lines.append(f"    {f['name']}: {f'NotRequired[{py}]' if 'default' in f else py}")
        self.blocks.append(lines)
        self.records.append((name, t))

    def groups(self) -> list[list[str]]:
        out = []
        for name, rec in self.records:
            for (key, value), fields in groups.field_groups(rec).items():
                const = groups.group_name(name, key, value)
                items = [json.dumps(f) for f in fields]
                tail = ",)" if len(items) == 1 else ")"
                lines = _sequence(f"{const}: tuple[str, ...] = (", items, tail)
                out.append([f"#: {name} fields with {key} = {value}.", *lines])
        return out


def outputs(schemas: list[dict[str, Any]]) -> dict[str, str]:
    em = _Emitter()
    for schema in schemas:
        em.schema(schema)
    blocks = [*em.blocks]
    top = " | ".join(em.top)
    blocks.append(["#: Any top-level record a topic carries.", f"AnyRecord: TypeAlias = {top}"])
    blocks += em.groups()
    body = "\n\n\n".join("\n".join(b) for b in blocks)
    # isort's and ruff format's layout: two blank lines before a class, else one after the imports.
    gap = "\n\n" if body.startswith("class ") else "\n"
    return {PATH: f"{_HEADER}{gap}{body}\n"}
