"""The alert table: every alert the engine holds, by key and by id, and the revisions due for publishing.

One table is shared by the engine's collaborators (:mod:`gpupipe_consumers.alerts.engine.xid_intake`,
:mod:`gpupipe_consumers.alerts.engine.signal_alerts`,
:mod:`gpupipe_consumers.alerts.engine.recovery_evidence`, :mod:`gpupipe_consumers.alerts.engine.node_burst`):
they decide *what* happens to an alert, the table keeps the lifecycle every alert shares -- fold an
occurrence in (supersede, reopen or raise), end it, expire it by quiet time, hand out its revisions in the
order they changed with a sequence that never repeats. Its windows come from
:class:`~gpupipe_consumers.alerts.engine.config.EngineConfig`. See
:mod:`gpupipe_consumers.alerts.engine.facade` for the rules.
"""

from __future__ import annotations

from collections.abc import Callable, Collection

from gpupipe_consumers.alerts.engine.alert_record import Alert, alert_id, is_level
from gpupipe_consumers.alerts.engine.config import EngineConfig

__all__ = ["COUNTS", "AlertCapReached", "AlertTable", "Key"]

Key = tuple[str, str, str, str]
"""``(scope, hostname, device, signal)``: one open alert per key."""

COUNTS = (
    "events",
    "duplicate_event_id",
    "replayed",
    "stale_clear",
    "double_sighting",
    "new",
    "folded",
    "superseded",
    "reopened",
    "resolved",
    "clock_future",
    "invalid",
    "signals",
    "recovered",
    "acknowledged",
    "reboots_seen",
    "driver_loads",
    "stale_event",
    "capped_alert",
)
"""What the engine counts (exported as ``gpupipe_alerts_input``)."""


class AlertCapReached(Exception):
    """An occurrence would open an alert beyond ``EngineConfig.max_open_alerts`` (counted, not raised)."""


