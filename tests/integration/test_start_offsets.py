"""No gap at start: a new consumer group reads from the moment its service started.

Reproduces the defect: the group used to begin at the end offsets found when its partitions were
assigned, seconds after the process started, so records written in between (an XID during a
rollout) were never seen. Here the records land after the service's start time and before the
loop subscribes; they must all arrive, the older record must not, and ``--from-beginning`` still
reads everything.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Sequence

import pytest
from confluent_kafka import Producer
from prometheus_client import CollectorRegistry

from gpupipe.kafka import topics
from gpupipe.kafka.admin import ensure_topics
from gpupipe_consumers.plumbing.consume_loop import ConsumeLoop, InRecord
from gpupipe_producer.simulated.fleet import FleetConfig, SimulatedFleet
from gpupipe_schemas.codec import AvroCodec

pytestmark = pytest.mark.integration


class Collect:
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


def _produce_old(kafka: str, topic: str) -> str:
    """One record written before the service starts; returns its uuid.

    The samples topic uses broker time (LogAppendTime), so "before" is when it
    is written, whatever timestamp the producer asks for.
    """
    (old, *_), _ = SimulatedFleet(FleetConfig(nodes=3, gpus_per_node=3)).tick(int(time.time() * 1000))
    p = Producer({"bootstrap.servers": kafka})
    p.produce(topic, AvroCodec().encoder("GpuSample").encode(old), old["uuid"].encode())
    assert p.flush(10) == 0
    return old["uuid"]


def _produce_new(kafka: str, topic: str, start_ms: int) -> list[str]:
    """Eight records written after `start_ms` (the service's start), before it subscribes."""
    samples, _ = SimulatedFleet(FleetConfig(nodes=3, gpus_per_node=3)).tick(start_ms)
    enc = AvroCodec().encoder("GpuSample")
    p = Producer({"bootstrap.servers": kafka})
    for r in samples[1:]:
        p.produce(topic, enc.encode(r), r["uuid"].encode(), timestamp=start_ms + 10)
    assert p.flush(10) == 0
    return [r["uuid"] for r in samples[1:]]


def _consume(kafka: str, topic: str, start_ms: int, want: int, from_beginning: bool) -> Collect:
    rec = Collect(want)
    loop = ConsumeLoop(
        bootstrap=kafka,
        group_id=f"g-{uuid.uuid4()}",
        topics=[topic],
        handler=rec,
        codec=AvroCodec(),
        deadletter_topic=topic + ".dlq",
        service="test",
        registry=CollectorRegistry(),
        from_beginning=from_beginning,
        start_ms=start_ms,
    )
    stop = threading.Event()
    t = threading.Thread(target=loop.run, args=(stop,), name="consume-loop")
    t.start()
    try:
        if rec.done.wait(20):
            time.sleep(1.0)  # a record too many (the old one) would have come within this
    finally:
        stop.set()
        t.join(30)
    assert not t.is_alive()
    return rec


def test_new_group_reads_what_was_written_while_it_started(kafka: str, topic_prefix: str) -> None:
    ensure_topics(kafka, [topics.SAMPLES], prefix=topic_prefix)
    topic = topic_prefix + topics.SAMPLES
    old = _produce_old(kafka, topic)  # before the service started
    time.sleep(0.01)  # broker time moves past the old record's append time
    start_ms = int(time.time() * 1000)
    new = _produce_new(kafka, topic, start_ms)  # after the "service start", before it subscribed
    rec = _consume(kafka, topic, start_ms, len(new), from_beginning=False)
    got = [r.value["uuid"] for r in rec.records]
    assert sorted(got) == sorted(new), f"{len(got)} of {len(new)} records written while starting"
    assert old not in got


def test_from_beginning_still_reads_everything(kafka: str, topic_prefix: str) -> None:
    ensure_topics(kafka, [topics.SAMPLES], prefix=topic_prefix)
    topic = topic_prefix + topics.SAMPLES
    old = _produce_old(kafka, topic)
    time.sleep(0.01)
    start_ms = int(time.time() * 1000)
    new = _produce_new(kafka, topic, start_ms)
    rec = _consume(kafka, topic, start_ms, len(new) + 1, from_beginning=True)
    assert sorted(r.value["uuid"] for r in rec.records) == sorted([*new, old])
