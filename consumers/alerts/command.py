"""Classify and deduplicate GPU faults into alerts: gpu.xid.v1 (+ gpu.samples.v1 health) -> gpu.alerts.v1.

Each XID is classified with NVIDIA's pinned XID catalog and its workflows (severity, cause class,
recommended action, drain or not), repeats of the same fault on the same GPU fold into one alert with an
occurrence count, a burst across several GPUs of one node becomes one node-level alert, and alerts
resolve after a quiet period. Health fields of the samples raise alerts too (uncorrectable ECC, row
remapping pending/failed, GPU lost, sustained thermal throttling). Optionally forwards to Alertmanager's
v2 API and cordons nodes whose alert calls for draining (rate limited; --dry-run to see what it would do).
Run one instance, or two or more with --ha (one leads, the others stand by and take over within
seconds); the active one restores its open alerts from gpu.alerts.v1 when it starts.
"""

from __future__ import annotations

import argparse
import socket

from gpupipe.clients import kube
from gpupipe.clients.alertmanager import AlertmanagerSender
from gpupipe.common.argtypes import duration_ms, field_default, keyword_default, positive_duration_ms
from gpupipe.common.errors import ConfigError
from gpupipe.domain import node_check
from gpupipe.kafka import topics
from gpupipe.kafka.acls import DEFAULT_GROUPS
from gpupipe.kafka.admin import parse_kafka_overrides
from gpupipe.lifecycle import service_flags, startup
from gpupipe.lifecycle.runner import KafkaNeeds, Lifecycle, ServiceSpec, run_service
from gpupipe_consumers.alerts.ack import acknowledge
from gpupipe_consumers.alerts.admission import DeviceAdmission
from gpupipe_consumers.alerts.cordon import Cordoner
from gpupipe_consumers.alerts.engine.config import EngineConfig
from gpupipe_consumers.alerts.engine.health_signals import HealthConfig
from gpupipe_consumers.alerts.leader import LeaderElector
from gpupipe_consumers.alerts.service import AlertsOptions, AlertsService

USES_KAFKA = True
#: A plain instance's check for --ha instances in its group (``--ha-guard-interval``).
HA_GUARD_INTERVAL_MS = 30_000


#: One line for `gpupipe --help`.
HELP = "classify and deduplicate XIDs into alerts"


