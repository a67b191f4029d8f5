"""NVML's notice events in the alert engine: the GPU's recovery action and "GPU unavailable" (no XID).

XidEvent kinds ``recovery_action`` and ``gpu_unavailable`` (see :mod:`gpupipe_consumers.alerts.rules.notice`
for what they say and how they are graded) have no XID code, so they are not keyed as XIDs (each would be
an "XID 0 UNKNOWN_XID" warning): each is keyed by its kind on its GPU and folded by the intake
(:mod:`gpupipe_consumers.alerts.engine.xid_intake`) like a fault, unless it is evidence of recovery.

Rules and reasons in full: docs/alerts.md, "Module notes", ``engine/nvml_notices.py``.
"""

from __future__ import annotations

from typing import Any

from gpupipe_consumers.alerts.engine.alert_record import AlertName
from gpupipe_consumers.alerts.engine.alert_table import AlertTable, Key
from gpupipe_consumers.alerts.engine.gpu_histories import GpuHistories
from gpupipe_consumers.alerts.engine.health_signals import SIGNAL_INFO, InvalidRecord
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
    """Turns NVML's notice events into occurrences of their alerts (folded by the intake like an XID's);
    keeps no state of its own (the recovery-action alert is the one the samples share)."""

    def __init__(self, table: AlertTable, *, histories: GpuHistories, recovery: RecoveryEvidence) -> None:
        self._table = table
        self._counts = table.counts
        self._histories = histories
        self._recovery = recovery

    def occurrence(
        self, ev: dict[str, Any], kind: str, host: str, device: str, ts: int, now_ms: int
    ) -> tuple[Key, FaultEvent] | None:
        """The alert key and fault of one ``recovery_action`` / ``gpu_unavailable`` XidEvent on ``device``,
        or ``None`` when it is evidence of recovery or older than what the GPU said since (see module
        doc)."""
        if not device:
            self._counts["invalid"] += 1
            raise InvalidRecord(f"XidEvent of kind {kind} without pci_bus_id or uuid")
        message = ev.get("message") or ""
        if kind == "recovery_action":
            if self._recovery_none(host, device, ts, now_ms, message):
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
        return ("gpu", host, device, kind), fe

    def _recovery_none(self, host: str, device: str, ts: int, now_ms: int, message: str) -> bool:
        """Whether NVML says the GPU needs no recovery action any more. If so: reset evidence for the GPU's
        alerts (:mod:`~gpupipe_consumers.alerts.engine.recovery_policy`), and the recovery-action
        signal's own clear: it ends that alert whatever action it asked for (one only the samples raised
        too: NVML said it first)."""
        if parse_recovery_event(message) != 0:
            return False
        detail = f"NVML recovery-action event: {message or 'NONE (0)'}"
        self._recovery.recovered(host, device, ts, now_ms, detail)
        key: Key = ("gpu", host, device, "recovery_action")
        a = self._table.get(key)
        if a is not None and a.last_seen_ms <= ts:
            self._recovery.end(a, now_ms, detail)
            self._counts["recovered"] += 1
        return True
