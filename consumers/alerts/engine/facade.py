"""The alert engine: classification, deduplication, node rollups and lifecycle (pure; time is passed in).

Inputs are decoded ``XidEvent`` dicts (:meth:`EngineFacade.on_xid`) and health-signal changes from samples
(:meth:`EngineFacade.on_signal`); :meth:`EngineFacade.tick` runs the
timers; :meth:`EngineFacade.take` hands out the alert revisions to publish. Every method takes ``now_ms``
(wall clock, injected): nothing here reads a clock, so tests drive hours of alert life in microseconds.

Keys. One open alert per key ``(scope, hostname, device, signal)``: ``device`` is the canonical PCI bus id
(kernel-log ``0000:3b:00`` and NVML ``00000000:3B:00.0`` are one GPU; a MIG slice's fault is its GPU's),
``signal`` is ``xid:<code>`` (``fallen_off_bus`` / ``gpu_lost`` count as 79), ``sxid:<code>`` (scope
``nvswitch``), a health signal (``ecc_dbe``, ``thermal``...; NVML's recovery-action *event* shares the
``recovery_action`` one), ``gpu_unavailable`` (NVML's GPU-unavailable event; see
:mod:`gpupipe_consumers.alerts.engine.nvml_notices`) or ``node_burst`` (scope ``node``, device ``""``).

Lifecycle. Folding and recurrence compare the events' own times (``timestamp_ms``; more than
``max_future_skew_ms`` ahead of ``now_ms`` is taken as ``now_ms``); quiet periods are measured in
processing (wall) time, from when the latest occurrence was *processed* (``seen_at_ms``), so an event
processed late (consumer lag, an outage, a node clock behind) is never born resolved:

* **Dedupe**: an occurrence within ``dedupe_window_ms`` (D) of the open alert's latest occurrence folds into
  it: ``occurrences += 1``, ``last_seen_ms`` moves. Late (out-of-order) occurrences fold in too and may move
  ``first_seen_ms`` back. An occurrence more than D after the latest one is a *recurrence*. Within
  ``recurrence_horizon_ms`` (6 h) of the latest one, by the same job (or where either names none) and
  with no reset, reboot or driver load since, it continues the open alert (``occurrences += 1``, same
  id, no new notification): a job that hits the same fault every few minutes is one incident. Otherwise
  the open alert is resolved (``resolve_reason="superseded"``) and a new alert (new id) starts -- but
  a sticky alert (below) with no recovery attempt since is continued by any job's recurrence however
  late: its GPU is still broken, and a lesser XID must not end its drain. Either
  way the classifier sees the history and may escalate (e.g. Xid 79 or 119/120 coming back after a
  reset, which always starts a new alert).
* **History, not faults**: an XID whose own time is more than ``max_event_age_ms`` (6 h) before
  ``now_ms`` feeds the GPU's history (recurrence rules) and opens, folds into or drains nothing (counted
  ``stale_event``). A kernel-log backlog read again without its cursor (the first start of a producer
  with cursors on a node, a lost or unwritable cursor) re-publishes every XID of the boot with its
  original time; a week-old Xid 79 of a GPU reset since must not drain its node. The price: a real fault
  delivered more than that late (producer spool held through a longer Kafka outage, a node clock hours
  behind) is not raised either.
* **Duplicates** are not occurrences: an ``event_id`` seen before (producer retry, replay after a
  rebalance or restart; the last ``event_id_memory`` ids are remembered), and the second sighting of one
  Xid by the producer's two sources (``nvml`` and ``kmsg`` records of the same key within
  ``sighting_merge_ms``, which the producer failed to merge). A double sighting still contributes what
  it knows (the kernel line's message and pid may change the classification; NVML's UUID).
* **Resolve by quiet**: an alert with no occurrence processed for ``resolve_after_ms`` (R) resolves
  (``quiet``) -- unless it is *sticky*: a GPU fault whose action needs a reset, reboot or RMA
  (:func:`sticky`: drain alerts and actions RESET_GPU, RESTART_BM, RESTART_VM, DRAIN_AND_RESET). Such a
  GPU does not repeat its Xid while it sits broken, so silence is no evidence; it stays firing until
  evidence of recovery that mends its action class (one table,
  :mod:`gpupipe_consumers.alerts.engine.recovery_policy`:
  a reset ends reset-class alerts, a reboot also reboot-class ones, only an ack or a replaced GPU
  support/RMA-class ones): the GPU's own (a ``gpu_reset`` signal from the samples, NVML's recovery
  action back to none, a new UUID in the slot: reason ``recovered``), the kernel log's (an event of the
  node under a new boot id: it rebooted; the driver's load line, XidEvent kind ``driver_loaded``),
  which ends a GPU's alert once a sample shows that GPU healthy after it (``Alert.pending`` until then;
  see :mod:`gpupipe_consumers.alerts.engine.recovery_evidence`), or an operator's acknowledgement
  (:meth:`EngineFacade.acknowledge`, ``gpupipe alerts --ack ALERT_ID``: reason ``acknowledged``), as
  NVSentinel and GPUd do. Evidence is remembered with its time: a fault processed after evidence that
  followed it is treated as if it had come first (:mod:`gpupipe_consumers.alerts.engine.evidence_memory`).
  Application-class alerts still expire by quiet time.
  Level health signals also resolve when the sample says the condition cleared (``cleared``); the
  samples alone raise and end them, except a ``recovery_action`` alert NVML's event spoke for, which is
  sticky (:func:`~gpupipe_consumers.alerts.engine.alert_policy.sample_owned`). When R < D a resolved alert is
  remembered until D after its last occurrence, and an occurrence in that span *reopens* it (same id,
  status firing again) instead of raising a new one.
* **Node burst**: when occurrences on at least ``node_burst_gpus`` distinct GPUs of one node fall within
  ``node_burst_window_ms``, a node-level alert (``GpuNodeXidStorm``) opens; the GPU alerts keep existing as
  detail and name it in ``parent_alert_id``. Only faults above info that are not job-kill codes (Xid
  43/45) count: killing a multi-GPU job is no node fault. While it is open, every such occurrence on that
  node folds into it (its GPUs, codes, worst severity/action and drain flag accumulate); it resolves after
  ``min(R, D)`` quiet, so it never outlives the span in which it absorbs faults -- unless one of its
  members is sticky and still firing: then it stays open as long as they do and goes on absorbing the
  node's faults (Alertmanager inhibits the members under it; resolving it first would page them again).
* **Classification** (:func:`~gpupipe_consumers.alerts.rules.classify.classify`, per GPU history and health
snapshot) runs
  for every occurrence; an alert keeps the *worst* decision seen (severity, then drain, then action rank):
  it may escalate, never de-escalate, while open.

Emission (:meth:`take`): a new alert, a status change (resolved, reopened) and an escalation are *urgent*
and published at the next :meth:`take`; other changes (count, last seen, pods, parent) at most once per
``update_interval_ms`` per alert (the latest state; the resolved record always carries the final counts).
A level signal seen again in a sample (and a lost GPU's sample) moves ``last_seen_ms`` without a
revision: that is no change, and one open level alert would otherwise publish one record per update
interval for as long as the condition holds. Every open alert unchanged for ``keepalive_ms`` (6 h) is
published again as it is (keep-alive): a restart restores the open alerts from the last
``--restore-lookback`` (24 h) of ``gpu.alerts.v1``, and a sticky alert that has not changed for days must
be among them, or Alertmanager would expire it and ``--uncordon`` release its still broken node. Each
published revision increments ``sequence``.

Parts. :class:`EngineFacade` is the façade the service drives; the work is done by collaborators that each
own their state and share one :class:`~gpupipe_consumers.alerts.engine.alert_table.AlertTable` (the alerts by
key and id, the revisions to publish, the counts) and the
:class:`~gpupipe_consumers.alerts.engine.alert_table.EngineConfig`:

* :class:`~gpupipe_consumers.alerts.engine.xid_intake.XidIntake` folds XidEvents (it owns their double
sightings) and hands
  NVML's notice kinds to :class:`~gpupipe_consumers.alerts.engine.nvml_notices.NvmlNotices`;
* :class:`~gpupipe_consumers.alerts.engine.signal_alerts.SignalAlerts` folds health-signal changes;
* :class:`~gpupipe_consumers.alerts.engine.recovery_evidence.RecoveryEvidence` applies evidence and acks (the
evidence
  memory, the evidence to publish);
* :class:`~gpupipe_consumers.alerts.engine.node_burst.NodeBursts` rolls GPU faults up into node alerts;
* :class:`~gpupipe_consumers.alerts.engine.fault_decisions.FaultDecisions` classifies occurrences,
  :class:`~gpupipe_consumers.alerts.engine.gpu_histories.GpuHistories` keeps what the classifier remembers
  per GPU, and
  :class:`~gpupipe_consumers.alerts.engine.input_guard.InputGuard` drops duplicates and replays.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from dataclasses import replace
from typing import Any

from gpupipe_consumers.alerts.engine.alert_policy import STICKY_ACTIONS, sticky, worse
from gpupipe_consumers.alerts.engine.alert_record import Alert, alert_from_record
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

__all__ = ["STICKY_ACTIONS", "EngineConfig", "EngineFacade", "sticky", "worse"]


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
        notices = NvmlNotices(
            self.table,
            guard=self.guard,
            decisions=self.decisions,
            histories=self.histories,
            recovery=self.evidence,
            bursts=self.bursts,
        )
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
