"""On a real broker: an offset reset (``kafka-consumer-groups --reset-offsets`` writes
offsets without our metadata) makes chargeback re-process and re-emit its output; the records carry
the same idempotency keys and ``gpupipe report chargeback`` counts them once (L4: with ``--from``
it starts at the offsets for that time instead of the beginning)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from confluent_kafka import ConsumerGroupTopicPartitions, TopicPartition
from confluent_kafka.admin import AdminClient

from gpupipe.common.durations import format_iso_ms
from gpupipe.kafka import topics
from gpupipe.kafka.admin import ensure_topics
from tests.integration.chargeback_util import (
    Progress,
    counter_sum,
    new_id,
    read_output,
    run_and_scrape,
    start_service,
    stop_service,
    wait_log,
)
from tests.integration.consumers.chargeback.test_environments import T0, produce, samples
from tests.integration.kafka_util import gpupipe

pytestmark = pytest.mark.integration


def run_to_end(kafka: str, prefix: str, group: str, log: Path) -> None:
    prog = Progress(kafka, group, prefix + topics.SAMPLES)
    # Without static membership the stopped instance leaves the group, so its offsets can be reset.
    args = ("--window", "10m", "--grace", "1m", "--group-id", group, "--no-static-membership")
    svc = start_service(kafka, prefix, log, *args)
    try:
        prog.wait_done(60, [svc])
        assert stop_service(svc) == 0, log.read_text()[-3000:]
    finally:
        if svc.poll() is None:
            svc.kill()
            svc.wait()
        prog.close()


def report(kafka: str, prefix: str, *extra: str) -> tuple[float, str]:
    res = gpupipe(
        "report", "chargeback", "--bootstrap-servers", kafka, "--topic-prefix", prefix,
        "--format", "json", "--period", "all", *extra,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    return sum(r["gpu_hours_allocated"] for r in json.loads(res.stdout)), res.stderr


def test_an_offset_reset_re_emits_but_the_report_counts_once(
    kafka: str, topic_prefix: str, tmp_path: Path
) -> None:
    ensure_topics(kafka, [topics.SAMPLES, topics.CHARGEBACK, topics.DEADLETTER], prefix=topic_prefix)
    t_in = topic_prefix + topics.SAMPLES
    produce(kafka, t_in, samples("a", 4, 0, 90))  # 15 min per GPU: window 0 closes
    group, log = f"cb-reset-{new_id()}", tmp_path / "cb.log"
    run_to_end(kafka, topic_prefix, group, log)
    once = read_output(kafka, topic_prefix + topics.CHARGEBACK)
    assert once and sum(r["allocated_gpu_seconds"] for r in once) == pytest.approx(4 * 600.0)

    # What an operator's --reset-offsets --to-earliest does: offsets 0, empty metadata.
    admin = AdminClient({"bootstrap.servers": kafka})
    parts = sorted(admin.list_topics(t_in, timeout=10).topics[t_in].partitions)
    req = ConsumerGroupTopicPartitions(group, [TopicPartition(t_in, p, 0) for p in parts])
    for fut in admin.alter_consumer_group_offsets([req]).values():
        res = fut.result(timeout=30)
        assert all(tp.error is None for tp in res.topic_partitions), res.topic_partitions
    run_to_end(kafka, topic_prefix, group, log)
    wait_log(log, "partition starts fresh")  # metadata gone: re-processed from the start
    twice = read_output(kafka, topic_prefix + topics.CHARGEBACK)
    assert len(twice) == 2 * len(once)  # the silent re-emission the review describes
    assert sorted(r["record_id"] for r in twice) == sorted(2 * [r["record_id"] for r in once])

    hours, stderr = report(kafka, topic_prefix)
    assert hours == pytest.approx(4 * 600.0 / 3600)
    assert f"{len(once)} re-emitted records counted once" in stderr
    hours_from, _ = report(kafka, topic_prefix, "--from", format_iso_ms(T0))
    assert hours_from == pytest.approx(hours)
    hours_later, _ = report(kafka, topic_prefix, "--from", format_iso_ms(T0 + 600_000))
    assert hours_later == 0.0


def emitted_any(text: str) -> bool:
    return counter_sum(text, "gpupipe_chargeback_records_emitted") > 0


def test_after_an_offset_reset_the_dashboard_counters_count_once_and_say_so(
    kafka: str, topic_prefix: str, tmp_path: Path
) -> None:
    """The Chargeback dashboard sums increase() over every process' counters: a re-emitted window
    counted again by the next process doubled it, while the report (by record id) did not."""
    ensure_topics(kafka, [topics.SAMPLES, topics.CHARGEBACK, topics.DEADLETTER], prefix=topic_prefix)
    t_in = topic_prefix + topics.SAMPLES
    produce(kafka, t_in, samples("a", 4, 0, 90))
    group, log = f"cb-reset-{new_id()}", tmp_path / "cb.log"
    first = run_and_scrape(kafka, topic_prefix, group, log, emitted_any)
    counted = counter_sum(first, "gpupipe_chargeback_allocated_gpu_seconds")
    assert counted == pytest.approx(4 * 600.0)
    once = read_output(kafka, topic_prefix + topics.CHARGEBACK)

    admin = AdminClient({"bootstrap.servers": kafka})
    parts = sorted(admin.list_topics(t_in, timeout=10).topics[t_in].partitions)
    req = ConsumerGroupTopicPartitions(group, [TopicPartition(t_in, p, 0) for p in parts])
    for fut in admin.alter_consumer_group_offsets([req]).values():
        assert all(tp.error is None for tp in fut.result(timeout=30).topic_partitions)

    second = run_and_scrape(
        kafka, topic_prefix, group, log, emitted_any, wait_for="emitted record ids read back"
    )
    assert "committed offsets without a chargeback checkpoint" in log.read_text()
    assert counter_sum(second, "gpupipe_chargeback_foreign_checkpoints") == len(parts)
    assert counter_sum(second, "gpupipe_chargeback_records_emitted") == len(once)  # re-emitted...
    assert counter_sum(second, "gpupipe_chargeback_counter_duplicates") == len(once)  # ...not recounted
    # what a dashboard adds up over both processes is what the report bills
    total = counted + counter_sum(second, "gpupipe_chargeback_allocated_gpu_seconds")
    hours, _ = report(kafka, topic_prefix)
    assert total / 3600 == pytest.approx(hours) == pytest.approx(4 * 600.0 / 3600)
