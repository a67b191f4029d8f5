"""A ``GpuAlert`` record as Alertmanager sees it: labels, annotations, and the sender's state.

Labels hold only what defines the incident (stable while it is open, so nothing is sent resolved by
mistake); what changes or is learnt later is an annotation. docs/alerts.md has the mapping.
"""

from __future__ import annotations

from typing import Any

from gpupipe.clients.alertmanager import AmState, iso_ms

__all__ = ["am_annotations", "am_labels", "gpu_alert_shape"]


def am_labels(rec: dict[str, Any]) -> dict[str, str]:
    """Alertmanager labels of a record: its identity there, stable for the incident (see module doc)."""
    labels = {
        "alertname": rec["alertname"],
        "severity": rec["severity"],
        "node": rec["hostname"],
        "cause_class": rec["cause_class"],
        "scope": rec["scope"],
        "source": "gpupipe",
    }
    if rec["scope"] != "node" and rec["xid_codes"]:
        labels["xid"] = str(rec["xid_codes"][0])
    if rec.get("pci_bus_id"):
        labels["pci_bus_id"] = rec["pci_bus_id"]
    if rec["signal"].startswith("nvlink_link:"):  # one alert per NVLink link of the GPU
        labels["nvlink_link"] = rec["signal"].split(":", 1)[1]
    # Senders whose alert is defined by more than the GPU (an idle recommendation is one pod's) name
    # those labels themselves; they must be as stable as the alert.
    labels.update(rec.get("identity_labels") or {})
    return labels


def am_annotations(rec: dict[str, Any]) -> dict[str, str]:
    pods = ", ".join(f"{a['namespace']}/{a['pod']}" for a in rec.get("allocations") or ())
    out = {
        "summary": rec["summary"],
        "description": rec["description"],
        "runbook": rec["runbook"],
        "alert_id": rec["alert_id"],
        "occurrences": str(rec["occurrences"]),
        "first_seen": iso_ms(rec["first_seen_ms"]),
        "drain_node": "true" if rec["drain_node"] else "false",
        "catalog_version": rec.get("catalog_version", ""),
        "action": rec.get("action", ""),
        "gpu_uuid": rec.get("gpu_uuid") or "",
        "gpu": "" if rec.get("gpu_index") is None else str(rec["gpu_index"]),
    }
    allocations = rec.get("allocations") or ()
    if allocations and rec["scope"] != "node":
        out["namespace"] = allocations[0]["namespace"]
        out["pod"] = allocations[0]["pod"]
    if rec["xid_codes"]:
        out["xid_codes"] = ",".join(str(c) for c in rec["xid_codes"])
    if pods:
        out["pods"] = pods
    if rec.get("gpus") and (rec["scope"] == "node" or rec["signal"].startswith("nvlink_link:")):
        out["gpus"] = ", ".join(rec["gpus"])
    if rec.get("parent_alert_id"):
        out["parent_alert_id"] = rec["parent_alert_id"]
    return {k: v for k, v in out.items() if v}


def gpu_alert_shape(rec: dict[str, Any]) -> AmState:
    """A GpuAlert record as the Alertmanager sender keeps it."""
    return AmState(
        rec["alert_id"],
        rec["status"],
        am_labels(rec),
        am_annotations(rec),
        rec["first_seen_ms"],
        rec.get("resolved_at_ms"),
        keep_earlier=True,
    )
