"""Spark SQL schema per record type, from the ``.avsc`` contract.

``outputs(schemas)`` maps ``docs/reference/engines/spark/<Name>.json`` to the ``StructType`` JSON
(``StructType.fromJson``) that Spark's ``from_avro`` gives for the writer schema: the same field
order, nullability from ``["null", X]`` unions, ``timestamp-millis`` as ``timestamp``, enums as
``string``. Use it to declare a table or to check a job's input against the contract.
"""

from __future__ import annotations

import json
from typing import Any


def named_types(t: Any, out: dict[str, Any] | None = None) -> dict[str, Any]:
    """Every named type (record, enum, fixed) defined in ``t``, by name and full name."""
    out = {} if out is None else out
    if isinstance(t, list):
        for x in t:
            named_types(x, out)
    elif isinstance(t, dict):
        if t.get("type") in ("record", "enum", "fixed"):
            out[t["name"]] = t
            if t.get("namespace"):
                out[f"{t['namespace']}.{t['name']}"] = t
        for f in t.get("fields", ()):
            named_types(f["type"], out)
        for k in ("items", "values"):
            if k in t:
                named_types(t[k], out)
        if isinstance(t.get("type"), dict | list):
            named_types(t["type"], out)
    return out


OUT_DIR = "docs/reference/engines/spark"
_PRIMITIVE = {
    "string": "string",
    "int": "integer",
    "long": "long",
    "double": "double",
    "float": "float",
    "boolean": "boolean",
    "bytes": "binary",
    "enum": "string",
}


def data_type(t: Any, named: dict[str, Any]) -> tuple[Any, bool]:
    """(Spark data type JSON, nullable) of an Avro type."""
    if isinstance(t, list):
        rest = [x for x in t if x != "null"]
        if len(rest) != 1:
            raise ValueError(f"union {t} has no Spark type")
        return data_type(rest[0], named)[0], "null" in t
    if isinstance(t, str):
        return (_PRIMITIVE[t], False) if t in _PRIMITIVE else data_type(named[t], named)
    kind = t["type"]
    if t.get("logicalType") == "timestamp-millis":
        return "timestamp", False
    if isinstance(kind, dict | list):
        return data_type(kind, named)
    if kind in _PRIMITIVE:
        return _PRIMITIVE[kind], False
    if kind == "record":
        return struct(t, named), False
    if kind == "array":
        item, null = data_type(t["items"], named)
        return {"type": "array", "elementType": item, "containsNull": null}, False
    if kind == "map":
        value, null = data_type(t["values"], named)
        return {"type": "map", "keyType": "string", "valueType": value, "valueContainsNull": null}, False
    raise ValueError(f"Avro type {kind!r} has no Spark type")


def struct(record: dict[str, Any], named: dict[str, Any]) -> dict[str, Any]:
    fields = []
    for f in record["fields"]:
        typ, null = data_type(f["type"], named)
        fields.append({"name": f["name"], "type": typ, "nullable": null, "metadata": {}})
    return {"type": "struct", "fields": fields}


def outputs(schemas: list[dict[str, Any]]) -> dict[str, str]:
    return {
        f"{OUT_DIR}/{s['name']}.json": json.dumps(struct(s, named_types(s)), indent=1) + "\n" for s in schemas
    }
