"""One price per window across the instances of a group, also during a rolling update.

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

import dataclasses
import logging
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from confluent_kafka import KafkaException, TopicPartition

from gpupipe.common.durations import format_iso_ms
from gpupipe.common.logs import fields
from gpupipe.domain.price_schedule import Fingerprint, divergence
from gpupipe.kafka.ready import retry
from gpupipe_consumers.chargeback.errors import PriceChangeError
from gpupipe_consumers.chargeback.partitions import InputPartitions
from gpupipe_consumers.chargeback.service_config import OP_TIMEOUT_S
from gpupipe_consumers.chargeback.windows import Checkpoint

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
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.ours, self.window_ms, self.grace_ms = ours, window_ms, grace_ms
        self.interval_s, self.clock, self.wall = interval_s, clock, wall
        self.last_check = float("-inf")
        self.held_from: int | None = None  # usage time from which another partition prices differently
        self.hold_at: int | None = None  # records of this event time or later wait
        # The other partitions that price differently: partition -> (from when, the instance that
        # committed its checkpoint, None from writers older than that); and since when (clock).
        self.differing: dict[int, tuple[int, str | None]] = {}
        self.since: float | None = None
        # Partitions this instance took over from another instance whose checkpoint priced them
        # differently (see carry): partition -> (that fingerprint, its writer, from when).
        self.carried: dict[int, tuple[Fingerprint, str | None, int]] = {}
        self.last_others: dict[int, Checkpoint | None] = {}
        self.me: str | None = None  # this instance's id (writer), known once it restored partitions

    def check_restored(self, restored: Mapping[int, Checkpoint | None], total: int | None = None) -> None:
        """Refuse partitions whose billed windows this schedule would price differently; the
        message names the latest billed horizon, the earliest ``valid_from`` all of them allow,
        and suggests a window boundary in the future (the other instances bill on meanwhile).
        ``total``: how many partitions were checked (all of the topic's at start)."""
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
        what = (
            "a price table whose base (the prices before every change) differs from this one: tables "
            "are compared whole, by digest, so any edit of the base re-prices billed usage, also "
            "adding a model never billed (which models were billed is not recorded)"
            if since == 0
            else f"a price table that differs from this one from {format_iso_ms(since)} on"
        )
        later = max(billed, int(self.wall() * 1000) + self.window_ms)
        later += -later % self.window_ms
        raise PriceChangeError(
            f"partition {part} was billed up to {format_iso_ms(billed)} with {what} ({len(refused)} of "
            f"{total if total is not None else len(restored)} partition(s) so): a price change may "
            "only apply to usage not billed yet, so that a window never has two prices. Deploy the "
            "old table again and put the change in its changes: with a valid_from of "
            f"{format_iso_ms(billed)} or later, on a window boundary; the instances bill on "
            f"meanwhile, so choose one in the future (e.g. {format_iso_ms(later)})"
        )

    def carry(self, restored: Mapping[int, Checkpoint | None], me: str) -> None:
        """Remember the restored partitions whose checkpoint shows another instance's table.

        During a rolling update an instance that restarts (or goes away) hands its partitions to
        the others (a rebalance). An old instance taking a new one's partitions would see the new
        table nowhere (it reads only the partitions it does not own): it would bill the windows
        after the change at the old price and its commits erase the new table's fingerprint, so
        that every new instance is refused afterwards. So a partition restored from another
        writer's checkpoint with another table (allowed: nothing billed past their divergence),
        or carrying one, holds from there as if that writer still owned it, and its checkpoints
        carry that table and writer (``cx``/``cby``) beside this instance's own, so the group keeps
        knowing of both. It ends when that writer restores the partition (whatever its table
        now), when an instance with that table does, or when that writer is seen committing
        another table elsewhere (:meth:`update`): it came back updated.
        """
        self.me = me
        for part, cp in restored.items():
            self.carried.pop(part, None)
            if cp is None:
                continue
            for prices, writer in ((cp.prices, cp.writer), (cp.carried_prices, cp.carried_writer)):
                if prices is None or writer is None or writer == me:
                    continue
                since = divergence(self.ours, prices)
                if since is not None:
                    self.carried[part] = (prices, writer, since)
                    break

    def forget(self, parts: Iterable[int]) -> None:
        for part in parts:
            self.carried.pop(part, None)

    def committed_as(self, part: int, cp: Checkpoint) -> Checkpoint:
        """The checkpoint to commit for ``part``: a carried table goes with this instance's own."""
        carried = self.carried.get(part)
        if carried is None:
            return cp
        return dataclasses.replace(cp, carried_prices=carried[0], carried_writer=carried[1])

    def refresh(self) -> bool:
        """Recompute the hold after the assignment changed (the carried partitions with it); True
        when it changed.

        The last read of the other partitions is stale now: it lacks the partitions this instance
        just handed on, carried ones among them, whose checkpoints now tell the group of the other
        table. Recomputed from it alone, the hold was lifted until the next read (``interval_s``),
        long enough to bill the kept partitions past the divergence at this table's prices. So an
        assignment only ever holds from earlier, and the others are read again at the next loop:
        only a fresh read lifts a hold.
        """
        self.last_check = float("-inf")
        return self.update(self.last_others, lift=False)

    def due(self) -> bool:
        now = self.clock()
        if now - self.last_check < self.interval_s:
            return False
        self.last_check = now
        return True

    def update(self, others: Mapping[int, Checkpoint | None], lift: bool = True) -> bool:
        """Recompute the hold from the checkpoints of the partitions other instances own; True
        when it changed. ``lift=False``: the hold may start earlier, never later nor end."""
        self.last_others = dict(others)
        since, differing = self._differing(self._tables(others))
        worst = self._billed_past(others, differing)
        if not lift and self.held_from is not None and (since is None or self.held_from < since):
            since, differing = self.held_from, {**self.differing, **differing}
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
        self._log_change(changed, moved, since, worst)
        return changed

    def _tables(self, others: Mapping[int, Checkpoint | None]) -> list[tuple[int, Fingerprint, str | None]]:
        """(partition, price table, writer) of every table the others' checkpoints and the carried
        ones name, once the stale carried tables are forgotten."""
        # A carried table ends once its writer is seen committing another one (it came back
        # updated, with other partitions): it no longer runs that table. The same for a table
        # another instance carries, and for one carried for this instance (it knows its own).
        now_by = {cp.writer: cp.prices for cp in others.values() if cp is not None and cp.writer is not None}

        def stale(prices: Fingerprint, writer: str | None) -> bool:
            return writer == self.me or (writer in now_by and now_by[writer] != prices)

        for part, (prices, writer, _) in list(self.carried.items()):
            if stale(prices, writer):
                del self.carried[part]
        tables = [(part, prices, writer) for part, (prices, writer, _) in self.carried.items()]
        for part, cp in sorted(others.items()):
            if cp is None:
                continue
            if cp.prices is not None:
                tables.append((part, cp.prices, cp.writer))
            if cp.carried_prices is not None and not stale(cp.carried_prices, cp.carried_writer):
                tables.append((part, cp.carried_prices, cp.carried_writer))
        return tables

    def _differing(
        self, tables: list[tuple[int, Fingerprint, str | None]]
    ) -> tuple[int | None, dict[int, tuple[int, str | None]]]:
        """The earliest time any table prices differently from ours, and per partition the earliest
        such time with the writer of that table."""
        since: int | None = None
        differing: dict[int, tuple[int, str | None]] = {}
        for part, prices, writer in tables:
            d = divergence(self.ours, prices)
            if d is None or (part in differing and differing[part][0] <= d):
                continue
            differing[part] = (d, writer)
            since = d if since is None else min(since, d)
        return since, differing

    def _billed_past(
        self, others: Mapping[int, Checkpoint | None], differing: Mapping[int, tuple[int, str | None]]
    ) -> tuple[int, int] | None:
        """The first partition billed with another table past where that table differs from ours,
        with how far it was billed."""
        for part, cp in sorted(others.items()):
            if cp is None or cp.prices is None or part not in differing:
                continue
            d, billed = divergence(self.ours, cp.prices), cp.billed_before()
            if d is not None and billed is not None and d < billed:
                return part, billed
        return None

    def _log_change(
        self, changed: bool, moved: bool, since: int | None, worst: tuple[int, int] | None
    ) -> None:
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
    """The partitions paused for :class:`PriceAgreement`, and the Kafka reads its decisions need.

    A held partition is paused at its first record that may not be processed yet (``held[P]``,
    that record's offset) until the instances agree; it owns those holds and keeps them consistent
    with the partitions' state as it is dropped and restored (see :meth:`unhold`)."""

    def __init__(self, agreement: PriceAgreement, partitions: InputPartitions, engine: Any) -> None:
        self.agreement = agreement
        self.partitions = partitions
        self.engine = engine
        self.held: dict[int, int] = {}  # held partition -> offset of its first record not processed

    def check_group_prices(self) -> None:
        """At start, before joining: refuse this price table if any partition of the group, not
        only the ones this instance will get, was billed past where it prices differently. Its own
        partitions' horizons may have moved on by the time it is redeployed, and an instance
        restored elsewhere would wait for ever on the others; the message names the latest billed
        horizon of all of them (PriceChangeError)."""
        consumer, topic = self.partitions.consumer, self.partitions.topic
        md = retry(lambda: consumer.list_topics(topic, timeout=OP_TIMEOUT_S), what=f"metadata of {topic}")
        meta = md.topics.get(topic)
        if meta is None or meta.error is not None or not meta.partitions:
            return  # no input topic yet: nothing was billed
        parts = sorted(meta.partitions)
        committed = self.partitions.read_committed(parts)
        self.agreement.check_restored(
            {
                tp.partition: Checkpoint.from_metadata(tp.offset, tp.metadata)
                for tp in committed
                if tp.error is None and tp.offset is not None and tp.offset >= 0
            },
            total=len(parts),
        )

    def agree(self) -> None:
        """Read the other partitions' checkpoints; resume what no longer has to wait."""
        consumer, topic = self.partitions.consumer, self.partitions.topic
        try:
            md = consumer.list_topics(topic, timeout=2.0).topics.get(topic)
            if md is None or md.error is not None:
                return
            others = [p for p in sorted(md.partitions) if p not in self.partitions.assigned]
            committed = (
                consumer.committed([TopicPartition(topic, p) for p in others], timeout=2.0) if others else []
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
        changed = self.agreement.update(
            {
                tp.partition: Checkpoint.from_metadata(tp.offset, tp.metadata)
                for tp in committed
                if tp.offset >= 0
            }
        )
        if changed and self.held:  # lifted or moved: each held record is checked again when it comes
            self._resume_held(list(self.held))

    def hold_new(self, parts: list[int]) -> None:
        """Pause the partitions that reached a record they may not process yet."""
        for part in parts:
            self.partitions.positions[part] = self.held[part]
        self.partitions.consumer.pause([TopicPartition(self.partitions.topic, p) for p in parts])
        log.info(
            "holding partitions until the instances agree on prices",
            extra=fields(partitions=parts, windows_from=format_iso_ms(self.agreement.held_from or 0)),
        )

    def unhold(self, parts: Iterable[int]) -> None:
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
            self.partitions.consumer.resume([TopicPartition(self.partitions.topic, p) for p in ids])

    def unhold_held(self, parts: Iterable[int]) -> None:
        """:meth:`unhold` those of ``parts`` that are held."""
        self.unhold([p for p in parts if p in self.held])

    def _resume_held(self, parts: list[int]) -> None:
        consumer, topic = self.partitions.consumer, self.partitions.topic
        parts = [p for p in parts if p in self.held and p in self.partitions.assigned]
        if not parts:
            self.unhold(list(self.held))
            return
        try:
            for p in parts:  # librdkafka fetched past the held record: go back to it
                consumer.seek(TopicPartition(topic, p, self.held[p]))
        except KafkaException:  # as after a rebalance: every partition where its state is
            self.partitions.reposition()
        consumer.resume([TopicPartition(topic, p) for p in parts])
        for p in parts:
            del self.held[p]

    def advance_idle(self, part: int, broker_ms: int) -> bool:
        """Idleness advances event time too: never past a hold."""
        hold_at = self.agreement.hold_at
        if hold_at is not None:
            broker_ms = min(broker_ms, hold_at - 1)
        return bool(self.engine.advance_idle(part, broker_ms))
