"""Classifier rules for interconnect faults: Xid 74 (WORKFLOW_NVLINK_ERR) and 144-150 (NVLink5)."""

from __future__ import annotations

from consumers.alerts.catalog import (
    Action,
    CauseClass,
    Severity,
)
from consumers.alerts.classify_ctx import (
    _RUNBOOK,
    _Ctx,
    _fmt_ms,
)
from consumers.alerts.classify_model import (
    Classification,
)
from consumers.alerts.rules_gsp import (
    _follow_154,
    _latest_154,
)
from consumers.alerts.xid_parsers import (
    Nvlink5Error,
    decode_nvlink_registers,
    parse_nvlink5,
    parse_nvlink_error,
)


def _nvlink74(ctx: _Ctx) -> Classification:
    """Xid 74, WORKFLOW_NVLINK_ERR [CAT]: decode the seven hex registers of the line.

    Per the catalog: first register bits 0/23/30 ignorable; 1/20 (and fourth register 16/17) sympathetic:
    follow the other Xid/SXid, report a bug if solo; fourth register bit 18 needs a fabric reset; ECC/parity
    bits (first 4/5, third 0/1/2/6, fifth 18/19/21/22/24/25/27/28) -> report when seen more than twice on
    the same link; first 8/9/12/16/17/24/28 and marginal SI 21/22 -> check mechanical connections; fifth
    20/23/26/29 = ECC threshold only, continue operation; undocumented bits -> report a bug. Without
    registers, [CAT] Xid 74: "a GPU reset or node reboot is needed", and "if seen repeatedly and reset or
    reboot fails to clear the condition, contact your hardware vendor".
    """
    cfg = ctx.cfg
    parsed = parse_nvlink_error(ctx.event.message)
    link_txt = f" on link {parsed.link}" if parsed is not None else ""
    decoded = decode_nvlink_registers(parsed.registers) if parsed is not None else {}
    critical = dict(severity=Severity.CRITICAL, drain=True, cause=CauseClass.NVLINK_FABRIC)
    if not decoded:
        prior = ctx.prior_incidents([74])
        if prior:
            return ctx.result(
                "xid74.recurring",
                f"XID 74 (NVLink error){link_txt}, no register detail; {prior} earlier incident(s) on this "
                f"GPU in the last {_fmt_ms(cfg.recurrence_window_ms)}: the reset/reboot did not clear it. "
                "[CAT] Xid 74: contact the hardware vendor.",
                action=Action.CONTACT_SUPPORT,
                related=[74],
                **critical,
            )
        return ctx.result(
            "xid74.reset",
            f"XID 74 (NVLink error){link_txt}, no register detail to decode: a GPU reset or node reboot is "
            "needed to clear it; the fault may be at the remote end of the link ([CAT] Xid 74).",
            action=Action.RESET_GPU,
            **critical,
        )
    bits = "; ".join(f"{k}: {' '.join(v)}" for k, v in decoded.items())
    head = f"XID 74 (NVLink error){link_txt}, registers decoded per [CAT] WORKFLOW_NVLINK_ERR ({bits})"
    if "undocumented" in decoded or "not_expected" in decoded:
        return ctx.result(
            "xid74.unexpected_bits",
            f"{head}: bits the catalog does not expect are set; it says report a bug.",
            action=Action.CONTACT_SUPPORT,
            **critical,
        )
    if "fabric_reset" in decoded:
        return ctx.result(
            "xid74.fabric_reset",
            f"{head}: fourth register bit 18 means a reset of the NVLink fabric is required.",
            action=Action.RESTART_BM,
            runbook="Cordon and drain the node; reset the fabric (all GPUs and NVSwitches) by rebooting the "
            "node. Check for the Xid/SXid that caused it.",
            **critical,
        )
    if "ecc_parity" in decoded:
        same_link = [
            r
            for r in ctx.before([74], cfg.recurrence_window_ms)
            if (p := parse_nvlink_error(r.message)) is not None and p.link == parsed.link
        ]
        count = len(same_link) + 1
        if count > cfg.nvlink_same_link_limit:
            return ctx.result(
                "xid74.ecc_parity_repeated",
                f"{head}: ECC/parity error, seen {count} times on this link in the last "
                f"{_fmt_ms(cfg.recurrence_window_ms)} (more than {cfg.nvlink_same_link_limit}): likely "
                "hardware; report it.",
                action=Action.CONTACT_SUPPORT,
                related=[74],
                **critical,
            )
        return ctx.result(
            "xid74.ecc_parity",
            f"{head}: ECC/parity error ({count} on this link so far): reset to clear; report if it exceeds "
            f"{cfg.nvlink_same_link_limit} on the same link.",
            action=Action.RESET_GPU,
            **critical,
        )
    if "mechanical" in decoded or "marginal_si" in decoded:
        return ctx.result(
            "xid74.mechanical",
            f"{head}: possible hardware / marginal signal integrity: check the link's mechanical connections "
            "and reseat if needed; run diagnostics if it persists.",
            action=Action.CHECK_MECHANICALS,
            runbook="Cordon and drain the node, reset the GPU to bring the link back; have the link's "
            "connections checked and reseated; run field diagnostics if it comes back; report if diagnostics "
            "pass.",
            **critical,
        )
    if "report_if_repeated" in decoded:
        prior = ctx.prior_incidents([74])
        return ctx.result(
            "xid74.repeat_bits",
            f"{head}: the catalog says report a bug if these bits repeat ({prior} earlier incident(s)).",
            action=Action.CONTACT_SUPPORT if prior else Action.RESET_GPU,
            related=[74] if prior else (),
            **critical,
        )
    if "sympathetic" in decoded:
        others = [r for r in ctx.around(None, cfg.correlation_window_ms) if r.code != 74]
        if others:
            codes = sorted({r.code for r in others})
            return ctx.result(
                "xid74.sympathetic",
                f"{head}: secondary error; XID/SXid {', '.join(map(str, codes))} seen within "
                f"{_fmt_ms(cfg.correlation_window_ms)}: follow that error's resolution.",
                action=Action.IGNORE,
                severity=Severity.WARNING,
                drain=False,
                cause=CauseClass.NVLINK_FABRIC,
                related=codes,
                runbook="Handle the other XID/SXid alert for this GPU or its NVSwitch; nothing extra for "
                "this one.",
            )
        return ctx.result(
            "xid74.sympathetic_solo",
            f"{head}: secondary-error bits seen with no other Xid/SXid: the catalog says report a bug.",
            action=Action.CONTACT_SUPPORT,
            severity=Severity.WARNING,
            drain=False,
            cause=CauseClass.NVLINK_FABRIC,
        )
    return ctx.result(
        "xid74.benign",
        f"{head}: only ignorable bits or an ECC threshold notice (no uncorrectable error): continue "
        "operation.",
        action=Action.IGNORE,
        severity=Severity.INFO,
        drain=False,
        cause=CauseClass.NVLINK_FABRIC,
        runbook="No action. If it keeps appearing, run field diagnostics to check link integrity.",
    )


