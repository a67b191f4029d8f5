"""Per-GPU XID histories for the classifier: the faults and the resets each GPU went through.

The recurrence rules (Xid 79 or 119/120 back after a reset, an application fault that follows its
workload) read them; the fault paths record faults, the evidence paths resets (a reset, a reboot, a
driver load). A history made for a GPU only now starts with the resets the evidence memory already
holds, so the order in which faults and evidence are processed does not matter
(:mod:`gpupipe_consumers.alerts.engine.evidence_memory`). Each history is bounded per cause, not per GPU
(:class:`~gpupipe_consumers.alerts.rules.classify_model.GpuXidHistory`): a flood of one kind of fault keeps
the records of the others the recurrence rules read.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

from gpupipe_consumers.alerts.engine.alert_record import Alert
from gpupipe_consumers.alerts.engine.config import EngineConfig
from gpupipe_consumers.alerts.engine.evidence_memory import EvidenceMemory
from gpupipe_consumers.alerts.rules.classify import FaultEvent, GpuXidHistory

__all__ = ["GpuHistories"]

_DEALT_WITH = frozenset({"recovered", "acknowledged"})


class GpuHistories:
    """One :class:`GpuXidHistory` per ``(host, device)``, made on first use."""

    def __init__(self, cfg: EngineConfig, memory: EvidenceMemory) -> None:
        self._horizon_ms = max(cfg.classify.recurrence_window_ms, cfg.dedupe_window_ms)
        self._memory = memory
        self._histories: dict[tuple[str, str], GpuXidHistory] = {}

    def get(self, host: str, device: str) -> GpuXidHistory:
        history = self._histories.get((host, device))
        if history is None:
            history = self._histories[(host, device)] = GpuXidHistory(horizon_ms=self._horizon_ms)
            for t in self._memory.resets(host, device):  # evidence processed before this GPU's faults
                history.record_reset(t)
        return history

    def all(self) -> Mapping[tuple[str, str], GpuXidHistory]:
        """Every GPU's history (the rule that looks for a workload's faults on the node's other GPUs)."""
        return self._histories

    def forget(self, hosts: Collection[str], gpus: Collection[tuple[str, str]]) -> None:
        """Drop the histories of ``hosts`` and of the devices ``gpus`` (evicted by admission)."""
        for key in [k for k in self._histories if k[0] in hosts] if hosts else []:
            del self._histories[key]
        for key in gpus:
            self._histories.pop(key, None)

    def reset_host(self, host: str, ts: int) -> None:
        """Every GPU of ``host`` was re-initialised at ``ts`` (a reboot, a driver load)."""
        for (h, _device), history in self._histories.items():
            if h == host:
                history.record_reset(ts)

    def stale_recovery(self, host: str, device: str, ts: int) -> bool:
        """A recovery action reported at ``ts`` is over already: the GPU has recovery evidence after it (a
        reset, reboot or driver load recorded in its history, the NONE event). Keeps a late sample or
        event from raising an alert for a GPU that is fine again. Evidence at the same time is not
        "after": the sample that shows a reset may show that the GPU still needs an action."""
        return any(r > ts for r in self.get(host, device).resets())

    def restored(self, a: Alert) -> None:
        """What the recurrence rules need from a restored alert: its codes at its first and last
        occurrence, and a reset when it ended as recovered or an operator acknowledged it (dealt with:
        the same fault after it is a new incident)."""
        if a.scope != "gpu" or a.signal != "xid" or not a.codes:
            return
        h = self.get(a.hostname, a.device)
        for ts in {a.first_seen_ms, a.last_seen_ms}:
            h.record(
                FaultEvent(kind="xid", ts_ms=ts, code=a.codes[0], message="(restored from gpu.alerts.v1)")
            )
        if a.status == "resolved" and a.resolve_reason in _DEALT_WITH and a.resolved_at_ms:
            h.record_reset(a.resolved_at_ms)
