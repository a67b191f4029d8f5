"""Publish GpuSample records (one per GPU per interval) and XidEvent records to Kafka.

Sources: `nvml` (this node's GPUs, the default) and `simulated` (a deterministic virtual fleet).
The simulated fleet must be asked for by name: run by hand on a GPU node, `gpupipe produce` has to
publish that node's readings, never made-up GPUs into the real topics.
With `--speed max` simulated time runs as fast as the pipeline allows: event
timestamps advance by the interval, not by the wall clock, so a backfill of two
simulated hours yields exactly nodes x gpus x 7200/interval samples.
"""

from __future__ import annotations

import argparse

from gpupipe.common.argtypes import field_default, iso_time_ms, positive_duration_ms
from gpupipe.common.durations import format_duration_ms
from gpupipe.common.errors import ConfigError
from gpupipe.lifecycle import service_flags, startup
from gpupipe.lifecycle.runner import ServiceSpec, run_service
from gpupipe_producer.framings import FRAMINGS
from gpupipe_producer.podmeta.extras import add_arguments as podmeta_arguments
from gpupipe_producer.service import ProducerService
from gpupipe_producer.simulated.fleet import FleetConfig
from gpupipe_producer.xid.spool import DEFAULT_MAX_BYTES as DEFAULT_SPOOL_MAX_BYTES

#: The kubelet's rotating client certificate and key in one file (CN system:node:<node>): the
#: identity the chart has a producer sign its XIDs with (``--node-cert``).
KUBELET_CLIENT_CERT = "/var/lib/kubelet/pki/kubelet-client-current.pem"

#: --startup-timeout of a finite run (--duration) when none is given: a job fails fast, a service waits.
JOB_STARTUP_TIMEOUT_MS = 10_000


def _speed(text: str) -> float:
    if text.strip().lower() == "max":
        return 0.0
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"bad speed {text!r}: use 1, 60 or max") from None
    if v <= 0:
        raise argparse.ArgumentTypeError("speed must be > 0 or 'max'")
    return v


def _node_indexes(text: str) -> tuple[int, ...]:
    """'0,3' -> (0, 3): node indexes of the simulated fleet."""
    try:
        out = tuple(sorted({int(v) for v in text.split(",") if v.strip()}))
    except ValueError:
        raise argparse.ArgumentTypeError(f"bad node list {text!r}: use node indexes such as 0,3") from None
    if any(n < 0 for n in out):
        raise argparse.ArgumentTypeError(f"bad node list {text!r}: indexes start at 0")
    return out