class AlertTable:
    """Open alerts, tombstones of resolved ones (reopened within the dedupe window), and what to publish.

    Collaborators that keep state per alert id register :meth:`when_ended` to forget it when an alert
    leaves the open set, so the table never needs to know what they keep."""

    def __init__(self, cfg: EngineConfig) -> None:
        self.cfg = cfg
        self.counts: dict[str, int] = dict.fromkeys(COUNTS, 0)
        self._open: dict[Key, Alert] = {}
        self._closed: dict[Key, Alert] = {}
        self._ids: dict[str, Alert] = {}  # open alerts by id
        self._by_gpu: dict[tuple[str, str], set[Key]] = {}  # open alert keys per (host, device)
        self._per_host: dict[str, int] = {}  # open alerts per host (admission asks per record)
        self._changed: dict[str, Alert] = {}
        # Latest published sequence per alert id (restored ones too): an incident raised again under
        # an id already published continues its sequence, never repeats one (downstream de-duplicates
        # by (alert_id, sequence)).
        self._sequences: dict[str, int] = {}
        self._early: list[Alert] = []  # revisions handed out before a new alert took their id
        self._ended: list[Callable[[Alert], None]] = []

    def when_ended(self, forget: Callable[[Alert], None]) -> None:
        """Call ``forget`` with every alert that leaves the open set (resolved, superseded, recovered)."""
        self._ended.append(forget)

    # ------------------------------------------------------------------------------------ queries

    def get(self, key: Key) -> Alert | None:
        return self._open.get(key)

    def by_id(self, aid: str) -> Alert | None:
        """The open alert of id ``aid``."""
        return self._ids.get(aid)

    def open_alerts(self) -> list[Alert]:
        return list(self._open.values())

    def open_count(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for a in self._open.values():
            out[a.scope] = out.get(a.scope, 0) + 1
        return out

    def gpu_alerts(self, host: str, device: str) -> list[Alert]:
        """The open alerts of one GPU (or NVSwitch)."""
        return [self._open[key] for key in self._by_gpu.get((host, device), ())]

    def host_keys(self, host: str) -> list[Key]:
        """Keys of the open alerts of one node's devices (node alerts included)."""
        return [key for (h, _device), keys in self._by_gpu.items() if h == host for key in keys]

    def pending(self) -> int:
        """Alerts with a revision not yet handed out."""
        return len(self._changed)

    def full(self) -> bool:
        """As many alerts are open as ``max_open_alerts`` allows."""
        return len(self._open) >= self.cfg.max_open_alerts

    def host_busy(self, host: str) -> bool:
        """``host`` has an open alert (any of its devices, or the node's own)."""
        return host in self._per_host

    def gpu_busy(self, host: str, device: str) -> bool:
        """The device has an open alert."""
        return (host, device) in self._by_gpu

    # ---------------------------------------------------------------------------------- lifecycle

    def touch(
        self,
        key: Key,
        ts: int,
        now_ms: int,
        count: int,
        *,
        anchor: str,
        first_event_id: str | None = None,
        continues: Callable[[Alert], bool] | None = None,
    ) -> Alert:
        """The open alert an occurrence at ``ts`` belongs to (supersede / reopen / new), folded.

        ``continues``: whether open alert ``a`` is the same incident as this occurrence (the same job); if
        so, an occurrence after the dedupe window but within ``recurrence_horizon_ms`` folds into it."""
        d = self.cfg.dedupe_window_ms
        a = self._open.get(key)
        if a is not None and ts > a.last_seen_ms + d and not self._continues(a, ts, continues):
            self.counts["superseded"] += 1
            self.end(a, now_ms, "superseded")
            a = None
        if a is None:
            self._room()
            t = self._closed.get(key)
            if t is not None and t.first_seen_ms - d <= ts <= t.last_seen_ms + d:
                del self._closed[key]
                t.status = "firing"
                t.resolved_at_ms = None
                t.resolve_reason = None
                t.urgent = True
                self._add(t)
                a = t
                self.counts["reopened"] += 1
        if a is None:
            scope, host, device, _ = key
            self._closed.pop(key, None)
            aid = alert_id(scope, host, device, key[3], anchor)
            a = Alert(
                alert_id=aid,
                key=key,
                scope=scope,
                alertname="",
                # xid:<code> is signal xid; a link's level keeps its link id (nvlink_link:<link>)
                signal=key[3] if is_level(key[3]) else key[3].split(":", 1)[0],
                hostname=host,
                first_seen_ms=ts,
                last_seen_ms=ts,
                device=device,
                first_event_id=first_event_id,
                urgent=True,
                sequence=self._sequences.get(aid, 0),  # an id published before goes on from there
            )
            self._add(a)
            self.counts["new"] += 1
        else:
            self.counts["folded"] += 1
            if a.pending is not None and ts > a.pending.since_ms:
                a.pending = None  # the fault is back after the reboot / driver load: not over
                a.urgent = True
        self._fold(a, ts, now_ms, count)
        return a

    def _room(self) -> None:
        """Raise :class:`AlertCapReached` (counted) when no further alert may open."""
        if len(self._open) >= self.cfg.max_open_alerts:
            self.counts["capped_alert"] += 1
            raise AlertCapReached(f"{len(self._open)} open alerts, at most {self.cfg.max_open_alerts}")

    def _continues(self, a: Alert, ts: int, continues: Callable[[Alert], bool] | None) -> bool:
        """A recurrence that the caller says is the same incident, within the horizon; for a sticky
        alert at any distance (its GPU is broken until evidence of recovery ends the alert)."""
        horizon = self.cfg.recurrence_horizon_ms
        return continues is not None and (ts <= a.last_seen_ms + horizon or a.sticky) and continues(a)

    def fold(self, a: Alert, ts: int, now_ms: int, count: int) -> None:
        """Fold an occurrence at ``ts`` into open alert ``a`` whatever its gap to the latest one (a node
        alert held open by its members goes on absorbing its node's faults)."""
        self.counts["folded"] += 1
        self._fold(a, ts, now_ms, count)

    def _fold(self, a: Alert, ts: int, now_ms: int, count: int) -> None:
        if ts < a.first_seen_ms:
            a.first_seen_ms = ts
        if ts > a.last_seen_ms:
            a.last_seen_ms = ts
        a.seen_at_ms = now_ms
        a.occurrences += count
        self.dirty(a)

    def end(self, a: Alert, now_ms: int, reason: str, *, keep: bool = False) -> None:
        """Resolve open alert ``a`` (``reason``) and take it out of the open set; ``keep`` leaves a tombstone
        that an occurrence within the dedupe window reopens."""
        a.status = "resolved"
        a.resolved_at_ms = now_ms
        a.resolve_reason = reason
        a.urgent = True
        self.counts["resolved"] += 1
        self.dirty(a)
        self._remove(a)
        if keep:
            self._tombstone(a)
        for forget in self._ended:
            forget(a)

    def _remove(self, a: Alert) -> None:
        key = a.key
        if self._open.pop(key, None) is None:
            return
        self._ids.pop(a.alert_id, None)
        keys = self._by_gpu.get((key[1], key[2]))
        if keys is not None:
            keys.discard(key)
            if not keys:
                del self._by_gpu[(key[1], key[2])]
        n = self._per_host.get(key[1], 0) - 1
        if n > 0:
            self._per_host[key[1]] = n
        else:
            self._per_host.pop(key[1], None)

    def forget(self, hosts: Collection[str], gpus: Collection[tuple[str, str]]) -> list[Alert]:
        """Drop every alert of ``hosts`` and of the devices ``gpus`` (open ones, tombstones, revisions not
        handed out) without publishing anything: the admission bound evicted them
        (:mod:`gpupipe_consumers.alerts.admission`). Returns the open alerts dropped. Scans the tombstones
        only for whole hosts (a batch at a time)."""
        dropped: list[Alert] = []
        targets = [g for g in self._by_gpu if g[0] in hosts] if hosts else []
        for gpu in [*targets, *(g for g in gpus if g in self._by_gpu)]:
            for key in list(self._by_gpu.get(gpu, ())):
                a = self._open[key]
                self._remove(a)
                self._changed.pop(a.alert_id, None)
                for forget in self._ended:
                    forget(a)
                dropped.append(a)
        if hosts:
            for key in [k for k in self._closed if k[1] in hosts]:
                a = self._closed.pop(key)
                if self._changed.get(a.alert_id) is a:
                    del self._changed[a.alert_id]
        return dropped

    def tick(self, now_ms: int, waiting: Callable[[Alert, int], None]) -> None:
        """Resolve alerts quiet for ``resolve_after_ms`` (node alerts: ``min(R, D)``) unless sticky or, for
        a node alert, held open by a sticky member (:meth:`held`); hand each one that stays open and waits
        for its GPU (``Alert.pending``) to ``waiting`` in the same pass, so revisions keep the order they
        changed in; republish open alerts unchanged for ``keepalive_ms``; forget tombstones older than the
        dedupe window."""
        r = self.cfg.resolve_after_ms
        d = self.cfg.dedupe_window_ms
        keepalive = self.cfg.keepalive_ms
        for key, a in list(self._open.items()):
            quiet = min(r, d) if a.scope == "node" else r
            if now_ms - a.seen_at_ms >= quiet and not a.sticky and not self.held(a):
                self.end(a, now_ms, "quiet", keep=r < d and not is_level(key[3]))
                continue
            if a.pending is not None:
                waiting(a, now_ms)
            if a.last_emit_ms is not None and now_ms - a.last_emit_ms >= keepalive and not a.dirty:
                self.dirty(a)  # unchanged, published again so that a restart's look-back finds it
        for key, a in list(self._closed.items()):
            if now_ms - a.seen_at_ms > d:
                del self._closed[key]

    def held(self, a: Alert) -> bool:
        """A node alert with a sticky member still firing: it stays open as long as they do. Alertmanager
        inhibits the members under it; resolving it first would page them all again for one incident."""
        if a.scope != "node":
            return False
        host, aid = a.hostname, a.alert_id
        return any(
            m.parent_alert_id == aid and m.sticky
            for (h, _device), keys in self._by_gpu.items()
            if h == host
            for m in (self._open[k] for k in keys)
        )

    # ----------------------------------------------------------------------------------- publishing

    def dirty(self, a: Alert) -> None:
        """``a`` changed: a revision of it is due (see :meth:`take`)."""
        if not a.dirty:
            a.dirty = True
        prev = self._changed.get(a.alert_id)
        if prev is not None and prev is not a:
            # A new incident under the id of one with a revision still due (a level signal cleared
            # and raised again from the same start): that revision goes out first, and the new one
            # continues its sequence.
            prev.sequence += 1
            prev.dirty = prev.urgent = False
            self._published(prev)
            self._early.append(prev.snapshot())
            a.sequence = max(a.sequence, prev.sequence)
        self._changed[a.alert_id] = a

    def take(self, now_ms: int, *, force: bool = False) -> list[Alert]:
        """Revisions due for publishing (snapshots, in the order they changed); see
        :mod:`gpupipe_consumers.alerts.engine.facade`, "Emission". ``force`` hands out every pending change
        regardless of
        the update interval."""
        out, self._early = self._early, []
        interval = self.cfg.update_interval_ms
        for aid, a in list(self._changed.items()):
            if not (force or a.urgent or a.last_emit_ms is None or now_ms - a.last_emit_ms >= interval):
                continue
            a.sequence += 1
            a.dirty = a.urgent = False
            a.last_emit_ms = now_ms
            self._published(a)
            out.append(a.snapshot())
            del self._changed[aid]
        return out

    def _published(self, a: Alert) -> None:
        seqs = self._sequences
        seqs.pop(a.alert_id, None)
        seqs[a.alert_id] = a.sequence
        if len(seqs) > self.cfg.event_id_memory:
            del seqs[next(iter(seqs))]

    # -------------------------------------------------------------------------------------- restore

    def published_before(self, aid: str, sequence: int) -> None:
        """Alert ``aid`` was published up to ``sequence`` (restored): an incident raised again under that
        id goes on from there."""
        self._sequences[aid] = sequence

    def restore_open(self, a: Alert, now_ms: int) -> Alert | None:
        """Hold restored firing alert ``a``; returns the open alert of the same key it superseded (two open
        alerts for one key: the newer incident stays)."""
        old = self._open.get(a.key)
        if old is not None:
            self.end(old, now_ms, "superseded")
        self._add(a)
        return old

    def restore_closed(self, a: Alert) -> None:
        """Hold restored resolved alert ``a`` as a tombstone (reopened by an occurrence within the window)."""
        self._tombstone(a)

    def _tombstone(self, a: Alert) -> None:
        """Keep resolved ``a`` for reopening, the oldest tombstone forgotten beyond the cap (a recurrence
        of a forgotten one opens a new alert instead of reopening it)."""
        closed = self._closed
        closed.pop(a.key, None)
        closed[a.key] = a
        if len(closed) > self.cfg.max_open_alerts:
            del closed[next(iter(closed))]

    def _add(self, a: Alert) -> None:
        self._open[a.key] = a
        self._ids[a.alert_id] = a
        self._by_gpu.setdefault((a.key[1], a.key[2]), set()).add(a.key)
        self._per_host[a.key[1]] = self._per_host.get(a.key[1], 0) + 1
