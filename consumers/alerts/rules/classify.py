"""Context-dependent XID/SXid classification: NVIDIA's catalog plus the workflows it describes.

Pure: no clocks, no I/O. Time is the event's ``ts_ms``; context is a small per-GPU history
(:class:`GpuXidHistory`) and an optional snapshot of the GPU's memory health (:class:`GpuHealth`),
both passed in by the caller.

Rules and reasons in full: docs/alerts.md, "Module notes", ``rules/classify.py``.
"""

from __future__ import annotations

from dataclasses import replace

from gpupipe_consumers.alerts.rules.app import (
    _app_fault,
    _catalog_default,
    _gpu_gone,
    _unknown,
    _xid45,
)
from gpupipe_consumers.alerts.rules.catalog import (
    Action,
    CauseClass,
    Severity,
)
from gpupipe_consumers.alerts.rules.classify_ctx import (
    _ACTION_RANK,
    _RECOVERY_DEFAULTS,
    _RUNBOOK,
    _SEVERITY_RANK,
    _Ctx,
)
from gpupipe_consumers.alerts.rules.classify_model import (
    _NO_HEALTH,
    DEFAULT_CONFIG,
    Classification,
    ClassifyConfig,
    EventKind,
    FaultEvent,
    GpuHealth,
    GpuXidHistory,
    XidRecord,
)
from gpupipe_consumers.alerts.rules.gsp import (
    _gsp,
    _sxid,
    _xid154,
)
from gpupipe_consumers.alerts.rules.link import (
    _nvlink74,
)
from gpupipe_consumers.alerts.rules.memory import (
    _RMA_RUNBOOK,
    _containment,
    _ecc_dbe,
    _remap_event,
    _remap_failure_xid,
)
from gpupipe_consumers.alerts.rules.notice import NOTICE_KINDS, classify_notice
from gpupipe_consumers.alerts.rules.nvlink5 import _nvlink5
from gpupipe_consumers.alerts.rules.parsers import (
    Containment,
    Nvlink5Error,
    NvlinkError,
    RecoveryChange,
    decode_nvlink_registers,
    parse_containment,
    parse_nvlink5,
    parse_nvlink_error,
    parse_recovery_action,
    recovery_action_from_nvml,
)

__all__ = [
    "DEFAULT_CONFIG",
    "Classification",
    "ClassifyConfig",
    "Containment",
    "EventKind",
    "FaultEvent",
    "GpuHealth",
    "GpuXidHistory",
    "Nvlink5Error",
    "NvlinkError",
    "RecoveryChange",
    "XidRecord",
    "classify",
    "decode_nvlink_registers",
    "observe",
    "parse_containment",
    "parse_nvlink5",
    "parse_nvlink_error",
    "parse_recovery_action",
    "recovery_action_from_nvml",
]

_HANDLERS = {
    13: _app_fault,
    31: _app_fault,
    43: _app_fault,
    45: _xid45,
    48: _ecc_dbe,
    171: _ecc_dbe,
    172: _ecc_dbe,
    63: _remap_event,
    64: _remap_failure_xid,
    74: _nvlink74,
    79: _gpu_gone,
    94: _containment,
    95: _containment,
    119: _gsp,
    120: _gsp,
    154: _xid154,
    **dict.fromkeys(range(144, 151), _nvlink5),
}


# ----------------------------------------------------------------------------------- health modifiers


def _apply_remap_failure(ctx: _Ctx, result: Classification) -> Classification:
    """[MEM] row-remapping failure flag: any memory-class fault on such a GPU is an RMA case."""
    if not ctx.health.remap_failure or result.cause_class is not CauseClass.HARDWARE_MEMORY:
        return result
    if result.action is Action.CONTACT_SUPPORT and result.drain_node:
        return result
    return replace(
        result,
        action=Action.CONTACT_SUPPORT,
        severity=Severity.CRITICAL,
        drain_node=True,
        reason=result.reason + " The row-remapper also reports a remapping failure: RMA ([MEM]).",
        runbook=_RMA_RUNBOOK,
        rule=result.rule + "+remap_failure",
    )


def _apply_recovery_action(ctx: _Ctx, result: Classification) -> Classification:
    """NVML's recovery-action field ([MEM] "recovery action flag"): escalate to what the driver requires."""
    value = ctx.health.recovery_action
    if value is None or value == 0:
        return result
    required = recovery_action_from_nvml(value)
    if required is None:
        return replace(result, reason=result.reason + f" (NVML recovery action {value} is not recognised.)")
    sev, drain = _RECOVERY_DEFAULTS.get(required, (Severity.WARNING, False))
    note = f" NVML also reports the GPU's required recovery action as {required.value}."
    escalate = _ACTION_RANK[required] > _ACTION_RANK[result.action]
    return replace(
        result,
        action=required if escalate else result.action,
        severity=sev if _SEVERITY_RANK[sev] > _SEVERITY_RANK[result.severity] else result.severity,
        drain_node=result.drain_node or drain,
        reason=result.reason + note,
        runbook=_RUNBOOK.get(required, result.runbook) if escalate else result.runbook,
        rule=result.rule + "+recovery_action",
    )


# ------------------------------------------------------------------------------------------- public


def classify(
    event: FaultEvent,
    history: GpuXidHistory | None = None,
    health: GpuHealth | None = None,
    config: ClassifyConfig = DEFAULT_CONFIG,
) -> Classification:
    """Classify one fault event given this GPU's recent history and memory health. Pure; never raises
    for a well-formed event (unknown codes get the catalog's safe default, ``known=False``)."""
    if event.kind in NOTICE_KINDS:
        return classify_notice(event)  # NVIDIA's own statement: no catalog row, no health modifier
    ctx = _Ctx(event, history, health if health is not None else _NO_HEALTH, config)
    if event.kind == "sxid":
        return _sxid(ctx)
    if event.kind == "unknown":
        return ctx.result(
            "unknown_kind",
            f"Event of a kind this consumer does not know (code {event.code}): safe default (warning, "
            "CONTACT_SUPPORT, no automatic drain); upgrade the alerts consumer to classify it.",
        )
    handler = _HANDLERS.get(ctx.code, _catalog_default) if ctx.info.known else _unknown
    result = handler(ctx)
    result = _apply_remap_failure(ctx, result)
    return _apply_recovery_action(ctx, result)


def observe(
    event: FaultEvent,
    history: GpuXidHistory,
    health: GpuHealth | None = None,
    config: ClassifyConfig = DEFAULT_CONFIG,
) -> Classification:
    """Classify ``event``, then record it in ``history``."""
    result = classify(event, history, health, config)
    history.record(event)
    return result
