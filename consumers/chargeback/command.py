"""Aggregate GPU time, energy and cost per namespace into event-time windows, exactly once.

Reads GpuSample records from gpu.samples.v1 in a consumer group and publishes ChargebackWindow
records to gpu.chargeback.v1: one per (window, namespace, node, GPU model) when a window closes
(its end plus --grace has passed in event time), and correction records for samples that arrive
later still. Output and consumed offsets commit in one Kafka transaction; after a crash the
open windows are rebuilt by replaying the input from the committed checkpoint, so every sample
is counted once. Instances in one group split the input partitions; give each a distinct
--instance-id (default: the host name), stable across its restarts.
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
from typing import Any

from gpupipe.common.argtypes import (
    ArgType,
    duration_ms,
    field_default,
    field_default_ms,
    positive_duration_ms,
)
from gpupipe.common.durations import format_duration_ms
from gpupipe.common.errors import ConfigError
from gpupipe.domain import node_check
from gpupipe.domain.price_schedule import PriceSchedule, load_price_schedule
from gpupipe.domain.prices import parse_price_table
from gpupipe.kafka import topics
from gpupipe.kafka.admin import parse_kafka_overrides
from gpupipe.lifecycle import service_flags, startup
from gpupipe.lifecycle.runner import KafkaNeeds, Lifecycle, ServiceSpec, run_service
from gpupipe_consumers.chargeback.accounting import AccountingConfig
from gpupipe_consumers.chargeback.identity import default_group_id
from gpupipe_consumers.chargeback.service import ChargebackService, ServiceConfig, build, check_topics
from gpupipe_consumers.chargeback.settings import ChargebackSettings
from gpupipe_schemas.validate import MAX_AGE_MS

USES_KAFKA = True

log = logging.getLogger("gpupipe.chargeback")

# The prices of deploy/prices.example.yaml, used when no --prices file is given (a warning says so).
EXAMPLE_PRICES: dict[str, Any] = {
    "currency": "USD",
    "energy_per_kwh": 0.14,
    "default_per_gpu_hour": 2.50,
    "models": [
        {"match": "NVIDIA H200", "per_gpu_hour": 4.10},
        {"match": "NVIDIA H100 80GB HBM3", "per_gpu_hour": 3.40},
        {"match": "NVIDIA H100*", "per_gpu_hour": 3.20},
        {"match": "NVIDIA A100*80GB*", "per_gpu_hour": 1.90},
        {"match": "NVIDIA A100*", "per_gpu_hour": 1.60},
        {"match": "NVIDIA L40S*", "per_gpu_hour": 1.10},
    ],
}


def _parse_skew(text: str) -> int | None:
    if text.strip().lower() in ("off", "none", "0"):
        return None
    return positive_duration_ms(text)


_skew = ArgType(_parse_skew, show=format_duration_ms)
"""A positive duration in milliseconds, or off (None)."""


def _parse_max_age(text: str) -> int:
    """A positive duration no longer than the contract's own bound on an event's age."""
    ms = positive_duration_ms(text)
    if ms > MAX_AGE_MS:
        raise argparse.ArgumentTypeError(
            f"must be at most {format_duration_ms(MAX_AGE_MS)} (older events are refused anyway), "
            f"got {format_duration_ms(ms)}"
        )
    return ms


_max_age = ArgType(_parse_max_age, show=format_duration_ms)
"""A positive duration in milliseconds, at most the contract's 400 days."""


_DAY_MS = 86_400_000


def _parse_window(text: str) -> int:
    """A window length that divides a day: windows are aligned to the epoch, so only those end on
    every midnight (UTC) and thus on every day and month boundary. A 7-day or 7-hour window would
    straddle a month end, and its usage could not be billed to either month whole."""
    ms = positive_duration_ms(text)
    if _DAY_MS % ms:
        raise argparse.ArgumentTypeError(
            f"must divide a day (e.g. 1m, 5m, 15m, 1h, 6h, 1d) so that no window straddles a "
            f"day or month boundary, got {format_duration_ms(ms)}"
        )
    return ms


_window = ArgType(_parse_window, show=format_duration_ms)
"""A positive duration in milliseconds that divides a day."""


def _positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {v}")
    return v


