"""Avro -> Arrow/Iceberg mapping of the lake tables: pure, from the schema files."""

from __future__ import annotations

import argparse
from datetime import UTC, datetime
from pathlib import Path

import pyarrow as pa
import pytest

from gpupipe_consumers.lake import catalog as lake_catalog
from gpupipe_consumers.lake.arrow import (
    BUILD_TS,
    KAFKA_COLUMNS,
    STORE_TS,
    arrow_schema,
    arrow_type,
    build_schema,
    storage_schema,
    to_arrow,
)
from gpupipe_consumers.lake.docs import iceberg_type, render
from gpupipe_consumers.lake.query import quarter_before
from gpupipe_consumers.lake.tables import TABLES
from gpupipe_producer.simulated.fleet import FleetConfig, SimulatedFleet
from gpupipe_schemas import catalog
from tests.lake_records import fill
from tests.paths import REPO

REPO = REPO


@pytest.mark.parametrize("spec", TABLES, ids=lambda t: t.name)
def test_columns_are_the_avro_fields_in_order_then_kafka(spec) -> None:
    avro = [f["name"] for f in catalog.current(spec.record).raw["fields"]]
    store = storage_schema(spec)
    assert store.names == [*avro, *(n for n, _ in KAFKA_COLUMNS)]
    assert all(f.nullable for f in store), "every column optional: added Avro fields must fit old rows"
    for col, _ in spec.partition:
        assert col in store.names
    for col in spec.key:
        assert col in store.names


def test_types_map_as_documented() -> None:
    store = storage_schema(next(t for t in TABLES if t.name == "alerts"))
    assert store.field("emitted_at_ms").type == STORE_TS  # timestamp-millis -> timestamptz (us)
    assert store.field("resolved_at_ms").type == STORE_TS  # [null, timestamp-millis]
    assert store.field("status").type == pa.string()  # enum
    assert store.field("nvidia_action").type == pa.string()  # enum referenced by name
    assert store.field("sequence").type == pa.int64()
    assert store.field("xid_codes").type == pa.list_(pa.int32())
    assert pa.types.is_struct(store.field("remediation").type)
    assert iceberg_type(store.field("emitted_at_ms").type) == "timestamptz"


def test_arrow_type_of_each_avro_kind() -> None:
    assert arrow_type({"type": "map", "values": "long"}, {}) == pa.map_(pa.string(), pa.int64())
    assert arrow_type({"type": "fixed", "name": "F", "size": 4}, {}) == pa.binary(4)
    assert arrow_type(["null", "double"], {}) == pa.float64()
    assert arrow_type({"type": "long", "logicalType": "timestamp-millis"}, {}) == BUILD_TS
    with pytest.raises(ValueError, match="unions"):
        arrow_type(["null", "int", "string"], {})
    with pytest.raises(ValueError, match="unsupported"):
        arrow_type("Nowhere", {})


def test_a_field_added_to_the_avro_schema_is_a_column() -> None:
    raw = catalog.current("XidEvent").raw
    grown = {
        **raw,
        "fields": [*raw["fields"], {"name": "new_one", "type": ["null", "string"], "default": None}],
    }
    assert "new_one" in arrow_schema(grown).names


def test_samples_convert_with_exact_timestamps() -> None:
    spec = next(t for t in TABLES if t.name == "samples")
    samples, _ = SimulatedFleet(FleetConfig(nodes=2, gpus_per_node=4)).tick(1_795_000_000_123)
    rows = [
        {**s, "_kafka_partition": 3, "_kafka_offset": i, "_kafka_timestamp": 1_795_000_000_999}
        for i, s in enumerate(samples)
    ]
    table = to_arrow(rows, build_schema(spec), storage_schema(spec))
    assert table.num_rows == len(samples)
    micros = table.column("timestamp_ms").cast(pa.int64()).to_pylist()
    assert micros == [1_795_000_000_123_000] * len(samples)
    assert table.column("uuid").to_pylist() == [s["uuid"] for s in samples]
    held = next(i for i, s in enumerate(samples) if s["allocations"])
    got, want = table.column("allocations").to_pylist()[held][0], samples[held]["allocations"][0]
    assert got["namespace"] == want["namespace"]
    assert dict(got["labels"]) == want["labels"]  # Avro map -> Iceberg map (Arrow: key/value pairs)


@pytest.mark.parametrize("spec", TABLES, ids=lambda t: t.name)
def test_every_record_type_converts(spec) -> None:
    row = {**fill(spec.record), "_kafka_partition": 0, "_kafka_offset": 7, "_kafka_timestamp": 1}
    table = to_arrow([row], build_schema(spec), storage_schema(spec))
    assert table.schema == storage_schema(spec)
    assert table.column("_kafka_offset").to_pylist() == [7]


def test_docs_are_generated_from_the_schemas() -> None:
    committed = (REPO / "docs" / "lake-tables.md").read_text()
    assert committed == render(), "run: python -m gpupipe_consumers.lake.docs > docs/lake-tables.md"


def test_last_quarter_is_the_calendar_quarter_before() -> None:
    assert quarter_before(datetime(2026, 5, 17, tzinfo=UTC)) == (
        datetime(2026, 1, 1, tzinfo=UTC),
        datetime(2026, 4, 1, tzinfo=UTC),
    )
    assert quarter_before(datetime(2026, 2, 1, tzinfo=UTC)) == (
        datetime(2025, 10, 1, tzinfo=UTC),
        datetime(2026, 1, 1, tzinfo=UTC),
    )


def _args(**kw: object) -> argparse.Namespace:
    base = dict(
        catalog_name="gpupipe",
        catalog_uri=None,
        warehouse=None,
        catalog_property=[],
        catalog_properties_file=None,
    )
    return argparse.Namespace(**{**base, **kw})


def test_catalog_defaults_to_sqlite_and_properties_win(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    props = lake_catalog.catalog_properties(_args(), configured={})
    assert props["type"] == "sql" and props["uri"] == lake_catalog.DEFAULT_URI
    assert props["warehouse"] == (tmp_path / "lake" / "warehouse").as_uri()
    f = tmp_path / "cat.yaml"
    f.write_text("type: rest\nuri: https://catalog.example\ns3.secret-access-key: from-file\n")
    props = lake_catalog.catalog_properties(
        _args(catalog_properties_file=str(f), catalog_property=["warehouse=s3://lake/gpupipe"]), configured={}
    )
    assert props == {
        "type": "rest",
        "uri": "https://catalog.example",
        "s3.secret-access-key": "from-file",
        "warehouse": "s3://lake/gpupipe",
    }
    # pyiceberg's own config for the name (env, ~/.pyiceberg.yaml) is not overridden by the default
    assert lake_catalog.catalog_properties(_args(), configured={"type": "rest", "uri": "https://x"}) == {}
