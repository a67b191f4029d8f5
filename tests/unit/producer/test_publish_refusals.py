"""The Publisher stops the producer on a delivery that will never pass, and never raises for a refused
record (a WRITE ACL revoked while running is one line and an exit, not a traceback or a
silent spin). Real broker: tests/integration/test_kafka_secure.py::test_a_write_acl_revoked_..."""

from __future__ import annotations

import threading
from typing import Any

from confluent_kafka import KafkaError, KafkaException

from gpupipe_producer.publish import Publisher


class _Msg:
    def __init__(self, topic: str) -> None:
        self._topic = topic

    def topic(self) -> str:
        return self._topic


class _FakeProducer:
    """librdkafka's produce(): raises what the test queues, else stores the delivery callback."""

    def __init__(self, conf: dict[str, Any]) -> None:
        self.on_delivery = conf["on_delivery"]
        self.raise_next: list[KafkaException] = []

    def produce(self, topic: str, value: bytes, key: Any, **kw: Any) -> None:
        if self.raise_next:
            raise self.raise_next.pop(0)


def _publisher() -> tuple[Publisher, _FakeProducer, list[tuple[str, str | None]]]:
    fatal: list[tuple[str, str | None]] = []
    made: list[_FakeProducer] = []

    def factory(conf: dict[str, Any]) -> _FakeProducer:
        made.append(_FakeProducer(conf))
        return made[0]

    pub = Publisher({}, producer_factory=factory, on_fatal=lambda err, t: fatal.append((err.name(), t)))
    return pub, made[0], fatal


def test_a_denied_delivery_is_fatal_once() -> None:
    pub, fake, fatal = _publisher()
    for _ in range(3):
        fake.on_delivery(KafkaError(KafkaError.TOPIC_AUTHORIZATION_FAILED), _Msg("gpu.samples.v1"))
    assert fatal == [("TOPIC_AUTHORIZATION_FAILED", "gpu.samples.v1")]
    assert pub.failed == 3 and pub.fatal is not None


def test_retriable_failures_are_counted_not_fatal() -> None:
    pub, fake, fatal = _publisher()
    fake.on_delivery(KafkaError(KafkaError._MSG_TIMED_OUT), _Msg("gpu.samples.v1"))
    fake.on_delivery(KafkaError(KafkaError._TRANSPORT), _Msg("gpu.xid.v1"))
    assert fatal == [] and pub.failed == 2 and pub.fatal is None


def test_a_record_refused_by_produce_is_counted_not_raised() -> None:
    pub, fake, fatal = _publisher()
    fake.raise_next.append(KafkaException(KafkaError(KafkaError.TOPIC_AUTHORIZATION_FAILED)))
    pub.produce("gpu.samples.v1", b"k", b"v")  # before: the KafkaException ended the process
    fake.raise_next.append(KafkaException(KafkaError(KafkaError.MSG_SIZE_TOO_LARGE)))
    pub.produce("gpu.samples.v1", b"k", b"v" * 10)  # one oversized record is dropped, counted
    assert pub.failed == 2 and pub.failures_by_reason == {
        "TOPIC_AUTHORIZATION_FAILED": 1,
        "MSG_SIZE_TOO_LARGE": 1,
    }
    assert fatal == [("TOPIC_AUTHORIZATION_FAILED", "gpu.samples.v1")]


def test_a_refused_tracked_record_goes_back_to_its_owner() -> None:
    pub, fake, fatal = _publisher()
    got: list[str] = []
    fake.raise_next.append(KafkaException(KafkaError(KafkaError.TOPIC_AUTHORIZATION_FAILED)))
    pub.produce_tracked("gpu.xid.v1", b"k", b"v", lambda err, msg: got.append(err.name()))
    assert got == ["TOPIC_AUTHORIZATION_FAILED"]  # the XID spool keeps it for a later retry
    assert pub.failed == 0 and fatal == [("TOPIC_AUTHORIZATION_FAILED", "gpu.xid.v1")]


def test_a_fatal_delivery_report_is_fatal_although_its_flag_is_not_set() -> None:
    # After a fatal error of the idempotent producer librdkafka fails what is queued with _FATAL,
    # whose fatal() is False (the flag stays on the original error): it was not noticed.
    pub, fake, fatal = _publisher()
    err = KafkaError(KafkaError._FATAL)
    assert not err.fatal()
    fake.on_delivery(err, _Msg("gpu.samples.v1"))
    fake.on_delivery(err, _Msg("gpu.samples.v1"))
    assert fatal == [("_FATAL", "gpu.samples.v1")] and pub.failed == 2


class _FullQueue:
    """librdkafka with its local queue full and the broker away: every produce() is BufferError."""

    def __init__(self, conf: dict[str, Any]) -> None:
        self.attempts = threading.Event()

    def produce(self, topic: str, value: bytes, key: Any, **kw: Any) -> None:
        self.attempts.set()
        raise BufferError("Local: Queue full")

    def poll(self, timeout: float = 0.0) -> int:
        return 0


def test_a_full_queue_waits_for_room_until_the_stop_then_refuses_the_record() -> None:
    stop = threading.Event()
    made: list[_FullQueue] = []
    pub = Publisher({}, producer_factory=lambda conf: made.append(_FullQueue(conf)) or made[0], stop=stop)
    tracked: list[str] = []
    results: list[str] = []

    def send() -> None:
        pub.produce("gpu.samples.v1", b"k", b"v")
        results.append("sample handed back")
        pub.produce_tracked("gpu.xid.v1", b"k", b"v", lambda err, msg: tracked.append(err.name()))
        results.append("xid handed back")

    t = threading.Thread(target=send, name="producing")
    t.start()
    assert made[0].attempts.wait(10)
    assert t.is_alive() and not results  # back-pressure: it waits for room while running
    stop.set()
    t.join(30)
    assert not t.is_alive(), "produce() kept waiting for room after the stop"
    assert results == ["sample handed back", "xid handed back"]
    assert pub.failed == 1 and pub.failures_by_reason == {"_QUEUE_FULL": 1}  # the sample: counted
    assert tracked == ["_QUEUE_FULL"]  # the XID: its caller keeps it in the spool
