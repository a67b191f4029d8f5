"""The node agent's configuration: ``AgentConfig`` and how ``gpupipe produce`` flags become one.

Every collaborator of the agent (the XID path, the NVML source's settings) reads this one value,
so it stands below them all and imports none of them.
"""

from __future__ import annotations

import argparse
import os
import socket
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from gpupipe.clients.kube import KubeClient
from gpupipe.clients.kube import config_from_args as kube_config_from_args
from gpupipe.common.errors import ConfigError
from gpupipe_producer.kubelet.client import DEFAULT_SOCKET_PATH
from gpupipe_producer.podmeta.extras import AllocationExtras, extras_from_args
from gpupipe_producer.samples.enrich import PidResolver
from gpupipe_producer.xid.kmsg_cursor import BOOT_ID_PATH
from gpupipe_producer.xid.kmsg_reader import DEFAULT_KMSG_PATH
from gpupipe_producer.xid.spool import DEFAULT_MAX_BYTES
from gpupipe_producer.xid.xid_merge import DEFAULT_WINDOW_S

if TYPE_CHECKING:  # cryptography is loaded only by a producer that signs
    from gpupipe.domain.node_identity import NodeSigner

DEFAULT_SPOOL_DIR = "/var/lib/gpupipe/spool"
DEFAULT_SPOOL_MAX_BYTES = DEFAULT_MAX_BYTES  # sized against the DaemonSet's memory limit
DEFAULT_SAMPLE_QUEUE_MAX = 10_000
DEFAULT_IN_FLIGHT_LIMIT = 2_000
SHUTDOWN_FLUSH_S = 5.0
#: The agent's whole stop (threads, event watcher, flush) ends this long after it began at most:
#: inside the default 10 s --shutdown-timeout, with the command's 2 s margin to report and exit.
SHUTDOWN_BUDGET_S = 7.5
KMSG_RETRY_S = 10.0
DEFAULT_NVML_TIMEOUT_S = 2.0
#: Name of the release file in the spool directory (``--nvml-release-file`` default).
NVML_RELEASE_FILE = "nvml-release"


@dataclass
class AgentConfig:
    """Everything the agent needs; ``config_from_args`` builds it from the ``produce`` flags."""

    hostname: str
    interval_s: float = 1.0
    slow_interval_s: float = 30.0
    profiling_interval_s: float = 1.0
    processes_interval_s: float = 5.0
    kubelet_socket: str | None = DEFAULT_SOCKET_PATH  # None: kubelet enrichment off
    kubelet_timeout_s: float = 1.0
    #: How long the last good kubelet map is kept after failed Lists (flagged meanwhile).
    kubelet_grace_s: float = 10.0
    extra_resource_names: tuple[str, ...] = ()
    kmsg_path: str | None = DEFAULT_KMSG_PATH  # None: kernel-log reader off
    nvml_events: bool = True
    xid_merge_window_s: float = DEFAULT_WINDOW_S
    spool_dir: str = DEFAULT_SPOOL_DIR
    spool_max_bytes: int = DEFAULT_SPOOL_MAX_BYTES
    sample_queue_max: int = DEFAULT_SAMPLE_QUEUE_MAX
    in_flight_limit: int = DEFAULT_IN_FLIGHT_LIMIT
    xid_retry_after_s: float = 5.0
    proc_root: str = "/proc"
    pod_logs_dir: str = "/var/log/pods"
    #: Overrides the /proc + /var/log/pods resolver (tests); ``resolve_pids=False`` turns it off.
    pid_resolver: PidResolver | None = None
    resolve_pids: bool = True
    nvml_event_timeout_ms: int = 500
    #: Longest wait for one GPU's NVML calls in a poll; a GPU over it is left out and reported.
    nvml_timeout_s: float = DEFAULT_NVML_TIMEOUT_S
    #: /healthz turns unhealthy when a loop made no progress for this long (None: derived).
    stall_after_s: float | None = None
    boot_id_path: str = BOOT_ID_PATH
    kmsg_retry_s: float = KMSG_RETRY_S
    #: While this file exists NVML is released (:mod:`gpupipe_producer.agent.nvml_control`);
    #: None: no such file.
    nvml_release_file: str | None = None
    #: First NVML re-initialisation after a GPU is lost (then doubling, up to an hour).
    nvml_reinit_after_s: float = 60.0
    #: Pod metadata (owner, labels) and HPC jobs added to allocations (:mod:`gpupipe_producer.podmeta`).
    extras: AllocationExtras | None = None
    #: Signs the node's XID records (``--node-cert``); None: unsigned.
    signer: NodeSigner | None = None
    #: The API server the node's ResourceSlices are read from (``--dra-resource-slices api``).
    dra_api: KubeClient | None = None
    #: The node's dcgm-exporter ``/metrics`` (``--dcgm-exporter-url``): profiling ratios for GPUs
    #: without GPM; None: off.
    dcgm_exporter_url: str | None = None

    def __post_init__(self) -> None:
        for name in ("interval_s", "slow_interval_s", "profiling_interval_s", "processes_interval_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name.removesuffix('_s').replace('_', '-')} must be positive")
        if not self.kubelet_timeout_s > 0:
            raise ConfigError("--kubelet-timeout must be positive")
        if not self.nvml_timeout_s > 0:
            raise ConfigError("--nvml-timeout must be positive")
        if not self.nvml_reinit_after_s > 0:
            raise ConfigError("--nvml-reinit-after must be positive")
        if self.xid_merge_window_s < 0:
            raise ConfigError("--xid-merge-window must not be negative")
        if self.sample_queue_max < 1 or self.spool_max_bytes < 1024:
            raise ConfigError("--sample-queue-max must be >= 1 and --spool-max-bytes >= 1024")
        if self.dcgm_exporter_url and not self.dcgm_exporter_url.startswith(("http://", "https://")):
            raise ConfigError(f"--dcgm-exporter-url must be an http(s) URL, got {self.dcgm_exporter_url!r}")
        if self.kubelet_socket and not os.path.isabs(self.kubelet_socket):
            raise ConfigError(f"--kubelet-socket must be an absolute path, got {self.kubelet_socket!r}")


