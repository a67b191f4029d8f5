"""Failure paths of the chargeback loop that must never lose, double or silently stop billing.

Review findings D1 (a fatal commit lost closed windows), D2 (a fatal consumer error left a healthy
zombie), D3 (foreign partitions) and L3 (cooperative assignor), against the in-memory broker of
``test_chargeback_service`` (a real broker cannot fail a commit on cue).
"""

from __future__ import annotations

import json
import threading
from typing import Any

import pytest
from confluent_kafka import KafkaError, KafkaException, TopicPartition

from gpupipe.common.errors import ConfigError
from gpupipe_consumers.chargeback import service as service_mod
from gpupipe_consumers.chargeback.service import ChargebackFatalError, ChargebackService, ServiceConfig
from gpupipe_consumers.chargeback.settings import ChargebackSettings, build_engine
from gpupipe_schemas.codec import AvroCodec
from tests.unit.consumers.chargeback.test_service import (
    DLQ,
    IN,
    OUT,
    Broker,
    FakeConsumer,
    FakeProducer,
    expected_output,
    fake_service,
    input_log,
    output,
    run_service,
)

FAST = {"batch_size": 300, "commit_records": 300, "commit_interval_s": 0.0}


class FlakyProducer(FakeProducer):
    """commit_transaction fails with ``error`` for the first transaction that carries window records."""

    def __init__(self, broker: Broker, error: KafkaError) -> None:
        super().__init__(broker)
        self.error: KafkaError | None = error

    def commit_transaction(self, timeout: float) -> None:
        if self.error is not None and any(t == OUT for t, _ in self.staged):
            raise KafkaException(self.error)
        super().commit_transaction(timeout)


def make_service(
    broker: Broker, stop: threading.Event, prod: Any, consumer: Any = None, **cfg: Any
) -> ChargebackService:
    return fake_service(
        lambda conf: consumer or FakeConsumer(broker, stop), lambda conf: prod, **{**FAST, **cfg}
    )


@pytest.mark.parametrize(
    "error",
    [
        KafkaError(KafkaError._TIMED_OUT, "coordinator unavailable", retriable=True),  # past the retry budget
        KafkaError(KafkaError._FENCED, "fenced by a newer instance", fatal=True),
    ],
    ids=["retriable-too-long", "fenced"],
)
def test_fatal_commit_keeps_closed_windows_for_the_restart(
    error: KafkaError, monkeypatch: pytest.MonkeyPatch
) -> None:
    """D1: after a failed commit nothing commits past the drained windows; a restart emits them."""
    monkeypatch.setattr(service_mod, "_RETRY_FOR_S", 0.0)
    log, fed = input_log()
    broker = Broker(log)
    stop = threading.Event()
    svc = make_service(broker, stop, FlakyProducer(broker, error))
    with pytest.raises(ChargebackFatalError):
        svc.run(stop)
    before = dict(broker.offsets)
    assert svc.failed and not svc.health()[0]
    # Nothing may have committed in the failing run after the failure: no output, and every
    # committed checkpoint still below the first window's records (the dead letter at 37 included).
    assert [t for t, _ in broker.output if t == OUT] == []
    assert all(until_ok(meta, 37) for _, meta in before.values()), before
    run_service(broker, **FAST)
    assert output(broker) == expected_output(fed)
    assert [v for t, v in broker.output if t == DLQ] == [b"garbage"]


def until_ok(meta: str | None, dead_letter_offset: int) -> bool:
    import json

    return meta is None or json.loads(meta)["until"] <= dead_letter_offset


class FatalEventConsumer(FakeConsumer):
    """Delivers a _FATAL error event (a fenced static member) after the first batch."""

    def __init__(self, broker: Broker, stop: threading.Event, via_callback: bool) -> None:
        super().__init__(broker, stop)
        self.calls = 0
        self.via_callback = via_callback
        self.error_cb: Any = None

    def consume(self, n: int, timeout: float) -> list:
        self.calls += 1
        if self.calls < 3:
            return super().consume(n, timeout)
        err = KafkaError(KafkaError._FATAL, "Broker: Static consumer fenced by other consumer")
        if self.via_callback:
            self.error_cb(err)
            return []
        return [ErrorMsg(err)]


class ErrorMsg:
    def __init__(self, err: KafkaError) -> None:
        self._err = err

    def error(self) -> KafkaError:
        return self._err


@pytest.mark.parametrize("via_callback", [False, True], ids=["consume-event", "error_cb"])
def test_fatal_consumer_error_ends_the_service(via_callback: bool) -> None:
    """D2: a _FATAL event (fatal() False) or a fatal error_cb ends the loop at once, unhealthy."""
    log, _ = input_log(ticks=300)
    broker = Broker(log)
    stop = threading.Event()
    consumer = FatalEventConsumer(broker, stop, via_callback)
    confs: list[dict] = []

    def factory(conf: dict) -> FatalEventConsumer:
        confs.append(conf)
        consumer.error_cb = conf["error_cb"]
        return consumer

    svc = fake_service(factory, lambda conf: FakeProducer(broker), **FAST)
    with pytest.raises(ChargebackFatalError, match="fenced"):
        svc.run(stop)
    assert consumer.calls == 3, "the loop went on consuming after the fatal error"
    assert not stop.is_set()  # it ended because of the error, not because the input ran out
    assert not svc.health()[0]


