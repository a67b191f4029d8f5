"""Classifier rule for Xid 144-150 (NVLink5, WORKFLOW_NVLINK5_ERR): NVIDIA's decode sheet, row by row.

The registers of the line are decoded with :mod:`gpupipe_consumers.alerts.rules.nvlink5_decode`; the row's
immediate bucket decides, and its investigatory bucket goes into the text and runbook:

Rules and reasons in full: docs/alerts.md, "Module notes", ``rules/nvlink5.py``.
"""

from __future__ import annotations

from gpupipe_consumers.alerts.rules.catalog import Action, CauseClass, Severity
from gpupipe_consumers.alerts.rules.classify_ctx import _RUNBOOK, _Ctx, _fmt_ms
from gpupipe_consumers.alerts.rules.classify_model import DAY_MS, Classification
from gpupipe_consumers.alerts.rules.gsp import _follow_154, _latest_154
from gpupipe_consumers.alerts.rules.nvlink5_decode import Nvlink5Decode, decode_nvlink5
from gpupipe_consumers.alerts.rules.parsers import Nvlink5Error, parse_nvlink5

__all__ = ["INVESTIGATE", "_nvlink5"]

#: The sheet's investigatory buckets, as its "Guidance Class" definitions put them (shortened).
INVESTIGATE = {
    "IGNORE": "",
    "CONTACT_SUPPORT": "if it recurs, contact NVIDIA support",
    "SYMPATHETIC_REPORT_SOLO": "usually a consequence of another fault: handle that one first; report the "
    "issue if it was seen alone",
    "REPORT_ISSUE (if seen >1 per day)": "report the issue if it is seen more than once a day",
    "INVESTIGATE_LINK_SI": "check the link's signal integrity (access/trunk link telemetry, GB200 "
    "resiliency service flow)",
    "INVESTIGATE_LINK_SI_AND_CABLES": "cable, temperature, transceiver or seating: check the link's "
    "telemetry and its cables",
    "INVESTIGATE_SW_USER": "software or a user took the link down: investigate if that was not expected",
    "INVESTIGATE_SW/USER": "software or a user took the link down: investigate if that was not expected",
    "INVESTIGATE_SW_USER_LINK_SI": "software or a user took the link down: investigate if that was not "
    "expected, then the link's signal integrity",
    "INVESTIGATE_HOST": "check the host's other logs: likely a secondary indicator of a host action or "
    "fault (possibly out of band)",
    "INVESTIGATE_PEER_DEVICE": "the device at the other end of the link took it down: investigate the peer "
    "(its own Xid/SXid, its software, users, cooling, resets)",
    "CHECK_NVLINK_FAILURE_FLOW": "if a link of the partition went down in the 30 s before, this is a "
    "by-product of that; otherwise report the issue",
}


def _registers(e: Nvlink5Error) -> str:
    status = "" if e.error_status is None else f", error status {e.error_status:#010x}"
    return f"IntrInfo {e.intr_info:#010x}{status}" if e.intr_info is not None else "no registers"


def _investigate(ctx: _Ctx, d: Nvlink5Decode) -> str:
    text = INVESTIGATE.get(d.investigatory, d.investigatory)
    if d.investigatory.startswith("REPORT_ISSUE"):
        seen = len(ctx.before([ctx.code], DAY_MS))
        text += f" ({seen} earlier on this GPU in the last {_fmt_ms(DAY_MS)})"
    return text


