"""Render the Avro contract as Markdown (`docs/schemas.md`): one table per record type.

Run `python -m gpupipe_schemas.docs > docs/schemas.md`; a unit test fails when the committed
file is out of date, so the documentation data-platform teams read is the schema.
"""

from __future__ import annotations

import sys
from typing import Any

from gpupipe_schemas import catalog
from gpupipe_schemas.codegen import groups


def _type_text(t: Any) -> str:
    if isinstance(t, str):
        return t
    if isinstance(t, list):
        parts = [_type_text(x) for x in t if x != "null"]
        text = " | ".join(parts)
        return f"{text} (nullable)" if "null" in t else text
    kind = t.get("type")
    if kind == "array":
        return f"array of {_type_text(t['items'])}"
    if kind == "map":
        return f"map of {_type_text(t['values'])}"
    if kind in ("record", "enum", "fixed"):
        if kind == "enum":
            return f"enum {t['name']} {{{', '.join(t['symbols'])}}}"
        return f"{kind} {t['name']}"
    if "logicalType" in t:
        return f"{kind} ({t['logicalType']})"
    return str(kind)


def _nested(t: Any) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    if isinstance(t, list):
        for x in t:
            out += _nested(x)
    elif isinstance(t, dict):
        if t.get("type") == "record":
            out.append(t)
            for f in t["fields"]:
                out += _nested(f["type"])
        elif t.get("type") == "array":
            out += _nested(t["items"])
        elif t.get("type") == "map":
            out += _nested(t["values"])
    return out


def _table(rec: dict[str, Any], level: str) -> list[str]:
    lines = [
        f"{level} `{rec['name']}`",
        "",
        rec.get("doc", ""),
        "",
        "| field | type | default | doc |",
        "|---|---|---|---|",
    ]
    for f in rec["fields"]:
        default = f"`{f['default']!r}`" if "default" in f else "required"
        doc = f.get("doc", "").replace("|", "\\|").replace("\n", " ")
        lines.append(f"| `{f['name']}` | {_type_text(f['type'])} | {default} | {doc} |")
    lines.append("")
    return lines


_FRAMING = """\
## Framing

Each value is one Avro binary record, framed one of three ways. The node agent picks a framing per
topic (`gpupipe produce --framing samples=raw`, or `--framing raw` for both of its topics); every
gpupipe consumer reads all three, also mixed in one topic.

| framing | value | the writer schema is named by | default |
|---|---|---|---|
| `single-object` | `C3 01` + 8-byte fingerprint + body | the fingerprint (wire bytes) | yes, without a registry |
| `confluent` | `00` + 4-byte big-endian schema id + body | the registry's id (subject `<topic>-value`) | with `--schema-registry-url` |
| `raw` | the body alone | Kafka record header `gpupipe.schema` = `<Name>@<fingerprint, wire bytes in hex>` | no |

A `raw` value whose header is lost (a copy job that drops headers) cannot be told apart from garbage:
gpupipe's consumers dead-letter it, as they do a value with neither header nor magic byte.

**Which framing for which engine.**

| reader | `single-object` | `confluent` | `raw` |
|---|---|---|---|
| Flink SQL, `'format'='avro'` | no (the prefix breaks decoding) | no | yes, with the [generated DDL](reference/engines/index.md) |
| Flink SQL, `'format'='avro-confluent'` | no | yes, with a registry | no |
| Spark `from_avro` | yes, `substring` past 10 bytes ([recipe](recipes/spark.md)) | yes, past 5 bytes | yes, the value as is |
| an Avro library in code (fastavro, Java `BinaryDecoder`) | skip 10 bytes | skip 5 bytes | as is |
| confluent-kafka `AvroDeserializer` | no | yes | no |

**Evolution.** Fields are only ever added with defaults, never removed, renamed or retyped (see
[Topics](topics.md)). Readers that resolve the writer schema (gpupipe's consumers, any reader given the
writer's `.avsc` by fingerprint, a registry reader) read every released version. A reader that takes
its schema from its own table definition and does no resolution (Flink's `avro` format) must declare
the writer's exact field list: regenerate the DDL from the same schema version the producers run,
and upgrade such jobs together with the producers (the header says which version a record has:
filter on it to fence off the other).

**The default's trade-offs.** `single-object` needs no server and no header support, a record's
identity travels in its bytes (through any copy), and it costs 10 bytes a record; but stock SQL
formats cannot skip the prefix. `raw` is what stock engines decode, at no byte cost, but the identity
lives in a header that every hop must keep. `confluent` lets readers resolve schemas they never saw,
at the price of running a registry.

**How `confluent` is tested.** Only against confluent-kafka's in-process mock registry
(`--schema-registry-url mock://...`): no Confluent-compatible registry server could be run where the
suite runs. Confluent's own is not on PyPI, Apicurio Registry's app needs a Quarkus build, Karapace
is not on PyPI, and `etlantic-schemaregistry` 0.59.0 (experimental) installs but is a read-only
client adapter, not a server. Registering and fetching over HTTP against a real registry is
therefore untested here: try it against yours before relying on it.

**Fingerprints.** The fingerprint is CRC-64-AVRO (the Avro spec's Rabin fingerprint) of the
schema's parsing canonical form. Two spellings of the same 64-bit number are in use: the *wire
bytes* (little-endian, as they appear after `C3 01` and in the `gpupipe.schema` header, and as
fastavro's `fingerprint(..., "CRC-64-AVRO")` prints them), and the *value* (Java's
`SchemaNormalization.parsingFingerprint64` returns it as a signed `long`; `Long.toHexString` prints the
unsigned hex). Each section below gives all three.

"""  # noqa: E501 (Markdown table rows)


