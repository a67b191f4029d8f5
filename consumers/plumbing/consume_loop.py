"""The consume loop every consumer service shares (metrics, alerts; chargeback adds transactions).

Batch `consume()`, decode with the codec, hand decoded records to the service's
pure logic, dead-letter what cannot be decoded, and what is not signed by the node it names when
the service checks node identity (:mod:`gpupipe.domain.node_check`), and count it, store offsets only
after the batch was handled (at-least-once; commits are asynchronous), and pass
partition assignment changes to the service so it can drop or rebuild per-partition
state. Consumer lag per partition is exposed at scrape time.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, cast

from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, Message, Producer, TopicPartition
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from gpupipe.common.logs import fields
from gpupipe.domain.node_check import DEADLETTER_REASON as NODE_IDENTITY
from gpupipe.domain.node_check import NodeCheck
from gpupipe.kafka import topics as gpupipe_topics
from gpupipe.kafka.admin import client_config
from gpupipe.kafka.auth import KafkaAuthError, principal_of, runtime_denial
from gpupipe.kafka.group_start import fresh_start_offsets
from gpupipe.kafka.lag import lags
from gpupipe.lifecycle.startup import process_start_ms
from gpupipe_consumers.plumbing.deadletter import DeadLetterWriter
from gpupipe_schemas.codec import AvroCodec, Headers, schema_header
from gpupipe_schemas.errors import DecodeError
from gpupipe_schemas.validate import violation

log = logging.getLogger("gpupipe.consume")

_DENIED = (KafkaError.TOPIC_AUTHORIZATION_FAILED, KafkaError.GROUP_AUTHORIZATION_FAILED)
#: The records a node writes, whose hostname a NodeCheck verifies.
_NODE_RECORDS = frozenset({"GpuSample", "XidEvent"})


#: Consumer-group settings a service may add to --kafka-config for its consumer; the dead-letter
#: producer gets the rest (librdkafka warns of a consumer property given to a producer).
_GROUP_ONLY = frozenset({"session.timeout.ms", "heartbeat.interval.ms"})


@dataclass(frozen=True, slots=True)
class InRecord:
    """A decoded input record with where it came from."""

    topic: str
    partition: int
    offset: int
    key: bytes | None
    name: str  # schema name, e.g. "GpuSample"
    value: dict[str, Any]
    kafka_ts_ms: int
    raw: Message | None = field(default=None, compare=False, repr=False)  # the consumed message


# A decoded record the handler refuses, with why: (record, reason, detail). It is dead-lettered
# like undecodable bytes (reason in the headers, counted per reason).
Rejected = tuple[InRecord, str, str]


class Handler(Protocol):
    def on_assign(self, partitions: Sequence[tuple[str, int]]) -> None: ...
    def on_revoke(self, partitions: Sequence[tuple[str, int]]) -> None: ...

    # May return records to dead-letter (wrong record type for the topic, invalid content).
    def handle(self, records: Sequence[InRecord]) -> Sequence[Rejected] | None: ...


class ConsumerMetrics:
    def __init__(self, registry: CollectorRegistry, service: str) -> None:
        self.consumed = Counter(
            "gpupipe_consumer_records", "Records consumed and decoded.", ["topic"], registry=registry
        )
        self.decode_errors = Counter(
            "gpupipe_consumer_decode_errors",
            "Records that could not be decoded, or that the service rejected (by reason).",
            ["topic", "reason"],
            registry=registry,
        )
        self.dead_letters = Counter(
            "gpupipe_consumer_dead_letters",
            "Records written to the dead-letter topic (acknowledged by the broker).",
            ["topic"],
            registry=registry,
        )
        self.dead_letter_failures = Counter(
            "gpupipe_consumer_dead_letter_failures",
            "Dead-letter writes that failed and are tried again; the input is not committed meanwhile.",
            ["error"],
            registry=registry,
        )
        self.handle_seconds = Histogram(
            "gpupipe_consumer_batch_duration_seconds",
            "Time to handle one consumed batch.",
            buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0),
            registry=registry,
        )
        self.rebalances = Counter(
            "gpupipe_consumer_rebalances", "Partition assignment changes.", ["kind"], registry=registry
        )


class _LagCollector(Collector):
    def __init__(self, loop: ConsumeLoop) -> None:
        self._loop = loop

    def collect(self) -> Iterator[GaugeMetricFamily]:
        fam = GaugeMetricFamily(
            "gpupipe_consumer_lag_records",
            "High watermark minus next offset to consume, per partition.",
            labels=["topic", "partition"],
        )
        for (topic, part), lag in sorted(self._loop.lag().items()):
            fam.add_metric([topic, str(part)], lag)
        yield fam


class ConsumeLoop:
    """Runs a Handler over a consumer group until `stop` is set."""

    def __init__(
        self,
        *,
        bootstrap: str,
        group_id: str,
        topics: Sequence[str],
        handler: Handler,
        codec: AvroCodec,
        deadletter_topic: str,
        service: str,
        registry: CollectorRegistry,
        extra: dict[str, str] | None = None,
        batch_size: int = 2000,
        poll_timeout_s: float = 0.2,
        consumer_factory: Callable[[dict[str, Any]], Any] = Consumer,
        from_beginning: bool = False,
        start_ms: int | None = None,
        topic_prefix: str = "",
        resume: Callable[[Sequence[tuple[str, int]]], Mapping[tuple[str, int], int]] | None = None,
        node_check: NodeCheck | None = None,
    ) -> None:
        self.handler = handler
        # With --node-ca-file: a sample or XID not signed by the node it names is dead-lettered here,
        # before the handler believes its hostname (metrics, recommend; alerts checks in its handler,
        # which drops such samples instead).
        self.node_check = node_check
        # A sink that stores its offsets with its output (the lake's Iceberg snapshots) says where
        # each assigned partition starts; the group's committed offsets are then only for lag.
        # Partitions it has no offset for start at the oldest record.
        self.resume = resume
        # A record type is accepted only on its own topic: a node may write samples and XIDs, and
        # must not get, say, an operator's ack applied by writing it to the XID topic.
        self._carries = {
            t: frozenset(gpupipe_topics.RECORDS_ON[gpupipe_topics.base_name(topic_prefix, t)])
            for t in topics
            if gpupipe_topics.base_name(topic_prefix, t) in gpupipe_topics.RECORDS_ON
        }
        # A partition without a committed offset starts at the first record at or after this time
        # (the service's start): records written while it was starting are not skipped.
        self.from_beginning = from_beginning
        self.start_ms = process_start_ms() if start_ms is None else start_ms
        self.codec = codec
        self.topics = list(topics)
        self.service = service
        self.deadletter_topic = deadletter_topic
        self.metrics = ConsumerMetrics(registry, service)
        self.batch_size = batch_size
        self.poll_timeout_s = poll_timeout_s
        self.assigned: set[tuple[str, int]] = set()
        self._polling = False
        self._stop = threading.Event()
        self.last_batch_time = 0.0
        self._positions: dict[tuple[str, int], int] = {}
        self._lag: dict[tuple[str, int], int] = {}  # refreshed by the loop thread (see lag())
        self._lag_refreshed = 0.0
        self._lock = threading.Lock()
        conf = client_config(
            bootstrap,
            extra,
            **{
                "group.id": group_id,
                "enable.auto.commit": True,
                "enable.auto.offset.store": False,
                "auto.offset.reset": "earliest" if from_beginning else "latest",
                "partition.assignment.strategy": "cooperative-sticky",
                "isolation.level": "read_committed",
                "fetch.wait.max.ms": 100,
            },
        )
        self.consumer = consumer_factory(conf)
        self.group_id = group_id
        self._principal = principal_of(conf)
        self.deadletters = DeadLetterWriter(
            Producer(
                client_config(
                    bootstrap,
                    {k: v for k, v in (extra or {}).items() if k not in _GROUP_ONLY},
                    **{"enable.idempotence": True, "linger.ms": 20},
                )
            ),
            deadletter_topic,
            service,
            on_written=lambda topic, _reason: self.metrics.dead_letters.labels(topic).inc(),
            on_failed=lambda error: self.metrics.dead_letter_failures.labels(error).inc(),
        )
        registry.register(_LagCollector(self))

    @property
    def healthy(self) -> bool:
        """Polling, and able to dead-letter (a service that cannot is doing nothing useful)."""
        return self._polling and self.deadletters.failing is None

    def health_detail(self) -> dict[str, Any]:
        """What /healthz adds for the loop: why dead letters are not being written, while they are not."""
        failing = self.deadletters.failing
        return (
            {}
            if failing is None
            else {"deadletters_failing": failing, "deadletters_pending": self.deadletters.pending}
        )

    # -- rebalance callbacks (run inside consume()) -----------------------------------
    def _assign(self, consumer: Any, parts: list[TopicPartition]) -> None:
        tps = [(p.topic, p.partition) for p in parts]
        self.assigned.update(tps)
        self.metrics.rebalances.labels("assign").inc()
        log.info("partitions assigned", extra=fields(partitions=[f"{t}[{p}]" for t, p in tps]))
        if self.resume is not None:
            known = self.resume(tps)
            consumer.incremental_assign(
                [TopicPartition(t, p, known.get((t, p), OFFSET_BEGINNING)) for t, p in tps]
            )
        elif not self.from_beginning:
            self._assign_from_start(consumer, parts)
        self.handler.on_assign(tps)

    def _assign_from_start(self, consumer: Any, parts: list[TopicPartition]) -> None:
        try:
            found = fresh_start_offsets(consumer, parts, self.start_ms)
        except Exception as exc:  # broker trouble: the default (latest) is the fallback
            log.warning("start offsets unknown, starting at the end", extra=fields(error=str(exc)))
            return
        if found is None:
            return
        offsets, fresh = found
        consumer.incremental_assign(offsets)
        # A fresh partition's start position becomes the group's: an instance that takes it over (an
        # HA standby, a restart) resumes there, and a partition that stays quiet for days no longer
        # starts again at the next instance's own start, which skipped what was written in between.
        try:
            consumer.commit(offsets=fresh, asynchronous=False)
        except Exception as exc:  # the coordinator moved: the next instance starts at its own start
            log.warning("start offsets not committed", extra=fields(error=str(exc)))

    def _revoke(self, consumer: Any, parts: list[TopicPartition]) -> None:
        tps = [(p.topic, p.partition) for p in parts]
        self.assigned.difference_update(tps)
        with self._lock:
            for tp in tps:
                self._positions.pop(tp, None)
                self._lag.pop(tp, None)
        self.metrics.rebalances.labels("revoke").inc()
        log.info("partitions revoked", extra=fields(partitions=[f"{t}[{p}]" for t, p in tps]))
        self.handler.on_revoke(tps)

    # -- main loop -----------------------------------------------------------------------
    def run(self, stop: threading.Event) -> None:
        self.consumer.subscribe(
            self.topics, on_assign=self._assign, on_revoke=self._revoke, on_lost=self._revoke
        )
        self._stop = stop
        try:
            while not stop.is_set():
                msgs = self.consumer.consume(self.batch_size, self.poll_timeout_s)
                self._polling = True
                if msgs:
                    self.process(msgs)
                self.deadletters.producer.poll(0)
                if time.monotonic() - self._lag_refreshed >= 1.0:
                    self._refresh_lag()
        finally:
            self.deadletters.producer.flush(10)
            try:
                self.consumer.close()
            except Exception:  # closing after a broker loss must not mask the real exit reason
                log.warning("consumer close failed", exc_info=True)

    def process(self, msgs: Sequence[Message]) -> None:
        began = time.perf_counter()
        records: list[InRecord] = []
        decode = self.codec.decode
        # A raw-framed value (schema in a header) goes to the shared codec itself: a service's own
        # decoder (codec-shaped, holding the codec as ``.codec``) reads the magic-framed ones only.
        headed = getattr(self.codec, "codec", self.codec).decode
        last: dict[tuple[str, int], int] = {}  # the offset last read per partition
        counts: dict[str, int] = {}
        now_ms = int(time.time() * 1000)
        node_check = self.node_check
        for msg in msgs:
            err = msg.error()
            if err is not None:
                if err.code() in _DENIED:
                    # an ACL revoked while running: exit with one line, do not log it forever
                    raise KafkaAuthError(
                        runtime_denial(self._principal, err.name(), msg.topic(), self.group_id)
                    )
                if err.code() != KafkaError._PARTITION_EOF:
                    log.warning("consume error", extra=fields(error=err.str()))
                continue
            topic, part, offset = msg.topic(), msg.partition(), msg.offset()
            if topic is None or part is None or offset is None:  # only error events lack them
                continue
            last[(topic, part)] = offset
            hdrs = cast(Headers, msg.headers())  # confluent-kafka yields a list of pairs
            try:
                if hdrs and schema_header(hdrs) is not None:
                    d = headed(msg.value(), hdrs)
                else:
                    d = decode(msg.value())
            except DecodeError as exc:
                self.dead_letter(msg, exc.reason, exc.detail)
                continue
            carries = self._carries.get(topic)
            if carries is not None and d.name not in carries:
                self.dead_letter(
                    msg,
                    "unexpected-record-type",
                    f"{d.name} on {topic}, which carries {', '.join(sorted(carries))}",
                )
                continue
            # a decoder that knows what it already checked says so (the metrics split decoder)
            check = getattr(d, "violation", None)
            if check is not None:
                bad = check(msg.timestamp()[1], now_ms)
            else:
                bad = violation(d.name, d.record, msg.timestamp()[1], now_ms)
            if bad is not None:
                self.dead_letter(msg, "out-of-range", bad)
                continue
            if node_check is not None and d.name in _NODE_RECORDS:
                refused = node_check.refuse(d.name, d.record.get("hostname"), msg, now_ms)
                if refused is not None:
                    self.dead_letter(msg, NODE_IDENTITY, refused)
                    continue
            counts[topic] = counts.get(topic, 0) + 1
            records.append(
                InRecord(topic, part, offset, msg.key(), d.name, d.record, msg.timestamp()[1], msg)
            )
        if records:
            rejected = self.handler.handle(records)
            for rec, reason, detail in rejected or ():
                if rec.raw is not None:
                    self.dead_letter(rec.raw, reason, detail)
        for topic, n in counts.items():
            self.metrics.consumed.labels(topic).inc(n)
        if self.deadletters.pending and not self.deadletters.settle(self._stop):
            return  # stopping with dead letters unwritten: their input is read again after a restart
        if last:
            offs = [TopicPartition(t, p, o + 1) for (t, p), o in last.items()]
            self.consumer.store_offsets(offsets=offs)
            with self._lock:
                for tp in offs:
                    self._positions[(tp.topic, tp.partition)] = tp.offset
        self.last_batch_time = time.time()
        self.metrics.handle_seconds.observe(time.perf_counter() - began)

    def dead_letter(self, msg: Message, reason: str, detail: str) -> None:
        """Dead-letter ``msg`` (counted once acknowledged; see :class:`DeadLetterWriter`)."""
        self.metrics.decode_errors.labels(msg.topic(), reason).inc()
        self.deadletters.write(msg, reason, detail)

    def lag(self) -> dict[tuple[str, int], int]:
        """Lag per assigned partition, as of the loop's last refresh (about every second).

        Computed in the loop thread: a call on the consumer from another thread (a scrape) would
        wait for the consumer's lock, which back-to-back ``consume()`` calls starve."""
        with self._lock:
            return dict(self._lag)

    def _refresh_lag(self) -> None:
        self._lag_refreshed = time.monotonic()
        with self._lock:
            positions = dict(self._positions)
        out = lags(self.consumer, {tp: positions.get(tp) for tp in list(self.assigned)})
        with self._lock:
            self._lag = out