def _decoded(ctx: _Ctx, e: Nvlink5Error, d: Nvlink5Decode, head: str) -> Classification:
    bucket = d.action + (" (Action 2)" if d.action2 else "")
    why = f"{head} ({_registers(e)}); [CAT] 'XID 144-150 Decode' {d.describe()}: {bucket}"
    hint = _investigate(ctx, d)
    why_inv = f"{why}, investigate {d.investigatory}" if d.investigatory != "IGNORE" else why
    if d.action == "XID_154_EVAL":
        linked = _latest_154(ctx)
        if linked is not None:
            return _follow_154(ctx, linked[1], "nvlink5.follow_154", why)
        return ctx.result(
            "nvlink5.xid154_eval",
            f"{why_inv}; XID_154_EVAL with no Xid 154 on this GPU: RESTART_APP (the job may have been "
            "stopped with Xid 45).",
            action=Action.RESTART_APP,
            severity=Severity.WARNING,
            drain=False,
            runbook="Restart the affected job. If an Xid 154 follows, do what it says."
            + (f" Then: {hint}." if hint else ""),
        )
    if d.action == "IGNORE":
        return ctx.result(
            "nvlink5.decoded",
            f"{why_inv}: no recovery action needed.",
            action=Action.IGNORE,
            severity=Severity.INFO,
            drain=False,
            runbook=_RUNBOOK[Action.IGNORE] + (f" If it is unexpected or repeats: {hint}." if hint else ""),
        )
    if d.peer_at_fault:
        return ctx.result(
            "nvlink5.peer_device",
            f"{why_inv}: the peer device at the other end of link {e.link:02d} is the source of this link "
            "fatal, not this GPU. This GPU needs a reset to bring the link back once its jobs are done "
            "(a link fatal puts it in 'drain and reset recommended'); draining this node does not fix the "
            "peer.",
            action=Action.RESET_GPU,
            severity=Severity.WARNING,
            drain=False,
            cause=CauseClass.NVLINK_FABRIC,
            runbook=f"Do not cordon this node for this alert. Find the peer of link {e.link:02d} (the "
            "NVSwitch port or GPU at the other end) and handle its fault: " + hint + ". Reset this GPU "
            "(nvidia-smi -r -i <gpu>) when its jobs have finished; reboot if the reset fails.",
        )
    fatal = "GPU fatal: every link goes down" if d.severity.startswith("Fatal") else "link fatal"
    return ctx.result(
        "nvlink5.decoded",
        f"{why_inv} ({fatal}).",
        action=Action.RESET_GPU,
        severity=Severity.CRITICAL,
        drain=True,
        cause=CauseClass.NVLINK_FABRIC,
        runbook=_RUNBOOK[Action.RESET_GPU] + (f" Then: {hint}." if hint else ""),
    )


def _undecoded(ctx: _Ctx, e: Nvlink5Error, head: str) -> Classification:
    """The line's bits match no row: the Fatal/Nonfatal word stands, flagged as not decoded."""
    what = (
        f"{head} ({_registers(e)}): not in NVIDIA's 'XID 144-150 Decode' sheet, so graded by the "
        f"{'Fatal' if e.fatal else 'Nonfatal'} word of the line (undecoded)"
    )
    if e.fatal:
        return ctx.result(
            "nvlink5.undecoded_fatal",
            f"{what}: the sheet's Fatal and Link Fatal rows resolve to RESET_GPU.",
            action=Action.RESET_GPU,
            severity=Severity.CRITICAL,
            drain=True,
            cause=CauseClass.NVLINK_FABRIC,
            runbook=_RUNBOOK[Action.RESET_GPU] + " Check the peer device and the link (cables, trays) if it "
            "recurs; report the undecoded registers to NVIDIA.",
        )
    linked = _latest_154(ctx)
    if linked is not None:
        return _follow_154(ctx, linked[1], "nvlink5.follow_154", what)
    if e.unit in ("RLW_REMAP", "RLW_SRC_TRACK"):
        return ctx.result(
            "nvlink5.undecoded_eval",
            f"{what}; this unit's non-fatal rows are XID_154_EVAL and there is no Xid 154 on this GPU: "
            "RESTART_APP.",
            action=Action.RESTART_APP,
            severity=Severity.WARNING,
            drain=False,
            runbook="Restart the affected job. If an Xid 154 follows, do what it says.",
        )
    return ctx.result(
        "nvlink5.undecoded_nonfatal",
        f"{what}: the sheet's non-fatal rows resolve to IGNORE.",
        action=Action.IGNORE,
        severity=Severity.INFO,
        drain=False,
        runbook="No action. If it repeats on the same link, check the link's signal integrity, cables and "
        "seating.",
    )


def _nvlink5(ctx: _Ctx) -> Classification:
    """Xid 144-150, WORKFLOW_NVLINK5_ERR [CAT]: see the module doc."""
    parsed = parse_nvlink5(ctx.event.message)
    if parsed is None:
        linked = _latest_154(ctx)
        if linked is not None:
            return _follow_154(ctx, linked[1], "nvlink5.follow_154", f"{ctx.label()} (message not decoded)")
        return ctx.result(
            "nvlink5.undecoded",
            f"{ctx.label()}: could not read the sub-unit and Fatal/Nonfatal fields from the message; decode "
            "IntrInfo/ErrorStatus with the catalog's 'XID 144-150 Decode' sheet. An Xid 154 will state the "
            "required recovery if there is one.",
        )
    head = f"{ctx.label()}: {parsed.unit} {'Fatal' if parsed.fatal else 'Nonfatal'} on link {parsed.link:02d}"
    decoded = decode_nvlink5(
        ctx.code,
        parsed.unit,
        parsed.intr_info,
        parsed.error_status,
        driver_version=ctx.event.driver_version,
    )
    if decoded is None:
        return _undecoded(ctx, parsed, head)
    return _decoded(ctx, parsed, decoded, head)
