"""One price per window across the instances of a group, also during a rolling update (review D6).

A price change is deployed by restarting the instances with a new price file, one after the other.
For a while old and new instances run side by side, each pricing the windows of its partitions with
its own file: if both emitted windows after the change's ``valid_from``, one hour would be billed
at two prices (an old instance does not know of the change). So every committed checkpoint carries
the fingerprint of its instance's schedule (``price_schedule.fingerprint``), and each instance

* refuses to start (:class:`PriceChangeError`) on a partition whose checkpoint shows that its
  windows before the *billed horizon* (:meth:`Checkpoint.billed_before`) were priced by a schedule
  that differs from its own there: a change may only apply to usage not billed yet, and corrections
  of billed windows must keep their prices;
* reads the other partitions' checkpoints every couple of seconds (the group's committed offsets)
  and, while one of them shows a schedule that prices differently from some time D on, never
  closes a window that starts at or after D: records whose event time would close one (``hold_at``
  = D's window end + grace) wait, their partition paused, until every partition carries the same
  prices. An old instance holds as soon as a new one has committed (a new one publishes its
  fingerprint in its first commit, during its replay); a new one holds while old ones run. When the
  update is done, all agree and the held records go on. A change deployed ahead of its
  ``valid_from`` (as the price file's docs ask) never holds anything: no window after it is due yet.

A partition that never commits again (no input) keeps its last fingerprint; its next owner's first
commit (even without input) replaces it. A checkpoint without a fingerprint (a writer older than
this) is taken to agree.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from confluent_kafka import KafkaException, TopicPartition

from consumers.chargeback.errors import PriceChangeError
from consumers.chargeback.price_schedule import Fingerprint, divergence
from consumers.chargeback.windows import Checkpoint
from gpupipe.durations import format_iso_ms
from gpupipe.logs import fields

log = logging.getLogger("gpupipe.chargeback")

CHECK_EVERY_S = 2.0
"""How often the other partitions' checkpoints are read (one OffsetFetch request)."""


