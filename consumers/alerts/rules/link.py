"""Classifier rules for interconnect faults: Xid 74 (WORKFLOW_NVLINK_ERR); NVLink5 (144-150) is in
:mod:`gpupipe_consumers.alerts.rules.nvlink5`."""

from __future__ import annotations

from typing import Any

from gpupipe_consumers.alerts.rules.catalog import (
    Action,
    CauseClass,
    Severity,
)
from gpupipe_consumers.alerts.rules.classify_ctx import (
    _Ctx,
    _fmt_ms,
)
from gpupipe_consumers.alerts.rules.classify_model import (
    Classification,
)
from gpupipe_consumers.alerts.rules.parsers import (
    decode_nvlink_registers,
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
    critical: dict[str, Any] = dict(severity=Severity.CRITICAL, drain=True, cause=CauseClass.NVLINK_FABRIC)
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