#: One line for `gpupipe --help`.
HELP = "run the node producer (simulated fleet or NVML) publishing to Kafka"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--source",
        choices=["nvml", "simulated"],
        default="nvml",
        help="nvml: this node's GPUs; simulated: a made-up fleet for demos, tests and backfills",
    )
    p.add_argument(
        "--interval",
        type=positive_duration_ms,
        default=field_default(FleetConfig, "interval_ms"),
        help="sample interval, e.g. 1s, 500ms",
    )
    service_flags.add_listen(p, serves="the producer's own /metrics")
    service_flags.add_create_topics(p)
    p.add_argument(
        "--topic-partitions",
        action="append",
        default=[],
        metavar="NAME=N",
        help="partitions for a topic created here, e.g. samples=24 (repeatable)",
    )
    p.add_argument(
        "--topic-retention",
        action="append",
        default=[],
        metavar="NAME=DURATION",
        help="retention for a topic created here, e.g. xid=90d (repeatable)",
    )
    p.add_argument(
        "--framing",
        action="append",
        default=[],
        metavar="[NAME=]FRAMING",
        help=f"how values are framed, per topic (samples=raw) or for both: one of {', '.join(FRAMINGS)} "
        "(default: confluent with --schema-registry-url, else single-object; docs/schemas.md)",
    )
    p.add_argument("--compression", default="zstd", choices=["zstd", "lz4", "snappy", "gzip", "none"])
    p.add_argument("--linger-ms", type=int, default=50, help="librdkafka linger for batching")
    sim = p.add_argument_group("simulated source")
    sim.add_argument("--nodes", type=int, default=field_default(FleetConfig, "nodes"))
    sim.add_argument("--gpus-per-node", type=int, default=field_default(FleetConfig, "gpus_per_node"))
    sim.add_argument(
        "--duration", type=positive_duration_ms, default=None, help="simulated time to cover, then exit"
    )
    sim.add_argument(
        "--start-time", type=iso_time_ms, default=None, help="ISO time of the first sample (default: now)"
    )
    sim.add_argument(
        "--speed", type=_speed, default=1.0, help="1 (real time), 60 (a minute per second) or max"
    )
    sim.add_argument("--seed", type=int, default=field_default(FleetConfig, "seed"))
    sim.add_argument(
        "--xid-rate",
        type=float,
        default=field_default(FleetConfig, "xid_rate_per_gpu_hour"),
        metavar="PER_GPU_HOUR",
        help="mean XIDs per GPU-hour of simulated time",
    )
    sim.add_argument("--hostname-prefix", default=field_default(FleetConfig, "hostname_prefix"))
    sim.add_argument(
        "--mig-nodes",
        type=_node_indexes,
        default=(),
        metavar="INDEXES",
        help="nodes (0-based, comma-separated) that always have a MIG GPU, whatever the seed draws",
    )
    sim.add_argument(
        "--shared-nodes",
        type=_node_indexes,
        default=(),
        metavar="INDEXES",
        help="nodes (0-based, comma-separated) that always have time-sliced GPUs, whatever the seed draws",
    )
    sim.add_argument(
        "--hpc-nodes",
        type=int,
        default=field_default(FleetConfig, "hpc_nodes"),
        help="extra Slurm-style nodes whose GPUs are held by HPC jobs (hpc_job allocations)",
    )
    nv = p.add_argument_group("nvml source")
    nv.add_argument(
        "--hostname", default=None, help="node name on the records (default: $NODE_NAME, else the host name)"
    )
    nv.add_argument(
        "--kubelet-socket",
        default="/var/lib/kubelet/pod-resources/kubelet.sock",
        help="kubelet PodResources socket; '' turns pod attribution off",
    )
    nv.add_argument(
        "--kubelet-timeout",
        type=positive_duration_ms,
        default=1000,
        help="deadline of one kubelet List",
    )
    nv.add_argument(
        "--kubelet-grace",
        type=positive_duration_ms,
        default=10_000,
        help="keep the last good pod attribution this long after failed kubelet Lists, flagged",
    )
    nv.add_argument(
        "--extra-resource-names",
        default="",
        metavar="NAMES",
        help="more GPU resource names to map, comma-separated ('example.com/gpu,vendor.io/*')",
    )
    nv.add_argument(
        "--kmsg-path",
        default="/dev/kmsg",
        help="kernel log to read XIDs from: /dev/kmsg, a gpupipe-kmsg-relay socket, a file, or - (stdin)",
    )
    nv.add_argument("--no-kmsg", action="store_true", help="do not read the kernel log")
    nv.add_argument("--no-nvml-events", action="store_true", help="do not watch NVML XID events")
    nv.add_argument(
        "--xid-merge-window",
        type=positive_duration_ms,
        default=500,
        help="an XID seen by NVML and the kernel log within this window is one event",
    )
    nv.add_argument("--spool-dir", default="/var/lib/gpupipe/spool", help="XID spool directory (on disk)")
    nv.add_argument(
        "--spool-max-bytes",
        type=int,
        default=DEFAULT_SPOOL_MAX_BYTES,
        help="XID spool bound in bytes (memory holds about 1.6 times it); oldest dropped over it",
    )
    nv.add_argument(
        "--sample-queue-max",
        type=int,
        default=10_000,
        help="samples held in memory while Kafka is unreachable; oldest dropped over it",
    )
    nv.add_argument(
        "--slow-interval",
        type=positive_duration_ms,
        default=30_000,
        help="ECC / remapped rows / retired pages",
    )
    nv.add_argument(
        "--profiling-interval",
        type=positive_duration_ms,
        default=1000,
        help="GPM profiling metrics",
    )
    nv.add_argument(
        "--dcgm-exporter-url",
        default=None,
        metavar="URL",
        help="the node's own dcgm-exporter /metrics (e.g. http://localhost:9400/metrics): profiling ratios "
        "for GPUs without GPM (A100, L40S, T4), read every --profiling-interval (default: off)",
    )
    nv.add_argument(
        "--processes-interval",
        type=positive_duration_ms,
        default=5000,
        help="per-process memory/utilisation",
    )
    nv.add_argument(
        "--nvml-timeout",
        type=positive_duration_ms,
        default=2000,
        help="longest wait for one GPU's NVML calls in a poll; a GPU over it is left out and reported",
    )
    nv.add_argument(
        "--nvml-release-file",
        default=None,
        metavar="PATH",
        help="while this file exists the agent holds no NVML session (for nvidia-smi -r or a driver "
        "upgrade; /readyz answers 503 meanwhile); '' for none (default: <spool-dir>/nvml-release)",
    )
    nv.add_argument(
        "--nvml-reinit-after",
        type=positive_duration_ms,
        default=60_000,
        help="with a GPU lost, re-initialise NVML after this long (then doubling up to 1h), so a "
        "reset GPU is seen again without a restart",
    )
    nv.add_argument(
        "--node-cert",
        default=None,
        metavar="PATH",
        help="sign XID and sample records as this node with this certificate (PEM; it must name the "
        "node in CN "
        f"system:node:NAME or a DNS SAN), e.g. the kubelet's {KUBELET_CLIENT_CERT}; the alerts "
        "service's --node-ca-file checks it (default: unsigned)",
    )
    nv.add_argument(
        "--node-key",
        default=None,
        metavar="PATH",
        help="private key of --node-cert, PEM (default: the --node-cert file, as the kubelet keeps both)",
    )
    nv.add_argument("--proc-root", default="/proc", help="procfs of the host (pid -> pod via cgroups)")
    nv.add_argument(
        "--pod-logs-dir",
        default="/var/log/pods",
        help="kubelet pod log directory (pod UID -> namespace/name)",
    )
    podmeta_arguments(p.add_argument_group("pod metadata and HPC jobs (nvml source)"))
    startup.add_arguments(
        p,
        startup_default=None,
        unset_means=f"{format_duration_ms(JOB_STARTUP_TIMEOUT_MS)} with --duration, else 0",
    )