def add_arguments(p: argparse.ArgumentParser) -> None:
    service_flags.add_listen(p)
    p.add_argument("--group-id", default=DEFAULT_GROUPS["alerts"], help="Kafka consumer group")
    service_flags.add_from_beginning(p, what="input")
    service_flags.add_create_topics(p)
    p.add_argument(
        "--ha",
        action="store_true",
        help="run as one of an HA pair (or more): lead, or stand by and take over when the leader dies "
        "(leader election on gpu.alerts.leader.v1; see docs/alerts.md)",
    )
    p.add_argument(
        "--ha-session-timeout",
        type=duration_ms,
        default=keyword_default(LeaderElector, "session_timeout_ms"),
        metavar="DURATION",
        help="how long a silent leader keeps leadership (Kafka session timeout)",
    )
    p.add_argument(
        "--ha-guard-interval",
        type=positive_duration_ms,
        default=HA_GUARD_INTERVAL_MS,
        metavar="DURATION",
        help="without --ha: how often to check that no --ha instances use this --group-id; if some "
        "start later, this instance stops with one line rather than split their input unfenced",
    )
    p.add_argument(
        "--ack",
        default=None,
        metavar="ALERT_ID",
        help="acknowledge an alert (a fault needing a reset, reboot or RMA was dealt with): publish the ack "
        "on gpu.alerts.v1, which resolves it, and exit",
    )
    p.add_argument("--ack-note", default="", metavar="TEXT", help="why (kept in the ack record)")
    p.add_argument(
        "--instance-id",
        default=None,
        help="name of this instance in records and cordon annotations (default: host name)",
    )
    life = p.add_argument_group("deduplication and lifecycle")
    life.add_argument(
        "--dedupe-window",
        type=duration_ms,
        default=field_default(EngineConfig, "dedupe_window_ms"),
        metavar="DURATION",
        help="repeats of the same fault on the same GPU within this gap fold into one alert",
    )
    life.add_argument(
        "--recurrence-horizon",
        type=duration_ms,
        default=field_default(EngineConfig, "recurrence_horizon_ms"),
        metavar="DURATION",
        help="a repeat of the same fault on the same GPU by the same job (or no known job) after "
        "--dedupe-window but within this continues the open alert (one notification) instead of "
        "starting a new one; 0: it always starts a new one",
    )
    life.add_argument(
        "--resolve-after",
        type=duration_ms,
        default=field_default(EngineConfig, "resolve_after_ms"),
        metavar="DURATION",
        help="an alert resolves after this long without an occurrence",
    )
    life.add_argument(
        "--update-interval",
        type=duration_ms,
        default=field_default(EngineConfig, "update_interval_ms"),
        metavar="DURATION",
        help="publish count/last-seen updates of an alert at most this often; new, escalated and "
        "resolved alerts go out at once",
    )
    life.add_argument(
        "--node-burst-gpus",
        type=int,
        default=field_default(EngineConfig, "node_burst_gpus"),
        metavar="N",
        help="GPUs of one node with faults within --node-burst-window that make a node-level alert",
    )
    life.add_argument(
        "--node-burst-window",
        type=duration_ms,
        default=field_default(EngineConfig, "node_burst_window_ms"),
        metavar="DURATION",
        help="the window of --node-burst-gpus",
    )
    life.add_argument(
        "--restore-lookback",
        type=duration_ms,
        default=86_400_000,
        metavar="DURATION",
        help="how far back gpu.alerts.v1 is read at startup to restore open alerts",
    )
    life.add_argument(
        "--keepalive-interval",
        type=duration_ms,
        default=field_default(EngineConfig, "keepalive_ms"),
        metavar="DURATION",
        help="publish an open alert that has not changed for this long again, so that a restart's "
        "--restore-lookback finds it however old it is (held under half of --restore-lookback)",
    )
    life.add_argument(
        "--max-event-age",
        type=duration_ms,
        default=field_default(EngineConfig, "max_event_age_ms"),
        metavar="DURATION",
        help="an XID this much older than its processing is history (a kernel-log backlog read again), "
        "not a new fault: it raises, pages and drains nothing",
    )
    life.add_argument(
        "--max-nodes",
        type=int,
        default=keyword_default(DeviceAdmission, "max_nodes"),
        metavar="N",
        help="keep state for about N nodes: a new node makes the least recently seen one without an open "
        "alert be forgotten; while every node alerts, up to twice N, then the least recently seen "
        "alerting node goes (a bound on what forged host names can make the service hold, that no "
        "flood turns into missed faults); raise it for larger fleets",
    )
    life.add_argument(
        "--max-devices",
        type=int,
        default=keyword_default(DeviceAdmission, "max_devices"),
        metavar="N",
        help="keep state for about N GPUs and NVSwitches in all, forgetting nodes as --max-nodes does",
    )
    life.add_argument(
        "--max-devices-per-node",
        type=int,
        default=keyword_default(DeviceAdmission, "max_devices_per_node"),
        metavar="N",
        help="keep state for at most N devices of one node (one node's certificate cannot fill "
        "--max-devices): a new one makes the node's least recently seen device without an open alert "
        "be forgotten",
    )
    life.add_argument(
        "--max-open-alerts",
        type=int,
        default=field_default(EngineConfig, "max_open_alerts"),
        metavar="N",
        help="hold at most N open alerts: an occurrence that would open another is refused and counted "
        "(open alerts go on folding and resolving)",
    )
    ident = p.add_argument_group("node identity (which node wrote an XID)")
    service_flags.add_node_identity(
        ident,
        records="an XID's or a sample's",
        refused="dead-letters an XID that fails the check and drops such a sample",
    )
    health = p.add_argument_group("health signals from gpu.samples.v1")
    health.add_argument(
        "--health-signals",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also consume gpu.samples.v1 for ECC, row-remap, GPU-lost and thermal alerts",
    )
    health.add_argument(
        "--thermal-for",
        type=duration_ms,
        default=field_default(HealthConfig, "thermal_for_ms"),
        metavar="DURATION",
        help="thermal clock-event bits must be set this long to alert",
    )
    am = p.add_argument_group("Alertmanager")
    am.add_argument(
        "--alertmanager-url",
        action="append",
        default=[],
        metavar="URL",
        help="post alerts to this Alertmanager (repeatable; every member of an HA cluster)",
    )
    am.add_argument(
        "--resend-interval",
        type=duration_ms,
        default=keyword_default(AlertmanagerSender, "resend_interval_ms"),
        metavar="DURATION",
        help="re-send firing alerts this often, with endsAt = now + 4 x this",
    )
    am.add_argument(
        "--alertmanager-timeout",
        type=duration_ms,
        default=round(keyword_default(AlertmanagerSender, "timeout_s") * 1000),
        metavar="DURATION",
        help="how long one POST to Alertmanager may take",
    )
    am.add_argument(
        "--alertmanager-max-alerts",
        type=int,
        default=keyword_default(AlertmanagerSender, "max_alerts"),
        metavar="N",
        help="alerts held for Alertmanager while it is unreachable",
    )
    k8s = p.add_argument_group("remediation (Kubernetes cordon)")
    k8s.add_argument("--cordon", action="store_true", help="cordon nodes whose alert calls for draining")
    k8s.add_argument(
        "--dry-run",
        action="store_true",
        help="decide cordons (rate limit included), log and record them, change nothing",
    )
    k8s.add_argument(
        "--cordon-max-per-hour",
        type=int,
        default=2,
        metavar="N",
        help="never cordon more than N nodes in any hour (0 disables cordoning)",
    )
    k8s.add_argument(
        "--cordon-max-share",
        type=float,
        default=keyword_default(Cordoner, "max_share"),
        metavar="FRACTION",
        help="never cordon when that would make more than this share of the cluster's nodes unschedulable",
    )
    k8s.add_argument(
        "--uncordon",
        action="store_true",
        help="make nodes gpupipe cordoned schedulable again once all their drain alerts resolved "
        "(recovered or acknowledged)",
    )
    kube.add_arguments(k8s)
    startup.add_arguments(p)


