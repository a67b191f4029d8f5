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
from collections.abc import Callable, Iterator
from datetime import UTC, tzinfo
from typing import Any, TextIO
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from gpupipe.common.argtypes import ArgType, positive_duration_ms
from gpupipe.common.errors import ConfigError
from gpupipe.common.logs import fields
from gpupipe.domain.teams import TeamMap, load_team_map
from gpupipe.kafka import topics
from gpupipe.kafka.admin import parse_kafka_overrides, wait_for_broker
from gpupipe_consumers.report.carbon import load_carbon_config
from gpupipe_consumers.report.chargeback_report import (
    CLOSE_MARGIN_MS,
    DIMENSIONS,
    PERIODS,
    build_report,
    open_billing_periods,
    parse_time_ms,
)
from gpupipe_consumers.report.errors import ReportOptionError
from gpupipe_consumers.report.formats import FORMATS, FocusOptions, iso, render_report
from gpupipe_consumers.report.reader import Deduplicator, deduplicated, iter_chargeback_records
from gpupipe_consumers.report.workload_report import build_workload_report, is_workload_dim, valid_dims
from gpupipe_schemas.codec import AvroCodec, codec_from_url

USES_KAFKA = True

log = logging.getLogger("gpupipe.report")


def _zone(text: str) -> tzinfo:
    """An IANA time zone (Area/City); UTC is the fast path of every period computation."""
    if text.strip().upper() in ("UTC", "Z", "ETC/UTC"):
        return UTC
    try:
        return ZoneInfo(text.strip())
    except (ZoneInfoNotFoundError, ValueError):
        raise argparse.ArgumentTypeError(f"not an IANA time zone (Area/City): {text!r}") from None


_zone_type = ArgType(_zone, show=str)


def _by(text: str) -> tuple[str, ...]:
    dims = tuple(d.strip() for d in text.split(",") if d.strip())
    bad = [d for d in dims if d not in DIMENSIONS and not is_workload_dim(d)]
    if not dims or bad or not valid_dims(dims):
        raise argparse.ArgumentTypeError(
            f"expected one or more of {', '.join(DIMENSIONS)} and at most one of owner, claim, label:<key>, "
            f"separated by commas, got {text!r}"
        )
    return dims