def _ratio(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number within 0..1, got {text!r}") from None
    if not 0 <= v <= 1:
        raise argparse.ArgumentTypeError(f"must be within 0..1, got {v}")
    return v


def default_instance_id() -> str:
    """The host name: a pod name in Kubernetes (stable per StatefulSet member), else the machine's."""
    return os.environ.get("HOSTNAME") or socket.gethostname() or "chargeback"


#: One line for `gpupipe --help`.
HELP = "aggregate GPU cost per namespace into windows"


def add_arguments(p: argparse.ArgumentParser) -> None:
    w = p.add_argument_group("windows and prices")
    w.add_argument(
        "--window",
        type=_window,
        default=field_default(ChargebackSettings, "window_ms"),
        help="tumbling event-time window, e.g. 1h, 10m; must divide a day, so that every window "
        "lies within one day and one month",
    )
    w.add_argument(
        "--grace",
        type=duration_ms,
        default=field_default(ChargebackSettings, "grace_ms"),
        help="how long after its end a window waits for late samples before it closes; later samples go "
        "into correction records",
    )
    w.add_argument(
        "--prices",
        default=None,
        metavar="FILE",
        help="price table YAML (default: the example prices of deploy/prices.example.yaml)",
    )
    w.add_argument(
        "--teams",
        default=None,
        metavar="FILE",
        help="namespace-to-team YAML; stamps each record's team (reports can map again at read time)",
    )
    w.add_argument(
        "--default-interval",
        type=positive_duration_ms,
        default=field_default(AccountingConfig, "default_interval_ms"),
        help="interval assumed for samples without interval_ms",
    )
    w.add_argument(
        "--idle-threshold",
        type=_ratio,
        default=field_default(AccountingConfig, "idle_activity_threshold"),
        help="activity below which allocated time counts as idle",
    )
    w.add_argument(
        "--max-clock-skew",
        type=_skew,
        default=field_default(ChargebackSettings, "max_clock_skew_ms"),
        help="samples stamped further ahead of their Kafka timestamp (broker time: the samples topic is "
        "created with LogAppendTime) are billed once, at that time, and counted ('off' disables)",
    )
    w.add_argument(
        "--max-sample-age",
        type=_max_age,
        default=field_default(ServiceConfig, "max_sample_age_ms"),
        help="a sample stamped further behind its Kafka timestamp is dead-lettered (reason too-old), "
        "never billed, so a period already invoiced stays closed; keep it above how long a node "
        "buffers samples while Kafka is away",
    )
    w.add_argument(
        "--late-run-gap",
        type=positive_duration_ms,
        default=field_default(ChargebackSettings, "late_run_gap_ms"),
        help="quiet time in record timestamps that ends a run of late samples, whose corrections then "
        "go out; keep it the same on every instance and re-processing run",
    )
    w.add_argument(
        "--max-gpus",
        type=int,
        default=field_default(ChargebackSettings, "max_gpus"),
        metavar="N",
        help="hold the reference samples of at most N GPUs per instance: a sample of another is "
        "dead-lettered (reason gpu-cap, counted), never dropped silently; a bound on what samples for "
        "made-up UUIDs can make the service hold",
    )
    w.add_argument(
        "--idle-timeout",
        type=_skew,
        default=300_000,
        help="a caught-up input partition that delivers nothing for this long has its event time "
        "advanced to broker time, so its last window closes and its checkpoint moves ('off' disables)",
    )
    k = p.add_argument_group("kafka")
    k.add_argument(
        "--group-id",
        default=None,
        help="consumer group; environments sharing a cluster never share the default one (default: <topic "
        "prefix>gpupipe-chargeback)",
    )
    k.add_argument(
        "--transactional-id",
        default=None,
        help="the producer's transactional.id (default: <group id>.<instance id>)",
    )
    k.add_argument(
        "--instance-id",
        default=None,
        help="this instance's id, unique in the group and stable across its restarts: the group.instance.id "
        "and the transactional.id suffix that fences a crashed predecessor (default: host name)",
    )
    k.add_argument(
        "--static-membership",
        action=argparse.BooleanOptionalAction,
        default=field_default(ServiceConfig, "static_membership"),
        help="join with group.instance.id so a restarted instance gets its partitions back without a "
        "rebalance (an instance that goes away for good releases its partitions only after "
        "session.timeout.ms)",
    )
    k.add_argument(
        "--commit-interval",
        type=positive_duration_ms,
        default=field_default_ms(ServiceConfig, "commit_interval_s"),
        help="commit a transaction this often; also the output latency",
    )
    k.add_argument(
        "--commit-records",
        type=_positive_int,
        default=field_default(ServiceConfig, "commit_records"),
        help="or after this many consumed records",
    )
    k.add_argument(
        "--batch-size",
        type=_positive_int,
        default=field_default(ServiceConfig, "batch_size"),
        help="records per consume() call",
    )
    k.add_argument(
        "--transaction-timeout",
        type=positive_duration_ms,
        default=field_default(ServiceConfig, "transaction_timeout_ms"),
        help="transaction.timeout.ms: how long a crashed instance's open transaction can block "
        "read_committed readers if no instance with its id comes back",
    )
    k.add_argument(
        "--start",
        choices=["earliest", "latest"],
        default=field_default(ServiceConfig, "start"),
        help="where a partition without a committed checkpoint starts (earliest: bill all retained samples)",
    )
    k.add_argument("--input-topic", default=None, help="override the samples topic (default: gpu.samples.v1)")
    k.add_argument(
        "--output-topic", default=None, help="override the output topic (default: gpu.chargeback.v1)"
    )
    service_flags.add_create_topics(k)
    ident = p.add_argument_group("node identity (which node wrote a sample)")
    service_flags.add_node_identity(
        ident, records="a sample's", refused="dead-letters a sample that fails the check, unbilled"
    )
    service_flags.add_listen(p)
    startup.add_arguments(p)


def load_prices(path: str | None) -> PriceSchedule:
    if path is None:
        log.warning("no --prices file: using the built-in example prices (deploy/prices.example.yaml)")
        table = parse_price_table(EXAMPLE_PRICES, "<built-in example prices>")
        return PriceSchedule((0,), (table,))
    return load_price_schedule(path)


def build_service(args: argparse.Namespace, extra: dict[str, str]) -> ChargebackService:
    prices = load_prices(args.prices)
    team_of = None
    if args.teams:
        from gpupipe.domain.teams import load_team_map

        team_of = load_team_map(args.teams).match
    if args.default_interval > 600_000:
        raise ConfigError("--default-interval must be at most 10m")
    if args.max_gpus < 1:
        raise ConfigError("--max-gpus must be at least 1")
    settings = ChargebackSettings(
        window_ms=args.window,
        grace_ms=args.grace,
        accounting=AccountingConfig(
            default_interval_ms=args.default_interval, idle_activity_threshold=args.idle_threshold
        ),
        max_clock_skew_ms=args.max_clock_skew,
        late_run_gap_ms=args.late_run_gap,
        max_gpus=args.max_gpus,
    )
    identity = node_check.from_args(args)  # a bad CA bundle: one line, before any network
    instance_id = args.instance_id or default_instance_id()
    cfg = ServiceConfig(
        bootstrap=args.bootstrap_servers,
        input_topic=args.input_topic or topics.with_prefix(args.topic_prefix, topics.SAMPLES),
        output_topic=args.output_topic or topics.with_prefix(args.topic_prefix, topics.CHARGEBACK),
        deadletter_topic=topics.with_prefix(args.topic_prefix, topics.DEADLETTER),
        group_id=args.group_id or default_group_id(args.topic_prefix),
        transactional_id_override=args.transactional_id,
        instance_id=instance_id,
        static_membership=args.static_membership,
        commit_interval_s=args.commit_interval / 1000.0,
        commit_records=args.commit_records,
        batch_size=args.batch_size,
        start=args.start,
        transaction_timeout_ms=args.transaction_timeout,
        idle_timeout_s=None if args.idle_timeout is None else args.idle_timeout / 1000.0,
        max_sample_age_ms=args.max_sample_age,
        extra=extra,
    )
    return build(
        cfg,
        settings,
        prices,
        team_of=team_of,
        schema_registry_url=args.schema_registry_url,
        identity=identity,
    )


def run(args: argparse.Namespace) -> int:
    extra = parse_kafka_overrides(args.kafka_config)
    service = build_service(args, extra)  # config errors (prices, teams, flags) before any network
    cfg = service.cfg
    overridden = [
        t for t, o in ((cfg.input_topic, args.input_topic), (cfg.output_topic, args.output_topic)) if o
    ]
    bases = [
        b for b, t in ((topics.SAMPLES, args.input_topic), (topics.CHARGEBACK, args.output_topic)) if not t
    ]
    spec = ServiceSpec.from_args(
        "chargeback",
        args,
        KafkaNeeds(
            args.bootstrap_servers,
            [*bases, topics.DEADLETTER],
            prefix=args.topic_prefix,
            create=args.create_topics,
            extra=extra,
            exact=overridden,
        ),
    )

    def ready(life: Lifecycle) -> ChargebackService:
        check_topics(args.bootstrap_servers, [cfg.input_topic, cfg.output_topic, cfg.deadletter_topic], extra)
        return service

    return run_service(spec, ready)
