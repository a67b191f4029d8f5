"""Evidence of recovery and operators' acks: what ends the sticky alerts that silence cannot end.

Which evidence ends which alert is one table, :mod:`gpupipe_consumers.alerts.engine.recovery_policy` (a reset
ends reset-class alerts, a reboot also reboot-class ones, only an ack or a replaced GPU ends
support/RMA-class ones). The evidence paths here apply it:

Rules and reasons in full: docs/alerts.md, "Module notes", ``engine/recovery_evidence.py``.
"""

from __future__ import annotations

from dataclasses import replace

from gpupipe_consumers.alerts.engine.alert_policy import with_note
from gpupipe_consumers.alerts.engine.alert_record import Alert, Pending, iso_ms
from gpupipe_consumers.alerts.engine.alert_table import AlertTable
from gpupipe_consumers.alerts.engine.evidence_memory import Evidence, EvidenceMemory
from gpupipe_consumers.alerts.engine.gpu_histories import GpuHistories
from gpupipe_consumers.alerts.engine.health_signals import GpuIdentity
from gpupipe_consumers.alerts.engine.recovery_policy import EVIDENCE_ENDS, NEEDS_SAMPLE, ends, recovery_class

__all__ = ["RecoveryEvidence"]

_REBOOT_SCOPES = frozenset({"gpu", "nvswitch"})


