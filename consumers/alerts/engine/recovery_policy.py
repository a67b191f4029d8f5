"""Which evidence of recovery ends which alert (pure): the one table every evidence path of the engine uses.

Rules and reasons in full: docs/alerts.md, "Module notes", ``engine/recovery_policy.py``.
"""

from __future__ import annotations

from typing import Any

from gpupipe_consumers.alerts.engine.alert_record import Alert

__all__ = [
    "CLASSES",
    "EVIDENCE_ENDS",
    "GPU_EVIDENCE",
    "NEEDS_SAMPLE",
    "NODE_EVIDENCE",
    "RECOVERY_CLASS",
    "ends",
    "recovery_class",
    "sample_healthy",
]

CLASSES = ("app", "reset", "gone", "reboot", "operator")

#: Recovery class of each recommended action (every ``RecommendedAction`` symbol of the GpuAlert schema).
RECOVERY_CLASS: dict[str, str] = {
    # the GPU is not suspect
    "RESTART_APP": "app",
    "IGNORE": "app",
    "CHECK_UVM": "app",
    "WORKFLOW_XID_45": "app",
    # a GPU reset mends it (the workflows' first step is a reset; the classifier resolves their RMA
    # branches to CONTACT_SUPPORT / RUN_FIELDDIAG when the context shows them)
    "RESET_GPU": "reset",
    "DRAIN_AND_RESET": "reset",
    "DRAIN_P2P": "reset",
    "XID_154": "reset",
    "WORKFLOW_XID_48": "reset",
    "WORKFLOW_NVLINK_ERR": "reset",
    "WORKFLOW_NVLINK5_ERR": "reset",
    "BUS_RESET": "reset",
    # a reboot mends it
    "RESTART_BM": "reboot",
    "RESTART_VM": "reboot",
    "RESTART_FM": "reboot",
    "SYSTEM_REBOOT": "reboot",
    # a person
    "CONTACT_SUPPORT": "operator",
    "RUN_FIELDDIAG": "operator",
    "RUN_DCGMEUD": "operator",
    "CHECK_MECHANICALS": "operator",
    "UPDATE_SWFW": "operator",
    "UNKNOWN": "operator",
}

_ALL = frozenset(CLASSES)

#: Evidence kind -> the recovery classes it ends (see the module doc for the node-wide ones' condition).
EVIDENCE_ENDS: dict[str, frozenset[str]] = {
    "reset": frozenset({"app", "reset", "gone"}),
    "gpu_back": frozenset({"app", "reset", "gone", "reboot"}),
    "driver_load": frozenset({"app", "reset", "gone"}),
    "reboot": frozenset({"app", "reset", "gone", "reboot"}),
    "replaced": _ALL,
    "ack": _ALL,
}

#: Evidence about one GPU (its samples, its NVML events) and about a whole node (its kernel log).
GPU_EVIDENCE = frozenset({"reset", "gpu_back", "replaced"})
NODE_EVIDENCE = frozenset({"driver_load", "reboot"})

#: (evidence, class) pairs only a sample of the GPU can confirm: without samples they end nothing.
NEEDS_SAMPLE = frozenset({("driver_load", "gone")})

# Signals whose alert says the GPU cannot be reached (their class is ``gone`` whatever the action).
_GONE_SIGNALS = frozenset({"gpu_unavailable"})


def recovery_class(a: Alert) -> str:
    """The alert's recovery class (see module doc); unknown actions are ``operator`` (safe)."""
    if a.signal in _GONE_SIGNALS:
        return "gone"
    cls = RECOVERY_CLASS.get(a.action, "operator")
    return "reset" if cls == "app" and a.drain_node else cls


def ends(evidence: str, a: Alert) -> bool:
    """Whether evidence of kind ``evidence`` ends alert ``a`` (its condition aside, see module doc)."""
    return recovery_class(a) in EVIDENCE_ENDS[evidence]


def sample_healthy(sample: dict[str, Any]) -> bool:
    """A whole-GPU sample that shows the GPU working: NVML answers for it, it is not reported lost and
    the driver requires no recovery action. (Its other faults have their own alerts.)"""
    if sample.get("mig") or sample.get("gpu_lost"):
        return False
    action = sample.get("gpu_recovery_action")
    return action is None or action == 0
