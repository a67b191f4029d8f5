"""A table missing from the catalog: new, or lost with its catalog? A lost one stops the writer with
one line unless --rebuild-catalog, and a rebuild says what Kafka no longer holds."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from pyiceberg.catalog.sql import SqlCatalog

from gpupipe.common.errors import ConfigError
from gpupipe_consumers.lake.recovery import MissingTable, PartitionHistory, judge, leftover_metadata
from gpupipe_consumers.lake.tables import BY_NAME
from gpupipe_consumers.lake.writer import open_table
from tests.lake_records import end_pyiceberg_threads


@pytest.fixture(autouse=True)
def _pool() -> Iterator[None]:
    yield
    end_pyiceberg_threads()


def missing(*parts: PartitionHistory, leftover: str | None = None) -> MissingTable:
    return MissingTable("gpupipe.samples", "gpu.samples.v1", "gpupipe-lake", parts, leftover)


def test_a_table_nobody_wrote_is_new() -> None:
    fresh = missing(PartitionHistory(0, None, 0), PartitionHistory(1, None, 500))
    assert judge([fresh], "gpupipe", rebuild=False) == []


def test_a_table_the_group_wrote_is_refused_in_one_line_naming_what_kafka_lost() -> None:
    lost = missing(PartitionHistory(0, 5000, 1200), PartitionHistory(1, 4000, 0))
    with pytest.raises(ConfigError) as exc:
        judge([lost], "gpupipe", rebuild=False)
    line = str(exc.value)
    assert "\n" not in line
    assert "gpupipe.samples" in line and "consumer group gpupipe-lake" in line
    assert "--rebuild-catalog" in line
    assert "gpu.samples.v1[0] offsets 0 to 1199 (group at 5000)" in line
    assert judge([lost], "gpupipe", rebuild=True) == [
        ("gpupipe.samples", "gpu.samples.v1[0] offsets 0 to 1199 (group at 5000)")
    ]


def test_a_rebuild_with_everything_still_in_kafka_says_so() -> None:
    lost = missing(PartitionHistory(0, 10, 0))
    assert judge([lost], "gpupipe", rebuild=True) == [
        ("gpupipe.samples", "nothing (Kafka still holds gpu.samples.v1 from offset 0)")
    ]


def test_a_deleted_sqlite_catalog_is_seen_in_the_warehouse(tmp_path: Path) -> None:
    """The review's case: catalog.db deleted, the writer restarted under a new group id."""
    wh = tmp_path / "wh"
    wh.mkdir()
    cat = SqlCatalog("gpupipe", uri=f"sqlite:///{tmp_path}/c.db", warehouse=wh.as_uri())
    assert leftover_metadata(wh.as_uri(), "gpupipe", "samples") is None
    table = open_table(cat, "gpupipe", BY_NAME["samples"])
    (tmp_path / "c.db").unlink()
    found = leftover_metadata(wh.as_uri(), "gpupipe", "samples")
    assert found == table.metadata_location.removeprefix("file://")
    assert leftover_metadata(str(wh), "gpupipe", "samples") == found  # a plain path too
    assert leftover_metadata("s3://bucket/wh", "gpupipe", "samples") is None
    with pytest.raises(ConfigError, match="the warehouse still holds its metadata"):
        judge([missing(PartitionHistory(0, None, 0), leftover=found)], "gpupipe", rebuild=False)
