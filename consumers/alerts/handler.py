"""The alerts service: consume-loop handler, GpuAlert publishing, restore after restart, wiring.

Rules and reasons in full: docs/alerts.md, "Module notes", ``handler.py``.
"""

from __future__ import annotations

import heapq
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from gpupipe.clients.kube import KubeApiError
from gpupipe.common.logs import fields
from gpupipe.domain.node_check import DEADLETTER_REASON, NodeCheck
from gpupipe.kafka.sink import KeyedSink
from gpupipe_consumers.alerts.admission import OVER_CAP, DeviceAdmission, device_of
from gpupipe_consumers.alerts.cordon import Cordoner, CordonResult
from gpupipe_consumers.alerts.engine.alert_record import Alert, action_record, is_level, to_record
from gpupipe_consumers.alerts.engine.alert_table import AlertCapReached
from gpupipe_consumers.alerts.engine.evidence_memory import evidence_record
from gpupipe_consumers.alerts.engine.facade import EngineConfig, EngineFacade
from gpupipe_consumers.alerts.engine.health_signals import HealthConfig, HealthTracker, InvalidRecord
from gpupipe_consumers.alerts.engine.recovery_policy import sample_healthy
from gpupipe_consumers.alerts.open_alerts_view import order_key
from gpupipe_consumers.plumbing.consume_loop import InRecord
from gpupipe_consumers.plumbing.topic_reader import read_topic
from gpupipe_schemas.codec import AvroCodec

__all__ = ["AlertSink", "AlertsHandler", "ListSink", "kafka_alert_sink", "restore_from_topic"]

log = logging.getLogger("gpupipe.alerts")

#: The private group of the restore read (the ACL table grants it by prefix).
RESTORE_GROUP_PREFIX = "gpupipe-alerts-restore-"


class AlertSink(Protocol):
    def send(self, record: dict[str, Any]) -> None: ...
    def flush(self, timeout_s: float = 30.0) -> None: ...


class ListSink:
    """In-memory sink (tests, dry experiments)."""

    def __init__(self) -> None:
        self.records: list[dict[str, Any]] = []
        self._lock = threading.Lock()

    def send(self, record: dict[str, Any]) -> None:
        with self._lock:
            self.records.append(record)

    def flush(self, timeout_s: float = 30.0) -> None:
        return None


def kafka_alert_sink(
    bootstrap: str, topic: str, codec: AvroCodec, extra: dict[str, str] | None = None
) -> KeyedSink:
    """GpuAlert records to the alerts topic, keyed by alert id (the floor's outage-tolerant sink)."""
    return KeyedSink(
        bootstrap,
        topic,
        codec.encoder("GpuAlert", topic).encode,
        lambda rec: rec["alert_id"].encode(),
        what="alert records",
        extra=extra,
        log=log,
    )


def restore_from_topic(
    bootstrap: str,
    topic: str,
    codec: AvroCodec,
    lookback_ms: int,
    extra: dict[str, str] | None = None,
    timeout_s: float = 60.0,
    now_ms: int | None = None,
) -> list[dict[str, Any]]:
    """GpuAlert records of ``topic`` from ``now - lookback_ms`` up to the end as of now, oldest first
    (a topic not created yet holds none)."""
    now_ms = int(time.time() * 1000) if now_ms is None else now_ms
    out = read_topic(
        bootstrap,
        topic,
        codec,
        "GpuAlert",
        since_ms=now_ms - lookback_ms,
        extra=extra,
        timeout_s=timeout_s,
        missing_ok=True,
        group_prefix=RESTORE_GROUP_PREFIX,
    )
    out.sort(key=lambda r: (r["emitted_at_ms"], r["sequence"]))
    return out


