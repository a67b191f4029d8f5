"""Shared helpers of the classifier rules: ranks, runbooks and the per-event context :class:`_Ctx`."""

from __future__ import annotations

from collections.abc import Iterable

from gpupipe_consumers.alerts.rules.catalog import (
    Action,
    CauseClass,
    Severity,
    lookup,
    unknown_entry,
)
from gpupipe_consumers.alerts.rules.classify_model import (
    _GPU_KINDS,
    HOUR_MS,
    MINUTE_MS,
    Classification,
    ClassifyConfig,
    FaultEvent,
    GpuHealth,
    GpuXidHistory,
    XidRecord,
    _clean_name,
    _record_of,
)

# ------------------------------------------------------------------------------------------- helpers

# Higher = more disruptive / more human work. Used to combine and escalate decisions.
_ACTION_RANK = {
    Action.IGNORE: 0,
    Action.WORKFLOW_XID_45: 0,
    Action.RESTART_APP: 1,
    Action.CHECK_UVM: 1,
    Action.UPDATE_SWFW: 1,
    Action.RESTART_FM: 2,
    Action.DRAIN_P2P: 2,
    Action.XID_154: 2,
    Action.WORKFLOW_NVLINK5_ERR: 2,
    Action.RESTART_VM: 3,
    Action.RESET_GPU: 3,
    Action.WORKFLOW_XID_48: 4,
    Action.WORKFLOW_NVLINK_ERR: 4,
    Action.DRAIN_AND_RESET: 4,
    Action.BUS_RESET: 4,
    Action.RESTART_BM: 5,
    Action.SYSTEM_REBOOT: 5,
    Action.CHECK_MECHANICALS: 5,
    Action.RUN_DCGMEUD: 5,
    Action.RUN_FIELDDIAG: 5,
    Action.CONTACT_SUPPORT: 6,
}
_SEVERITY_RANK = {Severity.INFO: 0, Severity.WARNING: 1, Severity.CRITICAL: 2}
_RECOVERY_DEFAULTS = {  # (severity, drain) when an action comes from a recovery-action report
    Action.IGNORE: (Severity.INFO, False),
    Action.DRAIN_P2P: (Severity.WARNING, True),
    Action.RESET_GPU: (Severity.CRITICAL, True),
    Action.DRAIN_AND_RESET: (Severity.CRITICAL, True),
    Action.RESTART_BM: (Severity.CRITICAL, True),
    Action.BUS_RESET: (Severity.CRITICAL, True),
    Action.SYSTEM_REBOOT: (Severity.CRITICAL, True),
}
_RUNBOOK = {
    Action.RESET_GPU: "Cordon and drain the node (or stop every process on this GPU), reset it with "
    "nvidia-smi -r -i <gpu>, reboot if the reset fails.",
    Action.DRAIN_AND_RESET: "Cordon the node and let (or make) the jobs on this GPU finish, then reset it "
    "with nvidia-smi -r -i <gpu>; reboot if the reset fails.",
    Action.RESTART_BM: "Cordon and drain the node, then reboot it (power-cycle if a GPU stays missing).",
    Action.DRAIN_P2P: "Cordon the node: stop multi-GPU (NVLink peer-to-peer) jobs on this GPU; single-GPU "
    "jobs may continue. Reset the GPU once drained.",
    Action.BUS_RESET: "NVML asks for a reset of the GPU's PCIe bus, more than a GPU reset: cordon and drain "
    "the node, stop every process on this GPU, then reset the bus the GPU sits on (a PCIe secondary bus "
    "reset, through the platform's or BMC's tools); if that is not possible, reboot the node. A plain "
    "nvidia-smi -r may not clear it.",
    Action.SYSTEM_REBOOT: "NVML asks for a reboot of the whole system, not only of the GPU: cordon and "
    "drain the node, then reboot it (power-cycle if a GPU stays missing afterwards). A GPU or bus reset "
    "does not clear it.",
    Action.IGNORE: "No action required.",
}


def _fmt_ms(ms: int) -> str:
    if ms % HOUR_MS == 0:
        return f"{ms // HOUR_MS}h"
    if ms % MINUTE_MS == 0:
        return f"{ms // MINUTE_MS}min"
    if ms % 1000 == 0:
        return f"{ms // 1000}s"
    return f"{ms}ms"