def run(args: argparse.Namespace) -> int:
    agent_config, fleet = None, None
    if args.source == "simulated":
        fleet = fleet_config(args)  # a bad fleet is one line before anything starts
        if getattr(args, "node_cert", None):
            raise ConfigError("--node-cert signs one node's records: use it with --source nvml")
    else:
        from gpupipe_producer.agent_config import config_from_args  # grpc and NVML: only for this source

        agent_config = config_from_args(args)  # so is a bad agent flag or node certificate
    # A finite run (--duration) is a job: an unreachable broker is one line and exit 3 after 10s.
    # Otherwise a service: wait for ever (503 on /healthz meanwhile), whatever starts first.
    startup_ms = args.startup_timeout
    if startup_ms is None:
        startup_ms = JOB_STARTUP_TIMEOUT_MS if args.duration else 0
    producer = ProducerService(args, agent_config, fleet)
    spec = ServiceSpec.from_args("producer", args, startup_timeout_ms=startup_ms)
    run_service(spec, producer.build)
    producer.raise_outcome()
    return 0


def fleet_config(args: argparse.Namespace) -> FleetConfig:
    """The simulated fleet that `produce --source simulated` flags describe; ConfigError if none can be."""
    if args.nodes < 1 or args.gpus_per_node < 1:
        raise ConfigError("--nodes and --gpus-per-node must be at least 1")
    mig, shared = tuple(getattr(args, "mig_nodes", ())), tuple(getattr(args, "shared_nodes", ()))
    for flag, picked in (("--mig-nodes", mig), ("--shared-nodes", shared)):
        if picked and picked[-1] >= args.nodes:
            raise ConfigError(f"{flag}: node {picked[-1]} is not in the fleet (nodes 0 to {args.nodes - 1})")
    if both := sorted(set(mig) & set(shared)):
        raise ConfigError(f"--mig-nodes and --shared-nodes both name node {both[0]}; pick one kind per node")
    if mig and args.gpus_per_node < 2:
        raise ConfigError("--mig-nodes needs --gpus-per-node 2 or more (a MIG GPU takes two slots)")
    return FleetConfig(
        nodes=args.nodes,
        gpus_per_node=args.gpus_per_node,
        interval_ms=args.interval,
        seed=args.seed,
        xid_rate_per_gpu_hour=args.xid_rate,
        hostname_prefix=args.hostname_prefix,
        hpc_nodes=getattr(args, "hpc_nodes", 0),
        mig_nodes=mig,
        shared_nodes=shared,
    )
