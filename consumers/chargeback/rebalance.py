"""What happens to the chargeback's partition state when the group moves partitions.

Open windows live only in memory, so every change of ownership is a restore or a drop. Eager by
default: an assignment restores every partition's checkpoint and replays; a revocation commits the
normal end-of-batch transaction and drops state. With cooperative-sticky assignment only the
partitions that moved are restored. A lost assignment cannot commit: the open transaction is
aborted and whatever is kept is rebuilt. An aborted transaction rewinds the same way.

The handlers raise like any code; the service's librdkafka callbacks catch what they raise and
surface it after ``consume()`` returns, so nothing is raised into librdkafka.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from confluent_kafka import OFFSET_INVALID, TopicPartition

from gpupipe.common.logs import fields
from gpupipe.kafka.txn import TransactionalSession
from gpupipe_consumers.chargeback.errors import ChargebackFatalError
from gpupipe_consumers.chargeback.idle import PartitionIdleness
from gpupipe_consumers.chargeback.partitions import InputPartitions
from gpupipe_consumers.chargeback.price_agreement import PriceAgreement, PriceHolds
from gpupipe_consumers.chargeback.service_config import ChargebackMetrics
from gpupipe_consumers.chargeback.state_metrics import PartitionInfo
from gpupipe_consumers.chargeback.windows import Checkpoint, WindowEngine

log = logging.getLogger("gpupipe.chargeback")


class PartitionOwnership:
    """Restores, drops and rebuilds partition state as the assignment changes; counts the changes."""

    def __init__(
        self,
        partitions: InputPartitions,
        engine: WindowEngine,
        holds: PriceHolds,
        idle: PartitionIdleness,
        info: PartitionInfo,
        txn: TransactionalSession,
        metrics: ChargebackMetrics,
        group_id: str,
        on_unchecked: Callable[[dict[int, int], dict[int, int]], None] | None = None,
        output_holds_records: Callable[[], bool | None] | None = None,
    ) -> None:
        self.partitions = partitions
        # Partitions that restart without a checkpoint of ours and may re-emit what an earlier
        # process emitted: (foreign, missing), each partition -> the offset it starts from.
        self.on_unchecked = on_unchecked
        # Whether the output topic holds records: a partition without any committed offset re-emits
        # only if something was emitted before (None: never asked, as for a new deployment).
        self.output_holds_records = output_holds_records
        self.engine = engine
        self.holds = holds
        self.agreement: PriceAgreement = holds.agreement
        self.idle = idle
        self.info = info
        self.txn = txn
        self.metrics = metrics
        self.group_id = group_id
        self.rebalances = 0  # assignment changes so far (callbacks run inside consume())

    def our_partitions(self, parts: list[TopicPartition]) -> list[int]:
        """Partition ids of ``parts``; a topic we did not subscribe to is a fatal error."""
        topic = self.partitions.topic
        foreign = sorted({tp.topic for tp in parts if tp.topic != topic})
        if foreign:
            raise ChargebackFatalError(
                f"the group handed us partitions of {foreign}, not of {topic}: another "
                f"environment shares the group id {self.group_id!r}; give each its own --group-id"
            )
        return sorted(tp.partition for tp in parts)

    # -- restore ----------------------------------------------------------------------------------
    def restore(self, parts: list[int]) -> dict[int, int]:
        """Restore ``parts`` from their committed checkpoints; return where to consume each from."""
        p, engine, agreement = self.partitions, self.engine, self.agreement
        committed = p.read_committed(parts)
        starts: dict[int, int] = {}
        foreign: dict[int, int] = {}
        missing: dict[int, int] = {}  # no committed offset at all, with retained input to replay
        # PriceChangeError when this price table would re-price usage already billed.
        restored = {
            tp.partition: Checkpoint.from_metadata(tp.offset, tp.metadata)
            for tp in committed
            if tp.error is None and tp.offset is not None and tp.offset >= 0
        }
        agreement.check_restored(restored)
        agreement.forget(parts)  # taken over from an instance with another table: hold
        agreement.carry(restored, engine.instance_id)
        agreement.refresh()
        for tp in committed:
            if tp.error is not None:
                raise ChargebackFatalError(f"cannot read the committed offset of {p.topic}[{tp.partition}]")
            part = tp.partition
            p.forget(part)
            if tp.offset is None or tp.offset < 0:
                engine.restore(part, None)
                starts[part], end = p.fresh_start(part)
                if starts[part] < end:
                    missing[part] = starts[part]
                log.info("partition starts fresh", extra=fields(partition=part, offset=starts[part]))
                continue
            cp = Checkpoint.from_metadata(tp.offset, tp.metadata)
            engine.restore(part, cp)  # CheckpointMismatchError for other window settings
            if cp is not None:
                p.committed[part] = cp
            else:
                foreign[part] = tp.offset
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
        # Restored below any held record: the hold must not stay above it (see PriceHolds.unhold).
        self.holds.unhold_held(parts)
        # Every partition of a new deployment has no committed offset either; only once the output
        # topic holds records can one whose offsets expired (or were deleted) re-emit anything.
        # Unknown (None): held and read back all the same, but not counted as expired offsets.
        holds = self.output_holds_records() if missing and self.output_holds_records is not None else False
        if holds is False:
            missing = {}
        if foreign:
            self.metrics.foreign_checkpoints.inc(len(foreign))
        if missing and holds:
            self.metrics.missing_checkpoints.inc(len(missing))
        if (foreign or missing) and self.on_unchecked is not None:
            self.on_unchecked(foreign, missing)
        return starts

    def rewind(self, restore: bool = True) -> None:
        """Drop every assigned partition's state; with ``restore``, restore it from the committed
        checkpoints and seek there (after an aborted transaction)."""
        parts = sorted(self.partitions.assigned)
        for part in parts:
            self.engine.drop_partition(part)
        if parts and restore:
            self.partitions.starts = self.restore(parts)
            self.partitions.reposition()

    # -- the group's changes (run inside consume()) -----------------------------------------------
    def assigned(self, consumer: Any, parts: list[TopicPartition]) -> None:
        p = self.partitions
        ids = self.our_partitions(parts)
        self.idle.forget(ids)
        self.metrics.rebalances.labels("assign").inc()
        self.rebalances += 1
        if p.cooperative:
            # Incremental: ``parts`` are only the added partitions; the kept ones go on with their
            # state, so only what moved is restored and replayed.
            new = [q for q in ids if q not in p.assigned]
            starts = self.restore(new) if new else {}
            p.starts.update(starts)
            p.assigned.update(new)
            consumer.incremental_assign([TopicPartition(p.topic, q, starts[q]) for q in new])
            self.holds.unhold(new)  # librdkafka may keep a pause from an earlier assignment
            log.info("partitions assigned", extra=fields(partitions=new, incremental=True))
            self.info.refresh()
            return
        starts = self.restore(ids) if ids else {}
        p.starts = starts
        p.assigned = set(ids)
        consumer.assign([TopicPartition(p.topic, q, starts.get(q, OFFSET_INVALID)) for q in ids])
        # A new assignment starts unpaused, at the checkpoints: librdkafka keeps a pause across
        # unassign/assign, so resume what an earlier hold may have left paused.
        self.holds.held.clear()
        self.holds.unhold(ids)
        log.info("partitions assigned", extra=fields(partitions=ids))
        self.info.refresh()

    def revoked(
        self, consumer: Any, parts: list[TopicPartition], end_of_batch: Callable[[], object] | None
    ) -> None:
        """``end_of_batch``: the normal commit before the state goes (None: nothing may commit)."""
        p = self.partitions
        ids = self.our_partitions(parts)
        self.rebalances += 1
        self.metrics.rebalances.labels("revoke").inc()
        if end_of_batch is not None:
            end_of_batch()
        self.holds.unhold_held(ids)  # before librdkafka unassigns them
        self.agreement.forget(ids)
        for part in ids:
            self.engine.drop_partition(part)
            p.forget(part)
        p.assigned.difference_update(ids)
        if p.cooperative:
            consumer.incremental_unassign(parts)
        log.info("partitions revoked", extra=fields(partitions=ids))
        self.info.refresh()

    def lost(self, consumer: Any, parts: list[TopicPartition]) -> None:
        """Everything not committed is gone with the transaction: every partition kept is rebuilt."""
        p = self.partitions
        ids = self.our_partitions(parts)
        self.rebalances += 1
        self.metrics.rebalances.labels("lost").inc()
        log.warning(
            "partitions lost (no commit possible); dropping their state", extra=fields(partitions=ids)
        )
        if self.txn.abort_if_possible():
            self.metrics.transactions.labels("aborted").inc()
        self.engine.poll_closed()
        for part in sorted(p.assigned):
            self.engine.drop_partition(part)
            p.forget(part)
        p.assigned.difference_update(ids)
        self.agreement.forget(ids)
        self.holds.unhold(list(self.holds.held))  # every kept partition is restored and read again
        if p.cooperative:
            consumer.incremental_unassign(parts)
            kept = sorted(p.assigned)  # eager: none (a new assignment restores everything)
            if kept:
                p.starts.update(self.restore(kept))
                self.rebalances += 1  # a batch fetched before this must be discarded
                p.reposition()
        self.info.refresh()
