"""Write the topics to Apache Iceberg tables: the cold path data-platform jobs query.

Consumes gpu.samples.v1, gpu.xid.v1, gpu.alerts.v1 and gpu.chargeback.v1 and appends each record,
exactly once, to its table (``samples``, ``xid_events``, ``alerts``, ``chargeback_windows`` in
--namespace): Kafka offsets are stored in each Iceberg snapshot and a (re)start resumes from them,
so a kill -9 at any point loses and duplicates nothing. Kafka's retention no longer bounds how far
back "what did team X's GPUs do last quarter" can be answered. Undecodable records are
dead-lettered as by every consumer. The default catalog is SQLite with a local warehouse; any
pyiceberg catalog (REST and S3 in production) by properties. Run one active instance.
"""

from __future__ import annotations

import argparse
import logging
import threading
from typing import Any

from prometheus_client import CollectorRegistry

from consumers.consume_loop import ConsumeLoop
from consumers.lake import catalog as lake_catalog
from consumers.lake.tables import TABLES
from consumers.lake.writer import LakeWriter, open_table
from gpupipe import startup, topics
from gpupipe.argtypes import duration_ms
from gpupipe.errors import ConfigError
from gpupipe.kafka_admin import parse_kafka_overrides
from gpupipe.logs import fields
from gpupipe.runner import KafkaNeeds, Lifecycle, ServiceSpec, run_service
from schemas.codec import codec_from_url

USES_KAFKA = True

log = logging.getLogger("gpupipe.lake")

#: One line for `gpupipe --help`.
HELP = "write the topics to Apache Iceberg tables, exactly once (the cold path)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--listen", default=None, help="HOST:PORT for /metrics and /healthz")
    p.add_argument(
        "--group-id",
        default="gpupipe-lake",
        help="Kafka consumer group (lag only: offsets live in the tables)",
    )
    p.add_argument(
        "--tables",
        default=",".join(t.name for t in TABLES),
        help="comma-separated tables to write (" + ", ".join(t.name for t in TABLES) + ")",
    )
    p.add_argument(
        "--flush-rows", type=int, default=50_000, help="commit a table once this many rows are buffered"
    )
    p.add_argument(
        "--flush-interval",
        type=duration_ms,
        default=30_000,
        metavar="DURATION",
        help="commit a table whose oldest buffered row waited this long (rows visible to readers then)",
    )
    p.add_argument(
        "--create-topics", action=argparse.BooleanOptionalAction, default=True, help="create missing topics"
    )
    lake_catalog.add_arguments(p)
    startup.add_arguments(p)


class LakeApp:
    """The consume loop, the writer and the timer that commits idle tables, run as one."""

    def __init__(self, writer: LakeWriter, loop: ConsumeLoop, registry: CollectorRegistry) -> None:
        self.writer, self.loop, self.registry = writer, loop, registry
        self._timer: threading.Thread | None = None

    def health(self) -> tuple[bool, dict[str, Any]]:
        """Healthy only while writing: polling, committing, and nothing buffered for too long."""
        w = self.writer
        stale = w.oldest_buffered_s() > max(3 * w.flush_interval_s, 30.0)
        detail: dict[str, Any] = {
            "rows_written": w.rows_written,
            "commits": w.commits,
            "rows_buffered": w.buffered,
            **self.loop.health_detail(),
        }
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


def selected_tables(value: str) -> list[str]:
    names = [n.strip() for n in value.split(",") if n.strip()]
    known = {t.name for t in TABLES}
    bad = [n for n in names if n not in known]
    if bad or not names:
        raise ConfigError(
            f"--tables: unknown {', '.join(bad) or '(none given)'}; known: {', '.join(sorted(known))}"
        )
    return names


def run(args: argparse.Namespace) -> int:
    names = selected_tables(args.tables)
    if args.flush_rows < 1 or args.flush_interval <= 0:
        raise ConfigError("--flush-rows and --flush-interval must be greater than zero")
    lake_catalog.catalog_properties(args)  # config errors before any network
    extra = parse_kafka_overrides(args.kafka_config)
    bases = [t.topic for t in TABLES if t.name in names]
    spec = ServiceSpec.from_args(
        "lake",
        args,
        KafkaNeeds(
            args.bootstrap_servers,
            topics.ALL if args.create_topics else [*bases, topics.DEADLETTER],
            prefix=args.topic_prefix,
            create=args.create_topics,
            extra=extra,
        ),
    )
    return run_service(spec, lambda life: build(args, names, extra, life))


def build(args: argparse.Namespace, names: list[str], extra: dict[str, str], life: Lifecycle) -> LakeApp:
    cat = lake_catalog.open_catalog(args)
    chosen = [t for t in TABLES if t.name in names]
    tables = {
        topics.with_prefix(args.topic_prefix, t.topic): (t, open_table(cat, args.namespace, t))
        for t in chosen
    }
    registry = CollectorRegistry()
    writer = LakeWriter(
        tables, registry, flush_rows=args.flush_rows, flush_interval_s=args.flush_interval / 1000
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
    return LakeApp(writer, loop, registry)
