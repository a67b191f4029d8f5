"""The shared consume loop against a real broker: decode, dead-letter, offsets, rebalance callbacks."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Sequence

import pytest
from confluent_kafka import Producer
from prometheus_client import CollectorRegistry

from gpupipe.kafka.admin import ensure_topics
from gpupipe_consumers.plumbing.consume_loop import ConsumeLoop, InRecord
from gpupipe_producer.simulated.fleet import FleetConfig, SimulatedFleet
from gpupipe_schemas.codec import AvroCodec
from tests.integration.kafka_util import read_all

pytestmark = pytest.mark.integration


class Recorder:
    def __init__(self) -> None:
        self.records: list[InRecord] = []
        self.assigned: list[tuple[str, int]] = []
        self.revoked: list[tuple[str, int]] = []
        self.done = threading.Event()
        self.want = 0

    def on_assign(self, partitions: Sequence[tuple[str, int]]) -> None:
        self.assigned += partitions

    def on_revoke(self, partitions: Sequence[tuple[str, int]]) -> None:
        self.revoked += partitions

    def handle(self, records: Sequence[InRecord]) -> None:
        self.records += records
        if len(self.records) >= self.want:
            self.done.set()


def test_decodes_and_dead_letters(kafka: str, topic_prefix: str) -> None:
    ensure_topics(kafka, ["gpu.samples.v1", "gpu.deadletter.v1"], prefix=topic_prefix)
    topic = topic_prefix + "gpu.samples.v1"
    dlq = topic_prefix + "gpu.deadletter.v1"
    samples, _ = SimulatedFleet(FleetConfig(nodes=2, gpus_per_node=4)).tick(1_795_000_000_000)
    enc = AvroCodec().encoder("GpuSample")
    p = Producer({"bootstrap.servers": kafka})
    for r in samples[:4]:
        p.produce(topic, enc.encode(r), r["uuid"].encode(), partition=0)
    p.produce(topic, b"\xc3\x01garbage!", b"bad-key", partition=0, headers=[("origin", b"test")])
    for r in samples[4:]:
        p.produce(topic, enc.encode(r), r["uuid"].encode(), partition=0)
    assert p.flush(10) == 0

    rec = Recorder()
    rec.want = len(samples)
    reg = CollectorRegistry()
    loop = ConsumeLoop(
        bootstrap=kafka,
        group_id=f"g-{uuid.uuid4()}",
        topics=[topic],
        handler=rec,
        codec=AvroCodec(),
        deadletter_topic=dlq,
        service="test",
        registry=reg,
        from_beginning=True,
    )
    stop = threading.Event()
    t = threading.Thread(target=loop.run, args=(stop,))
    t.start()
    try:
        assert rec.done.wait(60), f"only {len(rec.records)} records handled"
        deadline = time.monotonic() + 10
        while (
            time.monotonic() < deadline
            and reg.get_sample_value("gpupipe_consumer_lag_records", {"topic": topic, "partition": "0"})
            is None
        ):
            time.sleep(0.1)
    finally:
        stop.set()
        t.join(30)
    assert not t.is_alive()
    assert sorted(r.value["uuid"] for r in rec.records) == sorted(r["uuid"] for r in samples)
    assert all(r.name == "GpuSample" for r in rec.records)
    assert rec.assigned, "assignment reached the handler"
    assert reg.get_sample_value("gpupipe_consumer_dead_letters_total", {"topic": topic}) == 1
    assert (
        reg.get_sample_value(
            "gpupipe_consumer_decode_errors_total", {"topic": topic, "reason": "unknown-schema-fingerprint"}
        )
        == 1
    )
    assert reg.get_sample_value("gpupipe_consumer_records_total", {"topic": topic}) == len(samples)
    dead = read_all(kafka, dlq, expect=1)
    assert len(dead) == 1
    m = dead[0]
    assert m.value() == b"\xc3\x01garbage!" and m.key() == b"bad-key"
    h = dict(m.headers())
    assert h["origin"] == b"test"
    assert h["gpupipe.dlq.reason"] == b"unknown-schema-fingerprint"
    assert h["gpupipe.dlq.topic"] == topic.encode()
    assert h["gpupipe.dlq.offset"] == b"4"
    assert h["gpupipe.dlq.service"] == b"test"
