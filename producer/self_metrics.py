"""The producer's own Prometheus metrics: what it sent, failed, dropped, and how long collection took."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from gpupipe_producer.nvml.events import DELIVERIES


class _PublisherCollector(Collector):
    """Reads the Publisher's plain-int counters at scrape time, so the hot path never touches a lock."""

    def __init__(self, publisher: Any) -> None:
        self._p = publisher

    def collect(self) -> Iterator[CounterMetricFamily]:
        fam = CounterMetricFamily(
            "gpupipe_producer_records_sent", "Records acknowledged by Kafka.", labels=["topic"]
        )
        for topic, n in sorted(self._p.sent_by_topic.items()):
            fam.add_metric([topic], n)
        yield fam
        yield from ()


class ProducerMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.records_failed = Counter(
            "gpupipe_producer_records_failed",
            "Records Kafka did not acknowledge (delivery errors).",
            ["topic", "reason"],
            registry=r,
        )
        self.records_dropped = Counter(
            "gpupipe_producer_records_dropped",
            "Samples dropped from the bounded queue while the broker was unreachable (oldest first).",
            registry=r,
        )
        self.samples_built = Counter("gpupipe_producer_samples_built", "GpuSample records built.", registry=r)
        self.xid_events = Counter(
            "gpupipe_producer_xid_events", "XidEvent records built.", ["kind"], registry=r
        )
        self.tick_seconds = Histogram(
            "gpupipe_producer_tick_duration_seconds",
            "Wall time to build and hand over one tick of samples.",
            buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0),
            registry=r,
        )
        self.collect_seconds = Histogram(
            "gpupipe_producer_collect_duration_seconds",
            "Time spent in one collection of a field group.",
            ["group"],
            buckets=(0.0001, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.05, 0.1, 1.0),
            registry=r,
        )
        self.nvml_errors = Counter(
            "gpupipe_producer_nvml_errors", "NVML errors by kind.", ["kind"], registry=r
        )
        self.nvml_event_delivery = Counter(
            "gpupipe_producer_nvml_events",
            "NVML events received, by how they arrived: own_set (through the event set of the GPU the "
            "event names), other_set (through another GPU's set; still attributed to the GPU it names) "
            "or unresolved (NVML could not say which GPU: published without one).",
            ["delivery"],
            registry=r,
        )
        for how in DELIVERIES:  # each outcome is a series from the start, 0 until it happens
            self.nvml_event_delivery.labels(how)
        self.nvml_unsupported = Counter(
            "gpupipe_producer_nvml_unsupported",
            "NVML calls learned as unanswerable, per device, by call and reason (NoPermission means the "
            "agent lacks rights, FunctionNotFound an NVML binding or driver too old).",
            ["call", "reason"],
            registry=r,
        )
        self.operational_events = Gauge(
            "gpupipe_producer_operational_events_supported",
            "1 when the GPU is registered for NVIDIA GPU Operational Events (driver R615+), 0 when NVML "
            "refused them (why: gpupipe_producer_nvml_unsupported, call "
            "nvmlEventSetRegisterGpuOperationalEvents_v1: binding, FunctionNotFound, NotSupported).",
            ["gpu"],
            registry=r,
        )
        self.gpus_lost = Gauge(
            "gpupipe_producer_gpus_lost", "GPUs currently reported lost by NVML.", registry=r
        )
        self.dcgm_scrape_errors = Counter(
            "gpupipe_producer_dcgm_scrape_errors",
            "Failed scrapes of the node's dcgm-exporter (--dcgm-exporter-url), by kind: connect, timeout, "
            "http or parse.",
            ["kind"],
            registry=r,
        )
        self.kubelet_errors = Counter(
            "gpupipe_producer_kubelet_errors", "Failed kubelet PodResources List calls.", ["kind"], registry=r
        )
        self.spool_depth = Gauge(
            "gpupipe_producer_xid_spool_depth", "XID events spooled to disk awaiting Kafka.", registry=r
        )
        self.in_flight = Gauge(
            "gpupipe_producer_in_flight", "Records handed to librdkafka, not yet acknowledged.", registry=r
        )
        self.last_tick = Gauge(
            "gpupipe_producer_last_tick_timestamp_seconds", "Event time of the last tick.", registry=r
        )

    def watch_publisher(self, publisher: Any) -> None:
        self.registry.register(_PublisherCollector(publisher))
        self.in_flight.set_function(lambda: len(publisher))

    def operational_support(self, gpu: int, state: str) -> None:
        """The GPU's operational-event support; a refusal is also counted with its reason."""
        self.operational_events.labels(str(gpu)).set(1 if state == "supported" else 0)
        if state != "supported":
            self.nvml_unsupported.labels("nvmlEventSetRegisterGpuOperationalEvents_v1", state).inc()
