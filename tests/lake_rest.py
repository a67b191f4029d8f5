"""Iceberg's own REST catalog server for the lake's tests (scripts/iceberg-rest-local), one per test."""

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

REPO = Path(__file__).resolve().parents[1]


@contextlib.contextmanager
def rest_catalog_server(tmp: Path) -> Iterator[str]:
    """The server's URL: a JdbcCatalog on SQLite and a file warehouse under ``tmp``, on a free port."""
    cp = subprocess.run(
        [str(REPO / "scripts" / "iceberg-rest-local")],
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
    ).stdout.splitlines()[-1]
    port = free_port()
    (tmp / "rest-wh").mkdir()
    env = {
        **os.environ,
        "CATALOG_REST_PORT": str(port),
        "CATALOG_WAREHOUSE": (tmp / "rest-wh").as_uri(),
        "CATALOG_URI": f"jdbc:sqlite:{tmp}/rest.db",
    }
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