def _nvlink5(ctx: _Ctx) -> Classification:
    """Xid 144-150, WORKFLOW_NVLINK5_ERR [CAT]: the line names the sub-unit and says Fatal or Nonfatal.

    In the "XID 144-150 Decode" sheet, rows whose severity is Fatal or Link Fatal resolve to RESET_GPU;
    Non-fatal rows to IGNORE, or (RLW_REMAP, RLW_SRC_TRACK) to XID_154_EVAL: "If an XID 154 is seen along
    with this error, take that action. If no XID 154 present, RESTART_APP". An Xid 154 nearby always wins.
    Rows of the sheet's bit-level decode we have verified data for are decoded first
    (:func:`decode_nvlink5_row`); for the others the Fatal token the driver prints stands.
    """
    parsed = parse_nvlink5(ctx.event.message)
    linked = _latest_154(ctx)
    if parsed is None:
        if linked is not None:
            return _follow_154(ctx, linked[1], "nvlink5.follow_154", f"{ctx.label()} (message not decoded)")
        return ctx.result(
            "nvlink5.undecoded",
            f"{ctx.label()}: could not read the sub-unit and Fatal/Nonfatal fields from the message; decode "
            "IntrInfo/ErrorStatus with the catalog's 'XID 144-150 Decode' sheet. An Xid 154 will state the "
            "required recovery if there is one.",
        )
    head = f"{ctx.label()}: {parsed.unit} {'Fatal' if parsed.fatal else 'Nonfatal'} on link {parsed.link}"
    row = decode_nvlink5_row(ctx.code, parsed)
    if row is not None:
        action, why, investigate = row
        critical = action is Action.RESET_GPU
        return ctx.result(
            "nvlink5.decoded",
            f"{head}; [CAT] 'XID 144-150 Decode': {why} -> {action.value}"
            + (f" (investigate: {investigate})." if investigate else "."),
            action=action,
            severity=Severity.CRITICAL if critical else Severity.INFO,
            drain=critical,
            runbook=(_RUNBOOK[Action.RESET_GPU] if critical else _RUNBOOK[Action.IGNORE])
            + (f" Investigate: {investigate}." if investigate else ""),
        )
    if parsed.fatal:
        return ctx.result(
            "nvlink5.fatal",
            f"{head}; Fatal / Link Fatal rows of [CAT] 'XID 144-150 Decode' resolve to RESET_GPU (a "
            "link-fatal GPU is put in 'drain and reset recommended' state).",
            action=Action.RESET_GPU,
            severity=Severity.CRITICAL,
            drain=True,
            runbook=_RUNBOOK[Action.RESET_GPU]
            + " Check the peer device and the link (cables, trays) if it recurs.",
        )
    if linked is not None:
        return _follow_154(ctx, linked[1], "nvlink5.follow_154", head)
    if parsed.unit in ("RLW_REMAP", "RLW_SRC_TRACK"):
        return ctx.result(
            "nvlink5.nonfatal_eval",
            f"{head}; [CAT] XID_154_EVAL with no Xid 154 on this GPU: RESTART_APP (the job may have been "
            "stopped with Xid 45).",
            action=Action.RESTART_APP,
            severity=Severity.WARNING,
            drain=False,
            runbook="Restart the affected job. If an Xid 154 follows, do what it says.",
        )
    ber = parsed.unit.startswith("NETIR_BER")
    return ctx.result(
        "nvlink5.nonfatal",
        f"{head}; Non-fatal rows of [CAT] 'XID 144-150 Decode' resolve to IGNORE"
        + (" (investigate link signal integrity and cables if it repeats)." if ber else "."),
        action=Action.IGNORE,
        severity=Severity.INFO,
        drain=False,
        runbook="No action. If it repeats on the same link, check the link's signal integrity, cables and "
        "seating."
        if ber
        else _RUNBOOK[Action.IGNORE],
    )


