"""Evidence and restart for the alert engine: recovery and acks resolve sticky alerts; the state a restart
restores from ``gpu.alerts.v1``.

Which evidence ends which alert is one table, :mod:`consumers.alerts.recovery_policy` (a reset ends
reset-class alerts, a reboot also reboot-class ones, only an ack or a replaced GPU ends
support/RMA-class ones). The evidence paths here apply it:

* the GPU's own evidence (:meth:`EvidenceMixin.recovered`): a ``gpu_reset`` signal from the samples
  (counters restarted, recovery action back to none: ``reset``; the GPU back after lost: ``gpu_back``),
  NVML's recovery-action NONE event (``reset``), a healthy sample with a new UUID (``replaced``,
  :meth:`EvidenceMixin.sample_seen`): ends the GPU's alerts it mends at once;
* node-wide evidence from the kernel log: an event under a new boot id (:meth:`EvidenceMixin.seen_boot`:
  ``reboot``) and the driver's load line (:meth:`EvidenceMixin.driver_loaded`: ``driver_load``): ends the
  node's alerts it mends -- a GPU's only once a sample of that GPU at or after the evidence shows it
  healthy (until then ``Alert.pending``; :meth:`EvidenceMixin.sample_seen` ends it, the tick notes a GPU
  not seen within ``confirm_within_ms``);
* an operator's ack (:meth:`EvidenceMixin.acknowledge`).

Order does not matter (:mod:`consumers.alerts.evidence_memory`): evidence is remembered with its time,
and an alert raised by an event processed after evidence that followed it (:meth:`EvidenceMixin.evaluate`)
gets the same treatment as if it had come first. An event under a boot older than one already seen never
makes it the host's current boot again. The evidence is published, so a restored instance decides alike.

Level-signal alerts that only the samples raised are left to the samples' own clear; one an XidEvent
raised (the recovery-action event) is ended by evidence like any fault
(:func:`~consumers.alerts.alert_policy.sample_owned`).

A mixin of :class:`consumers.alerts.dedupe.AlertEngine` (it shares the engine's state); see that module's
doc, "Resolve by quiet", and :mod:`consumers.alerts.service`, "Restart".
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from consumers.alerts.alert_policy import rank, sample_owned, with_note
from consumers.alerts.alert_record import Alert, Pending, alert_from_record, iso_ms
from consumers.alerts.classify import FaultEvent, GpuXidHistory
from consumers.alerts.evidence_memory import Evidence, EvidenceMemory, evidence_from_record
from consumers.alerts.recovery_policy import EVIDENCE_ENDS, NEEDS_SAMPLE, ends, recovery_class

if TYPE_CHECKING:
    from consumers.alerts.engine_config import EngineConfig, Key
    from consumers.alerts.health_signals import GpuIdentity

__all__ = ["EvidenceMixin"]

_REBOOT_SCOPES = frozenset({"gpu", "nvswitch"})


class EvidenceMixin:
    """The engine's evidence and restore methods (state lives in the engine)."""

    cfg: EngineConfig
    counts: dict[str, int]
    _open: dict[Key, Alert]
    _closed: dict[Key, Alert]
    _ids: dict[str, Alert]
    _by_gpu: dict[tuple[str, str], set[Key]]
    _node_worst: dict[str, tuple[int, int, int]]
    _memory: EvidenceMemory
    _evidence_out: list[Evidence]
    _histories: dict[tuple[str, str], GpuXidHistory]

    def _history(self, host: str, device: str) -> GpuXidHistory: ...

    def _remember(self, eid: str) -> None: ...

    def _resolve(self, a: Alert, now_ms: int, reason: str) -> None: ...

    def _close(self, key: Key, a: Alert, *, keep: bool) -> None: ...

    def _dirty(self, a: Alert) -> None: ...

    def _restore_history(self, a: Alert) -> None:
        """What the classifier's recurrence rules need from a restored alert (review D11): its codes at
        its first and last occurrence, and a reset when it ended as recovered."""
        if a.scope != "gpu" or a.signal != "xid" or not a.codes:
            return
        h = self._history(a.hostname, a.device)
        for ts in {a.first_seen_ms, a.last_seen_ms}:
            h.record(
                FaultEvent(kind="xid", ts_ms=ts, code=a.codes[0], message="(restored from gpu.alerts.v1)")
            )
        if a.status == "resolved" and a.resolve_reason == "recovered" and a.resolved_at_ms:
            h.record_reset(a.resolved_at_ms)

    # ------------------------------------------------------------------------------------- evidence

    def take_evidence(self) -> list[Evidence]:
        """Evidence learnt since the last call, to publish (see :mod:`consumers.alerts.evidence_memory`)."""
        out, self._evidence_out = self._evidence_out, []
        return out

    def _host_keys(self, host: str) -> list[Key]:
        return [key for (h, _device), keys in self._by_gpu.items() if h == host for key in keys]

    def _host_resets(self, host: str, ts: int) -> None:
        for (h, _device), history in self._histories.items():
            if h == host:
                history.record_reset(ts)

    def _end(self, key: Key, a: Alert, now_ms: int, detail: str) -> None:
        a.description = (a.description + f" Recovered: {detail}.").strip()
        a.pending = None
        self._resolve(a, now_ms, "recovered")
        self._close(key, a, keep=False)

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
        clear and are left alone (:func:`~consumers.alerts.alert_policy.sample_owned`)."""
        ev = Evidence(kind, host, ts, detail, device=device, uuid=uuid)
        if self._memory.gpu_evidence(ev):
            self._evidence_out.append(ev)
        self._history(host, device).record_reset(ts)
        out = []
        for key in list(self._by_gpu.get((host, device), ())):
            a = self._open[key]
            if a.scope != "gpu" or sample_owned(a) or a.last_seen_ms >= ts or not ends(kind, a):
                continue  # a fault at or after the evidence is not over
            self._end(key, a, now_ms, detail or kind)
            out.append(a)
        self.counts["recovered"] += len(out)
        return out

    def _node_evidence(self, a: Alert, kind: str, since: int, detail: str, now_ms: int) -> bool:
        """Apply node-wide evidence (``reboot``, ``driver_load``) at ``since`` to open alert ``a``: end it
        now, make it wait for a healthy sample of its GPU, or leave it (see recovery_policy)."""
        if a.scope not in _REBOOT_SCOPES or sample_owned(a) or a.last_seen_ms > since:
            return False
        if kind == "driver_load" and a.scope != "gpu":
            return False  # NVSwitches are not the GPU driver's to re-initialise
        cls = recovery_class(a)
        if cls not in EVIDENCE_ENDS[kind]:
            return False
        if a.scope == "gpu" and cls != "app":
            if self.cfg.confirm_by_samples:
                seen = self._memory.healthy_since(a.hostname, a.device, since)
                if seen is None:
                    self._wait(a, Pending(kind, since, detail, now_ms), now_ms)
                    return False
                detail = f"{detail}; the GPU was seen healthy at {iso_ms(seen)}"
            elif (kind, cls) in NEEDS_SAMPLE:
                return False  # nothing could show the GPU came back
        self._end(a.key, a, now_ms, detail)
        self.counts["recovered"] += 1
        return True

    def _wait(self, a: Alert, p: Pending, now_ms: int) -> None:
        if a.pending is not None and a.pending.since_ms <= p.since_ms:
            return  # already waiting on earlier evidence: any sample after that one ends it
        a.pending = p
        a.description = with_note(
            a.description,
            f"Pending: {p.detail} at {iso_ms(p.since_ms)}; ends once a sample shows this GPU healthy "
            "after it.",
        )
        a.urgent = True
        self._dirty(a)

    def _reboot(self, a: Alert, now_ms: int) -> bool:
        """The reboot that followed ``a``'s fault, if one is known, applied to ``a``."""
        if a.boot_id is None or (a.pending is not None and a.pending.evidence == "reboot"):
            return False
        succ = self._memory.successor(a.hostname, a.boot_id, a.last_seen_ms)
        if succ is None:
            return False
        boot, since = succ
        detail = f"the node rebooted (boot id {a.boot_id} -> {boot})"
        return self._node_evidence(a, "reboot", since, detail, now_ms)

    def evaluate(self, a: Alert, now_ms: int) -> bool:
        """Match an alert just raised (or restored) against the evidence remembered after its fault, as if
        that evidence had been processed after it; True when that ended it."""
        if a.scope not in _REBOOT_SCOPES or sample_owned(a) or a.status != "firing":
            return False
        if a.scope == "gpu":
            for ev in self._memory.gpu_after(a.hostname, a.device, a.last_seen_ms):
                if ends(ev.kind, a):
                    self._end(a.key, a, now_ms, ev.detail or ev.kind)
                    self.counts["recovered"] += 1
                    return True
        if self._reboot(a, now_ms):
            return True
        for ts, detail in self._memory.loads_after(a.hostname, a.last_seen_ms) if a.scope == "gpu" else ():
            text = f"the NVIDIA driver was loaded again ({detail})"
            if self._node_evidence(a, "driver_load", ts, text, now_ms):
                return True
        return False

    def seen_boot(self, host: str, boot_id: str, ts: int, now_ms: int) -> list[Alert]:
        """An event of ``host`` at ``ts`` carries ``boot_id``. When that is news (a boot id not seen
        before, or an earlier time for one: one dict lookup otherwise), remember and publish it, record
        the reboots in the node's GPU histories, and apply each reboot now known to the node's open
        alerts raised under an earlier boot (see module doc)."""
        known = self._memory.earliest(host, boot_id)
        if known is not None and known <= ts:
            return []
        previous = self._memory.current_boot(host)
        self._memory.boot(host, boot_id, ts)
        if previous is not None and previous != boot_id and self._memory.current_boot(host) == boot_id:
            self.counts["reboots_seen"] += 1  # a newer boot than the one current so far
        earliest = self._memory.earliest(host, boot_id) or ts
        self._evidence_out.append(
            Evidence("boot", host, earliest, f"{host} booted (boot id {boot_id})", boot_id=boot_id)
        )
        for t in self._memory.reboot_times(host):
            self._host_resets(host, t)
        out = []
        for key in self._host_keys(host):
            a = self._open.get(key)
            if a is not None and self._reboot(a, now_ms):
                out.append(a)
        return out

    def driver_loaded(self, host: str, ts: int, now_ms: int, detail: str) -> list[Alert]:
        """The kernel log of ``host`` shows the NVIDIA driver loaded at ``ts``: every GPU was
        re-initialised -- a reset, no proof that a GPU came back. Remember and publish it, record the
        reset in the node's GPU histories, and apply it to the node's open alerts (see module doc)."""
        if self._memory.driver_load(host, ts, detail):
            self._evidence_out.append(Evidence("driver_load", host, ts, detail))
        self._host_resets(host, ts)
        text = f"the NVIDIA driver was loaded again ({detail})"
        out = []
        for key in self._host_keys(host):
            a = self._open.get(key)
            if a is not None and self._node_evidence(a, "driver_load", ts, text, now_ms):
                out.append(a)
        self.counts["driver_loads"] += 1
        return out

    def sample_seen(self, ident: GpuIdentity, ts: int, healthy: bool, now_ms: int) -> list[Alert]:
        """A whole-GPU sample at ``ts`` (``healthy``: see
        :func:`~consumers.alerts.recovery_policy.sample_healthy`): ends the GPU's alerts waiting for it
        after a reboot or driver load, and a new UUID in the slot is a replacement. Called for every
        sample: two dict lookups when the GPU has no open alert."""
        if not healthy:
            return []
        host, device = ident.hostname, ident.device
        key = (host, device)
        out: list[Alert] = []
        uuid = ident.uuid
        if uuid:
            before = self._memory.uuids.get(key)
            if before != uuid:
                self._memory.uuids[key] = uuid
                olds = (
                    {before}
                    if before
                    else {self._open[k].gpu_uuid for k in self._by_gpu.get(key, ()) if self._open[k].gpu_uuid}
                )
                olds.discard(uuid)
                if olds:
                    detail = f"the GPU in this slot was replaced ({', '.join(sorted(olds))} -> {uuid})"
                    out += self.recovered(host, device, ts, now_ms, detail, kind="replaced", uuid=uuid)
        self._memory.healthy(host, device, ts)
        for k in list(self._by_gpu.get(key, ())):
            a = self._open[k]
            p = a.pending
            if p is not None and p.since_ms <= ts:
                self._end(k, a, now_ms, f"{p.detail}; the GPU was seen healthy at {iso_ms(ts)}")
                self.counts["recovered"] += 1
                out.append(a)
        return out

    def pending_tick(self, a: Alert, now_ms: int) -> None:
        """An alert waiting too long for its GPU after node-wide evidence says so (it keeps waiting)."""
        p = a.pending
        if p is None or p.noted or now_ms - p.set_at_ms < self.cfg.confirm_within_ms:
            return
        a.pending = replace(p, noted=True)
        minutes = round((now_ms - p.set_at_ms) / 60_000)
        a.description = with_note(
            a.description,
            f"Not back: {p.detail} at {iso_ms(p.since_ms)}, and no sample has shown this GPU healthy since "
            f"(waited {minutes} min): it did not come back; check it (power-cycle, reseat, RMA).",
        )
        a.urgent = True
        self._dirty(a)

    def acknowledge(self, alert_id: str, now_ms: int, note: str = "") -> Alert | None:
        """An operator says the fault was dealt with (``gpupipe alerts --ack``): resolve the alert
        (``acknowledged``). Unknown or already resolved ids are ignored (acks replay after restarts)."""
        a = self._ids.get(alert_id)
        if a is None or a.status != "firing":
            return None
        if note:
            a.description = f"{a.description} Acknowledged: {note}".strip()
        self._resolve(a, now_ms, "acknowledged")
        self._close(a.key, a, keep=False)
        self.counts["acknowledged"] += 1
        return a

    # ----------------------------------------------------------------------------------- restore

    def restore(self, records: Iterable[dict[str, Any]], now_ms: int) -> int:
        """Rebuild open alerts from ``gpu.alerts.v1`` records (oldest first); returns alerts restored.

        The latest revision per alert id wins. Firing ones become open alerts (same id, sequence,
        counts); resolved ones within the reopen span become tombstones. Their first/last event ids are
        remembered as seen, so replayed input does not count them twice. Evidence records (action records
        of kind ``evidence``) and the alerts' boot ids rebuild the evidence memory, and every restored open
        alert is matched against it (:meth:`evaluate`): the state and decisions of the instance that
        published them. Other action records are ignored here.
        """
        latest: dict[str, dict[str, Any]] = {}
        records = list(records)
        for rec in records:
            ev = evidence_from_record(rec)
            if ev is not None:
                self._restore_evidence(ev)
        for rec in records:
            if rec.get("status") not in ("firing", "resolved"):
                continue
            prev = latest.get(rec["alert_id"])
            if prev is None or (rec["sequence"], rec["emitted_at_ms"]) >= (
                prev["sequence"],
                prev["emitted_at_ms"],
            ):
                latest[rec["alert_id"]] = rec
        restored: set[str] = set()
        for rec in sorted(latest.values(), key=lambda r: r["first_seen_ms"]):
            try:
                a = alert_from_record(rec)
            except (KeyError, TypeError, ValueError):
                self.counts["invalid"] += 1
                continue
            for eid in (a.first_event_id, a.last_event_id):
                if eid:
                    self._remember(eid)
            if a.boot_id is not None and a.scope != "node":
                self._memory.boot(a.hostname, a.boot_id, a.first_seen_ms)
            self._restore_history(a)
            if a.status == "resolved":
                a.seen_at_ms = a.resolved_at_ms or now_ms
                # a fault after a recovery or an ack is a new incident, never a reopen
                ended = a.resolve_reason in ("recovered", "acknowledged")
                if not ended and now_ms - a.seen_at_ms <= self.cfg.dedupe_window_ms:
                    self._closed[a.key] = a
                continue
            old = self._open.get(a.key)
            if old is not None:  # two open alerts for one key: keep the newer incident
                self._resolve(old, now_ms, "superseded")
                self._close(old.key, old, keep=False)
                restored.discard(old.alert_id)
            a.seen_at_ms = now_ms  # quiet time restarts: a restart is no evidence of anything
            self._open[a.key] = a
            self._ids[a.alert_id] = a
            self._by_gpu.setdefault((a.key[1], a.key[2]), set()).add(a.key)
            if a.scope == "node":
                self._node_worst[a.alert_id] = rank(a.severity, a.drain_node, a.action)
            if a.pending is not None:
                a.pending = replace(a.pending, set_at_ms=now_ms)  # the wait restarts, as quiet time does
            restored.add(a.alert_id)
        for a in list(self._open.values()):
            self.evaluate(a, now_ms)
        return len(restored)

    def _restore_evidence(self, ev: Evidence) -> None:
        """Remember published evidence (not published again); the resets go into the GPUs' histories."""
        m = self._memory
        if ev.kind == "boot" and ev.boot_id:
            m.boot(ev.host, ev.boot_id, ev.at_ms)
            for t in m.reboot_times(ev.host):
                self._host_resets(ev.host, t)
        elif ev.kind == "driver_load":
            m.driver_load(ev.host, ev.at_ms, ev.detail)
            self._host_resets(ev.host, ev.at_ms)
        elif ev.device:
            m.gpu_evidence(ev)
            self._history(ev.host, ev.device).record_reset(ev.at_ms)
