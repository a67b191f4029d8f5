"""Build the XidEvent record of a GPU Operational Event, alone or with its legacy Xid (pure).

Input: an :class:`~gpupipe_producer.xid.operational_merge.Incident` whose ``operational`` is the
watcher's dict (:mod:`gpupipe_producer.nvml.operational`) and whose ``legacy``, when the same incident
also arrived as a legacy Xid, is the Xid merger's output (NVML Xid event, kernel-log line, or both).

* ``kind``: ``xid`` with ``xid`` = the legacy Xid when the event carries one, else ``operational``
  (``xid`` null);
* ``source``: ``nvml_kmsg`` when the kernel-log line was folded in, else ``nvml``;
  ``operational.legacy_sources`` lists the legacy reports folded in (``nvml``, ``kmsg``);
* pid, process name and message come from the kernel line when there is one (the structured record
  has none); otherwise the message names the module, code, category and severity;
* GPU identity from the structured record's UUID (attributed by the watcher), MIG ids from it, else
  from the legacy report; ``timestamp_ms`` is the earliest arrival of the incident's reports;
* ``event_id``: ``hostname|nvml|bus|goe<module>:<code>|timestamp_ms|n<agent seq>``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple, cast

from gpupipe_producer.nvml.records import VENDOR, GpuRef
from gpupipe_producer.xid.events import XidContext, event_id
from gpupipe_producer.xid.operational_merge import Incident, legacy_sources
from gpupipe_schemas.operational_events import SEVERITIES
from gpupipe_schemas.records import OperationalEvent, XidEvent

__all__ = ["operational_message", "operational_xid_event"]


def operational_message(op: Mapping[str, Any]) -> str:
    """A one-line text for a structured event that has no kernel line."""
    category = op.get("category") or f"category {int(op['category_id']):#06x}"
    severity = SEVERITIES.get(int(op["severity"]), f"severity {int(op['severity'])}")
    return (
        f"GPU operational event {op['module_signature']} {int(op['module_event_code']):#06x} "
        f"({category}, {severity})"
    )


class _Gpu(NamedTuple):
    """The GPU an incident happened on, as its reports and the node's inventory say."""

    ref: GpuRef | None
    bus: str
    uuid: str | None
    gpu_index: int | None


def _gpu(ev: Mapping[str, Any], legacy: Mapping[str, Any], ctx: XidContext) -> _Gpu:
    """The structured record's bus, UUID and index, else the legacy report's, else the inventory's."""
    bus_reported = ev.get("pci_bus_id") or legacy.get("nvml_bus_id") or legacy.get("pci_bus_id") or ""
    ref = ctx.gpu_for_bus(bus_reported)
    bus = ref.pci_bus_id if ref is not None and ref.pci_bus_id else bus_reported
    uuid = ev.get("uuid") or legacy.get("uuid") or (ref.uuid if ref is not None else None) or None
    gpu_index = ev.get("gpu_index")
    if gpu_index is None and ref is not None:
        gpu_index = ref.gpu_index
    return _Gpu(ref, bus, uuid, gpu_index)


def _mig(
    ev: Mapping[str, Any], legacy: Mapping[str, Any], uuid: str | None, ctx: XidContext
) -> tuple[Any, Any, str | None]:
    """GPU instance, compute instance and MIG UUID: the structured record's, else the legacy report's;
    the MIG UUID looked up when neither names it."""
    gi = ev.get("gpu_instance_id")
    ci = ev.get("compute_instance_id")
    if gi is None:
        gi, ci = legacy.get("gpu_instance_id"), legacy.get("compute_instance_id")
    mig_uuid = ev.get("mig_uuid") or legacy.get("mig_uuid")
    if mig_uuid is None and uuid and gi is not None and ctx.mig_lookup is not None:
        try:
            mig_uuid = ctx.mig_lookup(uuid, gi, ci)
        except Exception:
            mig_uuid = None
    return gi, ci, mig_uuid


def _first_seen(ev: Mapping[str, Any], legacy: Mapping[str, Any]) -> int:
    """The earliest arrival of the incident's reports (0 when none has a time)."""
    stamps = [t for t in (ev.get("timestamp_ms"), legacy.get("nvml_ts_ms"), legacy.get("kmsg_ts_ms")) if t]
    return int(min(stamps)) if stamps else 0


def _event_id(ev: Mapping[str, Any], op: Mapping[str, Any], ctx: XidContext, bus: str, ts: int) -> str:
    code = f"goe{op['module_signature']}:{int(op['module_event_code']):#06x}"
    eid = event_id(ctx.hostname, "nvml", bus, code, ts)
    if ev.get("nvml_seq") is not None:
        eid += f"|n{int(ev['nvml_seq'])}"
    return eid


def operational_xid_event(incident: Incident, ctx: XidContext) -> XidEvent:
    """The XidEvent record of ``incident`` (which must hold an operational event)."""
    ev = incident.operational
    if ev is None:
        raise ValueError("an incident without an operational event is a legacy record")
    legacy: Mapping[str, Any] = incident.legacy or {}
    op = {**ev["operational"], "legacy_sources": legacy_sources(incident.legacy)}
    xid = op.get("legacy_xid")
    gpu = _gpu(ev, legacy, ctx)
    ref, uuid = gpu.ref, gpu.uuid
    gi, ci, mig_uuid = _mig(ev, legacy, uuid, ctx)
    ts = _first_seen(ev, legacy)
    pid = legacy.get("pid")
    return {
        "event_id": _event_id(ev, op, ctx, gpu.bus, ts),
        "timestamp_ms": ts,
        "hostname": ctx.hostname,
        "kind": "xid" if xid is not None else "operational",
        "xid": int(xid) if xid is not None else None,
        "pci_bus_id": gpu.bus,
        "gpu_index": gpu.gpu_index,
        "uuid": uuid,
        "model_name": (ref.model_name or None) if ref is not None else None,
        "driver_version": ref.driver_version if ref is not None else None,
        "pid": int(pid) if pid is not None else None,
        "process_name": legacy.get("process_name"),
        "message": legacy.get("message") or operational_message(op),
        "gpu_instance_id": gi,
        "compute_instance_id": ci if gi is not None else None,
        "mig_uuid": mig_uuid,
        "source": "nvml_kmsg" if "kmsg" in op["legacy_sources"] else "nvml",
        "vendor": VENDOR,
        "allocations": ctx.allocations(uuid, mig_uuid, ref),
        "operational": cast(OperationalEvent, op),
    }
