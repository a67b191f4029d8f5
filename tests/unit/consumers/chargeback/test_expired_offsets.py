"""A partition without any committed offset: a new deployment's (nothing to de-duplicate, nothing
held, nothing read back) or one whose group offsets expired or were deleted while the output topic
holds its windows (held until the ids on the output topic are known, counted once)."""

from __future__ import annotations

import logging
import threading
from types import SimpleNamespace
from typing import Any

import pytest
from confluent_kafka import KafkaError, KafkaException, TopicPartition

from gpupipe_consumers.chargeback.emitted import EmittedIdsReader, holds_records_since
from gpupipe_consumers.chargeback.service import ChargebackService
from gpupipe_schemas.codec import AvroCodec
from tests.unit.consumers.chargeback.test_counter_dedupe import allocated
from tests.unit.consumers.chargeback.test_service import (
    OUT,
    Broker,
    FakeConsumer,
    FakeProducer,
    Msg,
    fake_service,
    input_log,
)

MISSING = "gpupipe_chargeback_missing_checkpoints_total"
DUPLICATES = "gpupipe_chargeback_counter_duplicates_total"


class OutputConsumer(FakeConsumer):
    """Also answers for the output topic: ``output`` is ``absent`` (never created), ``empty``,
    ``old`` (records, none within the lookback), ``recent`` or ``failing`` (the broker does not
    answer). Its records sit in output partition 0 of 3. Stops only once no read-back is running,
    so a test sees what the read released."""

    def __init__(self, broker: Broker, stop: threading.Event, output: str) -> None:
        super().__init__(broker, stop)
        self.output = output
        self.reads_done: Any = lambda: True
        self.asked_output = 0

    def consume(self, n: int, timeout: float) -> list[Msg]:
        if not self.reads_done():
            self.idle = 0
        return super().consume(n, timeout)

    def list_topics(self, topic: str | None = None, timeout: float = -1) -> Any:
        md = super().list_topics(topic, timeout)
        if topic == OUT:
            self.asked_output += 1
            if self.output == "failing":
                raise KafkaException(KafkaError(KafkaError._TIMED_OUT, "no answer"))
            if self.output != "absent":
                md.topics[OUT] = SimpleNamespace(partitions=dict.fromkeys(range(3)), error=None)
        return md

    def held_out(self) -> int:
        return 0 if self.output in ("absent", "empty") else sum(1 for t, _ in self.b.output if t == OUT)

    def get_watermark_offsets(self, tp: TopicPartition, timeout: float = 0, cached: bool = False) -> tuple:
        if tp.topic == OUT:
            return 0, self.held_out() if tp.partition == 0 else 0
        return super().get_watermark_offsets(tp, timeout, cached)

    def offsets_for_times(self, tps: list[TopicPartition], timeout: float) -> list[TopicPartition]:
        at = 0 if self.output == "recent" else -1
        return [TopicPartition(tp.topic, tp.partition, at if self.held_out() else -1) for tp in tps]


def service(broker: Broker, output: str) -> tuple[ChargebackService, OutputConsumer, list[set[int]]]:
    """A service over ``broker`` whose read-back reads ``broker``'s output; the partitions of every
    read it starts are in the list returned."""
    stop = threading.Event()
    consumer = OutputConsumer(broker, stop, output)
    svc = fake_service(
        lambda conf: consumer,
        lambda conf: FakeProducer(broker),
        batch_size=250,
        commit_records=250,
        commit_interval_s=0.0,
    )
    reads: list[set[int]] = []
    real_start = svc.emitted_ids.start

    def start(partitions: set[int], since_ms: int) -> threading.Thread:
        reads.append(set(partitions))
        return real_start(partitions, since_ms)

    svc.emitted_ids.start = start  # type: ignore[method-assign]
    svc.emitted_ids.read = lambda *a, **k: iter(
        [Msg(0, i, v, 0) for i, (t, v) in enumerate(broker.output) if t == OUT]
    )
    consumer.reads_done = lambda: not any(t.is_alive() for t in svc.emitted_ids.threads)
    return svc, consumer, reads


def run(svc: ChargebackService) -> None:
    svc.prepare()
    consumer = svc.partitions.consumer
    svc.run(consumer.stop)  # the fake consumer sets it once the input is drained


def windows(broker: Broker) -> int:
    return sum(1 for t, _ in broker.output if t == OUT)


def expire(broker: Broker) -> None:
    """What offsets.retention.minutes (or deleting the group) leaves: no committed offset at all."""
    broker.offsets.clear()


@pytest.mark.parametrize("output", ["absent", "empty"])
def test_a_new_deployment_holds_nothing_and_reads_nothing_back(
    output: str, caplog: pytest.LogCaptureFixture
) -> None:
    log, _ = input_log()
    broker = Broker(log)
    svc, consumer, reads = service(broker, output)
    with caplog.at_level(logging.WARNING, logger="gpupipe.chargeback"):
        run(svc)
    assert consumer.asked_output >= 1  # every partition started fresh with input: asked once
    assert reads == [] and svc.emitted_ids.threads == []
    assert svc.registry.get_sample_value(MISSING) == 0
    assert svc.registry.get_sample_value(DUPLICATES) == 0
    assert allocated(svc.registry) > 0
    assert "without a committed offset" not in caplog.text


