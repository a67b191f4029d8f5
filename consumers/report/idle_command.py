"""Print the top idle-GPU wasters from gpu.recommendations.v1, per team, namespace, owner or pod.

Reads the whole topic (no consumer group, read_committed, up to the end offsets seen at start),
keeps each recommendation's latest revision, and keeps those whose idle streak lasted into the
last --since (a duration such as 7d, or an ISO date). Costs are the GPU-hour prices the recommend
service ran with; the waste is already in the chargeback bill (idle allocated time), so this report
says where it went and what to do about it.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import TextIO

from gpupipe.common.argtypes import positive_duration_ms
from gpupipe.common.durations import parse_duration_ms
from gpupipe.common.errors import ConfigError
from gpupipe.domain.teams import TeamMap, load_team_map
from gpupipe.kafka import topics
from gpupipe.kafka.admin import parse_kafka_overrides, wait_for_broker
from gpupipe_consumers.plumbing.topic_reader import read_topic
from gpupipe_consumers.report.chargeback_report import parse_time_ms
from gpupipe_consumers.report.formats import FORMATS, FocusOptions
from gpupipe_consumers.report.idle_html import render_idle_html
from gpupipe_consumers.report.idle_report import IDLE_DIMENSIONS, build_idle_report, render_idle, selected
from gpupipe_schemas.codec import codec_from_url

USES_KAFKA = True


#: One line for `gpupipe --help`.
HELP = "print the top idle-GPU wasters per team or owner"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--since",
        default="7d",
        help="streaks that lasted into this recent period: a duration (7d, 12h) or an ISO date",
    )
    p.add_argument("--by", choices=IDLE_DIMENSIONS, default="team", help="group by")
    p.add_argument("--format", choices=FORMATS, default="table", help="output format")
    p.add_argument("--teams", default=None, metavar="FILE", help="team mapping YAML (as report chargeback)")
    p.add_argument("--top", type=int, default=0, metavar="N", help="only the N largest wasters (0: all)")
    p.add_argument("--topic", default=None, help="read this topic instead of gpu.recommendations.v1")
    p.add_argument(
        "--timeout",
        type=positive_duration_ms,
        default=60_000,
        metavar="DURATION",
        help="give up if the end offsets are not reached in time",
    )
    p.add_argument("--focus-provider", default="gpupipe", help="FOCUS ProviderName")


def since_ms(text: str, now_ms: int) -> int:
    """``7d`` -> now - 7 days; an ISO date or time -> that instant."""
    try:
        return now_ms - parse_duration_ms(text)
    except (ValueError, ConfigError):
        return parse_time_ms(text)


def run(args: argparse.Namespace, out: TextIO | None = None, err: TextIO | None = None) -> int:
    out = out if out is not None else sys.stdout
    err = err if err is not None else sys.stderr
    if args.top < 0:
        raise ConfigError("--top must not be negative")
    cutoff = since_ms(args.since, int(time.time() * 1000))
    teams = load_team_map(args.teams) if args.teams else TeamMap()
    extra = parse_kafka_overrides(args.kafka_config)
    wait_for_broker(args.bootstrap_servers, extra=extra)
    topic = topics.with_prefix(args.topic_prefix, args.topic or topics.RECOMMENDATIONS)
    records = read_topic(
        args.bootstrap_servers,
        topic,
        codec_from_url(args.schema_registry_url),
        "GpuRecommendation",
        extra=extra,
        timeout_s=args.timeout / 1000,
        on_bad=lambda line: print(f"gpupipe report: {line}", file=err),
    )
    rows = build_idle_report(
        records,
        by=args.by,
        since_ms=cutoff,
        team_of=lambda ns, labels: teams.match(ns, labels),
        top=args.top or None,
    )
    if args.format == "html":
        out.write(render_idle_html(rows, selected(records, cutoff), since_ms=cutoff))
    else:
        out.write(render_idle(rows, args.format, focus=FocusOptions(provider_name=args.focus_provider)))
    out.flush()
    return 0
