"""Classifier rules for memory faults: Xid 48/171/172 (WORKFLOW_XID_48), 63, 64 and 94/95 containment."""

from __future__ import annotations

import re
from typing import Any

from gpupipe_consumers.alerts.rules.catalog import (
    Action,
    CauseClass,
    Severity,
)
from gpupipe_consumers.alerts.rules.classify_ctx import (
    _RUNBOOK,
    _Ctx,
    _fmt_ms,
    _who,
)
from gpupipe_consumers.alerts.rules.classify_model import (
    Classification,
    GpuHealth,
)
from gpupipe_consumers.alerts.rules.parsers import (
    parse_containment,
)


def _remap_state(health: GpuHealth) -> str:
    parts = []
    if health.remap_pending is not None:
        parts.append(f"remap pending={'yes' if health.remap_pending else 'no'}")
    if health.remap_failure is not None:
        parts.append(f"remap failure={'yes' if health.remap_failure else 'no'}")
    if health.uncorrectable_remapped_rows is not None:
        parts.append(f"{health.uncorrectable_remapped_rows} rows remapped for uncorrectable errors")
    return "; ".join(parts) if parts else "row-remapper state unknown"


_RMA_RUNBOOK = (
    "Cordon and drain the node and keep this GPU out of service: the row-remap failure flag means the GPU "
    "has run out of spare rows or failed to remap (NVIDIA RMA policy). Collect nvidia-bug-report.sh and "
    "nvidia-smi -q -d ROW_REMAPPER,ECC output and open an RMA/support case."
)
_DBE_CODES = (48, 171, 172)


def _ecc_dbe(ctx: _Ctx) -> Classification:
    """Xid 48 (and its detail lines 171/172), WORKFLOW_XID_48 [CAT] with row-remapper state [MEM].

    Solo -> RESET_GPU; with Xid 63 or 64 (within ``correlation_window_ms``) -> DRAIN_AND_RESET. The
    remap-pending flag means the remap happens at the next reset [MEM], which is the same outcome as
    "with 63". Remap failure (flag or Xid 64 with the flag) -> RMA (CONTACT_SUPPORT). With Xid 172 (the
    SRAM qualifier) -> the SRAM branch: check the SRAM threshold flag (a runbook step: no sample carries
    it), RUN_FIELDDIAG if set. The engine folds 171/172 into the 48 alert: one fault, one alert.
    """
    health = ctx.health
    remap = ctx.around([63, 64], ctx.cfg.correlation_window_ms)
    remap_codes = sorted({r.code for r in remap})
    state = _remap_state(health)
    base = (
        f"{ctx.label()}: uncorrectable ECC error; a GPU reset or node reboot is needed to clear it"
        " ([CAT] Xid 48)"
    )
    common: dict[str, Any] = dict(severity=Severity.CRITICAL, drain=True, cause=CauseClass.HARDWARE_MEMORY)
    if health.remap_failure:
        return ctx.result(
            "ecc.dbe_remap_failure",
            f"{base}; row-remapper reports a remapping failure ({state}): the GPU needs RMA ([MEM] "
            "row-remapping failure flag).",
            action=Action.CONTACT_SUPPORT,
            related=remap_codes,
            runbook=_RMA_RUNBOOK,
            **common,
        )
    if remap_codes or health.remap_pending:
        why = (
            f"with XID {'/'.join(map(str, remap_codes))} on this GPU"
            if remap_codes
            else "with a remap pending"
        )
        return ctx.result(
            "ecc.dbe_with_remap",
            f"{base}; {why} ({state}): drain and reset so the row remap takes effect. [CAT] WORKFLOW_XID_48: "
            "'w/ 63 or 64: DRAIN_AND_RESET'.",
            action=Action.DRAIN_AND_RESET,
            related=remap_codes,
            runbook=_RUNBOOK[Action.DRAIN_AND_RESET]
            + " Afterwards check nvidia-smi -q -d ROW_REMAPPER: pending must be No and failure No.",
            **common,
        )
    sram = ctx.code == 172 or bool(ctx.around([172], ctx.cfg.correlation_window_ms))
    if sram:
        # [CAT] 172 qualifies the 48 as an SRAM error: WORKFLOW_XID_48 "All other SRAM: check SRAM Error
        # Threshold flag ... If set RUN_FIELDDIAG". No sample carries that flag (NVML's
        # nvmlDeviceGetSramEccErrorStatus is not collected), so the check is the runbook's first step.
        return ctx.result(
            "ecc.dbe_sram",
            f"{base}; XID 172 marks it an SRAM (on-chip) error, not DRAM: the row remapper does not apply. "
            "[CAT] WORKFLOW_XID_48 SRAM branch: check the SRAM error threshold flag; if set, RUN_FIELDDIAG.",
            action=Action.RESET_GPU,
            related=[172] if ctx.code != 172 else [],
            runbook="Cordon and drain the node, then check the SRAM error threshold flag (nvidia-smi -q -d "
            "ECC, 'SRAM Threshold Exceeded'; NVML nvmlDeviceGetSramEccErrorStatus): if set, run NVIDIA field "
            "diagnostics and open an RMA case if they fail; if not, reset the GPU (nvidia-smi -r -i <gpu>).",
            **common,
        )
    return ctx.result(
        "ecc.dbe_solo",
        f"{base}; no XID 63/64 on this GPU within {_fmt_ms(ctx.cfg.correlation_window_ms)} ({state}). "
        "[CAT] WORKFLOW_XID_48 solo: RESET_GPU.",
        action=Action.RESET_GPU,
        runbook=_RUNBOOK[Action.RESET_GPU]
        + " Then check nvidia-smi -q -d ROW_REMAPPER,ECC; an SRAM error means checking the SRAM threshold "
        "flag.",
        **common,
    )


