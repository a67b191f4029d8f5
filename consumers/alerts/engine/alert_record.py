"""The alert model, its key's device part and stable id, and the two wire forms: the ``GpuAlert``
record and Alertmanager's.

Pure: no clocks (times are passed in), no I/O. :class:`Alert` is the mutable state the engine
(:mod:`gpupipe_consumers.alerts.engine.facade`) keeps per open alert; :func:`to_record` turns a snapshot of
it into a ``GpuAlert`` dict (``schemas/GpuAlert.avsc``) and :func:`gpu_alert_shape` turns a record into one
element of Alertmanager's ``POST /api/v2/alerts`` body.

Rules and reasons in full: docs/alerts.md, "Module notes", ``engine/alert_record.py``.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field, replace
from enum import StrEnum
from functools import cache
from typing import Any

from gpupipe.clients.alertmanager import iso_ms
from gpupipe.domain import pci
from gpupipe_schemas import catalog as schema_catalog

__all__ = [
    "ALERTNAMES",
    "LEVEL_SIGNALS",
    "MAX_ALLOCATIONS",
    "MAX_MESSAGE_CHARS",
    "NVLINK_SIGNAL",
    "STICKY_ACTIONS",
    "Alert",
    "AlertName",
    "Pending",
    "action_record",
    "alert_device_key",
    "alert_from_record",
    "alert_id",
    "is_level",
    "iso_ms",
    "to_record",
]


class AlertName(StrEnum):
    """Every ``alertname`` the alerts service gives its alerts: one list, so the shipped Prometheus rules
    can be checked never to use one (two sources paging one fault under one name, with different labels,
    defeat Alertmanager's grouping and inhibition; see deploy/prometheus/gpupipe-alerts.rules.yml)."""

    XID = "GpuXidError"
    SXID = "NvswitchSxidError"
    NODE_BURST = "GpuNodeXidStorm"
    ECC_UNCORRECTABLE = "GpuEccUncorrectable"
    ROW_REMAP_FAILURE = "GpuRowRemapFailure"
    ROW_REMAP_PENDING = "GpuRowRemapPending"
    BANK_REMAP_PENDING = "GpuBankRemapPending"
    MEMORY_UNREPAIRABLE = "GpuMemoryUnrepairable"
    THERMAL_THROTTLING = "GpuThermalThrottling"
    RECOVERY_ACTION = "GpuRecoveryActionRequired"
    GPU_UNAVAILABLE = "GpuUnavailable"
    RECOVERY_EVIDENCE = "GpuRecoveryEvidence"
    NVLINK_DEGRADING = "GpuNvLinkDegrading"


ALERTNAMES = frozenset(n.value for n in AlertName)

LEVEL_SIGNALS = frozenset(
    {
        "row_remap_failure",
        "row_remap_pending",
        "bank_remap_pending",
        "memory_unrepairable",
        "recovery_action",
        "thermal",
    }
)
"""Signals that are levels, not events: their alert lasts while the sampled value says so."""

NVLINK_SIGNAL = "nvlink_link"
"""An NVLink link's health: the signal of its alert is ``nvlink_link:<link id>``, a level too."""


def is_level(signal: str) -> bool:
    """Whether an alert key's signal is a level (see :data:`LEVEL_SIGNALS`; NVLink links included)."""
    return signal in LEVEL_SIGNALS or signal.startswith(NVLINK_SIGNAL + ":")


# Actions that need a reset, reboot or a person with a replacement GPU: silence is no evidence of recovery.
STICKY_ACTIONS = frozenset({"RESET_GPU", "RESTART_BM", "RESTART_VM", "DRAIN_AND_RESET"})

MAX_MESSAGE_CHARS = 1024
MAX_ALLOCATIONS = 64
_ID_HEX = 24


def alert_id(scope: str, hostname: str, device: str, signal: str, anchor: str | int) -> str:
    """Stable fingerprint of an alert (see module doc)."""
    text = f"{scope}|{hostname}|{device}|{signal}|{anchor}"
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:_ID_HEX]


_BUS_CACHE: dict[str, str] = {}


def alert_device_key(bus_id: str | None, fallback: str | None = None) -> str:
    """Canonical PCI bus id (``0000:3b:00.0``) used as the device part of alert keys.

    Kernel-log and NVML forms of one GPU map to the same key. Unparseable text is kept (lower-cased),
    and an empty bus id falls back to ``fallback`` (the UUID).
    """
    if not bus_id:
        return fallback or ""
    hit = _BUS_CACHE.get(bus_id)
    if hit is not None:
        return hit
    try:
        key = pci.canonical(bus_id)
    except ValueError:
        key = bus_id.strip().lower()
    if len(_BUS_CACHE) < 100_000:
        _BUS_CACHE[bus_id] = key
    return key


