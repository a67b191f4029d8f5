"""The lake writer as a service: the consume loop, the Iceberg writer and the commit timer."""

from __future__ import annotations

import argparse
import logging
import threading
from typing import Any

from confluent_kafka import Consumer
from prometheus_client import CollectorRegistry
from pyiceberg.catalog import Catalog

from gpupipe.common.logs import fields
from gpupipe.kafka import topics
from gpupipe.kafka.admin import client_config
from gpupipe.lifecycle.runner import Lifecycle
from gpupipe_consumers.lake import catalog as lake_catalog
from gpupipe_consumers.lake import recovery
from gpupipe_consumers.lake.tables import TABLES, LakeTable
from gpupipe_consumers.lake.writer import LakeWriter, load_table, open_table
from gpupipe_consumers.plumbing.consume_loop import ConsumeLoop
from gpupipe_schemas.codec import codec_from_url

log = logging.getLogger("gpupipe.lake")


class LakeService:
    """The consume loop, the writer and the timer that commits idle tables, run as one."""

    def __init__(self, writer: LakeWriter, loop: ConsumeLoop, registry: CollectorRegistry) -> None:
        self.writer, self.loop, self.registry = writer, loop, registry
        self._timer: threading.Thread | None = None

    def health(self) -> tuple[bool, dict[str, Any]]:
        """Healthy only while writing: polling, committing, and nothing buffered for too long.

        Reads only figures the writer publishes without its lock: while a commit is retried (a full
        disk, a catalog down) the lock is held, and this answers 503 with the commit's error."""
        w = self.writer
        stale = w.oldest_buffered_s() > max(3 * w.flush_interval_s, 30.0)
        detail: dict[str, Any] = {
            "rows_written": w.rows_written,
            "commits": w.commits,
            "rows_buffered": w.buffered,
            "bytes_buffered": w.buffered_bytes,
            **self.loop.health_detail(),
        }
        if w.committing:
            detail["committing"] = True
        if w.failing is not None:
            detail["commit_failing"] = w.failing
        if stale:
            detail["buffer_stale_s"] = round(w.oldest_buffered_s(), 1)
        return self.loop.healthy and w.failing is None and not stale, detail

    def _tick(self, stop: threading.Event) -> None:
        while not stop.wait(min(1.0, self.writer.flush_interval_s / 4)):
            self.writer.flush_due()

    def run(self, stop: threading.Event) -> None:
        self.writer.stop = stop
        self._timer = threading.Thread(target=self._tick, args=(stop,), name="lake-flush", daemon=True)
        self._timer.start()
        log.info("lake writer started", extra=fields(input=self.loop.topics))
        self.loop.run(stop)

    def close(self) -> None:
        if self._timer is not None:
            self._timer.join(5)
        # A clean stop commits what is buffered (a second signal cuts it short: read again later).
        self.writer.stop = threading.Event()
        self.writer.flush()
        log.info(
            "lake writer stopped", extra=fields(rows=self.writer.rows_written, commits=self.writer.commits)
        )


def check_missing_tables(
    args: argparse.Namespace, cat: Catalog, chosen: list[LakeTable], extra: dict[str, str], timeout_s: float
) -> None:
    """Refuse to recreate a table whose catalog was lost, unless --rebuild-catalog (see recovery)."""
    missing = [t for t in chosen if load_table(cat, args.namespace, t) is None]
    if not missing:
        return
    consumer = Consumer(client_config(args.bootstrap_servers, extra, **{"group.id": args.group_id}))
    try:
        found = [
            recovery.MissingTable(
                f"{args.namespace}.{t.name}",
                topic,
                args.group_id,
                recovery.kafka_history(consumer, topic, timeout_s),
                recovery.leftover_metadata(cat.properties.get("warehouse"), args.namespace, t.name),
            )
            for t in missing
            for topic in [topics.with_prefix(args.topic_prefix, t.topic)]
        ]
    finally:
        consumer.close()
    for table, lost in recovery.judge(found, args.catalog_name, rebuild=args.rebuild_catalog):
        log.warning(
            "lake table lost, rebuilding it from Kafka", extra=fields(table=table, lost_to_retention=lost)
        )


def build(args: argparse.Namespace, names: list[str], extra: dict[str, str], life: Lifecycle) -> LakeService:
    cat = lake_catalog.open_catalog(args)
    chosen = [t for t in TABLES if t.name in names]
    check_missing_tables(args, cat, chosen, extra, recovery.LOOKUP_TIMEOUT_S)
    tables = {
        topics.with_prefix(args.topic_prefix, t.topic): (t, open_table(cat, args.namespace, t))
        for t in chosen
    }
    registry = CollectorRegistry()
    writer = LakeWriter(
        tables,
        registry,
        flush_rows=args.flush_rows,
        flush_interval_s=args.flush_interval / 1000,
        buffer_bytes=args.buffer_bytes,
    )
    loop = ConsumeLoop(
        bootstrap=args.bootstrap_servers,
        group_id=args.group_id,
        topics=list(tables),
        handler=writer,
        codec=codec_from_url(args.schema_registry_url),
        deadletter_topic=topics.with_prefix(args.topic_prefix, topics.DEADLETTER),
        service="lake",
        registry=registry,
        extra=extra,
        from_beginning=True,
        topic_prefix=args.topic_prefix,
        resume=writer.resume,
    )
    return LakeService(writer, loop, registry)
