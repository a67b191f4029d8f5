"""NVML's notice events in the alert engine: the GPU's recovery action and "GPU unavailable" (no XID).

XidEvent kinds ``recovery_action`` and ``gpu_unavailable`` (see :mod:`consumers.alerts.rules_notice` for
what they say and how they are graded) have no XID code; keyed as XIDs they became one "XID 0
UNKNOWN_XID" warning per GPU (issue 16). Here:

* **Recovery action** (value != 0) opens or updates the ``recovery_action`` alert of that GPU: the very
  alert the sampled field ``gpu_recovery_action`` raises (key ``(gpu, host, device, recovery_action)``,
  alertname ``GpuRecoveryActionRequired``), so the event and the level signal are one incident
  whichever comes first; a later value folds in (the worst decision stays). NVML reports the change
  once, so once an event spoke for the alert silence is no evidence: it stays firing until evidence
  (:func:`~consumers.alerts.alert_policy.sample_owned`): a sample reading 0, the NONE event, evidence
  that mends the action it asked for (:mod:`consumers.alerts.recovery_policy`), or an ack. A report
  older than the GPU's latest recovery evidence (the sampled value reading 0 included) is over already
  and raises nothing.
* **Recovery action NONE (0)**: evidence of recovery, as the sampled field going back to none: reset
  evidence for the GPU (recorded for its history; it ends the GPU's reset-class alerts from before it,
  never a reboot- or support/RMA-class one: :mod:`consumers.alerts.recovery_policy`), and the
  recovery-action alert's own clear (``recovered``) whatever action that alert asked for.
* **GPU unavailable**: a critical RESET_GPU drain alert of that GPU (key ``(gpu, host, device,
  gpu_unavailable)``, alertname ``GpuUnavailable``, the pods attached as for XIDs) that stays firing
  until evidence of recovery, and counts toward the node's burst like an XID. Its recovery class is
  ``gone``: a driver reload alone does not end it (a module load says nothing of a GPU that could not
  be reached); a sample of the GPU after it, a reset seen in the samples or NVML's NONE do.

A mixin of :class:`consumers.alerts.dedupe.AlertEngine` (it shares the engine's state).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from consumers.alerts.alert_policy import workload
from consumers.alerts.alert_record import Alert
from consumers.alerts.classify import Classification, FaultEvent, GpuXidHistory
from consumers.alerts.health_signals import SIGNAL_INFO, InvalidRecord, device_key
from consumers.alerts.xid_parsers import parse_recovery_event

if TYPE_CHECKING:
    from consumers.alerts.engine_config import Key

__all__ = ["NOTICE_ALERTNAMES", "NoticeMixin"]

NOTICE_ALERTNAMES = {
    "recovery_action": SIGNAL_INFO["recovery_action"].alertname,  # the sampled signal's alert
    "gpu_unavailable": "GpuUnavailable",
}


class NoticeMixin:
    """The engine's handling of NVML notice events (state lives in the engine)."""

    counts: dict[str, int]
    _open: dict[Key, Alert]

    def _history(self, host: str, device: str) -> GpuXidHistory: ...

    def _classify(
        self, fe: FaultEvent, history: GpuXidHistory, host: str, device: str, key: Key
    ) -> tuple[Classification | None, tuple[Any, ...]]: ...

    def _apply(self, a: Alert, c: Classification | None, sig: tuple[Any, ...]) -> None: ...

    def _identify(self, a: Alert, ev: dict[str, Any], host: str, device: str) -> None: ...

    def _touch(
        self, key: Key, ts: int, now_ms: int, count: int, *, anchor: str, first_event_id: str | None = None
    ) -> Alert: ...

    def _dirty(self, a: Alert) -> None: ...

    def _node_burst(self, gpu_alert: Alert, ts: int, now_ms: int) -> None: ...

    def _end(self, key: Key, a: Alert, now_ms: int, detail: str) -> None: ...

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

    def stale_recovery(self, host: str, device: str, ts: int) -> bool:
        """A recovery action reported at ``ts`` is over already: the GPU has recovery evidence after it (a
        reset, reboot or driver load recorded in its history, the NONE event). Keeps a late sample or
        event from raising an alert for a GPU that is fine again. Evidence at the same time is not
        "after": the sample that shows a reset may show that the GPU still needs an action."""
        return any(r > ts for r in self._history(host, device).resets())

    def _on_notice(
        self, ev: dict[str, Any], kind: str, host: str, ts: int, now_ms: int, boot: str | None
    ) -> Alert | None:
        """Fold one ``recovery_action`` / ``gpu_unavailable`` XidEvent (see module doc)."""
        device = device_key(ev.get("pci_bus_id"), ev.get("uuid"))
        if not device:
            self.counts["invalid"] += 1
            raise InvalidRecord(f"XidEvent of kind {kind} without pci_bus_id or uuid")
        eid = ev.get("event_id") or None
        message = ev.get("message") or ""
        if kind == "recovery_action":
            value = parse_recovery_event(message)
            if value == 0:
                self._recovery_none(host, device, ts, now_ms, message)
                return None
            if self.stale_recovery(host, device, ts):
                return None
        fe = FaultEvent(
            kind=kind,  # one of NOTICE_KINDS (the caller routes only those here)
            ts_ms=ts,
            message=message,
            workload=workload(ev.get("allocations")),
            driver_version=ev.get("driver_version") or None,
        )
        key: Key = ("gpu", host, device, kind)
        result, signature = self._classify(fe, self._history(host, device), host, device, key)
        before = a = self._open.get(key)
        if a is None or kind != "recovery_action":
            a = self._touch(key, ts, now_ms, 1, anchor=eid or str(ts), first_event_id=eid)
        else:  # the GPU's need changed or was restated: the same incident as long as it lasts
            a.seen_at_ms = now_ms
            a.first_seen_ms = min(a.first_seen_ms, ts)
            a.last_seen_ms = max(a.last_seen_ms, ts)
            a.occurrences += 1
            self.counts["folded"] += 1
            self._dirty(a)
        if a.alertname == "":
            a.alertname = NOTICE_ALERTNAMES[kind]
        a.last_event_id = eid or a.last_event_id
        if a.boot_id is None and boot is not None:
            a.boot_id = boot
        self._apply(a, result, signature)
        self._identify(a, ev, host, device)
        if not a.message and message:
            a.message = message
            self._dirty(a)
        if a.add_allocations(ev.get("allocations")):
            self._dirty(a)
        if a is not before and self.evaluate(a, now_ms):
            return a  # over already: evidence after it was processed first
        self._node_burst(a, ts, now_ms)  # counts_toward_burst decides (gpu_unavailable does)
        return a

    def _recovery_none(self, host: str, device: str, ts: int, now_ms: int, message: str) -> None:
        """NVML says the GPU needs no recovery action any more: reset evidence for the GPU's alerts
        (:mod:`~consumers.alerts.recovery_policy`), and the recovery-action signal's own clear: it ends that
        alert whatever action it asked for (one only the samples raised too: NVML said it first)."""
        detail = f"NVML recovery-action event: {message or 'NONE (0)'}"
        self.recovered(host, device, ts, now_ms, detail)
        key: Key = ("gpu", host, device, "recovery_action")
        a = self._open.get(key)
        if a is not None and a.last_seen_ms <= ts:
            self._end(key, a, now_ms, detail)
            self.counts["recovered"] += 1