def default_hostname(environ: dict[str, str] | os._Environ[str] = os.environ) -> str:
    """The node name: ``NODE_NAME`` (``spec.nodeName`` in the DaemonSet), else the host name."""
    return environ.get("NODE_NAME") or socket.gethostname()


def config_from_args(args: argparse.Namespace) -> AgentConfig:
    """Build the agent config from ``gpupipe produce`` flags (defaults where a flag is absent)."""

    def get(name: str, default: Any) -> Any:
        value = getattr(args, name, None)
        return default if value is None else value

    names = get("extra_resource_names", "")
    if isinstance(names, str):
        names = [n.strip() for n in names.split(",")]
    kmsg = None if get("no_kmsg", False) else get("kmsg_path", DEFAULT_KMSG_PATH)
    spool_dir = get("spool_dir", DEFAULT_SPOOL_DIR)
    release = get("nvml_release_file", os.path.join(spool_dir, NVML_RELEASE_FILE))
    hostname = get("hostname", "") or default_hostname()
    return AgentConfig(
        hostname=hostname,
        interval_s=get("interval", 1000) / 1000.0,
        slow_interval_s=get("slow_interval", 30_000) / 1000.0,
        profiling_interval_s=get("profiling_interval", 1000) / 1000.0,
        processes_interval_s=get("processes_interval", 5000) / 1000.0,
        kubelet_socket=get("kubelet_socket", DEFAULT_SOCKET_PATH) or None,
        kubelet_timeout_s=get("kubelet_timeout", 1000) / 1000.0,
        kubelet_grace_s=get("kubelet_grace", 10_000) / 1000.0,
        extra_resource_names=tuple(n for n in names if n),
        kmsg_path=kmsg or None,
        nvml_events=not get("no_nvml_events", False),
        xid_merge_window_s=get("xid_merge_window", round(DEFAULT_WINDOW_S * 1000)) / 1000.0,
        spool_dir=spool_dir,
        nvml_release_file=release or None,
        nvml_reinit_after_s=get("nvml_reinit_after", 60_000) / 1000.0,
        spool_max_bytes=int(get("spool_max_bytes", DEFAULT_SPOOL_MAX_BYTES)),
        sample_queue_max=int(get("sample_queue_max", DEFAULT_SAMPLE_QUEUE_MAX)),
        proc_root=get("proc_root", "/proc"),
        pod_logs_dir=get("pod_logs_dir", "/var/log/pods"),
        nvml_timeout_s=get("nvml_timeout", round(DEFAULT_NVML_TIMEOUT_S * 1000)) / 1000.0,
        extras=extras_from_args(args, hostname),
        signer=_signer(args, hostname),
        dra_api=_dra_api(args),
        dcgm_exporter_url=get("dcgm_exporter_url", "") or None,
    )


def _dra_api(args: argparse.Namespace) -> KubeClient | None:
    if (getattr(args, "dra_resource_slices", "off") or "off") == "off":
        return None
    return KubeClient(kube_config_from_args(args, needed_by="--dra-resource-slices api"))


def _signer(args: argparse.Namespace, hostname: str) -> NodeSigner | None:
    cert = getattr(args, "node_cert", None)
    if not cert:
        if getattr(args, "node_key", None):
            raise ConfigError("--node-key needs --node-cert")
        return None
    from gpupipe.domain.node_identity import NodeSigner

    return NodeSigner(cert, getattr(args, "node_key", None), hostname)
