"""Classifier rules for the catalog default, unknown codes, a GPU gone (Xid 79) and application-class
faults (Xid 13/31/43, 45)."""

from __future__ import annotations

import re
from typing import Any

from gpupipe_consumers.alerts.rules.catalog import (
    CATALOG_VERSION,
    Action,
    CauseClass,
    Severity,
)
from gpupipe_consumers.alerts.rules.classify_ctx import (
    _Ctx,
    _fmt_ms,
    _who,
)
from gpupipe_consumers.alerts.rules.classify_model import (
    _GPU_KINDS,
    Classification,
    _record_of,
)

# --------------------------------------------------------------------------------------------- rules


def _catalog_default(ctx: _Ctx) -> Classification:
    """No workflow for this code: the catalog row as is ([CAT] §2 immediate action)."""
    info = ctx.info
    return ctx.result(
        "catalog",
        f"{ctx.label()}: {info.description}. "
        + (
            f"NVIDIA's immediate action is {info.nvidia_action.value}"
            if info.nvidia_action is not None
            else f"NVIDIA gives no action bucket; ours: {info.bucket.value}"
        )
        + (f" (investigate: {info.nvidia_investigatory})" if info.nvidia_investigatory else "")
        + ".",
    )


def _unknown(ctx: _Ctx) -> Classification:
    """Code missing from the pinned catalog: the safe default of :func:`catalog.lookup`."""
    kind = "SXid" if ctx.event.kind == "sxid" else "XID"
    return ctx.result(
        "sxid.unknown" if ctx.event.kind == "sxid" else "unknown",
        f"{kind} {ctx.code} is not in the pinned catalog {CATALOG_VERSION}: safe default (warning, "
        "CONTACT_SUPPORT, no automatic drain) until someone reads NVIDIA's current documentation for it.",
    )


def _gpu_gone(ctx: _Ctx) -> Classification:
    """Xid 79 and its non-Xid forms ([CAT] §2 Xid 79: RESTART_BM, investigate CONTACT_SUPPORT).

    ``fallen_off_bus``: the kernel's multi-line "GPU has fallen off the bus" message without an Xid
    number (reference §3, NVSentinel issue #155); ``gpu_lost``: NVML reports the GPU lost. All three are
    one fault. A new incident after an earlier one (within ``recurrence_window_ms``, separated from it
    by a reset, a reboot, the GPU coming back or an operator's ack) means the reboot did not fix it:
    CONTACT_SUPPORT. Time alone separates nothing: a lost GPU's samples report the same loss for as
    long as it lasts, and an alert escalated by them could no longer be ended by the reboot that mends
    the GPU.
    """
    ev = ctx.event
    source = {
        "fallen_off_bus": 'the kernel reported "GPU has fallen off the bus" (no Xid number)',
        "gpu_lost": "NVML reports the GPU as lost",
        "xid": "Xid 79: the GPU is no longer reachable over PCIe",
    }[ev.kind]
    prior, _codes = ctx.incidents_across_resets([79])
    common: dict[str, Any] = dict(severity=Severity.CRITICAL, drain=True, cause=CauseClass.BUS)
    if prior:
        return ctx.result(
            "xid79.recurring",
            f"{source}, and it already happened {prior} earlier time(s) on this GPU in the last "
            f"{_fmt_ms(ctx.cfg.recurrence_window_ms)}: rebooting did not fix it; likely hardware (GPU, "
            "riser, PCIe slot, power). [CAT] Xid 79 investigatory action: CONTACT_SUPPORT.",
            action=Action.CONTACT_SUPPORT,
            related=[79],
            runbook="Cordon and drain the node, keep it out of service, collect BMC/SEL and PCIe AER logs "
            "and nvidia-bug-report.sh, and open an RMA/support case. Reseating the GPU may be tried once.",
            **common,
        )
    rule = {"xid": "xid79", "fallen_off_bus": "fallen_off_bus", "gpu_lost": "gpu_lost"}[ev.kind]
    return ctx.result(
        rule,
        f"{source}. [CAT] Xid 79: often a PCIe link failure, sometimes failing GPU hardware or a driver "
        "issue; immediate action RESTART_BM and the node should be drained.",
        action=Action.RESTART_BM,
        **common,
    )


_APP_FAULT_CODES = (13, 31, 43)
_SUSPECT_CODES = (13, 31)  # Xid 43: "GPU remains in a healthy state" -- never a hardware suspicion
_SM_LOCATION = re.compile(r"\(\s*GPC\s*(\d+)\s*,\s*TPC\s*(\d+)\s*,\s*SM\s*(\d+)\s*\)", re.IGNORECASE)


def _sm_location(message: str) -> tuple[int, int, int] | None:
    """``(GPC, TPC, SM)`` of an Xid 13 "Graphics SM ... on (GPC 1, TPC 2, SM 0)" line."""
    m = _SM_LOCATION.search(message)
    return (int(m[1]), int(m[2]), int(m[3])) if m else None


