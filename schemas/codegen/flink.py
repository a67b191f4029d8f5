"""Flink SQL ``CREATE TABLE`` per record type, from the ``.avsc`` contract.

``outputs(schemas)`` maps ``docs/reference/engines/flink/<Name>.sql`` to a Kafka-connector table whose
columns mirror the writer schema field by field (order, types, nullability), as Flink's ``'avro'``
format needs: it derives the writer schema from the columns and does no resolution, so it reads the
``raw`` framing of exactly this schema version. Timestamps (``timestamp-millis``) are ``TIMESTAMP(3)``
in UTC (Flink's default legacy mapping). Flink has no enum column: an enum field is declared
``STRING`` and such a table is readable only with ``'avro-confluent'`` (its header says so).
"""

from __future__ import annotations

from typing import Any

from gpupipe.kafka.topics import RECORDS_ON


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


OUT_DIR = "docs/reference/engines/flink"
_PRIMITIVE = {
    "string": "STRING",
    "int": "INT",
    "long": "BIGINT",
    "double": "DOUBLE",
    "float": "FLOAT",
    "boolean": "BOOLEAN",
    "bytes": "BYTES",
}


def _has_enum(t: Any) -> bool:
    if isinstance(t, list):
        return any(_has_enum(x) for x in t)
    if not isinstance(t, dict):
        return False
    kind = t.get("type")
    if kind == "enum":
        return True
    if kind == "record":
        return any(_has_enum(f["type"]) for f in t["fields"])
    return _has_enum(t.get("items") or t.get("values") or kind)


def column_type(t: Any, named: dict[str, Any]) -> str:
    """The Flink SQL type of an Avro type (NOT NULL unless a ``["null", X]`` union)."""
    if isinstance(t, list):
        rest = [x for x in t if x != "null"]
        if len(rest) != 1 or len(t) != 2:
            raise ValueError(f"union {t} has no Flink column type")
        return column_type(rest[0], named).removesuffix(" NOT NULL")
    if isinstance(t, str):
        return _PRIMITIVE[t] + " NOT NULL" if t in _PRIMITIVE else column_type(named[t], named)
    kind = t["type"]
    if t.get("logicalType") == "timestamp-millis":
        return "TIMESTAMP(3) NOT NULL"
    if isinstance(kind, dict | list):
        return column_type(kind, named)
    if kind in _PRIMITIVE:
        return _PRIMITIVE[kind] + " NOT NULL"
    if kind == "enum":
        return "STRING NOT NULL"
    if kind == "record":
        fields = ", ".join(f"`{f['name']}` {column_type(f['type'], named)}" for f in t["fields"])
        return f"ROW<{fields}> NOT NULL"
    if kind == "array":
        return f"ARRAY<{column_type(t['items'], named)}> NOT NULL"
    if kind == "map":
        return f"MAP<STRING NOT NULL, {column_type(t['values'], named)}> NOT NULL"
    raise ValueError(f"Avro type {kind!r} has no Flink column type")


def table_name(record: str) -> str:
    """``GpuSample`` -> ``gpu_sample``."""
    return "".join(f"_{c.lower()}" if c.isupper() and i else c.lower() for i, c in enumerate(record))


def ddl(schema: dict[str, Any]) -> str:
    name = schema["name"]
    topic = next(t for t, names in RECORDS_ON.items() if name in names)
    named = named_types(schema)
    cols = [f"  `{f['name']}` {column_type(f['type'], named)}" for f in schema["fields"]]
    cols.append("  `kafka_headers` MAP<STRING, BYTES> METADATA FROM 'headers' VIRTUAL")
    if _has_enum(schema):
        note = (
            "-- Holds enums: Flink's 'avro' format cannot decode them (it has no enum column).\n"
            "-- Read this topic with 'format' = 'avro-confluent' and a registry\n"
            "-- (producers with --schema-registry-url).\n"
        )
    else:
        note = "-- Decodes the raw framing (producers with --framing raw) of exactly this schema version.\n"
    return (
        f"-- {name} on {topic}: generated from schemas/{name}.avsc; do not edit by hand.\n"
        "-- Set the broker with: ALTER TABLE ... SET ('properties.bootstrap.servers' = 'HOST:PORT')\n"
        f"{note}"
        f"CREATE TABLE `{table_name(name)}` (\n" + ",\n".join(cols) + "\n) WITH (\n"
        "  'connector' = 'kafka',\n"
        f"  'topic' = '{topic}',\n"
        "  'properties.bootstrap.servers' = 'localhost:9092',\n"
        "  'scan.startup.mode' = 'earliest-offset',\n"
        "  'format' = 'avro'\n"
        ");\n"
    )


def outputs(schemas: list[dict[str, Any]]) -> dict[str, str]:
    return {f"{OUT_DIR}/{s['name']}.sql": ddl(s) for s in schemas}
