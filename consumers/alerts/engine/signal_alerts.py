"""Health signals from the samples into the alerts (:meth:`SignalAlerts.on_signal`).

One change of one GPU's health signal (from
:class:`~gpupipe_consumers.alerts.engine.health_signals.HealthTracker`): ``gpu_lost`` is folded as an
XidEvent of kind ``gpu_lost`` (Xid 79: one alert with the XidEvents of the same loss; a GPU lost in the
tracker's first sample of it raises one only when none is open), ``gpu_reset`` is evidence of recovery,
``ecc_dbe`` joins the open Xid 48 alert of the GPU when there is one, and level signals (``active`` /
``clear``) keep one alert per GPU and signal, which NVML's recovery-action *event* shares
(:mod:`gpupipe_consumers.alerts.engine.nvml_notices`). See :mod:`gpupipe_consumers.alerts.engine.facade` for
the rules.
"""

from __future__ import annotations

from typing import Any

from gpupipe_consumers.alerts.engine.alert_policy import with_note, worse
from gpupipe_consumers.alerts.engine.alert_record import NVLINK_SIGNAL, Alert
from gpupipe_consumers.alerts.engine.alert_table import AlertTable, Key
from gpupipe_consumers.alerts.engine.gpu_histories import GpuHistories
from gpupipe_consumers.alerts.engine.health_signals import (
    NVLINK_FAILED,
    GpuIdentity,
    SignalEvent,
    recovery_presentation,
    signal_info,
)
from gpupipe_consumers.alerts.engine.input_guard import InputGuard
from gpupipe_consumers.alerts.engine.recovery_evidence import RecoveryEvidence
from gpupipe_consumers.alerts.engine.xid_intake import XidIntake
from gpupipe_consumers.alerts.rules.catalog import CATALOG_VERSION

__all__ = ["SignalAlerts"]