#: One line for `gpupipe --help`.
HELP = "print chargeback reports per namespace or team"


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
        help="group by namespace, team or node, and by owner, claim or label:<key> (the pods' top "
        "controller, the DRA ResourceClaim, a pod label); several with commas, e.g. team,node or "
        "namespace,owner",
    )
    p.add_argument(
        "--carbon",
        default=None,
        metavar="FILE",
        help="grid carbon intensity YAML (static gCO2e/kWh per zone, or a time series): adds CO2e columns",
    )
    p.add_argument("--format", choices=FORMATS, default="table", help="output format")
    p.add_argument("--teams", default=None, metavar="FILE", help="namespace-to-team mapping YAML")
    p.add_argument(
        "--period",
        choices=PERIODS,
        default="window",
        help="sum windows per window, hour, day, month (of --timezone) or over the whole range (all)",
    )
    p.add_argument(
        "--timezone",
        type=_zone_type,
        default=UTC,
        metavar="AREA/CITY",
        help="time zone of hour, day and month periods, of billing periods and of --from/--to "
        "without a zone, e.g. Europe/Berlin; times are still printed in UTC",
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
        type=positive_duration_ms,
        default=60_000,
        metavar="DURATION",
        help="give up if the end offsets are not reached in time (an open transaction holds "
        "read_committed readers until it ends)",
    )
    p.add_argument(
        "--invoice-lag",
        type=positive_duration_ms,
        default=86_400_000,
        help="FOCUS export: how long after a month ends its invoice is cut; records "
        "recorded later are billed in the month they were recorded in, as ChargeClass=Correction, "
        "and --from/--to select billing periods",
    )
    p.add_argument(
        "--provisional",
        action="store_true",
        help="FOCUS export: export billing periods that are not closed yet (chargeback has not "
        "written past their end plus --invoice-lag), marked x_Provisional=true; without it such "
        "an export is refused, so that every record is in exactly one final export",
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
    """Every committed ChargebackWindow record of ``topic`` (duplicates included), as a list."""
    records = iter_chargeback_records(
        bootstrap, topic, codec, extra=extra, timeout_s=timeout_s, on_bad=on_bad
    )
    return [rec for rec, _ in records]


def run(args: argparse.Namespace, out: TextIO | None = None, err: TextIO | None = None) -> int:
    out = out if out is not None else sys.stdout
    err = err if err is not None else sys.stderr
    tz: tzinfo = getattr(args, "timezone", UTC)
    start_ms = parse_time_ms(args.start, tz) if args.start else None
    end_ms = parse_time_ms(args.end, tz) if args.end else None
    if start_ms is not None and end_ms is not None and end_ms <= start_ms:
        raise ConfigError("--to must be after --from")
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
    dedup = Deduplicator()
    stream = iter_chargeback_records(
        args.bootstrap_servers,
        topic,
        codec,
        extra=extra,
        timeout_s=args.timeout / 1000,
        on_bad=on_bad,
        since_ms=start_ms,
        billing=args.format == "focus",  # far enough back to de-duplicate late copies (read_from_ms)
    )
    counted = 0
    newest: int | None = None  # the newest Kafka timestamp in the topic: what chargeback wrote last

    def watched() -> Iterator[tuple[dict[str, Any], int]]:
        nonlocal newest
        for rec, ts in stream:
            newest = ts if newest is None else max(newest, ts)
            yield rec, ts

    def counting() -> Iterator[dict[str, Any]]:
        nonlocal counted
        for rec in deduplicated(watched(), dedup):
            counted += 1
            yield rec

    if carbon is not None or any(is_workload_dim(d) for d in args.by) or teams.has_label_rules:
        rows = build_workload_report(
            counting(),
            by=args.by,
            teams=teams,
            start_ms=start_ms,
            end_ms=end_ms,
            period=args.period,
            split_corrections=args.split_corrections,
            carbon=carbon,
            billing_lag_ms=args.invoice_lag if args.format == "focus" else None,
            tz=tz,
        )
    else:
        rows = build_report(
            counting(),
            start_ms=start_ms,
            end_ms=end_ms,
            by=args.by,
            teams=teams,
            period=args.period,
            split_corrections=args.split_corrections,
            billing_lag_ms=args.invoice_lag if args.format == "focus" else None,
            tz=tz,
        )
    provisional = False
    if args.format == "focus":
        still_open = open_billing_periods(
            rows, end_ms=end_ms, newest_ms=newest, lag_ms=args.invoice_lag, tz=tz
        )
        if still_open:
            first_open = still_open[0]
            closes = iso(first_open[1] + args.invoice_lag + CLOSE_MARGIN_MS)
            line = (
                f"the billing period {iso(first_open[0])} to {iso(first_open[1])} is not closed: "
                f"chargeback has written nothing at or after {closes} "
                f"(its end plus --invoice-lag and {CLOSE_MARGIN_MS // 60_000} min) yet"
            )
            if not args.provisional:
                raise ReportOptionError(f"{line}; export closed periods only, or pass --provisional")
            provisional = True
            print(f"gpupipe report: provisional export: {line}", file=err)
    if dedup.dropped:
        print(
            f"gpupipe report: {dedup.dropped} re-emitted records counted once (same record_id)",
            file=err,
        )
    focus = FocusOptions(
        provider_name=args.focus_provider,
        billing_account_id=args.focus_account,
        provisional=provisional,
    )
    out.write(render_report(rows, args.format, focus=focus))
    out.flush()
    log.debug(
        "report done",
        extra=fields(
            records=counted,
            duplicates=dedup.dropped,
            rows=len(rows),
            skipped=bad,
            seconds=round(time.monotonic() - began, 3),
        ),
    )
    return 0
