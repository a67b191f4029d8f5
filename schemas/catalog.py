"""The schema files of the contract, loaded once.

Current schemas are `schemas/<Name>.avsc`; every released version stays under
`schemas/released/<Name>.v<N>.avsc` so that (a) decoders still recognise records
written by older producers (their fingerprints resolve to the old writer schema)
and (b) the compatibility test can compare the current schema to the last release.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cache
from importlib import resources
from typing import Any, cast

from fastavro import parse_schema
from fastavro.schema import fingerprint, to_parsing_canonical_form

from gpupipe_schemas.errors import SchemaError

RECORD_NAMES = ("GpuSample", "XidEvent", "ChargebackWindow", "GpuAlert", "GpuRecommendation", "GpuTopology")
_RELEASED = re.compile(r"^(?P<name>[A-Za-z]+)\.v(?P<version>\d+)\.avsc$")


@dataclass(frozen=True, slots=True)
class SchemaVersion:
    """One schema text with what a codec needs to use it."""

    name: str
    version: int | None  # None for the current (unreleased or latest) file
    raw: dict[str, Any]
    parsed: dict[str, Any]
    fingerprint: bytes  # CRC-64-AVRO of the canonical form, little-endian (single-object header)

    @property
    def text(self) -> str:
        return json.dumps(self.raw)


def strip_logical_types(node: Any) -> Any:
    """Drop ``logicalType`` annotations so fastavro hands back plain ints.

    Timestamps stay integer milliseconds end to end: converting every one to a
    ``datetime`` and back would cost more than decoding the rest of the record,
    and the canonical form (hence the fingerprint) ignores logical types anyway.
    """
    if isinstance(node, dict):
        return {k: strip_logical_types(v) for k, v in node.items() if k != "logicalType"}
    if isinstance(node, list):
        return [strip_logical_types(v) for v in node]
    return node


def parsed_schema(raw: Mapping[str, Any]) -> dict[str, Any]:
    """fastavro's parsed form of a record schema, logical types dropped (see above)."""
    return cast(dict[str, Any], parse_schema(strip_logical_types(raw)))


def _load(name: str, version: int | None, text: str) -> SchemaVersion:
    try:
        raw = json.loads(text)
        if not isinstance(raw, dict):
            raise TypeError("not a JSON object")
        parsed = parsed_schema(raw)
        pcf = to_parsing_canonical_form(parsed)
        fp = bytes.fromhex(fingerprint(pcf, "CRC-64-AVRO"))
    except Exception as exc:  # fastavro raises several unrelated types
        raise SchemaError(f"schema {name} (version {version or 'current'}) is invalid: {exc}") from exc
    return SchemaVersion(name, version, raw, parsed, fp)


@cache
def current(name: str) -> SchemaVersion:
    """The schema producers write today."""
    try:
        text = resources.files("gpupipe_schemas").joinpath(f"{name}.avsc").read_text()
    except FileNotFoundError as exc:
        raise SchemaError(f"no schema file for {name}") from exc
    return _load(name, None, text)


@cache
def released() -> tuple[SchemaVersion, ...]:
    """Every released schema version shipped with the package, oldest first."""
    folder = resources.files("gpupipe_schemas").joinpath("released")
    out = []
    for entry in folder.iterdir():
        m = _RELEASED.match(entry.name)
        if m:
            out.append(_load(m["name"], int(m["version"]), entry.read_text()))
    return tuple(sorted(out, key=lambda s: (s.name, s.version or 0)))


def latest_released(name: str) -> SchemaVersion | None:
    versions = [s for s in released() if s.name == name]
    return versions[-1] if versions else None


def available_names() -> tuple[str, ...]:
    """Record names with a current schema file (later issues add ChargebackWindow, GpuAlert)."""
    folder = resources.files("gpupipe_schemas")
    return tuple(n for n in RECORD_NAMES if folder.joinpath(f"{n}.avsc").is_file())
