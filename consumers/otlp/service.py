"""The otlp service as the runner builds it: the consume loop over samples and XID events, and the
handler that exports each batch to the collector before its offsets are stored."""

from __future__ import annotations

import argparse
import logging
import threading

from prometheus_client import CollectorRegistry

from gpupipe.common.logs import fields
from gpupipe.kafka import topics
from gpupipe.lifecycle.runner import Lifecycle
from gpupipe_consumers.otlp.export import OtlpConfig, Transport
from gpupipe_consumers.otlp.handler import ExportAbandoned, OtlpHandler
from gpupipe_consumers.plumbing.consume_loop import ConsumeLoop
from gpupipe_schemas.codec import codec_from_url

log = logging.getLogger("gpupipe.otlp")


class OtlpService:
    """The consume loop and the exporting handler, run as one."""

    def __init__(self, handler: OtlpHandler, loop: ConsumeLoop, registry: CollectorRegistry, cfg: OtlpConfig):
        self.handler, self.loop, self.registry, self.cfg = handler, loop, registry, cfg

    def health(self) -> tuple[bool, dict[str, object]]:
        return self.loop.healthy and self.handler.failing is None, {
            "exported_points": self.handler.exported["metrics"],
            "exported_log_records": self.handler.exported["logs"],
            **self.handler.health_detail(),
            **self.loop.health_detail(),
        }

    def run(self, stop: threading.Event) -> None:
        self.handler.stop = stop
        log.info(
            "otlp service started",
            extra=fields(input=self.loop.topics, endpoint=self.cfg.endpoint, protocol=self.cfg.protocol),
        )
        try:
            self.loop.run(stop)
        except ExportAbandoned as exc:  # the held batch is uncommitted: a restart sends it again
            log.warning("stopped with a batch not exported", extra=fields(error=str(exc)))

    def close(self) -> None:
        self.handler.transport.close()
        log.info("otlp service stopped", extra=fields(**self.handler.exported))


def build(
    args: argparse.Namespace, cfg: OtlpConfig, tx: Transport, extra: dict[str, str], life: Lifecycle
) -> OtlpService:
    registry = CollectorRegistry()
    handler = OtlpHandler(
        tx,
        registry,
        stop=life.stop,
        max_request_bytes=args.otlp_max_request_bytes,
        timeout_s=cfg.timeout_s,
    )
    loop = ConsumeLoop(
        bootstrap=args.bootstrap_servers,
        group_id=args.group_id,
        topics=[topics.with_prefix(args.topic_prefix, t) for t in (topics.SAMPLES, topics.XID)],
        handler=handler,
        codec=codec_from_url(args.schema_registry_url),
        deadletter_topic=topics.with_prefix(args.topic_prefix, topics.DEADLETTER),
        service="otlp",
        registry=registry,
        extra=extra,
        from_beginning=args.from_beginning,
        topic_prefix=args.topic_prefix,
    )
    return OtlpService(handler, loop, registry, cfg)
