"""On a real broker: the group's committed offsets are gone (Kafka expires them after
``offsets.retention.minutes`` of an empty group, or an operator deleted them), so chargeback starts
its partitions fresh, replays the retained input and re-emits windows already on the output topic.
The report counts them once by record id; the dashboard counters must too, and say why."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from confluent_kafka.admin import AdminClient

from gpupipe.kafka import topics
from gpupipe.kafka.admin import ensure_topics
from tests.integration.chargeback_util import counter_sum, new_id, read_output, run_and_scrape
from tests.integration.consumers.chargeback.test_environments import produce, samples
from tests.integration.consumers.chargeback.test_reprocess import report

pytestmark = pytest.mark.integration

ALLOCATED = "gpupipe_chargeback_allocated_gpu_seconds"
DUPLICATES = "gpupipe_chargeback_counter_duplicates"
EMITTED = "gpupipe_chargeback_records_emitted"


def settled(emitted: int, seconds: float) -> Callable[[str], bool]:
    """A scrape with ``emitted`` records committed and counted: ``seconds`` is the allocated
    seconds plus those of the duplicates (600 each) the counters skipped."""

    def ready(text: str) -> bool:
        seen = counter_sum(text, ALLOCATED) + 600.0 * counter_sum(text, DUPLICATES)
        return counter_sum(text, EMITTED) >= emitted and seen >= seconds

    return ready


def test_after_the_group_offsets_expire_the_dashboard_counters_count_once_and_say_so(
    kafka: str, topic_prefix: str, tmp_path: Path
) -> None:
    ensure_topics(kafka, [topics.SAMPLES, topics.CHARGEBACK, topics.DEADLETTER], prefix=topic_prefix)
    t_in, t_out = topic_prefix + topics.SAMPLES, topic_prefix + topics.CHARGEBACK
    produce(kafka, t_in, samples("a", 4, 0, 90))  # 15 min per GPU: window 0 (10 min each) closes
    group, log = f"cb-expired-{new_id()}", tmp_path / "cb.log"
    first = run_and_scrape(kafka, topic_prefix, group, log, settled(4, 4 * 600.0), stable=True)
    counted = counter_sum(first, ALLOCATED)
    assert counted == pytest.approx(4 * 600.0)
    assert counter_sum(first, DUPLICATES) == 0
    # A new deployment: every partition starts fresh too, but the output topic is empty.
    assert counter_sum(first, "gpupipe_chargeback_missing_checkpoints") == 0
    assert "emitted record ids read back" not in log.read_text()
    once = read_output(kafka, t_out)
    assert len(once) == 4
    with_windows = {r["source_partition"] for r in once}

    # What expiry leaves (and what deleting the group does): no committed offsets at all.
    admin = AdminClient({"bootstrap.servers": kafka})
    for fut in admin.delete_consumer_groups([group], request_timeout=30).values():
        fut.result(timeout=30)

    # While chargeback was down, window 1 (the next 10 minutes) came in and closes in the next run.
    produce(kafka, t_in, samples("a", 4, 90, 135))
    second = run_and_scrape(kafka, topic_prefix, group, log, settled(8, 4 * 1200.0), stable=True)
    twice = read_output(kafka, t_out)
    assert len(twice) == 12  # window 0 re-emitted (same record ids), window 1 new
    assert counter_sum(second, EMITTED) == 8
    # The second process counts only window 1; window 0's four records were counted by the first.
    assert counter_sum(second, ALLOCATED) == pytest.approx(4 * 600.0)
    assert counter_sum(second, DUPLICATES) == len(once)
    text = log.read_text()
    assert "partitions start without a committed offset while the output topic holds windows" in text
    assert counter_sum(second, "gpupipe_chargeback_missing_checkpoints") == len(with_windows)
    assert counter_sum(second, "gpupipe_chargeback_foreign_checkpoints") == 0
    # what a dashboard adds up over both processes is what the report bills
    hours, stderr = report(kafka, topic_prefix)
    assert f"{len(once)} re-emitted records counted once" in stderr
    assert (counted + counter_sum(second, ALLOCATED)) / 3600 == pytest.approx(hours)
    assert hours == pytest.approx(4 * 1200.0 / 3600)
