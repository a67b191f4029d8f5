"""Find GPUs that pods hold and do not use, and say what to do: gpu.samples.v1 -> gpu.recommendations.v1.

A pod holding a GPU, MIG slice or shared replica whose activity stays under --idle-threshold for
longer than --idle-after gets a GpuRecommendation: who, what, how long, GPU-hours and cost wasted so
far, and an action (release; right-size to a named MIG profile or a shared GPU; a cheaper model). It
is updated every --update-interval while it lasts and resolved when the pod ends, gets busy, or its
GPU goes silent. Open recommendations are Prometheus series on --listen and, optionally, info alerts
in Alertmanager. A separate service (not part of chargeback or metrics) so that its state and its
restarts touch neither billing's exactly-once transactions nor the metrics exposition; it restores
its open recommendations from its own topic when it restarts. Run one active instance.
"""

from __future__ import annotations

import argparse
import logging
import threading
import time
from dataclasses import dataclass
from typing import cast

from prometheus_client import CollectorRegistry

from gpupipe import node_check, service_flags, startup, topics
from gpupipe.acls import DEFAULT_GROUPS
from gpupipe.alertmanager import AlertmanagerFanout, AlertmanagerMetrics, AlertmanagerSender
from gpupipe.argtypes import duration_ms, field_default, keyword_default
from gpupipe.errors import ConfigError, GpupipeError
from gpupipe.kafka_admin import parse_kafka_overrides
from gpupipe.logs import fields
from gpupipe.prices import PriceTable, load_price_table
from gpupipe.runner import KafkaNeeds, Lifecycle, ServiceSpec, run_service
from gpupipe.teams import TeamMap, load_team_map
from gpupipe_consumers.consume_loop import ConsumeLoop
from gpupipe_consumers.recommend.detector import DetectorConfig, IdleDetector
from gpupipe_consumers.recommend.rightsize import MIB, RightSizeConfig
from gpupipe_consumers.recommend.service import RecommendService, am_shape, kafka_recommendation_sink
from gpupipe_consumers.topic_reader import read_topic
from gpupipe_schemas.codec import codec_from_url
from gpupipe_schemas.records import GpuRecommendation

USES_KAFKA = True

log = logging.getLogger("gpupipe.recommend")


#: One line for `gpupipe --help`.
HELP = "recommend what to do with GPUs that pods hold idle"


def add_arguments(p: argparse.ArgumentParser) -> None:
    service_flags.add_listen(p, serves="/metrics (open recommendations)")
    p.add_argument("--group-id", default=DEFAULT_GROUPS["recommend"], help="Kafka consumer group")
    service_flags.add_from_beginning(p, what="samples")
    service_flags.add_create_topics(p)
    p.add_argument(
        "--idle-threshold",
        type=float,
        default=field_default(DetectorConfig, "idle_threshold"),
        help="activity (SM active, else GPU utilisation, 0..1) under which a sample is idle",
    )
    p.add_argument(
        "--idle-after",
        type=duration_ms,
        default=field_default(DetectorConfig, "idle_after_ms"),
        metavar="DURATION",
        help="idle this long before a recommendation fires",
    )
    p.add_argument(
        "--update-interval",
        type=duration_ms,
        default=field_default(DetectorConfig, "update_interval_ms"),
        metavar="DURATION",
        help="publish an update of an open recommendation this often, in event time",
    )
    p.add_argument(
        "--gone-after",
        type=duration_ms,
        default=field_default(DetectorConfig, "gone_after_ms"),
        metavar="DURATION",
        help="resolve a recommendation whose GPU sent nothing for this long",
    )
    p.add_argument(
        "--max-gpus",
        type=int,
        default=field_default(DetectorConfig, "max_gpus"),
        metavar="N",
        help="track at most N GPUs: a new one beyond makes the least recently sampled be forgotten "
        "(a bound on what samples for made-up UUIDs can make the service hold)",
    )
    p.add_argument(
        "--prices", default=None, metavar="FILE", help="price table YAML (as chargeback's) for costs"
    )
    p.add_argument("--teams", default=None, metavar="FILE", help="team mapping YAML (as the reports')")
    p.add_argument(
        "--release-memory",
        type=int,
        default=field_default(RightSizeConfig, "release_memory_bytes") // MIB,
        metavar="MIB",
        help="an idle pod whose memory peak stays under this many MiB should release its GPU",
    )
    p.add_argument(
        "--shared-replicas",
        type=int,
        default=field_default(RightSizeConfig, "shared_replicas"),
        metavar="N",
        help="replicas per time-sliced GPU in your shared pool, for shared_gpu suggestions",
    )
    p.add_argument(
        "--restore-lookback",
        type=duration_ms,
        default=7 * 86_400_000,
        metavar="DURATION",
        help="how far back gpu.recommendations.v1 is read at start to continue open ones",
    )
    am = p.add_argument_group("Alertmanager (optional)")
    am.add_argument(
        "--alertmanager-url",
        action="append",
        default=[],
        metavar="URL",
        help="also post open recommendations as severity=info alerts (repeatable)",
    )
    am.add_argument(
        "--resend-interval",
        type=duration_ms,
        default=keyword_default(AlertmanagerSender, "resend_interval_ms"),
        metavar="DURATION",
        help="re-send open recommendations to Alertmanager this often",
    )
    ident = p.add_argument_group("node identity (which node wrote a sample)")
    service_flags.add_node_identity(
        ident, records="a sample's", refused="dead-letters a sample that fails the check"
    )
    startup.add_arguments(p)