def test_expired_offsets_with_windows_on_the_output_are_held_and_counted_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    log, _ = input_log()
    broker = Broker(log)
    first, _, _ = service(broker, "recent")  # empty output at start: a new deployment
    run(first)
    counted, emitted = allocated(first.registry), windows(broker)
    assert counted > 0 and emitted > 0
    assert first.registry.get_sample_value(MISSING) == 0

    expire(broker)
    second, _, reads = service(broker, "recent")
    with caplog.at_level(logging.WARNING, logger="gpupipe.chargeback"):
        run(second)
    assert windows(broker) == 2 * emitted  # re-processed from the start, every window again
    assert reads == [{0, 1}]  # one read-back for both partitions
    assert second.registry.get_sample_value(MISSING) == 2
    assert second.registry.get_sample_value("gpupipe_chargeback_foreign_checkpoints_total") == 0
    assert second.registry.get_sample_value(DUPLICATES) == emitted
    assert allocated(second.registry) == 0  # all of it was counted by the first process
    assert second.window_counters.held() == {}
    assert "partitions start without a committed offset while the output topic holds" in caplog.text
    assert not any(t.is_alive() for t in second.emitted_ids.threads)


def test_a_fresh_partition_without_input_to_replay_is_not_held() -> None:
    log, _ = input_log()
    log[2] = []  # nothing retained: nothing can be re-emitted
    broker = Broker(log)
    run(service(broker, "recent")[0])
    expire(broker)
    svc, _, reads = service(broker, "recent")
    run(svc)
    assert reads == [{0, 1}]
    assert svc.registry.get_sample_value(MISSING) == 2


def test_output_records_past_the_lookback_hold_nothing() -> None:
    """Records older than the lookback cannot be re-emitted (the input's retention is shorter)."""
    log, _ = input_log(ticks=100)
    broker = Broker(log)
    run(service(broker, "recent")[0])
    expire(broker)
    svc, _, reads = service(broker, "old")
    run(svc)
    assert reads == []
    assert svc.registry.get_sample_value(MISSING) == 0


def test_an_unanswered_check_holds_and_reads_back_but_counts_no_expiry(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Unknown is not "nothing there": the partitions are held and read back (their re-emitted
    windows counted once), with a warning; the expired-offsets metric counts only known cases."""
    log, _ = input_log(ticks=100)
    broker = Broker(log)
    run(service(broker, "recent")[0])
    expire(broker)
    svc, _, reads = service(broker, "failing")
    with caplog.at_level(logging.WARNING, logger="gpupipe.chargeback"):
        run(svc)
    assert reads == [{0, 1}]
    assert svc.registry.get_sample_value(MISSING) == 0
    assert "cannot tell whether the output topic holds windows" in caplog.text


def test_holds_records_since_asks_the_offsets_only_of_partitions_holding_records() -> None:
    asked: list[list[int]] = []
    water = {0: (5, 5), 1: (0, 3), 2: (0, 0)}
    consumer = SimpleNamespace(
        list_topics=lambda topic, timeout: SimpleNamespace(
            topics={"out": SimpleNamespace(partitions=dict.fromkeys(water), error=None)}
        ),
        get_watermark_offsets=lambda tp, timeout: water[tp.partition],
        offsets_for_times=lambda tps, timeout: (
            asked.append([tp.partition for tp in tps])
            or [TopicPartition("out", tp.partition, 1) for tp in tps]
        ),
    )
    assert holds_records_since(consumer, "out", 0, 1.0)
    assert asked == [[1]]
    assert not holds_records_since(consumer, "missing", 0, 1.0)


def test_holds_records_since_raises_when_a_partition_does_not_answer() -> None:
    """A partition whose offset lookup failed may hold records: not an answer of "no"."""
    failed = SimpleNamespace(error=KafkaError(KafkaError._TIMED_OUT), offset=-1)
    consumer = SimpleNamespace(
        list_topics=lambda topic, timeout: SimpleNamespace(
            topics={"out": SimpleNamespace(partitions={0: None}, error=None)}
        ),
        get_watermark_offsets=lambda tp, timeout: (0, 3),
        offsets_for_times=lambda tps, timeout: [failed],
    )
    with pytest.raises(KafkaException):
        holds_records_since(consumer, "out", 0, 1.0)


def test_close_ends_a_read_still_going_and_releases_nothing() -> None:
    released: list[int] = []
    began = threading.Event()

    def read(*args: Any, stop: threading.Event, **kwargs: Any) -> Any:
        began.set()
        stop.wait(30)  # a read waiting on the broker, as iter_messages does until stopped
        return iter([])

    reader = EmittedIdsReader(
        bootstrap="unused",
        topic="out",
        group_id="g",
        codec=AvroCodec(),
        extra=None,
        release=lambda p, ids: released.append(p),
        read=read,
    )
    t = reader.start({0}, 0)
    assert began.wait(10)
    reader.close(timeout_s=10)
    assert not t.is_alive() and reader.threads == []
    assert released == []
