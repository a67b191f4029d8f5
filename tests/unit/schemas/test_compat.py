"""Every schema stays backward and forward compatible with its last released version.

Backward: today's reader reads records the released writer wrote. Forward: the
released reader (a data-platform job not yet upgraded) reads today's records.
Checked by actually resolving records both ways with fastavro, plus the static
rules we promise in docs/topics.md (fields only added with defaults, never removed,
renamed or retyped; every field documented).
"""

import io
import json
from pathlib import Path

import pytest
from fastavro import parse_schema, schemaless_reader, schemaless_writer
from fastavro.validation import validate

from gpupipe_producer.simulated.fleet import FleetConfig, SimulatedFleet
from gpupipe_schemas import catalog

SCHEMAS = Path(catalog.__file__).parent
NAMES = catalog.available_names()


def _roundtrip(record: dict, writer: dict, reader: dict) -> dict:
    buf = io.BytesIO()
    schemaless_writer(buf, writer, record)
    buf.seek(0)
    return schemaless_reader(buf, writer, reader)


def _records(name: str) -> list[dict]:
    fleet = SimulatedFleet(FleetConfig(nodes=16, gpus_per_node=8, seed=11, xid_rate_per_gpu_hour=3600))
    samples, xids = fleet.tick(1_795_000_000_000)
    return {"GpuSample": samples, "XidEvent": xids}.get(name, [])


def _fields(schema: dict) -> dict[str, dict]:
    return {f["name"]: f for f in schema["fields"]}


@pytest.mark.parametrize("name", NAMES)
def test_has_released_version(name: str) -> None:
    assert catalog.latest_released(name) is not None, f"{name} has no released copy under schemas/released/"


@pytest.mark.parametrize("name", NAMES)
def test_every_field_documented(name: str) -> None:
    def walk(node: object) -> None:
        if isinstance(node, dict):
            if node.get("type") == "record":
                assert node.get("doc"), f"record {node['name']} lacks a doc"
                for f in node["fields"]:
                    assert f.get("doc"), f"{name}.{f['name']} lacks a doc"
                    walk(f["type"])
            elif node.get("type") in ("array", "map"):
                walk(node.get("items") or node.get("values"))
        elif isinstance(node, list):
            for x in node:
                walk(x)

    walk(catalog.current(name).raw)


@pytest.mark.parametrize("name", NAMES)
def test_static_evolution_rules(name: str) -> None:
    old = _fields(catalog.latest_released(name).raw)
    new = _fields(catalog.current(name).raw)
    for fname, f in old.items():
        assert fname in new, f"{name}.{fname} was removed or renamed"
        assert json.dumps(catalog.strip_logical_types(new[fname]["type"]), sort_keys=True) == json.dumps(
            catalog.strip_logical_types(f["type"]), sort_keys=True
        ) or _only_added_symbols(f["type"], new[fname]["type"]), f"{name}.{fname} changed type"
    for fname in new.keys() - old.keys():
        assert "default" in new[fname], f"new field {name}.{fname} needs a default"


def _only_added_symbols(old: object, new: object) -> bool:
    """Compatible growth at any depth (unions, arrays, nested records): an enum that only gained
    symbols (with a default), a record that kept its fields in place and only appended fields with
    defaults, and changed doc strings."""
    if isinstance(old, dict) and isinstance(new, dict):
        if old.get("type") == "enum":
            return (
                new.get("type") == "enum" and set(old["symbols"]) <= set(new["symbols"]) and "default" in new
            )
        if old.get("type") == "record":
            if (
                new.get("type") != "record"
                or old.get("name") != new.get("name")
                or len(new["fields"]) < len(old["fields"])
            ):
                return False
            kept = all(
                o["name"] == n["name"] and _same_or_grown(o["type"], n["type"])
                for o, n in zip(old["fields"], new["fields"], strict=False)
            )
            return kept and all("default" in f for f in new["fields"][len(old["fields"]) :])
        keys = (old.keys() | new.keys()) - {"doc"}
        return all(
            _same_or_grown(old.get(k), new.get(k))
            if isinstance(old.get(k), (dict, list))
            else old.get(k) == new.get(k)
            for k in keys
        )
    if isinstance(old, list) and isinstance(new, list):
        return len(old) == len(new) and all(_same_or_grown(o, n) for o, n in zip(old, new, strict=True))
    return old == new


def _same_or_grown(old: object, new: object) -> bool:
    same = json.dumps(catalog.strip_logical_types(old), sort_keys=True) == json.dumps(
        catalog.strip_logical_types(new), sort_keys=True
    )
    return same or _only_added_symbols(old, new)


@pytest.mark.parametrize("name", NAMES)
def test_resolves_both_ways(name: str) -> None:
    released = catalog.latest_released(name)
    cur = catalog.current(name)
    old_parsed = parse_schema(catalog.strip_logical_types(released.raw))
    for rec in _records(name):
        assert validate(rec, cur.parsed)
        # forward: an old reader reads a new record
        old_view = _roundtrip(rec, cur.parsed, old_parsed)
        # backward: a new reader reads what the old writer wrote
        new_view = _roundtrip(old_view, old_parsed, cur.parsed)
        for k, v in old_view.items():
            assert _keeps(v, new_view[k]), k


def _keeps(old: object, new: object) -> bool:
    """``new`` holds every value of ``old`` (nested records may have gained defaulted fields)."""
    if isinstance(old, dict) and isinstance(new, dict):
        return all(k in new and _keeps(v, new[k]) for k, v in old.items())
    if isinstance(old, list) and isinstance(new, list):
        return len(old) == len(new) and all(_keeps(a, b) for a, b in zip(old, new, strict=True))
    return old == new


def test_released_files_are_named_and_parse() -> None:
    files = sorted(p.name for p in (SCHEMAS / "released").glob("*.avsc"))
    assert files, "no released schemas"
    assert {s.name for s in catalog.released()} >= set(NAMES)


@pytest.mark.parametrize("name", ["GpuSample", "XidEvent"])
def test_records_written_before_the_vendor_field_read_as_nvidia(name: str) -> None:
    released = catalog.latest_released(name)
    assert "vendor" not in {f["name"] for f in released.raw["fields"]}
    old_parsed = parse_schema(catalog.strip_logical_types(released.raw))
    rec = _records(name)[0]
    old_view = _roundtrip(rec, catalog.current(name).parsed, old_parsed)
    assert "vendor" not in old_view
    assert _roundtrip(old_view, old_parsed, catalog.current(name).parsed)["vendor"] == "nvidia"
