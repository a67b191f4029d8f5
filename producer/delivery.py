"""What happens to records when Kafka is slow or gone: samples may be dropped, XIDs never.

- `SampleQueue`: a bounded in-memory queue in front of librdkafka. Samples are
  handed over only while the producer's in-flight count is below a limit; when
  the broker is unreachable the queue fills and the *oldest* samples are dropped
  (counted), since a fresh reading is worth more than an old one.
- `XidSender`: every XID goes through the on-disk spool first and is acknowledged
  on delivery; failed deliveries are retried in order, and a restarted producer
  replays what it had not delivered.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from producer.spool import XidSpool

log = logging.getLogger("gpupipe.delivery")


class SampleQueue:
    def __init__(
        self,
        produce: Callable[..., None],
        in_flight: Callable[[], int],
        maxlen: int = 50_000,
        in_flight_limit: int = 20_000,
    ) -> None:
        self._produce = produce
        self._in_flight = in_flight
        self._q: deque[tuple[str, bytes, bytes]] = deque()
        # put() runs on the NVML polling thread, pump() on both it and the main loop.
        self._lock = threading.Lock()
        self.maxlen = maxlen
        self.in_flight_limit = in_flight_limit
        self.dropped = 0

    def __len__(self) -> int:
        return len(self._q)

    def put(self, topic: str, key: bytes, value: bytes) -> None:
        with self._lock:
            if len(self._q) >= self.maxlen:
                self._q.popleft()
                self.dropped += 1
            self._q.append((topic, key, value))

    def pump(self) -> int:
        """Hand queued samples to librdkafka while it has room; returns how many were handed over."""
        n = 0
        room = self.in_flight_limit - self._in_flight()
        while room > 0:
            with self._lock:
                if not self._q:
                    break
                topic, key, value = self._q.popleft()
            self._produce(topic, key, value)
            n += 1
            room -= 1
        return n


class XidSender:
    def __init__(
        self,
        producer: Any,
        topic: str,
        spool: XidSpool,
        retry_after_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._p = producer
        self.topic = topic
        self.spool = spool
        self.sent = 0
        self.failed_attempts = 0
        self._in_flight: set[int] = set()
        self._retry_at = 0.0
        self._retry_after = retry_after_s
        self._clock = clock
        for seq, key, value in spool.pending():  # replay what a previous run did not deliver, in order
            self._produce(seq, key, value)

    def send(self, key: bytes, value: bytes) -> int:
        return self.send_many([(key, value)])[0]

    def send_many(self, items: list[tuple[bytes, bytes]]) -> list[int]:
        """Spool the events (one write and fsync for all), then hand each to Kafka, in order."""
        seqs = self.spool.append_many(items)
        for seq, (key, value) in zip(seqs, items, strict=True):
            self._produce(seq, key, value)
        return seqs

    def _produce(self, seq: int, key: bytes, value: bytes) -> None:
        def done(err: Any, msg: Any, seq: int = seq) -> None:
            self._in_flight.discard(seq)
            if err is None:
                self.spool.ack(seq)
                self.sent += 1
            else:
                self.failed_attempts += 1
                self._retry_at = self._clock() + self._retry_after
                log.warning(
                    "xid delivery failed; kept in spool for retry",
                    extra={"fields": {"seq": seq, "reason": err.str()}},
                )

        self._in_flight.add(seq)
        while True:
            try:
                self._p.produce(self.topic, value, key, on_delivery=done)
                return
            except BufferError:
                self._p.poll(0.05)

    def retry_failed(self) -> int:
        """Re-produce spooled events that are neither acknowledged nor in flight, oldest first."""
        if self._clock() < self._retry_at:
            return 0
        n = 0
        for seq, key, value in self.spool.pending():
            if seq not in self._in_flight:
                self._produce(seq, key, value)
                n += 1
        return n

    @property
    def depth(self) -> int:
        return len(self.spool)
