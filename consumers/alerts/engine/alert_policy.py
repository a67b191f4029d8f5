"""What the alert engine decides by (pure): decision ranks, which XIDs feed node bursts or follow
another fault, the workload of an event.

Split out of :mod:`gpupipe_consumers.alerts.engine.facade` so the engine module keeps to its state machine.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import replace

from gpupipe_consumers.alerts.engine.alert_record import Alert
from gpupipe_consumers.alerts.rules.catalog import Action, CauseClass, Severity
from gpupipe_consumers.alerts.rules.classify_model import Classification, GpuXidHistory

__all__ = [
    "BURST_SIGNALS",
    "FOLLOWER_CODES",
    "JOB_KILL_CODES",
    "MEMORY_FOLLOWER_CODES",
    "counts_toward_burst",
    "merge_codes",
    "rank",
    "unless_elsewhere",
    "with_note",
    "worse",
]

_SEVERITY_RANK = {"info": 0, "warning": 1, "critical": 2}
# Higher = more disruptive or more human work; decides which action a merged alert shows.
_ACTION_RANK = {
    "UNKNOWN": -1,
    "IGNORE": 0,
    "WORKFLOW_XID_45": 0,
    "RESTART_APP": 1,
    "CHECK_UVM": 1,
    "UPDATE_SWFW": 1,
    "RESTART_FM": 2,
    "DRAIN_P2P": 2,
    "XID_154": 2,
    "WORKFLOW_NVLINK5_ERR": 2,
    "RESTART_VM": 3,
    "RESET_GPU": 3,
    "WORKFLOW_XID_48": 4,
    "WORKFLOW_NVLINK_ERR": 4,
    "DRAIN_AND_RESET": 4,
    "BUS_RESET": 4,
    "RESTART_BM": 5,
    "SYSTEM_REBOOT": 5,
    "CHECK_MECHANICALS": 5,
    "RUN_DCGMEUD": 5,
    "RUN_FIELDDIAG": 5,
    "CONTACT_SUPPORT": 6,
}


def rank(severity: str, drain: bool, action: str) -> tuple[int, int, int]:
    return (_SEVERITY_RANK.get(severity, 1), int(drain), _ACTION_RANK.get(action, 0))


def worse(a: tuple[str, bool, str], b: tuple[str, bool, str]) -> bool:
    """True when decision ``a`` (severity, drain, action) is worse than ``b``."""
    return rank(*a) > rank(*b)


# Xid 43 (job stopped, GPU healthy) and 45 (channels torn down: a job killed or preempted) are what every
# multi-GPU job kill logs on each of its GPUs; they never make or feed a node burst.
JOB_KILL_CODES = frozenset({43, 45})


# GPU faults without an XID code that count toward a node burst like one (NVML's GPU-unavailable event).
BURST_SIGNALS = frozenset({"gpu_unavailable"})


def counts_toward_burst(a: Alert) -> bool:
    """A GPU alert counts toward a node burst when it is more than info and not a job-kill code; of the
    alerts without a code, only :data:`BURST_SIGNALS` (health signals are conditions, not bursts)."""
    if a.severity == "info":
        return False
    return a.codes[0] not in JOB_KILL_CODES if a.codes else a.signal in BURST_SIGNALS


# Xid 45 and 154 follow another fault on the same GPU: they fold into its alert (see _follows).
# 63 and 64 (a row remapped, or remapping failed) are the page retirement of a memory fault logged
# right after it (48, 94, 95): they fold into that fault's alert; alone they are alerts of their own.
MEMORY_FOLLOWER_CODES = frozenset({63, 64, 154})
FOLLOWER_CODES = frozenset({45}) | MEMORY_FOLLOWER_CODES


def with_note(text: str, note: str) -> str:
    return text if note in text else f"{text} {note}".strip()


def merge_codes(have: tuple[int, ...], new: Iterable[int]) -> tuple[int, ...]:
    out = list(have)
    for c in new:
        if c not in out:
            out.append(c)
    return tuple(out)


def unless_elsewhere(
    c: Classification,
    history: GpuXidHistory,
    histories: Mapping[tuple[str, str], GpuXidHistory],
    gpu: tuple[str, str],
    ts: int,
    window_ms: int,
) -> Classification:
    """WORKFLOW_XID_31 "MMU faults ... to diff GPU: CHECK_APP/CUDA": when the workloads that hit this GPU
    also hit another GPU of the node, they are the common factor, not this GPU. Called only on
    an escalation, so the scan over the node's GPUs is rare."""
    host, device = gpu
    mine = {r.workload for r in history.records() if r.code in (13, 31) and r.workload}
    for (h, d), other in histories.items():
        if h != host or d == device:
            continue
        shared = {
            r.workload
            for r in other.records()
            if r.code in (13, 31) and r.workload in mine and abs(ts - r.ts_ms) <= window_ms
        }
        if shared:
            return replace(
                c,
                action=Action.RESTART_APP,
                severity=Severity.WARNING,
                drain_node=False,
                cause_class=CauseClass.APPLICATION,
                rule="app_fault.workloads_fault_elsewhere",
                reason=f"{c.reason} But {', '.join(sorted(shared)[:3])} also faulted on GPU {d} of {host}: "
                "the workloads, not this GPU, are the common factor. [CAT] WORKFLOW_XID_31 'to diff GPU: "
                "CHECK_APP/CUDA'.",
                runbook="Hand it to the owners of those workloads (CUDA error checking, compute-sanitizer); "
                "the GPU needs nothing.",
            )
    return c
