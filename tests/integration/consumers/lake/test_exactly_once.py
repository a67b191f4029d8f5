"""`gpupipe lake write` against a real broker and a real SQLite catalog: kill -9 twice mid-stream,
restart, and every record is in its table exactly once; then the readers answer from the tables."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import urllib.request
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import Producer
from pyiceberg.catalog.sql import SqlCatalog

from gpupipe.kafka_admin import ensure_topics
from gpupipe_consumers.lake.writer import stored_offsets
from gpupipe_producer.simulated.fleet import FleetConfig, SimulatedFleet
from gpupipe_schemas.codec import AvroCodec
from tests import hygiene
from tests.conftest import free_port
from tests.integration.kafka_util import GPUPIPE, REPO, gpupipe, read_all
from tests.lake_records import end_pyiceberg_threads, fill

pytestmark = pytest.mark.integration

KEYS = {
    "samples": ("uuid", "timestamp_ms"),
    "xid_events": ("event_id",),
    "alerts": ("alert_id", "sequence"),
    "chargeback_windows": ("record_id",),
}


@pytest.fixture(autouse=True)
def _pool() -> Iterator[None]:
    yield
    end_pyiceberg_threads()


def produce_all(kafka: str, prefix: str) -> dict[str, int]:
    """Records on all four topics (and one undecodable sample); how many of each table's rows to expect."""
    codec = AvroCodec()
    p = Producer({"bootstrap.servers": kafka, "linger.ms": 20, "enable.idempotence": True})
    now = int(time.time() * 1000)
    t0 = now - now % 1000 - 2 * 3_600_000
    fleet = SimulatedFleet(FleetConfig(nodes=16, gpus_per_node=8))
    enc = codec.encoder("GpuSample")
    n_samples = 0
    for i in range(40):
        samples, _ = fleet.tick(t0 + i * 1000)
        for s in samples:
            p.produce(prefix + "gpu.samples.v1", enc.encode(s), s["uuid"].encode())
            n_samples += 1
        if i == 20:
            p.produce(prefix + "gpu.samples.v1", b"\xc3\x01not-avro", b"bad")
        p.poll(0)
    xid, alert, window = (
        codec.encoder("XidEvent"),
        codec.encoder("GpuAlert"),
        codec.encoder("ChargebackWindow"),
    )
    for i in range(300):
        key = f"k{i % 17}".encode()
        p.produce(
            prefix + "gpu.xid.v1", xid.encode(fill("XidEvent", event_id=f"e{i}", timestamp_ms=t0 + i)), key
        )
        a = fill(
            "GpuAlert",
            alert_id=f"a{i // 3}",
            sequence=i % 3,
            emitted_at_ms=t0 + i,
            first_seen_ms=t0,
            last_seen_ms=t0 + i,
        )
        p.produce(prefix + "gpu.alerts.v1", alert.encode(a), key)
        w = fill(
            "ChargebackWindow",
            record_id=f"r{i}",
            namespace=f"ns{i % 5}",
            allocated_gpu_seconds=36.0,
            window_start_ms=t0,
            window_end_ms=t0 + 60_000,
        )
        p.produce(prefix + "gpu.chargeback.v1", window.encode(w), key)
        p.poll(0)
    assert p.flush(30) == 0
    return {"samples": n_samples, "xid_events": 300, "alerts": 300, "chargeback_windows": 300}


def counts(cat: SqlCatalog) -> dict[str, Counter[tuple[Any, ...]]]:
    out: dict[str, Counter[tuple[Any, ...]]] = {}
    for name, key in KEYS.items():
        try:
            data = cat.load_table(("gpupipe", name)).scan(selected_fields=key).to_arrow()
        except Exception:  # not created yet
            out[name] = Counter()
            continue
        cols = [data.column(k).to_pylist() for k in key]
        out[name] = Counter(zip(*cols, strict=True))
    return out


