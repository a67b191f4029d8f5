"""The chargeback service: a transactional consume-transform-produce loop around the window engine.

Each transaction holds the closed windows' records, the dead letters and every input partition's
checkpoint as its committed offset: all visible together or not at all. Raises
:class:`ChargebackFatalError` when fenced or on a fatal Kafka error. Fencing, recovery and the
collaborators: docs/inside-chargeback.md.
"""

from __future__ import annotations

import contextlib
import logging
import os
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
from confluent_kafka.admin import AdminClient
from prometheus_client import CollectorRegistry

from gpupipe.common.errors import ConfigError
from gpupipe.common.logs import fields
from gpupipe.domain.node_check import DEADLETTER_REASON as NODE_IDENTITY
from gpupipe.domain.node_check import NodeCheck, NodeCheckCollector, NodeIdentity
from gpupipe.domain.price_schedule import PriceSchedule
from gpupipe.kafka.admin import client_config
from gpupipe.kafka.stuck_call import StuckCallError
from gpupipe.kafka.txn import AbortRequired, TransactionalSession, TransactionFatalError
from gpupipe_consumers.chargeback.emitted import EmittedIdsReader, holds_records_since
from gpupipe_consumers.chargeback.errors import ChargebackFatalError, GpuCapReached, PriceChangeError
from gpupipe_consumers.chargeback.identity import check_client_overrides
from gpupipe_consumers.chargeback.idle import PartitionIdleness
from gpupipe_consumers.chargeback.partitions import InputPartitions
from gpupipe_consumers.chargeback.price_agreement import PriceAgreement, PriceHolds
from gpupipe_consumers.chargeback.progress import ProgressPublisher
from gpupipe_consumers.chargeback.prom_counters import WindowCounters
from gpupipe_consumers.chargeback.rebalance import PartitionOwnership
from gpupipe_consumers.chargeback.sample_age import TOO_OLD, too_old
from gpupipe_consumers.chargeback.sample_decode import ChargebackDecoder, Sample, sample_violation
from gpupipe_consumers.chargeback.service_config import OP_TIMEOUT_S as _OP_TIMEOUT_S
from gpupipe_consumers.chargeback.service_config import ChargebackMetrics, ServiceConfig, output_key
from gpupipe_consumers.chargeback.settings import ChargebackSettings, build_engine, projected_sample_schema
from gpupipe_consumers.chargeback.state_metrics import PartitionInfo, StateCollector
from gpupipe_consumers.chargeback.windows import Checkpoint, WindowEngine
from gpupipe_consumers.plumbing.deadletter import deadletter_message
from gpupipe_schemas import catalog
from gpupipe_schemas.codec import AvroCodec, Decoded, Headers, codec_from_url
from gpupipe_schemas.errors import DecodeError

log = logging.getLogger("gpupipe.chargeback")

SERVICE = "chargeback"
_SAMPLE = "GpuSample"
_RETRY_FOR_S = 120.0  # how long a retriable transaction error is retried before the service ends
_STUCK_S = 15.0  # send_offsets_to_transaction takes milliseconds; past this it is stuck (librdkafka#5456)

_Callback = Callable[[Any, list[TopicPartition]], None]


def _default_consumer(conf: dict[str, Any]) -> Any:
    return Consumer(conf)


def _default_producer(conf: dict[str, Any]) -> Any:
    return Producer(conf)


