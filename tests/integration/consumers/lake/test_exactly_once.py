"""`gpupipe lake write` against a real broker and a real SQLite catalog: kill -9 twice mid-stream,
restart, and every record is in its table exactly once; then the readers answer from the tables."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import Producer
from pyiceberg.catalog.sql import SqlCatalog
from pyiceberg.exceptions import NoSuchTableError

from gpupipe.kafka.admin import ensure_topics
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
TOPICS = {
    "samples": "gpu.samples.v1",
    "xid_events": "gpu.xid.v1",
    "alerts": "gpu.alerts.v1",
    "chargeback_windows": "gpu.chargeback.v1",
}
EVENT_TABLES = ("xid_events", "alerts", "chargeback_windows")

FLUSH_ROWS = 200
# The stream in three parts, one per writer: (fleet ticks of 128 samples, records of each other
# table). Each part is at least FLUSH_ROWS per table, so every writer commits every table before
# it is killed, whatever batches the consumer happens to get.
PARTS = ((14, 200), (13, 200), (13, 200))


@pytest.fixture(autouse=True)
def _pool() -> Iterator[None]:
    yield
    end_pyiceberg_threads()


class Stream:
    """The input, produced a part at a time; each table's records go on from where they stopped."""

    def __init__(self, kafka: str, prefix: str) -> None:
        codec = AvroCodec()
        self.prefix = prefix
        self.producer = Producer({"bootstrap.servers": kafka, "linger.ms": 20, "enable.idempotence": True})
        now = int(time.time() * 1000)
        self.t0 = now - now % 1000 - 2 * 3_600_000
        self.fleet = SimulatedFleet(FleetConfig(nodes=16, gpus_per_node=8))
        self.ticks = 0
        self.enc = {
            name: codec.encoder(name) for name in ("GpuSample", "XidEvent", "GpuAlert", "ChargebackWindow")
        }
        #: decodable records produced per table: the rows each table must end with
        self.produced = dict.fromkeys(KEYS, 0)

    def samples(self, ticks: int) -> None:
        for _ in range(ticks):
            samples, _ = self.fleet.tick(self.t0 + self.ticks * 1000)
            self.ticks += 1
            for s in samples:
                self._send("samples", self.enc["GpuSample"].encode(s), s["uuid"].encode())
            self.producer.poll(0)

    def undecodable(self) -> None:
        """One sample that is not Avro: dead-lettered, never a row, but its offset is committed."""
        self.producer.produce(self.prefix + TOPICS["samples"], b"\xc3\x01not-avro", b"bad")

    def events(self, table: str, n: int) -> None:
        for _ in range(n):
            i = self.produced[table]
            if table == "xid_events":
                value = self.enc["XidEvent"].encode(
                    fill("XidEvent", event_id=f"e{i}", timestamp_ms=self.t0 + i)
                )
            elif table == "alerts":
                a = fill(
                    "GpuAlert",
                    alert_id=f"a{i // 3}",
                    sequence=i % 3,
                    emitted_at_ms=self.t0 + i,
                    first_seen_ms=self.t0,
                    last_seen_ms=self.t0 + i,
                )
                value = self.enc["GpuAlert"].encode(a)
            else:
                w = fill(
                    "ChargebackWindow",
                    record_id=f"r{i}",
                    namespace=f"ns{i % 5}",
                    allocated_gpu_seconds=36.0,
                    window_start_ms=self.t0,
                    window_end_ms=self.t0 + 60_000,
                )
                value = self.enc["ChargebackWindow"].encode(w)
            self._send(table, value, f"k{i % 17}".encode())
            self.producer.poll(0)

    def top_up(self, table: str) -> None:
        """Fewer rows than FLUSH_ROWS for ``table``: a writer holding none of it holds them all."""
        if table == "samples":
            self.samples(1)  # 128
        else:
            self.events(table, 10)
        self.flush()

    def part(self, ticks: int, events: int, *, undecodable: bool = False) -> None:
        self.samples(ticks // 2)
        if undecodable:
            self.undecodable()
        self.samples(ticks - ticks // 2)
        for table in EVENT_TABLES:
            self.events(table, events)
        self.flush()

    def flush(self) -> None:
        assert self.producer.flush(30) == 0

    def _send(self, table: str, value: bytes, key: bytes) -> None:
        self.producer.produce(self.prefix + TOPICS[table], value, key)
        self.produced[table] += 1


def committed(cat: SqlCatalog) -> dict[str, int]:
    """Rows per table as its current snapshot's summary says: cheap, unlike scanning every row,
    which under load took long enough for the writer to finish the stream meanwhile."""
    out: dict[str, int] = {}
    for name in KEYS:
        try:
            snap = cat.load_table(("gpupipe", name)).current_snapshot()
        except NoSuchTableError:
            snap = None
        total = snap.summary["total-records"] if snap is not None and snap.summary is not None else None
        out[name] = int(total or 0)
    return out


def counts(cat: SqlCatalog) -> dict[str, Counter[tuple[Any, ...]]]:
    out: dict[str, Counter[tuple[Any, ...]]] = {}
    for name, key in KEYS.items():
        data = cat.load_table(("gpupipe", name)).scan(selected_fields=key).to_arrow()
        cols = [data.column(k).to_pylist() for k in key]
        out[name] = Counter(zip(*cols, strict=True))
    return out


def health(port: int) -> tuple[int, dict[str, Any]] | None:
    """The writer's /healthz status and body; None before it listens or while it does not answer."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:  # 503: starting, or not polling yet
        return e.code, json.loads(e.read())
    except (OSError, ValueError):
        return None


def start(kafka: str, prefix: str, tmp: Path, port: int, flush_interval: str) -> subprocess.Popen[bytes]:
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
            str(FLUSH_ROWS),
            "--flush-interval",
            flush_interval,
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


def wait_for(
    cond: Callable[[], bool], timeout: float, what: str, log: Path, proc: subprocess.Popen[bytes]
) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        if proc.poll() is not None:
            break
        time.sleep(0.05)
    tail = log.read_text()[-3000:] if log.exists() else ""
    raise AssertionError(f"timed out waiting for {what} (writer exit: {proc.poll()})\n{tail}")


def test_kill_9_mid_stream_twice_and_every_record_is_in_once(
    kafka: str, topic_prefix: str, tmp_path: Path
) -> None:
    ensure_topics(kafka, [*TOPICS.values(), "gpu.deadletter.v1"], prefix=topic_prefix)
    stream = Stream(kafka, topic_prefix)
    (tmp_path / "warehouse").mkdir()
    warehouse = (tmp_path / "warehouse").as_uri()
    cat = SqlCatalog("gpupipe", uri=f"sqlite:///{tmp_path}/catalog.db", warehouse=warehouse)
    port = free_port()
    log = tmp_path / "lake.log"
    # Each writer but the last reads its part of the stream, commits some of it and holds the rest:
    # neither its row count (kept below FLUSH_ROWS) nor its interval (an hour) commits that rest.
    # Killed then, it loses buffered rows and group offsets after commits landed, and the next part
    # is produced only after the kill: mid-stream by construction, however fast the writer runs.
    proc: subprocess.Popen[bytes] | None = None
    try:
        for n, (ticks, events) in enumerate(PARTS):
            last = n == len(PARTS) - 1
            base = committed(cat)  # where this writer resumes: the one before it is dead
            proc = start(kafka, topic_prefix, tmp_path, port, "300ms" if last else "1h")
            stream.part(ticks, events, undecodable=n == 0)
            if last:
                break

            def caught_up(base: dict[str, int] = base) -> bool:
                """The writer handled (committed or holds) every record produced since it started."""
                h = health(port)
                todo = sum(stream.produced[t] - base[t] for t in KEYS)
                # not mid-commit: /healthz does not wait for a commit, and the rows it reports as
                # buffered meanwhile may be landing in their table
                return (
                    h is not None
                    and not h[1].get("committing")
                    and h[1].get("rows_written", -1) + h[1].get("rows_buffered", 0) >= todo
                )

            wait_for(caught_up, 120, f"writer {n + 1} to read its part", log, proc)
            rows = committed(cat)
            empty = [t for t in KEYS if rows[t] == stream.produced[t]]
            if empty:  # its last batch reached FLUSH_ROWS and was committed: give it rows to hold
                for t in empty:
                    stream.top_up(t)
                wait_for(caught_up, 120, f"writer {n + 1} to read the top-up", log, proc)
                rows = committed(cat)
            status = health(port)
            held = {t: stream.produced[t] - rows[t] for t in KEYS}
            for t in KEYS:
                assert rows[t] <= stream.produced[t], (
                    f"{t}: {rows[t]} rows of {stream.produced[t]}: duplicates"
                )
                assert rows[t] > base[t], f"{t}: writer {n + 1} committed nothing before its kill"
                assert held[t] > 0, f"{t}: writer {n + 1} holds no rows for its kill to lose"
            assert status is not None and status[1]["rows_buffered"] == sum(held.values()), (
                f"writer {n + 1} holds other than the uncommitted rows {held}: {status}"
            )
            os.killpg(proc.pid, signal.SIGKILL)  # no shutdown: buffered rows and group offsets lost
            proc.wait(10)
        assert proc is not None

        def complete() -> bool:
            return all(rows >= stream.produced[t] for t, rows in committed(cat).items())

        wait_for(complete, 120, "every row", log, proc)
        status = health(port)
        assert status is not None and status[0] == 200, f"healthy while writing: {status}"
        # A clean stop commits what the writer holds: a duplicate it has read is in the table then.
        assert hygiene.stop_group(proc, timeout=30) == 0
    finally:
        if proc is not None and proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    final = counts(cat)
    for name, c in final.items():
        dup = {k: n for k, n in c.items() if n != 1}
        assert not dup, f"{name}: rows not exactly once: {list(dup.items())[:5]}"
        assert len(c) == stream.produced[name], (
            f"{name}: {len(c)} distinct rows, want {stream.produced[name]}"
        )
        table = cat.load_table(("gpupipe", name))
        assert len(table.snapshots()) >= 3, f"{name}: a commit by each writer"
    samples = cat.load_table(("gpupipe", "samples"))
    offsets = stored_offsets(samples, topic_prefix + TOPICS["samples"])
    assert sum(offsets.values()) == stream.produced["samples"] + 1  # the undecodable one too
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
    answer = [json.loads(line) for line in out.stdout.splitlines()]
    windows = stream.produced["chargeback_windows"]
    assert answer == [
        {"namespace": f"ns{i}", "h": pytest.approx(len(range(i, windows, 5)) * 36.0 / 3600)} for i in range(5)
    ]
