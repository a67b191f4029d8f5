"""One keyed, idempotent Kafka sink for the records a service derives (alerts, recommendations).

A service hands records to :meth:`KeyedSink.send` and calls :meth:`KeyedSink.flush` before it commits
the input that caused them. The flush rides out a broker outage: records neither delivered nor failed
are waiting for the broker, and waiting loses nothing, because the input is not committed until the
flush returns. Only a record that *failed* (rejected, timed out by librdkafka) makes the flush raise, so
the service stops and replays that input after a restart. Encoding and keys belong to the caller: this
floor knows no record type.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any, Generic, TypeVar

from confluent_kafka import Producer

from gpupipe.common.errors import GpupipeError
from gpupipe.common.logs import fields
from gpupipe.kafka.admin import client_config

__all__ = ["KeyedSink"]

#: Idempotent, fully acknowledged, lightly batched: derived records are few and must not duplicate.
PRODUCER_SETTINGS: dict[str, Any] = {
    "enable.idempotence": True,
    "acks": "all",
    "linger.ms": 5,
    "compression.type": "zstd",
}


#: The record type a sink takes (a service's TypedDict from the contract).
R = TypeVar("R", bound=Mapping[str, Any])


class KeyedSink(Generic[R]):
    """Records of one kind to one topic, each keyed by ``key(record)``.

    ``what`` names the records in logs and errors ("alert records"). ``fence``, when set, is asked
    per record: once it answers True (a leader that lost its lease) records are dropped, not
    published, and counted in ``fenced_drops``.
    """

    def __init__(
        self,
        bootstrap: str,
        topic: str,
        encode: Callable[[R], bytes],
        key: Callable[[R], bytes],
        *,
        what: str,
        extra: dict[str, str] | None = None,
        log: logging.Logger | None = None,
    ) -> None:
        self.topic = topic
        self.what = what
        self.failed = 0
        self.sent = 0
        #: flushes that found the broker away and waited for it (one per wait round)
        self.outage_waits = 0
        self.fence: Callable[[], bool] | None = None
        self.fenced_drops = 0
        self._encode = encode
        self._key = key
        self._log = log or logging.getLogger("gpupipe.kafka")
        self._producer = Producer(client_config(bootstrap, extra, **PRODUCER_SETTINGS))

    def _delivered(self, err: Any, _msg: Any) -> None:
        if err is not None:
            self.failed += 1
            self._log.error(f"{self.what} not delivered", extra=fields(topic=self.topic, error=str(err)))
        else:
            self.sent += 1

    def send(self, record: R) -> None:
        if self.fence is not None and self.fence():
            if not self.fenced_drops:
                self._log.warning(
                    f"leadership lost: {self.what} no longer published", extra=fields(topic=self.topic)
                )
            self.fenced_drops += 1
            return
        value, key = self._encode(record), self._key(record)
        while True:
            try:
                self._producer.produce(self.topic, value, key, on_delivery=self._delivered)
                break
            except BufferError:  # the local queue is full: let deliveries drain it
                self._producer.poll(0.05)
        self._producer.poll(0)

    def flush(self, timeout_s: float = 30.0) -> None:
        """Return once every record sent is acknowledged; raise if one failed."""
        before = self.failed
        left = self._producer.flush(timeout_s)
        while left and self.failed == before:
            self.outage_waits += 1
            self._log.warning(
                f"{self.what} waiting for the broker", extra=fields(topic=self.topic, left=left)
            )
            left = self._producer.flush(timeout_s)
        if left or self.failed != before:
            raise GpupipeError(
                f"{left} {self.what} not delivered within {timeout_s:g}s and {self.failed - before} "
                "failed: stopping so that the input is replayed after a restart"
            )