class ChargebackService:
    """Runs the engine over the input topic with exactly-once output until ``stop`` is set."""

    def __init__(
        self,
        cfg: ServiceConfig,
        engine: WindowEngine,
        codec: AvroCodec,
        registry: CollectorRegistry | None = None,
        *,
        decode: Callable[[bytes | None, Headers], Decoded | Sample] | None = None,
        consumer_factory: Callable[[dict[str, Any]], Any] = _default_consumer,
        producer_factory: Callable[[dict[str, Any]], Any] = _default_producer,
        admin_factory: Callable[[dict[str, Any]], Any] | None = None,
        node_check: NodeCheck | None = None,
    ) -> None:
        if cfg.start not in ("earliest", "latest"):
            raise ValueError(f"start must be earliest or latest, got {cfg.start!r}")
        check_client_overrides(cfg.extra)
        self.cfg = cfg
        self.engine = engine
        self.codec = codec
        self.decode: Callable[[bytes | None, Headers], Decoded | Sample] = (
            decode if decode is not None else codec.decode
        )
        self.registry = registry if registry is not None else CollectorRegistry()
        self.metrics = ChargebackMetrics(self.registry)
        self.window_counters = WindowCounters(self.registry, engine.prices.currency)
        # With --node-ca-file: a sample not signed by the node it names is dead-lettered, not billed
        self.node_check = node_check
        if node_check is not None:
            self.registry.register(NodeCheckCollector(node_check, SERVICE))
        self.encode = codec.encoder("ChargebackWindow", cfg.output_topic).encode
        self.pending = 0  # records consumed since the last commit
        self.last_commit = time.monotonic()
        self.last_loop = 0.0
        self.fatal: BaseException | None = None
        # Set once the loop ended on an error: from then on nothing may commit (not even the revoke
        # callback that consumer.close() runs), or checkpoints would pass windows that were drained
        # from the engine but never committed.
        self.failed = False
        self.started = False
        self.warned_create_time = False
        self._gpu_cap_logged_ms = -60_000

        self._consumer_conf = self._consumer_config(cfg)
        # Incremental (cooperative-sticky) rebalancing when configured: only moved partitions replay.
        cooperative = (
            "cooperative" in str(self._consumer_conf.get("partition.assignment.strategy", "")).lower()
        )
        self._consumer_factory = consumer_factory
        self._admin_factory = admin_factory
        producer_conf = client_config(
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

        self.partitions = InputPartitions(cfg.input_topic, cfg.start, cooperative)
        self.txn = TransactionalSession(
            lambda: producer_factory(dict(producer_conf)),  # again when a stuck one is replaced
            probe=self.partitions.probe,
            op_timeout_s=_OP_TIMEOUT_S,
            retry_for_s=_RETRY_FOR_S,
            stuck_s=_STUCK_S,
            log=log,
        )
        # Idleness: when each partition last delivered a record, and the newest broker
        # (LogAppendTime) timestamp seen with the monotonic time it was seen at.
        self.idle = PartitionIdleness(cfg.idle_timeout_s)
        # One price per window across instances, also while a rolling update runs two price files:
        # partitions whose next record would close a window of disputed prices wait.
        self.prices_agreement = PriceAgreement(engine.price_fingerprint, engine.window_ms, engine.grace_ms)
        self.prices_agreement.me = engine.instance_id
        self.holds = PriceHolds(self.prices_agreement, self.partitions, engine)
        self.info = PartitionInfo(self.partitions, engine)
        self.ownership = PartitionOwnership(
            self.partitions,
            engine,
            self.holds,
            self.idle,
            self.info,
            self.txn,
            self.metrics,
            cfg.group_id,
            on_unchecked=self._on_unchecked_partitions,
            output_holds_records=self._output_holds_records,
        )
        self.emitted_ids = EmittedIdsReader(
            bootstrap=cfg.bootstrap,
            topic=cfg.output_topic,
            group_id=cfg.group_id,
            codec=codec,
            extra=cfg.extra,
            release=self.window_counters.release,
        )
        self.progress: ProgressPublisher | None = None
        self.registry.register(StateCollector(self.info, self.prices_agreement))

    def _consumer_config(self, cfg: ServiceConfig) -> dict[str, Any]:
        consumer_conf: dict[str, Any] = {
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
            # not always as a consume() error: either way the process must end.
            "error_cb": self._on_client_error,
        }
        if cfg.static_membership:
            consumer_conf["group.instance.id"] = cfg.instance_id
        return client_config(cfg.bootstrap, cfg.extra, **consumer_conf)

    # -- what callers and tests read --------------------------------------------------------------
    @property
    def held(self) -> dict[int, int]:
        return self.holds.held

    def _dedupe_since_ms(self) -> int:
        return int((time.time() - self.cfg.dedupe_lookback_s) * 1000)

    def _output_holds_records(self) -> bool | None:
        """Whether the output topic holds records a partition restarting without any committed
        offset could emit again (within the lookback); None when the broker does not say. Unknown
        partitions are held and read back like the others: a read that fails as well releases
        them unchecked, with a warning."""
        try:
            return holds_records_since(
                self.partitions.consumer, self.cfg.output_topic, self._dedupe_since_ms(), _OP_TIMEOUT_S
            )
        except KafkaException as exc:
            log.warning(
                "cannot tell whether the output topic holds windows: partitions starting without a "
                "committed offset are held and their emitted record ids read back",
                extra=fields(topic=self.cfg.output_topic, error=str(exc)),
            )
            return None

    def _on_unchecked_partitions(self, foreign: dict[int, int], missing: dict[int, int]) -> None:
        """Partitions restarting without a checkpoint of ours, whose re-processed input re-emits
        windows an earlier process emitted: say so, and keep the dashboard counters from counting
        them again (see prom_counters). One read of the output topic serves both kinds."""
        if foreign:
            log.warning(
                "committed offsets without a chargeback checkpoint (an offset reset, a mirror failover "
                "or another writer): these partitions re-process their input from there and emit its "
                "windows again under the same record ids, which the report counts once",
                extra=fields(partitions={str(p): o for p, o in sorted(foreign.items())}),
            )
        if missing:
            log.warning(
                "partitions start without a committed offset while the output topic holds windows, or "
                "could not be checked (the group's offsets expired after offsets.retention.minutes, "
                "were deleted, or the partitions are new to the group): they "
                "re-process their retained input and emit its windows again under the same record "
                "ids, which the report counts once",
                extra=fields(
                    partitions={str(p): o for p, o in sorted(missing.items())},
                    output=self.cfg.output_topic,
                ),
            )
        parts = set(foreign) | set(missing)
        for part in parts:
            self.window_counters.hold(part)
        self.emitted_ids.start(parts, self._dedupe_since_ms())

    @property
    def rebalances(self) -> int:
        return self.ownership.rebalances

    @property
    def stats_snapshot(self) -> dict[str, int]:
        return self.info.stats

    @property
    def abandoned_producers(self) -> int:
        """Producers replaced after an outage or left in a stuck call (kept, never torn down)."""
        return self.txn.abandoned_producers

    def partition_info(self) -> dict[int, dict[str, Any]]:
        """Per assigned partition: position, watermark, checkpoint distance and lag (scrape thread)."""
        return self.info.snapshot()

    # -- main loop --------------------------------------------------------------------------------
    def prepare(self) -> None:
        """Create the Kafka consumer (and the progress admin client); :meth:`run` calls it first.
        Idempotent."""
        if self.partitions.consumer is not None:
            return
        cfg = self.cfg
        self.partitions.attach(self._consumer_factory(dict(self._consumer_conf)))
        if self._admin_factory is not None:
            self.progress = ProgressPublisher(
                self._admin_factory(client_config(cfg.bootstrap, cfg.extra)),
                cfg.progress_group or f"{cfg.group_id}.progress",
                cfg.input_topic,
            )

    def run(self, stop: threading.Event) -> None:
        """Consume until ``stop`` is set; raise ChargebackFatalError when the service cannot go on."""
        try:
            self._run(stop)
        except TransactionFatalError as exc:
            raise ChargebackFatalError(str(exc)) from exc

    def _run(self, stop: threading.Event) -> None:
        self.prepare()
        self.txn.start(stop)  # a commit stuck in librdkafka gives up at once when the service stops
        log.info(
            "chargeback started",
            extra=fields(
                input=self.cfg.input_topic,
                output=self.cfg.output_topic,
                group=self.cfg.group_id,
                transactional_id=self.cfg.transactional_id,
                window_ms=self.engine.window_ms,
                grace_ms=self.engine.grace_ms,
                max_sample_age_ms=self.cfg.max_sample_age_ms,
            ),
        )
        consumer = self.partitions.consumer
        try:
            self.holds.check_group_prices()
        except PriceChangeError as exc:  # refused before joining the group: nothing moves
            self.failed = True
            with contextlib.suppress(Exception):
                consumer.close()
            raise ChargebackFatalError(str(exc)) from exc
        consumer.subscribe(
            [self.cfg.input_topic],
            on_assign=self._guarded(self.ownership.assigned),
            on_revoke=self._guarded(self._revoked),
            on_lost=self._guarded(self._lost),
        )
        self.started = True
        clean = False
        try:
            while not stop.is_set():
                rebalances = self.ownership.rebalances
                try:
                    msgs = consumer.consume(self.cfg.batch_size, self.cfg.poll_timeout_s)
                except KafkaException as exc:
                    raise ChargebackFatalError(f"consumer failed: {exc.args[0].str()}") from exc
                self._check_fatal()
                self.last_loop = time.monotonic()
                if msgs and rebalances != self.ownership.rebalances:
                    # The assignment changed inside this consume() call: the batch may hold messages
                    # fetched for the old assignment, whose state was committed and dropped.
                    if self.partitions.cooperative:  # keep what continues each partition exactly
                        msgs = self.partitions.contiguous(msgs)
                    else:  # discard it; every partition starts again where its state begins
                        self.partitions.reposition()
                        msgs = []
                if msgs:
                    try:
                        self.process(msgs)
                    except AbortRequired as exc:
                        self._abort_and_rewind(str(exc))
                self.idle.advance(
                    self.partitions.assigned, self.partitions.caught_up, self.holds.advance_idle
                )
                if self.prices_agreement.due() and not self.txn.broker_was_down:
                    self.holds.agree()
                if self._commit_due():
                    self.commit()
                self.txn.poll(0)
            self.commit()  # the normal end-of-batch commit; open windows are NOT flushed
            if self.progress is not None:
                self.progress.maybe_publish(self.partitions.positions, force=True)
            clean = True
        finally:
            if self.progress is not None:
                self.progress.close()
            self._close(clean)

    def _guarded(self, handle: _Callback) -> _Callback:
        """A rebalance callback that never raises into librdkafka: what ``handle`` raises is kept in
        ``fatal`` and surfaced by the loop after consume() returns; once one is kept, nothing runs."""

        def callback(consumer: Any, parts: list[TopicPartition]) -> None:
            if self.fatal is not None:
                return
            try:
                handle(consumer, parts)
            except BaseException as exc:
                self.fatal = exc

        return callback

    def _revoked(self, consumer: Any, parts: list[TopicPartition]) -> None:
        can_commit = self.started and not self.failed
        self.ownership.revoked(consumer, parts, self._end_of_batch if can_commit else None)

    def _end_of_batch(self) -> None:
        self.commit(rewind=False)

    def _lost(self, consumer: Any, parts: list[TopicPartition]) -> None:
        self.ownership.lost(consumer, parts)
        self.pending = 0

    def _close(self, clean: bool) -> None:
        try:
            self._close_clients(clean)
        finally:
            # After the consumer: its close() revokes, and only an assignment starts a read.
            self.emitted_ids.close()

    def _close_clients(self, clean: bool) -> None:
        if not clean:
            self.failed = True  # before close(): its revoke callback must not commit anything
        if self.txn.wedged:
            # A helper thread is still inside send_offsets_to_transaction: closing the clients under
            # it can abort the process. Leave them; the command exits without their teardown.
            log.warning("stopping with a transactional call stuck: uncommitted input is read again")
            return
        consumer = self.partitions.consumer
        if clean:
            try:
                consumer.close()  # eager revoke -> the revoke callback commits nothing new, drops state
            except Exception:
                log.warning("consumer close failed", exc_info=True)
            self._check_fatal()
            return
        self.txn.close()
        with contextlib.suppress(Exception):
            consumer.close()

    def _check_fatal(self) -> None:
        if self.fatal is not None:
            exc = self.fatal
            if isinstance(exc, ChargebackFatalError):
                raise exc
            if isinstance(exc, TransactionFatalError):
                raise ChargebackFatalError(str(exc)) from exc
            raise ChargebackFatalError(f"{type(exc).__name__}: {exc}") from exc

    def _commit_due(self) -> bool:
        if self.pending >= self.cfg.commit_records:
            return True
        return time.monotonic() - self.last_commit >= self.cfg.commit_interval_s

    # -- per batch --------------------------------------------------------------------------------
    def process(self, msgs: list[Message]) -> None:
        """Feed a consumed batch to the engine; dead-letter what cannot be decoded or billed (not on
        replay)."""
        engine = self.engine
        add = engine.add
        decode = self.decode
        first: dict[int, int] = {}
        last: dict[int, int] = {}
        n = 0
        held, hold_at, newly_held = self.holds.held, self.prices_agreement.hold_at, []
        now_ms = int(time.time() * 1000)
        node_check = self.node_check
        saw_broker_time, max_age_ms = self.idle.saw_broker_time, self.cfg.max_sample_age_ms
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
                d = decode(msg.value(), msg.headers())
                if d.name != _SAMPLE:
                    raise DecodeError("unexpected-record-type", f"{d.name} on the samples topic")
                ts_type, ts = msg.timestamp()
                if ts_type == TIMESTAMP_LOG_APPEND_TIME:
                    saw_broker_time(ts)
                elif ts_type == TIMESTAMP_CREATE_TIME and not self.warned_create_time:
                    self.warned_create_time = True
                    log.warning(
                        "input topic uses CreateTime: a node clock running ahead cannot be bounded by "
                        "broker time, and --max-sample-age trusts the producers' record timestamps; set "
                        "message.timestamp.type=LogAppendTime on it",
                        extra=fields(topic=msg.topic()),
                    )
                record_ts = None if ts_type == TIMESTAMP_NOT_AVAILABLE else ts
                check = getattr(d, "check", None)  # a Sample's per-record check (sample_decode.py)
                if check is None:
                    bad = sample_violation(d, record_ts, now_ms)
                else:
                    bad = check(d.record, record_ts, now_ms)
                if bad is not None:  # e.g. dated -2**63: its window would not encode, for ever
                    raise DecodeError("out-of-range", bad)
                if node_check is not None:
                    refused = node_check.refuse(_SAMPLE, d.record.get("hostname"), msg, now_ms)
                    if refused is not None:
                        raise DecodeError(NODE_IDENTITY, refused)
                # Its period may be invoiced already: billed only within the bound (sample_age.py).
                arrived = now_ms if record_ts is None else record_ts
                sample_ts = int(d.record["timestamp_ms"])
                if arrived - sample_ts > max_age_ms:  # too_old's bound, its detail only when over
                    old = too_old(sample_ts, arrived, max_age_ms)
                    if old is not None:
                        raise DecodeError(TOO_OLD, old)
                if hold_at is not None and engine.event_time(sample_ts, record_ts) >= hold_at:
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
            except GpuCapReached as exc:  # never raised on replay (windows.py, "Bounded state")
                quiet = now_ms - self._gpu_cap_logged_ms < 60_000  # a flood: one line a minute
                if not quiet:
                    self._gpu_cap_logged_ms = now_ms
                self.dead_letter(msg, "gpu-cap", str(exc), quiet=quiet)
            except Exception as exc:  # a decodable record the accounting cannot take: never crash
                if not engine.is_replay(part, off):
                    self.dead_letter(msg, "chargeback-rejected", f"{type(exc).__name__}: {exc}")
        if newly_held:
            self.holds.hold_new(newly_held)
        replayed = 0
        self.idle.saw_input(last)
        positions = self.partitions.positions
        for part, off in last.items():
            positions[part] = off + 1
            lo = first[part]
            if engine.is_replay(part, lo):
                replayed += (
                    (off - lo + 1) if engine.is_replay(part, off) else self._count_replay(part, lo, off)
                )
        self.pending += n
        self.metrics.consumed.inc(n)
        if replayed:
            self.metrics.replayed.inc(replayed)
        self.info.take_stats()

    def _count_replay(self, part: int, lo: int, hi: int) -> int:
        is_replay = self.engine.is_replay
        return sum(1 for o in range(lo, hi + 1) if is_replay(part, o))

    def _consume_error(self, err: KafkaError) -> None:
        if err.code() == KafkaError._PARTITION_EOF:
            return
        if err.code() == KafkaError._ALL_BROKERS_DOWN:
            self.txn.broker_down()  # commit() checks the broker before its next transaction
        if err.fatal() or err.code() == KafkaError._FATAL:
            # librdkafka reports a consumer's fatal error (e.g. a fenced group.instance.id) as an
            # event with code _FATAL whose fatal() is False; after it the consumer is dead.
            raise ChargebackFatalError(f"fatal consumer error: {err.str()}")
        log.warning("consume error", extra=fields(error=err.str(), code=err.name()))

    def dead_letter(self, msg: Message, reason: str, detail: str, *, quiet: bool = False) -> None:
        """Produce the record to the dead-letter topic in the current transaction, whole when it fits in
        one Kafka message, else cut to fit (a refused dead letter would abort every transaction).
        ``quiet``: counted, not logged (a flood's dead letters are logged once a minute)."""
        self.txn.begin()
        value, key, headers = deadletter_message(msg, reason, detail, SERVICE)
        self.txn.produce(self.cfg.deadletter_topic, value, key, headers)
        self.metrics.dead_letters.labels(reason).inc()
        if quiet:
            return
        log.warning(
            "record dead-lettered",
            extra=fields(topic=msg.topic(), partition=msg.partition(), offset=msg.offset(), reason=reason),
        )

    # -- transactions -----------------------------------------------------------------------------
    def commit(self, rewind: bool = True) -> bool:
        """Commit closed windows, dead letters and checkpoints in one transaction; False if aborted.

        After an abort, every partition is restored from its committed checkpoint and the consumer
        seeks there (``rewind``); on revocation the partitions are dropped instead.
        """
        began = time.perf_counter()
        if not self._broker_answers(probe=rewind):
            return False  # keep the transaction open; the next commit tries again
        engine, parts, txn = self.engine, self.partitions, self.txn
        self.window_counters.prime(engine.open_rows(), engine.team_of)
        try:
            records = engine.poll_closed()
            checkpoints: dict[int, Checkpoint] = {}
            for part in sorted(parts.assigned):
                cp = engine.checkpoint(part, next_offset=parts.positions.get(part))
                if cp is not None:
                    cp = self.prices_agreement.committed_as(part, cp)
                if cp is not None and cp != parts.committed.get(part):
                    checkpoints[part] = cp
            if not records and not checkpoints and not txn.in_txn:
                self.pending = 0
                self.last_commit = time.monotonic()
                # Nothing to commit (idle, or replaying: the restored checkpoint stands), but the
                # positions moved: the replay and lag gauges must follow them.
                self.info.refresh()
                return True
            txn.begin()
            encode, topic = self.encode, self.cfg.output_topic
            for rec in records:
                txn.produce(topic, encode(rec), output_key(rec))
            if checkpoints:
                offsets = [
                    TopicPartition(self.cfg.input_topic, part, cp.offset, cp.to_metadata())
                    for part, cp in checkpoints.items()
                ]
                txn.send_offsets(offsets, parts.consumer.consumer_group_metadata())
            txn.commit()
        except AbortRequired as exc:  # a stuck producer too: replaced, its transaction fenced
            self._abort_and_rewind(str(exc), rewind)
            return False
        except StuckCallError:
            # Stopping with a call stuck: no new producer, no further commit. The open transaction
            # is aborted by the broker (transaction.timeout.ms) or fenced by the next start; the
            # input is replayed.
            return False
        parts.committed.update(checkpoints)
        if self.progress is not None:
            self.progress.maybe_publish(parts.positions)
        self.pending = 0
        self.last_commit = time.monotonic()
        for rec in records:
            self.metrics.emitted.labels(rec["kind"]).inc()
        self.window_counters.add(records)
        self.metrics.transactions.labels("committed").inc()
        self.metrics.last_commit.set(time.time())
        self.metrics.commit_seconds.observe(time.perf_counter() - began)
        self.info.take_stats()
        self.info.refresh()
        return True

    def _broker_answers(self, probe: bool = True) -> bool:
        """After "all brokers down", commit only once the cluster answers again (see
        :meth:`TransactionalSession.usable`); back from an outage, the producer is a fresh one and
        the input is replayed from the committed checkpoints before the next commit."""
        try:
            return self.txn.usable(probe)
        except AbortRequired as exc:
            self._abort_and_rewind(str(exc))
            return True

    def _abort_and_rewind(self, why: str, rewind: bool = True) -> None:
        """Abort, forget every partition's state and resume from the committed checkpoints."""
        log.warning("aborting transaction and rewinding to the committed checkpoints", extra=fields(why=why))
        self.txn.abort()
        self.metrics.transactions.labels("aborted").inc()
        self.engine.poll_closed()  # discard: they were produced in the aborted transaction
        self.ownership.rewind(restore=rewind)
        self.pending = 0
        self.last_commit = time.monotonic()

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
            "assigned_partitions": sorted(self.partitions.assigned),
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
            detail["price_hold"] = {**hold, "held_partitions": sorted(self.holds.held)}
        return ok, detail

    def close(self) -> None:
        """Say what was done; after an outage, leave without the Kafka clients' teardown."""
        log.info(
            "chargeback stopped", extra=fields(**{k: int(v) for k, v in sorted(self.stats_snapshot.items())})
        )
        if self.abandoned_producers:
            # Producers replaced after an outage may still be inside a librdkafka call; tearing them
            # down at interpreter exit can abort the process (confluent-kafka CallState assertion).
            # Everything of ours is done and logged: leave without that teardown.
            logging.shutdown()
            os._exit(0)


def build(
    cfg: ServiceConfig,
    settings: ChargebackSettings,
    prices: PriceSchedule,
    *,
    team_of: Callable[[str], str | None] | None,
    schema_registry_url: str | None,
    identity: NodeIdentity | None,
) -> ChargebackService:
    """The service with its engine and a decoder of only the GpuSample fields chargeback reads."""
    engine = build_engine(settings, prices, cfg.instance_id, team_of=team_of)
    projected = projected_sample_schema(catalog.current("GpuSample").raw)
    codec = codec_from_url(schema_registry_url, reader_schemas={"GpuSample": projected})
    return ChargebackService(
        cfg,
        engine,
        codec,
        decode=sample_decoder(codec),
        node_check=None if identity is None else identity.check(SERVICE, ("GpuSample",)),
        admin_factory=AdminClient,  # publishes true positions to <group>.progress (lag tooling)
    )


def sample_decoder(codec: AvroCodec) -> Callable[[bytes | None, Headers], Decoded | Sample]:
    """The service's decoder: only the GpuSample fields chargeback reads (sample_decode.py)."""
    return ChargebackDecoder(codec, projected_sample_schema(catalog.current("GpuSample").raw)).decode


def check_topics(bootstrap: str, names: list[str], extra: dict[str, str]) -> None:
    """Fail at startup, not in the first transaction, when a topic is missing (no auto-creation)."""
    existing = AdminClient(client_config(bootstrap, extra)).list_topics(timeout=10).topics
    missing = [n for n in names if n not in existing]
    if missing:
        raise ConfigError(f"missing topics {missing}: create them, or run with --create-topics")


__all__ = [
    "ChargebackFatalError",
    "ChargebackService",
    "ServiceConfig",
    "build",
    "check_topics",
    "sample_decoder",
]
