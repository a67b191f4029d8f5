"""Context-dependent XID classification: the workflows of NVIDIA's catalog, table-driven."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import pytest

from gpupipe_consumers.alerts.rules.catalog import Action, CauseClass, Severity
from gpupipe_consumers.alerts.rules.classify import (
    ClassifyConfig,
    FaultEvent,
    GpuHealth,
    GpuXidHistory,
    classify,
    decode_nvlink_registers,
    observe,
    parse_containment,
    parse_nvlink5,
    parse_nvlink_error,
    parse_recovery_action,
    recovery_action_from_nvml,
)

MIN = 60_000
HOUR = 60 * MIN
T0 = 1_700_000_000_000  # any epoch ms; rules only look at differences


def xid(code, at_min=0.0, pid=None, name=None, msg="", kind="xid", wl=None):
    return FaultEvent(
        kind=kind,
        ts_ms=T0 + int(at_min * MIN),
        code=code,
        pid=pid,
        process_name=name,
        message=msg,
        workload=wl,
    )


def gone(kind, at_min=0.0):
    return FaultEvent(kind=kind, ts_ms=T0 + int(at_min * MIN))


def sxid(code, at_min=0.0, msg=""):
    return xid(code, at_min, msg=msg, kind="sxid")


def history_of(*events):
    h = GpuXidHistory()
    for e in events:
        h.record(e)
    return h


# Lines from shared/reference/xid-kmsg-corpus-from-repos.txt and the catalog's documented formats.
XID94_LINE = "NVRM: Xid (PCI:0000:01:00): 94, pid=7062, Contained: CE User Channel (0x9). RST: No, D-RST: No"
XID95_LINE = "NVRM: Xid (PCI:0000:01:00): 95, pid=7062, Uncontained: LTC TAG (0x2, 0x1). RST: Yes, D-RST: No"
XID63_LINE = (
    "NVRM: Xid (PCI:0000:10:1c): 63, pid=1896, "
    "Row Remapper: New row marked for remapping, reset gpu to activate."
)


XID13_SM = "Graphics SM Warp Exception on (GPC 1, TPC 2, SM {sm}): Out Of Range Address"
NVL74_BARE = "NVLink: fatal error detected on link 1"


def nvl74(regs, link=0):
    return f"NVLink: fatal error detected on link {link}({', '.join(hex(r) for r in regs)})"


def recovery(to_value, to_name):
    return f"GPU recovery action changed from 0x0 (None) to {to_value} ({to_name})"


@dataclass
class Case:
    id: str
    event: FaultEvent
    prior: tuple[FaultEvent, ...] = ()
    health: GpuHealth | None = None
    action: Action = Action.IGNORE
    severity: Severity = Severity.INFO
    drain: bool = False
    rule: str = ""
    cause: CauseClass | None = None
    codes: tuple[int, ...] | None = None
    known: bool = True
    reason_has: tuple[str, ...] = field(default_factory=tuple)
    resets: tuple[float, ...] = ()  # minutes at which the GPU was seen reset (samples)


W, C, I = Severity.WARNING, Severity.CRITICAL, Severity.INFO  # noqa: E741

CASES = [
    # --- Xid 13/31/43: application unless many different processes on one GPU (WORKFLOW_XID_13/31)
    Case("13 once", xid(13, pid=100, name="python"), action=Action.RESTART_APP, severity=W,
         rule="app_fault.single", cause=CauseClass.APPLICATION),
    Case("13 twice same pid stays application", xid(13, 5, pid=100, name="python"),
         prior=(xid(13, 0, pid=100, name="python"),), action=Action.RESTART_APP, severity=W,
         rule="app_fault.single", cause=CauseClass.APPLICATION),
    Case("13 five times same pid stays application", xid(13, 50, pid=100),
         prior=tuple(xid(13, m, pid=100) for m in (0, 10, 20, 30)), action=Action.RESTART_APP, severity=W,
         rule="app_fault.single"),
    Case("13 from 2 pids is below threshold", xid(13, 5, pid=200), prior=(xid(13, 0, pid=100),),
         action=Action.RESTART_APP, severity=W, rule="app_fault.single"),
    # Pids are not workloads (a crash loop gets a new pid per restart); escalation is a ticket.
    Case("13 from 3 pids of one workload stays application", xid(13, 40, pid=300, wl="ml/train"),
         prior=(xid(13, 0, pid=100, wl="ml/train"), xid(13, 20, pid=200, wl="ml/train")),
         action=Action.RESTART_APP, severity=W, rule="app_fault.single", cause=CauseClass.APPLICATION),
    Case("13 from 3 workloads within 1h is a diagnostics ticket", xid(13, 40, pid=300, wl="c/infer"),
         prior=(xid(13, 0, pid=100, wl="a/train"), xid(13, 20, pid=200, wl="b/eval")),
         action=Action.RUN_DCGMEUD, severity=W, drain=False, rule="app_fault.repeat_distinct_workloads",
         cause=CauseClass.HARDWARE_MEMORY, reason_has=("3 different workloads within 1h", "not a drain")),
    Case("13 from 3 workloads but one outside the hour", xid(13, 70, wl="c/x"),
         prior=(xid(13, 0, wl="a/x"), xid(13, 20, wl="b/x")), action=Action.RESTART_APP, severity=W,
         rule="app_fault.single"),
    Case("13/31 mixed across 3 workloads escalates", xid(31, 10, wl="c/x"),
         prior=(xid(13, 0, wl="a/x"), xid(31, 5, wl="b/x")), action=Action.RUN_DCGMEUD, severity=W,
         rule="app_fault.repeat_distinct_workloads", codes=(31, 13)),
    Case("43 never counts toward the suspicion", xid(13, 10, wl="c/x"),
         prior=(xid(43, 0, wl="a/x"), xid(43, 5, wl="b/x")), action=Action.RESTART_APP, severity=W,
         rule="app_fault.single"),
    Case("43 from 3 workloads stays IGNORE", xid(43, 10, wl="c/x"),
         prior=(xid(43, 0, wl="a/x"), xid(43, 5, wl="b/x")), action=Action.IGNORE, severity=I,
         rule="app_fault.single"),
    Case("unattributed 13s cannot prove distinct workloads", xid(13, 10, pid=3),
         prior=(xid(13, 0, pid=1), xid(13, 5, pid=2)), action=Action.RESTART_APP, severity=W,
         rule="app_fault.single"),
    Case("13 on one TPC from different SMs: NVIDIA's workflow", xid(13, 10, msg=XID13_SM.format(sm=1)),
         prior=(xid(13, 0, msg=XID13_SM.format(sm=0)),), action=Action.RUN_DCGMEUD, severity=W,
         rule="app_fault.xid13_same_tpc_diff_sm", reason_has=("repeat TPC and GPC, diff SMs",)),
    Case("13 on one SM repeating is the app", xid(13, 10, msg=XID13_SM.format(sm=0)),
         prior=(xid(13, 0, msg=XID13_SM.format(sm=0)),), action=Action.RESTART_APP, severity=W,
         rule="app_fault.single"),
    Case("31 once", xid(31, pid=7), action=Action.RESTART_APP, severity=W, rule="app_fault.single"),
    Case("43 once is IGNORE per catalog", xid(43, pid=7), action=Action.IGNORE, severity=I,
         rule="app_fault.single", cause=CauseClass.APPLICATION),
    # --- Xid 94/95 containment, RST / D-RST flags
    Case("94 contained", xid(94, pid=7062, msg=XID94_LINE), action=Action.RESTART_APP, severity=W,
         rule="containment.xid94", cause=CauseClass.HARDWARE_MEMORY, reason_has=("RST: No",)),
    Case("94 with RST: Yes", xid(94, msg="Contained: CE User Channel (0x9). RST: Yes, D-RST: No"),
         action=Action.RESET_GPU, severity=W, rule="containment.xid94_reset"),
    Case("94 with D-RST: Yes", xid(94, msg="Contained: CE User Channel (0x9). RST: Yes, D-RST: Yes"),
         action=Action.DRAIN_AND_RESET, severity=C, drain=True, rule="containment.xid94_drain_and_reset"),
    Case("95 uncontained", xid(95, pid=7062, msg=XID95_LINE), action=Action.RESET_GPU, severity=C,
         drain=True, rule="containment.xid95", reason_has=("uncontained in LTC TAG",)),
    Case("95 without parseable flags", xid(95), action=Action.RESET_GPU, severity=C, drain=True,
         rule="containment.xid95"),
    Case("95 with D-RST: Yes", xid(95, msg="Uncontained: LTC TAG (0x2, 0x1). RST: Yes, D-RST: Yes"),
         action=Action.DRAIN_AND_RESET, severity=C, drain=True, rule="containment.xid95_drain_and_reset"),
    # --- Xid 48 / 63 / 64 with row-remapper state (WORKFLOW_XID_48, [MEM])
    Case("48 solo", xid(48), action=Action.RESET_GPU, severity=C, drain=True, rule="ecc.dbe_solo",
         cause=CauseClass.HARDWARE_MEMORY),
    Case("48 + 63 + remap pending -> drain and reset", xid(48, 1), prior=(xid(63, 0, msg=XID63_LINE),),
         health=GpuHealth(remap_pending=True, remap_failure=False), action=Action.DRAIN_AND_RESET,
         severity=C, drain=True, rule="ecc.dbe_with_remap", codes=(48, 63)),
    Case("63 after 48 -> drain and reset", xid(63, 1, msg=XID63_LINE), prior=(xid(48, 0),),
         health=GpuHealth(remap_pending=True), action=Action.DRAIN_AND_RESET, severity=C, drain=True,
         rule="ecc.remap_with_dbe", codes=(63, 48)),
    Case("48 with a pending remap only", xid(48), health=GpuHealth(remap_pending=True),
         action=Action.DRAIN_AND_RESET, severity=C, drain=True, rule="ecc.dbe_with_remap"),
    Case("48 with 63 long before is solo", xid(48, 30), prior=(xid(63, 0),), action=Action.RESET_GPU,
         severity=C, drain=True, rule="ecc.dbe_solo"),
    Case("48 with remap failure -> RMA", xid(48), prior=(xid(64, -1),), health=GpuHealth(remap_failure=True),
         action=Action.CONTACT_SUPPORT, severity=C, drain=True, rule="ecc.dbe_remap_failure", codes=(48, 64)),
    Case("48 with its SRAM qualifier 172: the SRAM branch", xid(48, 0.1), prior=(xid(172),),
         action=Action.RESET_GPU, severity=C, drain=True, rule="ecc.dbe_sram",
         reason_has=("SRAM error threshold flag",)),
    Case("172 (SRAM detail of 48): SRAM branch", xid(172), action=Action.RESET_GPU, severity=C, drain=True,
         rule="ecc.dbe_sram"),
    Case("63 with remap failure -> RMA", xid(63, msg=XID63_LINE), health=GpuHealth(remap_failure=True),
         action=Action.CONTACT_SUPPORT, severity=C, drain=True, rule="ecc.remap_failure"),
    Case("63 'reset gpu to activate' -> reset when convenient", xid(63, msg=XID63_LINE),
         action=Action.RESET_GPU, severity=W, rule="ecc.remap_pending"),
    Case("63 with remap_pending flag", xid(63), health=GpuHealth(remap_pending=True),
         action=Action.RESET_GPU, severity=W, rule="ecc.remap_pending"),
    Case("63 with nothing pending -> catalog IGNORE", xid(63, msg="Row Remapper: row remapped"),
         health=GpuHealth(remap_pending=False, remap_failure=False), action=Action.IGNORE, severity=I,
         rule="ecc.remap_event"),
    Case("64 without state", xid(64), action=Action.RESET_GPU, severity=C, drain=True,
         rule="ecc.remap_failure_xid"),
    Case("64 with failure flag -> RMA", xid(64), health=GpuHealth(remap_failure=True),
         action=Action.CONTACT_SUPPORT, severity=C, drain=True, rule="ecc.remap_failure"),
    Case("64 with 48 nearby", xid(64, 2), prior=(xid(48, 0),), action=Action.DRAIN_AND_RESET, severity=C,
         drain=True, rule="ecc.remap_failure_with_dbe", codes=(64, 48)),
    # --- Xid 79 and its non-Xid forms
    Case("79", xid(79, msg="GPU has fallen off the bus."), action=Action.RESTART_BM, severity=C, drain=True,
         rule="xid79", cause=CauseClass.BUS),
    Case("fallen off the bus without Xid", gone("fallen_off_bus"), action=Action.RESTART_BM, severity=C,
         drain=True, rule="fallen_off_bus", codes=(79,)),
    Case("NVML GPU lost", gone("gpu_lost"), action=Action.RESTART_BM, severity=C, drain=True, rule="gpu_lost",
         codes=(79,)),
    Case("79 seen twice in one incident", xid(79, 0.5), prior=(gone("fallen_off_bus", 0),),
         action=Action.RESTART_BM, severity=C, drain=True, rule="xid79"),
    Case("79 again after a reboot -> support", xid(79, 120), prior=(gone("gpu_lost", 0),), resets=(60,),
         action=Action.CONTACT_SUPPORT, severity=C, drain=True, rule="xid79.recurring"),
    Case("79 again hours later, nothing tried in between: one loss", xid(79, 120),
         prior=(gone("gpu_lost", 0),), action=Action.RESTART_BM, severity=C, drain=True, rule="xid79"),
    # --- Xid 74 register decode (WORKFLOW_NVLINK_ERR)
    Case("74 without registers", xid(74, msg=NVL74_BARE),
         action=Action.RESET_GPU, severity=C, drain=True, rule="xid74.reset", cause=CauseClass.NVLINK_FABRIC),
    Case("74 without registers, again hours later", xid(74, 180, msg=NVL74_BARE),
         prior=(xid(74, 0, msg=NVL74_BARE),), action=Action.CONTACT_SUPPORT,
         severity=C, drain=True, rule="xid74.recurring"),
    Case("74 only ignorable bits", xid(74, msg=nvl74([0x1, 0, 0, 0, 0, 0, 0])), action=Action.IGNORE,
         severity=I, rule="xid74.benign"),
    Case("74 ECC threshold only", xid(74, msg=nvl74([0, 0, 0, 0, 1 << 20, 0, 0])), action=Action.IGNORE,
         severity=I, rule="xid74.benign"),
    Case("74 ECC/parity first time", xid(74, msg=nvl74([1 << 4, 0, 0, 0, 0, 0, 0], link=3)),
         action=Action.RESET_GPU, severity=C, drain=True, rule="xid74.ecc_parity"),
    Case("74 ECC/parity third time on the same link", xid(74, 60, msg=nvl74([1 << 4, 0, 0, 0, 0, 0, 0], 3)),
         prior=(xid(74, 0, msg=nvl74([1 << 5, 0, 0, 0], 3)), xid(74, 30, msg=nvl74([0, 0, 1, 0], 3))),
         action=Action.CONTACT_SUPPORT, severity=C, drain=True, rule="xid74.ecc_parity_repeated"),
    Case("74 ECC/parity repeats on other links do not count", xid(74, 60, msg=nvl74([1 << 4, 0, 0, 0], 3)),
         prior=(xid(74, 0, msg=nvl74([1 << 4, 0, 0, 0], 4)), xid(74, 30, msg=nvl74([1 << 4, 0, 0, 0], 5))),
         action=Action.RESET_GPU, severity=C, drain=True, rule="xid74.ecc_parity"),
    Case("74 mechanical bits", xid(74, msg=nvl74([1 << 8, 0, 0, 0, 0, 0, 0])),
         action=Action.CHECK_MECHANICALS, severity=C, drain=True, rule="xid74.mechanical"),
    Case("74 fabric reset bit", xid(74, msg=nvl74([0, 0, 0, 1 << 18, 0, 0, 0])), action=Action.RESTART_BM,
         severity=C, drain=True, rule="xid74.fabric_reset"),
    Case("74 sympathetic with an SXid nearby", xid(74, 1, msg=nvl74([0x2, 0, 0, 0, 0, 0, 0])),
         prior=(sxid(20034, 0, "Fatal, Link 48 LTSSM Fault Up"),), action=Action.IGNORE, severity=W,
         rule="xid74.sympathetic", codes=(74, 20034)),
    Case("74 sympathetic bits alone -> report", xid(74, msg=nvl74([0x2, 0, 0, 0, 0, 0, 0])),
         action=Action.CONTACT_SUPPORT, severity=W, rule="xid74.sympathetic_solo"),
    Case("74 undocumented bit -> report", xid(74, msg=nvl74([0, 0, 0, 0, 0, 0, 0x1])),
         action=Action.CONTACT_SUPPORT, severity=C, drain=True, rule="xid74.unexpected_bits"),
    Case("74 report-if-repeated bit, first time", xid(74, msg=nvl74([0, 0, 0x10000, 0, 0, 0, 0])),
         action=Action.RESET_GPU, severity=C, drain=True, rule="xid74.repeat_bits"),
    # --- Xid 119/120 GSP
    Case("119 once", xid(119, pid=2024380, name="nvidia-smi"), action=Action.RESET_GPU, severity=C,
         drain=True, rule="gsp.reset", cause=CauseClass.DRIVER),
    Case("119 burst is one incident", xid(119, 0.1), prior=(xid(119, 0),), action=Action.RESET_GPU,
         severity=C, drain=True, rule="gsp.reset"),
    Case("120 back after a reset -> power cycle", xid(120, 120), prior=(xid(119, 0),), resets=(60,),
         action=Action.RESTART_BM, severity=C, drain=True, rule="gsp.recurring", codes=(120, 119)),
    Case("119 third incident -> support", xid(119, 300), prior=(xid(119, 0), xid(120, 120)),
         resets=(60, 200), action=Action.CONTACT_SUPPORT, severity=C, drain=True, rule="gsp.persistent"),
    # A GSP timeout every 11 min while the GPU waits for its reset is one incident.
    Case("119 repeating without a reset stays RESET_GPU", xid(119, 33), prior=(xid(119, 0), xid(119, 11),
         xid(119, 22)), action=Action.RESET_GPU, severity=C, drain=True, rule="gsp.reset", codes=(119,)),
    # --- Xid 154 recovery action text
    Case("154 node reboot", xid(154, msg=recovery("0x2", "Node Reboot Required")), action=Action.RESTART_BM,
         severity=C, drain=True, rule="xid154.recovery_action"),
    Case("154 GPU reset", xid(154, msg=recovery("0x1", "GPU Reset Required")), action=Action.RESET_GPU,
         severity=C, drain=True, rule="xid154.recovery_action"),
    Case("154 drain P2P", xid(154, msg=recovery("0x3", "Drain P2P")), action=Action.DRAIN_P2P, severity=W,
         drain=True, rule="xid154.recovery_action"),
    Case("154 drain and reset", xid(154, msg=recovery("0x4", "Drain and Reset")),
         action=Action.DRAIN_AND_RESET, severity=C, drain=True, rule="xid154.recovery_action"),
    Case("154 back to none",
         xid(154, msg="GPU recovery action changed from 0x1 (GPU Reset Required) to 0x0 (None)"),
         action=Action.IGNORE, severity=I, rule="xid154.recovery_action"),
    Case("154 unknown text falls back to the NVML value", xid(154, msg=recovery("0x1", "Reset Soonish")),
         action=Action.RESET_GPU, severity=C, drain=True, rule="xid154.recovery_action"),
    Case("154 unreadable", xid(154, msg="something else"), action=Action.XID_154, severity=W,
         rule="xid154.unreadable"),
    Case("154 names the Xid it follows", xid(154, 0.01, msg=recovery("0x1", "GPU Reset Required")),
         prior=(xid(149, 0, msg="149, NETIR_LINK_EVT Fatal XC0 i0 Link 00 (0x016415c6 0x0)"),),
         action=Action.RESET_GPU, severity=C, drain=True, rule="xid154.recovery_action", codes=(154, 149)),
    # --- Xid 144-150 (WORKFLOW_NVLINK5_ERR)
    # link-down reason 33 (IntrInfo[25:20]): INVESTIGATE_PEER_DEVICE, the peer took the link down
    Case("149 link fatal from the peer",
         xid(149, msg="NETIR_LINK_EVT  Fatal   XC0 i0 Link 01 (0x021425c6 0x00000000 0x0)"),
         action=Action.RESET_GPU, severity=W, drain=False, rule="nvlink5.peer_device"),
    # link-down reason 4: INVESTIGATE_LINK_SI, this GPU's link
    Case("149 link fatal", xid(149, msg="NETIR_LINK_EVT Fatal XC0 i0 Link 08 (0x004505c6 0x00000000 0x0)"),
         action=Action.RESET_GPU, severity=C, drain=True, rule="nvlink5.decoded"),
    Case("149 registers in no row of the sheet",
         xid(149, msg="NETIR_LINK_EVT Fatal XC 1 i 2 Link 01 [0x0000000a]"),
         action=Action.RESET_GPU, severity=C, drain=True, rule="nvlink5.undecoded_fatal"),
    Case("149 BER nonfatal", xid(149, msg="NETIR_BER_EVENT Nonfatal XC0 i0 Link 03 (0x00086226 0x00000001)"),
         action=Action.IGNORE, severity=I, rule="nvlink5.decoded"),
    Case("145 RLW_REMAP nonfatal, no 154", xid(145, msg="RLW_REMAP Nonfatal XC0 i0 Link 02 (0x4 0x1)"),
         action=Action.RESTART_APP, severity=W, rule="nvlink5.xid154_eval"),
    Case("145 RLW_REMAP nonfatal with a 154",
         xid(145, 0.01, msg="RLW_REMAP Nonfatal XC0 i0 Link 02 (0x4 0x1)"),
         prior=(xid(154, 0, msg=recovery("0x1", "GPU Reset Required")),), action=Action.RESET_GPU, severity=C,
         drain=True, rule="nvlink5.follow_154", codes=(145, 154)),
    Case("150 undecodable", xid(150, msg="MSE something"), action=Action.WORKFLOW_NVLINK5_ERR, severity=W,
         rule="nvlink5.undecoded"),
    # --- Xid 45 (WORKFLOW_XID_45)
    Case("45 solo", xid(45, pid=9, name="python"), action=Action.RESTART_FM, severity=I, rule="xid45.solo"),
    Case("45 after 149 is sympathetic", xid(45, 0.005), prior=(xid(149, 0, msg="NETIR_LINK_EVT Fatal"),),
         action=Action.IGNORE, severity=I, rule="xid45.sympathetic", codes=(45, 149)),
    # --- catalog rows without a workflow, unknown codes
    Case("32 catalog row", xid(32), action=Action.RESTART_APP, severity=W, rule="catalog",
         cause=CauseClass.BUS),
    Case("62 catalog row", xid(62), action=Action.RESET_GPU, severity=C, drain=True, rule="catalog"),
    Case("155 link taken down", xid(155), action=Action.RESET_GPU, severity=C, drain=True, rule="catalog"),
    Case("unknown XID", xid(4242), action=Action.CONTACT_SUPPORT, severity=W, rule="unknown",
         cause=CauseClass.UNKNOWN, known=False, reason_has=("not in the pinned catalog",)),
    # --- SXids
    Case("SXid single-bit ECC", sxid(11012), action=Action.IGNORE, severity=I, rule="sxid.catalog"),
    Case("SXid LTSSM fault up", sxid(20034, msg="Fatal, Link 48 LTSSM Fault Up"), action=Action.RESET_GPU,
         severity=C, drain=True, rule="sxid.catalog", cause=CauseClass.NVLINK_FABRIC),
    Case("SXid always fatal", sxid(23001), action=Action.RESTART_BM, severity=C, drain=True,
         rule="sxid.catalog"),
    Case("SXid unknown but Fatal", sxid(29999, msg="Fatal, Link 3 something new"),
         action=Action.CONTACT_SUPPORT, severity=C, drain=True, rule="sxid.unknown_fatal", known=False),
    Case("unknown event kind", FaultEvent(kind="unknown", ts_ms=T0, code=13), action=Action.CONTACT_SUPPORT,
         severity=W, rule="unknown_kind", known=False, cause=CauseClass.UNKNOWN),
    Case("unknown event kind without code", FaultEvent(kind="unknown", ts_ms=T0),
         action=Action.CONTACT_SUPPORT, severity=W, rule="unknown_kind", known=False, codes=(0,)),
    Case("unknown-kind records do not count as app faults", xid(13, 10, pid=3),
         prior=(FaultEvent(kind="unknown", ts_ms=T0, code=13, pid=1),
                FaultEvent(kind="unknown", ts_ms=T0 + 5 * MIN, code=13, pid=2)),
         action=Action.RESTART_APP, severity=W, rule="app_fault.single"),
    Case("SXid unknown non-fatal", sxid(29998, msg="Non-fatal, Link 3 something new"),
         action=Action.CONTACT_SUPPORT, severity=W, rule="sxid.unknown", known=False),
    # --- health modifiers
    Case("NVML recovery action escalates an app fault", xid(13, pid=1), health=GpuHealth(recovery_action=1),
         action=Action.RESET_GPU, severity=C, drain=True, rule="app_fault.single+recovery_action"),
    Case("NVML recovery action never downgrades", xid(79), health=GpuHealth(recovery_action=1),
         action=Action.RESTART_BM, severity=C, drain=True, rule="xid79+recovery_action"),
    Case("remap failure turns a memory fault into RMA", xid(94, msg=XID94_LINE),
         health=GpuHealth(remap_failure=True), action=Action.CONTACT_SUPPORT, severity=C, drain=True,
         rule="containment.xid94+remap_failure"),
    Case("remap failure does not touch an app fault", xid(13, pid=1), health=GpuHealth(remap_failure=True),
         action=Action.RESTART_APP, severity=W, rule="app_fault.single"),
]  # fmt: skip


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_classify(case: Case):
    history = history_of(*case.prior)
    for minute in case.resets:
        history.record_reset(T0 + int(minute * MIN))
    result = classify(case.event, history, case.health)
    assert (result.action, result.severity, result.drain_node) == (case.action, case.severity, case.drain), (
        result.reason
    )
    assert result.rule == case.rule, result.reason
    assert result.known is case.known
    assert result.code == case.event.effective_code
    if case.cause is not None:
        assert result.cause_class is case.cause
    if case.codes is not None:
        assert result.codes == case.codes
    for text in case.reason_has:
        assert text in result.reason
    assert result.reason and result.runbook


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_recording_before_or_after_gives_the_same_answer(case: Case):
    before = classify(case.event, history_of(*case.prior), case.health)
    after = classify(case.event, history_of(*case.prior, case.event), case.health)
    assert before == after


def test_reason_explains_the_escalation():
    h = GpuXidHistory()
    for i, wl in enumerate(("a/train", "b/eval")):
        observe(xid(13, i * 10, pid=i, name="python", wl=wl), h)
    result = observe(xid(13, 30, pid=33, name="python", wl="c/infer"), h)
    assert result.reason.startswith("XID 13 seen on this GPU from 3 different workloads within 1h")
    assert "a/train" in result.reason and "c/infer" in result.reason
    assert "WORKFLOW_XID_13" in result.reason
    assert len(h) == 3


def test_config_thresholds_are_used():
    cfg = ClassifyConfig(app_fault_distinct_workloads=2, app_fault_window_ms=5 * MIN)
    h = history_of(xid(13, 0, wl="a/x"))
    assert classify(xid(13, 4, wl="b/x"), h, config=cfg).action is Action.RUN_DCGMEUD
    assert classify(xid(13, 6, wl="b/x"), h, config=cfg).action is Action.RESTART_APP


def test_classify_does_not_mutate_history():
    h = history_of(xid(13, 0, pid=1))
    classify(xid(13, 1, pid=2), h)
    assert len(h) == 1


def test_classify_works_without_history_or_health():
    assert classify(xid(48)).action is Action.RESET_GPU
    assert classify(gone("gpu_lost")).drain_node is True


def test_classification_is_frozen_and_carries_catalog_version():
    result = classify(xid(79))
    with pytest.raises(dataclasses.FrozenInstanceError):
        result.action = Action.IGNORE  # type: ignore[misc]
    assert result.catalog_version
    assert result.nvidia_action is Action.RESTART_BM


# ------------------------------------------------------------------------------------------- history


def test_history_dedupes_replayed_events():
    e = xid(13, 0, pid=1, msg="x")
    h = history_of(e, e, e)
    assert len(h) == 1


def test_history_keeps_order_for_late_events():
    h = history_of(xid(13, 10), xid(31, 5), xid(43, 7))
    assert [r.code for r in h.records()] == [31, 43, 13]


def test_history_drops_records_older_than_the_horizon():
    h = GpuXidHistory(horizon_ms=HOUR)
    for m in (0, 29, 30, 61, 90):
        h.record(xid(13, m))
    assert [r.ts_ms for r in h.records()] == [T0 + m * MIN for m in (30, 61, 90)]


def test_history_is_bounded_in_size():
    h = GpuXidHistory(max_records=5)
    for i in range(20):
        h.record(xid(13, i * 0.01, pid=i))
    assert len(h) == 5
    assert [r.pid for r in h.records()] == [15, 16, 17, 18, 19]


def test_history_normalises_unknown_process_names_and_gpu_lost():
    h = history_of(xid(79, 0, name="<unknown>"), gone("gpu_lost", 1))
    first, second = h.records()
    assert first.process_name is None
    assert (second.code, second.kind) == (79, "gpu_lost")


@pytest.mark.parametrize(("horizon", "size"), [(0, 5), (HOUR, 0)])
def test_history_rejects_nonsense_bounds(horizon, size):
    with pytest.raises(ValueError):
        GpuXidHistory(horizon_ms=horizon, max_records=size)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [({"kind": "xid", "ts_ms": 0}, "needs a code"), ({"kind": "nvswitch", "ts_ms": 0, "code": 1}, "kind")],
)
def test_fault_event_validation(kwargs, message):
    with pytest.raises(ValueError, match=message):
        FaultEvent(**kwargs)


# ------------------------------------------------------------------------------------------- parsers


@pytest.mark.parametrize(
    ("line", "contained", "unit", "rst", "drst"),
    [
        (XID94_LINE, True, "CE User Channel", False, False),
        (XID95_LINE, False, "LTC TAG", True, False),
        ("Contained: FBHUB (0x1, 0x2). physAddr: 0x1234abcd RST: Yes, D-RST: Yes", True, "FBHUB", True, True),
        ("Uncontained: GR (0x3)", False, "GR", None, None),
    ],
)
def test_parse_containment(line, contained, unit, rst, drst):
    c = parse_containment(line)
    assert c is not None
    assert (c.contained, c.unit, c.gpu_reset_required, c.drain_and_reset_required) == (
        contained,
        unit,
        rst,
        drst,
    )


def test_parse_containment_none():
    assert parse_containment("GPU has fallen off the bus.") is None


@pytest.mark.parametrize(
    ("line", "to_value", "to_name", "action"),
    [
        ("Xid 154 GPU recovery action changed from 0x0 (None) to 0x2 (Node Reboot Required)", 2,
         "Node Reboot Required", Action.RESTART_BM),
        (recovery("0x3", "Drain P2P"), 3, "Drain P2P", Action.DRAIN_P2P),
        (recovery("0x4", "Drain  and Reset"), 4, "Drain  and Reset", Action.DRAIN_AND_RESET),
        ("GPU recovery action changed from 0x0 to 0x1", 1, "", Action.RESET_GPU),
        (recovery("0x5", "Recover IMEX Domain"), 5, "Recover IMEX Domain", None),
    ],
)  # fmt: skip
def test_parse_recovery_action(line, to_value, to_name, action):
    change = parse_recovery_action(line)
    assert change is not None
    assert (change.to_value, change.to_name, change.action) == (to_value, to_name, action)


@pytest.mark.parametrize(
    ("value", "action"),
    [(0, Action.IGNORE), (1, Action.RESET_GPU), (2, Action.RESTART_BM), (5, None), (99, None)],
)
def test_recovery_action_from_nvml(value, action):
    assert recovery_action_from_nvml(value) is action


@pytest.mark.parametrize(
    ("line", "link", "registers"),
    [
        ("NVLink: fatal error detected on link 14(0x0, 0x0, 0x10000, 0x0, 0x0, 0x0, 0x0)", 14,
         (0, 0, 0x10000, 0, 0, 0, 0)),
        ("NVRM: Xid (PCI:0000:c1:00): 74, pid='<unknown>', name=<unknown>, " + NVL74_BARE,
         1, ()),
    ],
)  # fmt: skip
def test_parse_nvlink_error(line, link, registers):
    parsed = parse_nvlink_error(line)
    assert parsed is not None and (parsed.link, parsed.registers) == (link, registers)


def test_decode_nvlink_registers():
    decoded = decode_nvlink_registers([0x1 | 1 << 4, 0, 1 << 13, 1 << 18, 1 << 20, 0, 0x80])
    assert decoded == {
        "ignorable": ["r1.b0"],
        "ecc_parity": ["r1.b4"],
        "not_expected": ["r3.b13"],
        "fabric_reset": ["r4.b18"],
        "ecc_threshold": ["r5.b20"],
        "undocumented": ["r7.b7"],
    }
    assert decode_nvlink_registers([0, 0, 0, 0, 0, 0, 0]) == {}


@pytest.mark.parametrize(
    ("line", "unit", "fatal", "link", "intr", "status"),
    [
        ("NVRM: Xid (PCI:0008:01:00): 149, NETIR_LINK_EVT Fatal XC0 i0 Link 08 (0x004505c6 0x00000000 0x0)",
         "NETIR_LINK_EVT", True, 8, 0x004505C6, 0),
        ("149, NETIR_BER_EVENT Nonfatal XC0 i0 Link 03 (0x00086226 0x00000001)", "NETIR_BER_EVENT", False, 3,
         0x00086226, 1),
        ("149, NETIR_LINK_EVT Fatal XC 1 i 2 Link 01 [0x0000000a]", "NETIR_LINK_EVT", True, 1, 0xA, None),
        ("NETIR_LINK_EVT Fatal Link 00 (0x016415c6)", "NETIR_LINK_EVT", True, 0, 0x016415C6, None),
    ],
)  # fmt: skip
def test_parse_nvlink5(line, unit, fatal, link, intr, status):
    parsed = parse_nvlink5(line)
    assert parsed is not None
    assert (parsed.unit, parsed.fatal, parsed.link, parsed.intr_info, parsed.error_status) == (
        unit,
        fatal,
        link,
        intr,
        status,
    )


def test_parse_nvlink5_none():
    assert parse_nvlink5("GSP RPC timeout") is None
