"""A consumer whose ACL is revoked while it runs exits with one line, it does not spin."""

from __future__ import annotations

import threading
from typing import Any

import pytest
from confluent_kafka import KafkaError
from prometheus_client import CollectorRegistry

from gpupipe.kafka.auth import KafkaAuthError
from gpupipe_consumers.plumbing.consume_loop import ConsumeLoop
from gpupipe_schemas.codec import AvroCodec


class _Msg:
    def __init__(self, code: int, topic: str | None) -> None:
        self._err = KafkaError(code)
        self._topic = topic

    def error(self) -> KafkaError:
        return self._err

    def topic(self) -> str | None:
        return self._topic


class _Consumer:
    """Answers consume() like librdkafka does after the principal lost READ on the topic."""

    def __init__(self, code: int, topic: str | None) -> None:
        self.code, self.topic = code, topic
        self.polls = 0

    def subscribe(self, topics: list[str], **kw: Any) -> None:
        pass

    def consume(self, n: int, timeout: float) -> list[_Msg]:
        self.polls += 1
        return [_Msg(self.code, self.topic)]

    def close(self) -> None:
        pass


@pytest.mark.parametrize(
    ("code", "topic", "line"),
    [
        (
            KafkaError.TOPIC_AUTHORIZATION_FAILED,
            "gpu.xid.v1",
            "Kafka denied User:alerts READ on topic gpu.xid.v1 (TOPIC_AUTHORIZATION_FAILED)",
        ),
        (
            KafkaError.GROUP_AUTHORIZATION_FAILED,
            None,
            "Kafka denied User:alerts READ on group gpupipe-alerts (GROUP_AUTHORIZATION_FAILED)",
        ),
    ],
)
def test_a_revoked_acl_ends_the_loop_with_one_line(code: int, topic: str | None, line: str) -> None:
    fake = _Consumer(code, topic)
    loop = ConsumeLoop(
        bootstrap="127.0.0.1:1",
        group_id="gpupipe-alerts",
        topics=["gpu.xid.v1"],
        handler=None,  # type: ignore[arg-type]  # never reached
        codec=AvroCodec(),
        deadletter_topic="gpu.deadletter.v1",
        service="alerts",
        registry=CollectorRegistry(),
        extra={
            "security.protocol": "SASL_SSL",
            "sasl.mechanism": "SCRAM-SHA-512",
            "sasl.username": "alerts",
            "sasl.password": "x",
        },
        consumer_factory=lambda conf: fake,
    )
    with pytest.raises(KafkaAuthError) as exc:
        loop.run(threading.Event())
    assert str(exc.value) == line
    assert fake.polls == 1
