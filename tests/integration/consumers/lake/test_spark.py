"""Three readers of one lake agree: Apache Spark (the shipped recompute recipe, through Iceberg's
JdbcCatalog on the SQLite file pyiceberg writes, or through a REST catalog server), DuckDB
(`gpupipe lake query`) and the chargeback windows themselves; and Spark's recompute from the raw
samples matches what the chargeback engine billed from the same samples to 1e-9 relative.

No Kafka: the samples go through the real chargeback engine and, with the windows it closes, through
the real lake writer (tests/lake_chargeback.py). The same readers over a REST catalog with an S3
warehouse: test_rest_s3.py."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from pyiceberg.catalog import Catalog, load_catalog
from pyiceberg.catalog.sql import SqlCatalog

from tests.lake_chargeback import assert_duckdb_agrees, assert_spark_agrees, build_lake
from tests.lake_records import end_pyiceberg_threads
from tests.lake_rest import rest_catalog_server

pytestmark = pytest.mark.integration

#: (the catalog, the catalog flags of the recipe and the CLI, the CLI's extra environment)
Lake = tuple[Catalog, list[str], dict[str, str]]


@pytest.fixture(autouse=True)
def _pool() -> Iterator[None]:
    yield
    end_pyiceberg_threads()


@pytest.fixture(params=["sqlite", "rest"])
def lake(
    request: pytest.FixtureRequest, tmp_path: Path
) -> Iterator[tuple[Catalog, list[str], dict[str, str]]]:
    """The lake on the embedded SQLite catalog, or behind Iceberg's REST catalog server."""
    if request.param == "sqlite":
        (tmp_path / "warehouse").mkdir()
        uri = f"sqlite:///{tmp_path}/catalog.db"
        flags = ["--catalog-uri", uri, "--warehouse", str(tmp_path / "warehouse")]
        yield SqlCatalog("gpupipe", uri=uri, warehouse=(tmp_path / "warehouse").as_uri()), flags, {}
        return
    with rest_catalog_server(tmp_path) as url:
        env = {"PYICEBERG_CATALOG__GPUPIPE__TYPE": "rest", "PYICEBERG_CATALOG__GPUPIPE__URI": url}
        yield load_catalog("gpupipe", type="rest", uri=url), ["--catalog-uri", url], env


def test_spark_recompute_and_three_readers_agree(lake: Lake, tmp_path: Path) -> None:
    cat, flags, env = lake
    engine = build_lake(cat).billed
    assert {"__unallocated__", "__unattributed__"} <= set(engine)
    # Spark's recompute from the raw samples against what chargeback billed (Spark reading the
    # windows table, and the engine's own records).
    assert_spark_agrees(engine, flags, tmp_path)
    # DuckDB through the CLI, the same tables; REST: pyiceberg's environment alone.
    assert_duckdb_agrees(engine, flags if not env else [], {**os.environ, **env})
