"""Records that once stopped a consumer for good: each is dead-lettered, and nothing is lost.

Against a real broker, through the shared consume loop every service but chargeback runs on:
a value over librdkafka's message limit, a small value with a 1 MB header, an operator's ack
written to the XID topic, and a dead-letter topic the loop cannot write to for a while.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import pytest
from confluent_kafka import Consumer, Producer, TopicPartition
from prometheus_client import CollectorRegistry

from gpupipe.kafka import topics
from gpupipe.kafka.admin import ensure_topics
from gpupipe_consumers.plumbing.consume_loop import ConsumeLoop, InRecord
from gpupipe_consumers.plumbing.deadletter import HEADER_PREFIX, MAX_BYTES
from gpupipe_producer.simulated.fleet import FleetConfig, SimulatedFleet
from gpupipe_schemas.codec import AvroCodec
from tests.agent_harness import wait_for
from tests.integration.kafka_util import read_all
from tests.unit.consumers.alerts.test_record import _records

pytestmark = pytest.mark.integration


class Recorder:
    def __init__(self) -> None:
        self.records: list[InRecord] = []

    def on_assign(self, partitions: Sequence[tuple[str, int]]) -> None:
        pass

    def on_revoke(self, partitions: Sequence[tuple[str, int]]) -> None:
        pass

    def handle(self, records: Sequence[InRecord]) -> None:
        self.records += records


@contextmanager
def running(loop: ConsumeLoop) -> Iterator[threading.Thread]:
    stop = threading.Event()
    t = threading.Thread(target=loop.run, args=(stop,), name="test-loop")
    t.start()
    try:
        yield t
    finally:
        stop.set()
        t.join(30)
        assert not t.is_alive()


def _loop(
    kafka: str, prefix: str, inputs: list[str], rec: Recorder, reg: CollectorRegistry, **kw
) -> ConsumeLoop:
    return ConsumeLoop(
        bootstrap=kafka,
        group_id=f"g-{uuid.uuid4()}",
        topics=[topics.with_prefix(prefix, t) for t in inputs],
        handler=rec,
        codec=AvroCodec(),
        deadletter_topic=topics.with_prefix(prefix, topics.DEADLETTER),
        service="test",
        registry=reg,
        from_beginning=True,
        topic_prefix=prefix,
        **kw,
    )


def _committed(kafka: str, loop: ConsumeLoop, topic: str) -> int:
    c = Consumer({"bootstrap.servers": kafka, "group.id": loop.group_id})
    try:
        (tp,) = c.committed([TopicPartition(topic, 0)], timeout=10)
        return tp.offset
    finally:
        c.close()


def test_oversized_records_are_dead_lettered_cut_to_fit_and_the_loop_goes_on(
    kafka: str, topic_prefix: str
) -> None:
    ensure_topics(kafka, [topics.SAMPLES, topics.DEADLETTER], prefix=topic_prefix)
    topic = topics.with_prefix(topic_prefix, topics.SAMPLES)
    samples, _ = SimulatedFleet(FleetConfig(nodes=1, gpus_per_node=2)).tick(1_795_000_000_000)
    enc = AvroCodec().encoder("GpuSample")
    p = Producer({"bootstrap.servers": kafka, "message.max.bytes": 2_000_000})
    big = b"JUNK" + b"x" * 1_000_500
    p.produce(topic, big, b"big", partition=0)
    p.produce(topic, b"\x00\x01junk", b"header", partition=0, headers=[("h", b"y" * 1_000_000)])
    for r in samples:
        p.produce(topic, enc.encode(r), r["uuid"].encode(), partition=0)
    assert p.flush(30) == 0

    rec, reg = Recorder(), CollectorRegistry()
    loop = _loop(kafka, topic_prefix, [topics.SAMPLES], rec, reg)
    with running(loop) as t:
        wait_for(lambda: len(rec.records) >= len(samples) or not t.is_alive(), 60, "the good samples")
        assert t.is_alive(), "the loop stopped"
        wait_for(
            lambda: reg.get_sample_value("gpupipe_consumer_dead_letters_total", {"topic": topic}) == 2,
            30,
            "two acknowledged dead letters",
        )
        assert loop.healthy
    dead = read_all(kafka, topics.with_prefix(topic_prefix, topics.DEADLETTER), expect=2, timeout_s=30)
    by_key = {m.key(): m for m in dead}
    cut = dict(by_key[b"big"].headers())
    assert cut[HEADER_PREFIX + "truncated_value"] == str(len(big)).encode()
    assert big.startswith(by_key[b"big"].value()) and len(by_key[b"big"].value()) < MAX_BYTES
    dropped = dict(by_key[b"header"].headers())
    assert dropped[HEADER_PREFIX + "dropped_headers"] == b"1" and "h" not in dropped
    assert by_key[b"header"].value() == b"\x00\x01junk"
    sources = {m.key(): m.offset() for m in read_all(kafka, topic, expect=2 + len(samples), timeout_s=30)}
    assert dropped[HEADER_PREFIX + "offset"] == str(sources[b"header"]).encode()
    assert _committed(kafka, loop, topic) == max(sources.values()) + 1


def test_a_record_type_counts_only_on_its_own_topic(kafka: str, topic_prefix: str) -> None:
    # An operator's ack is a GpuAlert: written by a node to the XID topic it must not close anything.
    ensure_topics(kafka, [topics.XID, topics.SAMPLES, topics.ALERTS, topics.DEADLETTER], prefix=topic_prefix)
    codec = AvroCodec()
    xid_topic = topics.with_prefix(topic_prefix, topics.XID)
    alerts_topic = topics.with_prefix(topic_prefix, topics.ALERTS)
    ack = _records()[0]
    sample = SimulatedFleet(FleetConfig(nodes=1, gpus_per_node=1)).tick(1_795_000_000_000)[0][0]
    p = Producer({"bootstrap.servers": kafka})
    p.produce(xid_topic, codec.encoder("GpuAlert").encode(ack), b"forged", partition=0)
    p.produce(xid_topic, codec.encoder("GpuSample").encode(sample), b"sample-on-xid", partition=0)
    p.produce(alerts_topic, codec.encoder("GpuAlert").encode(ack), b"own-topic", partition=0)
    assert p.flush(30) == 0

    rec, reg = Recorder(), CollectorRegistry()
    loop = _loop(kafka, topic_prefix, [topics.XID, topics.SAMPLES, topics.ALERTS], rec, reg)
    with running(loop):
        wait_for(lambda: len(rec.records) >= 1, 60, "the ack on its own topic")
        wait_for(
            lambda: reg.get_sample_value("gpupipe_consumer_dead_letters_total", {"topic": xid_topic}) == 2,
            30,
            "the two records on the wrong topic dead-lettered",
        )
    assert [(r.topic, r.name) for r in rec.records] == [(alerts_topic, "GpuAlert")]
    dead = read_all(kafka, topics.with_prefix(topic_prefix, topics.DEADLETTER), expect=2, timeout_s=30)
    reasons = {m.key(): dict(m.headers())[HEADER_PREFIX + "reason"] for m in dead}
    assert reasons == {b"forged": b"unexpected-record-type", b"sample-on-xid": b"unexpected-record-type"}


def test_a_dead_letter_counts_once_written_and_holds_its_offset_until_then(
    kafka: str, topic_prefix: str
) -> None:
    # The dead-letter topic does not exist yet (and the broker creates none): writes fail.
    ensure_topics(kafka, [topics.SAMPLES], prefix=topic_prefix)
    topic = topics.with_prefix(topic_prefix, topics.SAMPLES)
    p = Producer({"bootstrap.servers": kafka})
    p.produce(topic, b"not avro at all", b"junk", partition=0)
    assert p.flush(30) == 0

    rec, reg = Recorder(), CollectorRegistry()
    loop = _loop(kafka, topic_prefix, [topics.SAMPLES], rec, reg, extra={"message.timeout.ms": "1500"})

    def failures() -> float:
        return sum(
            s.value
            for m in reg.collect()
            if m.name == "gpupipe_consumer_dead_letter_failures"
            for s in m.samples
            if s.name.endswith("_total")
        )

    with running(loop) as t:
        wait_for(lambda: failures() >= 2, 60, "failed dead-letter writes")
        assert t.is_alive() and not loop.healthy
        assert "deadletters_failing" in loop.health_detail()
        assert reg.get_sample_value("gpupipe_consumer_dead_letters_total", {"topic": topic}) is None
        assert _committed(kafka, loop, topic) < 1, "the record's offset was committed before its dead letter"
        ensure_topics(kafka, [topics.DEADLETTER], prefix=topic_prefix)
        wait_for(
            lambda: reg.get_sample_value("gpupipe_consumer_dead_letters_total", {"topic": topic}) == 1,
            60,
            "the dead letter written once the topic exists",
        )
        wait_for(lambda: loop.healthy, 30, "healthy again")
        wait_for(
            lambda: _committed(kafka, loop, topic) == 1, 30, "the offset committed after the dead letter"
        )
    (dead,) = read_all(kafka, topics.with_prefix(topic_prefix, topics.DEADLETTER), expect=1, timeout_s=30)
    assert dead.value() == b"not avro at all"