def _remap_event(ctx: _Ctx) -> Classification:
    """Xid 63 (row remapping event; catalog IGNORE) in context: [CAT] Xid 63, WORKFLOW_XID_48, [MEM].

    Failure flag -> RMA; with an Xid 48 nearby -> DRAIN_AND_RESET; pending (flag, or the driver's
    "reset gpu to activate" text) -> reset at a convenient time (jobs may keep running [MEM]); else IGNORE.
    """
    health, msg = ctx.health, ctx.event.message
    state = _remap_state(health)
    if health.remap_failure:
        return ctx.result(
            "ecc.remap_failure",
            f"XID 63 (row remapping event) and the row-remapper reports a remapping failure ({state}): RMA "
            "([MEM] row-remapping failure flag).",
            action=Action.CONTACT_SUPPORT,
            severity=Severity.CRITICAL,
            drain=True,
            runbook=_RMA_RUNBOOK,
        )
    dbe = ctx.around(_DBE_CODES, ctx.cfg.correlation_window_ms)
    if dbe:
        codes = sorted({r.code for r in dbe})
        return ctx.result(
            "ecc.remap_with_dbe",
            f"XID 63 (row remapping event) with XID {'/'.join(map(str, codes))} (uncorrectable ECC) on this "
            f"GPU within {_fmt_ms(ctx.cfg.correlation_window_ms)} ({state}). [CAT] WORKFLOW_XID_48: 'w/ 63 "
            "or 64: DRAIN_AND_RESET'.",
            action=Action.DRAIN_AND_RESET,
            severity=Severity.CRITICAL,
            drain=True,
            related=codes,
            runbook=_RUNBOOK[Action.DRAIN_AND_RESET],
        )
    pending_text = re.search(r"reset (the )?gpu to activate|pending", msg, re.IGNORECASE) is not None
    if health.remap_pending or (health.remap_pending is None and pending_text):
        source = (
            "row-remapper reports a pending remap"
            if health.remap_pending
            else "the driver says so in the line"
        )
        return ctx.result(
            "ecc.remap_pending",
            "XID 63: a memory row was marked for remapping and takes effect at the next GPU reset "
            f"({source}). Running and new jobs are unaffected until then ([MEM] remapping pending flag).",
            action=Action.RESET_GPU,
            severity=Severity.WARNING,
            drain=False,
            runbook="No urgent action. At the next convenient window drain this GPU and reset it (nvidia-smi "
            "-r) to activate the remap; reset it before migrating a live VM onto it.",
        )
    return ctx.result(
        "ecc.remap_event",
        f"XID 63 (row remapping event), no uncorrectable error nearby ({state}). [CAT] Xid 63: IGNORE.",
    )


