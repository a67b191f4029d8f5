"""The lake tables' columns, derived from the Avro contract: Avro schemas as Arrow schemas.

The Arrow (hence Iceberg) schema of each table is computed from ``schemas/<Record>.avsc`` and never
written by hand, so a field added to the Avro schema is a column added to the table on the writer's
next start (:func:`gpupipe_consumers.lake.writer.open_table` evolves the table by name). The mapping:

* ``timestamp-millis`` longs become ``timestamptz`` (Iceberg has microseconds only; the value is
  the same instant), so day partitioning and time filters work on them;
* enums become strings (a new symbol is then no schema change), records structs, arrays lists,
  maps maps, ``["null", T]`` a nullable T;
* every column is optional in Iceberg: Avro fields added later carry defaults and must be
  addable to a table that already has rows, and an optional column never rejects an old row.

Each row also carries where it came from (``_kafka_partition``, ``_kafka_offset``,
``_kafka_timestamp``): the exactly-once offsets are per partition and a row can be traced to its
record on the topic.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import pyarrow as pa

from gpupipe_consumers.lake.tables import LakeTable

#: Avro primitive -> Arrow type.
_PRIMITIVES: Mapping[str, pa.DataType] = {
    "boolean": pa.bool_(),
    "int": pa.int32(),
    "long": pa.int64(),
    "float": pa.float32(),
    "double": pa.float64(),
    "string": pa.string(),
    "bytes": pa.binary(),
}

#: How rows are built (the codec hands back integer milliseconds) and how they are stored.
BUILD_TS = pa.timestamp("ms", tz="UTC")
STORE_TS = pa.timestamp("us", tz="UTC")

#: Columns every table adds after the Avro fields (name, Arrow type while building).
KAFKA_COLUMNS: tuple[tuple[str, pa.DataType], ...] = (
    ("_kafka_partition", pa.int32()),
    ("_kafka_offset", pa.int64()),
    ("_kafka_timestamp", BUILD_TS),
)


def _named_types(node: Any, out: dict[str, Any]) -> None:
    """Collect the named types (records, enums, fixed) an Avro schema defines, by full and short name."""
    if isinstance(node, list):
        for x in node:
            _named_types(x, out)
    elif isinstance(node, dict):
        kind = node.get("type")
        if kind in ("record", "enum", "fixed") and "name" in node:
            out[node["name"]] = node
            if node.get("namespace"):
                out[f"{node['namespace']}.{node['name']}"] = node
        for f in node.get("fields", ()):
            _named_types(f["type"], out)
        for k in ("items", "values"):
            if k in node:
                _named_types(node[k], out)
        if isinstance(kind, dict | list):
            _named_types(kind, out)


def arrow_type(t: Any, names: Mapping[str, Any], ts: pa.DataType = BUILD_TS) -> pa.DataType:
    """The Arrow type of Avro type ``t`` (``names``: the schema's named types; ``ts``: timestamp type)."""
    if isinstance(t, str):
        if t in _PRIMITIVES:
            return _PRIMITIVES[t]
        if t in names:
            return arrow_type(names[t], names, ts)
        raise ValueError(f"unsupported Avro type {t!r}")
    if isinstance(t, list):
        branches = [b for b in t if b != "null"]
        if len(branches) != 1:
            raise ValueError(f"only [null, T] unions map to a column, got {t!r}")
        return arrow_type(branches[0], names, ts)
    kind = t["type"]
    if t.get("logicalType") in ("timestamp-millis", "timestamp-micros") and kind == "long":
        return ts if t["logicalType"] == "timestamp-millis" else STORE_TS
    if kind == "record":
        return pa.struct([pa.field(f["name"], arrow_type(f["type"], names, ts)) for f in t["fields"]])
    if kind == "enum":
        return pa.string()
    if kind == "array":
        return pa.list_(arrow_type(t["items"], names, ts))
    if kind == "map":
        return pa.map_(pa.string(), arrow_type(t["values"], names, ts))
    if kind == "fixed":
        return pa.binary(t["size"])
    return arrow_type(kind, names, ts)


def arrow_schema(record: Mapping[str, Any], ts: pa.DataType = BUILD_TS) -> pa.Schema:
    """The table's Arrow schema: the Avro record's fields in order, then :data:`KAFKA_COLUMNS`.

    ``ts`` BUILD_TS gives the schema rows are built with (integer milliseconds in), STORE_TS the one
    they are stored with."""
    names: dict[str, Any] = {}
    _named_types(record, names)
    fields = [pa.field(f["name"], arrow_type(f["type"], names, ts)) for f in record["fields"]]
    fields += [pa.field(n, ts if ty == BUILD_TS else ty) for n, ty in KAFKA_COLUMNS]
    return pa.schema(fields)


def storage_schema(table: LakeTable) -> pa.Schema:
    return arrow_schema(table.avro(), STORE_TS)


def build_schema(table: LakeTable) -> pa.Schema:
    return arrow_schema(table.avro(), BUILD_TS)


def to_arrow(rows: Sequence[Mapping[str, Any]], build: pa.Schema, store: pa.Schema) -> pa.Table:
    """Rows (decoded records with the Kafka columns added) as an Arrow table in the storage schema.

    Built with millisecond timestamps (the codec's integers) and cast to microseconds, which is
    exact: no integer arithmetic per row in Python."""
    return pa.Table.from_pylist(list(rows), schema=build).cast(store)