def detector_config(args: argparse.Namespace, currency: str) -> DetectorConfig:
    if not 0 < args.idle_threshold <= 1:
        raise ConfigError("--idle-threshold must be within (0, 1]")
    if args.idle_after <= 0 or args.update_interval <= 0 or args.gone_after <= 0:
        raise ConfigError("--idle-after, --update-interval and --gone-after must be greater than zero")
    if args.max_gpus < 1:
        raise ConfigError("--max-gpus must be at least 1")
    if args.shared_replicas < 2 or args.release_memory < 0:
        raise ConfigError("--shared-replicas must be at least 2 and --release-memory not negative")
    for url in args.alertmanager_url:
        if not url.startswith(("http://", "https://")):
            raise ConfigError(f"--alertmanager-url must start with http:// or https://, got {url!r}")
    return DetectorConfig(
        idle_threshold=args.idle_threshold,
        idle_after_ms=args.idle_after,
        update_interval_ms=args.update_interval,
        gone_after_ms=args.gone_after,
        max_gpus=args.max_gpus,
        currency=currency,
        rightsize=RightSizeConfig(
            release_memory_bytes=args.release_memory * MIB, shared_replicas=args.shared_replicas
        ),
    )


class RecommendApp:
    """The consume loop, the detector's service and the optional Alertmanager sender, run as one."""

    def __init__(
        self,
        service: RecommendService,
        loop: ConsumeLoop,
        registry: CollectorRegistry,
        alertmanager: AlertmanagerFanout | None,
        cfg: DetectorConfig,
        output_topic: str,
    ) -> None:
        self.service, self.loop, self.registry = service, loop, registry
        self.alertmanager, self.cfg, self.output_topic = alertmanager, cfg, output_topic

    def health(self) -> tuple[bool, dict[str, object]]:
        return self.loop.healthy, {
            "open_recommendations": len(self.service.open),
            **self.loop.health_detail(),
        }

    def run(self, stop: threading.Event) -> None:
        if self.alertmanager is not None:
            self.alertmanager.start()
        log.info(
            "recommend service started",
            extra=fields(
                input=self.loop.topics,
                output=self.output_topic,
                idle_after_ms=self.cfg.idle_after_ms,
                threshold=self.cfg.idle_threshold,
            ),
        )
        self.loop.run(stop)

    def close(self) -> None:
        try:
            self.service.flush()
        finally:
            if self.alertmanager is not None:
                self.alertmanager.stop()
        log.info("recommend service stopped", extra=fields(records=self.service.records_out))


def run(args: argparse.Namespace) -> int:
    prices = load_price_table(args.prices) if args.prices else PriceTable()
    teams = load_team_map(args.teams) if args.teams else TeamMap()
    cfg = detector_config(args, prices.currency)  # config errors before any network
    extra = parse_kafka_overrides(args.kafka_config)
    spec = ServiceSpec.from_args(
        "recommend",
        args,
        KafkaNeeds(
            args.bootstrap_servers,
            topics.to_prepare(
                [topics.SAMPLES, topics.RECOMMENDATIONS, topics.DEADLETTER], create=args.create_topics
            ),
            prefix=args.topic_prefix,
            create=args.create_topics,
            extra=extra,
        ),
    )
    opts = options_from_args(args, extra)
    return run_service(spec, lambda life: build(opts, cfg, prices, teams, life))


