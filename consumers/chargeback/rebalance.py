"""The chargeback service's rebalance callbacks (run by librdkafka inside ``consume()``).

Eager by default: an assignment restores every partition's checkpoint and replays; a revocation
commits the normal end-of-batch transaction and drops state. With cooperative-sticky assignment
only the partitions that moved are restored (review W1). A lost assignment cannot commit: the open
transaction is aborted and whatever is kept is rebuilt. A callback never raises into librdkafka:
it stores the exception in ``self.fatal`` and the service's loop surfaces it.

A mixin of :class:`consumers.chargeback.service.ChargebackService`, whose state it uses.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

from confluent_kafka import OFFSET_INVALID, TopicPartition

from consumers.chargeback.errors import AbortTransaction, ChargebackFatalError
from consumers.chargeback.service_config import OP_TIMEOUT_S
from gpupipe.logs import fields

log = logging.getLogger("gpupipe.chargeback")


class RebalanceCallbacks:
    """``_on_assign``, ``_on_revoke`` and ``_on_lost`` of the chargeback service."""

    # Set by the service (see ChargebackService.__init__).
    cfg: Any
    fatal: BaseException | None

    def _our_partitions(self, parts: list[TopicPartition]) -> list[int]:
        """Partition ids of ``parts``; a topic we did not subscribe to is a fatal error (review D3)."""
        foreign = sorted({tp.topic for tp in parts if tp.topic != self.cfg.input_topic})
        if foreign:
            raise ChargebackFatalError(
                f"the group handed us partitions of {foreign}, not of {self.cfg.input_topic}: another "
                f"environment shares the group id {self.cfg.group_id!r}; give each its own --group-id"
            )
        return sorted(tp.partition for tp in parts)

    # -- rebalance callbacks (run inside consume()) -----------------------------------------------
    def _on_assign(self, consumer: Any, parts: list[TopicPartition]) -> None:
        if self.fatal is not None:
            return
        try:
            ids = self._our_partitions(parts)
            self.idle.forget(ids)
            self.metrics.rebalances.labels("assign").inc()
            self.rebalances += 1
            if self.cooperative:
                # Incremental (W1): ``parts`` are only the added partitions; the kept ones go on
                # with their state, so only what moved is restored and replayed.
                new = [p for p in ids if p not in self.assigned]
                starts = self._restore(new) if new else {}
                self.starts.update(starts)
                self.assigned.update(new)
                consumer.incremental_assign([TopicPartition(self.cfg.input_topic, p, starts[p]) for p in new])
                self._unhold(new)  # librdkafka may keep a pause from an earlier assignment
                log.info("partitions assigned", extra=fields(partitions=new, incremental=True))
                self._refresh_info()
                return
            starts = self._restore(ids) if ids else {}
            self.starts = starts
            self.assigned = set(ids)
            consumer.assign(
                [TopicPartition(self.cfg.input_topic, p, starts.get(p, OFFSET_INVALID)) for p in ids]
            )
            # A new assignment starts unpaused, at the checkpoints: librdkafka keeps a pause across
            # unassign/assign, so resume what an earlier hold may have left paused.
            self.held.clear()
            self._unhold(ids)
            log.info("partitions assigned", extra=fields(partitions=ids))
            self._refresh_info()
        except BaseException as exc:  # surfaced by the loop after consume() returns
            self.fatal = exc

    def _on_revoke(self, consumer: Any, parts: list[TopicPartition]) -> None:
        if self.fatal is not None:
            return
        try:
            ids = self._our_partitions(parts)
            self.rebalances += 1
            self.metrics.rebalances.labels("revoke").inc()
            if self.started and not self.failed:
                self.commit(rewind=False)  # the normal end-of-batch transaction
            self._unhold([p for p in ids if p in self.held])  # before librdkafka unassigns them
            self.prices_agreement.forget(ids)
            for part in ids:
                self.engine.drop_partition(part)
                self.positions.pop(part, None)
                self.committed.pop(part, None)
            self.assigned.difference_update(ids)
            if self.cooperative:
                consumer.incremental_unassign(parts)
            log.info("partitions revoked", extra=fields(partitions=ids))
            self._refresh_info()
        except BaseException as exc:
            self.fatal = exc

    def _on_lost(self, consumer: Any, parts: list[TopicPartition]) -> None:
        if self.fatal is not None:
            return
        try:
            ids = self._our_partitions(parts)
            self.rebalances += 1
            self.metrics.rebalances.labels("lost").inc()
            log.warning(
                "partitions lost (no commit possible); dropping their state", extra=fields(partitions=ids)
            )
            if self.in_txn:
                with contextlib.suppress(AbortTransaction):
                    self._call(self.producer.abort_transaction, OP_TIMEOUT_S)
                self.in_txn = False
                self.metrics.transactions.labels("aborted").inc()
            self.engine.poll_closed()
            # Everything not committed is gone with the transaction: rebuild every partition we keep.
            for part in sorted(self.assigned):
                self.engine.drop_partition(part)
                self.positions.pop(part, None)
                self.committed.pop(part, None)
            self.assigned.difference_update(ids)
            self.prices_agreement.forget(ids)
            self._unhold(list(self.held))  # every kept partition is restored and read again
            self.pending = 0
            if self.cooperative:
                consumer.incremental_unassign(parts)
                kept = sorted(self.assigned)  # eager: none (a new assignment restores everything)
                if kept:
                    self.starts.update(self._restore(kept))
                    self.rebalances += 1  # a batch fetched before this must be discarded
                    self._reposition()
            self._refresh_info()
        except BaseException as exc:
            self.fatal = exc
