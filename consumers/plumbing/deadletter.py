"""Dead letters: records a service could not use go to gpu.deadletter.v1 with the reason.

Headers follow Kafka Connect's DLQ convention under our own prefix (`gpupipe.dlq.*`): why, which
service, from which topic/partition/offset, when. The original key, value and headers are kept so the
record can be replayed once the cause is fixed -- unless the whole would not fit in one Kafka message:
then the value (and, if need be, the original headers and key) is cut to fit and the headers say what
was cut, because a dead letter the broker refuses would stop the service on the same record for ever.

:class:`DeadLetterWriter` counts a dead letter as written only once the broker acknowledged it, and
:meth:`DeadLetterWriter.settle` lets the consume loop hold back the input offsets until then.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from confluent_kafka import KafkaException

from gpupipe.common.logs import fields

HEADER_PREFIX = "gpupipe.dlq."

#: What one dead letter may weigh (key, value and headers). librdkafka refuses a message over its
#: ``message.max.bytes`` (1,000,000 by default) whole; the rest is room for its framing.
MAX_BYTES = 900_000

log = logging.getLogger("gpupipe.consume")


def deadletter_headers(
    msg: Any, reason: str, detail: str, service: str, now_ms: int | None = None
) -> list[tuple[str, bytes]]:
    """Original headers first, then ours (pure: `msg` only needs Kafka Message accessors)."""
    out = list(msg.headers() or [])
    out += _ours(msg, reason, detail, service, now_ms)
    return out


def _ours(msg: Any, reason: str, detail: str, service: str, now_ms: int | None) -> list[tuple[str, bytes]]:
    ours = {
        "reason": reason,
        "detail": detail[:1000],
        "service": service,
        "topic": msg.topic() or "",
        "partition": str(msg.partition()),
        "offset": str(msg.offset()),
        "time_ms": str(now_ms if now_ms is not None else int(time.time() * 1000)),
    }
    return [(HEADER_PREFIX + k, v.encode()) for k, v in ours.items()]


def _size(headers: Sequence[tuple[str, bytes | None]]) -> int:
    return sum(len(k) + len(v or b"") for k, v in headers)


def deadletter_message(
    msg: Any,
    reason: str,
    detail: str,
    service: str,
    now_ms: int | None = None,
    max_bytes: int = MAX_BYTES,
) -> tuple[bytes | None, bytes | None, list[tuple[str, bytes]]]:
    """(value, key, headers) of the dead letter of ``msg``, never over ``max_bytes`` in all.

    What is cut is said in headers: ``truncated_value`` (the original value's length),
    ``dropped_headers`` (how many original headers), ``truncated_key`` (the original key's length).
    """
    value, key = msg.value(), msg.key()
    original = list(msg.headers() or [])
    ours = _ours(msg, reason, detail, service, now_ms)
    notes: list[tuple[str, bytes]] = []
    if key is not None and len(key) > max_bytes // 4:
        notes.append((HEADER_PREFIX + "truncated_key", str(len(key)).encode()))
        key = key[: max_bytes // 4]
    if _size(original) + _size(ours) > max_bytes // 2:
        notes.append((HEADER_PREFIX + "dropped_headers", str(len(original)).encode()))
        original = []
    room = max_bytes - len(key or b"") - _size(original) - _size(ours) - 128  # 128: the notes below
    if value is not None and len(value) > room:
        notes.append((HEADER_PREFIX + "truncated_value", str(len(value)).encode()))
        value = value[: max(room, 0)]
    return value, key, original + ours + notes


class DeadLetterWriter:
    """Dead letters through one producer, counted once the broker acknowledged them.

    ``on_written(topic, reason)`` is called per acknowledged dead letter, ``on_failed(reason)`` per
    failed attempt (which is produced again by :meth:`settle`). Thread-safe: the metrics service's
    XID reader writes through the loop's writer from its own thread.
    """

    def __init__(
        self,
        producer: Any,
        topic: str,
        service: str,
        on_written: Callable[[str, str], None],
        on_failed: Callable[[str], None],
        max_bytes: int = MAX_BYTES,
        retry_s: float = 1.0,
    ) -> None:
        self.producer = producer
        self.topic = topic
        self.service = service
        self.max_bytes = max_bytes
        self.retry_s = retry_s
        self._on_written = on_written
        self._on_failed = on_failed
        self._lock = threading.Lock()
        self._pending = 0
        self._retry: list[tuple[bytes | None, bytes | None, list[tuple[str, bytes]], str, str]] = []
        #: the last write error while dead letters are failing, else None (reported in /healthz)
        self.failing: str | None = None

    @property
    def pending(self) -> int:
        with self._lock:
            return self._pending + len(self._retry)

    def write(self, msg: Any, reason: str, detail: str) -> None:
        value, key, headers = deadletter_message(msg, reason, detail, self.service, max_bytes=self.max_bytes)
        self._produce(value, key, headers, msg.topic() or "", reason)
        log.warning(
            "record dead-lettered",
            extra=fields(topic=msg.topic(), partition=msg.partition(), offset=msg.offset(), reason=reason),
        )

    def _produce(
        self,
        value: bytes | None,
        key: bytes | None,
        headers: list[tuple[str, bytes]],
        source: str,
        reason: str,
    ) -> None:
        def delivered(err: Any, _msg: Any) -> None:
            with self._lock:
                self._pending -= 1
                if err is not None:
                    self._retry.append((value, key, headers, source, reason))
                    self.failing = str(err)
            if err is None:
                self._on_written(source, reason)
            else:
                self._on_failed(err.name())
                log.error("dead letter not written", extra=fields(topic=self.topic, error=str(err)))

        while True:
            with self._lock:
                self._pending += 1
            try:
                self.producer.produce(self.topic, value, key, headers=headers, on_delivery=delivered)
                return
            except BufferError:
                with self._lock:
                    self._pending -= 1
                self.producer.poll(0.1)
            except KafkaException as exc:  # refused at once (too large for the client, unknown topic)
                with self._lock:
                    self._pending -= 1
                    self._retry.append((value, key, headers, source, reason))
                    self.failing = exc.args[0].str()
                self._on_failed(exc.args[0].name())
                log.error("dead letter not written", extra=fields(topic=self.topic, error=self.failing))
                return

    def settle(self, stop: threading.Event) -> bool:
        """Return True once every dead letter written so far is acknowledged; failed ones are produced
        again every ``retry_s``. False if ``stop`` was set first (the caller must not commit)."""
        while True:
            self.producer.flush(self.retry_s)
            with self._lock:
                retry, self._retry = self._retry, []
                done = not retry and self._pending == 0
                if done:
                    self.failing = None
            if done:
                return True
            if retry:
                if stop.wait(self.retry_s):
                    with self._lock:
                        self._retry = retry + self._retry
                    return False
                for value, key, headers, source, reason in retry:
                    self._produce(value, key, headers, source, reason)
            elif stop.is_set():
                return False
