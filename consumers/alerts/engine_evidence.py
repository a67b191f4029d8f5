"""Evidence and restart for the alert engine: recovery and acks resolve sticky alerts; the state a restart
restores from ``gpu.alerts.v1``.

Evidence of recovery, and what each one ends:

* a ``gpu_reset`` signal from the samples (:meth:`EvidenceMixin.recovered`): that GPU's fault alerts;
* a reboot (:meth:`EvidenceMixin.seen_boot`): an event of the node carrying another boot id than the one
  an open alert was raised under ends every GPU and NVSwitch fault alert of that node raised before the
  event (a reboot resets every GPU and switch; what comes back afterwards is a new incident, which the
  recurrence rules see across the recorded reset);
* the driver's load line in the kernel log (:meth:`EvidenceMixin.driver_loaded`, XidEvent kind
  ``driver_loaded``): every GPU of the node was re-initialised, which is what a GPU reset does, so it
  ends the node's GPU alerts except those that need more than a reset (RESTART_BM, RESTART_VM, an RMA
  or support case on a drain alert): a GPU that fell off the bus is not back because the module loaded
  again ("The NVIDIA probe routine failed" then "NVRM: loading ..." is what the kernel prints then);
* NVML's recovery-action event saying NONE (0) (:mod:`consumers.alerts.engine_notices`): as the
  sampled field going back to none, that GPU's fault alerts, its recovery-action alert included;
* an operator's ack (:meth:`EvidenceMixin.acknowledge`).

Level-signal alerts that only the samples raised are left to the samples' own clear; one an XidEvent
raised (the recovery-action event) is ended by evidence like any fault
(:func:`~consumers.alerts.alert_policy.sample_owned`).

A mixin of :class:`consumers.alerts.dedupe.AlertEngine` (it shares the engine's state); see that module's
doc, "Resolve by quiet", and :mod:`consumers.alerts.service`, "Restart".
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from consumers.alerts.alert_policy import STICKY_ACTIONS, rank, sample_owned
from consumers.alerts.alert_record import Alert, alert_from_record
from consumers.alerts.classify import FaultEvent, GpuXidHistory

if TYPE_CHECKING:
    from consumers.alerts.engine_config import EngineConfig, Key

__all__ = ["RESET_CLASS_ACTIONS", "EvidenceMixin"]

#: Actions a GPU reset (or the driver re-initialising every GPU) satisfies.
RESET_CLASS_ACTIONS = frozenset({"RESET_GPU", "DRAIN_AND_RESET", "DRAIN_P2P"})
_REBOOT_SCOPES = frozenset({"gpu", "nvswitch"})


class EvidenceMixin:
    """The engine's evidence and restore methods (state lives in the engine)."""

    cfg: EngineConfig
    counts: dict[str, int]
    _open: dict[Key, Alert]
    _closed: dict[Key, Alert]
    _ids: dict[str, Alert]
    _by_gpu: dict[tuple[str, str], set[Key]]
    _node_worst: dict[str, tuple[int, int, int]]
    _boots: dict[str, str]
    _histories: dict[tuple[str, str], GpuXidHistory]

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
        fault alerts older than that. Level signals the samples own have their own clear and are left
        alone (:func:`~consumers.alerts.alert_policy.sample_owned`)."""
        out = []
        for key in list(self._by_gpu.get((host, device), ())):
            a = self._open[key]
            if sample_owned(a) or a.scope != "gpu":
                continue
            if a.first_seen_ms > ts:
                continue  # a fault after the reset is a new fault
            a.description = (a.description + f" Recovered: {detail}.").strip() if detail else a.description
            self._resolve(a, now_ms, "recovered")
            self._close(key, a, keep=False)
            out.append(a)
        self.counts["recovered"] += len(out)
        return out

    def _host_keys(self, host: str) -> list[Key]:
        return [key for (h, _device), keys in self._by_gpu.items() if h == host for key in keys]

    def _end(self, key: Key, a: Alert, now_ms: int, detail: str) -> None:
        a.description = (a.description + f" Recovered: {detail}.").strip()
        self._resolve(a, now_ms, "recovered")
        self._close(key, a, keep=False)

    def seen_boot(self, host: str, boot_id: str, ts: int, now_ms: int) -> list[Alert]:
        """An event of ``host`` at ``ts`` carries ``boot_id``: if that is not the boot the node's open
        alerts were raised under, the node rebooted since -- resolve (``recovered``) every GPU/NVSwitch
        fault alert of the node raised under another boot before ``ts``. Cheap when the boot id is the
        one seen last for the host (the common case: one dict lookup)."""
        if self._boots.get(host) == boot_id:
            return []
        self._boots[host] = boot_id
        out = []
        for key in self._host_keys(host):
            a = self._open[key]
            if a.scope not in _REBOOT_SCOPES or sample_owned(a):
                continue
            if a.boot_id is None or a.boot_id == boot_id or a.first_seen_ms > ts:
                continue
            self._end(key, a, now_ms, f"the node rebooted (boot id {a.boot_id} -> {boot_id})")
            out.append(a)
        if out:
            for (h, _device), history in self._histories.items():
                if h == host:
                    history.record_reset(ts)
        self.counts["recovered"] += len(out)
        self.counts["reboots_seen"] += bool(out)
        return out

    def driver_loaded(self, host: str, ts: int, now_ms: int, detail: str) -> list[Alert]:
        """The kernel log of ``host`` shows the NVIDIA driver loaded at ``ts``: every GPU was
        re-initialised. Resolve (``recovered``) the node's GPU fault alerts raised before ``ts`` whose
        action a reset satisfies; those that need a reboot or a person stay (see module doc)."""
        out = []
        for key in self._host_keys(host):
            a = self._open[key]
            if a.scope != "gpu" or sample_owned(a) or a.first_seen_ms > ts:
                continue
            if (a.drain_node or a.action in STICKY_ACTIONS) and a.action not in RESET_CLASS_ACTIONS:
                continue  # RESTART_BM / RESTART_VM / an RMA: a driver reload is no evidence
            self._end(key, a, now_ms, f"the NVIDIA driver was loaded again ({detail})")
            out.append(a)
        for (h, _device), history in self._histories.items():
            if h == host:
                history.record_reset(ts)
        self.counts["recovered"] += len(out)
        self.counts["driver_loads"] += 1
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