def fingerprint_forms(fp: bytes) -> tuple[str, str, int]:
    """(wire bytes hex, the 64-bit value in hex, the value as Java's signed long) of a fingerprint."""
    value = int.from_bytes(fp, "little")
    return fp.hex(), f"0x{value:016x}", value - (1 << 64) if value >= 1 << 63 else value


def render_markdown() -> str:
    lines = [
        "# gpupipe topic schemas",
        "",
        "Generated from `schemas/*.avsc` by `python -m gpupipe_schemas.docs`; do not edit by hand.",
        "",
        *_FRAMING.splitlines(),
    ]
    for name in catalog.available_names():
        sv = catalog.current(name)
        released = catalog.latest_released(name)
        wire, value, signed = fingerprint_forms(sv.fingerprint)
        lines.append(f"## {name}")
        lines.append("")
        lines.append(
            f"Namespace `{sv.raw.get('namespace', '')}`; latest released version: "
            f"v{released.version if released else '-'}. Fingerprint: wire bytes `{wire}`; "
            f"value `{value}` (Java `long` `{signed}`)."
        )
        lines.append("")
        lines += _table(sv.raw, "###")
        seen = {sv.raw["name"]}
        for sub in _nested([f["type"] for f in sv.raw["fields"]]):
            if sub["name"] not in seen:
                seen.add(sub["name"])
                lines += _table(sub, "####")
    lines += _attributes()
    return "\n".join(lines).rstrip() + "\n"


def _attributes() -> list[str]:
    """The ``gpupipe.*`` field attributes: what they mean and which fields carry which value."""
    lines = [
        "## Field attributes",
        "",
        "Some fields carry `gpupipe.*` attributes: Avro keeps and ignores them (fingerprints do not",
        "change), and the code reads them instead of restating field lists by hand:",
        "`python -m gpupipe_schemas.codegen` turns each value into a tuple of field names in",
        "`schemas/records.py`. An attribute not listed here fails the generator.",
        "",
        "| attribute | meaning |",
        "|---|---|",
        *(f"| `{key}` | {meaning} |" for key, meaning in groups.ATTRIBUTES.items()),
        "",
        "| group (`gpupipe_schemas.records`) | record | attribute = value | fields |",
        "|---|---|---|---|",
    ]
    seen: set[str] = set()
    for name in catalog.available_names():
        for rec in groups.records(catalog.current(name).raw):
            if rec["name"] in seen:
                continue
            seen.add(rec["name"])
            for (key, value), fields in groups.field_groups(rec).items():
                const = groups.group_name(rec["name"], key, value)
                names = ", ".join(f"`{f}`" for f in fields)
                lines.append(f"| `{const}` | {rec['name']} | `{key}` = `{value}` | {names} |")
    lines.append("")
    return lines


if __name__ == "__main__":
    sys.stdout.write(render_markdown())
