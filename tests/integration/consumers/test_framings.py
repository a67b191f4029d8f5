"""Each framing over a real broker: what the producer writes, the shared consume loop reads.

Single-object, Confluent (a registry client shared by writer and reader) and raw (plain Avro, the
schema named by a record header) in one topic, read through a service's own codec-shaped decoder;
a raw body whose header was lost is dead-lettered.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Sequence

import pytest
from confluent_kafka import Producer
from prometheus_client import CollectorRegistry

from gpupipe.kafka.admin import ensure_topics
from gpupipe_consumers.plumbing.consume_loop import ConsumeLoop, InRecord
from gpupipe_producer.simulated.fleet import FleetConfig, SimulatedFleet
from gpupipe_schemas import catalog
from gpupipe_schemas.codec import FRAMINGS, RAW, SCHEMA_HEADER, AvroCodec, codec_from_url
from gpupipe_schemas.fastdecode import SampleDecoder
from tests.integration.kafka_util import gpupipe, read_all, read_to_end

pytestmark = pytest.mark.integration


class _Recorder:
    def __init__(self, want: int) -> None:
        self.records: list[InRecord] = []
        self.want = want
        self.done = threading.Event()

    def on_assign(self, partitions: Sequence[tuple[str, int]]) -> None: ...

    def on_revoke(self, partitions: Sequence[tuple[str, int]]) -> None: ...

    def handle(self, records: Sequence[InRecord]) -> None:
        self.records += records
        if len(self.records) >= self.want:
            self.done.set()


def test_every_framing_reaches_the_consume_loop(kafka: str, topic_prefix: str) -> None:
    ensure_topics(kafka, ["gpu.samples.v1", "gpu.deadletter.v1"], prefix=topic_prefix)
    topic, dlq = topic_prefix + "gpu.samples.v1", topic_prefix + "gpu.deadletter.v1"
    samples, _ = SimulatedFleet(FleetConfig(nodes=3, gpus_per_node=2)).tick(1_795_000_000_000)
    codec = codec_from_url(f"mock://framings-{uuid.uuid4()}")
    p = Producer({"bootstrap.servers": kafka})
    sent: dict[str, str] = {}  # uuid -> framing
    for i, rec in enumerate(samples):
        framing = FRAMINGS[i % len(FRAMINGS)]
        enc = codec.encoder("GpuSample", topic, framing=framing)
        p.produce(topic, enc.encode(rec), rec["uuid"].encode(), partition=0, headers=enc.headers)
        sent[rec["uuid"]] = framing
    lost = codec.encoder("GpuSample", topic, framing=RAW).encode(samples[0])
    p.produce(topic, lost, b"headerless", partition=0)  # a hop that dropped the header
    assert p.flush(10) == 0

    rec = _Recorder(len(samples))
    loop = ConsumeLoop(
        bootstrap=kafka,
        group_id=f"g-{uuid.uuid4()}",
        topics=[topic],
        handler=rec,
        # a service's own decoder: magic-framed values go through it, raw ones to its codec
        codec=SampleDecoder(codec, catalog.current("GpuSample").raw),  # type: ignore[arg-type]
        deadletter_topic=dlq,
        service="test",
        registry=CollectorRegistry(),
        from_beginning=True,
    )
    stop = threading.Event()
    t = threading.Thread(target=loop.run, args=(stop,))
    t.start()
    try:
        assert rec.done.wait(60), f"only {len(rec.records)} records handled"
        dead = read_all(kafka, dlq, expect=1)
    finally:
        stop.set()
        t.join(30)
    assert not t.is_alive()
    by_uuid = {r.value["uuid"]: r.value for r in rec.records}
    assert by_uuid == {s["uuid"]: s for s in samples}
    assert set(sent.values()) == set(FRAMINGS)
    assert [m.key() for m in dead] == [b"headerless"]


def test_produce_writes_raw_framing_with_its_header_per_topic(kafka: str, topic_prefix: str) -> None:
    res = gpupipe(
        "produce",
        "--source",
        "simulated",
        "--nodes",
        "1",
        "--gpus-per-node",
        "2",
        "--interval",
        "10s",
        "--duration",
        "60s",
        "--start-time",
        "2026-11-30T00:00:00Z",
        "--speed",
        "max",
        "--xid-rate",
        "600",
        "--framing",
        "samples=raw",
        "--bootstrap-servers",
        kafka,
        "--topic-prefix",
        topic_prefix,
        "--create-topics",
    )
    assert res.returncode == 0, res.stderr
    samples = read_to_end(kafka, f"{topic_prefix}gpu.samples.v1")  # the producer is done: all it wrote
    assert len(samples) == 12
    codec = AvroCodec()
    for m in samples:
        assert dict(m.headers() or [])[SCHEMA_HEADER].startswith(b"GpuSample@")
        assert codec.decode(m.value(), m.headers()).framing == "raw"
    xids = read_to_end(kafka, f"{topic_prefix}gpu.xid.v1")
    assert xids, "an XID rate of 600 per GPU-hour over 2 GPU-minutes writes some"
    assert all(not m.headers() and codec.decode(m.value()).framing == "single-object" for m in xids)
