"""A day of 1,000 GPUs: GPU-hours per namespace from the lake against replaying the topic for it.

Without the lake, "GPU-hours per namespace yesterday" means reading the day's gpu.samples.v1 from
Kafka (while retention still has it), decoding every sample and running chargeback's accounting
over it. With the lake it is one query of the chargeback_windows table. Both are timed here on the
same day, and must give the same answer (1e-9 relative):

* replay: consume the topic from the beginning, decode (chargeback's projected schema) and feed
  the chargeback engine, close every window, sum per namespace;
* lake: the windows the replay closed are written to a lake (untimed); then, timed, open the SQLite
  catalog, load the tables and run ``gpu_hours_sql`` (DuckDB) for the day, best of three.

Prints ``lake_query_vs_replay ratio=<replay_s / lake_s> target=20``. One sample per GPU every five
minutes keeps the run to a few minutes (288,000 samples): replaying grows with the sampling rate
and the lake's query does not, so at the producer's one a second the ratio is far higher.

    PYTHONPATH=. .venv/bin/python bench/bench_lake_query.py [--gpus 1000] [--interval-s 300]
"""

from __future__ import annotations

import argparse
import tempfile
import time
import uuid
from collections import defaultdict
from datetime import UTC, datetime
from pathlib import Path

from common import bench_kafka, best_of, figure, ratio_line
from confluent_kafka import Consumer, Producer, TopicPartition
from prometheus_client import CollectorRegistry
from pyiceberg.catalog.sql import SqlCatalog

from gpupipe.domain.prices import PriceTable
from gpupipe.kafka import topics
from gpupipe.kafka.admin import ensure_topics
from gpupipe_consumers.chargeback.settings import ChargebackSettings, build_engine, projected_sample_schema
from gpupipe_consumers.lake.query import gpu_hours_sql, load_tables
from gpupipe_consumers.lake.tables import BY_NAME
from gpupipe_consumers.lake.writer import LakeWriter, open_table
from gpupipe_consumers.plumbing.consume_loop import InRecord
from gpupipe_producer.simulated.fleet import FleetConfig, SimulatedFleet
from gpupipe_schemas import catalog
from gpupipe_schemas.codec import AvroCodec

DAY_MS = 86_400_000


def produce_day(bootstrap: str, topic: str, gpus: int, interval_ms: int, t0: int) -> int:
    fleet = SimulatedFleet(FleetConfig(nodes=gpus // 8, gpus_per_node=8, interval_ms=interval_ms))
    enc = AvroCodec().encoder("GpuSample")
    p = Producer({"bootstrap.servers": bootstrap, "linger.ms": 50, "compression.type": "lz4"})
    n = 0
    for i in range(DAY_MS // interval_ms):
        for s in fleet.tick(t0 + i * interval_ms)[0]:
            p.produce(topic, enc.encode(s), s["uuid"].encode())
            n += 1
        p.poll(0)
    assert p.flush(120) == 0
    return n


def replay(bootstrap: str, topic: str, start: datetime, end: datetime) -> tuple[dict[str, float], list]:
    """GPU-hours per namespace of the day, from the topic: what answering it without a lake costs."""
    codec = AvroCodec(reader_schemas={"GpuSample": projected_sample_schema(catalog.current("GpuSample").raw)})
    engine = build_engine(ChargebackSettings(), PriceTable(), "bench")
    c = Consumer(
        {"bootstrap.servers": bootstrap, "group.id": f"bench-{uuid.uuid4()}", "enable.auto.commit": False}
    )
    try:
        parts = c.list_topics(topic, timeout=30).topics[topic].partitions
        ends = {p: c.get_watermark_offsets(TopicPartition(topic, p), timeout=30)[1] for p in parts}
        c.assign([TopicPartition(topic, p, 0) for p in parts])
        left = {p for p, e in ends.items() if e > 0}
        while left:
            for m in c.consume(5000, timeout=1.0):
                if m.error():
                    continue
                p, off = m.partition(), m.offset()
                engine.add(codec.decode(m.value()).record, p, off, m.timestamp()[1])
                if off + 1 >= ends[p]:
                    left.discard(p)
    finally:
        c.close()
    windows = engine.poll_closed() + engine.flush_all()
    lo, hi = int(start.timestamp() * 1000), int(end.timestamp() * 1000)
    out: dict[str, float] = defaultdict(float)
    for w in windows:
        if lo <= w["window_start_ms"] < hi:
            out[w["namespace"]] += w["allocated_gpu_seconds"] / 3600.0
    return dict(out), windows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gpus", type=int, default=1000)
    ap.add_argument("--interval-s", type=float, default=300.0, help="sampling interval of the simulated day")
    args = ap.parse_args()
    bootstrap = bench_kafka()
    prefix = f"bench-lake-{uuid.uuid4().hex[:8]}."
    topic = topics.with_prefix(prefix, topics.SAMPLES)
    ensure_topics(bootstrap, [topics.SAMPLES], prefix=prefix)
    day = datetime.now(UTC).replace(hour=0, minute=0, second=0, microsecond=0)
    start = datetime.fromtimestamp(day.timestamp() - 2 * 86_400, UTC)
    end = datetime.fromtimestamp(start.timestamp() + 86_400, UTC)
    t = time.perf_counter()
    n = produce_day(bootstrap, topic, args.gpus, int(args.interval_s * 1000), int(start.timestamp() * 1000))
    figure("samples", n)
    figure("produce_s", time.perf_counter() - t, "s")

    t = time.perf_counter()
    by_replay, windows = replay(bootstrap, topic, start, end)
    replay_s = time.perf_counter() - t
    figure("replay_s", replay_s, "s (consume, decode, account, close windows)")

    with tempfile.TemporaryDirectory(prefix="bench-lake-") as d:
        (Path(d) / "wh").mkdir()
        uri, wh = f"sqlite:///{d}/c.db", (Path(d) / "wh").as_uri()
        spec = BY_NAME["chargeback_windows"]
        cat = SqlCatalog("gpupipe", uri=uri, warehouse=wh)
        w = LakeWriter({topics.CHARGEBACK: (spec, open_table(cat, "gpupipe", spec))}, CollectorRegistry())
        w.handle([InRecord(topics.CHARGEBACK, 0, i, None, spec.record, r, 0) for i, r in enumerate(windows)])
        w.flush()
        figure("window_rows", len(windows))
        answer: dict[str, float] = {}

        def lake() -> float:
            began = time.perf_counter()
            tables = load_tables(SqlCatalog("gpupipe", uri=uri, warehouse=wh), "gpupipe")
            answer.update(gpu_hours_sql(tables, start, end))
            return time.perf_counter() - began

        lake_s = best_of(3, lake)
    figure("lake_query_s", lake_s, "s (open catalog, scan, DuckDB)")
    assert set(answer) == set(by_replay), (sorted(answer), sorted(by_replay))
    for ns, h in by_replay.items():
        assert abs(answer[ns] - h) <= 1e-9 * max(abs(h), 1e-300), (ns, answer[ns], h)
    figure("gpu_hours_total", sum(by_replay.values()), "GPU-hours (the same from both)")
    ratio_line("lake_query_vs_replay", replay_s / lake_s, 20, "%.1f")


if __name__ == "__main__":
    main()
