"""What one fault occurrence says about its alert: the classifier's decision and the GPU's identity.

Classification (:func:`~gpupipe_consumers.alerts.rules.classify.classify`, per GPU history and health
snapshot) runs for every occurrence, except a repeat of a fault already classified within the open incident;
an alert keeps the *worst* decision seen (severity, then drain, then action rank): it may escalate, never
de-escalate, while open. The identity (UUID, index, model, driver, pods) comes from the event, or from
what the samples know of the GPU when the event lacks it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from gpupipe_consumers.alerts.engine.alert_policy import merge_codes, unless_elsewhere, worse
from gpupipe_consumers.alerts.engine.alert_record import Alert
from gpupipe_consumers.alerts.engine.alert_table import AlertTable, Key
from gpupipe_consumers.alerts.engine.gpu_histories import GpuHistories
from gpupipe_consumers.alerts.engine.health_signals import GpuIdentity
from gpupipe_consumers.alerts.rules.classify import Classification, FaultEvent, GpuHealth, classify

__all__ = ["FaultDecisions", "HealthFn", "IdentityFn"]

HealthFn = Callable[[str, str], GpuHealth | None]
IdentityFn = Callable[[str, str], GpuIdentity | None]

Signature = tuple[Any, ...]


class FaultDecisions:
    """Classify occurrences and write the decision and identity into their alerts.

    Owns the signatures of the faults classified per open alert (the storm path's shortcut); they are
    forgotten when the alert ends."""

    def __init__(
        self, table: AlertTable, histories: GpuHistories, health: HealthFn, identity: IdentityFn
    ) -> None:
        self._table = table
        self._cfg = table.cfg.classify
        self._histories = histories
        self._health = health
        self._identity = identity
        self._signatures: dict[str, set[Signature]] = {}
        table.when_ended(self._forget)

    def _forget(self, a: Alert) -> None:
        self._signatures.pop(a.alert_id, None)

    def classify(
        self, fe: FaultEvent, host: str, device: str, key: Key
    ) -> tuple[Classification | None, Signature]:
        """Classify, or ``None`` when this exact fault was already classified within the open alert.

        A repeat with the same code, process and message inside one incident cannot change the decision
        (the rules look at distinct processes, messages and incidents separated by more than the
        classifier's incident gap or by a reset), so the storm path skips the work -- unless the GPU was
        reset or its node rebooted since the alert's latest occurrence (the fault back after it may
        escalate, e.g. Xid 79 minutes after a reboot).
        """
        history = self._histories.get(host, device)
        a = self._table.get(key)
        sig = (fe.kind, fe.code, fe.pid, fe.process_name, fe.message)
        resets = history.resets()
        if (
            a is not None
            and fe.ts_ms - a.last_seen_ms < self._cfg.incident_gap_ms
            and not (resets and resets[-1] > a.last_seen_ms)  # a reset since: a new incident
        ):
            seen = self._signatures.get(a.alert_id)
            if seen is not None and sig in seen:
                return None, sig
        result = classify(fe, history, self._health(host, device), self._cfg)
        if result.rule == "app_fault.repeat_distinct_workloads":
            window = self._cfg.app_fault_window_ms
            others = self._histories.all()
            result = unless_elsewhere(result, history, others, (host, device), fe.ts_ms, window)
        return result, sig

    def apply(self, a: Alert, c: Classification | None, sig: Signature) -> None:
        """Write decision ``c`` into ``a`` when it is worse than the one ``a`` holds (see module doc)."""
        if c is None:
            return
        dirty = self._table.dirty
        seen = self._signatures.setdefault(a.alert_id, set())
        if len(seen) < 64:
            seen.add(sig)
        new_decision = (c.severity.value, c.drain_node, c.action.value)
        current = (a.severity, a.drain_node, a.action)
        if a.name and c.codes[:1] in ((171,), (172,)) and not worse(current, new_decision):
            # 171/172 qualify the 48 (DRAM or SRAM): same decision, a more precise workflow branch
            a.codes = merge_codes(a.codes, c.codes)
            a.rule, a.description, a.runbook = c.rule, c.reason, c.runbook
            dirty(a)
            return
        if a.name and not worse(new_decision, current):
            merged = merge_codes(a.codes, c.codes)  # a folded detail (172, 95, 45, 154) is listed
            if merged != a.codes:
                a.codes = merged
                dirty(a)
            a.known = a.known and c.known
            return
        first = not a.name
        a.codes = merge_codes(a.codes, c.codes) if a.codes else tuple(c.codes)
        a.name = c.name
        a.severity = c.severity.value
        a.cause_class = c.cause_class.value
        a.action = c.action.value
        a.nvidia_action = c.nvidia_action.value if c.nvidia_action is not None else None
        a.drain_node = c.drain_node
        a.known = c.known if first else a.known and c.known
        a.rule = c.rule
        a.description = c.reason
        a.runbook = c.runbook
        a.catalog_version = c.catalog_version
        a.urgent = True
        dirty(a)

    def identify(self, a: Alert, ev: dict[str, Any], host: str, device: str) -> None:
        """Fill in what ``a`` does not know yet of its GPU and pods, from event ``ev`` or the samples."""
        ident = self._identity(host, device) if (ev.get("uuid") is None or a.gpu_index is None) else None
        uuid = ev.get("uuid") or (ident.uuid if ident else None)
        changed = False
        if a.gpu_uuid is None and uuid and a.scope == "gpu":
            a.gpu_uuid = uuid
            changed = True
        if a.gpu_index is None:
            idx = ev.get("gpu_index")
            if idx is None and ident is not None:
                idx = ident.gpu_index
            if idx is not None:
                a.gpu_index = idx
                changed = True
        if a.model_name is None:
            a.model_name = ev.get("model_name") or (ident.model_name if ident else None)
        if a.driver_version is None:
            a.driver_version = ev.get("driver_version") or (ident.driver_version if ident else None)
        if a.mig_uuid is None and a.occurrences <= 1:
            a.mig_uuid = ev.get("mig_uuid")
        if not a.gpus or (a.gpu_uuid and a.gpus == [device]):
            a.gpus = [a.gpu_uuid or device]
            changed = True
        if not ev.get("allocations") and ident is not None and a.add_allocations(ident.allocations):
            changed = True
        if changed:
            self._table.dirty(a)
