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

from gpupipe.common.argtypes import duration_ms
from gpupipe.common.errors import ConfigError
from gpupipe.kafka import topics
from gpupipe.kafka.acls import DEFAULT_GROUPS
from gpupipe.kafka.admin import parse_kafka_overrides
from gpupipe.lifecycle import service_flags, startup
from gpupipe.lifecycle.runner import KafkaNeeds, ServiceSpec, run_service
from gpupipe_consumers.lake import catalog as lake_catalog
from gpupipe_consumers.lake.tables import BY_NAME, TABLES

USES_KAFKA = True

log = logging.getLogger("gpupipe.lake")

#: The buffers of all tables together (50,000 rows of 4 tables at 3-7 KB a row would be over 1 GB).
#: A commit converts a buffer to Arrow and Parquet, so the peak is about idle + 3x this: measured
#: 641 MiB with 45k samples and 45k 4 KB XIDs in one flush interval (1,502 MiB unbounded).
DEFAULT_BUFFER_BYTES = 128 * 2**20

#: One line for `gpupipe --help`.
HELP = "write the topics to Apache Iceberg tables, exactly once (the cold path)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    service_flags.add_listen(p)
    p.add_argument(
        "--group-id",
        default=DEFAULT_GROUPS["lake"],
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
        "--buffer-bytes",
        type=int,
        default=DEFAULT_BUFFER_BYTES,
        metavar="BYTES",
        help="commit the largest tables early once the buffers of all tables hold about this much memory",
    )
    p.add_argument(
        "--rebuild-catalog",
        action="store_true",
        help="recreate tables the catalog lost from what Kafka still holds (saying what it no longer "
        "holds); without it a lost table stops the writer with one line",
    )
    service_flags.add_create_topics(p)
    lake_catalog.add_arguments(p)
    startup.add_arguments(p)


def selected_tables(value: str) -> list[str]:
    names = [n.strip() for n in value.split(",") if n.strip()]
    known = set(BY_NAME)
    bad = [n for n in names if n not in known]
    if bad or not names:
        raise ConfigError(
            f"--tables: unknown {', '.join(bad) or '(none given)'}; known: {', '.join(sorted(known))}"
        )
    return names


def run(args: argparse.Namespace) -> int:
    names = selected_tables(args.tables)
    if args.flush_rows < 1 or args.flush_interval <= 0 or args.buffer_bytes < 1:
        raise ConfigError("--flush-rows, --flush-interval and --buffer-bytes must be greater than zero")
    lake_catalog.catalog_properties(args)  # config errors before any network
    extra = parse_kafka_overrides(args.kafka_config)
    bases = [BY_NAME[n].topic for n in names]
    spec = ServiceSpec.from_args(
        "lake",
        args,
        KafkaNeeds(
            args.bootstrap_servers,
            topics.to_prepare([*bases, topics.DEADLETTER], create=args.create_topics),
            prefix=args.topic_prefix,
            create=args.create_topics,
            extra=extra,
        ),
    )
    # Loaded only here: the parser loads every command module, and pyarrow with pyiceberg would add
    # about 110 MB and 0.6 s to every gpupipe process (a node agent's included).
    from gpupipe_consumers.lake.service import build

    return run_service(spec, lambda life: build(args, names, extra, life))
