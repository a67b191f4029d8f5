"""Classifier rules for GSP (Xid 119/120), recovery actions (Xid 154) and NVSwitch SXids."""

from __future__ import annotations

import re
from typing import Any

from gpupipe_consumers.alerts.rules.app import _unknown
from gpupipe_consumers.alerts.rules.catalog import (
    CATALOG_VERSION,
    Action,
    CauseClass,
    Severity,
)
from gpupipe_consumers.alerts.rules.classify_ctx import (
    _RECOVERY_DEFAULTS,
    _RUNBOOK,
    _Ctx,
    _fmt_ms,
    _who,
)
from gpupipe_consumers.alerts.rules.classify_model import (
    _GPU_KINDS,
    Classification,
    XidRecord,
    _ts,
)
from gpupipe_consumers.alerts.rules.parsers import (
    RecoveryChange,
    parse_recovery_action,
)


def _gsp(ctx: _Ctx) -> Classification:
    """Xid 119/120 (GSP RPC timeout / GSP error), [CAT]: "A GPU reset or node power cycle may be needed if
    the error persists. If this problem reoccurs after a power cycle, follow the NVIDIA GPU Debug
    Guidelines". First incident -> RESET_GPU; back after a reset -> RESTART_BM (power cycle); back after
    that -> CONTACT_SUPPORT. Incidents are separated by a reset or reboot seen in the samples (or an
    alert that recovered), not by time: a GSP timeout repeating while the GPU waits for its drain is one
    incident. ``xid_codes`` lists only codes that happened.
    """
    prior, seen = ctx.incidents_across_resets([119, 120])
    related = [c for c in seen if c != ctx.code]
    what = f"{ctx.label()} from {_who(ctx.event.pid, ctx.event.process_name)}: GSP firmware error or timeout"
    common: dict[str, Any] = dict(severity=Severity.CRITICAL, drain=True, cause=CauseClass.DRIVER)
    if prior >= 2:
        return ctx.result(
            "gsp.persistent",
            f"{what}; {prior} earlier incidents on this GPU in the last "
            f"{_fmt_ms(ctx.cfg.recurrence_window_ms)}, each ended by a reset: it persists after resets and "
            "power cycles. [CAT] Xid 119/120: follow NVIDIA's GPU debug guidelines.",
            action=Action.CONTACT_SUPPORT,
            related=related,
            runbook="Keep the node cordoned and drained; collect nvidia-bug-report.sh; check the driver "
            "version against known GSP issues; open a support case.",
            **common,
        )
    if prior == 1:
        return ctx.result(
            "gsp.recurring",
            f"{what}; it came back after a reset that followed an earlier incident: power-cycle the node. "
            "[CAT] Xid 119/120.",
            action=Action.RESTART_BM,
            related=related,
            runbook=_RUNBOOK[Action.RESTART_BM]
            + " If it returns after the power cycle, open a support case.",
            **common,
        )
    return ctx.result(
        "gsp.reset",
        f"{what}. [CAT] Xid 119/120: RESET_GPU; power-cycle the node if it persists.",
        action=Action.RESET_GPU,
        **common,
    )


def _latest_154(ctx: _Ctx) -> tuple[XidRecord, RecoveryChange] | None:
    for r in sorted(ctx.around([154], ctx.cfg.recovery_link_window_ms), key=_ts, reverse=True):
        change = parse_recovery_action(r.message)
        if change is not None and change.action is not None:
            return r, change
    return None


def _follow_154(ctx: _Ctx, change: RecoveryChange, rule: str, head: str) -> Classification:
    assert change.action is not None
    severity, drain = _RECOVERY_DEFAULTS.get(change.action, (Severity.WARNING, False))
    return ctx.result(
        rule,
        f"{head}; XID 154 on this GPU says the recovery action is now "
        f"'{change.to_name or hex(change.to_value)}': follow it ([CAT] XID_154 / XID_154_EVAL).",
        action=change.action,
        severity=severity,
        drain=drain,
        related=[154],
        runbook=_RUNBOOK.get(change.action, ctx.info.runbook),
    )


def _xid154(ctx: _Ctx) -> Classification:
    """Xid 154 (GPU recovery action changed), [CAT]: follow the action the line reports.

    ``... changed from 0x0 (None) to 0x2 (Node Reboot Required)``: None -> IGNORE, Drain P2P -> DRAIN_P2P,
    Drain and Reset -> DRAIN_AND_RESET, GPU Reset Required -> RESET_GPU, Node Reboot Required ->
    RESTART_BM (an unknown text falls back to the NVML value). The Xids it speaks for are those on this
    GPU within ``recovery_link_window_ms``.
    """
    change = parse_recovery_action(ctx.event.message)
    linked = sorted(
        {
            r.code
            for r in ctx.around(None, ctx.cfg.recovery_link_window_ms)
            if r.kind in _GPU_KINDS and r.code != 154
        }
    )
    about = f" (about XID {', '.join(map(str, linked))})" if linked else ""
    if change is None or change.action is None:
        shown = f" '{change.to_name or hex(change.to_value)}'" if change is not None else ""
        return ctx.result(
            "xid154.unreadable",
            f"XID 154{about}: recovery action{shown} could not be read from the message; read the line and "
            "do what it says.",
            related=linked,
        )
    severity, drain = _RECOVERY_DEFAULTS.get(change.action, (Severity.WARNING, False))
    frm = change.from_name or hex(change.from_value)
    to = change.to_name or hex(change.to_value)
    return ctx.result(
        "xid154.recovery_action",
        f"XID 154{about}: the driver changed the GPU's required recovery from '{frm}' to '{to}'. [CAT] "
        "XID_154: follow the reported action.",
        action=change.action,
        severity=severity,
        drain=drain,
        related=linked,
        runbook=_RUNBOOK.get(change.action, ctx.info.runbook)
        + (" Then fix the underlying XID." if change.action is not Action.IGNORE else ""),
    )


_FATAL_WORD = re.compile(r"(?<![-\w])fatal\b", re.IGNORECASE)


def _sxid(ctx: _Ctx) -> Classification:
    """NVSwitch SXid: the catalog row (Fabric Manager guide class and recovery).

    An SXid missing from the catalog gets the safe default, raised to critical with a drain when the
    driver's own line says ``Fatal`` (as in ``SXid (PCI:...): 20034, Fatal, Link 48 ...``).
    """
    info = ctx.info
    if not info.known:
        if _FATAL_WORD.search(ctx.event.message):
            return ctx.result(
                "sxid.unknown_fatal",
                f"SXid {ctx.code} is not in the pinned catalog {CATALOG_VERSION}, and the NVSwitch driver "
                "marks it Fatal: NVLink traffic through this switch is likely broken.",
                severity=Severity.CRITICAL,
                drain=True,
                cause=CauseClass.NVLINK_FABRIC,
            )
        return _unknown(ctx)
    section = {
        "non_fatal": "non-fatal",
        "fatal": "fatal",
        "always_fatal": "always fatal",
        "notable": "notable",
    }
    return ctx.result(
        "sxid.catalog",
        f"SXid {ctx.code} ({info.name}): {section.get(info.fatality, info.fatality)} NVSwitch error per the "
        f"Fabric Manager guide (which gives no action bucket); ours: {info.bucket.value}.",
    )
