"""Iceberg's own REST catalog server for the lake's tests (scripts/iceberg-rest-local), one per test:
with a file warehouse, or with an s3:// warehouse on a local S3 store (tests/lake_s3.py)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from tests import hygiene
from tests.conftest import free_port
from tests.lake_s3 import BUCKET, REGION, S3Store

REPO = Path(__file__).resolve().parents[1]


@contextlib.contextmanager
def rest_catalog_server(tmp: Path, s3: S3Store | None = None) -> Iterator[str]:
    """The server's URL: a JdbcCatalog on SQLite and a file warehouse under ``tmp``, on a free port.

    With ``s3`` the warehouse is ``s3://BUCKET/wh`` on that S3-compatible store instead,
    read and written by Iceberg's S3FileIO with path-style requests (what MinIO, Ceph and moto
    serve), the credentials in the server's environment as the AWS SDK reads them."""
    cp = subprocess.run(
        [str(REPO / "scripts" / "iceberg-rest-local")],
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
    ).stdout.splitlines()[-1]
    port = free_port()
    env = {
        **os.environ,
        "CATALOG_REST_PORT": str(port),
        "CATALOG_URI": f"jdbc:sqlite:{tmp}/rest.db",
    }
    if s3 is None:
        (tmp / "rest-wh").mkdir()
        env["CATALOG_WAREHOUSE"] = (tmp / "rest-wh").as_uri()
    else:
        env.update(
            CATALOG_WAREHOUSE=f"s3://{BUCKET}/wh",
            CATALOG_IO__IMPL="org.apache.iceberg.aws.s3.S3FileIO",
            CATALOG_S3_ENDPOINT=s3.url,
            CATALOG_S3_PATH__STYLE__ACCESS="true",
            AWS_REGION=REGION,
            AWS_ACCESS_KEY_ID=s3.key_id,
            AWS_SECRET_ACCESS_KEY=s3.secret,
        )
    log = open(tmp / "rest.log", "w")  # noqa: SIM115 (owned by the process' lifetime)
    proc = hygiene.popen(
        ["java", "-Xmx256m", "-cp", cp, "org.apache.iceberg.rest.RESTCatalogServer"],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                urllib.request.urlopen(url + "/v1/config", timeout=2).close()
                break
            except OSError:
                assert proc.poll() is None, (tmp / "rest.log").read_text()[-3000:]
                assert time.monotonic() < deadline, "the REST catalog did not answer in 120 s"
                time.sleep(0.2)
        yield url
    finally:
        hygiene.stop_group(proc)
        log.close()
