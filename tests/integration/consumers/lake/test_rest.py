"""The lake through a real Iceberg REST catalog server (Iceberg's own, scripts/iceberg-rest-local):
the writer's commits carry their offsets through the REST commit, a new writer resumes from them,
and `gpupipe lake query` reads the rows, configured by pyiceberg properties only."""

from __future__ import annotations

import argparse
import csv
import io
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from gpupipe_consumers.lake import catalog as lake_catalog
from gpupipe_consumers.lake.tables import BY_NAME
from gpupipe_consumers.lake.writer import LakeWriter, open_table, stored_offsets
from gpupipe_consumers.plumbing.consume_loop import InRecord
from tests.integration.kafka_util import GPUPIPE
from tests.lake_records import end_pyiceberg_threads, fill
from tests.lake_rest import rest_catalog_server

pytestmark = pytest.mark.integration

TOPIC = "gpu.xid.v1"
SPEC = BY_NAME["xid_events"]


@pytest.fixture(autouse=True)
def _pool() -> Iterator[None]:
    yield
    end_pyiceberg_threads()


@pytest.fixture
def rest(tmp_path: Path) -> Iterator[str]:
    with rest_catalog_server(tmp_path) as url:
        yield url


def args_for(url: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    lake_catalog.add_arguments(p)
    return p.parse_args(["--catalog-property", "type=rest", "--catalog-property", f"uri={url}"])


def xids(first: int, n: int, partition: int) -> list[InRecord]:
    ts = 1_790_000_000_000
    return [
        InRecord(
            TOPIC,
            partition,
            i,
            None,
            "XidEvent",
            fill("XidEvent", event_id=f"e{partition}-{i}", timestamp_ms=ts + i),
            ts,
        )
        for i in range(first, first + n)
    ]


def test_writer_and_query_through_a_rest_catalog(rest: str, tmp_path: Path) -> None:
    cat = lake_catalog.open_catalog(args_for(rest))
    assert type(cat).__name__ == "RestCatalog"
    w = LakeWriter({TOPIC: (SPEC, open_table(cat, "gpupipe", SPEC))}, CollectorRegistry())
    assert w.resume([(TOPIC, 0), (TOPIC, 1)]) == {}
    w.handle(xids(0, 40, 0) + xids(0, 25, 1))
    w.flush()
    w.handle(xids(40, 10, 0))
    w.flush()
    assert w.commits == 2

    # A new writer with a new catalog client resumes from what the REST commits carried.
    again = lake_catalog.open_catalog(args_for(rest))
    table = again.load_table(("gpupipe", "xid_events"))
    assert stored_offsets(table, TOPIC) == {0: 50, 1: 25}
    w2 = LakeWriter({TOPIC: (SPEC, table)}, CollectorRegistry())
    assert w2.resume([(TOPIC, 0), (TOPIC, 1)]) == {(TOPIC, 0): 50, (TOPIC, 1): 25}

    # The analyst's CLI, configured by pyiceberg's environment convention alone.
    env = {
        **os.environ,
        "PYICEBERG_CATALOG__GPUPIPE__TYPE": "rest",
        "PYICEBERG_CATALOG__GPUPIPE__URI": rest,
    }
    out = subprocess.run(
        [*GPUPIPE, "lake", "query", "SELECT count(DISTINCT event_id) AS n, count(*) AS rows FROM xid_events"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        env=env,
    )
    assert out.returncode == 0, out.stderr
    assert next(csv.DictReader(io.StringIO(out.stdout))) == {"n": "75", "rows": "75"}
    assert not (tmp_path / "lake").exists(), "no local default catalog was created"
