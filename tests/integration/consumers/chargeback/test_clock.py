"""On a real broker: the samples topic stamps LogAppendTime, so a node clock running a day
ahead is bounded by broker time; its samples are billed once, in the broker's window, and the
correctly clocked GPU sharing its partition keeps final window records (no corrections)."""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest
from confluent_kafka import Consumer, KafkaError, KafkaException, TopicPartition
from confluent_kafka.admin import AdminClient, ConfigResource

from gpupipe.kafka import topics
from gpupipe.kafka.admin import ensure_topics
from tests.agent_harness import wait_for
from tests.integration.chargeback_util import (
    Progress,
    new_id,
    read_output,
    start_service,
    stop_service,
    totals,
    wait_log,
)
from tests.integration.consumers.chargeback.test_environments import produce, samples

pytestmark = pytest.mark.integration

DAY_MS = 86_400_000


def _configs(admin: AdminClient, res: ConfigResource) -> dict | None:
    try:
        return admin.describe_configs([res])[res].result(timeout=10)
    except KafkaException as exc:
        if exc.args[0].code() == KafkaError.UNKNOWN_TOPIC_OR_PART:
            return None
        raise


def test_a_node_a_day_ahead_is_bounded_by_broker_time(kafka: str, topic_prefix: str, tmp_path: Path) -> None:
    ensure_topics(kafka, [topics.SAMPLES, topics.CHARGEBACK, topics.DEADLETTER], prefix=topic_prefix)
    t_in = topic_prefix + topics.SAMPLES
    res = ConfigResource(ConfigResource.Type.TOPIC, t_in)
    admin = AdminClient({"bootstrap.servers": kafka})
    conf = wait_for(lambda: _configs(admin, res), 30, "the new topic's configs")  # its metadata spreads
    assert conf["message.timestamp.type"].value == "LogAppendTime"

    now = int(time.time() * 1000)
    start = now - now % 300_000 - 1_200_000  # 20-25 min ago, on a 5-minute boundary
    ticks = (now - start) // 10_000
    (good,), (fast,) = samples("good", 1, 0, 1), samples("fast", 1, 0, 1)
    items = [dict(good, timestamp_ms=start + k * 10_000) for k in range(ticks)]
    # Then, in the same partition, a node that booted with its clock a day ahead (fixed after 5 min).
    items += [dict(fast, timestamp_ms=start + k * 10_000 + (DAY_MS if k < 30 else 0)) for k in range(ticks)]
    # Each record carries its node's clock as CreateTime, as a real node's producer stamps it; only
    # the topic's LogAppendTime replaces it with broker time (it was CreateTime: the skew guard
    # compared the node clock with itself and never fired).
    produce(kafka, t_in, items, partition=0, node_clock=True)
    group, log = f"cb-clock-{new_id()}", tmp_path / "cb.log"
    prog = Progress(kafka, group, t_in)
    args = ("--window", "5m", "--grace", "30s", "--group-id", group, "--late-run-gap", "2s")
    svc = start_service(kafka, topic_prefix, log, *args)
    try:
        wait_log(log, "partitions assigned")
        prog.wait_done(60, [svc])
        # The fixed clock's late samples are one pending run: the good GPU's next sample, after a
        # quiet gap, ends it and its corrections go out.
        time.sleep(2.5)
        produce(kafka, t_in, [dict(good, timestamp_ms=int(time.time() * 1000))], partition=0)
        prog.refresh_high()
        prog.wait_done(60, [svc])
        deadline = time.monotonic() + 30
        while not [
            r for r in read_output(kafka, topic_prefix + topics.CHARGEBACK) if r["kind"] == "correction"
        ]:
            assert time.monotonic() < deadline and svc.poll() is None, log.read_text()[-3000:]
            time.sleep(0.5)
        assert stop_service(svc) == 0, log.read_text()[-3000:]
    finally:
        if svc.poll() is None:
            svc.kill()
            svc.wait()
        prog.close()
    out = read_output(kafka, topic_prefix + topics.CHARGEBACK)
    assert out, log.read_text()[-3000:]
    assert [r for r in out if r["kind"] == "correction" and r["namespace"] == "good"] == []
    assert max(r["window_start_ms"] for r in out) < now + 60_000  # nothing billed a day ahead
    by_ns = totals(out, ("window_start_ms", "namespace"))
    for (ws, ns), v in by_ns.items():
        if ns == "good":  # every closed window of the good GPU is whole: 30 samples x 10 s
            assert v["allocated_gpu_seconds"] == pytest.approx(300.0), ws
    # The day-ahead samples closed the windows before them (broker time is now), so the fixed
    # clock's later samples land in corrections; each sample is still counted once.
    fast_samples = sum(r["sample_count"] for r in out if r["namespace"] == "fast")
    closed_fast = sum(1 for s in items[ticks:] if s["timestamp_ms"] < now)
    assert 0 < fast_samples <= closed_fast + 30
    m = re.search(r"clock_ahead=(\d+)", log.read_text())
    assert m and int(m.group(1)) == 30, log.read_text()[-2000:]


