"""Classify and deduplicate GPU faults into alerts: gpu.xid.v1 (+ gpu.samples.v1 health) -> gpu.alerts.v1.

Each XID is classified with NVIDIA's pinned XID catalog and its workflows (severity, cause class,
recommended action, drain or not), repeats of the same fault on the same GPU fold into one alert with an
occurrence count, a burst across several GPUs of one node becomes one node-level alert, and alerts
resolve after a quiet period. Health fields of the samples raise alerts too (uncorrectable ECC, row
remapping pending/failed, GPU lost, sustained thermal throttling). Optionally forwards to Alertmanager's
v2 API and cordons nodes whose alert calls for draining (rate limited; --dry-run to see what it would do).
Run one active instance; it restores its open alerts from gpu.alerts.v1 when it restarts.
"""

from __future__ import annotations

import argparse
import logging
import signal
import socket
import threading

from prometheus_client import CollectorRegistry

from consumers.alerts.alertmanager import AlertmanagerFanout, AlertmanagerMetrics, AlertmanagerSender
from consumers.alerts.cordon import Cordoner, KubeNodeApi, kube_config
from consumers.alerts.dedupe import EngineConfig
from consumers.alerts.health_signals import HealthConfig
from consumers.alerts.service import AlertsService, KafkaAlertSink, restore_from_topic
from consumers.consume_loop import ConsumeLoop
from gpupipe import startup, topics
from gpupipe.argtypes import duration_ms
from gpupipe.errors import ConfigError, GpupipeError
from gpupipe.health_server import ServiceHttp
from gpupipe.kafka_admin import parse_kafka_overrides
from gpupipe.logs import fields
from schemas.codec import codec_from_url

USES_KAFKA = True

log = logging.getLogger("gpupipe.alerts")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--listen", default=None, help="HOST:PORT for the service's /metrics and /healthz")
    p.add_argument(
        "--group-id", default="gpupipe-alerts", help="Kafka consumer group (default gpupipe-alerts)"
    )
    p.add_argument(
        "--from-beginning",
        action="store_true",
        help="a new consumer group starts at the oldest retained input instead of the newest",
    )
    p.add_argument(
        "--create-topics",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="create missing topics with default partitions and retention",
    )
    p.add_argument(
        "--instance-id",
        default=None,
        help="name of this instance in records and cordon annotations (host name)",
    )
    life = p.add_argument_group("deduplication and lifecycle")
    life.add_argument(
        "--dedupe-window",
        type=duration_ms,
        default=600_000,
        metavar="DURATION",
        help="repeats of the same fault on the same GPU within this gap fold into one alert (default 10m)",
    )
    life.add_argument(
        "--resolve-after",
        type=duration_ms,
        default=1_800_000,
        metavar="DURATION",
        help="an alert resolves after this long without an occurrence (default 30m)",
    )
    life.add_argument(
        "--update-interval",
        type=duration_ms,
        default=30_000,
        metavar="DURATION",
        help="publish count/last-seen updates of an alert at most this often (default 30s); new, "
        "escalated and resolved alerts go out at once",
    )
    life.add_argument(
        "--node-burst-gpus",
        type=int,
        default=3,
        metavar="N",
        help="GPUs of one node with faults within --node-burst-window that make a node-level alert "
        "(default 3)",
    )
    life.add_argument(
        "--node-burst-window", type=duration_ms, default=60_000, metavar="DURATION", help="default 60s"
    )
    life.add_argument(
        "--restore-lookback",
        type=duration_ms,
        default=86_400_000,
        metavar="DURATION",
        help="how far back gpu.alerts.v1 is read at startup to restore open alerts (default 24h)",
    )
    health = p.add_argument_group("health signals from gpu.samples.v1")
    health.add_argument(
        "--health-signals",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also consume gpu.samples.v1 for ECC, row-remap, GPU-lost and thermal alerts (default on)",
    )
    health.add_argument(
        "--thermal-for",
        type=duration_ms,
        default=300_000,
        metavar="DURATION",
        help="thermal clock-event bits must be set this long to alert (default 5m)",
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
        default=60_000,
        metavar="DURATION",
        help="re-send firing alerts this often, with endsAt = now + 4 x this (default 1m)",
    )
    am.add_argument(
        "--alertmanager-timeout", type=duration_ms, default=10_000, metavar="DURATION", help="default 10s"
    )
    am.add_argument(
        "--alertmanager-max-alerts",
        type=int,
        default=10_000,
        metavar="N",
        help="alerts held for Alertmanager while it is unreachable (default 10000)",
    )
    k8s = p.add_argument_group("remediation (Kubernetes cordon)")
    k8s.add_argument(
        "--cordon", action="store_true", help="cordon nodes whose alert calls for draining (default off)"
    )
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
        help="never cordon more than N nodes in any hour (default 2; 0 disables cordoning)",
    )
    k8s.add_argument("--kube-api-url", default=None, help="API server URL (default: in-cluster config)")
    k8s.add_argument("--kube-token-file", default=None, help="bearer token file (default: service account)")
    k8s.add_argument("--kube-ca-file", default=None, help="CA bundle for the API server's certificate")
    startup.add_arguments(p)