def _configs(args: argparse.Namespace) -> tuple[EngineConfig, HealthConfig]:
    if args.dedupe_window <= 0 or args.resolve_after <= 0 or args.node_burst_window <= 0:
        raise ConfigError(
            "--dedupe-window, --resolve-after and --node-burst-window must be greater than zero"
        )
    if args.update_interval < 0 or args.thermal_for < 0 or args.recurrence_horizon < 0:
        raise ConfigError("--update-interval, --thermal-for and --recurrence-horizon must not be negative")
    if args.node_burst_gpus < 2:
        raise ConfigError("--node-burst-gpus must be at least 2")
    if args.resend_interval <= 0 or args.alertmanager_timeout <= 0:
        raise ConfigError("--resend-interval and --alertmanager-timeout must be greater than zero")
    if args.alertmanager_max_alerts < 1:
        raise ConfigError("--alertmanager-max-alerts must be at least 1")
    if min(args.max_nodes, args.max_devices, args.max_devices_per_node, args.max_open_alerts) < 1:
        raise ConfigError(
            "--max-nodes, --max-devices, --max-devices-per-node and --max-open-alerts must be at least 1"
        )
    if args.cordon_max_per_hour < 0:
        raise ConfigError("--cordon-max-per-hour must not be negative")
    if args.ha_session_timeout < 1000:
        raise ConfigError("--ha-session-timeout must be at least 1s (brokers default to a 6s minimum)")
    if not 0 < args.cordon_max_share <= 1:
        raise ConfigError("--cordon-max-share must be greater than 0 and at most 1")
    if args.restore_lookback < 0:
        raise ConfigError("--restore-lookback must not be negative")
    if args.keepalive_interval <= 0 or args.max_event_age <= 0:
        raise ConfigError("--keepalive-interval and --max-event-age must be greater than zero")
    keepalive = args.keepalive_interval
    if args.restore_lookback:  # a restart must find every open alert's latest revision in its look-back
        keepalive = max(1000, min(keepalive, args.restore_lookback // 2))
    for url in args.alertmanager_url:
        if not url.startswith(("http://", "https://")):
            raise ConfigError(f"--alertmanager-url must start with http:// or https://, got {url!r}")
    engine = EngineConfig(
        dedupe_window_ms=args.dedupe_window,
        resolve_after_ms=args.resolve_after,
        recurrence_horizon_ms=args.recurrence_horizon,
        update_interval_ms=args.update_interval,
        node_burst_gpus=args.node_burst_gpus,
        node_burst_window_ms=args.node_burst_window,
        confirm_by_samples=args.health_signals,  # nothing else could show a GPU back after a reboot
        keepalive_ms=keepalive,
        max_event_age_ms=args.max_event_age,
        max_open_alerts=args.max_open_alerts,
    )
    return engine, HealthConfig(thermal_for_ms=args.thermal_for)


def options_from_args(args: argparse.Namespace) -> AlertsOptions:
    """Check the flags (one line per mistake, before any network) and type them."""
    engine, health = _configs(args)
    cluster = None
    if args.cordon and not args.dry_run:
        cluster = kube.config_from_args(args, needed_by="--cordon", otherwise="or use --dry-run")
    identity = node_check.from_args(args)  # a bad bundle: one line, now
    return AlertsOptions(
        engine=engine,
        health=health,
        bootstrap=args.bootstrap_servers,
        topic_prefix=args.topic_prefix,
        group_id=args.group_id,
        instance=args.instance_id or socket.gethostname(),
        schema_registry_url=args.schema_registry_url,
        extra=parse_kafka_overrides(args.kafka_config),
        from_beginning=args.from_beginning,
        create_topics=args.create_topics,
        health_signals=args.health_signals,
        restore_lookback_ms=args.restore_lookback,
        startup_timeout_ms=getattr(args, "startup_timeout", 0) or 0,
        ha=args.ha,
        ha_session_timeout_ms=args.ha_session_timeout,
        ha_guard_interval_ms=args.ha_guard_interval,
        alertmanager_urls=tuple(args.alertmanager_url),
        resend_interval_ms=args.resend_interval,
        alertmanager_timeout_ms=args.alertmanager_timeout,
        alertmanager_max_alerts=args.alertmanager_max_alerts,
        max_nodes=args.max_nodes,
        max_devices=args.max_devices,
        max_devices_per_node=args.max_devices_per_node,
        cordon=args.cordon,
        dry_run=args.dry_run,
        cordon_max_per_hour=args.cordon_max_per_hour,
        cordon_max_share=args.cordon_max_share,
        uncordon=args.uncordon,
        cluster=cluster,
        node_identity=identity,
    )


def run(args: argparse.Namespace) -> int:
    if args.ack:
        return acknowledge(args)
    opts = options_from_args(args)  # flag mistakes are one line before any network
    needed = [topics.XID, topics.ALERTS, topics.DEADLETTER] + ([topics.SAMPLES] * args.health_signals)
    spec = ServiceSpec.from_args(
        "alerts",
        args,
        KafkaNeeds(
            args.bootstrap_servers,
            topics.to_prepare(needed, create=args.create_topics),
            prefix=args.topic_prefix,
            create=args.create_topics,
            extra=opts.extra,
        ),
    )
    services: list[AlertsService] = []

    def build(life: Lifecycle) -> AlertsService:
        services.append(AlertsService(opts, life))
        return services[0]

    rc = run_service(spec, build)
    if services and services[0].guard_error:
        raise ConfigError(services[0].guard_error)
    return rc