class RecoveryEvidence:
    """Applies evidence to the table's alerts; owns the evidence learnt and not yet published.

    The evidence memory is shared with :class:`~gpupipe_consumers.alerts.engine.gpu_histories.GpuHistories`,
    which seeds a new GPU's history with the resets it holds."""

    def __init__(self, table: AlertTable, histories: GpuHistories, memory: EvidenceMemory) -> None:
        self._table = table
        self._cfg = table.cfg
        self._counts = table.counts
        self._histories = histories
        self.memory = memory
        self._out: list[Evidence] = []  # evidence to publish (take_evidence)

    def take_evidence(self) -> list[Evidence]:
        """Evidence learnt since the last call, to publish (see
        :mod:`gpupipe_consumers.alerts.engine.evidence_memory`)."""
        out, self._out = self._out, []
        return out

    def end(self, a: Alert, now_ms: int, detail: str) -> None:
        """Resolve ``a`` as ``recovered``, saying by what."""
        a.description = (a.description + f" Recovered: {detail}.").strip()
        a.pending = None
        self._table.end(a, now_ms, "recovered")

    def recovered(
        self,
        host: str,
        device: str,
        ts: int,
        now_ms: int,
        detail: str = "",
        kind: str = "reset",
        uuid: str | None = None,
    ) -> list[Alert]:
        """The GPU's own evidence of ``kind`` (``reset``, ``gpu_back``, ``replaced``) at ``ts``: remember and
        publish it, record the reset in the GPU's history, and resolve (``recovered``) its open fault
        alerts from before ``ts`` that the evidence mends. Level signals the samples own have their own
        clear and are left alone (:func:`~gpupipe_consumers.alerts.engine.alert_policy.sample_owned`)."""
        ev = Evidence(kind, host, ts, detail, device=device, uuid=uuid)
        if self.memory.gpu_evidence(ev):
            self._out.append(ev)
        self._histories.get(host, device).record_reset(ts)
        out = []
        for a in self._table.gpu_alerts(host, device):
            if a.scope != "gpu" or a.sample_owned or a.last_seen_ms >= ts or not ends(kind, a):
                continue  # a fault at or after the evidence is not over
            self.end(a, now_ms, detail or kind)
            out.append(a)
        self._counts["recovered"] += len(out)
        return out

    def _node_evidence(self, a: Alert, kind: str, since: int, detail: str, now_ms: int) -> bool:
        """Apply node-wide evidence (``reboot``, ``driver_load``) at ``since`` to open alert ``a``: end it
        now, make it wait for a healthy sample of its GPU, or leave it (see recovery_policy)."""
        if a.scope not in _REBOOT_SCOPES or a.sample_owned or a.last_seen_ms > since:
            return False
        if kind == "driver_load" and a.scope != "gpu":
            return False  # NVSwitches are not the GPU driver's to re-initialise
        cls = recovery_class(a)
        if cls not in EVIDENCE_ENDS[kind]:
            return False
        if a.scope == "gpu" and cls != "app":
            if self._cfg.confirm_by_samples:
                seen = self.memory.healthy_since(a.hostname, a.device, since)
                if seen is None:
                    self._wait(a, Pending(kind, since, detail, now_ms))
                    return False
                detail = f"{detail}; the GPU was seen healthy at {iso_ms(seen)}"
            elif (kind, cls) in NEEDS_SAMPLE:
                return False  # nothing could show the GPU came back
        self.end(a, now_ms, detail)
        self._counts["recovered"] += 1
        return True

    def _wait(self, a: Alert, p: Pending) -> None:
        if a.pending is not None and a.pending.since_ms <= p.since_ms:
            return  # already waiting on earlier evidence: any sample after that one ends it
        a.pending = p
        a.description = with_note(
            a.description,
            f"Pending: {p.detail} at {iso_ms(p.since_ms)}; ends once a sample shows this GPU healthy "
            "after it.",
        )
        a.urgent = True
        self._table.dirty(a)

    def _reboot(self, a: Alert, now_ms: int) -> bool:
        """The reboot that followed ``a``'s fault, if one is known, applied to ``a``."""
        if a.boot_id is None or (a.pending is not None and a.pending.evidence == "reboot"):
            return False
        succ = self.memory.successor(a.hostname, a.boot_id, a.last_seen_ms)
        if succ is None:
            return False
        boot, since = succ
        detail = f"the node rebooted (boot id {a.boot_id} -> {boot})"
        return self._node_evidence(a, "reboot", since, detail, now_ms)

    def evaluate(self, a: Alert, now_ms: int) -> bool:
        """Match an alert just raised (or restored) against the evidence remembered after its fault, as if
        that evidence had been processed after it; True when that ended it."""
        if a.scope not in _REBOOT_SCOPES or a.sample_owned or a.status != "firing":
            return False
        if a.scope == "gpu":
            for ev in self.memory.gpu_after(a.hostname, a.device, a.last_seen_ms):
                if ends(ev.kind, a):
                    self.end(a, now_ms, ev.detail or ev.kind)
                    self._counts["recovered"] += 1
                    return True
        if self._reboot(a, now_ms):
            return True
        for ts, detail in self.memory.loads_after(a.hostname, a.last_seen_ms) if a.scope == "gpu" else ():
            text = f"the NVIDIA driver was loaded again ({detail})"
            if self._node_evidence(a, "driver_load", ts, text, now_ms):
                return True
        return False

    def seen_boot(self, host: str, boot_id: str, ts: int, now_ms: int) -> list[Alert]:
        """An event of ``host`` at ``ts`` carries ``boot_id``. When that is news (a boot id not seen
        before, or an earlier time for one: one dict lookup otherwise), remember and publish it, record
        the reboots in the node's GPU histories, and apply each reboot now known to the node's open
        alerts raised under an earlier boot (see module doc)."""
        memory = self.memory
        known = memory.earliest(host, boot_id)
        if known is not None and known <= ts:
            return []
        previous = memory.current_boot(host)
        memory.boot(host, boot_id, ts)
        if previous is not None and previous != boot_id and memory.current_boot(host) == boot_id:
            self._counts["reboots_seen"] += 1  # a newer boot than the one current so far
        earliest = memory.earliest(host, boot_id) or ts
        detail = f"{host} booted (boot id {boot_id})"
        self._out.append(Evidence("boot", host, earliest, detail, boot_id=boot_id))
        for t in memory.reboot_times(host):
            self._histories.reset_host(host, t)
        out = []
        for key in self._table.host_keys(host):
            a = self._table.get(key)
            if a is not None and self._reboot(a, now_ms):
                out.append(a)
        return out

    def driver_loaded(self, host: str, ts: int, now_ms: int, detail: str) -> list[Alert]:
        """The kernel log of ``host`` shows the NVIDIA driver loaded at ``ts``: every GPU was
        re-initialised -- a reset, no proof that a GPU came back. Remember and publish it, record the
        reset in the node's GPU histories, and apply it to the node's open alerts (see module doc)."""
        if self.memory.driver_load(host, ts, detail):
            self._out.append(Evidence("driver_load", host, ts, detail))
        self._histories.reset_host(host, ts)
        text = f"the NVIDIA driver was loaded again ({detail})"
        out = []
        for key in self._table.host_keys(host):
            a = self._table.get(key)
            if a is not None and self._node_evidence(a, "driver_load", ts, text, now_ms):
                out.append(a)
        self._counts["driver_loads"] += 1
        return out

    def sample_seen(self, ident: GpuIdentity, ts: int, healthy: bool, now_ms: int) -> list[Alert]:
        """A whole-GPU sample at ``ts`` (``healthy``: see
        :func:`~gpupipe_consumers.alerts.engine.recovery_policy.sample_healthy`): ends the GPU's alerts
        waiting for it
        after a reboot or driver load, and a new UUID in the slot is a replacement. Called for every
        sample: two dict lookups when the GPU has no open alert."""
        if not healthy:
            return []
        host, device = ident.hostname, ident.device
        key = (host, device)
        out: list[Alert] = []
        uuid = ident.uuid
        if uuid:
            before = self.memory.uuids.get(key)
            if before != uuid:
                self.memory.uuids[key] = uuid
                olds = (
                    {before}
                    if before
                    else {a.gpu_uuid for a in self._table.gpu_alerts(host, device) if a.gpu_uuid}
                )
                olds.discard(uuid)
                if olds:
                    detail = f"the GPU in this slot was replaced ({', '.join(sorted(olds))} -> {uuid})"
                    out += self.recovered(host, device, ts, now_ms, detail, kind="replaced", uuid=uuid)
        self.memory.healthy(host, device, ts)
        for a in self._table.gpu_alerts(host, device):
            p = a.pending
            if p is not None and p.since_ms <= ts:
                self.end(a, now_ms, f"{p.detail}; the GPU was seen healthy at {iso_ms(ts)}")
                self._counts["recovered"] += 1
                out.append(a)
        return out

    def pending_tick(self, a: Alert, now_ms: int) -> None:
        """An alert waiting too long for its GPU after node-wide evidence says so (it keeps waiting)."""
        p = a.pending
        if p is None or p.noted or now_ms - p.set_at_ms < self._cfg.confirm_within_ms:
            return
        a.pending = replace(p, noted=True)
        minutes = round((now_ms - p.set_at_ms) / 60_000)
        a.description = with_note(
            a.description,
            f"Not back: {p.detail} at {iso_ms(p.since_ms)}, and no sample has shown this GPU healthy since "
            f"(waited {minutes} min): it did not come back; check it (power-cycle, reseat, RMA).",
        )
        a.urgent = True
        self._table.dirty(a)

    def acknowledge(self, alert_id: str, now_ms: int, note: str = "") -> Alert | None:
        """An operator says the fault was dealt with (``gpupipe alerts --ack``): resolve the alert
        (``acknowledged``). Unknown or already resolved ids are ignored (acks replay after restarts)."""
        a = self._table.by_id(alert_id)
        if a is None or a.status != "firing":
            return None
        if note:
            a.description = f"{a.description} Acknowledged: {note}".strip()
        if a.scope == "gpu":  # the fault was dealt with: the same fault after it is a new incident
            self._histories.get(a.hostname, a.device).record_reset(now_ms)
        self._table.end(a, now_ms, "acknowledged")
        self._counts["acknowledged"] += 1
        return a

    # -------------------------------------------------------------------------------------- restore

    def restore_evidence(self, ev: Evidence) -> None:
        """Remember published evidence (not published again); the resets go into the GPUs' histories."""
        m = self.memory
        if ev.kind == "boot" and ev.boot_id:
            m.boot(ev.host, ev.boot_id, ev.at_ms)
            for t in m.reboot_times(ev.host):
                self._histories.reset_host(ev.host, t)
        elif ev.kind == "driver_load":
            m.driver_load(ev.host, ev.at_ms, ev.detail)
            self._histories.reset_host(ev.host, ev.at_ms)
        elif ev.device:
            m.gpu_evidence(ev)
            self._histories.get(ev.host, ev.device).record_reset(ev.at_ms)

    def restored(self, a: Alert) -> None:
        """A restored alert's boot id is evidence of that boot (node alerts carry none of their own)."""
        if a.boot_id is not None and a.scope != "node":
            self.memory.boot(a.hostname, a.boot_id, a.first_seen_ms)
