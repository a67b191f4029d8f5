"""The recommend service as the runner builds it: the consume loop over samples, the idle detector's
handler, the restore of open recommendations and the optional Alertmanager sender."""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import cast

from prometheus_client import CollectorRegistry

from gpupipe.clients.alertmanager import AlertmanagerFanout, AlertmanagerMetrics, AlertmanagerSender
from gpupipe.common.errors import GpupipeError
from gpupipe.common.logs import fields
from gpupipe.domain import node_check
from gpupipe.domain.prices import PriceTable
from gpupipe.domain.teams import TeamMap
from gpupipe.kafka import ready, topics
from gpupipe.lifecycle.runner import Lifecycle
from gpupipe_consumers.plumbing.consume_loop import ConsumeLoop
from gpupipe_consumers.plumbing.topic_reader import read_topic
from gpupipe_consumers.recommend.detector import DetectorConfig, IdleDetector
from gpupipe_consumers.recommend.handler import RecommendHandler, am_shape, kafka_recommendation_sink
from gpupipe_schemas.codec import codec_from_url
from gpupipe_schemas.records import GpuRecommendation

log = logging.getLogger("gpupipe.recommend")


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


class RecommendService:
    """The consume loop, the detector's handler and the optional Alertmanager sender, run as one."""

    def __init__(
        self,
        handler: RecommendHandler,
        loop: ConsumeLoop,
        registry: CollectorRegistry,
        alertmanager: AlertmanagerFanout | None,
        cfg: DetectorConfig,
        output_topic: str,
    ) -> None:
        self.handler, self.loop, self.registry = handler, loop, registry
        self.alertmanager, self.cfg, self.output_topic = alertmanager, cfg, output_topic

    def health(self) -> tuple[bool, dict[str, object]]:
        return self.loop.healthy, {
            "open_recommendations": len(self.handler.open),
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
            self.handler.flush()
        finally:
            if self.alertmanager is not None:
                self.alertmanager.stop()
        log.info("recommend service stopped", extra=fields(records=self.handler.records_out))


def build(
    opts: RecommendOptions,
    cfg: DetectorConfig,
    prices: PriceTable,
    teams: TeamMap,
    life: Lifecycle,
) -> RecommendService:
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
    handler = RecommendHandler(
        detector,
        kafka_recommendation_sink(opts.bootstrap, t_out, codec, extra),
        registry,
        alertmanager,
    )
    if opts.restore_lookback_ms:
        since = int(time.time() * 1000) - opts.restore_lookback_ms
        records = ready.retry(  # a fresh topic's leaders may still be moving: wait, do not crash
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
        restored = handler.restore(cast(list[GpuRecommendation], records))  # read with its own schema
        log.info("open recommendations restored", extra=fields(count=restored))
    check = None
    if opts.node_identity is not None:
        check = opts.node_identity.check("recommend", ("GpuSample",))
        registry.register(node_check.NodeCheckCollector(check, "recommend"))
    loop = ConsumeLoop(
        bootstrap=opts.bootstrap,
        group_id=opts.group_id,
        topics=[t_samples],
        handler=handler,
        codec=codec,
        deadletter_topic=topics.with_prefix(opts.topic_prefix, topics.DEADLETTER),
        service="recommend",
        registry=registry,
        extra=extra,
        from_beginning=opts.from_beginning,
        topic_prefix=opts.topic_prefix,
        node_check=check,
    )
    return RecommendService(handler, loop, registry, alertmanager, cfg, t_out)
