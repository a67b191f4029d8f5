"""Classifier rules for NVML's notice events: the GPU's recovery action and "GPU unavailable" (no XID).

Rules and reasons in full: docs/alerts.md, "Module notes", ``rules/notice.py``.
"""

from __future__ import annotations

from gpupipe_consumers.alerts.rules.catalog import Action, CauseClass, Severity
from gpupipe_consumers.alerts.rules.classify_ctx import _RECOVERY_DEFAULTS, _RUNBOOK
from gpupipe_consumers.alerts.rules.classify_model import Classification, FaultEvent
from gpupipe_consumers.alerts.rules.parsers import (
    RECOVERY_ACTION_NAMES,
    parse_recovery_event,
    recovery_action_from_nvml,
)

__all__ = [
    "NOTICE_KINDS",
    "RECOVERY_ACTION_NAME",
    "UNAVAILABLE_NAME",
    "classify_notice",
    "recovery_decision",
    "recovery_name",
    "recovery_runbook",
]

NOTICE_KINDS = frozenset({"recovery_action", "gpu_unavailable"})
RECOVERY_ACTION_NAME = "GPU_RECOVERY_ACTION"  # the sampled signal's name too (health_signals.SIGNAL_INFO)
UNAVAILABLE_NAME = "GPU_UNAVAILABLE"
_VALUE_NAMES = {v: k for k, v in RECOVERY_ACTION_NAMES.items()}
_UNMAPPED_RUNBOOK = (
    "NVML reports a recovery action this consumer has no bucket for (e.g. RECOVER_IMEX_DOMAIN on a "
    "multi-node NVLink system, or a value newer than this release): read NVIDIA's documentation for the "
    "value and do what it says; contact support if unsure."
)
_UNAVAILABLE_RUNBOOK = (
    "The GPU cannot run work until it is reset: cordon and drain the node (or stop every process on this "
    "GPU), reset it with nvidia-smi -r -i <gpu>, reboot the node if the reset fails. If it becomes "
    "unavailable again after the reset, run field diagnostics and open an RMA case."
)


def recovery_decision(value: int | None) -> tuple[Action, Severity, bool]:
    """(action, severity, drain) for an ``nvmlGpuRecoveryAction_t`` value; unmapped or unknown values get
    the safe default (CONTACT_SUPPORT, warning, no drain); 0 (NONE) is IGNORE / info."""
    action = recovery_action_from_nvml(value) if value is not None else None
    if action is None:
        return Action.CONTACT_SUPPORT, Severity.WARNING, False
    severity, drain = _RECOVERY_DEFAULTS.get(action, (Severity.WARNING, False))
    return action, severity, drain


def recovery_name(value: int | None) -> str:
    """The ``nvmlGpuRecoveryAction_t`` name of ``value`` (``BUS_RESET``), ``UNKNOWN`` if it has none."""
    return _VALUE_NAMES.get(value, "UNKNOWN") if value is not None else "UNKNOWN"


def recovery_runbook(value: int | None) -> str:
    """What the operator does for a recovery-action value (a bus reset and a reboot read differently)."""
    return _RUNBOOK.get(recovery_decision(value)[0], _UNMAPPED_RUNBOOK)


def _recovery(event: FaultEvent) -> Classification:
    value = parse_recovery_event(event.message)
    action, severity, drain = recovery_decision(value)
    name = recovery_name(value)
    what = f"{name} ({value})" if value is not None else "an unreadable value"
    if value == 0:
        rule = "nvml_event.recovery_action_none"
        reason = (
            "NVML's recovery-action event says NONE (0): the GPU needs no recovery action any more "
            "(evidence of recovery)."
        )
    elif action is Action.CONTACT_SUPPORT:
        rule = "nvml_event.recovery_action_unmapped"
        reason = f"NVML's recovery-action event says {what}, which has no action bucket here: safe default."
    else:
        rule = "nvml_event.recovery_action"
        reason = (
            f"NVML's recovery-action event: the driver requires {what} on this GPU ([MEM] recovery action "
            f"flag): {action.value}."
        )
    return Classification(
        codes=(),
        kind=event.kind,
        name=RECOVERY_ACTION_NAME,
        severity=severity,
        cause_class=CauseClass.HARDWARE_MEMORY,
        action=action,
        nvidia_action=None,
        drain_node=drain,
        reason=reason,
        runbook=recovery_runbook(value),
        known=value in _VALUE_NAMES,
        rule=rule,
    )


def _unavailable(event: FaultEvent) -> Classification:
    said = f" ({event.message})" if event.message else ""
    return Classification(
        codes=(),
        kind=event.kind,
        name=UNAVAILABLE_NAME,
        severity=Severity.CRITICAL,
        cause_class=CauseClass.HARDWARE_MEMORY,
        action=Action.RESET_GPU,
        nvidia_action=None,
        drain_node=True,
        reason=f"NVML reports the GPU unavailable{said}: it cannot run work until it is reset or the node "
        "rebooted.",
        runbook=_UNAVAILABLE_RUNBOOK,
        known=True,
        rule="nvml_event.gpu_unavailable",
    )


def classify_notice(event: FaultEvent) -> Classification:
    """Classify a ``recovery_action`` or ``gpu_unavailable`` event (see module doc)."""
    if event.kind == "recovery_action":
        return _recovery(event)
    if event.kind == "gpu_unavailable":
        return _unavailable(event)
    raise ValueError(f"not an NVML notice kind: {event.kind!r}")
