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

from gpupipe.clients.alertmanager import AlertmanagerSender
from gpupipe.common.argtypes import duration_ms, field_default, keyword_default
from gpupipe.common.errors import ConfigError
from gpupipe.domain import node_check
from gpupipe.domain.prices import PriceTable, load_price_table
from gpupipe.domain.teams import TeamMap, load_team_map
from gpupipe.kafka import topics
from gpupipe.kafka.acls import DEFAULT_GROUPS
from gpupipe.kafka.admin import parse_kafka_overrides
from gpupipe.lifecycle import service_flags, startup
from gpupipe.lifecycle.runner import KafkaNeeds, ServiceSpec, run_service
from gpupipe_consumers.recommend.detector import DetectorConfig
from gpupipe_consumers.recommend.rightsize import MIB, RightSizeConfig
from gpupipe_consumers.recommend.service import RecommendOptions, build

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