def _configs(args: argparse.Namespace) -> tuple[EngineConfig, HealthConfig]:
    if args.dedupe_window <= 0 or args.resolve_after <= 0 or args.node_burst_window <= 0:
        raise ConfigError(
            "--dedupe-window, --resolve-after and --node-burst-window must be greater than zero"
        )
    if args.update_interval < 0 or args.thermal_for < 0:
        raise ConfigError("--update-interval and --thermal-for must not be negative")
    if args.node_burst_gpus < 2:
        raise ConfigError("--node-burst-gpus must be at least 2")
    if args.resend_interval <= 0 or args.alertmanager_timeout <= 0:
        raise ConfigError("--resend-interval and --alertmanager-timeout must be greater than zero")
    if args.alertmanager_max_alerts < 1:
        raise ConfigError("--alertmanager-max-alerts must be at least 1")
    if args.cordon_max_per_hour < 0:
        raise ConfigError("--cordon-max-per-hour must not be negative")
    if args.restore_lookback < 0:
        raise ConfigError("--restore-lookback must not be negative")
    for url in args.alertmanager_url:
        if not url.startswith(("http://", "https://")):
            raise ConfigError(f"--alertmanager-url must start with http:// or https://, got {url!r}")
    engine = EngineConfig(
        dedupe_window_ms=args.dedupe_window,
        resolve_after_ms=args.resolve_after,
        update_interval_ms=args.update_interval,
        node_burst_gpus=args.node_burst_gpus,
        node_burst_window_ms=args.node_burst_window,
    )
    return engine, HealthConfig(thermal_for_ms=args.thermal_for)


class _Stop:
    def __init__(self) -> None:
        self.event = threading.Event()

    def install(self) -> None:
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, lambda *_: self.event.set())
            signal.signal(signal.SIGINT, lambda *_: self.event.set())


