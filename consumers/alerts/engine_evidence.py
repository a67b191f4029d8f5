"""Evidence and restart for the alert engine: recovery and acks resolve sticky alerts; the state a restart
restores from ``gpu.alerts.v1``.

A mixin of :class:`consumers.alerts.dedupe.AlertEngine` (it shares the engine's state); see that module's
doc, "Resolve by quiet", and :mod:`consumers.alerts.service`, "Restart".
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from consumers.alerts.alert_policy import rank
from consumers.alerts.alert_record import Alert, alert_from_record
from consumers.alerts.classify import FaultEvent, GpuXidHistory
from consumers.alerts.health_signals import LEVEL_SIGNALS

if TYPE_CHECKING:
    from consumers.alerts.engine_config import EngineConfig, Key

__all__ = ["EvidenceMixin"]


class EvidenceMixin:
    """The engine's evidence and restore methods (state lives in the engine)."""

    cfg: EngineConfig
    counts: dict[str, int]
    _open: dict[Key, Alert]
    _closed: dict[Key, Alert]
    _ids: dict[str, Alert]
    _by_gpu: dict[tuple[str, str], set[Key]]
    _node_worst: dict[str, tuple[int, int, int]]

    def _history(self, host: str, device: str) -> GpuXidHistory: ...

    def _remember(self, eid: str) -> None: ...

    def _resolve(self, a: Alert, now_ms: int, reason: str) -> None: ...

    def _close(self, key: Key, a: Alert, *, keep: bool) -> None: ...

    def _restore_history(self, a: Alert) -> None:
        """What the classifier's recurrence rules need from a restored alert (review D11): its codes at
        its first and last occurrence, and a reset when it ended as recovered."""
        if a.scope != "gpu" or a.signal != "xid" or not a.codes:
            return
        h = self._history(a.hostname, a.device)
        for ts in {a.first_seen_ms, a.last_seen_ms}:
            h.record(
                FaultEvent(kind="xid", ts_ms=ts, code=a.codes[0], message="(restored from gpu.alerts.v1)")
            )
        if a.status == "resolved" and a.resolve_reason == "recovered" and a.resolved_at_ms:
            h.record_reset(a.resolved_at_ms)

    # ------------------------------------------------------------------------------------- evidence

    def recovered(self, host: str, device: str, ts: int, now_ms: int, detail: str = "") -> list[Alert]:
        """Evidence that a GPU was reset or its node rebooted at ``ts``: resolve (``recovered``) its open
        fault alerts older than that. Level signals have their own clear and are left alone."""
        out = []
        for key in list(self._by_gpu.get((host, device), ())):
            a = self._open[key]
            if key[3] in LEVEL_SIGNALS or a.scope != "gpu":
                continue
            if a.first_seen_ms > ts:
                continue  # a fault after the reset is a new fault
            a.description = (a.description + f" Recovered: {detail}.").strip() if detail else a.description
            self._resolve(a, now_ms, "recovered")
            self._close(key, a, keep=False)
            out.append(a)
        self.counts["recovered"] += len(out)
        return out

    def acknowledge(self, alert_id: str, now_ms: int, note: str = "") -> Alert | None:
        """An operator says the fault was dealt with (``gpupipe alerts --ack``): resolve the alert
        (``acknowledged``). Unknown or already resolved ids are ignored (acks replay after restarts)."""
        a = self._ids.get(alert_id)
        if a is None or a.status != "firing":
            return None
        if note:
            a.description = f"{a.description} Acknowledged: {note}".strip()
        self._resolve(a, now_ms, "acknowledged")
        self._close(a.key, a, keep=False)
        self.counts["acknowledged"] += 1
        return a

    # ----------------------------------------------------------------------------------- restore

    def restore(self, records: Iterable[dict[str, Any]], now_ms: int) -> int:
        """Rebuild open alerts from ``gpu.alerts.v1`` records (oldest first); returns alerts restored.

        The latest revision per alert id wins. Firing ones become open alerts (same id, sequence,
        counts); resolved ones within the reopen span become tombstones. Their first/last event ids are
        remembered as seen, so replayed input does not count them twice. Action records are ignored here.
        """
        latest: dict[str, dict[str, Any]] = {}
        for rec in records:
            if rec.get("status") not in ("firing", "resolved"):
                continue
            prev = latest.get(rec["alert_id"])
            if prev is None or (rec["sequence"], rec["emitted_at_ms"]) >= (
                prev["sequence"],
                prev["emitted_at_ms"],
            ):
                latest[rec["alert_id"]] = rec
        restored: set[str] = set()
        for rec in sorted(latest.values(), key=lambda r: r["first_seen_ms"]):
            try:
                a = alert_from_record(rec)
            except (KeyError, TypeError, ValueError):
                self.counts["invalid"] += 1
                continue
            for eid in (a.first_event_id, a.last_event_id):
                if eid:
                    self._remember(eid)
            self._restore_history(a)
            if a.status == "resolved":
                a.seen_at_ms = a.resolved_at_ms or now_ms
                # a fault after a recovery or an ack is a new incident, never a reopen
                ended = a.resolve_reason in ("recovered", "acknowledged")
                if not ended and now_ms - a.seen_at_ms <= self.cfg.dedupe_window_ms:
                    self._closed[a.key] = a
                continue
            old = self._open.get(a.key)
            if old is not None:  # two open alerts for one key: keep the newer incident
                self._resolve(old, now_ms, "superseded")
                self._close(old.key, old, keep=False)
                restored.discard(old.alert_id)
            a.seen_at_ms = now_ms  # quiet time restarts: a restart is no evidence of anything
            self._open[a.key] = a
            self._ids[a.alert_id] = a
            self._by_gpu.setdefault((a.key[1], a.key[2]), set()).add(a.key)
            if a.scope == "node":
                self._node_worst[a.alert_id] = rank(a.severity, a.drain_node, a.action)
            restored.add(a.alert_id)
        return len(restored)