def _app_fault(ctx: _Ctx) -> Classification:
    """Xid 13/31/43: the job's bug, unless NVIDIA's workflow or several *workloads* point at the GPU.

    [CAT] WORKFLOW_XID_13: "Repeat TPC and GPC, diff SMs: RUN_DCGMEUD (possible HW issue) ... Not repeat
    TPC and GPC: CHECK_APP/CUDA ... Solo, no burst: CHECK_APP/CUDA"; WORKFLOW_XID_31: "Repeat MMU faults
    to same GPU: RUN_DCGMEUD (possible HW issue) ... to diff GPU: CHECK_APP/CUDA". Xid 43: "GPU remains
    in a healthy state ... user application error" (IGNORE): never escalated. We escalate 13/31 when
    (a) two Xid 13 on this GPU in ``app_fault_window_ms`` hit the same GPC and TPC on different SMs, or
    (b) ``app_fault_distinct_workloads`` different workloads (namespace + controller of the pod, see
    :func:`~gpupipe_consumers.alerts.rules.classify_model.workload_key`; never pids: a crash-looping
    container gets a
    new pid per restart) hit 13/31 on it. The escalation is a *ticket* (warning, RUN_DCGMEUD), never a
    drain: the diagnostics decide whether the GPU is bad.
    """
    ev, cfg = ctx.event, ctx.cfg
    window = _fmt_ms(cfg.app_fault_window_ms)
    if ctx.code in _SUSPECT_CODES:
        records = [*ctx.before(_SUSPECT_CODES, cfg.app_fault_window_ms), _record_of(ev)]
        codes_seen = sorted({r.code for r in records})
        workloads = sorted({r.workload for r in records if r.workload})
        reason = ""
        rule = ""
        if ctx.code == 13:
            here = _sm_location(ev.message)
            if here is not None:
                for r in records[:-1]:
                    there = _sm_location(r.message) if r.code == 13 else None
                    if there is not None and there[:2] == here[:2] and there[2] != here[2]:
                        rule = "app_fault.xid13_same_tpc_diff_sm"
                        reason = (
                            f"XID 13 on GPC {here[0]}, TPC {here[1]} from SM {there[2]} and SM {here[2]} "
                            f'within {window}: [CAT] WORKFLOW_XID_13 "repeat TPC and GPC, diff SMs" -> '
                            "RUN_DCGMEUD (possible hardware issue)."
                        )
                        break
        if not rule and len(workloads) >= cfg.app_fault_distinct_workloads:
            rule = "app_fault.repeat_distinct_workloads"
            reason = (
                f"XID {ctx.code} seen on this GPU from {len(workloads)} different workloads within {window} "
                f"({', '.join(workloads[:5])}; codes {', '.join(map(str, codes_seen))}): the GPU may be the "
                "common factor. [CAT] WORKFLOW_XID_13/31: repeats on the same GPU -> RUN_DCGMEUD."
            )
        if rule:
            return ctx.result(
                rule,
                reason + " A ticket to run diagnostics, not a drain: the diagnostics decide.",
                action=Action.RUN_DCGMEUD,
                severity=Severity.WARNING,
                drain=False,
                cause=CauseClass.HARDWARE_MEMORY,
                related=[c for c in codes_seen if c != ctx.code],
                runbook="When the GPU's current jobs end, run DCGM diagnostics on it (dcgmi diag -r 3, or "
                "the DCGM EUD); if they pass, run NVIDIA field diagnostics; on any failure cordon the node "
                "and open an RMA/support case. If the same jobs also fault on other GPUs, hand it back to "
                "the job owners instead.",
            )
    who = _who(ev.pid, ev.process_name)
    what = {
        13: "Graphics Engine Exception, typically an out-of-bounds access or illegal instruction in the job",
        31: "GPU memory page fault, typically an illegal address access in the job",
        43: "the job hit a software-induced fault and was stopped; the GPU stays healthy",
    }[ctx.code]
    return ctx.result(
        "app_fault.single",
        f"XID {ctx.code} from {who}: {what}: application fault (hardware suspicion needs "
        f"{cfg.app_fault_distinct_workloads} different workloads within {window}, or Xid 13 on one TPC "
        f"from different SMs). [CAT] immediate action {ctx.info.bucket.value}.",
        cause=CauseClass.APPLICATION,
    )


def _xid45(ctx: _Ctx) -> Classification:
    """Xid 45, WORKFLOW_XID_45 [CAT]: not solo -> IGNORE (follow the other Xid); solo -> RESTART_FM.

    "Solo" means no other Xid on this GPU within ``solo_window_ms`` either side. A solo 45 is most often a
    job killed by Ctrl-C / SIGKILL / a GPU reset ([CAT] trigger text), so it stays ``info``.
    """
    others = [
        r
        for r in ctx.around(None, ctx.cfg.solo_window_ms)
        if r.kind in _GPU_KINDS and r.code not in (45, 154)
    ]
    if others:
        codes = sorted({r.code for r in others})
        return ctx.result(
            "xid45.sympathetic",
            f"XID 45 (channels torn down) follows XID {', '.join(map(str, codes))} on this GPU within "
            f"{_fmt_ms(ctx.cfg.solo_window_ms)}: sympathetic; handle that error instead. [CAT] "
            "WORKFLOW_XID_45.",
            action=Action.IGNORE,
            severity=Severity.INFO,
            drain=False,
            related=codes,
            runbook="No action for this line; follow the alert for the other XID on this GPU.",
        )
    return ctx.result(
        "xid45.solo",
        f"XID 45 from {_who(ctx.event.pid, ctx.event.process_name)} with no other XID on this GPU within "
        f"{_fmt_ms(ctx.cfg.solo_window_ms)}: usually a job killed on purpose (Ctrl-C, SIGKILL, GPU reset). "
        "[CAT] WORKFLOW_XID_45 solo: RESTART_FM if it was not expected.",
        action=Action.RESTART_FM,
        severity=Severity.INFO,
        drain=False,
    )