class PriceAgreement:
    """The decisions, apart from Kafka: what a restored checkpoint allows, and what to hold."""

    def __init__(
        self,
        ours: Fingerprint,
        window_ms: int,
        grace_ms: int,
        interval_s: float = CHECK_EVERY_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.ours, self.window_ms, self.grace_ms = ours, window_ms, grace_ms
        self.interval_s, self.clock = interval_s, clock
        self.last_check = float("-inf")
        self.held_from: int | None = None  # usage time from which another partition prices differently
        self.hold_at: int | None = None  # records of this event time or later wait
        # The other partitions that price differently: partition -> (from when, the instance that
        # committed its checkpoint, None from writers older than that); and since when (clock).
        self.differing: dict[int, tuple[int, str | None]] = {}
        self.since: float | None = None

    def check_restored(self, restored: Mapping[int, Checkpoint | None]) -> None:
        """Refuse partitions whose billed windows this schedule would price differently; the
        message names the latest billed horizon, the earliest ``valid_from`` all of them allow."""
        refused: list[tuple[int, int, int]] = []  # (billed before, partition, differs from)
        for part, cp in restored.items():
            if cp is None or cp.prices is None:
                continue
            since = divergence(self.ours, cp.prices)
            billed = cp.billed_before()
            if since is not None and billed is not None and since < billed:
                refused.append((billed, part, since))
        if not refused:
            return
        billed, part, since = max(refused)
        raise PriceChangeError(
            f"partition {part} was billed up to {format_iso_ms(billed)} with a price table that differs "
            f"from this one from {format_iso_ms(since)} on ({len(refused)} partition(s) so): a price "
            "change may only apply to usage not billed yet, so that a window never has two prices. "
            "Deploy the old table again and put the change in its changes: with a valid_from of "
            f"{format_iso_ms(billed)} or later"
        )

    def due(self) -> bool:
        now = self.clock()
        if now - self.last_check < self.interval_s:
            return False
        self.last_check = now
        return True

    def update(self, others: Mapping[int, Checkpoint | None]) -> bool:
        """Recompute the hold from the checkpoints of the partitions other instances own; True
        when it changed."""
        since: int | None = None
        worst: tuple[int, int] | None = None
        differing: dict[int, tuple[int, str | None]] = {}
        for part, cp in sorted(others.items()):
            if cp is None or cp.prices is None:
                continue
            d = divergence(self.ours, cp.prices)
            if d is None:
                continue
            differing[part] = (d, cp.writer)
            since = d if since is None else min(since, d)
            billed = cp.billed_before()
            if billed is not None and d < billed and worst is None:
                worst = (part, billed)
        hold_at = None
        if since is not None:
            start = since - since % self.window_ms
            hold_at = start + self.window_ms + self.grace_ms
        changed = hold_at != self.hold_at
        if since is None:
            self.since = None
        elif self.since is None:
            self.since = self.clock()
        moved = differing != self.differing
        self.held_from, self.hold_at, self.differing = since, hold_at, differing
        if (changed or moved) and since is not None:
            log.warning(
                "another instance prices differently: windows from this time wait until every "
                "instance runs the same price table (a rolling update in progress?)",
                extra=fields(windows_from=format_iso_ms(since), other_tables=self.other_tables()),
            )
        elif changed:
            log.info("every instance prices alike again: held windows go on")
        if changed and worst is not None:
            log.error(
                "a partition was billed past the point where the price tables differ: these "
                "windows wait until the tables agree, and an instance with this table will not "
                "restore that partition",
                extra=fields(partition=worst[0], billed_up_to=format_iso_ms(worst[1])),
            )
        return changed

    def other_tables(self) -> dict[str, str]:
        """Partition -> instance whose checkpoint of it prices differently (``?``: not recorded)."""
        return {str(p): w or "?" for p, (_, w) in sorted(self.differing.items())}

    def hold_detail(self) -> dict[str, Any] | None:
        """What /healthz says of a hold (None when every instance agrees)."""
        if self.held_from is None:
            return None
        return {
            "windows_from": format_iso_ms(self.held_from),
            "for_s": None if self.since is None else round(self.clock() - self.since, 1),
            "other_tables": self.other_tables(),
        }


class PriceHolds:
    """The chargeback service's side of :class:`PriceAgreement` (a mixin of ChargebackService)."""

    # Set by the service (see ChargebackService.__init__).
    cfg: Any
    consumer: Any
    engine: Any
    assigned: set[int]
    positions: dict[int, int]
    prices_agreement: PriceAgreement
    held: dict[int, int]  # held partition -> offset of its first record not processed
    _reposition: Any

    def _agree_on_prices(self) -> None:
        """Read the other partitions' checkpoints; resume what no longer has to wait."""
        if getattr(self, "_broker_was_down", False):
            return
        topic = self.cfg.input_topic
        try:
            md = self.consumer.list_topics(topic, timeout=2.0).topics.get(topic)
            if md is None or md.error is not None:
                return
            others = [p for p in sorted(md.partitions) if p not in self.assigned]
            committed = (
                self.consumer.committed([TopicPartition(topic, p) for p in others], timeout=2.0)
                if others
                else []
            )
        except KafkaException:
            return  # keep the last decision; the next check tries again
        failed = sorted(tp.partition for tp in committed if tp.error is not None)
        if failed:
            # An errored read is no evidence of agreement: taking it as "no fingerprint" would lift
            # a hold while that partition still prices differently. Keep the last decision.
            log.info(
                "cannot read the checkpoints of other partitions; the price decision stands",
                extra=fields(partitions=failed),
            )
            return
        changed = self.prices_agreement.update(
            {
                tp.partition: Checkpoint.from_metadata(tp.offset, tp.metadata)
                for tp in committed
                if tp.offset >= 0
            }
        )
        if changed and self.held:  # lifted or moved: each held record is checked again when it comes
            self._resume_held(list(self.held))

    def _hold_new(self, parts: list[int]) -> None:
        """Pause the partitions that reached a record they may not process yet."""
        topic = self.cfg.input_topic
        for part in parts:
            self.positions[part] = self.held[part]
        self.consumer.pause([TopicPartition(topic, p) for p in parts])
        log.info(
            "holding partitions until the instances agree on prices",
            extra=fields(partitions=parts, windows_from=format_iso_ms(self.prices_agreement.held_from or 0)),
        )

    def _unhold(self, parts: Iterable[int]) -> None:
        """Forget the holds of ``parts`` and resume them.

        Whenever a partition's state is dropped or restored (an aborted transaction, a rebalance,
        lost partitions) it starts again at its checkpoint, below any held record: a hold kept
        above it would later seek past the records in between and never bill them. Its records
        are checked against the hold again as they come, and held anew where they must wait. And
        librdkafka keeps an application pause across unassign/assign, so a partition whose hold is
        forgotten without a resume stays paused for ever: billing would stop without an error.
        """
        ids = sorted(set(parts))
        for p in ids:
            self.held.pop(p, None)
        if ids:
            self.consumer.resume([TopicPartition(self.cfg.input_topic, p) for p in ids])

    def _resume_held(self, parts: list[int]) -> None:
        topic = self.cfg.input_topic
        parts = [p for p in parts if p in self.held and p in self.assigned]
        if not parts:
            self._unhold(list(self.held))
            return
        try:
            for p in parts:  # librdkafka fetched past the held record: go back to it
                self.consumer.seek(TopicPartition(topic, p, self.held[p]))
        except KafkaException:  # as after a rebalance: every partition where its state is
            self._reposition()
        self.consumer.resume([TopicPartition(topic, p) for p in parts])
        for p in parts:
            del self.held[p]

    def _advance_idle(self, part: int, broker_ms: int) -> bool:
        """Idleness advances event time too: never past a hold."""
        hold_at = self.prices_agreement.hold_at
        if hold_at is not None:
            broker_ms = min(broker_ms, hold_at - 1)
        return bool(self.engine.advance_idle(part, broker_ms))
