"""The ChargebackWindow contract, and the engine's records and inputs against the Avro schemas."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gpupipe.domain.prices import parse_price_table
from gpupipe_consumers.chargeback.errors import ChargebackConfigError
from gpupipe_consumers.chargeback.settings import (
    SAMPLE_FIELDS,
    ChargebackSettings,
    build_engine,
    projected_sample_schema,
)
from gpupipe_schemas import catalog
from gpupipe_schemas.codec import AvroCodec
from tests.synthetic_fleet import FleetSpec, generate_fleet

SCHEMAS = Path(catalog.__file__).resolve().parent


def _fields(schema: dict) -> list[dict]:
    out = []
    for f in schema["fields"]:
        out.append(f)
        for t in f["type"] if isinstance(f["type"], list) else [f["type"]]:
            if isinstance(t, dict) and t.get("type") == "record":
                out += _fields(t)
    return out


def test_current_is_released_v1_plus_defaulted_fields_at_the_end():
    current = json.loads((SCHEMAS / "ChargebackWindow.avsc").read_text())
    released = json.loads((SCHEMAS / "released" / "ChargebackWindow.v1.avsc").read_text())
    n = len(released["fields"])
    assert {k: v for k, v in current.items() if k != "fields"} == {
        k: v for k, v in released.items() if k != "fields"
    }
    assert current["fields"][:n] == released["fields"]
    added = current["fields"][n:]
    assert [f["name"] for f in added] == [
        "workloads",
        "record_id",
        "late_offsets",
    ]  # the idempotency key and what a correction sums
    assert all("default" in f for f in added)


def test_every_field_is_documented_and_timestamps_are_millis():
    raw = catalog.current("ChargebackWindow").raw
    assert raw["namespace"] == "gpupipe.v1" and raw["doc"]
    for f in _fields(raw):
        assert f.get("doc"), f["name"]
        if f["name"].endswith("_ms"):
            assert f["type"] == {"type": "long", "logicalType": "timestamp-millis"}, f["name"]
        if isinstance(f["type"], list) and "null" in f["type"]:
            assert f["type"][0] == "null" and "default" in f, f["name"]


def _run_fleet() -> list[dict]:
    prices = parse_price_table(
        {
            "currency": "EUR",
            "energy_per_kwh": 0.3,
            "default_per_gpu_hour": 2.0,
            "models": [{"match": "NVIDIA H*", "per_gpu_hour": 3.0}],
        }
    )
    eng = build_engine(
        ChargebackSettings(), prices, "cb-0", team_of=lambda ns: None if ns.startswith("_") else "t"
    )
    for r in generate_fleet(FleetSpec(gpus=10, hours=1.2)):
        eng.add(r.sample, r.partition, r.offset)
    return eng.flush_all()


def test_engine_records_have_exactly_the_schema_fields_and_round_trip():
    records = _run_fleet()
    names = [f["name"] for f in catalog.current("ChargebackWindow").raw["fields"]]
    codec = AvroCodec()
    enc = codec.encoder("ChargebackWindow")
    assert {r["price_source"] for r in records} >= {"pattern", "default"}
    for rec in records:
        assert list(rec) == names
        decoded = codec.decode(enc.encode(rec))
        assert decoded.name == "ChargebackWindow"
        assert decoded.record == rec


def test_projected_sample_schema_decodes_what_accounting_needs():
    raw = catalog.current("GpuSample").raw
    projected = projected_sample_schema(raw)
    assert [f["name"] for f in projected["fields"]] == [
        n for n in (f["name"] for f in raw["fields"]) if n in SAMPLE_FIELDS
    ]
    codec = AvroCodec(reader_schemas={"GpuSample": projected})
    enc = AvroCodec().encoder("GpuSample")
    fleet = generate_fleet(FleetSpec(gpus=10, hours=0.2))
    plain, projected_run = (
        build_engine(ChargebackSettings(), parse_price_table({}), "a"),
        build_engine(ChargebackSettings(), parse_price_table({}), "a"),
    )
    for r in fleet:
        rec = codec.decode(enc.encode(r.sample)).record
        assert set(rec) == set(SAMPLE_FIELDS)
        projected_run.add(rec, r.partition, r.offset)
        plain.add(r.sample, r.partition, r.offset)
    assert projected_run.flush_all() == plain.flush_all()


def test_projection_fails_early_when_a_field_is_missing():
    raw = catalog.current("GpuSample").raw
    broken = dict(raw, fields=[f for f in raw["fields"] if f["name"] != "power_w"])
    with pytest.raises(ChargebackConfigError, match="power_w"):
        projected_sample_schema(broken)