def _who(pid: int | None, name: str | None) -> str:
    name = _clean_name(name)
    if pid is not None and name:
        return f"pid {pid} ({name})"
    if pid is not None:
        return f"pid {pid}"
    return name or "an unknown process"


class _Ctx:
    """The event, its catalog row and the history seen without the event itself."""

    __slots__ = ("cfg", "code", "event", "health", "info", "others", "resets")

    def __init__(
        self, event: FaultEvent, history: GpuXidHistory | None, health: GpuHealth, cfg: ClassifyConfig
    ) -> None:
        self.event = event
        self.code = event.effective_code
        self.health = health
        self.cfg = cfg
        if event.kind == "unknown":
            self.info = unknown_entry(self.code, "xid")
        else:
            self.info = lookup(self.code, "sxid" if event.kind == "sxid" else "xid")
        own = _record_of(event)
        self.others: tuple[XidRecord, ...] = (
            tuple(r for r in history.records() if r != own) if history is not None else ()
        )
        self.resets: tuple[int, ...] = history.resets() if history is not None else ()

    def gpu_records(self) -> Iterable[XidRecord]:
        return (r for r in self.others if r.kind in _GPU_KINDS)

    def before(self, codes: Iterable[int], window_ms: int) -> list[XidRecord]:
        """GPU records with one of ``codes`` in ``[ts - window, ts]``."""
        wanted = frozenset(codes)
        now = self.event.ts_ms
        return [r for r in self.gpu_records() if r.code in wanted and now - window_ms <= r.ts_ms <= now]

    def around(self, codes: Iterable[int] | None, window_ms: int) -> list[XidRecord]:
        """Records within ``window_ms`` either side: with ``codes``, GPU records with those codes; with
        ``codes=None``, any GPU or SXid record."""
        wanted = None if codes is None else frozenset(codes)
        now = self.event.ts_ms
        return [
            r
            for r in self.others
            if abs(r.ts_ms - now) <= window_ms
            and r.kind != "unknown"
            and (wanted is None or (r.code in wanted and r.kind in _GPU_KINDS))
        ]

    def prior_incidents(self, codes: Iterable[int]) -> int:
        """Earlier incidents of these codes within the recurrence window, not counting the current one.

        Reports closer than ``incident_gap_ms`` to the next one are one incident, so a burst (or the same
        fault seen by kmsg and NVML) is not a recurrence.
        """
        times = sorted((r.ts_ms for r in self.before(codes, self.cfg.recurrence_window_ms)), reverse=True)
        incidents, later = 0, self.event.ts_ms
        for t in times:
            if later - t >= self.cfg.incident_gap_ms:
                incidents += 1
            later = t
        return incidents

    def incidents_across_resets(self, codes: Iterable[int]) -> tuple[int, list[int]]:
        """Earlier incidents of these codes that a reset or reboot separates from this event, and the
        codes they had. A fault that repeats while the GPU waits for its reset is the same incident: a
        gap in time is no evidence that the reset was tried."""
        records = self.before(codes, self.cfg.recurrence_window_ms)
        if not records:
            return 0, []
        first = min(r.ts_ms for r in records)
        now = self.event.ts_ms
        resets = [t for t in self.resets if first < t <= now]
        # each reset closes the incident before it: count the resets that follow an earlier record
        count = sum(1 for t in resets if any(r.ts_ms < t for r in records))
        return min(count, self.prior_incidents(codes)), sorted({r.code for r in records})

    def result(
        self,
        rule: str,
        reason: str,
        *,
        action: Action | None = None,
        severity: Severity | None = None,
        drain: bool | None = None,
        cause: CauseClass | None = None,
        runbook: str | None = None,
        related: Iterable[int] = (),
    ) -> Classification:
        info = self.info
        codes = [self.code]
        for c in related:
            if c not in codes:
                codes.append(c)
        return Classification(
            codes=tuple(codes),
            kind=self.event.kind,
            name=info.name,
            severity=severity if severity is not None else info.severity,
            cause_class=cause if cause is not None else info.cause_class,
            action=action if action is not None else info.bucket,
            nvidia_action=info.nvidia_action,
            drain_node=drain if drain is not None else info.drain_node,
            reason=reason,
            runbook=runbook if runbook is not None else info.runbook,
            known=info.known,
            rule=rule,
        )

    def label(self) -> str:
        kind = "SXid" if self.event.kind == "sxid" else "XID"
        return f"{kind} {self.code} ({self.info.name})"
