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
import logging
import socket
import threading
from dataclasses import dataclass

from prometheus_client import CollectorRegistry

from gpupipe import kube, node_check, service_flags, startup, topics
from gpupipe.acls import DEFAULT_GROUPS
from gpupipe.alertmanager import AlertmanagerFanout, AlertmanagerMetrics, AlertmanagerSender
from gpupipe.argtypes import duration_ms, field_default, keyword_default, positive_duration_ms
from gpupipe.errors import ConfigError, GpupipeError
from gpupipe.kafka_admin import parse_kafka_overrides, wait_for_broker
from gpupipe.logs import fields
from gpupipe.runner import KafkaNeeds, Lifecycle, ServiceSpec, run_service
from gpupipe.web.server import Route, registry_route
from gpupipe_consumers.alerts.admission import DeviceAdmission
from gpupipe_consumers.alerts.alerts_page import AlertsPage
from gpupipe_consumers.alerts.am_shape import gpu_alert_shape
from gpupipe_consumers.alerts.cordon import HOUR_MS, Cordoner, KubeNodeApi
from gpupipe_consumers.alerts.engine.facade import EngineConfig
from gpupipe_consumers.alerts.engine.health_signals import HealthConfig
from gpupipe_consumers.alerts.handler import AlertsService, kafka_alert_sink, restore_from_topic
from gpupipe_consumers.alerts.leader import LeaderElector, ha_members
from gpupipe_consumers.alerts.sample_decode import AlertsDecoder
from gpupipe_consumers.consume_loop import ConsumeLoop
from gpupipe_schemas.codec import codec_from_url

USES_KAFKA = True
#: A plain instance's check for --ha instances in its group (``--ha-guard-interval``).
HA_GUARD_INTERVAL_MS = 30_000

log = logging.getLogger("gpupipe.alerts")


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


@dataclass(frozen=True)
class AlertsOptions:
    """What the alerts service is run with, typed: the flags end at :func:`options_from_args`.

    No defaults here: the flags hold them (and `--help` shows them), the builder passes every field.
    """

    engine: EngineConfig
    health: HealthConfig
    bootstrap: str
    topic_prefix: str
    group_id: str
    instance: str
    schema_registry_url: str | None
    extra: dict[str, str]  # librdkafka settings
    from_beginning: bool
    create_topics: bool
    health_signals: bool
    restore_lookback_ms: int
    startup_timeout_ms: int
    ha: bool
    ha_session_timeout_ms: int
    ha_guard_interval_ms: int
    alertmanager_urls: tuple[str, ...]
    resend_interval_ms: int
    alertmanager_timeout_ms: int
    alertmanager_max_alerts: int
    max_nodes: int
    max_devices: int
    max_devices_per_node: int
    cordon: bool
    dry_run: bool
    cordon_max_per_hour: int
    cordon_max_share: float
    uncordon: bool
    cluster: kube.KubeConfig | None  # the API server to cordon through (--cordon without --dry-run)
    node_identity: node_check.NodeIdentity | None  # None: a record's hostname is taken as written


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


