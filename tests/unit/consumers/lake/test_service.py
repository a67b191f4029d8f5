"""The lake service's /healthz while Iceberg commits fail (a full disk, a catalog down): it answers
503 with the commit's error at once, never waiting for the writer that is retrying the commit."""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pyarrow as pa
import pytest
from prometheus_client import CollectorRegistry
from pyiceberg.catalog.sql import SqlCatalog

from gpupipe.web.server import HttpServer
from gpupipe_consumers.lake.service import LakeService
from gpupipe_consumers.lake.tables import BY_NAME
from gpupipe_consumers.lake.writer import LakeWriter, open_table
from gpupipe_consumers.plumbing.consume_loop import InRecord
from tests.lake_records import end_pyiceberg_threads, fill

TOPIC = "gpu.xid.v1"
#: A kubelet probe's timeoutSeconds is 1 s by default; 5 s leaves room for a loaded test machine.
PROBE_DEADLINE_S = 5.0


@pytest.fixture(autouse=True)
def _pool() -> Iterator[None]:
    yield
    end_pyiceberg_threads()


class DiskFull:
    """A table whose every append fails as a full warehouse disk does (nothing lands)."""

    def __init__(self, table: Any) -> None:
        self.table = table

    def append(self, data: pa.Table, snapshot_properties: dict[str, str]) -> None:
        raise OSError(28, "No space left on device")

    def refresh(self) -> Any:
        return self

    def __getattr__(self, name: str) -> Any:
        return getattr(self.table, name)


def test_healthz_answers_503_with_the_error_while_a_commit_is_retried(tmp_path: Path) -> None:
    (tmp_path / "wh").mkdir()
    cat = SqlCatalog("t", uri=f"sqlite:///{tmp_path}/c.db", warehouse=(tmp_path / "wh").as_uri())
    spec = BY_NAME["xid_events"]
    w = LakeWriter({TOPIC: (spec, open_table(cat, "gpupipe", spec))}, CollectorRegistry(), flush_rows=2)
    w.retry_s = 0.05
    w.tables[TOPIC] = (spec, DiskFull(w.tables[TOPIC][1]))  # type: ignore[assignment]
    loop = SimpleNamespace(healthy=True, health_detail=dict)
    app = LakeService(w, loop, CollectorRegistry())  # type: ignore[arg-type]
    recs = [InRecord(TOPIC, 0, i, None, "XidEvent", fill("XidEvent", event_id=f"e{i}"), 1) for i in range(2)]
    # the consume loop's thread: handle() reaches flush_rows and retries the commit until stopped
    writing = threading.Thread(target=w.handle, args=(recs,), daemon=True)
    http = HttpServer("127.0.0.1:0", service="lake", health=app.health).start()
    try:
        writing.start()
        deadline = time.monotonic() + 30
        while w.failing is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert w.failing is not None, "the commit never failed"
        began = time.monotonic()
        with pytest.raises(urllib.error.HTTPError) as got:
            urllib.request.urlopen(f"http://127.0.0.1:{http.port}/healthz", timeout=PROBE_DEADLINE_S)
        took = time.monotonic() - began
        assert got.value.code == 503
        body = json.loads(got.value.read())
        assert "No space left on device" in body["commit_failing"]
        assert body["rows_buffered"] == 2 and body["rows_written"] == 0
        assert took < PROBE_DEADLINE_S
    finally:
        w.stop.set()
        writing.join(10)
        http.close()
    assert not writing.is_alive() and w.buffered == 2, (
        "stopped without committing: read again after a restart"
    )
