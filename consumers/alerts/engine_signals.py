"""Health signals from the samples in the alert engine (:meth:`SignalMixin.on_signal`).

One change of one GPU's health signal (from :class:`~consumers.alerts.health_signals.HealthTracker`):
``gpu_lost`` is folded as an XidEvent of kind ``gpu_lost`` (Xid 79: one alert with the XidEvents of the
same loss), ``gpu_reset`` is evidence of recovery, ``ecc_dbe`` joins the open Xid 48 alert of the GPU
when there is one, and level signals (``active`` / ``clear``) keep one alert per GPU and signal, which
NVML's recovery-action *event* shares (:mod:`consumers.alerts.engine_notices`).

A mixin of :class:`consumers.alerts.dedupe.AlertEngine` (it shares the engine's state); see that
module's doc.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from consumers.alerts.alert_policy import with_note, worse
from consumers.alerts.alert_record import Alert
from consumers.alerts.catalog import CATALOG_VERSION
from consumers.alerts.health_signals import SIGNAL_INFO, GpuIdentity, SignalEvent, recovery_presentation

if TYPE_CHECKING:
    from consumers.alerts.classify import GpuXidHistory
    from consumers.alerts.engine_config import Key

__all__ = ["SignalMixin"]


class SignalMixin:
    """The engine's health-signal input (state lives in the engine)."""

    counts: dict[str, int]
    _open: dict[Key, Alert]

    def _clamp(self, ts: int, now_ms: int) -> int: ...

    def _history(self, host: str, device: str) -> GpuXidHistory: ...

    def _dirty(self, a: Alert) -> None: ...

    def _touch(
        self, key: Key, ts: int, now_ms: int, count: int, *, anchor: str, first_event_id: str | None = None
    ) -> Alert: ...

    def _resolve(self, a: Alert, now_ms: int, reason: str) -> None: ...

    def _close(self, key: Key, a: Alert, *, keep: bool) -> None: ...

    def on_xid(self, ev: dict[str, Any], now_ms: int) -> Alert | None: ...

    def recovered(
        self,
        host: str,
        device: str,
        ts: int,
        now_ms: int,
        detail: str = "",
        kind: str = "reset",
        uuid: str | None = None,
    ) -> list[Alert]: ...

    def evaluate(self, a: Alert, now_ms: int) -> bool: ...

    def stale_recovery(self, host: str, device: str, ts: int) -> bool: ...

    def on_signal(self, ident: GpuIdentity, sig: SignalEvent, now_ms: int) -> Alert | None:
        """Apply one health-signal change of one GPU (from :class:`HealthTracker`)."""
        self.counts["signals"] += 1
        host, device = ident.hostname, ident.device
        ts = self._clamp(sig.ts_ms, now_ms)
        if sig.signal == "gpu_lost":
            if sig.kind == "occurrence":
                ev = {
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
                self.counts["events"] -= 1  # counted as a signal, not as an XidEvent
                return self.on_xid(ev, now_ms)
            a = self._open.get(("gpu", host, device, "xid:79"))
            if a is not None:
                a.seen_at_ms = now_ms
                if ts > a.last_seen_ms:
                    a.last_seen_ms = ts
                    self._dirty(a)
            return a
        if sig.signal == "gpu_reset":
            self.recovered(host, device, ts, now_ms, sig.detail, kind=sig.evidence or "reset")
            return None
        if sig.signal == "ecc_dbe":
            mem = self._open.get(("gpu", host, device, "xid:48"))
            if mem is not None:  # the counter of the memory fault an XID already reported: one alert
                mem.seen_at_ms = now_ms
                mem.description = with_note(mem.description, f"Samples: {sig.detail}.")
                self.counts["folded"] += 1
                self._dirty(mem)
                return mem
        key: Key = ("gpu", host, device, sig.signal)
        before = self._open.get(key)
        if sig.kind == "clear":
            a = self._open.get(key)
            if a is not None:
                self._resolve(a, now_ms, "cleared")
                self._close(key, a, keep=False)
            if sig.signal == "recovery_action":
                # the driver requires nothing any more: reset evidence, and any report of an action read
                # before it, processed after it (NVML's event comes on another topic), is over already
                self.recovered(host, device, ts, now_ms, f"Samples: {sig.detail or 'gpu_recovery_action=0'}")
            return None
        if sig.kind == "active":
            a = self._open.get(key)
            if a is not None:
                a.seen_at_ms = now_ms
                if ts > a.last_seen_ms:
                    a.last_seen_ms = ts
                    self._dirty(a)
            else:
                since = self._clamp(sig.since_ms or ts, now_ms)
                if sig.signal == "recovery_action" and self.stale_recovery(host, device, since):
                    return None  # read before the GPU's latest recovery evidence, processed after it
                a = self._touch(key, since, now_ms, 1, anchor=str(since))
                if ts > a.last_seen_ms:
                    a.last_seen_ms = ts
        else:
            a = self._touch(key, ts, now_ms, max(1, sig.count), anchor=str(ts))
        info = SIGNAL_INFO[sig.signal]
        severity, drain, action = info.severity, info.drain_node, info.action
        if sig.signal == "recovery_action":
            action, severity, drain = recovery_presentation(sig.value)
        if a.alertname == "":
            a.alertname = info.alertname
            a.name = info.name
            a.cause_class = info.cause_class
            a.runbook = info.runbook
            a.rule = f"health.{sig.signal}"
            a.catalog_version = CATALOG_VERSION
        if a.description == "" or worse((severity, drain, action), (a.severity, a.drain_node, a.action)):
            a.severity, a.drain_node, a.action = severity, drain, action
            a.description = f"{info.name} on {host} {device}: {sig.detail}."
            a.urgent = True
            self._dirty(a)
        if a.gpu_uuid is None and ident.uuid:
            a.gpu_uuid = ident.uuid
            a.add_gpu(ident.uuid)
        if a.gpu_index is None:
            a.gpu_index = ident.gpu_index
        a.model_name = a.model_name or ident.model_name
        a.driver_version = a.driver_version or ident.driver_version
        if not a.gpus:
            a.add_gpu(a.gpu_uuid or device)
        if a.add_allocations(ident.allocations):
            self._dirty(a)
        if a is not before:
            self.evaluate(a, now_ms)  # evidence after it processed first (NVML's events come on gpu.xid.v1)
        return a
