"""XID delivery that never loses one: spool first, hand to Kafka in bounded chunks, ack on delivery.

Failed deliveries are retried in order, and a restarted producer replays what it had not delivered.
The spool keeps XIDs in :data:`SPOOL_FRAMING` whatever the topic's ``--framing``; each is framed for
the topic's framing of the running producer when handed over, then signed.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

from gpupipe_producer.publish import Publisher
from gpupipe_producer.self_metrics import ProducerMetrics
from gpupipe_producer.xid.spool import XidSpool
from gpupipe_schemas.codec import SINGLE_OBJECT, AvroCodec, Encoder
from gpupipe_schemas.errors import DecodeError, EncodeError
from gpupipe_schemas.records import XidEvent

if TYPE_CHECKING:  # cryptography is loaded only by a producer that signs
    from gpupipe.domain.node_identity import NodeSigner

log = logging.getLogger("gpupipe.delivery")


#: XID events handed to librdkafka and not yet reported on, at most. Why: a restart with a full
#: spool replayed every pending event into librdkafka at once, a second copy of the spool in
#: memory (352 MB for a 64 MiB spool); in chunks the copy is this many events (a few hundred KB).
MAX_XIDS_IN_FLIGHT = 1000

#: How spooled XIDs are framed. Self-describing, so an XID spooled before a restart that changed
#: the topic's framing is re-framed for the new one (spooled as the topic's framing then, it went
#: out with a schema header that did not match its bytes, or without the one it needed).
SPOOL_FRAMING = SINGLE_OBJECT


def reframer(codec: AvroCodec, wire: Encoder[XidEvent]) -> Callable[[bytes], bytes] | None:
    """Spooled value -> the value ``wire`` (the topic's encoder) writes; None: sent as spooled."""
    if wire.framing == SPOOL_FRAMING:
        return None

    def frame(value: bytes) -> bytes:
        try:
            return wire.encode(cast(XidEvent, codec.decode(value).record))
        except (DecodeError, EncodeError):
            return value  # not self-describing: spooled by an older agent, in the topic's framing

    return frame


class XidSender:
    """Spooled, acknowledged, retried XID delivery.

    Events go to librdkafka oldest first and at most ``max_in_flight`` at a time; :meth:`pump` (the
    main loop, every pass) hands over more as deliveries are reported, re-sends failed ones after
    ``retry_after_s``, and persists the spool's acknowledged mark once for all the acks reported
    since the last pass. ``ready`` (None: always) holds every hand-over back while false: the
    events stay spooled until, say, the topic exists.
    """

    def __init__(
        self,
        producer: Any,
        topic: str,
        spool: XidSpool,
        retry_after_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
        *,
        max_in_flight: int = MAX_XIDS_IN_FLIGHT,
        ready: Callable[[], bool] | None = None,
    ) -> None:
        self._p = producer
        self.topic = topic
        self.spool = spool
        self.sent = 0
        self.failed_attempts = 0
        self.max_in_flight = max(1, max_in_flight)
        self._ready = ready
        self._in_flight: set[int] = set()
        self._failed: set[int] = set()  # failed, waiting for the retry time
        self._next_seq = 0  # the spool's events from here on were never handed over
        self._retry_at = 0.0
        self._retry_after = retry_after_s
        self._clock = clock
        self.pump()  # replay what a previous run did not deliver, in order, in bounded chunks

    def send(self, key: bytes, value: bytes) -> int:
        return self.send_many([(key, value)])[0]

    def send_many(self, items: list[tuple[bytes, bytes]]) -> list[int]:
        """Spool the events (one write and fsync for all), then hand them to Kafka, in order, as
        far as the in-flight bound allows (:meth:`pump` hands over the rest)."""
        seqs = self.spool.append_many(items)
        self.pump()
        return seqs

    def _produce(self, seq: int, key: bytes, value: bytes) -> None:
        def done(err: Any, msg: Any, seq: int = seq) -> None:
            self._in_flight.discard(seq)
            if err is None:
                self.spool.ack(seq)
                self.sent += 1
            else:
                self.failed_attempts += 1
                self._failed.add(seq)
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

    @property
    def in_flight(self) -> int:
        """Events handed to librdkafka whose delivery is not reported yet."""
        return len(self._in_flight)

    @property
    def ready(self) -> bool:
        return self._ready is None or self._ready()

    def pump(self) -> int:
        """Persist the acknowledged mark, then hand over failed events (once their retry time has
        come) and never-sent ones, oldest first, up to the in-flight bound; returns how many."""
        self.spool.sync_acked()
        if not self.ready:
            return 0
        room = self.max_in_flight - len(self._in_flight)
        n = 0
        if self._failed and room > 0 and self._clock() >= self._retry_at:
            for seq in sorted(self._failed):
                if room <= 0:
                    break
                self._failed.discard(seq)
                item = self.spool.get(seq)
                if item is None or seq in self._in_flight:  # acknowledged late, or dropped for the bound
                    continue
                self._produce(seq, *item)
                n += 1
                room -= 1
        if room > 0:
            chunk, self._next_seq = self.spool.pending_from(self._next_seq, room)
            for seq, key, value in chunk:
                self._produce(seq, key, value)
            n += len(chunk)
        return n

    def retry_failed(self) -> int:
        """Re-produce spooled events that are neither acknowledged nor in flight, oldest first
        (and hand over what the in-flight bound held back): :meth:`pump`."""
        return self.pump()

    @property
    def depth(self) -> int:
        return len(self.spool)


class PublisherXids:
    """XidSender's view of the Publisher's librdkafka producer (per-message delivery callbacks).

    Successes are counted like every other record (``records_sent{topic}``); a failure is counted
    in ``records_failed{topic,reason}`` but not in ``Publisher.failed``: the event stays in the
    spool and is retried, so it is not lost.
    """

    def __init__(
        self,
        publisher: Publisher,
        metrics: ProducerMetrics,
        signer: NodeSigner | None,
        frame: Callable[[bytes], bytes] | None = None,
    ) -> None:
        self._pub = publisher
        self._metrics = metrics
        self._signer = signer
        self._frame = frame  # spooled value -> the topic's framing (:func:`reframer`)

    def produce(self, topic: str, value: bytes, key: bytes, on_delivery: Callable[[Any, Any], None]) -> None:
        def done(err: Any, msg: Any) -> None:
            if err is not None:
                self._metrics.records_failed.labels(topic, err.name()).inc()
            on_delivery(err, msg)

        if self._frame is not None:
            value = self._frame(value)
        # Signed at hand-over, so a record spooled before a certificate rotation carries the new one.
        headers = self._signer.headers(value) if self._signer is not None else None
        self._pub.produce_tracked(topic, key, value, done, headers)

    def poll(self, timeout: float = 0.0) -> int:
        return self._pub.poll(timeout)
