"""Compaction and snapshot expiry of the lake tables, without losing the exactly-once offsets.

The writer commits every ``--flush-rows`` rows or ``--flush-interval``: a busy table gets thousands
of snapshots and small files a day. The policy (``gpupipe lake maintain``, run daily):

* **compact** each day partition that ended more than ``compact_after`` ago and has a partition
  (a day, or a day and node bucket) of ``min_files`` data files or more: its rows are read and
  written back as one file per partition in a single overwrite. Days still written to are left
  alone, so the writer's appends never conflict with it (a conflict would fail the overwrite, which
  is then tried on the next run: Iceberg commits are optimistic);
* **expire** snapshots older than ``expire_after``, except the current one and the chain of its
  ancestors down to the oldest that still supplies a partition's newest offsets (the writer
  resumes from the newest snapshot naming each partition, following parent links; a writer
  holding fewer partitions after a rebalance commits only those).

A compaction commit carries the table's current offsets in its summary, like an append, so a
writer started after it resumes exactly where it stopped.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from pyiceberg.expressions import And, GreaterThanOrEqual, LessThan
from pyiceberg.table import Table

from gpupipe.common.logs import fields
from gpupipe_consumers.lake.tables import LakeTable
from gpupipe_consumers.lake.version_hint import write_version_hint
from gpupipe_consumers.lake.writer import OFFSET_PREFIX

log = logging.getLogger("gpupipe.lake")

DAY = timedelta(days=1)


@dataclass(frozen=True)
class Policy:
    expire_after: timedelta = timedelta(days=7)
    """Snapshots (time travel, and the files only they reference) are kept this long."""
    compact_after: timedelta = timedelta(days=1)
    """A day partition is compacted once it ended this long ago."""
    min_files: int = 4
    """Compact a day when one of its partitions has this many data files or more."""


@dataclass
class Report:
    table: str
    days_compacted: int = 0
    files_before: int = 0
    files_after: int = 0
    snapshots_expired: int = 0


def offset_properties(table: Table) -> tuple[dict[str, str], set[int]]:
    """(every offset property as of now: each key's newest value; the snapshots the writer's resume
    walks to find them: the current snapshot's ancestry down to the oldest that supplies one).

    The resume follows parent links, so a supplier is reachable only while every snapshot between
    it and the current one is kept."""
    props: dict[str, str] = {}
    walked: list[int] = []
    needed = 0
    snap = table.current_snapshot()
    while snap is not None and snap.snapshot_id not in walked:
        walked.append(snap.snapshot_id)
        extra = snap.summary.additional_properties if snap.summary is not None else {}
        for k, v in extra.items():
            if k.startswith(OFFSET_PREFIX) and k not in props:
                props[k] = v
                needed = len(walked)
        if snap.parent_snapshot_id is None:
            break
        snap = table.snapshot_by_id(snap.parent_snapshot_id)
    return props, set(walked[:needed])


def _day_column(spec: LakeTable) -> str:
    return next(col for col, transform in spec.partition if transform == "day")


def compact(table: Table, spec: LakeTable, policy: Policy, now: datetime, report: Report) -> Table:
    """Rewrite each closed day whose partitions hold ``min_files`` files or more as one overwrite."""
    column = _day_column(spec)
    last = (now - policy.compact_after).astimezone(UTC).replace(hour=0, minute=0, second=0, microsecond=0)
    files_by_day: dict[datetime, Counter[tuple[object, ...]]] = {}
    field_pos = [i for i, f in enumerate(table.spec().fields) if f.name == f"{column}_day"]
    if not field_pos:
        return table
    for task in table.scan().plan_files():
        part = task.file.partition
        day = datetime(1970, 1, 1, tzinfo=UTC) + DAY * part[field_pos[0]]
        files_by_day.setdefault(day, Counter())[tuple(part)] += 1
    for day, per_part in sorted(files_by_day.items()):
        if day + DAY > last or max(per_part.values()) < policy.min_files:
            continue
        where = And(GreaterThanOrEqual(column, day.isoformat()), LessThan(column, (day + DAY).isoformat()))
        data = table.scan(row_filter=where).to_arrow()
        props, _ = offset_properties(table)
        table.overwrite(data, overwrite_filter=where, snapshot_properties=props)
        table = table.refresh()
        after = sum(1 for _ in table.scan(row_filter=where).plan_files())
        report.days_compacted += 1
        report.files_before += sum(per_part.values())
        report.files_after += after
        log.info(
            "lake day compacted",
            extra=fields(
                table=spec.name, day=day.date().isoformat(), files=sum(per_part.values()), now=after
            ),
        )
    return table


def expire(table: Table, policy: Policy, now: datetime, report: Report) -> Table:
    """Expire snapshots older than ``expire_after`` but the current one and the offsets' chain."""
    cutoff_ms = int((now - policy.expire_after).timestamp() * 1000)
    _, suppliers = offset_properties(table)
    current = table.current_snapshot()
    keep = suppliers | ({current.snapshot_id} if current is not None else set())
    doomed = [
        s.snapshot_id for s in table.snapshots() if s.timestamp_ms < cutoff_ms and s.snapshot_id not in keep
    ]
    if doomed:
        table.maintenance.expire_snapshots().by_ids(doomed).commit()
        table = table.refresh()
        report.snapshots_expired += len(doomed)
    return table


def maintain(table: Table, spec: LakeTable, policy: Policy, now: datetime | None = None) -> Report:
    """Compact, then expire (the compaction's replaced snapshots expire with the rest in time)."""
    now = now or datetime.now(UTC)
    report = Report(spec.name)
    table = compact(table, spec, policy, now, report)
    table = expire(table, policy, now, report)
    write_version_hint(table)
    return report
