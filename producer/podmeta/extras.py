"""What the node agent adds to allocations beyond the kubelet: pod metadata and HPC jobs.

One object with one call per record (:meth:`AllocationExtras.decorate`), so the agent's enrichment
path gains two lines and nothing else. Built from the ``produce`` flags by :func:`extras_from_args`;
None when neither ``--pod-metadata api`` nor ``--hpc-job-mapping-dir`` is given.
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from gpupipe.clients import kube
from gpupipe.common.errors import ConfigError
from gpupipe_producer.podmeta.hpc_jobs import DEFAULT_NAMESPACE as DEFAULT_HPC_NAMESPACE
from gpupipe_producer.podmeta.hpc_jobs import HpcJobMap
from gpupipe_producer.podmeta.kube_watch import PodMetadataWatcher
from gpupipe_producer.podmeta.owners import annotate
from gpupipe_schemas.validate import MAX_LABELS

log = logging.getLogger("gpupipe.podmeta")

DEFAULT_POD_LABELS = "team,project,cost-center"


class AllocationExtras:
    def __init__(
        self,
        watcher: PodMetadataWatcher | None = None,
        label_keys: tuple[str, ...] = (),
        hpc: HpcJobMap | None = None,
    ) -> None:
        self.watcher = watcher
        self.label_keys = label_keys
        self.hpc = hpc
        self.errors: dict[str, int] = {}
        self.requests: dict[str, int] = {}
        if watcher is not None:
            watcher.on_error = self._count(self.errors)
            watcher.on_request = self._count(self.requests)

    @staticmethod
    def _count(target: dict[str, int]) -> Any:
        def inc(kind: str) -> None:
            target[kind] = target.get(kind, 0) + 1

        return inc

    def decorate(self, record: dict[str, Any]) -> None:
        """Owner, labels, priority class, metadata status, and HPC jobs, on a GpuSample or XidEvent dict."""
        if self.watcher is not None and record.get("allocations"):
            annotate(record["allocations"], self.watcher.lookup, self.label_keys, self.watcher.healthy)
        if self.hpc is not None:
            self.hpc.decorate(record)

    def start(self, registry: CollectorRegistry) -> None:
        registry.register(_ExtrasCollector(self))
        if self.watcher is not None:
            self.watcher.start()

    def stop(self) -> None:
        if self.watcher is not None:
            self.watcher.stop()


class _ExtrasCollector(Collector):
    def __init__(self, extras: AllocationExtras) -> None:
        self.x = extras

    def collect(self) -> Iterator[Any]:
        w = self.x.watcher
        if w is None:
            return
        yield GaugeMetricFamily(
            "gpupipe_producer_pod_metadata_up",
            "1 while the pod metadata watch on the API server is live; 0: allocations carry last known "
            "values flagged metadata_status=stale (or unknown).",
            value=1 if w.healthy else 0,
        )
        yield GaugeMetricFamily(
            "gpupipe_producer_pod_metadata_pods", "Pods of this node known.", value=len(w)
        )
        err = CounterMetricFamily(
            "gpupipe_producer_pod_metadata_errors", "Pod metadata watch failures by kind.", labels=["kind"]
        )
        for k, n in sorted(self.x.errors.items()):
            err.add_metric([k], n)
        yield err
        req = CounterMetricFamily(
            "gpupipe_producer_pod_metadata_requests",
            "Requests to the API server by verb (list, watch, get_owner): the agent's API-server load.",
            labels=["verb"],
        )
        for k, n in sorted(self.x.requests.items()):
            req.add_metric([k], n)
        yield req


def add_arguments(group: argparse._ArgumentGroup) -> None:
    group.add_argument(
        "--pod-metadata",
        choices=["off", "api"],
        default="off",
        help="learn this node's pods' labels, owner and priority class from the API server with a "
        "node-scoped watch",
    )
    group.add_argument(
        "--pod-labels",
        default=DEFAULT_POD_LABELS,
        help=f"pod label keys copied into each allocation, comma-separated (at most {MAX_LABELS})",
    )
    group.add_argument(
        "--dra-resource-slices",
        choices=["off", "api"],
        default="off",
        help="resolve DRA devices (MIG ones too) to their UUIDs from this node's ResourceSlices on the "
        "API server; off: only whole GPUs named gpu-<n> are resolved",
    )
    kube.add_arguments(group)
    group.add_argument(
        "--hpc-job-mapping-dir",
        default=None,
        metavar="DIR",
        help="dcgm-exporter-style GPU -> job id files written by the scheduler's prolog/epilog",
    )
    group.add_argument(
        "--hpc-namespace", default=DEFAULT_HPC_NAMESPACE, help="namespace of HPC job allocations"
    )


def extras_from_args(args: argparse.Namespace, node_name: str) -> AllocationExtras | None:
    mode = getattr(args, "pod_metadata", "off") or "off"
    hpc_dir = getattr(args, "hpc_job_mapping_dir", None)
    if mode == "off" and not hpc_dir:
        return None
    watcher = None
    keys = tuple(k.strip() for k in (getattr(args, "pod_labels", "") or "").split(",") if k.strip())
    if len(set(keys)) > MAX_LABELS:  # the consumers would dead-letter each sample of a pod with them all
        raise ConfigError(f"--pod-labels selects {len(set(keys))} keys, at most {MAX_LABELS}")
    if mode == "api":
        cfg = kube.config_from_args(args, needed_by="--pod-metadata api")
        watcher = PodMetadataWatcher(kube.KubeClient(cfg), node_name)
    hpc = HpcJobMap(hpc_dir, namespace=args.hpc_namespace) if hpc_dir else None
    return AllocationExtras(watcher, keys, hpc)
