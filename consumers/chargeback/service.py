"""The chargeback service: a transactional consume-transform-produce loop around the window engine.

Reads ``gpu.samples.v1`` in a consumer group, feeds every decoded GpuSample to a
:class:`~consumers.chargeback.windows.WindowEngine`, and every ``commit_interval`` (or
``commit_records`` records) commits ONE Kafka transaction holding

1. the ChargebackWindow records of the windows that closed (and corrections) since the last one,
2. dead letters of the records that could not be decoded (``gpu.deadletter.v1``), and
3. per input partition, the engine's *checkpoint* as the group's committed offset: the oldest offset
   the partition's open windows depend on, with the watermark and the consumer position
   (``replay_until``) in the offset's commit metadata.

So output, dead letters and input progress become visible together or not at all. Open windows
live only in memory; after a crash (``kill -9`` at any moment), a restart or a rebalance, the new
owner of a partition restores the checkpoint and replays from its offset: records below
``replay_until`` rebuild the open windows, and those whose window was already emitted are skipped
by the engine, so every sample is counted once. Nothing is flushed on revocation or shutdown.

Zombie fencing: the producer's ``transactional.id`` is ``<group id>.<instance id>``, stable across
restarts of one instance, so ``init_transactions`` aborts whatever a crashed predecessor left open
(at once, rather than after ``transaction.timeout.ms``) and fences it if it still runs. The instance
id is also the consumer's ``group.instance.id`` (static membership, on by default), so a restarted
instance takes its partitions back without a group rebalance; offsets are sent with the group
metadata (KIP-447), so a member of an older generation cannot commit either. Two live processes
must never share an instance id: the later one fences the earlier, which exits non-zero.

Errors: an abortable transaction error aborts, drops every partition's state, restores the
committed checkpoints and seeks there; a retriable one is retried; a fatal one (fenced, ...) ends
the service with :class:`ChargebackFatalError`.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from confluent_kafka import (
    TIMESTAMP_CREATE_TIME,
    TIMESTAMP_LOG_APPEND_TIME,
    TIMESTAMP_NOT_AVAILABLE,
    Consumer,
    KafkaError,
    KafkaException,
    Message,
    Producer,
    TopicPartition,
)
from prometheus_client import CollectorRegistry

from consumers.chargeback.errors import AbortTransaction as _Abort
from consumers.chargeback.errors import ChargebackFatalError, PriceChangeError
from consumers.chargeback.identity import check_client_overrides
from consumers.chargeback.idle import IdleDetector
from consumers.chargeback.price_agreement import PriceAgreement, PriceHolds
from consumers.chargeback.progress import ProgressPublisher
from consumers.chargeback.prom_counters import WindowCounters
from consumers.chargeback.rebalance import RebalanceCallbacks
from consumers.chargeback.service_config import OP_TIMEOUT_S as _OP_TIMEOUT_S
from consumers.chargeback.service_config import ChargebackMetrics, ServiceConfig, output_key
from consumers.chargeback.state_metrics import PartitionInfo, StateCollector
from consumers.chargeback.windows import Checkpoint, WindowEngine
from consumers.deadletter import deadletter_headers
from gpupipe.kafka_admin import client_config
from gpupipe.logs import fields
from gpupipe.startup import StuckCallError, retry, with_deadline
from schemas.codec import AvroCodec, Decoded
from schemas.errors import DecodeError

log = logging.getLogger("gpupipe.chargeback")

SERVICE = "chargeback"
_SAMPLE = "GpuSample"
_RETRY_FOR_S = 120.0
_STUCK_S = 15.0  # send_offsets_to_transaction takes milliseconds; past this it is stuck (librdkafka#5456)


def _default_consumer(conf: dict[str, Any]) -> Any:
    return Consumer(conf)


def _default_producer(conf: dict[str, Any]) -> Any:
    return Producer(conf)


class ChargebackService(RebalanceCallbacks, PriceHolds, PartitionInfo):
    """Runs the engine over the input topic with exactly-once output until ``stop`` is set."""

    def __init__(
        self,
        cfg: ServiceConfig,
        engine: WindowEngine,
        codec: AvroCodec,
        registry: CollectorRegistry | None = None,
        *,
        decode: Callable[[bytes | None], Decoded] | None = None,
        consumer_factory: Callable[[dict[str, Any]], Any] = _default_consumer,
        producer_factory: Callable[[dict[str, Any]], Any] = _default_producer,
        admin_factory: Callable[[dict[str, Any]], Any] | None = None,
    ) -> None:
        self.cfg = cfg
        self.engine = engine
        self.codec = codec
        self.decode = decode if decode is not None else codec.decode
        self.registry = registry if registry is not None else CollectorRegistry()
        self.metrics = ChargebackMetrics(self.registry)
        self.window_counters = WindowCounters(self.registry, engine.prices.currency)
        self.encode = codec.encoder("ChargebackWindow", cfg.output_topic).encode
        self.stats_snapshot: dict[str, int] = {}
        self.assigned: set[int] = set()
        self.positions: dict[int, int] = {}  # next offset to process, per assigned partition
        self.committed: dict[int, Checkpoint] = {}  # last checkpoint committed (or restored)
        self.starts: dict[int, int] = {}  # where each partition's restored state begins
        self.rebalances = 0  # assignment changes so far (callbacks run inside consume())
        self.in_txn = False
        self.pending = 0  # records consumed since the last commit
        self.last_commit = time.monotonic()
        self.last_loop = 0.0
        self.fatal: BaseException | None = None
        # Set once the loop ended on an error: from then on nothing may commit (not even the revoke
        # callback that consumer.close() runs), or checkpoints would pass windows that were drained
        # from the engine but never committed (review D1).
        self.failed = False
        self.started = False
        self.warned_create_time = False
        # Idleness (D7): when each partition last delivered a record, and the newest broker
        # (LogAppendTime) timestamp seen with the monotonic time it was seen at.
        self.idle = IdleDetector(cfg.idle_timeout_s)
        # One price per window across instances, also while a rolling update runs two price files
        # (review D6): partitions whose next record would close a window of disputed prices wait.
        self.prices_agreement = PriceAgreement(engine.price_fingerprint, engine.window_ms, engine.grace_ms)
        self.prices_agreement.me = engine.instance_id
        self.held: dict[int, int] = {}
        self._lock = threading.Lock()
        self._info: dict[int, dict[str, Any]] = {}
        if cfg.start not in ("earliest", "latest"):
            raise ValueError(f"start must be earliest or latest, got {cfg.start!r}")
        check_client_overrides(cfg.extra)
        consumer_conf = {
            "group.id": cfg.group_id,
            "enable.auto.commit": False,
            "enable.auto.offset.store": False,
            "isolation.level": "read_committed",
            "auto.offset.reset": cfg.start,
            # Eager: every rebalance revokes everything (after the end-of-batch commit) and the new
            # assignment restores from the committed checkpoints; simple and always consistent.
            "partition.assignment.strategy": "roundrobin",
            "fetch.wait.max.ms": 100,
            # A fenced static member or a fatal idempotence error is reported here (fatal() true),
            # not always as a consume() error: either way the process must end (review D2).
            "error_cb": self._on_client_error,
        }
        if cfg.static_membership:
            consumer_conf["group.instance.id"] = cfg.instance_id
        conf = client_config(cfg.bootstrap, cfg.extra, **consumer_conf)
        # Incremental (cooperative-sticky) rebalancing when configured: only moved partitions replay.
        self.cooperative = "cooperative" in str(conf.get("partition.assignment.strategy", "")).lower()
        self.consumer = consumer_factory(conf)
        self._new_producer = lambda: producer_factory(  # again when a stuck one is replaced
            client_config(
                cfg.bootstrap,
                cfg.extra,
                **{
                    "transactional.id": cfg.transactional_id,
                    "transaction.timeout.ms": cfg.transaction_timeout_ms,
                    "linger.ms": 20,
                    "compression.type": "zstd",
                    "error_cb": self._on_client_error,
                },
            )
        )
        self.producer = self._new_producer()
        # outage handling (see _broker_answers, _replace_producer)
        self._broker_was_down = False
        self._last_probe = 0.0
        self._wedged = False
        self._stop: threading.Event | None = None
        self._abandoned: list[Any] = []
        self.registry.register(StateCollector(self))
        self.progress = (
            ProgressPublisher(
                admin_factory(client_config(cfg.bootstrap, cfg.extra)),
                cfg.progress_group or f"{cfg.group_id}.progress",
                cfg.input_topic,
            )
            if admin_factory is not None
            else None
        )

    # -- main loop --------------------------------------------------------------------------------
    def run(self, stop: threading.Event) -> None:
        """Consume until ``stop`` is set; raise ChargebackFatalError when the service cannot go on."""
        self._stop = stop  # a commit stuck in librdkafka gives up at once when the service stops
        try:
            self._call(self.producer.init_transactions, _OP_TIMEOUT_S)
        except _Abort as exc:  # cannot happen before a transaction began; treat as fatal
            raise ChargebackFatalError(f"init_transactions failed: {exc}") from exc
        log.info(
            "chargeback started",
            extra=fields(
                input=self.cfg.input_topic,
                output=self.cfg.output_topic,
                group=self.cfg.group_id,
                transactional_id=self.cfg.transactional_id,
                window_ms=self.engine.window_ms,
                grace_ms=self.engine.grace_ms,
            ),
        )
        try:
            self._check_group_prices()
        except PriceChangeError as exc:  # refused before joining the group: nothing moves
            self.failed = True
            with contextlib.suppress(Exception):
                self.consumer.close()
            raise ChargebackFatalError(str(exc)) from exc
        self.consumer.subscribe(
            [self.cfg.input_topic],
            on_assign=self._on_assign,
            on_revoke=self._on_revoke,
            on_lost=self._on_lost,
        )
        self.started = True
        clean = False
        try:
            while not stop.is_set():
                rebalances = self.rebalances
                try:
                    msgs = self.consumer.consume(self.cfg.batch_size, self.cfg.poll_timeout_s)
                except KafkaException as exc:
                    raise ChargebackFatalError(f"consumer failed: {exc.args[0].str()}") from exc
                self._check_fatal()
                self.last_loop = time.monotonic()
                if msgs and rebalances != self.rebalances:
                    # The assignment changed inside this consume() call: the batch may hold messages
                    # fetched for the old assignment, whose state was committed and dropped.
                    if self.cooperative:  # keep what continues each partition exactly
                        msgs = self._contiguous(msgs)
                    else:  # discard it; every partition starts again where its state begins
                        self._reposition()
                        msgs = []
                if msgs:
                    try:
                        self.process(msgs)
                    except _Abort as exc:
                        self._abort_and_rewind(str(exc))
                self.idle.advance(self.assigned, self._caught_up, self._advance_idle)
                if self.prices_agreement.due():
                    self._agree_on_prices()
                if self._commit_due():
                    self.commit()
                self.producer.poll(0)
            self.commit()  # the normal end-of-batch commit; open windows are NOT flushed
            if self.progress is not None:
                self.progress.maybe_publish(self.positions, force=True)
            clean = True
        finally:
            if self.progress is not None:
                self.progress.close()
            self._close(clean)

    def _close(self, clean: bool) -> None:
        if not clean:
            self.failed = True  # before close(): its revoke callback must not commit anything
        if self._wedged:
            # A helper thread is still inside send_offsets_to_transaction: closing the clients under
            # it can abort the process. Leave them; the command exits without their teardown.
            log.warning("stopping with a transactional call stuck: uncommitted input is read again")
            return
        if clean:
            try:
                self.consumer.close()  # eager revoke -> _on_revoke commits nothing new, drops state
            except Exception:
                log.warning("consumer close failed", exc_info=True)
            self._check_fatal()
            return
        if self.in_txn:
            with contextlib.suppress(Exception):
                self.producer.abort_transaction(5.0)
            self.in_txn = False
        with contextlib.suppress(Exception):
            self.consumer.close()

    def _check_fatal(self) -> None:
        if self.fatal is not None:
            exc = self.fatal
            if isinstance(exc, ChargebackFatalError):
                raise exc
            raise ChargebackFatalError(f"{type(exc).__name__}: {exc}") from exc

    def _commit_due(self) -> bool:
        if self.pending >= self.cfg.commit_records:
            return True
        return time.monotonic() - self.last_commit >= self.cfg.commit_interval_s

    # -- per batch --------------------------------------------------------------------------------
    def process(self, msgs: list[Message]) -> None:
        """Feed a consumed batch to the engine; dead-letter what cannot be decoded (not on replay)."""
        engine = self.engine
        add = engine.add
        decode = self.decode
        first: dict[int, int] = {}
        last: dict[int, int] = {}
        n = 0
        held, hold_at, newly_held = self.held, self.prices_agreement.hold_at, []
        for msg in msgs:
            err = msg.error()
            if err is not None:
                self._consume_error(err)
                continue
            part = msg.partition()
            if held and part in held:
                continue  # fetched before it was paused; read again when it resumes
            off = msg.offset()
            if part not in first:
                first[part] = off
            last[part] = off
            n += 1
            try:
                d = decode(msg.value())
                if d.name != _SAMPLE:
                    raise DecodeError("unexpected-record-type", f"{d.name} on the samples topic")
                ts_type, ts = msg.timestamp()
                if ts_type == TIMESTAMP_LOG_APPEND_TIME:
                    self.idle.saw_broker_time(ts)
                elif ts_type == TIMESTAMP_CREATE_TIME and not self.warned_create_time:
                    self.warned_create_time = True
                    log.warning(
                        "input topic uses CreateTime: a node clock running ahead cannot be bounded by "
                        "broker time; set message.timestamp.type=LogAppendTime on it",
                        extra=fields(topic=msg.topic()),
                    )
                record_ts = None if ts_type == TIMESTAMP_NOT_AVAILABLE else ts
                if hold_at is not None and (
                    engine.event_time(int(d.record["timestamp_ms"]), record_ts) >= hold_at
                ):
                    held[part] = off  # it would close a window the instances price differently
                    newly_held.append(part)
                    n -= 1
                    if first[part] == off:
                        del first[part], last[part]
                    else:
                        last[part] = off - 1
                    continue
                add(d.record, part, off, record_ts)
            except DecodeError as exc:
                if not engine.is_replay(part, off):
                    self.dead_letter(msg, exc.reason, exc.detail)
            except Exception as exc:  # a decodable record the accounting cannot take: never crash
                if not engine.is_replay(part, off):
                    self.dead_letter(msg, "chargeback-rejected", f"{type(exc).__name__}: {exc}")
        if newly_held:
            self._hold_new(newly_held)
        replayed = 0
        self.idle.saw_input(last)
        for part, off in last.items():
            self.positions[part] = off + 1
            lo = first[part]
            if engine.is_replay(part, lo):
                replayed += (
                    (off - lo + 1) if engine.is_replay(part, off) else self._count_replay(part, lo, off)
                )
        self.pending += n
        self.metrics.consumed.inc(n)
        if replayed:
            self.metrics.replayed.inc(replayed)
        self.stats_snapshot = dict(engine.stats)

    def _caught_up(self, part: int) -> bool:
        try:
            _, high = self.consumer.get_watermark_offsets(
                TopicPartition(self.cfg.input_topic, part), timeout=0.5, cached=True
            )
        except KafkaException:
            return False
        return high >= 0 and self.positions.get(part, high) >= high

    def _count_replay(self, part: int, lo: int, hi: int) -> int:
        is_replay = self.engine.is_replay
        return sum(1 for o in range(lo, hi + 1) if is_replay(part, o))

    def _consume_error(self, err: KafkaError) -> None:
        if err.code() == KafkaError._PARTITION_EOF:
            return
        if err.code() == KafkaError._ALL_BROKERS_DOWN:
            self._broker_was_down = True  # commit() checks the broker before its next transaction
        if err.fatal() or err.code() == KafkaError._FATAL:
            # librdkafka reports a consumer's fatal error (e.g. a fenced group.instance.id) as an
            # event with code _FATAL whose fatal() is False; after it the consumer is dead.
            raise ChargebackFatalError(f"fatal consumer error: {err.str()}")
        log.warning("consume error", extra=fields(error=err.str(), code=err.name()))

    def dead_letter(self, msg: Message, reason: str, detail: str) -> None:
        """Produce the undecodable record, untouched, to the dead-letter topic in the current transaction."""
        self._begin()
        headers = deadletter_headers(msg, reason, detail, SERVICE)
        self._produce(self.cfg.deadletter_topic, msg.value(), msg.key(), headers)
        self.metrics.dead_letters.labels(reason).inc()
        log.warning(
            "record dead-lettered",
            extra=fields(topic=msg.topic(), partition=msg.partition(), offset=msg.offset(), reason=reason),
        )

    # -- transactions -----------------------------------------------------------------------------
    def _begin(self) -> None:
        if not self.in_txn:
            self._call(self.producer.begin_transaction)
            self.in_txn = True

    def _produce(self, topic: str, value: bytes | None, key: bytes | None, headers: Any = None) -> None:
        while True:
            try:
                self.producer.produce(topic, value, key, headers=headers)
                return
            except BufferError:
                self.producer.poll(0.05)
            except KafkaException as exc:
                self._classify(exc)  # raises _Abort or fatal; retriable falls through to retry
                self.producer.poll(0.05)

    def commit(self, rewind: bool = True) -> bool:
        """Commit closed windows, dead letters and checkpoints in one transaction; False if aborted.

        After an abort, every partition is restored from its committed checkpoint and the consumer
        seeks there (``rewind``); on revocation the partitions are dropped instead.
        """
        began = time.perf_counter()
        if not self._broker_answers(probe=rewind):
            return False  # keep the transaction open; the next commit tries again
        self.window_counters.prime(self.engine.open_rows(), self.engine.team_of)
        try:
            records = self.engine.poll_closed()
            checkpoints: dict[int, Checkpoint] = {}
            for part in sorted(self.assigned):
                cp = self.engine.checkpoint(part, next_offset=self.positions.get(part))
                if cp is not None:
                    cp = self.prices_agreement.committed_as(part, cp)
                if cp is not None and cp != self.committed.get(part):
                    checkpoints[part] = cp
            if not records and not checkpoints and not self.in_txn:
                self.pending = 0
                self.last_commit = time.monotonic()
                # Nothing to commit (idle, or replaying: the restored checkpoint stands), but the
                # positions moved: the replay and lag gauges must follow them (review L7).
                self._refresh_info()
                return True
            self._begin()
            encode, topic = self.encode, self.cfg.output_topic
            for rec in records:
                self._produce(topic, encode(rec), output_key(rec))
            if checkpoints:
                offsets = [
                    TopicPartition(self.cfg.input_topic, part, cp.offset, cp.to_metadata())
                    for part, cp in checkpoints.items()
                ]
                self._call(
                    with_deadline(
                        self.producer.send_offsets_to_transaction,
                        _STUCK_S,
                        "send_offsets",
                        self._stop,
                    ),
                    offsets,
                    self.consumer.consumer_group_metadata(),
                    _OP_TIMEOUT_S,
                )
            self._call(self.producer.commit_transaction, _OP_TIMEOUT_S)
        except _Abort as exc:
            self._abort_and_rewind(str(exc), rewind)
            return False
        except StuckCallError as exc:  # a fresh producer fences the stuck one and aborts its transaction
            stop = self._stop
            if stop is not None and stop.is_set():
                # Stopping: no new producer, no further commit. The open transaction is aborted by
                # the broker (transaction.timeout.ms) or fenced by the next start; input is replayed.
                self._wedged = True
                return False
            self._replace_producer(str(exc))
            self._abort_and_rewind(str(exc), rewind)
            return False
        self.in_txn = False
        self.committed.update(checkpoints)
        if self.progress is not None:
            self.progress.maybe_publish(self.positions)
        self.pending = 0
        self.last_commit = time.monotonic()
        for rec in records:
            self.metrics.emitted.labels(rec["kind"]).inc()
        self.window_counters.add(records)
        self.metrics.transactions.labels("committed").inc()
        self.metrics.last_commit.set(time.time())
        self.metrics.commit_seconds.observe(time.perf_counter() - began)
        self.stats_snapshot = dict(self.engine.stats)
        self._refresh_info()
        return True

    def _broker_answers(self, probe: bool = True) -> bool:
        """After "all brokers down", commit only once the cluster answers again: librdkafka's
        send_offsets_to_transaction can block for ever, past its timeout, when called with the
        coordinator down (confluentinc/librdkafka#5456, seen in the outage drill). A metadata request
        (2 s at most) per commit while the outage lasts keeps the loop alive; commits resume after."""
        if self._wedged:
            return False  # stopping with a producer stuck in a call: leave the transaction open
        if not probe:  # inside a rebalance callback (close, revoke): no nested client call
            return not self._broker_was_down
        now = time.monotonic()
        if not self._broker_was_down and now - self._last_probe < 1.0:
            return True  # probed within the last second (commits can be every 100 ms)
        self._last_probe = now
        try:
            self.consumer.list_topics(self.cfg.input_topic, timeout=2.0)
        except KafkaException:
            self._broker_was_down = True
            return False
        if not self._broker_was_down:
            return True
        # Back after an outage: the transactional producer may keep a dead coordinator and hang in
        # its next send_offsets (confluentinc/librdkafka#5511). Start from a fresh one.
        self._broker_was_down = False
        self._replace_producer("the broker answers again after an outage")
        self._abort_and_rewind("producer replaced after an outage")
        return True

    @property
    def abandoned_producers(self) -> int:
        """Producers replaced after an outage or left in a stuck call (kept, never torn down)."""
        return len(self._abandoned) + int(self._wedged)

    def _replace_producer(self, why: str) -> None:
        """A fresh producer with the same transactional.id fences the old one and aborts its open
        transaction at the coordinator; the old one is abandoned (it may be stuck in a call)."""
        log.warning("replacing the transactional producer", extra=fields(why=why))
        # Keep the old one referenced: destroying a producer that is stuck in a transactional call
        # can abort the process; it is a few threads and buffers, and replacements are rare.
        self._abandoned.append(self.producer)
        self.producer = self._new_producer()
        self._call(self.producer.init_transactions, _OP_TIMEOUT_S)
        self.in_txn = False

    def _call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Call a transactional API, retrying retriable errors; abortable -> _Abort; fatal -> raise."""
        deadline = time.monotonic() + _RETRY_FOR_S
        while True:
            try:
                return fn(*args)
            except KafkaException as exc:
                self._classify(exc)
                if time.monotonic() > deadline:
                    raise ChargebackFatalError(
                        f"{getattr(fn, '__name__', fn)} kept failing: {exc.args[0].str()}"
                    ) from exc
                log.info(
                    "retriable transaction error, retrying",
                    extra=fields(op=getattr(fn, "__name__", str(fn)), error=exc.args[0].str()),
                )
                time.sleep(0.1)

    @staticmethod
    def _classify(exc: KafkaException) -> None:
        """Return for a retriable error; raise _Abort for an abortable one, fatal otherwise."""
        err = exc.args[0] if exc.args else None
        if not isinstance(err, KafkaError):
            raise ChargebackFatalError(f"unexpected Kafka error: {exc}") from exc
        if err.fatal():
            raise ChargebackFatalError(f"fatal Kafka error ({err.name()}): {err.str()}") from exc
        if err.txn_requires_abort():
            raise _Abort(f"{err.name()}: {err.str()}") from exc
        if err.retriable():
            return
        raise ChargebackFatalError(f"Kafka error ({err.name()}): {err.str()}") from exc

    def _abort_and_rewind(self, why: str, rewind: bool = True) -> None:
        """Abort, forget every partition's state and resume from the committed checkpoints."""
        log.warning("aborting transaction and rewinding to the committed checkpoints", extra=fields(why=why))
        if self.in_txn:
            try:
                self._call(self.producer.abort_transaction, _OP_TIMEOUT_S)
            except _Abort as exc:
                raise ChargebackFatalError(f"abort_transaction failed: {exc}") from exc
            self.in_txn = False
        self.metrics.transactions.labels("aborted").inc()
        self.engine.poll_closed()  # discard: they were produced in the aborted transaction
        parts = sorted(self.assigned)
        for part in parts:
            self.engine.drop_partition(part)
        if parts and rewind:
            self.starts = self._restore(parts)
            self._reposition()
        self.pending = 0
        self.last_commit = time.monotonic()

    def _restore(self, parts: list[int]) -> dict[int, int]:
        """Restore ``parts`` from their committed checkpoints; return where to consume each from."""
        topic = self.cfg.input_topic
        committed = retry(  # an assignment can land as the broker goes away: wait, do not exit
            lambda: self.consumer.committed([TopicPartition(topic, p) for p in parts], timeout=_OP_TIMEOUT_S),
            what=f"committed offsets of {topic}",
        )
        starts: dict[int, int] = {}
        # PriceChangeError when this price table would re-price usage already billed (review D6).
        restored = {
            tp.partition: Checkpoint.from_metadata(tp.offset, tp.metadata)
            for tp in committed
            if tp.error is None and tp.offset is not None and tp.offset >= 0
        }
        self.prices_agreement.check_restored(restored)
        self.prices_agreement.forget(parts)  # taken over from an instance with another table: hold
        self.prices_agreement.carry(restored, self.engine.instance_id)
        self.prices_agreement.refresh()
        for tp in committed:
            if tp.error is not None:
                raise ChargebackFatalError(f"cannot read the committed offset of {topic}[{tp.partition}]")
            part = tp.partition
            self.positions.pop(part, None)
            self.committed.pop(part, None)
            if tp.offset is None or tp.offset < 0:
                self.engine.restore(part, None)
                starts[part] = self._fresh_start(part)
                log.info("partition starts fresh", extra=fields(partition=part, offset=starts[part]))
                continue
            cp = Checkpoint.from_metadata(tp.offset, tp.metadata)
            self.engine.restore(part, cp)  # CheckpointMismatchError for other window settings
            if cp is not None:
                self.committed[part] = cp
            starts[part] = tp.offset
            log.info(
                "partition restored",
                extra=fields(
                    partition=part,
                    offset=tp.offset,
                    replay_until=None if cp is None else cp.replay_until,
                    watermark_ms=None if cp is None else cp.watermark_ms,
                ),
            )
        # Restored below any held record: the hold must not stay above it (see PriceHolds._unhold).
        self._unhold([p for p in parts if p in self.held])
        return starts

    def _reposition(self) -> None:
        """Seek every assigned partition to where its restored state begins."""
        topic = self.cfg.input_topic
        # A partition restored since its last record (all of them with eager assignment) starts
        # where its restored state begins; one kept across an incremental rebalance where it was.
        tps = [
            TopicPartition(topic, p, self.positions.get(p, self.starts[p]))
            for p in sorted(self.assigned)
            if p in self.starts
        ]
        log.debug("repositioning after an assignment change", extra=fields(starts=self.starts))
        try:
            for tp in tps:
                self.consumer.seek(tp)
        except KafkaException as exc:  # a partition not fetching yet: re-assigning sets positions too
            if self.cooperative:  # assign() is not allowed: end rather than guess
                raise ChargebackFatalError(f"seek failed: {exc.args[0].str()}") from exc
            log.info("seek failed, re-assigning instead", extra=fields(error=exc.args[0].str()))
            self.consumer.assign(tps)

    def _contiguous(self, msgs: list[Message]) -> list[Message]:
        """The messages that continue each assigned partition exactly where its state is (after an
        incremental rebalance); a partition with a stale or missing offset is sought back there."""
        expected: dict[int, int] = {}
        broken: set[int] = set()
        out: list[Message] = []
        for m in msgs:
            if m.error() is not None:
                out.append(m)
                continue
            p = m.partition()
            if p not in self.assigned or p in broken:
                continue
            exp = expected.get(p, self.positions.get(p, self.starts.get(p)))
            if exp is None or m.offset() != exp:
                broken.add(p)
                if exp is not None:
                    expected[p] = exp
                continue
            expected[p] = exp + 1
            out.append(m)
        for p in sorted(broken):
            if p in expected:
                self.consumer.seek(TopicPartition(self.cfg.input_topic, p, expected[p]))
        return out

    def _fresh_start(self, part: int) -> int:
        low, high = retry(
            lambda: self.consumer.get_watermark_offsets(
                TopicPartition(self.cfg.input_topic, part), timeout=_OP_TIMEOUT_S
            ),
            what=f"offsets of {self.cfg.input_topic}[{part}]",
        )
        return low if self.cfg.start == "earliest" else high

    def _on_client_error(self, err: KafkaError) -> None:
        """librdkafka's error callback (runs inside consume()/poll()): remember fatal errors."""
        if (err.fatal() or err.code() == KafkaError._FATAL) and self.fatal is None:
            self.fatal = ChargebackFatalError(f"fatal Kafka error ({err.name()}): {err.str()}")
            log.error("fatal Kafka client error", extra=fields(error=err.str(), code=err.name()))

    # -- introspection ----------------------------------------------------------------------------
    def health(self) -> tuple[bool, dict[str, Any]]:
        age = time.monotonic() - self.last_loop if self.last_loop else None
        ok = self.fatal is None and not self.failed and self.started and age is not None and age < 60
        detail: dict[str, Any] = {
            "assigned_partitions": sorted(self.assigned),
            "seconds_since_poll": None if age is None else round(age, 3),
            "seconds_since_commit": round(time.monotonic() - self.last_commit, 3),
            "transactional_id": self.cfg.transactional_id,
        }
        hold = self.prices_agreement.hold_detail()
        if hold is not None:
            # Degraded, not unhealthy (still 200, as during a replay or a broker outage): the hold
            # is expected during every rolling update of the price table, and a failing probe
            # would restart instances in the middle of the update it waits for. The alert
            # ChargebackPriceHold covers a hold that does not end.
            detail["degraded"] = "price hold: windows wait until every instance runs the same price table"
            detail["price_hold"] = {**hold, "held_partitions": sorted(self.held)}
        return ok, detail


__all__ = [
    "ChargebackFatalError",
    "ChargebackService",
    "ServiceConfig",
]