class AlertsApp:
    """The service wired from its options; :func:`run` and the storm benchmark use it."""

    def __init__(self, opts: AlertsOptions, life: Lifecycle | None = None) -> None:
        self.opts = opts
        self.instance = opts.instance
        node_api = None
        if opts.cluster is not None:
            node_api = KubeNodeApi(kube.KubeClient(opts.cluster))
        extra = opts.extra
        t_xid = topics.with_prefix(opts.topic_prefix, topics.XID)
        t_samples = topics.with_prefix(opts.topic_prefix, topics.SAMPLES)
        self.alerts_topic = topics.with_prefix(opts.topic_prefix, topics.ALERTS)
        # gpu.alerts.v1 is read for operators' acks (gpupipe alerts --ack); the rest of it is skipped
        self.inputs = (
            [t_xid, t_samples, self.alerts_topic] if opts.health_signals else [t_xid, self.alerts_topic]
        )
        codec = codec_from_url(opts.schema_registry_url)
        self.registry = CollectorRegistry()
        self.alertmanager = None
        if opts.alertmanager_urls:
            am_metrics = AlertmanagerMetrics(self.registry)
            self.alertmanager = AlertmanagerFanout(
                [
                    AlertmanagerSender(
                        url,
                        shape=gpu_alert_shape,
                        resend_interval_ms=opts.resend_interval_ms,
                        timeout_s=opts.alertmanager_timeout_ms / 1000,
                        max_alerts=opts.alertmanager_max_alerts,
                        metrics=am_metrics,
                    )
                    for url in opts.alertmanager_urls
                ]
            )
        self.cordoner = None
        if opts.cordon or opts.dry_run:
            self.cordoner = Cordoner(
                node_api,
                dry_run=opts.dry_run,
                max_per_hour=opts.cordon_max_per_hour,
                on_result=lambda result: self.service.on_cordon_result(result),
                instance=self.instance,
                max_share=opts.cordon_max_share,
                uncordon=opts.uncordon,
            )
        sink = kafka_alert_sink(opts.bootstrap, self.alerts_topic, codec, extra)
        identity = None
        if opts.node_identity is not None:
            identity = opts.node_identity.check("alerts", ("XidEvent", "GpuSample"))
        self.service = AlertsService(
            sink=sink,
            engine_config=opts.engine,
            health_config=opts.health,
            registry=self.registry,
            alertmanager=self.alertmanager,
            cordoner=self.cordoner,
            instance=self.instance,
            admission=DeviceAdmission(
                max_nodes=opts.max_nodes,
                max_devices=opts.max_devices,
                max_devices_per_node=opts.max_devices_per_node,
            ),
            node_check=identity,
        )
        self.page = AlertsPage(self.service.open_alerts_snapshot, instance=self.instance, role=self.role)
        self._codec, self._extra = codec, extra
        self._state = life.state if life is not None else None
        self._stop = life.stop if life is not None else None
        self.loop: ConsumeLoop | None = None
        self.elector: LeaderElector | None = None
        self.guard_error: str | None = None  # set when --ha instances joined this plain one's group
        if opts.ha:
            self.elector = LeaderElector(
                opts.bootstrap,
                prefix=opts.topic_prefix,
                group_id=opts.group_id,
                instance=self.instance,
                session_timeout_ms=opts.ha_session_timeout_ms,
                extra=extra,
                create_topic=opts.create_topics,
            )
            sink.fence = self.elector.fenced  # checked per record: a fenced leader publishes nothing
        else:
            self._refuse_a_group_of_ha_instances()
            self.activate()

    def _refuse_a_group_of_ha_instances(self) -> None:
        """A plain instance must not join the input group of ``--ha`` instances: it would take part of the
        leader's partitions (each XID seen by one of two engines, two publishers, two cordoners) and
        nothing fences it. Live HA instances are the members of the leader group (see :func:`ha_members`)."""
        line = self._ha_conflict()
        if line:
            raise ConfigError(line)

    def _ha_conflict(self) -> str | None:
        opts = self.opts
        members = ha_members(opts.bootstrap, opts.group_id, extra=opts.extra)
        if not members:
            return None
        return (
            f"--group-id {opts.group_id} is used by --ha instances ({', '.join(members)}): a plain "
            "instance would split their input and publish beside their leader; run it with --ha (it "
            "stands by), or give it a --group-id of its own"
        )

    def _guard(self, stop: threading.Event) -> None:
        """The same check while running: --ha instances started after this plain one stop it (it cannot
        be fenced, so it fences itself); the command then exits with the line (``guard_error``)."""
        while not stop.wait(self.opts.ha_guard_interval_ms / 1000):
            line = self._ha_conflict()
            if line:
                self.guard_error = line
                log.error("stopping: " + line)
                stop.set()
                return

    def activate(self) -> None:
        """Restore state and build the consume loop: at start, or when this instance becomes the leader."""
        opts, codec, extra = self.opts, self._codec, self._extra
        # The cordon ledger always needs the rate-limit window, however short --restore-lookback is.
        lookback = max(opts.restore_lookback_ms, HOUR_MS if self.cordoner is not None else 0)
        if lookback:
            records = startup.retry(  # a fresh topic's leaders may still be moving: wait, do not crash
                lambda: restore_from_topic(opts.bootstrap, self.alerts_topic, codec, lookback, extra),
                what=f"restore of open alerts from {self.alerts_topic}",
                transient=(GpupipeError,),
                timeout_s=opts.startup_timeout_ms / 1000,
                state=self._state,
                stop=self._stop,
            )
            since = self.service.now_ms() - opts.restore_lookback_ms
            alerts = [r for r in records if opts.restore_lookback_ms and r["emitted_at_ms"] >= since]
            self.service.restore(alerts, ledger=records)
        if opts.ha:  # the input group moves to the standby as fast as the leader group does
            timeout = opts.ha_session_timeout_ms
            extra = {
                "session.timeout.ms": str(timeout),
                "heartbeat.interval.ms": str(max(500, timeout // 5)),
                **(extra or {}),
            }
        self.loop = ConsumeLoop(
            bootstrap=opts.bootstrap,
            group_id=opts.group_id,
            topics=self.inputs,
            handler=self.service,
            # samples: only the fields alerts and the contract check read; the rest the codec's
            codec=AlertsDecoder(codec),  # type: ignore[arg-type]
            deadletter_topic=topics.with_prefix(opts.topic_prefix, topics.DEADLETTER),
            service="alerts",
            registry=self.registry,
            extra=extra,
            from_beginning=opts.from_beginning,
            topic_prefix=opts.topic_prefix,
        )

    def routes(self) -> dict[str, Route]:
        """``/metrics``, and the open alerts as a page and as JSON (behind the same TLS and auth)."""
        return {"/metrics": registry_route(self.registry), **self.page.routes()}

    def role(self) -> str:
        if self.elector is None:
            return "single"
        return "leader" if self.elector.is_leader else "standby"

    def health(self) -> tuple[bool, dict[str, object]]:
        detail: dict[str, object] = {
            "open_alerts": self.service.open_alerts,
            "instance": self.instance,
            "role": self.role(),
        }
        if self.elector is not None and self.elector.fenced():
            detail["fenced"] = True  # leadership lost: the service is stopping (restarts as a standby)
            return False, detail
        if self.loop is None:  # a standby is healthy while it waits to lead
            return self.elector is not None, detail
        return self.loop.healthy, {**detail, **self.loop.health_detail()}

    def run(self, stop: threading.Event) -> None:
        """Serve until ``stop`` is set (or the consume loop fails, or leadership is lost), then shut down."""
        opts = self.opts
        if self.elector is not None:
            self.elector.start()
            log.info("standing by for leadership", extra=fields(instance=self.instance))
            while not stop.is_set() and not self.elector.acquired.wait(0.2):
                pass
            if stop.is_set():
                self.elector.stop()
                return
            threading.Thread(
                target=_fence, args=(self.elector, stop), name="alerts-fence", daemon=True
            ).start()
            self.activate()
        else:
            threading.Thread(target=self._guard, args=(stop,), name="alerts-ha-guard", daemon=True).start()
        assert self.loop is not None
        if self.alertmanager is not None:
            self.alertmanager.start()
        if self.cordoner is not None:
            self.cordoner.start()
        ticker = threading.Thread(
            target=_tick_loop, args=(self.service, stop), name="alerts-tick", daemon=True
        )
        ticker.start()
        log.info(
            "alerts service started",
            extra=fields(
                input=self.inputs,
                output=self.alerts_topic,
                instance=self.instance,
                alertmanager=opts.alertmanager_urls,
                cordon="dry-run" if opts.dry_run else ("on" if opts.cordon else "off"),
                dedupe_window_ms=opts.engine.dedupe_window_ms,
                resolve_after_ms=opts.engine.resolve_after_ms,
            ),
        )
        try:
            self.loop.run(stop)
        finally:
            stop.set()
            ticker.join(10)
            if self.cordoner is not None:
                self.cordoner.stop()
            try:
                if self.elector is not None and self.elector.fenced():
                    # fenced: the new leader owns the alerts now; publishing here would contradict it
                    log.warning("leadership lost: pending revisions left to the new leader")
                else:
                    self.service.flush()
            finally:
                if self.alertmanager is not None:
                    self.alertmanager.stop()
                if self.elector is not None:
                    self.elector.stop()
        log.info("alerts service stopped", extra=fields(records=self.service.records_out))


def run(args: argparse.Namespace) -> int:
    if args.ack:
        return _ack(args)
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
    apps: list[AlertsApp] = []

    def build(life: Lifecycle) -> AlertsApp:
        apps.append(AlertsApp(opts, life))
        return apps[0]

    rc = run_service(spec, build)
    if apps and apps[0].guard_error:
        raise ConfigError(apps[0].guard_error)
    return rc


def _fence(elector: LeaderElector, stop: threading.Event) -> None:
    """Stop the service as soon as leadership is lost: never two publishers (see leader module)."""
    while not stop.is_set():
        if elector.lost.wait(0.2) or elector.fenced():
            stop.set()
            return


def _ack(args: argparse.Namespace) -> int:
    from gpupipe_consumers.alerts.ack import publish_ack

    extra = parse_kafka_overrides(args.kafka_config)
    wait_for_broker(args.bootstrap_servers, extra=extra)
    topic = topics.with_prefix(args.topic_prefix, topics.ALERTS)
    codec = codec_from_url(args.schema_registry_url)
    rec = publish_ack(
        args.bootstrap_servers,
        topic,
        codec,
        args.ack,
        args.ack_note,
        args.restore_lookback or 86_400_000,
        extra,
    )
    print(f"acknowledged {rec['alert_id']} ({rec['alertname']} on {rec['hostname']}) on {topic}")
    return 0


def _tick_loop(service: AlertsService, stop: threading.Event, interval_s: float = 1.0) -> None:
    while not stop.wait(interval_s):
        try:
            service.tick()
        except Exception:
            log.exception("alerts tick failed")
            stop.set()
