"""The node agent's own metrics read at scrape time (plain ints on the hot paths, no locks).

Everything the agent cannot open or had to degrade is visible here, next to a log line: the
kernel log (``input_errors{input="kmsg",reason}``), the kubelet (``source_up``), the spool
(``xid_spool_on_disk``, ``xid_spool_write_errors``), a stalled collection (``nvml_stalled_gpus``).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector


class AgentCollector(Collector):
    def __init__(self, agent: Any) -> None:
        """``agent``: the :class:`producer.node_agent.NodeAgent` (not imported: it imports us)."""
        self._a = agent

    def collect(self) -> Iterator[Any]:
        a = self._a
        st = a.kmsg_stats()
        kin = a.kmsg_input
        yield CounterMetricFamily(
            "gpupipe_producer_kmsg_lines", "Kernel-log lines read.", value=st.get("lines", 0)
        )
        yield CounterMetricFamily(
            "gpupipe_producer_kmsg_malformed_lines",
            "Kernel-log lines that looked like an Xid report, or kmsg records, that did not parse.",
            value=(kin.malformed if kin else 0) + st.get("malformed", 0),
        )
        yield CounterMetricFamily(
            "gpupipe_producer_kmsg_overruns",
            "Times /dev/kmsg overwrote records before the agent read them.",
            value=st.get("overrun", 0),
        )
        yield CounterMetricFamily(
            "gpupipe_producer_kmsg_skipped_records",
            "Kernel-log records skipped at start because the persisted cursor had handled them.",
            value=st.get("skipped", 0),
        )
        errs = CounterMetricFamily(
            "gpupipe_producer_input_errors",
            "Inputs the agent could not open or read, by input and reason (errno name).",
            labels=["input", "reason"],
        )
        if kin is not None:
            for reason, n in sorted(kin.errors.items()):
                errs.add_metric(["kmsg", reason], n)
        if a.cursor is not None and a.cursor.errors:
            errs.add_metric(["kmsg_cursor", "write"], a.cursor.errors)
        yield errs
        yield CounterMetricFamily(
            "gpupipe_producer_xid_merged",
            "XIDs seen by both NVML and the kernel log and sent as one event.",
            value=a.xid_merged,
        )
        spool = a.sender.spool if a.sender is not None else None
        yield CounterMetricFamily(
            "gpupipe_producer_xid_spool_dropped",
            "XID events dropped because the spool exceeded --spool-max-bytes (oldest first).",
            value=spool.dropped if spool is not None else 0,
        )
        yield CounterMetricFamily(
            "gpupipe_producer_xid_spool_damaged",
            "Damaged spool records skipped at load (bad checksum or garbage); never replayed.",
            value=(spool.damaged + spool.torn) if spool is not None else 0,
        )
        yield CounterMetricFamily(
            "gpupipe_producer_xid_spool_write_errors",
            "Failed spool disk operations (unwritable directory, full disk); events kept in memory.",
            value=spool.write_errors if spool is not None else 0,
        )
        yield GaugeMetricFamily(
            "gpupipe_producer_xid_spool_on_disk",
            "1 when XIDs are spooled to disk, 0 while they are kept in memory only.",
            value=1 if spool is not None and spool.on_disk else 0,
        )
        yield CounterMetricFamily(
            "gpupipe_producer_encode_errors",
            "Records that did not match their schema.",
            value=a.encode_errors,
        )
        yield GaugeMetricFamily(
            "gpupipe_producer_nvml_stalled_gpus",
            "GPUs whose NVML calls did not return within --nvml-timeout (left out until they do).",
            value=a.stalled_gpus(),
        )
        gpus = GaugeMetricFamily(
            "gpupipe_producer_gpus",
            "GPUs of this node by state: ok, lost (NVML says GPU_IS_LOST), unusable (NVML could not "
            "open it at start). No GPU at all makes /healthz unhealthy.",
            labels=["state"],
        )
        src = a.source
        if src is not None:
            known, lost = len(src.gpus()), len(src.lost_gpus)
            gpus.add_metric(["ok"], known - lost)
            gpus.add_metric(["lost"], lost)
            gpus.add_metric(["unusable"], src.unusable_gpus)
        yield gpus
        amap = a.allocations
        yield GaugeMetricFamily(
            "gpupipe_producer_kubelet_map_stale",
            "1 while samples carry the last good kubelet attribution after failed Lists (grace period).",
            value=1 if a.kubelet_map_stale else 0,
        )
        yield GaugeMetricFamily(
            "gpupipe_producer_kubelet_dra_unresolved",
            "gpu.nvidia.com DRA devices in the last List that match no GPU of this node (e.g. MIG).",
            value=a.dra_unresolved(amap),
        )
        yield GaugeMetricFamily(
            "gpupipe_producer_kubelet_ignored_devices",
            "Device entries of non-GPU resource names in the last kubelet List.",
            value=sum(amap.ignored_resources.values()),
        )
        yield GaugeMetricFamily(
            "gpupipe_producer_kubelet_odd_device_ids",
            "Malformed or non-UUID device ids in the last kubelet List.",
            value=amap.odd_device_ids,
        )
        up = GaugeMetricFamily(
            "gpupipe_producer_source_up", "1 when an input of the agent works.", labels=["input"]
        )
        up.add_metric(["kubelet"], 1 if a.refresher is not None and a.refresher.healthy else 0)
        up.add_metric(["nvml_events"], 1 if a.watcher is not None and a.watcher.running else 0)
        up.add_metric(["kmsg"], 1 if kin is not None and kin.reading and a.kmsg_alive() else 0)
        yield up
