"""Three brokers (replication 3, min.insync.replicas 2): a leader killed, a broker paused, topic copies.

The services run as they do in production (``python -m gpupipe ...``) against the ``kafka_cluster``
fixture; brokers are killed, paused and restarted with ``scripts/kafka-local broker N ...``. Every
wait polls the cluster or the services; the one fixed interval is the pause itself.
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest
from confluent_kafka import Consumer, KafkaException, TopicPartition
from confluent_kafka.admin import ConfigResource, ConfigSource

from gpupipe.common.durations import parse_iso_ms
from gpupipe.kafka import topics
from gpupipe_consumers.chargeback.accounting import gpu_fraction
from gpupipe_producer.simulated.fleet import FleetConfig, SimulatedFleet
from gpupipe_schemas.codec import AvroCodec
from tests import hygiene
from tests.conftest import free_port
from tests.integration.chargeback_util import (
    Progress,
    counter_sum,
    new_id,
    past_hour_ms,
    read_output,
    start_service,
    stop_service,
    totals,
    window_keys,
)
from tests.integration.kafka_util import GPUPIPE, REPO, read_all
from tests.integration.metrics_helpers import http_get, start_metrics
from tests.kafka_cluster import KafkaCluster, await_true

pytestmark = pytest.mark.integration


def _produce(cluster: KafkaCluster, prefix: str, *args: str) -> subprocess.Popen:
    return hygiene.popen(
        [*GPUPIPE, "produce", "--source", "simulated", "--bootstrap-servers", cluster.bootstrap,
         "--topic-prefix", prefix, "--log-format", "text", "--log-level", "warning", *args],
        cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


def _highs(cluster: KafkaCluster, topic: str, only: set[int] | None = None) -> dict[int, int]:
    """High watermarks of the topic's partitions (``only`` those), -1 where the leader does not answer."""
    c = Consumer({"bootstrap.servers": cluster.bootstrap, "group.id": f"hw-{new_id()}"})
    out = {}
    try:
        for p in c.list_topics(topic, timeout=5).topics[topic].partitions:
            if only is None or p in only:
                try:
                    out[p] = c.get_watermark_offsets(TopicPartition(topic, p), timeout=5)[1]
                except KafkaException:
                    out[p] = -1
        return out
    finally:
        c.close()


def test_topics_the_services_create_have_three_copies_two_in_sync(kafka_cluster: KafkaCluster) -> None:
    prefix = f"rf-{new_id()}."
    proc = _produce(kafka_cluster, prefix, "--nodes", "1", "--gpus-per-node", "1", "--duration", "1s",
                    "--speed", "max")  # fmt: skip
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-2000:]
    admin = kafka_cluster.admin()
    md = admin.list_topics(timeout=10).topics
    names = [prefix + base for base in topics.ALL]
    for name in names:
        assert {len(p.replicas) for p in md[name].partitions.values()} == {3}, name
    for res, fut in admin.describe_configs([ConfigResource("topic", n) for n in names]).items():
        entry = fut.result()["min.insync.replicas"]
        # set on the topic itself, not inherited: a cluster whose brokers default to 1 gets 2 as well
        assert (entry.value, entry.source) == ("2", ConfigSource.DYNAMIC_TOPIC_CONFIG.value), res


