"""Which evidence of recovery ends which alert (pure): the one table every evidence path of the engine uses.

A GPU fault alert that needs a reset, reboot or RMA stays firing until evidence says the fault is over
(silence is no evidence: a broken GPU does not repeat its Xid). Evidence is not all alike: a GPU reset
does not mend a GPU that needs a reboot, and neither a reset nor a reboot replaces a GPU that needs an
RMA. So every alert has a *recovery class* (:func:`recovery_class`, from its action), and every kind of
evidence ends the classes listed in :data:`EVIDENCE_ENDS`:

=============  ==================================================================  ======================
evidence       what shows it                                                       ends classes
=============  ==================================================================  ======================
``reset``      that GPU's samples: volatile ECC or energy counters restarted;      app, reset, gone
               NVML's recovery action back to none (sampled, or NVML's NONE event)
``gpu_back``   that GPU's samples: NVML reports the GPU again after it was lost    app, reset, gone,
                                                                                   reboot
``driver_load``  the node's kernel log: the driver's load line (every GPU          app, reset, gone [*]
               re-initialised)
``reboot``     the node's kernel log: the first event under a new boot id          app, reset, gone,
                                                                                   reboot [*]
``replaced``   a healthy sample with another UUID in the GPU's slot (the board     every class
               was swapped)
``ack``        an operator: ``gpupipe alerts --ack``                               every class
=============  ==================================================================  ======================

Classes (:data:`RECOVERY_CLASS`, by action): ``app`` -- the GPU is not suspect (application and
software faults); ``reset`` -- a GPU reset mends it; ``gone`` -- NVML's GPU-unavailable event: a reset
mends it, but only the GPU answering again shows that it did; ``reboot`` -- it needs a reboot (or the
fabric manager restarted, which a reboot does); ``operator`` -- it needs a person: support case, field
diagnostics, RMA, mechanics, a software update, or an action this release cannot read. A drain alert
whose action would be ``app`` counts as ``reset`` (a drain says the GPU is suspect).

[*] Node-wide evidence says something happened to the node, not that this GPU came back (NVSentinel#155:
the module loads again right after a GPU fell off the bus; a GPU that does not enumerate after a reboot
is silent). So it ends a GPU alert of class reset, gone or reboot only once a sample of *that* GPU taken
at or after the evidence shows it healthy (:func:`sample_healthy`); until then the alert stays firing
with ``recovery_pending`` set, and if no such sample comes within the engine's ``confirm_within_ms`` it
says so. Application-class alerts and NVSwitch alerts (no samples) end at once. Without samples
(``gpupipe alerts --no-health-signals``) nothing could confirm: node-wide evidence ends what the table
says at once, except a ``gone`` alert on a driver load (:data:`NEEDS_SAMPLE`), which then waits for a
reboot, NVML or an operator.

Besides this table: quiet time ends alerts that are not sticky, and a level signal's own clear (the
sample or NVML's event reading normal) ends that signal's alert whatever its class.
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
    # a reboot mends it
    "RESTART_BM": "reboot",
    "RESTART_VM": "reboot",
    "RESTART_FM": "reboot",
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
