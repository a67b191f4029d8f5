"""Consume-loop handler of the recommend service: Kafka sink, Prometheus series, Alertmanager adapter.

Thin I/O around :class:`~gpupipe_consumers.recommend.detector.IdleDetector`: each batch of ``GpuSample``
records goes through the detector partition by partition, the revisions it yields go to
``gpu.recommendations.v1`` (keyed by recommendation id, idempotent producer), to the Prometheus
collector's view of open recommendations, and, when configured, to Alertmanager at severity
``info``. Tracks of GPUs silent for ``--gone-after`` are resolved after every batch.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from gpupipe.clients.alertmanager import AmState, iso_ms
from gpupipe.common.logs import fields
from gpupipe.kafka.sink import KeyedSink
from gpupipe_consumers.plumbing.consume_loop import InRecord, Rejected
from gpupipe_consumers.recommend.detector import IdleDetector
from gpupipe_schemas.codec import AvroCodec
from gpupipe_schemas.records import GpuRecommendation

log = logging.getLogger("gpupipe.recommend")

ALERTNAME = "GpuIdleRecommendation"
_SERIES_LABELS = (
    "namespace",
    "pod",
    "owner",
    "team",
    "Hostname",
    "UUID",
    "GPU_I_PROFILE",
    "modelName",
    "action",
    "target",
)


def kafka_recommendation_sink(
    bootstrap: str, topic: str, codec: AvroCodec, extra: dict[str, str] | None = None
) -> KeyedSink:
    """GpuRecommendation records to their topic, keyed by recommendation id; a broker outage is
    waited out, as for alerts."""
    return KeyedSink(
        bootstrap,
        topic,
        codec.encoder("GpuRecommendation", topic).encode,
        lambda rec: rec["recommendation_id"].encode(),
        what="recommendation records",
        extra=extra,
        log=log,
    )


def am_shape(rec: dict[str, Any]) -> AmState:
    """A recommendation as an Alertmanager alert (severity info). One per pod and GPU: both belong
    to its labels."""
    gpu = rec["mig_uuid"] or rec["uuid"]
    labels = {
        "alertname": ALERTNAME,
        "severity": "info",
        "node": rec["hostname"],
        "cause_class": "idle",
        "scope": "gpu",
        "source": "gpupipe",
        "namespace": rec["namespace"],
        "pod": rec["pod"],
        "gpu_uuid": gpu,
    }
    annotations = {
        "summary": f"GPU idle for {rec['idle_seconds'] / 3600:.1f} h in {rec['namespace']}/{rec['pod']}",
        "description": rec["message"],
        "runbook": "Release the GPU, or move the workload to the suggested target (see description).",
        "alert_id": rec["recommendation_id"],
        "occurrences": str(rec["sequence"]),
        "first_seen": iso_ms(rec["idle_since_ms"]),
        "drain_node": "false",
        "action": rec["action"],
        "gpu_uuid": gpu,
        "gpu": "" if rec["gpu_index"] is None else str(rec["gpu_index"]),
        "namespace": rec["namespace"],
        "pod": rec["pod"],
        "pods": f"{rec['namespace']}/{rec['pod']}",
    }
    resolved = rec["timestamp_ms"] if rec["status"] == "resolved" else None
    return AmState(
        rec["recommendation_id"],
        rec["status"],
        labels,
        {k: v for k, v in annotations.items() if v},
        rec["idle_since_ms"],
        resolved,
    )


def _series_labels(rec: Mapping[str, Any]) -> list[str]:
    """Label values of an open recommendation's series, in ``_SERIES_LABELS`` order.

    ``team`` is the namespace where no team rule matched, as in chargeback's counters and the
    reports: the Chargeback dashboard's ``$team`` variable (from chargeback's counters) must select
    the recommendations of the same namespaces, not lose every unmapped one."""
    owner = f"{rec['owner_kind']}/{rec['owner_name']}" if rec.get("owner_name") else ""
    return [
        rec["namespace"],
        rec["pod"],
        owner,
        rec.get("team") or rec["namespace"],
        rec["hostname"],
        rec["mig_uuid"] or rec["uuid"],
        rec.get("mig_profile") or "",
        rec["model_name"],
        rec["action"],
        rec.get("target") or "",
    ]


class _OpenCollector(Collector):
    """Gauges over the open recommendations (one series per idle pod and GPU, gone when resolved), and
    the detector's bound on tracked GPUs."""

    def __init__(self, service: RecommendHandler) -> None:
        self.service = service

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        with self.service.lock:
            open_recs = list(self.service.open.values())
        idle = GaugeMetricFamily(
            "gpupipe_recommendation_idle_seconds",
            "How long an open idle-GPU recommendation's pod has held its GPU idle.",
            labels=_SERIES_LABELS,
        )
        hours = GaugeMetricFamily(
            "gpupipe_recommendation_gpu_hours_idle",
            "GPU-hours wasted so far by an open recommendation's idle pod.",
            labels=_SERIES_LABELS,
        )
        cost = GaugeMetricFamily(
            "gpupipe_recommendation_cost_wasted",
            "Cost of those GPU-hours at the price table's GPU-hour price (see the currency label).",
            labels=[*_SERIES_LABELS, "currency"],
        )
        saving = GaugeMetricFamily(
            "gpupipe_recommendation_saving_per_hour",
            "Cost per hour the suggested action saves.",
            labels=[*_SERIES_LABELS, "currency"],
        )
        det = self.service.detector
        tracked = GaugeMetricFamily(
            "gpupipe_recommendation_gpus",
            "GPU keys the detector tracks, and their cap (--max-gpus).",
            labels=["of"],
        )
        tracked.add_metric(["tracked"], len(det.tracks))
        tracked.add_metric(["cap"], det.cfg.max_gpus)
        yield tracked
        evicted = CounterMetricFamily(
            "gpupipe_recommendation_gpus_evicted",
            "GPU keys forgotten at --max-gpus, least recently sampled first (open recommendations "
            "resolved gone): a fleet larger than the cap, or samples for made-up UUIDs.",
            labels=[],
        )
        evicted.add_metric([], det.evicted)
        yield evicted
        count = GaugeMetricFamily(
            "gpupipe_recommendations_open", "Open idle-GPU recommendations by action.", labels=["action"]
        )
        by_action: dict[str, int] = {}
        for rec in open_recs:
            lab = _series_labels(rec)
            idle.add_metric(lab, rec["idle_seconds"])
            hours.add_metric(lab, rec["gpu_hours_idle"])
            cost.add_metric([*lab, rec["currency"]], rec["cost_wasted"])
            saving.add_metric([*lab, rec["currency"]], rec["saving_per_hour"] or 0.0)
            by_action[rec["action"]] = by_action.get(rec["action"], 0) + 1
        for action, n in sorted(by_action.items()):
            count.add_metric([action], n)
        yield from (idle, hours, cost, saving, count)


