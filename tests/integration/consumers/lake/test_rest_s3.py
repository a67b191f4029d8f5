"""The lake's production path end to end: Apache Iceberg's own REST catalog server whose warehouse
is an s3:// bucket on a local S3-compatible store (moto in server mode), the lake writer committing
through it, `gpupipe lake query` (DuckDB) and the shipped Spark recipe reading the same tables back
with the numbers chargeback billed.

Each side gets its S3 credentials the way production does, never on argv: the REST server from its
environment (the AWS SDK's chain), the writer from a catalog properties file, the CLI from the
AWS SDK's environment variables and from pyiceberg's environment convention, Spark from the AWS
SDK's environment variables. The store checks every signature against the key it issued, so a
side that did not get the credentials fails."""

from __future__ import annotations

import argparse
import csv
import io
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from botocore.exceptions import ClientError

from gpupipe_consumers.lake import catalog as lake_catalog
from tests.integration.kafka_util import GPUPIPE
from tests.lake_chargeback import assert_duckdb_agrees, assert_spark_agrees, build_lake
from tests.lake_records import end_pyiceberg_threads
from tests.lake_rest import rest_catalog_server
from tests.lake_s3 import BUCKET, REGION, S3Store, moto_server, object_keys, s3_client

pytestmark = pytest.mark.integration


@pytest.fixture(autouse=True)
def _pool() -> Iterator[None]:
    yield
    end_pyiceberg_threads()


@pytest.fixture
def rest_s3(tmp_path: Path) -> Iterator[tuple[S3Store, str]]:
    """(the S3 store, the REST catalog's URL): the catalog's warehouse is s3://BUCKET/wh."""
    with moto_server(tmp_path) as s3, rest_catalog_server(tmp_path, s3) as url:
        yield s3, url


def lake_files(root: Path) -> list[Path]:
    """Iceberg data and metadata files under ``root``: none may land on local disk."""
    return [p for pat in ("*.parquet", "*.avro", "*.metadata.json") for p in root.rglob(pat)]


def test_lake_on_a_rest_catalog_with_an_s3_warehouse(rest_s3: tuple[S3Store, str], tmp_path: Path) -> None:
    s3, url = rest_s3
    # No AWS or pyiceberg settings of this machine leak into the readers below.
    base = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "PYICEBERG_"))}

    # The writer: the lake's catalog options, its secrets in the properties file. The REST
    # catalog names no storage endpoint to its clients, so the lake sets its own (non-secret).
    props = tmp_path / "lake-catalog.yaml"
    props.write_text(f"s3.access-key-id: {s3.key_id}\ns3.secret-access-key: {s3.secret}\n")
    argv = ["--catalog-properties-file", str(props)]
    for kv in ("type=rest", f"uri={url}", f"s3.endpoint={s3.url}", f"s3.region={REGION}"):
        argv += ["--catalog-property", kv]
    p = argparse.ArgumentParser()
    lake_catalog.add_arguments(p)
    cat = lake_catalog.open_catalog(p.parse_args(argv))
    assert type(cat).__name__ == "RestCatalog" and s3.secret not in " ".join(argv)
    written = build_lake(cat)

    # Every data file the tables reference is an object in the bucket (written by pyiceberg), the
    # metadata the REST server committed too (written by its S3FileIO); none on local disk.
    keys = set(object_keys(s3, prefix="wh/"))
    for name in written.rows:
        table = cat.load_table(("gpupipe", name))
        assert table.location() == f"s3://{BUCKET}/wh/gpupipe/{name}"
        assert table.metadata_location.removeprefix(f"s3://{BUCKET}/") in keys
        data = [t.file.file_path for t in table.scan().plan_files()]
        assert data and {f.removeprefix(f"s3://{BUCKET}/") for f in data} <= keys, data[:3]
    assert not lake_files(tmp_path)
    # The store checks signatures: the credentials each side got are what let it in.
    with pytest.raises(ClientError, match="InvalidAccessKeyId"):
        s3_client(s3, "not-the-key", "not-the-secret").list_objects_v2(Bucket=BUCKET)

    # DuckDB through the CLI, the catalog from pyiceberg's environment convention: the exact row
    # counts with the credentials as the AWS SDK reads them (pyarrow's fallback when no property
    # names any), then the engine's sums per namespace with them as pyiceberg properties.
    catalog_env = {
        **base,
        "PYICEBERG_CATALOG__GPUPIPE__TYPE": "rest",
        "PYICEBERG_CATALOG__GPUPIPE__URI": url,
        "PYICEBERG_CATALOG__GPUPIPE__S3__ENDPOINT": s3.url,
        "PYICEBERG_CATALOG__GPUPIPE__S3__REGION": REGION,
    }
    sql = (
        "SELECT (SELECT count(*) FROM samples) AS samples, "
        "(SELECT count(*) FROM chargeback_windows) AS chargeback_windows"
    )
    out = subprocess.run(
        [*GPUPIPE, "lake", "query", sql],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        env={**catalog_env, "AWS_ACCESS_KEY_ID": s3.key_id, "AWS_SECRET_ACCESS_KEY": s3.secret},
    )
    assert out.returncode == 0, out.stderr
    got = next(csv.DictReader(io.StringIO(out.stdout)))
    assert {k: int(v) for k, v in got.items()} == written.rows
    creds = {
        "PYICEBERG_CATALOG__GPUPIPE__S3__ACCESS_KEY_ID": s3.key_id,
        "PYICEBERG_CATALOG__GPUPIPE__S3__SECRET_ACCESS_KEY": s3.secret,
    }
    assert_duckdb_agrees(written.billed, [], {**catalog_env, **creds})

    # Spark: the recipe's REST catalog with S3FileIO pointed at the store on argv (no secret
    # there), the credentials from AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY as the SDK reads them.
    spark_flags = ["--catalog-uri", url]
    for kv in (f"s3.endpoint={s3.url}", "s3.path-style-access=true", f"client.region={REGION}"):
        spark_flags += ["--catalog-property", kv]
    spark_env = {**base, "AWS_ACCESS_KEY_ID": s3.key_id, "AWS_SECRET_ACCESS_KEY": s3.secret}
    assert_spark_agrees(written.billed, spark_flags, tmp_path, spark_env)
    assert not lake_files(tmp_path), "Spark read the tables from the bucket, nothing local"
