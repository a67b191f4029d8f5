"""Serve dcgm-exporter-compatible Prometheus metrics from gpu.samples.v1 and gpu.xid.v1.

`/metrics` carries dcgm-exporter's metric names, label names and order, units and HELP/TYPE
(selectable with its counters CSV format, `-f/--collectors`), its series layout for MIG and shared
GPUs (and its `--kubernetes-virtual-gpus` mode), its exporter-derived `DCGM_EXP_*` families, and no
stale series: a GPU or pod not seen for `--stale-after` while others are disappears. dcgm-exporter's flags and
`DCGM_EXPORTER_*` variables are accepted (see `consumers/metrics/dcgm_compat.py`). `/health`
answers `OK` as dcgm-exporter's; `/healthz` answers 200 once consuming.

Scale out by starting more instances with the same `--group-id`: they split the partitions of
gpu.samples.v1, each serves only its partitions' GPUs (and their XIDs), and a revoked
partition's series go at once. Prometheus scrapes every instance.
"""

from __future__ import annotations

import argparse
import logging

from gpupipe.common.argtypes import duration_ms, field_default, field_default_ms
from gpupipe.common.errors import ConfigError
from gpupipe.domain import node_check
from gpupipe.kafka import topics
from gpupipe.kafka.admin import parse_kafka_overrides
from gpupipe.lifecycle import service_flags, startup
from gpupipe.lifecycle.runner import KafkaNeeds, Lifecycle, ServiceSpec, run_service
from gpupipe.web.server import parse_listen
from gpupipe_consumers.metrics import dcgm_compat, dialect
from gpupipe_consumers.metrics.collectors_csv import in_dialect, load_counters
from gpupipe_consumers.metrics.http import DEFAULT_PORT
from gpupipe_consumers.metrics.render import MIG_LAYOUTS, RenderOptions
from gpupipe_consumers.metrics.service import MetricsConfig, MetricsService, tune_gc

USES_KAFKA = True

log = logging.getLogger("gpupipe.metrics")

HOST_LABELS = {"Hostname": "Hostname", "hostname": "hostname", "none": None}