def test_an_idle_partition_closes_its_last_window(kafka: str, topic_prefix: str, tmp_path: Path) -> None:
    """GPUs of partition 1 stopped 20 minutes ago; after --idle-timeout their last
    window closes by broker time and the partition's checkpoint reaches its end."""
    ensure_topics(kafka, [topics.SAMPLES, topics.CHARGEBACK, topics.DEADLETTER], prefix=topic_prefix)
    t_in = topic_prefix + topics.SAMPLES
    now = int(time.time() * 1000)
    start = now - now % 300_000 - 1_800_000
    (busy,), (gone,) = samples("busy", 1, 0, 1), samples("gone", 1, 0, 1)
    produce(kafka, t_in, [dict(busy, timestamp_ms=t) for t in range(start, now, 10_000)], partition=0)
    gone_items = [
        dict(gone, timestamp_ms=t) for t in range(start, now - 1_200_000, 10_000)
    ]  # stale after 15.5 min
    produce(kafka, t_in, gone_items, partition=1)
    group, log = f"cb-idle-{new_id()}", tmp_path / "cb.log"
    prog = Progress(kafka, group, t_in)
    args = ("--window", "5m", "--grace", "30s", "--group-id", group, "--idle-timeout", "2s")
    svc = start_service(kafka, topic_prefix, log, *args)
    try:
        wait_log(log, "partitions assigned")
        prog.wait_done(60, [svc])
        deadline = time.monotonic() + 30
        while True:  # the checkpoint of the idle partition reaches its end (nothing to replay)
            committed = {
                tp.partition: tp.offset for tp in prog.c.committed([TopicPartition(t_in, 1)], timeout=10)
            }
            if committed[1] == len(gone_items):
                break
            assert time.monotonic() < deadline, f"checkpoint pinned at {committed} of {len(gone_items)}"
            time.sleep(0.2)
        assert stop_service(svc) == 0, log.read_text()[-3000:]
    finally:
        if svc.poll() is None:
            svc.kill()
            svc.wait()
        prog.close()
    out = read_output(kafka, topic_prefix + topics.CHARGEBACK)
    gone_total = sum(r["allocated_gpu_seconds"] for r in out if r["namespace"] == "gone")
    assert gone_total == pytest.approx(10.0 * len(gone_items))  # its last window included
    # W1: the true positions, for lag tooling, on <group>.progress (the group's own offset is a
    # checkpoint, a window behind by design).
    progress = Consumer({"bootstrap.servers": kafka, "group.id": f"{group}.progress"})
    try:
        tps = progress.committed([TopicPartition(t_in, 0), TopicPartition(t_in, 1)], timeout=10)
    finally:
        progress.close()
    busy_count = len(range(start, now, 10_000))
    assert [tp.offset for tp in tps] == [busy_count, len(gone_items)]
