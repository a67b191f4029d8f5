"""Context-dependent XID/SXid classification: NVIDIA's catalog plus the workflows it describes.

Pure: no clocks, no I/O. Time is the event's ``ts_ms``; context is a small per-GPU history
(:class:`GpuXidHistory`) and an optional snapshot of the GPU's memory health (:class:`GpuHealth`),
both passed in by the caller.

Typical use in the alerts consumer, one history per GPU UUID::

    history = histories.setdefault(gpu_uuid, GpuXidHistory())
    result = classify(event, history, health)   # then history.record(event)
    # or: result = observe(event, history, health)  (classify, then record)

``classify`` does not mutate the history. It ignores a history record identical to the event being
classified, so recording before or after classifying gives the same answer.

References in docstrings use the tags of ``shared/reference/xid-catalog.md``: [CAT] NVIDIA's Xid
catalog (§1 buckets, §2 table, "Guidance Class" sheet), [MEM] NVIDIA's GPU memory error management
guide, [SRC] the open GPU kernel modules' Xid formats (§4), [NVS] NVSentinel (§3). SXids: NVIDIA
Fabric Manager User Guide, appendix "NVSwitch SXid Errors" (see ``xid_catalog.json``).

Rules (the ``rule`` field of :class:`Classification` names the one that decided):

* ``fallen_off_bus`` / ``gpu_lost`` / ``xid79`` / ``xid79.recurring``: treated as Xid 79.
* ``app_fault.single`` / ``app_fault.repeat_distinct_workloads`` / ``app_fault.xid13_same_tpc_diff_sm``:
  Xid 13/31/43 (WORKFLOW_XID_13/31; a ticket, never a drain; 43 never escalates).
* ``xid45.sympathetic`` / ``xid45.solo``: WORKFLOW_XID_45.
* ``ecc.*``: Xid 48 (and 171/172), 63, 64 with row-remapper state (WORKFLOW_XID_48, [MEM]).
* ``containment.*``: Xid 94/95 with the RST / D-RST flags of the message ([SRC]).
* ``xid74.*``: NVLink register decode (WORKFLOW_NVLINK_ERR).
* ``gsp.*``: Xid 119/120, escalating when they recur.
* ``nvlink5.*``: Xid 144-150 decoded with NVIDIA's 'XID 144-150 Decode' sheet (WORKFLOW_NVLINK5_ERR,
  XID_154_EVAL); ``nvlink5.undecoded*`` where no row matches (the Fatal/Nonfatal word stands).
* ``xid154.*``: recovery action text of Xid 154 (XID_154).
* ``nvml_event.*``: NVML's recovery-action and GPU-unavailable events (no XID code).
* ``sxid.catalog`` / ``sxid.unknown``; ``catalog`` (no workflow: the catalog row as is); ``unknown``.
* Modifiers appended as ``+remap_failure`` and ``+recovery_action`` (from :class:`GpuHealth`).

Layout (one rule family per module; this module dispatches and re-exports the public names):
:mod:`~gpupipe_consumers.alerts.rules.classify_model` (inputs, history, output),
:mod:`~gpupipe_consumers.alerts.rules.parsers`
(message texts), :mod:`~gpupipe_consumers.alerts.rules.classify_ctx` (shared context and ranks),
:mod:`~gpupipe_consumers.alerts.rules.app` (catalog default, 79, 13/31/43, 45),
:mod:`~gpupipe_consumers.alerts.rules.memory`
(48/171/172, 63, 64, 94/95), :mod:`~gpupipe_consumers.alerts.rules.link` (74),
:mod:`~gpupipe_consumers.alerts.rules.nvlink5` (144-150),
:mod:`~gpupipe_consumers.alerts.rules.gsp` (119/120, 154, SXids),
:mod:`~gpupipe_consumers.alerts.rules.notice` (NVML's notice events).
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