#: One line for `gpupipe --help`.
HELP = "serve dcgm-exporter-compatible /metrics from Kafka"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--listen",
        "--address",
        "-a",
        dest="listen",
        default=f":{DEFAULT_PORT}",
        metavar="HOST:PORT",
        help=f"address of /metrics, /health and /healthz; the default is dcgm-exporter's: every IPv4 and "
        f"IPv6 address, IPv4 only where the host has no IPv6; '[::]:{DEFAULT_PORT}' is IPv6 (dual-stack), "
        f"'0.0.0.0:{DEFAULT_PORT}' IPv4 only",
    )
    p.add_argument(
        "--group-id",
        default=field_default(MetricsConfig, "group_id"),
        help="Kafka consumer group; instances of one group split the GPUs",
    )
    service_flags.add_from_beginning(p, what="records (still subject to --max-sample-age)")
    service_flags.add_create_topics(p)
    ex = p.add_argument_group("exposition")
    ex.add_argument(
        "--collectors",
        "-f",
        dest="collectors",
        default=None,
        metavar="FILE",
        help="dcgm-exporter counters CSV selecting the metrics (default: dcgm-exporter's "
        "default-counters.csv set plus the profiling fields and DCGM_EXP_XID_ERRORS_TOTAL)",
    )
    ex.add_argument(
        "--dialect",
        default=dialect.DEFAULT_DIALECT,
        metavar="NAMES",
        help="metric names to serve: dcgm-4.8 (dcgm-exporter up to 4.8, and the dashboards written for "
        "it), dcgm-4.9 (4.9's DCGM base-unit names, values in Hz, J, ratios 0-1 and bytes), dcgm-4.10 "
        "(4.9's plus the PCIe/NVLink ..._BYTES_PER_SECOND names), a comma list of these (each renamed "
        "series under each generation's name, while dashboards migrate), or both (dcgm-4.8,dcgm-4.10)",
    )
    ex.add_argument(
        "--host-label",
        choices=sorted(HOST_LABELS),
        default=field_default(MetricsConfig, "host_label"),
        help="name of the node label: Hostname (dcgm-exporter up to 4.5.3-4.8.2 and its dashboards), "
        "hostname (4.8.3), or none",
    )
    ex.add_argument(
        "--no-hostname",
        "-n",
        action=dcgm_compat.GoBool,
        help="no node label at all (dcgm-exporter's flag; same as --host-label none)",
    )
    ex.add_argument(
        "--kubernetes-virtual-gpus",
        action=dcgm_compat.GoBool,
        help="dcgm-exporter's virtual-GPU layout: on shared (time-sliced) GPUs one copy of every series "
        "per pod replica (vgpu label), GPU_UTIL and FB_USED split per pod (pod_uid label); without it one "
        "series per GPU, as dcgm-exporter's default",
    )
    ex.add_argument(
        "--kubernetes-enable-dra",
        action=dcgm_compat.GoBool,
        help="dcgm-exporter's DRA labels: a GPU (or MIG instance) held through a ResourceClaim gets "
        "dra_claim_name, dra_claim_namespace, dra_driver_name, dra_pool_name, dra_device_name (MIG: "
        "dra_mig_profile, dra_mig_device_uuid), one series per container holding it",
    )
    ex.add_argument(
        "--mig-layout",
        choices=MIG_LAYOUTS,
        default=None,
        help="instances (dcgm-exporter's -d f): a GPU in MIG mode appears only as its GPU instances, each "
        "with the parent's device-wide readings; gpu+instances (-d g+i): the parent too (default: "
        "instances, or what --devices maps to)",
    )
    ex.add_argument(
        "--devices",
        "-d",
        default=None,
        metavar="f|g+i",
        help="dcgm-exporter's device selection, mapped to --mig-layout (f: instances; g+i: "
        "gpu+instances; its g, i and ranges are read as the nearest of these, with a log line)",
    )
    ex.add_argument(
        "--use-old-namespace",
        "-o",
        action=dcgm_compat.GoBool,
        help="dcgm-exporter 1.x label names (uuid, pod_name, pod_namespace, container_name)",
    )
    ex.add_argument(
        "--replace-blanks-in-model-name",
        "-rbmn",
        action=dcgm_compat.GoBool,
        help="dashes for the spaces of the modelName label (NVIDIA-H200), as dcgm-exporter's flag",
    )
    ex.add_argument(
        "--xid-count-window-size",
        "-x",
        type=int,
        default=300_000,
        metavar="MS",
        help="window of DCGM_EXP_XID_ERRORS_COUNT in milliseconds, as dcgm-exporter's",
    )
    ex.add_argument(
        "--clock-events-count-window-size",
        type=int,
        default=300_000,
        metavar="MS",
        help="window of DCGM_EXP_CLOCK_EVENTS_COUNT in milliseconds",
    )
    ex.add_argument(
        "--per-pod-shares",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="on GPUs held by two or more containers, each pod's share of SM time, memory-controller "
        "time and framebuffer as gpupipe_pod_gpu_util_percent, gpupipe_pod_mem_copy_util_percent and "
        "gpupipe_pod_fb_used_mib (from per-process data)",
    )
    ex.add_argument(
        "--stale-after",
        type=duration_ms,
        default=None,
        metavar="DURATION",
        help="drop a GPU's series when no sample of it came for this long while other GPUs' samples "
        "did, so a stall of all input holds every series (unset: --stale-intervals x the GPU's own "
        "sample interval)",
    )
    ex.add_argument(
        "--stale-intervals",
        type=float,
        default=field_default(MetricsConfig, "stale_intervals"),
        metavar="N",
        help="sample intervals without a sample before a GPU's series go",
    )
    ex.add_argument(
        "--max-gpus",
        type=int,
        default=field_default(MetricsConfig, "max_gpus"),
        metavar="N",
        help="GPUs (and MIG slices) one instance holds at most; a sample of a new GPU then displaces "
        "the longest-held GPU known only from XIDs, else samples and XIDs of further ones are "
        "dropped, counted in gpupipe_metrics_gpus_dropped_total and logged, so records for made-up "
        "UUIDs cannot exhaust its memory",
    )
    ex.add_argument(
        "--max-sample-age",
        type=duration_ms,
        default=field_default_ms(MetricsConfig, "max_sample_age_s"),
        metavar="DURATION",
        help="do not show samples older than this when they arrive (replays, backfills; 0 = no limit)",
    )
    web = p.add_argument_group("HTTP")
    web.add_argument(
        "--web-config-file",
        default=None,
        metavar="FILE",
        help="exporter-toolkit web config: TLS and basic auth for /metrics (none: plain HTTP)",
    )
    dcgm_compat.add_ignored(p)
    web.add_argument(
        "--gzip-level",
        type=int,
        default=field_default(MetricsConfig, "gzip_level"),
        choices=range(1, 10),
        metavar="1-9",
        help="gzip level for scrapers that accept gzip (1: fast, still ~10x smaller)",
    )
    ident = p.add_argument_group("node identity (which node wrote a sample or an XID)")
    service_flags.add_node_identity(
        ident, records="a sample's or an XID's", refused="dead-letters a record that fails the check"
    )
    startup.add_arguments(p)

    dcgm_compat.apply_dcgm_env(p)