@dataclass(frozen=True, slots=True)
class Pending:
    """Node-wide evidence (``reboot``, ``driver_load``) at ``since_ms`` that ends the alert once a sample of
    its GPU taken at or after that time shows it healthy (see
    :mod:`gpupipe_consumers.alerts.engine.recovery_policy`)."""

    evidence: str
    since_ms: int
    detail: str
    set_at_ms: int = 0
    """Processing time the alert started waiting (not in the record: a restore restarts the wait)."""
    noted: bool = False
    """The alert already says the GPU was not seen within the wait."""


@dataclass(slots=True)
class Alert:
    """State of one alert. The engine mutates it; :meth:`snapshot` gives an independent copy."""

    alert_id: str
    key: tuple[str, str, str, str]
    """(scope, hostname, device, signal): one open alert per key at a time."""
    scope: str
    alertname: str
    signal: str
    hostname: str
    first_seen_ms: int
    last_seen_ms: int
    severity: str = "warning"
    codes: tuple[int, ...] = ()
    name: str = ""
    description: str = ""
    cause_class: str = "unknown"
    action: str = "UNKNOWN"
    nvidia_action: str | None = None
    drain_node: bool = False
    known: bool = True
    rule: str = ""
    catalog_version: str = ""
    runbook: str = ""
    device: str = ""
    gpu_uuid: str | None = None
    gpu_index: int | None = None
    model_name: str | None = None
    driver_version: str | None = None
    mig_uuid: str | None = None
    gpus: list[str] = field(default_factory=list)
    allocations: list[tuple[str, str, str]] = field(default_factory=list)
    occurrences: int = 0
    first_event_id: str | None = None
    last_event_id: str | None = None
    message: str = ""
    parent_alert_id: str | None = None
    status: str = "firing"
    sequence: int = 0
    resolved_at_ms: int | None = None
    resolve_reason: str | None = None
    boot_id: str | None = None
    """The node's boot id when the fault was first reported with one (a later boot id: it rebooted)."""
    pending: Pending | None = None
    """Node-wide evidence waiting for a healthy sample of the GPU (``recovery_pending`` in the record)."""
    last_input: tuple[int, int] | None = None
    """(partition, offset) in the XidEvent topic of the latest event counted in this alert
    (``last_event_partition``/``last_event_offset``): after a restart the input is replayed from
    the group's committed offsets, which may lag what the published counts include; an event at or
    before this position in that partition was counted already (see ``EngineFacade.on_xid``)."""
    # -- engine bookkeeping (not in the record) --
    dirty: bool = False
    """Something changed since the last emitted revision."""
    urgent: bool = False
    """The change must be emitted now (new, status, severity/action/drain), not throttled."""
    last_emit_ms: int | None = None
    """Wall time of the last emitted revision."""
    seen_at_ms: int = 0
    """Processing (wall) time of the latest occurrence: quiet periods are measured from it."""

    def snapshot(self) -> Alert:
        return replace(self, gpus=list(self.gpus), allocations=list(self.allocations))

    @property
    def sample_owned(self) -> bool:
        """A level alert only the samples speak for: they refresh it while the condition holds and clear it
        when it ends, so neither quiet time nor reset evidence concerns it. Once an XidEvent spoke for it
        (NVML's recovery-action event, which reports a change once and never repeats it) it is a fault like
        the others: silence is no evidence, recovery evidence ends it."""
        return is_level(self.key[3]) and self.first_event_id is None and self.last_event_id is None

    @property
    def sticky(self) -> bool:
        """A GPU/NVSwitch fault that stays firing until evidence of recovery: quiet time does not end it
        (see :mod:`gpupipe_consumers.alerts.engine.facade`)."""
        if self.scope == "node" or self.sample_owned:
            return False
        if is_level(self.key[3]):
            return True  # raised by an event that will not repeat (see sample_owned)
        return self.drain_node or self.action in STICKY_ACTIONS

    def learn(self, message: str, allocations: Any) -> bool:
        """The first message and any new containers an occurrence names; True if the alert changed."""
        changed = False
        if not self.message and message:
            self.message = message
            changed = True
        return self.add_allocations(allocations) or changed

    def add_allocations(self, allocations: Any) -> bool:
        """Append containers not seen yet (first ones stay first); True if any was added."""
        added = False
        have = set(self.allocations)
        for a in allocations or ():
            if len(self.allocations) >= MAX_ALLOCATIONS:
                break
            try:
                item = (str(a["namespace"]), str(a["pod"]), str(a.get("container") or ""))
            except (KeyError, TypeError, AttributeError):
                continue
            if item not in have:
                have.add(item)
                self.allocations.append(item)
                added = True
        return added

    def add_gpu(self, gpu: str) -> bool:
        if gpu and gpu not in self.gpus:
            self.gpus.append(gpu)
            return True
        return False