@dataclass(frozen=True, slots=True)
class RecommendOptions:
    """What the service is run with beyond the detector's config, typed: the flags end here.

    No defaults here: the flags hold them (and `--help` shows them)."""

    bootstrap: str
    topic_prefix: str
    group_id: str
    schema_registry_url: str | None
    extra: dict[str, str]  # librdkafka settings
    from_beginning: bool
    alertmanager_urls: tuple[str, ...]
    resend_interval_ms: int
    restore_lookback_ms: int
    node_identity: node_check.NodeIdentity | None  # None: a sample's hostname is taken as written


def options_from_args(args: argparse.Namespace, extra: dict[str, str]) -> RecommendOptions:
    return RecommendOptions(
        bootstrap=args.bootstrap_servers,
        topic_prefix=args.topic_prefix,
        group_id=args.group_id,
        schema_registry_url=args.schema_registry_url,
        extra=extra,
        from_beginning=args.from_beginning,
        alertmanager_urls=tuple(args.alertmanager_url or ()),
        resend_interval_ms=args.resend_interval,
        restore_lookback_ms=args.restore_lookback,
        node_identity=node_check.from_args(args),  # a bad CA bundle: one line, before any network
    )


def build(
    opts: RecommendOptions,
    cfg: DetectorConfig,
    prices: PriceTable,
    teams: TeamMap,
    life: Lifecycle,
) -> RecommendApp:
    extra = opts.extra
    t_samples = topics.with_prefix(opts.topic_prefix, topics.SAMPLES)
    t_out = topics.with_prefix(opts.topic_prefix, topics.RECOMMENDATIONS)
    codec = codec_from_url(opts.schema_registry_url)
    registry = CollectorRegistry()
    alertmanager = None
    if opts.alertmanager_urls:
        am_metrics = AlertmanagerMetrics(registry)
        alertmanager = AlertmanagerFanout(
            [
                AlertmanagerSender(
                    url, shape=am_shape, resend_interval_ms=opts.resend_interval_ms, metrics=am_metrics
                )
                for url in opts.alertmanager_urls
            ]
        )
    detector = IdleDetector(
        cfg,
        gpu_price=lambda model: prices.gpu_price(model).per_gpu_hour,
        team_of=lambda ns, labels: teams.match(ns, labels),
    )
    service = RecommendService(
        detector,
        kafka_recommendation_sink(opts.bootstrap, t_out, codec, extra),
        registry,
        alertmanager,
    )
    if opts.restore_lookback_ms:
        since = int(time.time() * 1000) - opts.restore_lookback_ms
        records = startup.retry(  # a fresh topic's leaders may still be moving: wait, do not crash
            lambda: read_topic(
                opts.bootstrap,
                t_out,
                codec,
                "GpuRecommendation",
                since_ms=since,
                extra=extra,
                missing_ok=True,  # first start with --no-create-topics: nothing to restore
            ),
            what=f"restore of open recommendations from {t_out}",
            transient=(GpupipeError,),
            timeout_s=life.startup_timeout_s,
            state=life.state,
            stop=life.stop,
        )
        restored = service.restore(cast(list[GpuRecommendation], records))  # read with that schema
        log.info("open recommendations restored", extra=fields(count=restored))
    check = None
    if opts.node_identity is not None:
        check = opts.node_identity.check("recommend", ("GpuSample",))
        registry.register(node_check.NodeCheckCollector(check, "recommend"))
    loop = ConsumeLoop(
        bootstrap=opts.bootstrap,
        group_id=opts.group_id,
        topics=[t_samples],
        handler=service,
        codec=codec,
        deadletter_topic=topics.with_prefix(opts.topic_prefix, topics.DEADLETTER),
        service="recommend",
        registry=registry,
        extra=extra,
        from_beginning=opts.from_beginning,
        topic_prefix=opts.topic_prefix,
        node_check=check,
    )
    return RecommendApp(service, loop, registry, alertmanager, cfg, t_out)