def test_xids_exactly_once_when_their_partition_leader_is_killed(kafka_cluster: KafkaCluster) -> None:
    prefix, start = f"xidkill-{new_id()}.", "2026-11-30T00:00:00Z"
    nodes, gpus, rate, minutes, seed = 2, 4, 900, 30, 11
    xid_topic = prefix + topics.XID
    proc = _produce(
        kafka_cluster, prefix, "--nodes", str(nodes), "--gpus-per-node", str(gpus), "--interval", "1s",
        "--duration", f"{minutes}m", "--start-time", start, "--speed", "60", "--seed", str(seed),
        "--xid-rate", str(rate),
    )  # fmt: skip
    victim_node = None
    try:
        # Kill the leader of the busiest XID partition once XIDs flow into it.
        highs = await_true(
            "XIDs on Kafka", lambda: (h := _highs(kafka_cluster, xid_topic)) and max(h.values()) > 0 and h
        )
        part = max(highs, key=highs.__getitem__)
        victim_node = kafka_cluster.leader(xid_topic, part)
        kafka_cluster.broker(victim_node, "kill")
        killed_at = time.monotonic()
        admin = kafka_cluster.admin()
        new = await_true(
            "a new leader",
            lambda: (
                (p := kafka_cluster.partition(xid_topic, part, admin)).leader not in (-1, victim_node) and p
            ),
            timeout=60,
            every=0.05,
        )
        elected_s = time.monotonic() - killed_at
        assert new.leader in new.isrs
        assert proc.poll() is None, "the stream must outlast the election"
        kafka_cluster.broker(victim_node, "start")
        victim_node = None
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err[-2000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if victim_node is not None:
            kafka_cluster.broker(victim_node, "start")
    print(f"leader of {xid_topic}[{part}] re-elected {elected_s:.1f}s after SIGKILL of broker")

    fleet = SimulatedFleet(
        FleetConfig(nodes=nodes, gpus_per_node=gpus, interval_ms=1000, seed=seed, xid_rate_per_gpu_hour=rate)
    )
    t0 = parse_iso_ms(start)
    want = sorted(x["event_id"] for k in range(minutes * 60) for x in fleet.tick(t0 + k * 1000)[1])
    assert len(want) > 100
    codec = AvroCodec()
    got = sorted(
        codec.decode(m.value()).record["event_id"]
        for m in read_all(kafka_cluster.bootstrap, xid_topic, expect=len(want))
    )
    assert len(got) == len(set(got)), "an XID on Kafka twice: the producer was not idempotent"
    assert got == want
    # the restarted broker caught up: three in-sync copies of every XID partition again
    await_true(
        "ISR of 3",
        lambda: all(len(kafka_cluster.partition(xid_topic, p).isrs) == 3 for p in highs),
        timeout=60,
    )


def test_a_paused_broker_stops_nothing_and_bills_once(kafka_cluster: KafkaCluster, tmp_path: Path) -> None:
    prefix, group = f"pause-{new_id()}.", f"cb-pause-{new_id()}"
    samples = prefix + topics.SAMPLES
    start_ms = past_hour_ms(3)
    nodes, gpus, interval_s = 3, 4, 10
    port = free_port()
    metrics = start_metrics(
        kafka_cluster.bootstrap, prefix, port, tmp_path / "metrics.log", "--from-beginning"
    )
    cb_log = tmp_path / "chargeback.log"
    cb = start_service(kafka_cluster.bootstrap, prefix, cb_log, "--window", "10m", "--grace", "1m",
                       "--group-id", group, "--instance-id", "p", "--commit-interval", "200ms")  # fmt: skip
    start_iso = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(start_ms / 1000))
    proc = _produce(kafka_cluster, prefix, "--nodes", str(nodes), "--gpus-per-node", str(gpus),
                    "--interval", f"{interval_s}s", "--duration", "1h", "--start-time", start_iso,
                    "--speed", "150", "--seed", "6", "--xid-rate", "0")  # fmt: skip
    paused = None
    prog = None
    try:
        await_true("samples topic", lambda: samples in kafka_cluster.admin().list_topics(timeout=5).topics)
        prog = Progress(kafka_cluster.bootstrap, group, samples)
        await_true("chargeback progress", lambda: prog.committed_total() > 0, timeout=90)
        paused = kafka_cluster.leader(samples, 0)
        before = _highs(kafka_cluster, samples)
        kafka_cluster.broker(paused, "pause")
        served = 0
        pause_end = time.monotonic() + 10
        while time.monotonic() < pause_end:  # the pause is the scenario: the metrics service answers in it
            text = http_get(f"http://127.0.0.1:{port}/metrics", timeout_s=5).decode()
            served += "gpupipe_consumer_records_total" in text
            time.sleep(0.5)
        others = {p for p in before if kafka_cluster.partition(samples, p).leader not in (-1, paused)}
        during = _highs(kafka_cluster, samples, others)
        kafka_cluster.broker(paused, "resume")
        paused = None
        assert served >= 5, "the metrics service stopped answering while a broker was paused"
        assert others and any(during[p] > before[p] for p in others), "samples stopped flowing"
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err[-2000:]
        total = nodes * gpus * 360
        # every sample once (none lost, none written twice), once every leader answers again
        await_true("every sample once", lambda: sum(_highs(kafka_cluster, samples).values()) == total, 30)
        prog.refresh_high()
        prog.wait_done(90, [cb])
        consumed = await_true(
            "metrics consumed every sample",
            lambda: (
                (
                    n := counter_sum(
                        http_get(f"http://127.0.0.1:{port}/metrics").decode(), "gpupipe_consumer_records"
                    )
                )
                >= total
                and n
            ),
            timeout=60,
        )
        assert consumed == total
        assert stop_service(cb) == 0, cb_log.read_text()[-3000:]
    finally:
        if paused is not None:
            kafka_cluster.broker(paused, "resume")
        for p in (proc,):
            if p.poll() is None:
                p.kill()
                p.wait()
        if cb.poll() is None:
            cb.kill()
            cb.wait()
        metrics.stop()
        if prog is not None:
            prog.close()
    out = read_output(kafka_cluster.bootstrap, prefix + topics.CHARGEBACK)
    keys = window_keys(out)
    assert keys and len(keys) == len(set(keys)), "a window billed twice"
    fleet = SimulatedFleet(
        FleetConfig(nodes=nodes, gpus_per_node=gpus, interval_ms=interval_s * 1000, seed=6)
    )
    observed = sum(gpu_fraction(s) for s in fleet.tick(start_ms)[0]) * 600
    per_window = totals(out, ("window_start_ms",))
    assert sorted(ws for (ws,) in per_window) == [start_ms + k * 600_000 for k in range(5)]
    for (ws,), t in per_window.items():
        assert t["allocated_gpu_seconds"] == pytest.approx(observed, rel=1e-9), ws