@cache
def _symbols(enum_name: str) -> frozenset[str]:
    def walk(node: Any) -> list[str] | None:
        if isinstance(node, dict):
            if node.get("type") == "enum" and node.get("name") == enum_name:
                return list(node["symbols"])
            for v in node.values():
                found = walk(v)
                if found is not None:
                    return found
        elif isinstance(node, list):
            for v in node:
                found = walk(v)
                if found is not None:
                    return found
        return None

    found = walk(schema_catalog.current("GpuAlert").raw)
    if found is None:  # pragma: no cover - schema file and code shipped together
        raise RuntimeError(f"GpuAlert schema has no enum {enum_name}")
    return frozenset(found)


def _enum(enum_name: str, value: str | None, default: str) -> str:
    return value if value in _symbols(enum_name) else default


def _gpu_label(alert: Alert) -> str:
    return alert.gpu_uuid or alert.device


def _summary(a: Alert) -> str:
    where = a.hostname
    if a.scope == "gpu":
        idx = f"GPU {a.gpu_index} " if a.gpu_index is not None else "GPU "
        where = f"{idx}({_gpu_label(a)}) on {a.hostname}"
    elif a.scope == "nvswitch":
        where = f"NVSwitch {a.device} on {a.hostname}"
    times = f", {a.occurrences} occurrences" if a.occurrences > 1 else ""
    if a.signal in ("xid", "sxid"):
        label = "SXid" if a.signal == "sxid" else "XID"
        code = a.codes[0] if a.codes else "?"
        what = f"{label} {code} {a.name}"
    elif a.signal == "node_burst":
        codes = ", ".join(str(c) for c in a.codes)
        what = f"XID burst on {len(a.gpus)} GPUs (XID {codes})"
    else:
        what = a.name
    act = f"; action {a.action}" + ("; drain the node" if a.drain_node else "")
    return f"{a.severity.upper()}: {what} on {where}{times}{act}"


def to_record(alert: Alert, emitted_at_ms: int, instance: str = "") -> dict[str, Any]:
    """The ``GpuAlert`` dict for the alert's current state."""
    a = alert
    allocations = [{"namespace": n, "pod": p, "container": c} for n, p, c in a.allocations]
    return {
        "alert_id": a.alert_id,
        "status": a.status,
        "sequence": a.sequence,
        "scope": a.scope,
        "alertname": a.alertname,
        "signal": a.signal,
        "severity": _enum("AlertSeverity", a.severity, "warning"),
        "xid_codes": list(a.codes),
        "name": a.name,
        "summary": _summary(a),
        "description": a.description,
        "cause_class": _enum("AlertCauseClass", a.cause_class, "unknown"),
        "action": _enum("RecommendedAction", a.action, "UNKNOWN"),
        "nvidia_action": None
        if a.nvidia_action is None
        else _enum("RecommendedAction", a.nvidia_action, "UNKNOWN"),
        "drain_node": a.drain_node,
        "known": a.known,
        "rule": a.rule,
        "catalog_version": a.catalog_version,
        "hostname": a.hostname,
        "gpu_uuid": a.gpu_uuid,
        "gpu_index": a.gpu_index,
        "pci_bus_id": a.device or None,
        "model_name": a.model_name,
        "driver_version": a.driver_version,
        "mig_uuid": a.mig_uuid,
        "gpus": list(a.gpus),
        "allocations": allocations,
        "namespaces": sorted({n for n, _, _ in a.allocations}),
        "first_seen_ms": a.first_seen_ms,
        "last_seen_ms": a.last_seen_ms,
        "occurrences": a.occurrences,
        "first_event_id": a.first_event_id,
        "last_event_id": a.last_event_id,
        "message": a.message[:MAX_MESSAGE_CHARS],
        "runbook": a.runbook,
        "parent_alert_id": a.parent_alert_id,
        "emitted_at_ms": emitted_at_ms,
        "resolved_at_ms": a.resolved_at_ms,
        "resolve_reason": a.resolve_reason,
        "remediation": None,
        "instance": instance,
        "boot_id": a.boot_id,
        "last_event_partition": None if a.last_input is None else a.last_input[0],
        "last_event_offset": None if a.last_input is None else a.last_input[1],
        "recovery_pending": None
        if a.pending is None
        else {"evidence": a.pending.evidence, "since_ms": a.pending.since_ms, "detail": a.pending.detail},
    }


