"""NVML's notice events in the alert engine: the GPU's recovery action and "GPU unavailable" (no XID).

XidEvent kinds ``recovery_action`` and ``gpu_unavailable`` (see :mod:`gpupipe_consumers.alerts.rules.notice`
for
what they say and how they are graded) have no XID code, so they are not keyed as XIDs (each would be
an "XID 0 UNKNOWN_XID" warning). Here:

Rules and reasons in full: docs/alerts.md, "Module notes", ``engine/nvml_notices.py``.
"""

from __future__ import annotations

from typing import Any

from gpupipe_consumers.alerts.engine.alert_record import Alert, AlertName, device_key
from gpupipe_consumers.alerts.engine.alert_table import AlertTable, Key
from gpupipe_consumers.alerts.engine.fault_decisions import FaultDecisions
from gpupipe_consumers.alerts.engine.gpu_histories import GpuHistories
from gpupipe_consumers.alerts.engine.health_signals import SIGNAL_INFO, InvalidRecord
from gpupipe_consumers.alerts.engine.input_guard import InputGuard
from gpupipe_consumers.alerts.engine.node_burst import NodeBursts
from gpupipe_consumers.alerts.engine.recovery_evidence import RecoveryEvidence
from gpupipe_consumers.alerts.rules.classify import FaultEvent
from gpupipe_consumers.alerts.rules.classify_model import workload
from gpupipe_consumers.alerts.rules.parsers import parse_recovery_event

__all__ = ["NOTICE_ALERTNAMES", "NvmlNotices"]

NOTICE_ALERTNAMES = {
    "recovery_action": SIGNAL_INFO["recovery_action"].alertname,  # the sampled signal's alert
    "gpu_unavailable": AlertName.GPU_UNAVAILABLE,
}


class NvmlNotices:
    """Folds NVML's notice events into the table; keeps no state of its own (the recovery-action
    alert is the one the samples share)."""

    def __init__(
        self,
        table: AlertTable,
        *,
        guard: InputGuard,
        decisions: FaultDecisions,
        histories: GpuHistories,
        recovery: RecoveryEvidence,
        bursts: NodeBursts,
    ) -> None:
        self._table = table
        self._counts = table.counts
        self._guard = guard
        self._decisions = decisions
        self._histories = histories
        self._recovery = recovery
        self._bursts = bursts

    def on_notice(
        self,
        ev: dict[str, Any],
        kind: str,
        host: str,
        ts: int,
        now_ms: int,
        boot: str | None,
        position: tuple[int, int] | None = None,
    ) -> Alert | None:
        """Fold one ``recovery_action`` / ``gpu_unavailable`` XidEvent (see module doc)."""
        device = device_key(ev.get("pci_bus_id"), ev.get("uuid"))
        if not device:
            self._counts["invalid"] += 1
            raise InvalidRecord(f"XidEvent of kind {kind} without pci_bus_id or uuid")
        eid = ev.get("event_id") or None
        message = ev.get("message") or ""
        if kind == "recovery_action":
            value = parse_recovery_event(message)
            if value == 0:
                self._recovery_none(host, device, ts, now_ms, message)
                return None
            if self._histories.stale_recovery(host, device, ts):
                return None
        fe = FaultEvent(
            kind=kind,  # one of NOTICE_KINDS (the caller routes only those here)
            ts_ms=ts,
            message=message,
            workload=workload(ev.get("allocations")),
            driver_version=ev.get("driver_version") or None,
        )
        key: Key = ("gpu", host, device, kind)
        if self._guard.replayed(key, position):  # counted before a restart
            return None
        result, signature = self._decisions.classify(fe, host, device, key)
        before = a = self._table.get(key)
        if a is None or kind != "recovery_action":
            a = self._table.touch(key, ts, now_ms, 1, anchor=eid or str(ts), first_event_id=eid)
        else:  # the GPU's need changed or was restated: the same incident as long as it lasts
            a.seen_at_ms = now_ms
            a.first_seen_ms = min(a.first_seen_ms, ts)
            a.last_seen_ms = max(a.last_seen_ms, ts)
            a.occurrences += 1
            self._counts["folded"] += 1
            self._table.dirty(a)
        if a.alertname == "":
            a.alertname = NOTICE_ALERTNAMES[kind]
        a.last_event_id = eid or a.last_event_id
        if position is not None:
            a.last_input = position
        if a.boot_id is None and boot is not None:
            a.boot_id = boot
        self._decisions.apply(a, result, signature)
        self._decisions.identify(a, ev, host, device)
        if not a.message and message:
            a.message = message
            self._table.dirty(a)
        if a.add_allocations(ev.get("allocations")):
            self._table.dirty(a)
        if a is not before and self._recovery.evaluate(a, now_ms):
            return a  # over already: evidence after it was processed first
        self._bursts.count(a, ts, now_ms)  # counts_toward_burst decides (gpu_unavailable does)
        return a

    def _recovery_none(self, host: str, device: str, ts: int, now_ms: int, message: str) -> None:
        """NVML says the GPU needs no recovery action any more: reset evidence for the GPU's alerts
        (:mod:`~gpupipe_consumers.alerts.engine.recovery_policy`), and the recovery-action signal's own
        clear: it ends that
        alert whatever action it asked for (one only the samples raised too: NVML said it first)."""
        detail = f"NVML recovery-action event: {message or 'NONE (0)'}"
        self._recovery.recovered(host, device, ts, now_ms, detail)
        key: Key = ("gpu", host, device, "recovery_action")
        a = self._table.get(key)
        if a is not None and a.last_seen_ms <= ts:
            self._recovery.end(a, now_ms, detail)
            self._counts["recovered"] += 1