def start(kafka: str, prefix: str, tmp: Path, port: int) -> subprocess.Popen[bytes]:
    log = open(tmp / "lake.log", "a")  # noqa: SIM115 (owned by the process' lifetime)
    return hygiene.popen(
        [
            *GPUPIPE,
            "lake",
            "write",
            "--bootstrap-servers",
            kafka,
            "--topic-prefix",
            prefix,
            "--catalog-uri",
            f"sqlite:///{tmp}/catalog.db",
            "--warehouse",
            str(tmp / "warehouse"),
            "--flush-rows",
            "300",
            "--flush-interval",
            "300ms",
            "--listen",
            f"127.0.0.1:{port}",
            "--log-format",
            "text",
            # static membership: the restarted writer takes the killed one's partitions at once
            # instead of after its session times out (the offsets come from the tables either way)
            "--group-id",
            f"{prefix}lake",
            "--kafka-config",
            f"group.instance.id={prefix}lake-0",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=REPO,
        env=dict(os.environ),
    )


def wait_for(cond: Any, timeout: float, what: str, log: Path | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.05)
    tail = log.read_text()[-3000:] if log is not None and log.exists() else ""
    raise AssertionError(f"timed out waiting for {what}\n{tail}")


def test_kill_9_mid_stream_twice_and_every_record_is_in_once(
    kafka: str, topic_prefix: str, tmp_path: Path
) -> None:
    bases = ["gpu.samples.v1", "gpu.xid.v1", "gpu.alerts.v1", "gpu.chargeback.v1", "gpu.deadletter.v1"]
    ensure_topics(kafka, bases, prefix=topic_prefix)
    want = produce_all(kafka, topic_prefix)
    (tmp_path / "warehouse").mkdir()
    warehouse = (tmp_path / "warehouse").as_uri()
    cat = SqlCatalog("gpupipe", uri=f"sqlite:///{tmp_path}/catalog.db", warehouse=warehouse)
    port = free_port()
    proc = start(kafka, topic_prefix, tmp_path, port)
    try:
        log = tmp_path / "lake.log"
        for kill in (1, 2):
            seen = [0]

            def progressed(seen: list[int] = seen, kill: int = kill) -> bool:
                rows = sum(counts(cat)["samples"].values())
                seen[0] = rows
                return rows >= kill * 1200  # some commits in, most of the stream still to go

            wait_for(progressed, 120, f"rows before kill {kill}", log)
            assert seen[0] < want["samples"], "the kill must land mid-stream: produce more or flush less"
            os.killpg(proc.pid, signal.SIGKILL)  # no shutdown: buffered rows and group offsets lost
            proc.wait(10)
            proc = start(kafka, topic_prefix, tmp_path, port)

        def complete() -> bool:
            return all(sum(c.values()) >= want[n] for n, c in counts(cat).items())

        wait_for(complete, 180, "every row", log)
        time.sleep(1.5)  # a duplicate, were there one, would be committed by now
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5) as r:
            assert r.status == 200, "healthy while writing"
        assert hygiene.stop_group(proc, timeout=30) == 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    final = counts(cat)
    for name, c in final.items():
        dup = {k: n for k, n in c.items() if n != 1}
        assert not dup, f"{name}: rows not exactly once: {list(dup.items())[:5]}"
        assert len(c) == want[name], f"{name}: {len(c)} distinct rows, want {want[name]}"
    samples = cat.load_table(("gpupipe", "samples"))
    assert len(samples.snapshots()) >= 3, "a commit before each kill and one after"
    assert sum(stored_offsets(samples, topic_prefix + "gpu.samples.v1").values()) == want["samples"] + 1
    dead = read_all(kafka, topic_prefix + "gpu.deadletter.v1", expect=1)
    assert {m.value() for m in dead} == {b"\xc3\x01not-avro"}  # dead-lettered (once per reading of it)

    # The analyst's path over the same tables: SQL in process.
    out = gpupipe(
        "lake",
        "query",
        "--catalog-uri",
        f"sqlite:///{tmp_path}/catalog.db",
        "--warehouse",
        str(tmp_path / "warehouse"),
        "--format",
        "jsonl",
        "SELECT namespace, sum(allocated_gpu_seconds) / 3600 AS h FROM chargeback_windows "
        "GROUP BY namespace ORDER BY namespace",
    )
    assert out.returncode == 0, out.stderr
    rows = [json.loads(line) for line in out.stdout.splitlines()]
    assert rows == [{"namespace": f"ns{i}", "h": pytest.approx(60 * 36.0 / 3600)} for i in range(5)]