def render_options(args: argparse.Namespace) -> RenderOptions:
    """The exposition layout the flags ask for (dcgm-exporter's modes and labels)."""
    for name in ("xid_count_window_size", "clock_events_count_window_size"):
        if int(getattr(args, name)) <= 0:
            raise ConfigError(f"--{name.replace('_', '-')} must be a positive number of milliseconds")
    mig = args.mig_layout or (dcgm_compat.mig_layout_for(args.devices) if args.devices else "instances")
    return RenderOptions(
        host_label=None if args.no_hostname else HOST_LABELS[args.host_label],
        split_shared=args.per_pod_shares,
        virtual_gpus=args.kubernetes_virtual_gpus,
        old_namespace=args.use_old_namespace,
        xid_window_ms=int(args.xid_count_window_size),
        clock_window_ms=int(args.clock_events_count_window_size),
        mig_layout=mig,
        replace_blanks_in_model_name=args.replace_blanks_in_model_name,
        dra_labels=args.kubernetes_enable_dra,
    )


def config_from_args(args: argparse.Namespace) -> MetricsConfig:
    host, port = parse_listen(args.listen)
    ignored = dcgm_compat.ignored_given(args)
    if ignored:
        log.info("dcgm-exporter flags with no effect in gpupipe ignored: %s", ", ".join(ignored))
    if args.stale_intervals <= 0:
        raise ConfigError("--stale-intervals must be greater than zero")
    if args.stale_after is not None and args.stale_after <= 0:
        raise ConfigError("--stale-after must be greater than zero")
    if args.max_gpus <= 0:
        raise ConfigError("--max-gpus must be greater than zero")
    if args.max_sample_age < 0:
        raise ConfigError("--max-sample-age must not be negative")
    if args.host_label not in HOST_LABELS:
        raise ConfigError(f"--host-label must be one of {', '.join(sorted(HOST_LABELS))}")
    try:
        dialect.generations(args.dialect)
    except ValueError as exc:
        raise ConfigError(f"--dialect: {exc}") from None
    options = render_options(args)
    identity = node_check.from_args(args)  # a bad CA bundle: one line, before any network
    return MetricsConfig(
        bootstrap=args.bootstrap_servers,
        topic_prefix=args.topic_prefix,
        group_id=args.group_id,
        host=host,
        port=port,
        counters=in_dialect(load_counters(dcgm_compat.resolve_collectors(args.collectors)), args.dialect),
        host_label=options.host_label,
        split_shared=args.per_pod_shares,
        render=options,
        stale_after_s=None if args.stale_after is None else args.stale_after / 1000.0,
        stale_intervals=args.stale_intervals,
        max_gpus=args.max_gpus,
        max_sample_age_s=args.max_sample_age / 1000.0 or None,
        web_config=args.web_config_file,
        gzip_level=args.gzip_level,
        from_beginning=args.from_beginning,
        create_topics=args.create_topics,
        schema_registry_url=args.schema_registry_url,
        extra=parse_kafka_overrides(args.kafka_config),
        node_identity=identity,
    )


def run(args: argparse.Namespace) -> int:
    cfg = config_from_args(args)  # config errors (CSV, flags) before any network
    spec = ServiceSpec.from_args(
        "metrics",
        args,
        KafkaNeeds(
            cfg.bootstrap,
            topics.to_prepare([topics.SAMPLES, topics.XID, topics.DEADLETTER], create=cfg.create_topics),
            prefix=cfg.topic_prefix,
            create=cfg.create_topics,
            extra=cfg.extra,
        ),
    )

    def build(life: Lifecycle) -> MetricsService:
        service = MetricsService(cfg, server=life.http)
        tune_gc()
        return service

    return run_service(spec, build)