class _ServiceCollector(Collector):
    def __init__(self, service: AlertsHandler) -> None:
        self._s = service

    def collect(self) -> Iterator[Any]:
        s = self._s
        counts = dict(s.engine.counts)
        adm = s.admission
        fam = CounterMetricFamily(
            "gpupipe_alerts_input", "Input handled by the alert engine, by result.", labels=["result"]
        )
        for k, v in sorted(counts.items()):
            fam.add_metric([k], v)
        yield fam
        known = GaugeMetricFamily(
            "gpupipe_alerts_known",
            "Nodes, devices and open alerts the service keeps state for, and their caps (--max-nodes, "
            "--max-devices, --max-open-alerts): at a node or device cap the least recently seen are "
            "forgotten (gpupipe_alerts_admission_total).",
            labels=["kind", "of"],
        )
        known.add_metric(["node", "known"], adm.nodes())
        known.add_metric(["node", "cap"], adm.max_nodes)
        known.add_metric(["device", "known"], adm.devices())
        known.add_metric(["device", "cap"], adm.max_devices)
        known.add_metric(["alert", "known"], s.open_alerts)
        known.add_metric(["alert", "cap"], s.engine.cfg.max_open_alerts)
        yield known
        ev = CounterMetricFamily(
            "gpupipe_alerts_admission",
            "What the node and device caps cost: nodes or devices forgotten (idle: no open alert; "
            "alerting: its open alerts dropped unpublished, the last resort against a flood) and "
            "records taken past a cap while every node held an open alert (over_cap).",
            labels=["result"],
        )
        for k, v in sorted(adm.counts.items()):
            ev.add_metric([k], v)
        yield ev
        open_fam = GaugeMetricFamily(
            "gpupipe_alerts_open", "Open (firing) alerts by scope.", labels=["scope"]
        )
        by_scope = s._open_by_scope
        for scope in ("gpu", "node", "nvswitch"):
            open_fam.add_metric([scope], by_scope.get(scope, 0))
        yield open_fam
        gpus = GaugeMetricFamily("gpupipe_alerts_health_gpus", "GPUs with health state from samples.")
        gpus.add_metric([], len(s.health))
        yield gpus
        if s.node_check is not None:
            yield s.node_check.family(
                "gpupipe_alerts_node_identity",
                "XidEvents and GpuSamples checked against the certificate of the node they name "
                "(--node-ca-file), by record, result (verified, or why not) and mode (enforce: refused "
                "XIDs are dead-lettered, refused samples dropped).",
            )
        if s.cordoner is not None:
            cf = CounterMetricFamily(
                "gpupipe_alerts_cordon", "Cordon decisions by outcome.", labels=["outcome", "dry_run"]
            )
            for outcome, n in sorted(s.cordoner.outcomes.items()):
                cf.add_metric([outcome, str(s.cordoner.dry_run).lower()], n)
            yield cf