def action_record(
    record: dict[str, Any],
    *,
    outcome: str,
    node: str,
    dry_run: bool,
    detail: str,
    at_ms: int,
    kind: str = "cordon",
) -> dict[str, Any]:
    """A status ``action`` record: the alert record as it was, plus what was done about it."""
    out = dict(record)
    out["status"] = "action"
    out["emitted_at_ms"] = at_ms
    out["remediation"] = {
        "kind": _enum("RemediationKind", kind, "unknown"),
        "outcome": _enum("RemediationOutcome", outcome, "unknown"),
        "node": node,
        "dry_run": dry_run,
        "detail": detail,
        "at_ms": at_ms,
    }
    return out


def alert_from_record(rec: dict[str, Any]) -> Alert:
    """Rebuild engine state from a ``GpuAlert`` record (restore after a restart)."""
    scope = rec.get("scope") or "gpu"
    device = rec.get("pci_bus_id") or ""
    a = Alert(
        alert_id=rec["alert_id"],
        key=(scope, rec["hostname"], device, _key_signal(rec)),
        scope=scope,
        alertname=rec.get("alertname", ""),
        signal=rec.get("signal", ""),
        hostname=rec["hostname"],
        first_seen_ms=int(rec["first_seen_ms"]),
        last_seen_ms=int(rec["last_seen_ms"]),
        severity=rec.get("severity", "warning"),
        codes=tuple(rec.get("xid_codes") or ()),
        name=rec.get("name", ""),
        description=rec.get("description", ""),
        cause_class=rec.get("cause_class", "unknown"),
        action=rec.get("action", "UNKNOWN"),
        nvidia_action=rec.get("nvidia_action"),
        drain_node=bool(rec.get("drain_node")),
        known=bool(rec.get("known", True)),
        rule=rec.get("rule", ""),
        catalog_version=rec.get("catalog_version", ""),
        runbook=rec.get("runbook", ""),
        device=device,
        gpu_uuid=rec.get("gpu_uuid"),
        gpu_index=rec.get("gpu_index"),
        model_name=rec.get("model_name"),
        driver_version=rec.get("driver_version"),
        mig_uuid=rec.get("mig_uuid"),
        gpus=list(rec.get("gpus") or ()),
        occurrences=int(rec.get("occurrences") or 0),
        first_event_id=rec.get("first_event_id"),
        last_event_id=rec.get("last_event_id"),
        message=rec.get("message", ""),
        parent_alert_id=rec.get("parent_alert_id"),
        status=rec.get("status", "firing"),
        sequence=int(rec.get("sequence") or 0),
        resolved_at_ms=rec.get("resolved_at_ms"),
        resolve_reason=rec.get("resolve_reason"),
        last_emit_ms=rec.get("emitted_at_ms"),
        boot_id=rec.get("boot_id"),
        pending=_pending(rec.get("recovery_pending")),
        last_input=_position(rec.get("last_event_partition"), rec.get("last_event_offset")),
    )
    a.add_allocations(rec.get("allocations") or ())
    return a


def _position(partition: Any, offset: Any) -> tuple[int, int] | None:
    if not isinstance(partition, int) or not isinstance(offset, int):
        return None
    return (partition, offset)


def _pending(raw: Any) -> Pending | None:
    if not isinstance(raw, dict) or raw.get("evidence") not in ("reboot", "driver_load"):
        return None
    return Pending(str(raw["evidence"]), int(raw["since_ms"]), str(raw.get("detail") or ""))


# One uncorrectable memory fault shows up as several XIDs: 48 (DBE) with its DRAM/SRAM qualifiers 171/172,
# and 94/95 (contained/uncontained ECC) on newer GPUs. They are one incident: one alert keyed as 48.
MEMORY_FAULT_CODES = frozenset({48, 171, 172, 94, 95})


def signal_code(code: int) -> int:
    """The code an XID is keyed under: its own, or 48 for the codes of one memory fault."""
    return 48 if code in MEMORY_FAULT_CODES else code


def _key_signal(rec: dict[str, Any]) -> str:
    """The signal part of an alert key: ``xid:<code>`` / ``sxid:<code>`` for faults, else the signal."""
    signal = rec.get("signal", "")
    if signal in ("xid", "sxid"):
        codes = rec.get("xid_codes") or [0]
        return f"{signal}:{signal_code(codes[0]) if signal == 'xid' else codes[0]}"
    return signal
