"""Classify NVIDIA GPU Operational Events: by their legacy Xid where the catalog knows it, else by category.

GPU Operational Events are a preview (drivers R615/R620): NVIDIA keeps legacy Xid output as the stable
contract for production monitoring, and says "a consumer can act on the category alone when it does
not recognize a specific module event code" (GPU Operational Event Catalog, R620). So:

* an event whose legacy Xid the catalog knows keeps the Xid's classification (rule unchanged);
* otherwise (no legacy Xid, or one newer than the catalog) the *category* decides what kind of fault
  it is and NVML's *severity* how urgent (:func:`category_decision`): FATAL pages (critical),
  RECOVERABLE tickets (warning), CORRECTED and INFORMATIONAL are recorded (info). Only a FATAL memory
  integrity or corruption event drains, because the GPU's state is then suspect until a reset; an
  unknown category gets the catalog's safe default (CONTACT_SUPPORT, no drain). ``known`` stays False:
  the code itself is not understood. The mapping from category to action is ours, read from NVIDIA's
  category descriptions; the categories and severities are in :mod:`gpupipe_schemas.operational_events`.

Pure; :func:`refine` is called where an XidEvent's classification is made.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from gpupipe_consumers.alerts.rules.catalog import Action, CauseClass, Severity
from gpupipe_consumers.alerts.rules.classify_model import Classification
from gpupipe_schemas.operational_events import CATEGORIES, KNOWN_EVENTS, SEVERITIES

__all__ = ["CATEGORY_RULES", "category_decision", "refine"]

FATAL, RECOVERABLE = 40, 30

#: category name -> (cause class, action when FATAL or RECOVERABLE, drain when FATAL, runbook)
CATEGORY_RULES: dict[str, tuple[CauseClass, Action, bool, str]] = {
    "TIMEOUT": (
        CauseClass.DRIVER,
        Action.RESTART_APP,
        False,
        "An operation on the GPU did not complete in time: restart the affected workload; if timeouts "
        "repeat on this GPU, reset it (nvidia-smi -r -i <gpu>) and collect nvidia-bug-report.sh.",
    ),
    "MEMORY_INTEGRITY_ERROR": (
        CauseClass.HARDWARE_MEMORY,
        Action.RESET_GPU,
        True,
        "A data integrity error in GPU memory or cache (ECC, parity, poison): check nvidia-smi -q -d "
        "ECC,ROW_REMAPPER and the GPU's recovery action; reset the GPU when NVIDIA asks for it; repeated "
        "errors: field diagnostics and an RMA case.",
    ),
    "INTERCONNECT_ERROR": (
        CauseClass.BUS,
        Action.CHECK_MECHANICALS,
        False,
        "An error on a link between the GPU and another device (NVLink, PCIe, C2C): check the link "
        "state and counters (nvidia-smi nvlink -s, -q -d PCIE), seating and cables; drain if links go down.",
    ),
    "CORRUPTION_DETECTED": (
        CauseClass.DRIVER,
        Action.RESET_GPU,
        True,
        "The driver detected corrupted driver or device state: drain the GPU's work and reset it; collect "
        "nvidia-bug-report.sh and open a support case if it recurs.",
    ),
    "SECURITY_ERROR": (
        CauseClass.DRIVER,
        Action.CONTACT_SUPPORT,
        False,
        "A security policy violation or authentication failure on the GPU: collect nvidia-bug-report.sh "
        "and the event's contexts, and open a support case.",
    ),
}
_UNKNOWN_RUNBOOK = (
    "A GPU operational event of a category this release does not know: read NVIDIA's event catalog for "
    "the driver version in the event and do what it says; contact support if unsure."
)


def _severity(nvml_severity: int) -> Severity:
    if nvml_severity >= FATAL:
        return Severity.CRITICAL
    if nvml_severity >= RECOVERABLE:
        return Severity.WARNING
    return Severity.INFO


def category_decision(op: Mapping[str, Any], base: Classification) -> Classification:
    """``base`` (the Xid path's decision) replaced by what the event's category and severity say."""
    module = str(op.get("module_signature") or "?")
    code = int(op.get("module_event_code") or 0)
    category_id = int(op.get("category_id") or 0)
    category = CATEGORIES.get(category_id)
    nvml_severity = int(op.get("severity") or 0)
    severity = _severity(nvml_severity)
    known = KNOWN_EVENTS.get((module, code))
    name = f"{module} {code:#06x}" + (f" {known.name}" if known is not None else "")
    label = category or f"category {category_id:#06x}"
    what = f"{name} ({label}, {SEVERITIES.get(nvml_severity, nvml_severity)})"
    legacy = op.get("legacy_xid")
    codes = (int(legacy),) if legacy is not None else ()
    if category is None:
        return replace(
            base,
            codes=codes,
            name=name,
            severity=min(severity, Severity.WARNING, key=_rank),
            cause_class=CauseClass.UNKNOWN,
            action=Action.CONTACT_SUPPORT,
            nvidia_action=None,
            drain_node=False,
            reason=f"GPU operational event {what}: neither the code nor the category is known here.",
            runbook=_UNKNOWN_RUNBOOK,
            known=False,
            rule="operational.unknown_category",
        )
    cause, action, drain_if_fatal, runbook = CATEGORY_RULES[category]
    if "NVLINK" in module.upper() and cause is CauseClass.BUS:
        cause = CauseClass.NVLINK_FABRIC
    if severity is Severity.INFO:
        action, drain = Action.IGNORE, False
    else:
        drain = drain_if_fatal and nvml_severity >= FATAL
    return replace(
        base,
        codes=codes,
        name=name,
        severity=severity,
        cause_class=cause,
        action=action,
        nvidia_action=None,
        drain_node=drain,
        reason=(
            f"GPU operational event {what}: the code is not in this release's catalog, so it is "
            f"classified by its category, as NVIDIA's event catalog allows."
        ),
        runbook=runbook,
        known=False,
        rule=f"operational.category.{category}",
    )


def _rank(s: Severity) -> int:
    return {Severity.INFO: 0, Severity.WARNING: 1, Severity.CRITICAL: 2}[s]


def refine(operational: Mapping[str, Any] | None, result: Classification | None) -> Classification | None:
    """The classification of an XidEvent that may carry an operational event (``None`` passes through:
    the storm path skipped the work). The catalog's decision for a known legacy Xid stands."""
    if operational is None or result is None or result.known:
        return result
    return category_decision(operational, result)
