"""The Kafka side of the producer: idempotent, acks=all, compressed, batched, keyed by GPU.

:class:`Publisher` counts and logs delivery errors; ``produce()`` never raises BufferError (it serves
delivery reports until there is room); a fatal producer error goes to ``on_fatal`` once, never as a
traceback. Details: docs/producer.md.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from confluent_kafka import KafkaError, KafkaException, Message, Producer

from gpupipe.kafka.admin import client_config

log = logging.getLogger("gpupipe.publish")

# Chosen by bench/bench_produce.py (zstd beats lz4 on our records' wire size; see docs/benchmarks.md).
DEFAULT_COMPRESSION = "zstd"


def producer_config(
    bootstrap: str,
    extra: Mapping[str, str] | None = None,
    compression: str = DEFAULT_COMPRESSION,
    linger_ms: int = 50,
) -> dict[str, Any]:
    return client_config(
        bootstrap,
        extra,
        **{
            "enable.idempotence": True,
            "acks": "all",
            "compression.type": compression,
            "linger.ms": linger_ms,
            "batch.num.messages": 10000,
            "batch.size": 1_000_000,
            "queue.buffering.max.messages": 200_000,
            "message.timeout.ms": 300_000,
            # murmur2 matches the Java client, so any language's job finds a GPU's partition the same way.
            "partitioner": "murmur2_random",
        },
    )


#: Delivery errors that retrying cannot mend: the broker refuses this principal (an ACL revoked while
#: running). The service stops on the first one instead of failing every record quietly for ever.
DENIED = frozenset(
    {
        KafkaError.TOPIC_AUTHORIZATION_FAILED,
        KafkaError.CLUSTER_AUTHORIZATION_FAILED,
        KafkaError.TRANSACTIONAL_ID_AUTHORIZATION_FAILED,
    }
)


class Publisher:
    """A thin wrapper over confluent_kafka.Producer with delivery accounting.

    ``on_fatal(err, topic)`` is called once, for the first delivery error that will not pass (an
    authorization refusal, or a fatal error of the idempotent producer); ``fatal`` keeps it.

    A full local queue (``BufferError``: the broker is away and librdkafka holds as much as it may)
    makes ``produce`` wait for room, which is back-pressure, until ``stop`` is set: then the record
    is refused at once (``_QUEUE_FULL``, counted like any failed delivery; a tracked XID stays in its
    spool), so a stop never waits on a broker that is gone.
    """

    def __init__(
        self,
        conf: dict[str, Any],
        on_delivery: Callable[[KafkaError | None, Message], None] | None = None,
        producer_factory: Callable[[dict[str, Any]], Any] = Producer,
        on_fatal: Callable[[KafkaError, str | None], None] | None = None,
        stop: threading.Event | None = None,
    ) -> None:
        self.fatal: tuple[KafkaError, str | None] | None = None
        self._stop = stop
        self._on_fatal = on_fatal
        self.sent = 0
        self.failed = 0
        self.sent_by_topic: dict[str, int] = {}
        self.failures_by_reason: dict[str, int] = {}
        self._last_error_log = 0.0
        self.purged_by_topic: dict[str, int] = {}
        self._user_cb = on_delivery
        #: Kafka headers every record of a topic carries (the raw framing's schema header).
        self.topic_headers: dict[str, list[tuple[str, bytes]]] = {}
        conf = dict(conf)
        conf["on_delivery"] = self._delivered
        self._producer = producer_factory(conf)

    def _delivered(self, err: KafkaError | None, msg: Message | _Refused) -> None:
        if err is None:
            self.sent += 1
            t = msg.topic()
            self.sent_by_topic[t] = self.sent_by_topic.get(t, 0) + 1
        else:
            self.failed += 1
            self._count_purged(err, msg)
            self._note_fatal(err, msg)
            reason = err.name()
            self.failures_by_reason[reason] = self.failures_by_reason.get(reason, 0) + 1
            now = time.monotonic()
            if now - self._last_error_log > 10.0:
                self._last_error_log = now
                log.error(
                    "delivery failed",
                    extra={
                        "fields": {
                            "topic": msg.topic(),
                            "reason": reason,
                            "detail": err.str(),
                            "failed_total": self.failed,
                        }
                    },
                )
        if self._user_cb is not None:
            self._user_cb(err, msg)

    def _stopping(self) -> bool:
        return self._stop is not None and self._stop.is_set()

    def _headers(self, topic: str, headers: Any) -> Any:
        fixed = self.topic_headers.get(topic)
        return headers if fixed is None else [*fixed, *(headers or ())]

    def produce(self, topic: str, key: bytes | str, value: bytes, headers: Any = None) -> None:
        headers = self._headers(topic, headers)
        while True:
            try:
                self._producer.produce(topic, value, key, headers=headers)
                return
            except BufferError:
                if self._stopping():
                    self._delivered(KafkaError(KafkaError._QUEUE_FULL), _Refused(topic))
                    return
                self.poll(0.05)
            except KafkaException as exc:  # refused before sending (e.g. the topic's WRITE revoked)
                self._surface_fatal(exc.args[0])
                self._delivered(exc.args[0], _Refused(topic))
                return

    def produce_tracked(
        self,
        topic: str,
        key: bytes | str,
        value: bytes,
        on_delivery: Callable[[KafkaError | None, Message], None],
        headers: list[tuple[str, bytes]] | None = None,
    ) -> None:
        """Produce with a per-message delivery callback (the XID spool acknowledges through it).

        Successes are counted like any other record; a failure is left to the callback, because
        the caller keeps the record (spooled) and retries it: it is not lost, so not `failed`.
        """

        def done(err: KafkaError | None, msg: Message) -> None:
            if err is None:
                self.sent += 1
                t = msg.topic()
                self.sent_by_topic[t] = self.sent_by_topic.get(t, 0) + 1
            else:
                self._count_purged(err, msg)
                self._note_fatal(err, msg)
            on_delivery(err, msg)

        headers = self._headers(topic, headers)
        while True:
            try:
                self._producer.produce(topic, value, key, on_delivery=done, headers=headers)
                return
            except BufferError:
                if self._stopping():  # the caller keeps the record (spooled) for the next start
                    done(KafkaError(KafkaError._QUEUE_FULL), _Refused(topic))
                    return
                self.poll(0.05)
            except KafkaException as exc:  # refused before sending: the caller keeps the record
                self._surface_fatal(exc.args[0])
                done(exc.args[0], _Refused(topic))
                return

    def poll(self, timeout: float = 0.0) -> int:
        """Serve delivery reports; a fatal producer error goes to ``on_fatal`` (never raised)."""
        try:
            return self._producer.poll(timeout)
        except KafkaException as exc:
            self._raised(exc)
            return 0

    def flush(self, timeout: float = 30.0) -> int:
        """Wait for outstanding deliveries; returns how many are still in flight (0 = all done)."""
        try:
            return self._producer.flush(timeout)
        except KafkaException as exc:
            self._raised(exc)
            return len(self._producer)

    def _raised(self, exc: KafkaException) -> None:
        """A KafkaException out of poll()/flush(): librdkafka's fatal error, else re-raised."""
        err = exc.args[0] if exc.args else None
        if not isinstance(err, KafkaError) or not err.fatal():
            raise exc
        self._set_fatal(err, None)

    def drop_pending(self) -> dict[str, int]:
        """Purge what is still queued or in flight (shutdown with the broker gone); count it per topic.

        The purged records' delivery callbacks run here with a purge error, so a tracked record (a
        spooled XID) stays in its spool and every drop is counted in ``failed``."""
        self.purged_by_topic = {}
        self._producer.purge(in_queue=True, in_flight=True, blocking=False)
        self.flush(0.5)  # runs the purged records' callbacks
        return dict(self.purged_by_topic)

    def _note_fatal(self, err: KafkaError, msg: Message | _Refused) -> None:
        # A delivery report after a fatal error carries _FATAL with fatal() False (librdkafka
        # keeps the flag on the original error, which poll() raises).
        if err.code() in DENIED or err.fatal() or err.code() == KafkaError._FATAL:
            self._set_fatal(err, msg.topic())

    def _surface_fatal(self, err: KafkaError) -> None:
        """produce() refused with _FATAL ("Local: Fatal error"): serve librdkafka's queue first, so
        that the fatal error itself (with its cause) is the one reported, not this echo of it."""
        if self.fatal is None and err.code() == KafkaError._FATAL:
            self.poll(0)

    def _set_fatal(self, err: KafkaError, topic: str | None) -> None:
        if self.fatal is None:
            self.fatal = (err, topic)
            if self._on_fatal is not None:
                self._on_fatal(err, topic)

    def _count_purged(self, err: KafkaError | None, msg: Message | _Refused) -> None:
        if err is not None and err.code() in (KafkaError._PURGE_QUEUE, KafkaError._PURGE_INFLIGHT):
            self.purged_by_topic[msg.topic()] = self.purged_by_topic.get(msg.topic(), 0) + 1

    def __len__(self) -> int:
        return len(self._producer)


class _Refused:
    """The message stand-in for a record ``produce()`` refused at once (it never got a Message)."""

    __slots__ = ("_topic",)

    def __init__(self, topic: str) -> None:
        self._topic = topic

    def topic(self) -> str:
        return self._topic

    def partition(self) -> int:
        return -1