def test_partitions_of_another_topic_are_refused() -> None:
    """D3: a group shared with another environment hands us its topic: fatal, never consumed."""
    broker = Broker(input_log(ticks=10)[0])
    stop = threading.Event()

    class Foreign(FakeConsumer):
        def consume(self, n: int, timeout: float) -> list:
            if self.pending_assign:
                self.pending_assign = False
                self.on_assign(self, [TopicPartition("prod." + IN, 0)])
            return []

    svc = make_service(broker, stop, FakeProducer(broker), Foreign(broker, stop))
    with pytest.raises(ChargebackFatalError, match="another environment"):
        svc.run(stop)
    assert broker.offsets == {} and broker.output == []


@pytest.mark.parametrize(
    "extra",
    [
        {"partition.assignment.strategy": "cooperative-weird"},
        {"group.protocol": "consumer"},
        {"transactional.id": "x"},
    ],
)
def test_unsupported_client_overrides_are_refused_at_start(extra: dict[str, str]) -> None:
    """L3: a cooperative assignor would break the eager assign/revoke protocol mid-run."""
    with pytest.raises(ConfigError):
        ChargebackService(
            ServiceConfig(
                bootstrap="fake", input_topic=IN, output_topic=OUT, deadletter_topic=DLQ, extra=extra
            ),
            build_engine(ChargebackSettings(), None, "svc"),  # type: ignore[arg-type]
            AvroCodec(),
            consumer_factory=lambda conf: None,
            producer_factory=lambda conf: None,
        )


class AbortFailsProducer(FakeProducer):
    """The commit needs an abort (abortable error), and the abort itself fails fatally."""

    def commit_transaction(self, timeout: float) -> None:
        if any(t == OUT for t, _ in self.staged):
            raise KafkaException(KafkaError(KafkaError._STATE, "needs abort", txn_requires_abort=True))
        super().commit_transaction(timeout)

    def abort_transaction(self, timeout: float) -> None:
        raise KafkaException(KafkaError(KafkaError._FENCED, "fenced while aborting", fatal=True))


def test_a_failing_abort_ends_the_service_without_committing_past_anything() -> None:
    log, fed = input_log()
    broker = Broker(log)
    stop = threading.Event()
    svc = make_service(broker, stop, AbortFailsProducer(broker))
    with pytest.raises(ChargebackFatalError):
        svc.run(stop)
    assert [t for t, _ in broker.output if t == OUT] == []
    assert all(until_ok(meta, 37) for _, meta in broker.offsets.values()), broker.offsets
    run_service(broker, **FAST)
    assert output(broker) == expected_output(fed)
    assert [v for t, v in broker.output if t == DLQ] == [b"garbage"]


def test_output_is_keyed_by_namespace_and_node() -> None:
    """L8: one large namespace must not make one output partition hot."""
    from gpupipe_consumers.chargeback.service import output_key

    assert output_key({"namespace": "ml", "node": "gpu-07"}) == b"ml/gpu-07"


class ScrapingConsumer(FakeConsumer):
    """Reads the service's gauges before every consume(), as a Prometheus scrape in between does."""

    svc: ChargebackService

    def __init__(self, broker: Broker, stop: threading.Event) -> None:
        super().__init__(broker, stop)
        self.seen: list[tuple[float | None, float | None]] = []

    def consume(self, n: int, timeout: float) -> list:
        if self.pos:  # assigned
            get = self.svc.registry.get_sample_value
            label = {"partition": "0"}
            self.seen.append(
                (
                    get("gpupipe_chargeback_replay_remaining_records", label),
                    get("gpupipe_chargeback_lag_records", label),
                )
            )
        return super().consume(n, timeout)


def test_a_replay_in_progress_shows_in_its_gauge_and_the_lag() -> None:
    """L7: the replay-remaining gauge (what the ChargebackReplayNotFinishing rule watches) and the
    lag follow the replay as it goes. They were refreshed only by a committed transaction, and a
    replay commits nothing (its restored checkpoint stands), so a scrape saw 0 and no lag until the
    replay was over: an alert on it could never fire for a replay that never finishes."""
    log, _ = input_log()
    broker = Broker(log)
    run_service(broker, **FAST)
    until = json.loads(broker.offsets[0][1])["until"]
    assert broker.offsets[0][0] < until - 30  # what a restart replays, in batches of 10
    stop = threading.Event()
    consumer = ScrapingConsumer(broker, stop)
    svc = make_service(broker, stop, FakeProducer(broker), consumer, batch_size=10)
    consumer.svc = svc
    svc.run(stop)
    replaying = [(r, lag) for r, lag in consumer.seen if r]
    assert len(replaying) >= 2, consumer.seen
    remaining = [r for r, _ in replaying]
    assert remaining == sorted(remaining, reverse=True) and remaining[0] > 20
    assert len(set(remaining)) >= 3  # it falls as the replay goes, not only at its end
    assert all(lag is not None and lag >= r for r, lag in replaying)
    assert consumer.seen[-1][0] == 0  # and reads 0 once the replay is over


def test_the_start_time_gauge_is_this_process_start() -> None:
    """L7: a crash loop shows as changes of gpupipe_chargeback_start_time_seconds."""
    import time

    broker = Broker(input_log(ticks=10)[0])
    before = time.time()
    svc = make_service(broker, threading.Event(), FakeProducer(broker))
    started = svc.registry.get_sample_value("gpupipe_chargeback_start_time_seconds")
    assert started is not None and before <= started <= time.time()
