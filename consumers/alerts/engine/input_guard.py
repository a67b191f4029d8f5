"""What the alert engine does not take from its input at face value: ids seen before, replayed events
and clocks that run ahead.

* An ``event_id`` seen before (producer retry, replay after a rebalance or restart) is no occurrence;
  the last ``event_id_memory`` ids are remembered.
* After a restart the ids are gone, and the consumer group's committed offsets may lag the published
  counts (a coordinator away for a minute after a broker restart): an XidEvent at or before the topic
  position a restored alert counted last (``Alert.last_input``) is a replay and is not counted again.
* An event time more than ``max_future_skew_ms`` ahead of the processing time is taken as that time.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any, NamedTuple

from gpupipe_consumers.alerts.engine.alert_record import Alert
from gpupipe_consumers.alerts.engine.alert_table import AlertTable, Key
from gpupipe_consumers.alerts.engine.health_signals import InvalidRecord

__all__ = ["Admitted", "InputGuard"]


class Admitted(NamedTuple):
    """What an admitted XidEvent is: its id (if any), host and processing-safe time."""

    event_id: str | None
    hostname: str
    ts: int


class InputGuard:
    """Remembered event ids and restored input positions; counts into the table's ``counts``."""

    def __init__(self, table: AlertTable) -> None:
        self._cfg = table.cfg
        self._counts = table.counts
        self._seen: dict[str, None] = {}
        # Restored alerts' last counted XidEvent positions per key: until the replayed input passes
        # them, events at or before them were counted already.
        self._marks: dict[Key, tuple[int, int]] = {}

    def admit(self, ev: Mapping[str, Any], now_ms: int) -> Admitted | None:
        """Event ``ev`` as the engine takes it: ``None`` for an ``event_id`` seen before, its time clamped
        (:meth:`clamp`). Raises :class:`InvalidRecord` (counted) for one without host or integer time."""
        eid = ev.get("event_id") or None
        if eid is not None and self.duplicate(eid):
            return None
        host = ev.get("hostname") or ""
        raw_ts = ev.get("timestamp_ms")
        if not host or not isinstance(raw_ts, int) or isinstance(raw_ts, bool):
            self._counts["invalid"] += 1
            raise InvalidRecord("XidEvent without hostname or integer timestamp_ms")
        return Admitted(eid, host, self.clamp(raw_ts, now_ms))

    def duplicate(self, eid: str) -> bool:
        """``eid`` was seen before (counted); otherwise it is remembered from now on."""
        if eid in self._seen:
            self._counts["duplicate_event_id"] += 1
            return True
        self.remember(eid)
        return False

    def remember(self, eid: str) -> None:
        seen = self._seen
        seen[eid] = None
        if len(seen) > self._cfg.event_id_memory:
            del seen[next(iter(seen))]

    def remembered(self) -> int:
        """How many event ids are remembered (at most ``event_id_memory``)."""
        return len(self._seen)

    def forget(self, hosts: Collection[str]) -> None:
        """Drop the restored positions of ``hosts``' alerts (evicted by admission)."""
        for key in [k for k in self._marks if k[1] in hosts] if hosts else []:
            del self._marks[key]

    def replayed(self, key: Key, position: tuple[int, int] | None) -> bool:
        """The event at ``position`` (partition, offset) was counted in the alert of ``key`` already."""
        if position is None or not self._marks:
            return False
        mark = self._marks.get(key)
        if mark is None or mark[0] != position[0]:
            return False
        if position[1] > mark[1]:
            del self._marks[key]  # the replay is past it: new input from here
            return False
        self._counts["replayed"] += 1
        return True

    def restored(self, a: Alert) -> None:
        """Remember what restored alert ``a`` (firing or ended) counted: its first and last event ids, and
        its last input position -- a later incident's wins (restore goes by ``first_seen_ms``; in one
        partition, the larger offset)."""
        for eid in (a.first_event_id, a.last_event_id):
            if eid:
                self.remember(eid)
        mark, pos = self._marks.get(a.key), a.last_input
        if pos is not None and (mark is None or mark[0] != pos[0] or mark < pos):
            self._marks[a.key] = pos

    def clamp(self, ts: int, now_ms: int) -> int:
        """``ts``, or ``now_ms`` when ``ts`` runs more than ``max_future_skew_ms`` ahead of it (counted)."""
        if ts > now_ms + self._cfg.max_future_skew_ms:
            self._counts["clock_future"] += 1
            return now_ms
        return ts
