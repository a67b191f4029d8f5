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


def render_markdown() -> str:
    lines = [
        "# gpupipe topic schemas",
        "",
        "Generated from `schemas/*.avsc` by `python -m gpupipe_schemas.docs`; do not edit by hand.",
        "Values are Avro single-object encoded (`C3 01` + 8-byte CRC-64-AVRO fingerprint) or, with a schema",
        "registry, Confluent-framed (`00` + 4-byte id). Fields are only ever added with defaults.",
        "",
    ]
    for name in catalog.available_names():
        sv = catalog.current(name)
        released = catalog.latest_released(name)
        lines.append(f"## {name}")
        lines.append("")
        lines.append(
            f"Namespace `{sv.raw.get('namespace', '')}`; fingerprint `{sv.fingerprint.hex()}`; "
            f"latest released version: v{released.version if released else '-'}."
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