class SignalAlerts:
    """Folds health-signal changes into the table; keeps no state of its own (a level signal's alert is
    its state)."""

    def __init__(
        self,
        table: AlertTable,
        *,
        guard: InputGuard,
        histories: GpuHistories,
        recovery: RecoveryEvidence,
        xids: XidIntake,
    ) -> None:
        self._table = table
        self._counts = table.counts
        self._guard = guard
        self._histories = histories
        self._recovery = recovery
        self._xids = xids

    def on_signal(self, ident: GpuIdentity, sig: SignalEvent, now_ms: int) -> Alert | None:
        """Apply one health-signal change of one GPU (see module doc)."""
        self._counts["signals"] += 1
        host, device = ident.hostname, ident.device
        ts = self._guard.clamp(sig.ts_ms, now_ms)
        if sig.signal == "gpu_lost":
            return self._gpu_lost(ident, sig, ts, now_ms)
        if sig.signal == "gpu_reset":
            self._recovery.recovered(host, device, ts, now_ms, sig.detail, kind=sig.evidence or "reset")
            return None
        if sig.signal == "ecc_dbe":
            mem = self._table.get(("gpu", host, device, "xid:48"))
            if mem is not None:  # the counter of the memory fault an XID already reported: one alert
                mem.seen_at_ms = now_ms
                mem.description = with_note(mem.description, f"Samples: {sig.detail}.")
                self._counts["folded"] += 1
                self._table.dirty(mem)
                return mem
        key: Key = ("gpu", host, device, sig.signal)
        before = self._table.get(key)
        if sig.kind == "clear":
            self._clear(ident, sig, key, ts, now_ms)
            return None
        a = self._raise(ident, sig, key, ts, now_ms)
        if a is None:
            return None
        self._present(a, ident, sig)
        self._identify(a, ident)
        self._blast_radius(a, sig)
        if a is not before:
            # evidence after it processed first (NVML's events come on gpu.xid.v1)
            self._recovery.evaluate(a, now_ms)
        return a

    def _gpu_lost(self, ident: GpuIdentity, sig: SignalEvent, ts: int, now_ms: int) -> Alert | None:
        """A lost GPU is Xid 79: its occurrence (or a first sample of it lost) goes the XidEvent path."""
        host, device = ident.hostname, ident.device
        a = self._table.get(("gpu", host, device, "xid:79"))
        if sig.kind == "occurrence" or (sig.baseline and a is None):
            self._counts["events"] -= 1  # counted as a signal, not as an XidEvent
            return self._xids.on_xid(_lost_event(ident, sig), now_ms)
        # still lost (after a restart, the open alert is the same loss whatever happened since its
        # latest published sighting): no change to publish, the next revision carries the time
        if a is not None:
            a.seen_at_ms = now_ms
            a.last_seen_ms = max(a.last_seen_ms, ts)
        return a

    def _clear(self, ident: GpuIdentity, sig: SignalEvent, key: Key, ts: int, now_ms: int) -> None:
        a = self._table.get(key)
        if a is not None and ts <= a.last_seen_ms:
            # A sample older than the alert's latest sighting (input replayed after a restart, the
            # restored alert saw later samples): it says nothing about now.
            self._counts["stale_clear"] += 1
        elif a is not None:
            self._table.end(a, now_ms, "cleared")
        if sig.signal == "recovery_action":
            # the driver requires nothing any more: reset evidence, and any report of an action read
            # before it, processed after it (NVML's event comes on another topic), is over already
            detail = f"Samples: {sig.detail or 'gpu_recovery_action=0'}"
            self._recovery.recovered(ident.hostname, ident.device, ts, now_ms, detail)

    def _raise(self, ident: GpuIdentity, sig: SignalEvent, key: Key, ts: int, now_ms: int) -> Alert | None:
        """The alert an active level or an occurrence lands in (``None``: a report already over)."""
        if sig.kind != "active":
            return self._table.touch(key, ts, now_ms, max(1, sig.count), anchor=str(ts))
        a = self._table.get(key)
        if a is not None:  # the condition holds: no change to publish, the keep-alive carries it
            a.seen_at_ms = now_ms
            a.last_seen_ms = max(a.last_seen_ms, ts)
            return a
        since = self._guard.clamp(sig.since_ms or ts, now_ms)
        if sig.signal == "recovery_action" and self._histories.stale_recovery(
            ident.hostname, ident.device, since
        ):
            return None  # read before the GPU's latest recovery evidence, processed after it
        a = self._table.touch(key, since, now_ms, 1, anchor=str(since))
        if ts > a.last_seen_ms:
            a.last_seen_ms = ts
        return a

    def _present(self, a: Alert, ident: GpuIdentity, sig: SignalEvent) -> None:
        """Name a new alert after its signal; the worse presentation wins (and is urgent)."""
        info = signal_info(sig.signal)
        severity, drain, action, runbook = info.severity, info.drain_node, info.action, info.runbook
        if sig.signal == "recovery_action":
            action, severity, drain, runbook = recovery_presentation(sig.value)
        elif info.name == signal_info(NVLINK_SIGNAL).name and sig.value == 2:
            severity, drain, action = NVLINK_FAILED
        if a.alertname == "":
            a.alertname = info.alertname
            a.name = info.name
            a.cause_class = info.cause_class
            a.runbook = info.runbook
            a.rule = f"health.{sig.signal}"
            a.catalog_version = CATALOG_VERSION
        if a.description == "" or worse((severity, drain, action), (a.severity, a.drain_node, a.action)):
            a.severity, a.drain_node, a.action = severity, drain, action
            a.runbook = runbook  # the action's own steps: a bus reset and a reboot read differently
            a.description = f"{info.name} on {ident.hostname} {ident.device}: {sig.detail}."
            a.urgent = True
            self._table.dirty(a)

    def _identify(self, a: Alert, ident: GpuIdentity) -> None:
        """What the sample says about the GPU and who used it."""
        if a.gpu_uuid is None and ident.uuid:
            a.gpu_uuid = ident.uuid
            a.add_gpu(ident.uuid)
        if a.gpu_index is None:
            a.gpu_index = ident.gpu_index
        a.model_name = a.model_name or ident.model_name
        a.driver_version = a.driver_version or ident.driver_version
        if not a.gpus:
            a.add_gpu(a.gpu_uuid or ident.device)
        if a.add_allocations(ident.allocations):
            self._table.dirty(a)

    def _blast_radius(self, a: Alert, sig: SignalEvent) -> None:
        """An NVLink link's alert names the GPUs of its NVLink domain and the pods on them."""
        for other in sig.related:
            added = a.add_gpu(other.uuid or other.device)
            if a.add_allocations(other.allocations) or added:
                self._table.dirty(a)


def _lost_event(ident: GpuIdentity, sig: SignalEvent) -> dict[str, Any]:
    """The XidEvent a sample's GPU loss stands for."""
    host, device = ident.hostname, ident.device
    return {
        "event_id": f"{host}|sample|{device}|gpu_lost|{sig.ts_ms}",
        "timestamp_ms": sig.ts_ms,
        "hostname": host,
        "kind": "gpu_lost",
        "xid": None,
        "pci_bus_id": device,
        "uuid": ident.uuid,
        "gpu_index": ident.gpu_index,
        "model_name": ident.model_name,
        "driver_version": ident.driver_version,
        "message": "NVML reports the GPU lost (gpu_lost in gpu.samples.v1)",
        "source": "sample",
        "allocations": ident.allocations,
    }