# NETIR_LINK_EVT sub-code: IntrInfo bits [25:20] in the >=R575 (V2) layout (0x025001c6 -> 37,
# 0x026001c6 -> 38, as NVSentinel's and GPUd's decoders read it).
def _netir_subcode(intr: int) -> int:
    return (intr >> 20) & 0x3F


def decode_nvlink5_row(code: int, e: Nvlink5Error) -> tuple[Action, str, str] | None:
    """(action, row, investigatory) for the rows of NVIDIA's "XID 144-150 Decode" sheet we decode by bits
    (review D6); ``None`` for the rest, which follow the Fatal/Nonfatal token.

    * 149 NETIR_LINK_EVT "Link Fatal" sub-codes 38 (link taken down by software) and 40 (by the host):
      IGNORE -- the GPU is fine, draining it is the wrong remedy; 37: RESET_GPU, but the *peer* device is
      at fault (INVESTIGATE_PEER_DEVICE).
    * 145 RLW_RXPIPE non-fatal with IntrInfo bit 7 ("Action 2"): RESET_GPU.
    * 144 SAW_MVB error status 0x1: IGNORE; 0x2: RESET_GPU.
    * 150 MSE_WATCHDOG: RESET_GPU.
    """
    unit, intr, status = e.unit, e.intr_info, e.error_status
    if code == 149 and unit == "NETIR_LINK_EVT" and intr is not None:
        sub = _netir_subcode(intr)
        if sub == 38:
            return (
                Action.IGNORE,
                f"NETIR_LINK_EVT sub-code {sub} (link down by software)",
                "INVESTIGATE_SW_USER",
            )
        if sub == 40:
            return Action.IGNORE, f"NETIR_LINK_EVT sub-code {sub} (link down by the host)", "INVESTIGATE_HOST"
        if sub == 37:
            return Action.RESET_GPU, f"NETIR_LINK_EVT sub-code {sub} (peer device)", "INVESTIGATE_PEER_DEVICE"
        return None
    if code == 145 and unit == "RLW_RXPIPE" and not e.fatal and intr is not None and intr & 0x80:
        return Action.RESET_GPU, "RLW_RXPIPE non-fatal with IntrInfo bit 7 (Action 2)", ""
    if code == 144 and unit == "SAW_MVB" and status in (0x1, 0x2):
        return (Action.IGNORE if status == 0x1 else Action.RESET_GPU), f"SAW_MVB error status {status:#x}", ""
    if code == 150 and unit == "MSE_WATCHDOG":
        return Action.RESET_GPU, "MSE_WATCHDOG", ""
    return None
