"""The alert engine: classification, deduplication, node rollups and lifecycle (pure; time is passed in).

Inputs are decoded ``XidEvent`` dicts (:meth:`EngineFacade.on_xid`) and health-signal changes from samples
(:meth:`EngineFacade.on_signal`); :meth:`EngineFacade.tick` runs the
timers; :meth:`EngineFacade.take` hands out the alert revisions to publish. Every method takes ``now_ms``
(wall clock, injected): nothing here reads a clock, so tests drive hours of alert life in microseconds.

Rules and reasons in full: docs/alerts.md, "Module notes", ``engine/facade.py``.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from dataclasses import replace
from typing import Any

from gpupipe_consumers.alerts.engine.alert_policy import worse
from gpupipe_consumers.alerts.engine.alert_record import STICKY_ACTIONS, Alert, alert_from_record
from gpupipe_consumers.alerts.engine.alert_table import AlertTable, Key
from gpupipe_consumers.alerts.engine.config import EngineConfig
from gpupipe_consumers.alerts.engine.evidence_memory import Evidence, EvidenceMemory, evidence_from_record
from gpupipe_consumers.alerts.engine.fault_decisions import FaultDecisions, HealthFn, IdentityFn
from gpupipe_consumers.alerts.engine.gpu_histories import GpuHistories
from gpupipe_consumers.alerts.engine.health_signals import GpuIdentity, SignalEvent
from gpupipe_consumers.alerts.engine.input_guard import InputGuard
from gpupipe_consumers.alerts.engine.node_burst import NodeBursts
from gpupipe_consumers.alerts.engine.nvml_notices import NvmlNotices
from gpupipe_consumers.alerts.engine.recovery_evidence import RecoveryEvidence
from gpupipe_consumers.alerts.engine.signal_alerts import SignalAlerts
from gpupipe_consumers.alerts.engine.xid_intake import XidIntake

__all__ = ["STICKY_ACTIONS", "EngineConfig", "EngineFacade", "worse"]


def _unknown(host: str, device: str) -> None:
    return None


class EngineFacade:
    """See module doc. Wires the collaborators together and delegates to them; the collaborators are
    attributes for inspection, the methods here are the API. Not thread-safe: the service serialises
    calls."""

    def __init__(
        self,
        config: EngineConfig | None = None,
        *,
        health: HealthFn | None = None,
        identity: IdentityFn | None = None,
    ) -> None:
        self.cfg = config or EngineConfig()
        self.table = AlertTable(self.cfg)
        self.counts = self.table.counts
        self.memory = EvidenceMemory()  # boots, driver loads, GPU evidence, healthy samples
        self.histories = GpuHistories(self.cfg, self.memory)
        self.guard = InputGuard(self.table)
        self.decisions = FaultDecisions(self.table, self.histories, health or _unknown, identity or _unknown)
        self.evidence = RecoveryEvidence(self.table, self.histories, self.memory)
        self.bursts = NodeBursts(self.table)
        notices = NvmlNotices(self.table, histories=self.histories, recovery=self.evidence)
        self.xids = XidIntake(
            self.table,
            guard=self.guard,
            decisions=self.decisions,
            histories=self.histories,
            recovery=self.evidence,
            bursts=self.bursts,
            notices=notices,
        )
        self.signals = SignalAlerts(
            self.table, guard=self.guard, histories=self.histories, recovery=self.evidence, xids=self.xids
        )

    # ------------------------------------------------------------------------------------ queries

    def open_alerts(self) -> list[Alert]:
        return self.table.open_alerts()

    def get(self, key: Key) -> Alert | None:
        return self.table.get(key)

    def open_count(self) -> dict[str, int]:
        return self.table.open_count()

    def pending(self) -> int:
        return self.table.pending()

    # ------------------------------------------------------------------------------------- inputs

    def on_xid(
        self, ev: dict[str, Any], now_ms: int, position: tuple[int, int] | None = None
    ) -> Alert | None:
        """Fold one ``XidEvent`` into the alerts; returns the GPU/NVSwitch alert it landed in (``None`` for
        a duplicate). Raises :class:`~gpupipe_consumers.alerts.engine.health_signals.InvalidRecord` for an
        event without
        host or time.

        ``position``: (partition, offset) of the event in the XidEvent topic. An event at or before the
        position of the latest event counted in its alert (``Alert.last_input``, restored from the
        published record) is a replay after a restart and is not counted again: the consumer group's
        committed offsets may lag the published counts by whatever was processed after the last commit
        (a coordinator away for a minute after a broker restart), and the event ids remembered in memory
        are gone with the previous process."""
        return self.xids.on_xid(ev, now_ms, position)

    def on_signal(self, ident: GpuIdentity, sig: SignalEvent, now_ms: int) -> Alert | None:
        """Apply one health-signal change of one GPU (from
        :class:`~gpupipe_consumers.alerts.engine.health_signals.HealthTracker`)."""
        return self.signals.on_signal(ident, sig, now_ms)

    def sample_seen(self, ident: GpuIdentity, ts: int, healthy: bool, now_ms: int) -> list[Alert]:
        """A whole-GPU sample at ``ts``: see :meth:`RecoveryEvidence.sample_seen
        <gpupipe_consumers.alerts.engine.recovery_evidence.RecoveryEvidence.sample_seen>`."""
        return self.evidence.sample_seen(ident, ts, healthy, now_ms)

    def acknowledge(self, alert_id: str, now_ms: int, note: str = "") -> Alert | None:
        """An operator says the fault was dealt with (``gpupipe alerts --ack``): resolve the alert
        (``acknowledged``). Unknown or already resolved ids are ignored (acks replay after restarts)."""
        return self.evidence.acknowledge(alert_id, now_ms, note)

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
        """The GPU's own evidence of recovery at ``ts``: see :meth:`RecoveryEvidence.recovered
        <gpupipe_consumers.alerts.engine.recovery_evidence.RecoveryEvidence.recovered>`."""
        return self.evidence.recovered(host, device, ts, now_ms, detail, kind, uuid)

    def seen_boot(self, host: str, boot_id: str, ts: int, now_ms: int) -> list[Alert]:
        return self.evidence.seen_boot(host, boot_id, ts, now_ms)

    def driver_loaded(self, host: str, ts: int, now_ms: int, detail: str) -> list[Alert]:
        return self.evidence.driver_loaded(host, ts, now_ms, detail)

    def evaluate(self, a: Alert, now_ms: int) -> bool:
        return self.evidence.evaluate(a, now_ms)

    def pending_tick(self, a: Alert, now_ms: int) -> None:
        self.evidence.pending_tick(a, now_ms)

    def stale_recovery(self, host: str, device: str, ts: int) -> bool:
        return self.histories.stale_recovery(host, device, ts)

    def forget(self, hosts: Collection[str], gpus: Collection[tuple[str, str]] = ()) -> list[Alert]:
        """Drop everything held of ``hosts`` and of the devices ``gpus`` ((host, device) pairs), open
        alerts included, publishing nothing: the service's admission bound evicted them
        (:mod:`gpupipe_consumers.alerts.admission`). Returns the open alerts dropped."""
        hosts, gpus = frozenset(hosts), frozenset(gpus)
        dropped = self.table.forget(hosts, gpus)
        self.histories.forget(hosts, gpus)
        self.memory.forget(hosts, gpus)
        self.guard.forget(hosts)
        self.bursts.forget(hosts, gpus)
        self.xids.forget(hosts)
        return dropped

    # ------------------------------------------------------------------------------ timers, output

    def tick(self, now_ms: int) -> None:
        """Resolve alerts quiet for ``resolve_after_ms``; note GPUs not back in time; forget expired
        tombstones, sightings and burst members."""
        self.table.tick(now_ms, self.evidence.pending_tick)
        self.xids.expire(now_ms)
        self.bursts.expire(now_ms)

    def take(self, now_ms: int, *, force: bool = False) -> list[Alert]:
        """Revisions due for publishing (snapshots, in the order they changed); see module doc.

        ``force`` hands out every pending change regardless of the update interval (at shutdown, so
        that the published state, which a restart restores, is complete)."""
        return self.table.take(now_ms, force=force)

    def take_evidence(self) -> list[Evidence]:
        """Evidence learnt since the last call, to publish (see
        :mod:`gpupipe_consumers.alerts.engine.evidence_memory`)."""
        return self.evidence.take_evidence()

    # ----------------------------------------------------------------------------------- restore

    def restore(self, records: Iterable[dict[str, Any]], now_ms: int) -> int:
        """Rebuild open alerts from ``gpu.alerts.v1`` records (oldest first); returns alerts restored.

        The latest revision per alert id wins. Firing ones become open alerts (same id, sequence,
        counts); resolved ones within the reopen span become tombstones. Their first/last event ids are
        remembered as seen and their ``last_input`` marks the replayed XidEvents they counted already
        (:meth:`on_xid`), so replayed input does not count them twice. Evidence records (action records
        of kind ``evidence``) and the alerts' boot ids rebuild the evidence memory, and every restored open
        alert is matched against it (:meth:`evaluate`): the state and decisions of the instance that
        published them. Other action records are ignored here. Each collaborator rebuilds its own part.
        """
        latest: dict[str, dict[str, Any]] = {}
        records = list(records)
        for rec in records:
            ev = evidence_from_record(rec)
            if ev is not None:
                self.evidence.restore_evidence(ev)
        for rec in records:
            if rec.get("status") not in ("firing", "resolved"):
                continue
            prev = latest.get(rec["alert_id"])
            if prev is None or (rec["sequence"], rec["emitted_at_ms"]) >= (
                prev["sequence"],
                prev["emitted_at_ms"],
            ):
                latest[rec["alert_id"]] = rec
        for aid, rec in latest.items():  # an id raised again goes on from its latest sequence
            self.table.published_before(aid, int(rec["sequence"]))
        restored: set[str] = set()
        for rec in sorted(latest.values(), key=lambda r: r["first_seen_ms"]):
            try:
                a = alert_from_record(rec)
            except (KeyError, TypeError, ValueError):
                self.counts["invalid"] += 1
                continue
            self.guard.restored(a)  # ended alerts too: a replayed event must not raise them again
            self.evidence.restored(a)
            self.histories.restored(a)
            if a.status == "resolved":
                a.seen_at_ms = a.resolved_at_ms or now_ms
                # a fault after a recovery or an ack is a new incident, never a reopen
                ended = a.resolve_reason in ("recovered", "acknowledged")
                if not ended and now_ms - a.seen_at_ms <= self.cfg.dedupe_window_ms:
                    self.table.restore_closed(a)
                continue
            a.seen_at_ms = now_ms  # quiet time restarts: a restart is no evidence of anything
            if a.pending is not None:
                a.pending = replace(a.pending, set_at_ms=now_ms)  # the wait restarts, as quiet time does
            old = self.table.restore_open(a, now_ms)
            if old is not None:
                restored.discard(old.alert_id)
            self.bursts.restored(a)
            restored.add(a.alert_id)
        for a in self.table.open_alerts():
            self.evidence.evaluate(a, now_ms)
        return len(restored)