class RecommendHandler:
    """Consume-loop handler: samples in, recommendation revisions out."""

    def __init__(
        self,
        detector: IdleDetector,
        sink: Any,
        registry: CollectorRegistry,
        alertmanager: Any = None,
    ) -> None:
        self.detector = detector
        self.sink = sink
        self.alertmanager = alertmanager
        self.lock = threading.Lock()
        self.open: dict[str, GpuRecommendation] = {}  # recommendation id -> latest firing revision
        self.records_out = 0
        self.revisions = Counter(
            "gpupipe_recommendation_records",
            "GpuRecommendation revisions published, by status and action.",
            ["status", "action"],
            registry=registry,
        )
        registry.register(_OpenCollector(self))

    def restore(self, records: Sequence[GpuRecommendation]) -> int:
        n = self.detector.restore(records)
        latest: dict[str, GpuRecommendation] = {}
        for r in records:
            prev = latest.get(r["recommendation_id"])
            if prev is None or r["sequence"] >= prev["sequence"]:
                latest[r["recommendation_id"]] = r
        with self.lock:
            self.open = {k: r for k, r in latest.items() if r["status"] == "firing"}
        return n

    # -- Handler protocol --------------------------------------------------------------------------
    def on_assign(self, partitions: Sequence[tuple[str, int]]) -> None:
        return None

    def on_revoke(self, partitions: Sequence[tuple[str, int]]) -> None:
        self.detector.drop_partitions(p for _, p in partitions)

    def handle(self, records: Sequence[InRecord]) -> Sequence[Rejected] | None:
        rejected: list[Rejected] = []
        out: list[GpuRecommendation] = []
        observe = self.detector.observe
        for rec in records:
            if rec.name != "GpuSample":
                rejected.append((rec, "wrong_record_type", f"{rec.name} on a samples topic"))
                continue
            try:
                out.extend(observe(rec.value, rec.partition))
            except (KeyError, TypeError, ValueError) as exc:
                rejected.append((rec, "invalid_sample", f"{type(exc).__name__}: {exc}"))
        out.extend(self.detector.expire())
        self.publish(out)
        if out:  # delivered before the consume loop stores the batch's offsets: at least once
            self.sink.flush()
        return rejected

    def publish(self, revisions: Sequence[GpuRecommendation]) -> None:
        for rev in revisions:
            self.sink.send(rev)
            self.records_out += 1
            self.revisions.labels(rev["status"], rev["action"]).inc()
            with self.lock:
                if rev["status"] == "firing":
                    self.open[rev["recommendation_id"]] = rev
                else:
                    self.open.pop(rev["recommendation_id"], None)
            if self.alertmanager is not None:
                self.alertmanager.update(rev)
            log.info(
                "recommendation",
                extra=fields(
                    id=rev["recommendation_id"],
                    status=rev["status"],
                    sequence=rev["sequence"],
                    namespace=rev["namespace"],
                    pod=rev["pod"],
                    action=rev["action"],
                    target=rev["target"],
                    gpu_hours_idle=round(rev["gpu_hours_idle"], 4),
                ),
            )

    def flush(self) -> None:
        self.sink.flush()
