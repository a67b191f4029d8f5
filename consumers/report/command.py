"""Print a chargeback report from gpu.chargeback.v1: per namespace or team, as a table, CSV, JSON or FOCUS.

Reads the whole topic with read_committed isolation (only what chargeback transactions committed),
without a consumer group, up to the end offsets it sees when it starts, and sums the partial
records of every partition, instance and correction per window (or per --period). --from/--to
select windows by their start time (ISO 8601; a date or time without a zone is UTC). A --teams
file maps namespaces to teams (globs, first match wins); unmapped namespaces are their own team,
and __unallocated__ (capacity no pod held) and __mig_shared__ (energy of MIG-mode GPUs) always
show as themselves. Costs are in the currency of the price table chargeback ran with.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
import uuid
from collections.abc import Callable
from typing import Any, TextIO

from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, KafkaException, TopicPartition

from consumers.report.carbon import load_carbon_config
from consumers.report.chargeback_report import DIMENSIONS, PERIODS, build_report, parse_time_ms
from consumers.report.formats import FORMATS, FocusOptions, render_report
from consumers.report.teams import TeamMap, load_team_map
from consumers.report.workload_report import build_workload_report, is_workload_dim, valid_dims
from gpupipe import topics
from gpupipe.errors import ConfigError, GpupipeError
from gpupipe.kafka_admin import client_config, parse_kafka_overrides, wait_for_broker
from gpupipe.logs import fields
from schemas.codec import AvroCodec, codec_from_url
from schemas.errors import DecodeError

USES_KAFKA = True

log = logging.getLogger("gpupipe.report")


def _by(text: str) -> tuple[str, ...]:
    dims = tuple(d.strip() for d in text.split(",") if d.strip())
    bad = [d for d in dims if d not in DIMENSIONS and not is_workload_dim(d)]
    if not dims or bad or not valid_dims(dims):
        raise argparse.ArgumentTypeError(
            f"expected one or more of {', '.join(DIMENSIONS)} and at most one of owner, label:<key>, "
            f"separated by commas, got {text!r}"
        )
    return dims


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--from",
        dest="start",
        default=None,
        metavar="ISO",
        help="first window start to include, e.g. 2026-11-01 or 2026-11-01T08:00Z (default: all)",
    )
    p.add_argument(
        "--to",
        dest="end",
        default=None,
        metavar="ISO",
        help="windows starting at or after this are left out (default: all)",
    )
    p.add_argument(
        "--by",
        type=_by,
        default=("namespace",),
        help="group by namespace (default), team or node, and by owner or label:<key> (the pods' top "
        "controller, a pod label); several with commas, e.g. team,node or namespace,owner",
    )
    p.add_argument(
        "--carbon",
        default=None,
        metavar="FILE",
        help="grid carbon intensity YAML (static gCO2e/kWh per zone, or a time series): adds CO2e columns",
    )
    p.add_argument("--format", choices=FORMATS, default="table", help="output format (default table)")
    p.add_argument("--teams", default=None, metavar="FILE", help="namespace-to-team mapping YAML")
    p.add_argument(
        "--period",
        choices=PERIODS,
        default="window",
        help="sum windows per window (default), hour, day, month (UTC) or over the whole range (all)",
    )
    p.add_argument(
        "--split-corrections",
        action="store_true",
        help="show corrections (samples later than the grace period) as rows of their own",
    )
    p.add_argument(
        "--topic", default=None, help="read this topic instead of gpu.chargeback.v1 (with the topic prefix)"
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=60.0,
        metavar="SECONDS",
        help="give up if the end offsets are not reached in time (an open transaction holds "
        "read_committed readers until it ends) (default 60)",
    )
    p.add_argument("--focus-provider", default="gpupipe", help="FOCUS ProviderName/InvoiceIssuerName")
    p.add_argument("--focus-account", default="gpupipe", help="FOCUS BillingAccountId")


def read_chargeback_records(
    bootstrap: str,
    topic: str,
    codec: AvroCodec,
    *,
    extra: dict[str, str] | None = None,
    timeout_s: float = 60.0,
    on_bad: Callable[[str], None] | None = None,
) -> list[dict[str, Any]]:
    """Every committed ChargebackWindow record of ``topic`` up to the end offsets seen at the start."""
    consumer = Consumer(
        client_config(
            bootstrap,
            extra,
            **{
                "group.id": f"gpupipe-report-{uuid.uuid4()}",
                "enable.auto.commit": False,
                "enable.auto.offset.store": False,
                "isolation.level": "read_committed",
                "enable.partition.eof": True,
                "auto.offset.reset": "earliest",
            },
        )
    )
    out: list[dict[str, Any]] = []
    try:
        md = consumer.list_topics(topic, timeout=10)
        tmd = md.topics.get(topic)
        if tmd is None or tmd.error is not None:
            raise ConfigError(f"topic {topic} does not exist (has chargeback run with this --topic-prefix?)")
        ends: dict[int, int] = {}
        assign = []
        for part in sorted(tmd.partitions):
            low, high = consumer.get_watermark_offsets(TopicPartition(topic, part), timeout=10)
            if high > low:
                ends[part] = high
                assign.append(TopicPartition(topic, part, OFFSET_BEGINNING))
        if not assign:
            return out
        consumer.assign(assign)
        pending = set(ends)
        deadline = time.monotonic() + timeout_s
        decode = codec.decode
        while pending:
            if time.monotonic() > deadline:
                where = ", ".join(f"[{p}] (end {ends[p]})" for p in sorted(pending))
                raise GpupipeError(
                    f"timed out after {timeout_s:g}s reading {topic} partitions {where}: an open "
                    "transaction of a crashed chargeback instance blocks read_committed readers until "
                    "the instance restarts or its transaction times out; retry, or raise --timeout"
                )
            for msg in consumer.consume(1000, 0.5):
                err = msg.error()
                part = msg.partition()
                if err is not None:
                    if err.code() == KafkaError._PARTITION_EOF:
                        if msg.offset() >= ends.get(part, 0):
                            pending.discard(part)
                    elif err.fatal():
                        raise GpupipeError(f"reading {topic}: {err.str()}")
                    continue
                if part not in ends or msg.offset() >= ends[part]:
                    pending.discard(part)
                    continue
                try:
                    d = decode(msg.value())
                except DecodeError as exc:
                    if on_bad:
                        on_bad(
                            f"{topic}[{part}]@{msg.offset()}: not a ChargebackWindow record ({exc.reason})"
                        )
                    continue
                if d.name == "ChargebackWindow":
                    out.append(d.record)
                if msg.offset() + 1 >= ends[part]:
                    pending.discard(part)
    except KafkaException as exc:
        raise GpupipeError(f"reading {topic}: {exc.args[0].str()}") from exc
    finally:
        consumer.close()
    return out


def run(args: argparse.Namespace, out: TextIO | None = None, err: TextIO | None = None) -> int:
    out = out if out is not None else sys.stdout
    err = err if err is not None else sys.stderr
    start_ms = parse_time_ms(args.start) if args.start else None
    end_ms = parse_time_ms(args.end) if args.end else None
    if start_ms is not None and end_ms is not None and end_ms <= start_ms:
        raise ConfigError("--to must be after --from")
    if args.timeout <= 0:
        raise ConfigError("--timeout must be greater than zero")
    teams = load_team_map(args.teams) if args.teams else TeamMap()
    carbon = load_carbon_config(args.carbon).co2e_kg if getattr(args, "carbon", None) else None
    extra = parse_kafka_overrides(args.kafka_config)
    wait_for_broker(args.bootstrap_servers, extra=extra)
    topic = topics.with_prefix(args.topic_prefix, args.topic or topics.CHARGEBACK)
    codec = codec_from_url(args.schema_registry_url)
    bad = 0

    def on_bad(line: str) -> None:
        nonlocal bad
        bad += 1
        print(f"gpupipe report: {line}", file=err)

    began = time.monotonic()
    records = read_chargeback_records(
        args.bootstrap_servers, topic, codec, extra=extra, timeout_s=args.timeout, on_bad=on_bad
    )
    if carbon is not None or any(is_workload_dim(d) for d in args.by) or teams.has_label_rules:
        rows = build_workload_report(
            records,
            by=args.by,
            teams=teams,
            start_ms=start_ms,
            end_ms=end_ms,
            period=args.period,
            split_corrections=args.split_corrections,
            carbon=carbon,
        )
    else:
        rows = build_report(
            records,
            start_ms=start_ms,
            end_ms=end_ms,
            by=args.by,
            teams=teams,
            period=args.period,
            split_corrections=args.split_corrections,
        )
    focus = FocusOptions(provider_name=args.focus_provider, billing_account_id=args.focus_account)
    out.write(render_report(rows, args.format, focus=focus))
    out.flush()
    log.debug(
        "report done",
        extra=fields(
            records=len(records), rows=len(rows), skipped=bad, seconds=round(time.monotonic() - began, 3)
        ),
    )
    return 0