class AlertsApp:
    """The service wired from parsed arguments; :func:`run` and the storm benchmark use it."""

    def __init__(self, args: argparse.Namespace, state: startup.StartupState | None = None) -> None:
        engine_cfg, health_cfg = _configs(args)
        self.args = args
        self.instance = args.instance_id or socket.gethostname()
        kube = None
        if args.cordon and not args.dry_run:
            kube = KubeNodeApi(kube_config(args.kube_api_url, args.kube_token_file, args.kube_ca_file))
        extra = parse_kafka_overrides(args.kafka_config)
        needed = [topics.XID, topics.ALERTS, topics.DEADLETTER] + ([topics.SAMPLES] * args.health_signals)
        startup.prepare_kafka(  # waits (503 on /healthz) until Kafka and the topics are usable
            args.bootstrap_servers,
            topics.ALL if args.create_topics else needed,
            prefix=args.topic_prefix,
            create=args.create_topics,
            extra=extra,
            timeout_s=getattr(args, "startup_timeout", 0) / 1000,
            state=state,
        )
        t_xid = topics.with_prefix(args.topic_prefix, topics.XID)
        t_samples = topics.with_prefix(args.topic_prefix, topics.SAMPLES)
        self.alerts_topic = topics.with_prefix(args.topic_prefix, topics.ALERTS)
        self.inputs = [t_xid, t_samples] if args.health_signals else [t_xid]
        codec = codec_from_url(args.schema_registry_url)
        self.registry = CollectorRegistry()
        self.alertmanager = None
        if args.alertmanager_url:
            am_metrics = AlertmanagerMetrics(self.registry)
            self.alertmanager = AlertmanagerFanout(
                [
                    AlertmanagerSender(
                        url,
                        resend_interval_ms=args.resend_interval,
                        timeout_s=args.alertmanager_timeout / 1000,
                        max_alerts=args.alertmanager_max_alerts,
                        metrics=am_metrics,
                    )
                    for url in args.alertmanager_url
                ]
            )
        self.cordoner = None
        if args.cordon or args.dry_run:
            self.cordoner = Cordoner(
                kube,
                dry_run=args.dry_run,
                max_per_hour=args.cordon_max_per_hour,
                on_result=lambda result: self.service.on_cordon_result(result),
                instance=self.instance,
            )
        self.service = AlertsService(
            sink=KafkaAlertSink(args.bootstrap_servers, self.alerts_topic, codec, extra),
            engine_config=engine_cfg,
            health_config=health_cfg,
            registry=self.registry,
            alertmanager=self.alertmanager,
            cordoner=self.cordoner,
            instance=self.instance,
        )
        if args.restore_lookback:
            records = startup.retry(  # a fresh topic's leaders may still be moving: wait, do not crash
                lambda: restore_from_topic(
                    args.bootstrap_servers, self.alerts_topic, codec, args.restore_lookback, extra
                ),
                what=f"restore of open alerts from {self.alerts_topic}",
                transient=(GpupipeError,),
                timeout_s=getattr(args, "startup_timeout", 0) / 1000,
                state=state,
            )
            self.service.restore(records)
        self.loop = ConsumeLoop(
            bootstrap=args.bootstrap_servers,
            group_id=args.group_id,
            topics=self.inputs,
            handler=self.service,
            codec=codec,
            deadletter_topic=topics.with_prefix(args.topic_prefix, topics.DEADLETTER),
            service="alerts",
            registry=self.registry,
            extra=extra,
            from_beginning=args.from_beginning,
        )

    def health(self) -> tuple[bool, dict[str, object]]:
        return self.loop.healthy, {"open_alerts": self.service.open_alerts, "instance": self.instance}

    def run(self, stop: threading.Event) -> None:
        """Serve until ``stop`` is set (or the consume loop fails), then shut down in order."""
        args = self.args
        http = ServiceHttp(args.listen, self.registry, self.health).start() if args.listen else None
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
                alertmanager=args.alertmanager_url,
                cordon="dry-run" if args.dry_run else ("on" if args.cordon else "off"),
                dedupe_window_ms=args.dedupe_window,
                resolve_after_ms=args.resolve_after,
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
                self.service.flush()
            finally:
                if self.alertmanager is not None:
                    self.alertmanager.stop()
                if http is not None:
                    http.stop()
        log.info("alerts service stopped", extra=fields(records=self.service.records_out))


def run(args: argparse.Namespace) -> int:
    state = startup.StartupState()
    with startup.StartupHealth(args.listen, state, "alerts"):
        app = AlertsApp(args, state)
    stop = threading.Event()
    startup.ShutdownDeadline(stop, args.shutdown_timeout, "alerts").install()
    app.run(stop)
    return 0


def _tick_loop(service: AlertsService, stop: threading.Event, interval_s: float = 1.0) -> None:
    while not stop.wait(interval_s):
        try:
            service.tick()
        except Exception:
            log.exception("alerts tick failed")
            stop.set()