def _remap_failure_xid(ctx: _Ctx) -> Classification:
    """Xid 64 (row remapping failure): [CAT] RESET_GPU then CONTACT_SUPPORT; flag confirms RMA [MEM]."""
    health = ctx.health
    state = _remap_state(health)
    if health.remap_failure:
        return ctx.result(
            "ecc.remap_failure",
            f"XID 64 (row remapping failure) and the row-remapper failure flag is set ({state}): the GPU "
            "needs RMA.",
            action=Action.CONTACT_SUPPORT,
            severity=Severity.CRITICAL,
            drain=True,
            runbook=_RMA_RUNBOOK,
        )
    dbe = ctx.around(_DBE_CODES, ctx.cfg.correlation_window_ms)
    if dbe:
        codes = sorted({r.code for r in dbe})
        return ctx.result(
            "ecc.remap_failure_with_dbe",
            f"XID 64 (row remapping failure) with XID {'/'.join(map(str, codes))} on this GPU ({state}). "
            "[CAT] WORKFLOW_XID_48: 'w/ 63 or 64: DRAIN_AND_RESET'; then check the remap failure flag (RMA "
            "if set).",
            action=Action.DRAIN_AND_RESET,
            severity=Severity.CRITICAL,
            drain=True,
            related=codes,
        )
    return ctx.result(
        "ecc.remap_failure_xid",
        f"XID 64 (row remapping failure) ({state}). [CAT] Xid 64: RESET_GPU, then CONTACT_SUPPORT.",
        action=Action.RESET_GPU,
    )


def _containment(ctx: _Ctx) -> Classification:
    """Xid 94/95 (error containment): [CAT] 94 RESTART_APP, 95 RESET_GPU; the line's flags refine it.

    [SRC] the body ends with ``RST: <Yes|No>, D-RST: <Yes|No>``, printed from the driver's "GPU reset
    required" / "drain and reset required" flags. D-RST: Yes -> DRAIN_AND_RESET. For 94, RST: Yes ->
    RESET_GPU, but [CAT] says applications can keep running until the reset, so no drain.
    """
    c = parse_containment(ctx.event.message)
    flags = ""
    if c is not None:
        flags = (
            f" ({'contained' if c.contained else 'uncontained'} in {c.unit or 'unknown unit'}; "
            f"RST: {_yn(c.gpu_reset_required)}, D-RST: {_yn(c.drain_and_reset_required)})"
        )
    who = _who(ctx.event.pid, ctx.event.process_name)
    if c is not None and c.drain_and_reset_required:
        return ctx.result(
            f"containment.xid{ctx.code}_drain_and_reset",
            f"XID {ctx.code} from {who}{flags}: the driver asks to drain and reset the GPU (D-RST: Yes).",
            action=Action.DRAIN_AND_RESET,
            severity=Severity.CRITICAL,
            drain=True,
            runbook=_RUNBOOK[Action.DRAIN_AND_RESET],
        )
    if ctx.code == 95:
        return ctx.result(
            "containment.xid95",
            f"XID 95 from {who}{flags}: uncontained memory error affecting several applications; the GPU "
            "must be reset before applications can restart. [CAT] Xid 95: RESET_GPU.",
            action=Action.RESET_GPU,
            severity=Severity.CRITICAL,
            drain=True,
        )
    if c is not None and c.gpu_reset_required:
        return ctx.result(
            "containment.xid94_reset",
            f"XID 94 from {who}{flags}: contained to that application (restart it); the driver flags that "
            "the GPU needs a reset (RST: Yes). Other applications continue until then ([CAT] Xid 94).",
            action=Action.RESET_GPU,
            severity=Severity.WARNING,
            drain=False,
            runbook="Restart the affected job. Reset the GPU (nvidia-smi -r) at the next convenient window "
            "once its jobs have finished; no need to evacuate the node now.",
        )
    return ctx.result(
        "containment.xid94",
        f"XID 94 from {who}{flags}: memory error contained to that application, which must be restarted; "
        "other applications are unaffected. [CAT] Xid 94: RESTART_APP; reset the GPU when convenient.",
        action=Action.RESTART_APP,
        severity=Severity.WARNING,
        drain=False,
    )


def _yn(value: bool | None) -> str:
    return "?" if value is None else ("Yes" if value else "No")