class AlertsHandler:
    """Handler + publisher; thread-safe (the consume loop, the ticker and the cordon worker call in)."""

    def __init__(
        self,
        *,
        sink: AlertSink,
        engine_config: EngineConfig | None = None,
        health_config: HealthConfig | None = None,
        registry: CollectorRegistry | None = None,
        alertmanager: Any | None = None,
        cordoner: Cordoner | None = None,
        instance: str = "",
        clock: Callable[[], float] = time.time,
        reconcile_interval_ms: int = 10_000,
        admission: DeviceAdmission | None = None,
        node_check: NodeCheck | None = None,
    ) -> None:
        self.sink = sink
        self.admission = admission or DeviceAdmission()
        self.node_check = node_check
        self._capped_logged_ms = self._alert_cap_logged_ms = -60_000
        # Nodes whose drain alerts admission evicted: still cordoned, never released by --uncordon here
        # (oldest forgotten beyond twice --max-nodes; a restart restores their alerts from the topic).
        self._pinned: OrderedDict[str, None] = OrderedDict()
        self.reconcile_interval_ms = reconcile_interval_ms
        self._last_reconcile_ms = 0
        self.health = HealthTracker(health_config)
        self.engine = EngineFacade(engine_config, health=self.health.health, identity=self.health.identity)
        self.admission.node_busy = self.engine.table.host_busy
        self.admission.device_busy = self.engine.table.gpu_busy
        self.alertmanager = alertmanager
        self.cordoner = cordoner
        self.instance = instance
        self.clock = clock
        self.lock = threading.RLock()
        self.records_out: dict[str, int] = {}
        self.errors = 0
        self.last_emit_ms = 0
        self.open_alerts = 0
        self._open_by_scope: dict[str, int] = {}
        reg = registry if registry is not None else CollectorRegistry()
        self.m_records = Counter(
            "gpupipe_alerts_records", "GpuAlert records published, by status.", ["status"], registry=reg
        )
        self.m_latency = Histogram(
            "gpupipe_alerts_detection_latency_seconds",
            "Alerts raised by an XidEvent (XID, SXid, NVML's recovery-action and GPU-unavailable events): "
            "from the first event's own time stamp to the first firing record "
            "(emitted_at_ms - first_seen_ms).",
            buckets=(0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0),
            registry=reg,
        )
        self.m_errors = Counter(
            "gpupipe_alerts_record_errors",
            "Input records the engine could not use (logged; processing goes on).",
            ["topic"],
            registry=reg,
        )
        reg.register(_ServiceCollector(self))

    def now_ms(self) -> int:
        return int(self.clock() * 1000)

    # -------------------------------------------------------------------------------------- handler

    def on_assign(self, partitions: Sequence[tuple[str, int]]) -> None:
        return None

    def on_revoke(self, partitions: Sequence[tuple[str, int]]) -> None:
        # Alert state is per GPU, not per partition: one active instance owns every partition (the leader
        # with --ha; see gpupipe_consumers.alerts.leader), and a new leader restores from gpu.alerts.v1.
        return None

    def handle(self, records: Sequence[InRecord]) -> list[tuple[InRecord, str, str]]:
        """Apply a batch; returns the records to dead-letter (invalid content), which the loop does."""
        now = self.now_ms()
        rejected: list[tuple[InRecord, str, str]] = []
        with self.lock:
            for r in records:
                if r.name in ("XidEvent", "GpuSample"):
                    verified = False
                    if self.node_check is not None:
                        detail = self.node_check.refuse(r.name, r.value.get("hostname"), r.raw, now)
                        if detail is not None:
                            # an XID is dead-lettered; a sample (thousands a second from a fleet not yet
                            # signing) is counted only: it is well formed and stays in its topic
                            if r.name == "XidEvent":
                                rejected.append((r, DEADLETTER_REASON, detail))
                            continue
                        verified = self.node_check.last_verified
                    self._admit(r, verified, now)
                try:
                    if r.name == "XidEvent":
                        # XidEvents come from one topic: its partition and offset mark a replay
                        a = self.engine.on_xid(r.value, now, (r.partition, r.offset))
                        if a is not None and is_level(a.key[3]) and a.status == "firing":
                            # NVML's recovery-action event: the samples may never show the value
                            self.health.await_clear(a.hostname, a.device, a.key[3], a.last_seen_ms)
                    elif r.name == "GpuSample":
                        ident, signals = self.health.observe(r.value)
                        if ident is not None:  # None: a sample not tracked (a MIG slice's), no signals
                            for sig in signals:
                                try:
                                    self.engine.on_signal(sig.subject or ident, sig, now)
                                except AlertCapReached as exc:  # the sample's other signals still count
                                    self._capped(now, str(exc))
                            # a reboot or driver load may wait for this GPU
                            healthy = sample_healthy(r.value)
                            self.engine.sample_seen(ident, r.value["timestamp_ms"], healthy, now)
                    elif r.name == "GpuAlert":
                        self._on_alert_record(r.value, now)  # our own output: only acks matter
                    else:
                        rejected.append((r, "unexpected-record-type", f"{r.name} on {r.topic}"))
                except AlertCapReached as exc:  # well formed: counted, not dead-lettered
                    self._capped(now, str(exc))
                except Exception as exc:  # a record the engine cannot use must not stop the stream
                    self.errors += 1
                    self.m_errors.labels(r.topic).inc()
                    reason = "invalid-record" if isinstance(exc, InvalidRecord) else "alerts-error"
                    rejected.append((r, reason, f"{exc!r}"[:300]))
                    log.warning(
                        "record rejected",
                        extra=fields(
                            topic=r.topic, partition=r.partition, offset=r.offset, error=f"{exc!r}"[:300]
                        ),
                    )
            self._emit(self.engine.take(now), now)
        return rejected

    def _admit(self, r: InRecord, verified: bool, now: int) -> None:
        """Remember the record's node and device, forgetting what admission evicts for them (see
        :mod:`gpupipe_consumers.alerts.admission`), and make room in a full alert table: a new fault
        must open its alert whatever a flood left open."""
        host = r.value.get("hostname")
        self.admission.admit(host, device_of(r.value), verified=verified)
        if self.engine.table.full():
            self.admission.evict_alerting(host if isinstance(host, str) else None)
        self._forget_evicted(now)

    def _forget_evicted(self, now: int) -> None:
        evicted = self.admission.take_evicted()
        if not evicted:
            return
        hosts = [e.host for e in evicted if e.device is None]
        gpus = [(e.host, e.device) for e in evicted if e.device is not None]
        dropped = self.engine.forget(hosts, gpus)
        self.health.forget(frozenset(hosts), frozenset(gpus))
        am_forget = getattr(self.alertmanager, "forget", None)  # test doubles may lack it
        for a in dropped:
            if am_forget is not None:
                am_forget(a.alert_id)
            if a.drain_node:
                self._pinned.pop(a.hostname, None)
                self._pinned[a.hostname] = None
                if len(self._pinned) > OVER_CAP * self.admission.max_nodes:
                    del self._pinned[next(iter(self._pinned))]
        if dropped:
            self._open_by_scope = self.engine.open_count()
            self.open_alerts = sum(self._open_by_scope.values())
        alerting = [e for e in evicted if e.alerting]
        if alerting and now - self._capped_logged_ms >= 60_000:
            self._capped_logged_ms = now
            adm = self.admission
            log.warning(
                "nodes or devices with open alerts forgotten: caps reached (a flood of made-up names?)",
                extra=fields(
                    example=alerting[0].host[:253],
                    alerts_dropped=len(dropped),
                    nodes=adm.nodes(),
                    max_nodes=adm.max_nodes,
                    devices=adm.devices(),
                    max_devices=adm.max_devices,
                    evicted=dict(adm.counts),
                ),
            )

    def _capped(self, now: int, detail: str) -> None:
        """An occurrence refused at the open-alert cap (counted by the table): a line a minute at most."""
        if now - self._alert_cap_logged_ms >= 60_000:
            self._alert_cap_logged_ms = now
            log.warning(
                "occurrences that would open new alerts refused: open alerts at their cap",
                extra=fields(detail=detail, refused=self.engine.counts["capped_alert"]),
            )

    def _on_alert_record(self, rec: dict[str, Any], now: int) -> None:
        rem = rec.get("remediation") or {}
        if rec.get("status") == "action" and rem.get("kind") == "ack":
            a = self.engine.acknowledge(rec["alert_id"], now, rem.get("detail") or "")
            if a is not None:
                log.info("alert acknowledged", extra=fields(alert_id=a.alert_id, node=a.hostname))

    def tick(self) -> int:
        """Run the engine's timers and publish what is due; returns records published."""
        now = self.now_ms()
        with self.lock:
            self.engine.tick(now)
            out = self.engine.take(now)
            self._emit(out, now)
        if self.cordoner is not None and now - self._last_reconcile_ms >= self.reconcile_interval_ms:
            self.reconcile(now)
        return len(out)

    def reconcile(self, now: int | None = None) -> int:
        """Hand every open drain alert to the cordoner (desired state; see
        :mod:`gpupipe_consumers.alerts.cordon`)."""
        if self.cordoner is None:
            return 0
        now = self.now_ms() if now is None else now
        self._last_reconcile_ms = now
        with self.lock:
            drain = [to_record(a, now, self.instance) for a in self.engine.open_alerts() if a.drain_node]
            pinned = list(self._pinned)
        return self.cordoner.reconcile(drain, keep=pinned)

    def flush(self) -> int:
        """Publish every pending change now, throttled ones included (shutdown)."""
        now = self.now_ms()
        with self.lock:
            self.engine.tick(now)
            out = self.engine.take(now, force=True)
            self._emit(out, now)
        return len(out)

    def restore(
        self, records: Sequence[dict[str, Any]], ledger: Sequence[dict[str, Any]] | None = None
    ) -> int:
        """Rebuild open alerts from ``records`` and the cordon ledger from ``ledger`` (default: the same
        records; the command passes at least the rate-limit window however short ``--restore-lookback``)."""
        now = self.now_ms()
        with self.lock:
            n = self.engine.restore(records, now)
            # Restored nodes are known, least recently seen first and evictable like any other: forged
            # alerts restored from a flood must not keep new nodes out after a restart.
            for a in sorted(self.engine.open_alerts(), key=lambda a: a.last_seen_ms):
                self.admission.admit(a.hostname, a.device or None)
            self._forget_evicted(now)
            for rec in records:  # acks published while we were down (the engine ignores stale ones)
                self._on_alert_record(rec, now)
            open_alerts = [a.snapshot() for a in self.engine.open_alerts()]
            for a in open_alerts:
                if is_level(a.key[3]):
                    self.health.await_clear(a.hostname, a.device, a.key[3])
            self._emit(self.engine.take(now), now)
        if self.cordoner is not None:
            counted = self.cordoner.restore(ledger if ledger is not None else records, now)
            try:
                from_cluster = self.cordoner.restore_from_cluster(now)
            except KubeApiError as exc:
                from_cluster = 0
                log.warning("cannot read the cordon ledger from the cluster", extra=fields(error=str(exc)))
            log.info(
                "cordon ledger restored",
                extra=fields(cordons_in_window=counted + from_cluster, from_cluster=from_cluster),
            )
        self._open_by_scope = self.engine.open_count()
        self.open_alerts = sum(self._open_by_scope.values())
        if self.alertmanager is not None:
            for a in open_alerts:
                self.alertmanager.update(to_record(a, now, self.instance))
        log.info("alerts restored", extra=fields(open=n, records=len(records)))
        self.reconcile(now)  # requests lost with the previous process are asked again
        return n

    def open_alerts_snapshot(
        self, limit: int, timeout_s: float
    ) -> tuple[list[dict[str, Any]], int, int] | None:
        """The first ``limit`` open alerts in the page's order (:func:`order_key`) as ``GpuAlert`` records,
        how many are open, and when (ms): copied under the lock, turned into records outside it. The
        consume loop holds the lock while it waits for the broker to take its records (for as long as an
        outage lasts), so a reader waits at most ``timeout_s``; None past it."""
        if not self.lock.acquire(timeout=timeout_s):
            return None
        try:
            now = self.now_ms()
            alerts = self.engine.open_alerts()
            top = heapq.nsmallest(
                limit, alerts, key=lambda a: order_key(a.severity, a.first_seen_ms, a.alert_id)
            )
            snaps = [a.snapshot() for a in top]
        finally:
            self.lock.release()
        return [to_record(a, now, self.instance) for a in snaps], len(alerts), now

    # ------------------------------------------------------------------------------------- output

    def _emit(self, alerts: Sequence[Alert], now: int) -> None:
        """Publish revisions and the evidence the engine learnt (caller holds ``self.lock``: revisions of
        one alert go out in order). Evidence goes to the topic only (a restored instance reads it), never to
        Alertmanager or the cordoner."""
        evidence = self.engine.take_evidence()
        for ev in evidence:
            self.sink.send(evidence_record(ev, now, self.instance))
            self.records_out["action"] = self.records_out.get("action", 0) + 1
            self.m_records.labels("action").inc()
        if not alerts:
            if evidence:
                self.sink.flush()
            return
        self._open_by_scope = self.engine.open_count()  # for scrapes, which never take the lock
        self.open_alerts = sum(self._open_by_scope.values())
        for a in alerts:
            rec = to_record(a, now, self.instance)
            self.sink.send(rec)
            status = rec["status"]
            self.records_out[status] = self.records_out.get(status, 0) + 1
            self.m_records.labels(status).inc()
            from_event = rec["signal"] in ("xid", "sxid") or rec["first_event_id"] is not None
            if status == "firing" and rec["sequence"] == 1 and from_event:
                self.m_latency.observe(max(0.0, (now - rec["first_seen_ms"]) / 1000))
            if self.alertmanager is not None:
                self.alertmanager.update(rec)
            if self.cordoner is not None and status == "firing" and rec["drain_node"]:
                self.cordoner.request(rec)
        self.sink.flush()
        self.last_emit_ms = now

    def on_cordon_result(self, result: CordonResult) -> None:
        """Cordoner callback: publish the decision as a status ``action`` record."""
        rec = action_record(
            result.record,
            outcome=result.outcome,
            node=result.node,
            dry_run=result.dry_run,
            detail=result.detail,
            at_ms=result.at_ms,
        )
        rec["instance"] = self.instance
        with self.lock:
            self.sink.send(rec)
            self.records_out["action"] = self.records_out.get("action", 0) + 1
            self.m_records.labels("action").inc()
            self.sink.flush()
